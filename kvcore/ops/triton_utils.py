"""Helpers for Triton kernels written against kvcore's conventions, public for plugins.

kvcore's own kernels (:mod:`kvcore.ops.triton_cache`, :mod:`kvcore.ops.triton_attention`) and
plugin kernels (kvcore-mla) share them, so the fp8 rounding, the per-tensor scale convention
and the varlen tile-to-request lookup have one definition. This module imports triton; nothing
imports it at ``import kvcore`` or ``import kvcore.ops``.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import os

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kvcore.ops.attention_config import next_power_of_2

__all__ = ["find_sequence", "fp8_format", "gluon_defaults_enabled", "gluon_kernels_unavailable",
           "interpreting", "is_interpreted", "load_kv_scales", "locate_query_tile",
           "next_power_of_2", "prefill_key_tiles", "recording_launches", "round_to_fp8_grid",
           "scale_arg", "scale_args", "to_output"]

# Set by kvcore.testing's capture_launches while it records launches instead of running them.
_RECORDING = contextvars.ContextVar("kvcore_recording_launches", default=False)


@triton.jit
def round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round fp32 ``y`` (already clamped to the fp8 range) to the nearest fp8 value, ties to even.

    For the interpreter only, whose fp32 -> fp8 conversion rounds half away from zero and
    drops the carry into the exponent (125.0 -> 64.0 in e4m3); the rounded value is
    representable, so the conversion that follows is exact. On a GPU the conversion
    instruction rounds correctly.
    """
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)  # subnormals share the smallest quantum
    quantum = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2**23 makes fp32 addition round the quotient to an integer, ties to even.
    r = ((a / quantum + 12582912.0) - 12582912.0) * quantum
    # The sign bit, not y < 0: -0.0 and negatives that round to zero stay -0 (as on the GPU).
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)


@triton.jit
def to_output(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with float32 -> bf16 rounded to nearest even under the interpreter too
    (it truncates, a bias of half a bf16 step that the conformance suite's bound sees)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)  # the truncation below then rounds to even
            # Zeros and subnormals keep their value (a biased zero would be a subnormal).
            x = tl.where(tl.abs(x) < 1.1754943508222875e-38, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``tile`` of a varlen batch: request ``s`` owns the tiles
    starting at ``query_start_loc[s] // BLOCK_Q + s`` (strictly increasing in ``s``)."""
    # Scalars made from ``tile`` (a program id, never a compile-time constant as ``num_seqs``
    # can be): no ``tl.full``, so Gluon kernels can call this too.
    lo = tile * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """(request, its first token, its query length, the tile's index in it) of query tile
    ``tile`` of a varlen batch (:func:`find_sequence`'s numbering); ``q_tile * BLOCK_Q >=
    q_len`` past the last tile of the batch or for an empty request (the caller returns).
    Scalar-only, so Gluon kernels call it too."""
    seq = find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_len, q_tile


@triton.jit
def prefill_key_tiles(first_q, last_q, seq_len, sliding_window, CAUSAL: tl.constexpr,
                      USE_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles of a prefill query tile whose queries sit at positions ``first_q`` to
    ``last_q`` of a request of ``seq_len`` keys: ``(kv_end, lo, hi, full_lo, full_hi)``.
    Tiles ``[lo, hi)`` hold every key some query sees (keys before ``kv_end``), tiles
    ``[full_lo, full_hi)`` those every query sees: after the window's lower edge of the last
    query, up to the first query's position (causal), or the window's upper edge of the first
    query (not causal: the window is symmetric) or the last full tile.
    TRITON_ATTN's Triton and Gluon prefill kernels both call it (scalar-only)."""
    if CAUSAL:
        kv_end = last_q + 1
        full_hi = (first_q + 1) // BLOCK_N
    elif USE_WINDOW:  # min() on the distances: position + window may not fit int32
        kv_end = last_q + tl.minimum(seq_len - last_q, sliding_window)
        full_hi = (first_q + tl.minimum(seq_len - first_q, sliding_window)) // BLOCK_N
    else:
        kv_end = seq_len
        full_hi = seq_len // BLOCK_N
    hi = tl.cdiv(kv_end, BLOCK_N)
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_q - sliding_window + 1, 0) // BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_q - sliding_window + 1, 0), BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return kv_end, lo, hi, full_lo, full_hi


@triton.jit
def load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR: tl.constexpr):
    """The fp8 cache's per-tensor K and V scales in a kernel: read as fp32 from one-element
    device tensors when ``SCALE_IS_TENSOR``, else the float launch arguments themselves (what
    :func:`scale_args` passes)."""
    if SCALE_IS_TENSOR:
        ks = tl.load(k_scale).to(tl.float32)
        vs = tl.load(v_scale).to(tl.float32)
    else:
        ks = k_scale
        vs = v_scale
    return ks, vs


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set now (an environment read). Kernels decorated
    before a change keep what they were: for a kernel's own mode ask
    :func:`is_interpreted`."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter: fixed
    when it was decorated (``TRITON_INTERPRET=1`` then), so launch code asks this, not the
    environment, and a later change of the variable cannot split a kernel from its
    launches' ``INTERPRET`` flags."""
    return not isinstance(kernel, JITFunction)


@functools.cache
def gluon_defaults_enabled() -> bool:
    """Whether default configs may pick Gluon kernels (the tables' Gluon rows: TRITON_ATTN's
    Hopper prefill, TRITON_MLA's Hopper decode). ``KVCORE_GLUON=0`` turns them off, so the
    Triton kernels run instead: an operator's switch, set before the process starts. Explicit
    Gluon configs are not affected.

    Read once per process (the first choice that asks), so checked launches kept across
    steps stay valid. A process that changes the variable later (a test) calls
    ``gluon_defaults_enabled.cache_clear()`` after the change and again once it is undone;
    the ``kvcore_gluon`` pytest fixture of kvcore's pytest plugin does both."""
    return os.environ.get("KVCORE_GLUON", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def gluon_kernels_unavailable(module: str) -> str | None:
    """``None`` when ``module`` (a module of Gluon kernels for Hopper, e.g.
    ``"kvcore.ops.gluon_prefill"``) imports with the installed Triton, else why not, as a
    sentence for the refusal of a Gluon kernel's config (Gluon's Hopper API needs Triton 3.6 or
    newer).
    Cached: the import is tried once per module."""
    try:
        importlib.import_module(module)
    except (ImportError, AttributeError) as exc:
        return (f"{module}'s Gluon kernels need Triton's Gluon API for Hopper (Triton 3.6 or "
                f"newer); Triton {triton.__version__} lacks it ({exc}): upgrade Triton or use "
                "a Triton kernel's config")
    return None


def recording_launches() -> bool:
    """Whether Triton launches are being recorded, not run (inside
    :func:`kvcore.testing.compile_launches` and ``kvcore kernels``, which compile them ahead
    of time for a target GPU from CPU stand-in tensors): an op may then skip its checks of the
    device its tensors are on, and only those."""
    return _RECORDING.get()


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """(largest finite value, mantissa bits, smallest normal exponent) of an fp8 dtype
    (float8_e4m3fn, float8_e5m2); ``(0.0, 0, 0)`` for other dtypes, which are not rounded."""
    if dtype == torch.float8_e4m3fn:
        return 448.0, 3, -6
    if dtype == torch.float8_e5m2:
        return 57344.0, 2, -14
    return 0.0, 0, 0


def scale_arg(scale: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | float:
    """A per-tensor scale as kernels take it: a one-element tensor on ``device`` (read in the
    kernel, so no host sync and CUDA-graph safe) or a Python float (1.0 when absent; a tensor
    on another device is read once)."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.device == device:
            return scale.reshape(1)
        return float(scale.reshape(()).item())
    return float(scale)


def scale_args(k_scale: torch.Tensor | float | None, v_scale: torch.Tensor | float | None,
               device: torch.device) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """K and V scales for a kernel with one ``SCALE_IS_TENSOR`` flag: both device tensors or
    both floats (see :func:`scale_arg`)."""
    ks, vs = scale_arg(k_scale, device), scale_arg(v_scale, device)
    if isinstance(ks, torch.Tensor) != isinstance(vs, torch.Tensor):
        ks = ks if isinstance(ks, float) else float(ks.reshape(()).item())
        vs = vs if isinstance(vs, float) else float(vs.reshape(()).item())
    return ks, vs
