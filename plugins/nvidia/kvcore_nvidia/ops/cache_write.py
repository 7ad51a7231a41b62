"""The NVIDIA backends' cache write: the plugin's CUDA C++ kernel or kvcore's Triton kernel.

Both compute exactly :func:`kvcore.ops.reshape_and_cache_ref` (fp8 included) on caches of any
strides with int64 offsets; which one runs on a GPU is chosen once per process:

1. ``KVCORE_NVIDIA_CACHE_WRITE`` (``cuda`` or ``triton``) when set, else
   :data:`DEFAULT_CACHE_WRITE` (chosen from measurements);
2. ``cuda`` (``KVCORE_NVIDIA_CACHE_WRITE=cuda``; Triton is the default, as fast or faster on
   the H200) runs only where the CUDA C++ extension builds (:mod:`kvcore_nvidia.ops._build`):
   the first GPU write builds it (or loads it from the on-disk cache); call
   :func:`kvcore_nvidia.ops.build_extension` at start-up to keep the compile out of the first
   step. When it cannot be built the write is Triton, with the reason logged once and shown by
   ``kvcore plugins`` and ``kvcore collect-env`` (:func:`cache_write_status`); a failed build
   never raises in a forward.

CPU tensors get the reference (as :func:`kvcore.ops.reshape_and_cache` does).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import torch

from kvcore.ops import KVScale, reshape_and_cache
from kvcore_nvidia.ops import _build

__all__ = ["CACHE_WRITE_KERNELS", "DEFAULT_CACHE_WRITE", "cache_write_kernel",
           "cache_write_status", "write_kv_cache"]

logger = logging.getLogger(__name__)

CacheWriteKernel = Literal["cuda", "triton"]
CACHE_WRITE_KERNELS: tuple[str, ...] = ("cuda", "triton")

#: The GPU cache write when ``KVCORE_NVIDIA_CACHE_WRITE`` is unset. Set from
#: ``benchmarks/bench_cache_write.py`` on the H200 (bf16, 8 KV heads, head size 128, block 16,
#: auto cache, standard layout; numbers in benchmarks/RESULTS.md), microseconds (% of the
#: device-copy ceiling) at 4096 / 32768 / 131072 tokens:
#:   triton   5.8 (137%) / 71.1 (89.4%) / 275.4 (92.3%)
#:   cuda     6.5 (122%) / 70.9 (89.6%) / 276.2 (92.0%)
#: Triton time / CUDA time 0.89 / 1.00 / 1.00 (geomean 0.96); fp8_e4m3 caches: Triton faster
#: at every size (5.5 vs 7.1, 51.7 vs 53.4, 199.9 vs 204.4 us). The CUDA C++ write stays
#: available with ``KVCORE_NVIDIA_CACHE_WRITE=cuda``.
DEFAULT_CACHE_WRITE: CacheWriteKernel = "triton"

_ENV = "KVCORE_NVIDIA_CACHE_WRITE"
# Model dtypes the CUDA kernel is instantiated for; others (float64) go to Triton.
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _requested() -> tuple[str, str]:
    """The kernel asked for and where that came from; a bad environment value raises."""
    raw = os.environ.get(_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_CACHE_WRITE, "the default"
    value = raw.strip().lower()
    if value not in CACHE_WRITE_KERNELS:
        raise ValueError(f"{_ENV}={raw!r} (supported: {', '.join(CACHE_WRITE_KERNELS)}); unset "
                         f"it for the default ({DEFAULT_CACHE_WRITE})")
    return value, f"{_ENV}={value}"


@functools.cache
def cache_write_kernel() -> CacheWriteKernel:
    """The kernel GPU cache writes use in this process (builds the extension if it is asked
    for and not built yet; falls back to Triton, logging why, when it cannot be built)."""
    wanted, _ = _requested()
    if wanted == "triton":
        return "triton"
    module, reason = _build.load_or_reason()
    if module is None:
        logger.warning("kvcore-nvidia: the cache write uses Triton: the CUDA C++ extension is "
                       "unavailable (%s)", reason)
        return "triton"
    return "cuda"


def cache_write_status() -> str:
    """Which kernel GPU cache writes use and why, without building anything."""
    try:
        wanted, source = _requested()
    except ValueError as exc:
        return f"error: {exc}"
    if wanted == "triton":
        return f"triton ({source})"
    if cache_write_kernel.cache_info().currsize and cache_write_kernel() == "cuda":
        return f"cuda ({source})"
    extension = _build.status()
    if extension.startswith("unavailable"):
        return f"triton (the CUDA C++ extension is {extension})"
    return f"cuda ({source}; the CUDA C++ extension is {extension.split(' (')[0]})"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_cache_dtype: str = "auto", k_scale: KVScale = None,
                   v_scale: KVScale = None) -> None:
    """:func:`kvcore.ops.reshape_and_cache_ref`'s cache write (arguments, shapes and result
    documented there) with :func:`cache_write_kernel`; arguments are validated before any
    kernel runs."""
    if key_cache.is_cuda and key.dtype in _CUDA_DTYPES and cache_write_kernel() == "cuda":
        from kvcore_nvidia.ops.bindings import reshape_and_cache_flash as write
    else:  # kvcore's own dispatch: Triton on a GPU, the reference on the CPU
        write = reshape_and_cache
    write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
