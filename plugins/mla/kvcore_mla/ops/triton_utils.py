"""Helpers shared by the plugin's Triton kernels (imports triton; used only by them)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["fp8_format", "interpreting", "is_rocm", "round_to_fp8_grid", "scale_arg"]


@triton.jit
def round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round fp32 ``y`` (already clamped to the fp8 range) to the nearest fp8 value, ties to even.

    Only used under the interpreter, whose fp32 -> fp8 conversion drops the carry into the
    exponent (127.98 -> 64.0 in e4m3); the rounded value is representable, so the conversion
    that follows is exact. On a GPU the conversion instruction rounds correctly.
    """
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)  # subnormals share the smallest quantum
    quantum = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2**23 makes fp32 addition round the quotient to an integer, ties to even.
    r = ((a / quantum + 12582912.0) - 12582912.0) * quantum
    # y's sign bit on the result: -0.0 and negatives that round to zero stay -0.0 (0x80 in
    # fp8), as torch and the GPU's conversion give.
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def scale_arg(scale: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | float:
    """A per-tensor scale as the kernels take it: a tensor on ``device`` (read in the kernel, so
    no host sync and CUDA-graph safe) or a Python float (1.0 when absent)."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.device == device:
            return scale.reshape(1)
        return float(scale.reshape(()).item())
    return float(scale)


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """(largest finite value, mantissa bits, smallest normal exponent) of an fp8 dtype
    (float8_e4m3fn, float8_e5m2); ``(0.0, 0, 0)`` for other dtypes, which are not rounded."""
    if dtype == torch.float8_e4m3fn:
        return 448.0, 3, -6
    if dtype == torch.float8_e5m2:
        return 57344.0, 2, -14
    return 0.0, 0, 0
