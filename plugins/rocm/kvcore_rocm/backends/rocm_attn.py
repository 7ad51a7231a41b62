"""ROCM_ATTN: kvcore's portable Triton kernels on the legacy ``(2, num_blocks, ...)`` cache.

KV connectors are not supported: dim 0 splits K from V, so a block is not one run of memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kvcore import (
    AttentionBackend,
    CudaGraphSupport,
    KVSplit,
    MultipleOf,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from kvcore_rocm.backends.common import GFX90A

__all__ = ["RocmAttentionBackend", "RocmAttentionImpl"]


class _LegacyKVSplit(KVSplit):
    """The K and V ``(num_blocks, N, H, D)`` halves of the legacy cache, ``kv_cache.unbind(0)``,
    kept per cache as :class:`kvcore.KVSplit` keeps them (its shape checked once per cache)."""

    __slots__ = ()

    def halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; ROCM_ATTN expects the legacy "
                "(2, num_blocks, block_size, num_kv_heads, head_size)"
            )
        return kv_cache.unbind(0)


class RocmAttentionImpl(TritonAttentionImpl):
    """TRITON_ATTN's kernels and plan on ``kv_cache.unbind(0)``: K and V ``(num_blocks, N, H,
    D)`` halves."""

    @functools.cached_property
    def split_kv(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``split_kv(kv_cache)``: the legacy cache's halves (:class:`_LegacyKVSplit`), the same
        view objects while the layer's cache is the same."""
        return _LegacyKVSplit().split


class RocmAttentionBackend(AttentionBackend):
    """ROCM_ATTN: legacy ``(2, num_blocks, block_size, num_kv_heads, head_size)`` cache.

    Dim 0 splits K from V, so one block is two separate runs of memory and connectors (which
    move ``cache[block_ids]``) would move the wrong bytes: the backend opts out of them.
    """

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # The sizes ROCm's paged-attention kernels are built for; the Triton kernels that run them
    # here take any multiple of 8 up to 256, so this is the narrower of the two.
    SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 224, 256)
    SUPPORTED_BLOCK_SIZES = (MultipleOf(16),)
    MIN_DEVICE_CAPABILITY = GFX90A
    PLATFORMS = ("rocm",)
    USES_TRITON = True
    # TRITON_ATTN's kernels and builder (persistent buffers, split choice, workspace): the
    # same launches as TRITON_ATTN's, on the other halves of the cache.
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE

    NAME = "ROCM_ATTN"
    IMPL_CLS = RocmAttentionImpl
    BUILDER_CLS = TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """Legacy ``(2, num_blocks, block_size, num_kv_heads, head_size)``: K/V split first."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def kv_connector_unsupported_reason(cls) -> str:
        return ("ROCM_ATTN keeps the legacy (2, num_blocks, ...) layout; "
                "use ROCM_AITER_UNIFIED_ATTN")
