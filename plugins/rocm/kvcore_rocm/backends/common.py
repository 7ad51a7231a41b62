"""What the ROCm backends share: aiter detection, the AITER device range and capabilities."""

from __future__ import annotations

import importlib.metadata

import torch

from kvcore import AttentionBackend, DeviceCapability, MultipleOf

__all__ = [
    "AITER_DISTRIBUTION",
    "AITER_HINT",
    "AiterBackend",
    "aiter_installed",
    "use_aiter",
    "window",
]

#: The distribution that provides the ``aiter`` module. Checked by distribution name because the
#: PyPI project called ``aiter`` is an unrelated asyncio library with the same import name.
AITER_DISTRIBUTION = "amd-aiter"
AITER_HINT = f"{AITER_DISTRIBUTION} not installed (pip install 'kvcore-rocm[aiter]')"

# AITER ships kernels for CDNA GPUs (MI200 gfx90a .. MI350 gfx950); gfx942 (MI300) is the oldest
# its FA kernels and unified attention are built for.
GFX90A = DeviceCapability.parse("gfx90a")
GFX942 = DeviceCapability.parse("gfx942")
GFX950 = DeviceCapability.parse("gfx950")


def aiter_installed() -> bool:
    """Whether AMD's aiter is installed (by distribution metadata; nothing is imported)."""
    try:
        importlib.metadata.distribution(AITER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def use_aiter(tensor: torch.Tensor) -> bool:
    """Whether aiter runs on ``tensor``: it is on the GPU and aiter is installed."""
    return tensor.device.type == "cuda" and aiter_installed()


def window(sliding_window: int | None) -> tuple[int, int]:
    """flash-attn style ``(left, right)`` window: ``window`` keys including the query itself."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


class AiterBackend(AttentionBackend):
    """The capabilities of the two AITER backends (ROCM_AITER_UNIFIED_ATTN, ROCM_AITER_FA):
    blocks-first NHD cache, fp16/bf16, the head and block sizes AITER's kernels are built for,
    MI300 (gfx942) to MI350 (gfx950)."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    SUPPORTED_HEAD_SIZES = (64, 128, 256)
    # Multiples of the shuffle width x (8 for fp16/bf16) as AITER's paged kernels tile them.
    SUPPORTED_BLOCK_SIZES = (MultipleOf(16),)
    MIN_DEVICE_CAPABILITY = GFX942
    MAX_DEVICE_CAPABILITY = GFX950
    PLATFORMS = ("rocm",)
