"""The plugin's own helpers for its Triton kernels; the shared ones (fp8 rounding, scales,
the varlen tile lookup) are kvcore's public :mod:`kvcore.ops.triton_utils`."""

from __future__ import annotations

import torch

__all__ = ["is_rocm"]


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None
