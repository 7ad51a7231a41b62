"""The plugin's own helpers for its Triton kernels; the shared ones (fp8 rounding, scales,
the varlen tile lookup) are kvcore's public :mod:`kvcore.ops.triton_utils`, the pre-bound
launches :mod:`kvcore.ops.triton_launch`. This module imports no kernel library."""

from __future__ import annotations

import torch

__all__ = ["is_rocm", "pointer_classes"]


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def pointer_classes(*tensors: torch.Tensor) -> tuple:
    """``(dtype, address modulo 16)`` of each tensor: what Triton specialises a pointer
    argument on, for a :class:`kvcore.ops.triton_launch.KernelLaunch` call's dynamic key."""
    return tuple([(t.dtype, t.data_ptr() & 15) for t in tensors])
