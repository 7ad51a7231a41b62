"""kvcore-nvidia's status report (``kvcore plugins``, ``kvcore collect-env``), with the cache
directories ``kvcore warmup`` lists."""

from __future__ import annotations

from kvcore_nvidia.caches import flashinfer_jit_cache
from kvcore_nvidia.ops import _build
from kvcore_nvidia.ops.cache_write import cache_write_status

__all__ = ["status_report"]


def status_report() -> dict[str, str]:
    """kvcore-nvidia's lines; the facts named ``*_cache`` are the directories ``kvcore warmup``
    lists."""
    return {"cuda_extension": _build.status(), "cache_write": cache_write_status(),
            "cuda_extension_cache": str(_build.build_directory()),
            "flashinfer_jit_cache": flashinfer_jit_cache()}
