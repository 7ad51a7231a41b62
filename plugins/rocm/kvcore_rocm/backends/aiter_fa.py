"""ROCM_AITER_FA: a blocks-first cache whose pages hold AITER's shuffled layout; attention on
aiter.

**Unverified:** the aiter call (``aiter.flash_attn_varlen_func``) is written from aiter's
documented Python entry point but has never run: no machine here has an AMD GPU or aiter. The
shuffled cache write and read are tested on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from kvcore import AttentionImpl, AttentionLayer, AttentionMetadata
from kvcore.ops import triton_unavailable_reasons
from kvcore_rocm.backends.common import AITER_HINT, AiterBackend, aiter_installed, use_aiter, window

__all__ = ["AiterFlashAttentionBackend", "AiterFlashAttentionImpl"]


class AiterFlashAttentionImpl(AttentionImpl):
    """Cache write: Triton :func:`~kvcore_rocm.ops.shuffle.reshape_and_cache_shuffle` on GPU
    tensors, :func:`~kvcore_rocm.ops.shuffle.reshape_and_cache_shuffle_ref` on CPU tensors.

    Attention (UNVERIFIED, needs aiter): the requests' tokens are read out of the shuffled
    pages with :func:`~kvcore_rocm.ops.shuffle.gather_shuffled_kv` (verified on CPU) and passed to
    ``aiter.flash_attn_varlen_func`` with bottom-right causal alignment.
    """

    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from kvcore_rocm.ops import shuffle

        key_cache, value_cache = kv_cache.unbind(1)
        write = (shuffle.reshape_and_cache_shuffle if key_cache.device.type == "cuda"
                 else shuffle.reshape_and_cache_shuffle_ref)
        write(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype)

    def check_forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      attn_metadata: AttentionMetadata, output: torch.Tensor | None) -> None:
        if not use_aiter(kv_cache):
            raise RuntimeError(
                f"ROCM_AITER_FA needs aiter on an AMD GPU for attention (kv_cache is on "
                f"{kv_cache.device}; {'aiter installed' if aiter_installed() else AITER_HINT})"
            )

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        from aiter import flash_attn_varlen_func

        from kvcore_rocm.ops.shuffle import gather_shuffled_kv

        key_cache, value_cache = kv_cache.unbind(1)
        keys, values, cu_seqlens_k = gather_shuffled_kv(
            key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens)
        flash_attn_varlen_func(
            query, keys, values,
            # aiter reads it densely; an engine's view may have stride > 1.
            cu_seqlens_q=attn_metadata.query_start_loc.contiguous(), cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=attn_metadata.max_query_len, max_seqlen_k=attn_metadata.max_seq_len,
            dropout_p=0.0, softmax_scale=self.scale, causal=self.is_causal(attn_metadata),
            window_size=window(self.sliding_window), out=output)


class AiterFlashAttentionBackend(AiterBackend):
    """ROCM_AITER_FA: blocks-first cache with AITER's shuffled pages; attention needs aiter.

    The logical shape and stride order are the standard NHD blocks-first ones, so the pages
    are what connectors and :class:`kvcore.KVCacheLayout` expect; only the element order inside
    each K/V half-page is AITER's (defined in :mod:`kvcore_rocm.ops.shuffle`). No cross-layer
    opt-in: the attention path (aiter) has not been verified on strided pages.
    """

    NAME = "ROCM_AITER_FA"
    IMPL_CLS = AiterFlashAttentionImpl

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = [*super().unavailable_reasons(), *triton_unavailable_reasons()]
        if not aiter_installed():
            reasons.append(
                f"{AITER_HINT}; ROCM_AITER_FA's shuffled-cache attention runs only on aiter "
                "(use ROCM_AITER_UNIFIED_ATTN without it)"
            )
        return reasons
