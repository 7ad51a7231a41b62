"""Launching a Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` binds the arguments, computes each one's specialisation
(dtype, 16-byte alignment, integer width, ``== 1``), builds a cache key from them and the
options, looks the compiled kernel up and only then launches: tens of microseconds of host
time per call, paid per kernel, layer and step. :class:`KernelLaunch` is one call site's
launch with its constexprs and options fixed. Its caller knows which arguments change
between calls and gives their classes as a small key (:func:`ptr_class` of the tensors,
:func:`int_class` of the changing ints); the first launch per key goes through
``kernel[grid]`` (which compiles or finds the kernel) and keeps the ``CompiledKernel`` it
returns; later launches with that key call the kernel's launcher directly with the argument
tuple Triton itself would pass.

The direct launch is taken only where it is known to be what Triton does: NVIDIA GPUs (AMD's
specialisation also depends on a tensor's size), a compiled (not interpreted) kernel, no
launch hooks installed (profilers), no launch being recorded
(:func:`kvcore.ops.triton_utils.recording_launches`); else every call is ``kernel[grid]``.
Triton's ``CompiledKernel.run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)`` is the same in Triton 3.4 to 3.9.

Public API for plugins (like :mod:`kvcore.ops.triton_utils`): a plugin's op makes one
:class:`KernelLaunch` per call site and choice of constexprs (kept per layer or per cache, or
made anew per step: the compiled kernels are shared through a process-wide table), passes
its arguments positionally in the kernel's order, and keys each call by what it lets change:
``ptr_class`` of each tensor that may move, with its dtype where that may change,
``int_class`` (or the value) of each int that may change. ``launch_counts`` lets a test check
that many calls of one shape compile and bind nothing more.

This module imports triton; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

from kvcore.ops.triton_utils import recording_launches

__all__ = ["KernelLaunch", "LaunchCounts", "arg_class", "int_class", "launch_counts", "ptr_class"]


@dataclasses.dataclass
class LaunchCounts:
    """How :class:`KernelLaunch` launches went in this process (for tests and benchmarks).

    Attributes:
        bound: compiled kernels taken from a launch through ``kernel[grid]`` and kept for
            direct launches (one per call site's compile-time choices and alignment class:
            flat once a workload's shapes have been seen).
        direct: launches through a kept kernel's launcher.
        triton: launches through ``kernel[grid]`` (first of a class, or no direct path).
    """

    bound: int = 0
    direct: int = 0
    triton: int = 0


_COUNTS = LaunchCounts()
#: Compiled kernels' (launcher, function handle, packed metadata) by (function, compile-time
#: key, alignment class), shared by every KernelLaunch with the same choices (a launch made
#: anew each step finds its kernel here).
_BOUND: dict[tuple, tuple[Any, Any, Any]] = {}
#: Compiled kernels kept at most (a process seeing that many classes is an unusual one).
_MAX_BOUND = 4096


def launch_counts() -> LaunchCounts:
    """The process's counts so far (a live object: read its fields before and after)."""
    return _COUNTS


def _runtime() -> Any | None:
    """Triton's runtime knobs when launches can be direct here (see the module), else None."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or torch.version.hip or not hasattr(runtime, "launch_enter_hook"):
        return None
    return runtime


_RUNTIME = _runtime()
#: Triton's driver configuration (its ``active`` driver is looked up per launch: a test may
#: swap it).
_DRIVER = triton.runtime.driver


def ptr_class(t: torch.Tensor) -> int:
    """What Triton specialises a pointer argument on, or finer: its address modulo 16."""
    return t.data_ptr() & 15


def arg_class(value: object) -> object:
    """:func:`ptr_class` of a tensor, else the value's type (a float argument's value is not
    specialised on): for arguments that are either (a scale)."""
    return value.data_ptr() & 15 if isinstance(value, torch.Tensor) else type(value)


def int_class(value: int) -> tuple[bool, bool, bool, bool]:
    """What Triton specialises an int argument on, or finer: ``== 1`` (a constant), divisible
    by 16, fits int32, fits int64."""
    return (value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63)


class KernelLaunch:
    """Launches of ``fn`` with fixed constexprs and options, direct after the first.

    Args:
        fn: the ``@triton.jit`` function.
        static_key: what fixes Triton's specialisation of the arguments between calls of
            this launch beside the ``dynamic_key`` each call gives (the argument dtypes, the
            ints that do not change); hashable, no tensors.
        constexprs: the constexpr arguments by name, in the kernel's parameter order after
            the positional ones.
        options: launch options (``num_warps``, ``num_stages``).

    A call passes the grid, every positional argument, and a ``dynamic_key`` that covers the
    specialisation of whatever in them ``static_key`` does not: :func:`ptr_class` of each
    tensor, :func:`int_class` (or the value) of each changing int. Two calls with equal keys
    must be calls Triton would compile the same kernel for (the direct launch runs the
    kernel the first such call compiled).
    """

    __slots__ = ("_kernels", "constexprs", "direct", "fn", "key", "kwargs")

    def __init__(self, fn: Any, static_key: Hashable, constexprs: dict[str, Any],
                 options: dict[str, int]) -> None:
        self.fn = fn
        self.constexprs = tuple(constexprs.values())
        self.kwargs = {**constexprs, **options}
        names = getattr(fn, "arg_names", None)
        # Direct launches pass every parameter positionally in signature order, as Triton's
        # own run does: the constexprs must be the last parameters.
        self.direct = (_RUNTIME is not None and isinstance(fn, JITFunction)
                       and names is not None and bool(constexprs)
                       and list(names[-len(constexprs):]) == list(constexprs))
        self.key = (fn, static_key, tuple(constexprs.items()), tuple(options.items()))
        self._kernels: dict[Hashable, Any] = {}

    def __call__(self, grid: tuple[int, int, int], args: tuple, dynamic_key: Hashable) -> None:
        """Launch on ``grid`` (three ints) with the positional ``args``; see the class."""
        if self.direct:
            # A profiler's hooks and a recording see every launch through kernel[grid]
            # (no hook: None up to Triton 3.6, an empty HookChain after).
            enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
            if ((enter is None or not getattr(enter, "calls", True))
                    and (leave is None or not getattr(leave, "calls", True))
                    and not recording_launches()):
                driver = _DRIVER.active
                device = driver.get_current_device()
                found = (device, dynamic_key)
                kept = self._kernels.get(found)
                if kept is None:
                    kept = _BOUND.get((self.key, found))
                    if kept is None:
                        self._launch_and_keep(grid, args, found)
                        return
                    self._kernels[found] = kept
                run, function, packed_metadata = kept
                run(grid[0], grid[1], grid[2], driver.get_current_stream(device), function,
                    packed_metadata, None, None, None, *args, *self.constexprs)
                _COUNTS.direct += 1
                return
        _COUNTS.triton += 1
        self.fn[grid](*args, **self.kwargs)

    def _launch_and_keep(self, grid: tuple[int, int, int], args: tuple,
                         found: Hashable) -> None:
        """Launch through ``kernel[grid]`` and keep the compiled kernel it returns (its
        launcher, function handle and packed metadata: what a direct launch passes)."""
        _COUNTS.triton += 1
        kernel = self.fn[grid](*args, **self.kwargs)
        if (kernel is None or hasattr(kernel, "result")
                or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))):
            return  # compiling asynchronously, or an unknown kind
        if len(_BOUND) >= _MAX_BOUND:
            _BOUND.clear()
        # The launch above initialised the kernel's handles (``run`` first: reading it
        # loads the module that sets ``function``).
        run = kernel.run
        kept = _BOUND[(self.key, found)] = (run, kernel.function, kernel.packed_metadata)
        self._kernels[found] = kept
        _COUNTS.bound += 1
