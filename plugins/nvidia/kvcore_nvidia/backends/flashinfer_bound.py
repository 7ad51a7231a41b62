"""A planned FlashInfer wrapper's ``run`` with its Python work done once per plan.

FlashInfer's ``run`` (decode or prefill wrapper) spends most of its host time before the
kernel: it unpacks the cache, checks dtypes and shapes, reads the plan's attributes, derives
the softmax scale and builds an argument list of some forty entries for its compiled module's
``run`` / ``paged_run``. For one plan those arguments are the same on every layer of a step
but for the query, the two cache halves and the output. :class:`BoundRun` records the list
once (``wrapper.run`` called with a stand-in module that only records, so FlashInfer's own
code builds it, whatever its version) and then calls the compiled module straight with the
layer's four tensors in their places: FlashInfer's kernel with FlashInfer's arguments, without
repeating the Python around it.

A recording is refused (the call then goes through ``wrapper.run``, as before) unless the
wrapper made exactly one call of its compiled module, with positional arguments only, in
which the layer's query, key cache, value cache and output each appear once as themselves
(not as a copy or a view: FlashInfer's trtllm-gen path transposes an NHD cache, for one).
A value scale other than 1 is never bound: FlashInfer applies it to the output after the
kernel, outside the recorded call. A recording belongs to one plan: the wrapper's
``_plan_info`` (a new object from every ``plan``) is compared by identity on every call, so
a wrapper planned again is recorded again.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BoundRun"]


class _RecordingModule:
    """Stands in for a wrapper's compiled module during one ``run``: records each call
    (method name, positional and keyword arguments) and launches nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, args, kwargs))

        return record


class BoundRun:
    """One planned wrapper's ``run`` for the tensors of any layer of the plan's steps (see
    the module docstring); ``None`` attributes mean the recording was refused and ``run``
    goes through ``wrapper.run``.

    Call it as ``bound(query, (key_cache, value_cache), output)``: the same tensors
    ``wrapper.run(query, (key_cache, value_cache), out=output, **scales)`` takes, with the
    shapes, dtypes and device the recording was made with (the caller's checks guarantee
    them) and the scales it was bound for.
    """

    __slots__ = ("_args", "_fn", "_plan_info", "_scales", "_slots", "_wrapper")

    def __init__(self, wrapper: Any, query: torch.Tensor, kv: tuple[torch.Tensor, ...],
                 output: torch.Tensor, scales: dict[str, float]) -> None:
        """Record ``wrapper.run(query, kv, out=output, **scales)`` (no kernel runs)."""
        self._wrapper, self._scales = wrapper, scales
        self._plan_info = getattr(wrapper, "_plan_info", None)
        self._fn = self._args = self._slots = None
        if scales.get("v_scale", 1.0) != 1.0 or not hasattr(wrapper, "_cached_module"):
            return
        module = wrapper._cached_module
        recorder = _RecordingModule()
        wrapper._cached_module = recorder
        try:
            wrapper.run(query, kv, out=output, **scales)
        finally:
            wrapper._cached_module = module
        if len(recorder.calls) != 1:
            return
        name, args, kwargs = recorder.calls[0]
        slots = tuple(_only_place(args, t) for t in (query, kv[0], kv[1], output))
        if kwargs or None in slots or not callable(getattr(module, name, None)):
            return
        self._fn, self._args, self._slots = getattr(module, name), list(args), slots

    @property
    def bound(self) -> bool:
        """Whether calls go straight to the compiled module (else through ``wrapper.run``)."""
        return self._fn is not None

    def current(self, wrapper: Any) -> bool:
        """Whether this recording is of ``wrapper``'s current plan."""
        return self._wrapper is wrapper and getattr(wrapper, "_plan_info", None) is \
            self._plan_info

    def __call__(self, query: torch.Tensor, kv: tuple[torch.Tensor, ...],
                 output: torch.Tensor) -> None:
        fn = self._fn
        if fn is None:
            self._wrapper.run(query, kv, out=output, **self._scales)
            return
        args = self._args
        q_at, k_at, v_at, out_at = self._slots
        args[q_at], args[k_at], args[v_at], args[out_at] = query, kv[0], kv[1], output
        try:
            fn(*args)
        finally:
            # Hold no layer's tensors between calls.
            args[q_at] = args[k_at] = args[v_at] = args[out_at] = None


def _only_place(args: tuple, tensor: torch.Tensor) -> int | None:
    """The one index of ``args`` that holds ``tensor`` itself, else ``None``."""
    places = [i for i, a in enumerate(args) if a is tensor]
    return places[0] if len(places) == 1 else None
