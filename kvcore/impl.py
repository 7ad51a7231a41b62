"""The per-layer half of the backend contract: :class:`AttentionImpl`, whose ``forward`` and
``do_kv_cache_update`` are templates around a backend's two kernel hooks, and
:class:`PagedAttentionImpl`, the impl over two ops with :mod:`kvcore.ops`' signatures.

The template is what vLLM's attention layer does around an impl that declares
``accept_output_buffer = True`` and ``forward_includes_kv_cache_update = False``: the engine
writes the step's K/V first (:meth:`AttentionImpl.do_kv_cache_update`), then
:meth:`AttentionImpl.forward` checks the arguments, applies the encoder-only rule, allocates
the output when none is given, returns at once on an empty batch, and hands the backend's
kernel hook (:meth:`AttentionImpl.attend`) the rows that are real tokens and the output rows
to fill. A backend writes only its kernel calls: :meth:`AttentionImpl.write_kv_cache` and
:meth:`AttentionImpl.attend`. What its builder planned for the step (split counts, a library's
plan, workspaces) is a typed field of the metadata class that builder returns; ``attend``
receives the step's metadata and reads its own plan there.
"""

from __future__ import annotations

import functools
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kvcore.metadata import AttentionLayer, AttentionMetadata, encoder_only_cache, is_index
from kvcore.platform_types import AttentionType

__all__ = ["AttentionImpl", "KVSplit", "PagedAttentionImpl"]


class AttentionImpl(ABC):
    """Per-layer state of a backend and the two calls an engine makes every step.

    Shapes: ``query`` is ``(num_tokens, num_heads, head_size)``; ``key``/``value`` are
    ``(num_tokens, num_kv_heads, head_size)``; ``kv_cache`` is the layer's logical view from
    :func:`kvcore.allocate_kv_caches` (for K/V backends ``(num_blocks, 2, block_size,
    num_kv_heads, head_size)`` of any strides).

    The engine calls :meth:`do_kv_cache_update` then :meth:`forward` (or both at once:
    :meth:`update_and_forward`); both are templates. A backend implements
    :meth:`write_kv_cache` and :meth:`attend` (its kernels), and where it needs them
    :meth:`check_forward` (checks its kernels cannot make themselves) and :meth:`new_output`
    (an output whose shape is not the query's).
    """

    #: vLLM's name for what :meth:`forward` does: it takes the caller's ``output`` buffer
    #: and writes the result into it (allocating one only when none is given).
    accept_output_buffer: bool = True
    #: vLLM's name for the cache-write contract: ``forward`` never writes the step's K/V;
    #: the engine calls :meth:`do_kv_cache_update` before it.
    forward_includes_kv_cache_update: bool = False
    #: The backend whose feature declarations (``SUPPORTS_SINK``,
    #: ``SUPPORTS_LOGITS_SOFT_CAP``) this impl honours: set on the class by the first
    #: :class:`kvcore.AttentionBackend` subclass that names it as ``IMPL_CLS``; a backend that
    #: reuses the class with other declarations gets a subclass of it bound to itself (its
    #: ``get_impl_cls()``). ``None`` (no backend named it): the impl takes neither ``sinks``
    #: nor ``logits_soft_cap``.
    BACKEND: ClassVar[Any] = None

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        attn_type: AttentionType | str = AttentionType.DECODER,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The layer's shape and features, as vLLM's ``AttentionImpl`` takes them.

        ``logits_soft_cap``: scores (already scaled) become ``cap * tanh(score / cap)``
        before masking and the softmax (Gemma 2); ``sinks``: ``(num_heads,)`` floating, one
        learned logit per query head that joins each row's softmax denominator and adds no
        value (gpt-oss). Either needs a backend that declares it (``SUPPORTS_LOGITS_SOFT_CAP``,
        ``SUPPORTS_SINK``); :attr:`attention_features` is what reaches the kernels.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
            )
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not is_index(sliding_window)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1 "
                             "(how many positions each query sees, itself included)")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale={scale!r} must be a finite, positive float "
                             "(usually head_size ** -0.5)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = None if sliding_window is None else operator.index(sliding_window)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = AttentionType(attn_type)
        self.logits_soft_cap = _check_soft_cap(logits_soft_cap)
        self.sinks = _check_sinks(sinks, num_heads)
        #: The keyword arguments this layer's features add to the attention op's call
        #: (``logits_soft_cap``, ``sinks``; empty for a layer without them, so ops that take
        #: neither keep working).
        self.attention_features: dict[str, Any] = {}
        for name, value, attr, feature in (
                ("logits_soft_cap", self.logits_soft_cap, "SUPPORTS_LOGITS_SOFT_CAP",
                 "logit soft-capping"),
                ("sinks", self.sinks, "SUPPORTS_SINK", "attention sinks")):
            if value is None:
                continue
            backend = type(self).BACKEND
            if backend is None or not getattr(backend, attr, False):
                owner = (f"{type(self).__name__} (backend {backend.get_name()})"
                         if backend is not None else type(self).__name__)
                shown = f"{value:g}" if name == "logits_soft_cap" else (
                    f"a tensor of shape {tuple(value.shape)}")
                raise NotImplementedError(
                    f"{name}={shown}: {owner} does not support {feature} (its backend does "
                    f"not declare {attr}); choose a backend that does (kvcore select "
                    f"{'--soft-cap' if name == 'logits_soft_cap' else '--sink'} --explain "
                    "lists them)")
            self.attention_features[name] = value

    def is_causal(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether this layer masks each query to the keys at or before its position.

        The one causal rule of every backend: the step's metadata asks for it
        (:attr:`AttentionMetadata.causal`) and the layer is a decoder; an encoder-only layer
        sees every key of its request.
        """
        return attn_metadata.causal and self.attn_type == AttentionType.DECODER

    def writes_kv_cache(self) -> bool:
        """Whether :meth:`do_kv_cache_update` writes anything: the one cache-write rule of
        every backend. An encoder-only layer keeps nothing across steps, so it never writes
        the paged cache (its ``forward`` attends over the step's own ``key``/``value``,
        through :func:`kvcore.encoder_only_cache`)."""
        return self.attn_type != AttentionType.ENCODER_ONLY

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the new tokens' K and V into ``kv_cache`` at ``slot_mapping`` (negative: skip):
        :meth:`write_kv_cache`, for a layer that :meth:`writes_kv_cache`."""
        if self.writes_kv_cache():
            self.write_kv_cache(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over the paged cache (already updated for this step).

        Returns ``(num_tokens, num_heads, head_size)`` (:meth:`new_output`'s shape), written
        into ``output`` when given; rows past ``attn_metadata.num_actual_tokens`` are padding
        and are left untouched. In order: :meth:`check_forward`; for an encoder-only layer, a
        private cache of this step's ``key``/``value`` written by :meth:`write_kv_cache`
        (:func:`kvcore.encoder_only_cache`); the output; nothing more for an empty batch;
        else :meth:`attend` on the real rows.
        """
        self.check_forward(query, kv_cache, attn_metadata, output)
        if not self.writes_kv_cache():
            kv_cache, attn_metadata = encoder_only_cache(
                key, value, kv_cache, attn_metadata, functools.partial(self.write_kv_cache, layer))
        if output is None:
            output = self.new_output(query)
        n = attn_metadata.num_actual_tokens
        if n:  # views of the real rows only where there are padding rows
            self.attend(layer, query if query.shape[0] == n else query[:n], kv_cache,
                        attn_metadata, output if output.shape[0] == n else output[:n])
        return output

    def update_and_forward(self, layer: AttentionLayer, query: torch.Tensor,
                           key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           attn_metadata: AttentionMetadata,
                           output: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`do_kv_cache_update` at ``attn_metadata.slot_mapping``, then :meth:`forward`:
        a layer's whole step in one call, which a backend may do with one set of checks and
        views (``kvcore.TritonAttentionImpl``'s does). Same arguments, result and errors as
        the two calls."""
        self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
        return self.forward(layer, query, key, value, kv_cache, attn_metadata, output)

    @abstractmethod
    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The backend's cache write (kernel hook): token ``i`` of ``key``/``value`` into slot
        ``slot_mapping[i]`` of ``kv_cache`` (negative: skip; fp8 caches scaled by
        ``layer.k_scale``/``layer.v_scale``). Called for every layer that writes the cache,
        and on an encoder-only layer's private cache."""

    @abstractmethod
    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        """The backend's attention (kernel hook): write the attention of ``query`` into
        ``output``.

        ``query`` and ``output`` hold the step's ``num_actual_tokens`` real rows (at least
        one); ``kv_cache`` and ``attn_metadata`` are the layer's (an encoder-only layer's
        private ones). ``attn_metadata`` is what the backend's builder returned (its typed plan
        included) or plain :class:`~kvcore.AttentionMetadata` from an engine or test without
        the builder: then the kernels choose for themselves. Must not write ``kv_cache``.
        """

    def check_forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      attn_metadata: AttentionMetadata, output: torch.Tensor | None) -> None:
        """Refuse arguments the kernels would misread, before anything runs (hook; the
        default checks nothing, for kernels that check their own arguments). Raise with the
        argument, its value, what is supported and the fix."""
        return  # nothing to check by default

    def new_output(self, query: torch.Tensor) -> torch.Tensor:
        """The output :meth:`forward` allocates when none is given: ``query``'s shape and
        dtype (hook: an impl whose output has another shape, MLA's, overrides it)."""
        return torch.empty_like(query)


class KVSplit:
    """A layer's K and V cache views, kept for the last cache it split.

    :meth:`split` returns ``(key_cache, value_cache)``, :meth:`halves` of ``kv_cache``, and
    while the same tensor comes again with the same address, shape, strides, dtype and device
    (an engine passes one cache per layer every step) it returns the same tuple of the same
    view objects: no views are made per call, and ops that find their checks by the view
    objects (``kvcore.ops.reshape_and_cache``, ``kvcore.ops.paged_attention``) find them.
    Another cache, or this one changed in place (``resize_``, ``set_``, ``.data =``), gets
    new views. The kept views hold that one cache alive until another comes (a view holds
    its base, so a weak reference would not free it either).

    An impl keeps one per layer as its ``split_kv``, as :class:`PagedAttentionImpl` does::

        @functools.cached_property
        def split_kv(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
            return KVSplit().split

    (the bound method lands in the instance on first use, so each later ``split_kv`` call
    is one call of :meth:`split`). For another layout subclass it and override
    :meth:`halves`.
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        #: The last cache split: ``(kv_cache, address, shape, strides, dtype, device,
        #: halves)``; empty before the first.
        self._seen: tuple = ()

    def split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)`` of ``kv_cache`` (:meth:`halves`), the kept ones
        while ``kv_cache`` is the last cache split and unchanged."""
        seen = self._seen
        if (seen and seen[0] is kv_cache and kv_cache.data_ptr() == seen[1]
                and kv_cache.stride() == seen[3] and kv_cache.shape == seen[2]
                and kv_cache.dtype is seen[4] and kv_cache.device == seen[5]):
            return seen[6]
        halves = self.halves(kv_cache)
        self._seen = (kv_cache, kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(),
                      kv_cache.dtype, kv_cache.device, halves)
        return halves

    def halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V views of a new cache (hook): ``kv_cache.unbind(1)``, the
        ``(num_blocks, block_size, num_kv_heads, head_size)`` halves of the standard
        ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` cache. Raise here to refuse
        a cache of another shape."""
        return kv_cache.unbind(1)


class PagedAttentionImpl(AttentionImpl):
    """An :class:`AttentionImpl` over two ops with the signatures of :mod:`kvcore.ops`.

    Subclasses set :meth:`reshape_and_cache` (``kvcore.ops.reshape_and_cache``'s signature)
    and :meth:`paged_attention` (``kvcore.ops.paged_attention``'s) and get the kernel hooks on
    the standard ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` cache split with
    ``unbind(1)`` (:meth:`split_kv`; override it for another layout), output written in place.
    An op that takes a plan from the backend's builder is called by the backend's own
    :meth:`attend` (``kvcore.TritonAttentionImpl``'s hands ``paged_attention`` its ``plan``).
    """

    @functools.cached_property
    def split_kv(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``split_kv(kv_cache)``: the K and V ``(num_blocks, block_size, num_kv_heads,
        head_size)`` views, kept per layer by a :class:`KVSplit` (the same view objects while
        the layer's cache is the same; the ops find their checks by them). Override it for
        another layout, with a :class:`KVSplit` subclass or a method."""
        return KVSplit().split

    @staticmethod
    @abstractmethod
    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                          k_scale, v_scale) -> None:
        """Scatter new tokens into the K and V caches (see ``kvcore.ops.reshape_and_cache``)."""

    @staticmethod
    @abstractmethod
    def paged_attention(query, key_cache, value_cache, **kwargs) -> torch.Tensor:
        """Paged attention with ``kvcore.ops.paged_attention``'s keyword arguments."""

    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = self.split_kv(kv_cache)
        self.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                               self.kv_cache_dtype, layer.k_scale, layer.v_scale)

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        m = attn_metadata
        key_cache, value_cache = self.split_kv(kv_cache)
        self.paged_attention(query, key_cache, value_cache, query_start_loc=m.query_start_loc,
                             seq_lens=m.seq_lens, block_table=m.block_table, scale=self.scale,
                             causal=self.is_causal(m), sliding_window=self.sliding_window,
                             kv_cache_dtype=self.kv_cache_dtype, k_scale=layer.k_scale,
                             v_scale=layer.v_scale, output=output, **self.attention_features)


def _check_soft_cap(cap: object) -> float | None:
    """``cap`` as a float (``None`` stays ``None``), or ``ValueError``."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (
            math.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap={cap!r} must be None or a finite float > 0 (scores "
                         "become cap * tanh(score / cap); Gemma 2 uses 50.0)")
    return float(cap)


def _check_sinks(sinks: object, num_heads: int) -> torch.Tensor | None:
    """``sinks`` checked as ``(num_heads,)`` floating (``None`` stays ``None``)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a torch.Tensor of shape (num_heads,) = "
                        f"({num_heads},), got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != num_heads or not sinks.is_floating_point():
        raise ValueError(f"sinks has shape {tuple(sinks.shape)} and dtype {sinks.dtype}; it "
                         f"must be 1-D of length num_heads={num_heads} (one sink logit per "
                         "query head of this rank), floating point (float32 as vLLM passes it)")
    return sinks
