"""ROCM_AITER_UNIFIED_ATTN: aiter's unified attention when installed, kvcore's Triton otherwise.

**Unverified:** the aiter call (``aiter.ops.triton.unified_attention.unified_attention``) is
written from aiter's documented Python entry point but has never run: no machine here has an
AMD GPU or aiter. The Triton path is tested on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from kvcore import (
    AttentionLayer,
    AttentionMetadata,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from kvcore.ops import triton_unavailable_reasons
from kvcore_rocm.backends.common import AiterBackend, aiter_installed, use_aiter, window

__all__ = ["AiterUnifiedAttentionBackend", "AiterUnifiedAttentionImpl"]


class AiterUnifiedAttentionImpl(TritonAttentionImpl):
    """Cache write: kvcore's Triton ``reshape_and_cache`` on ``kv_cache.unbind(1)`` (both paths).

    Attention: aiter's ``unified_attention`` (UNVERIFIED, see the module docstring) for GPU
    tensors when aiter is installed, TRITON_ATTN's (the portable Triton ``paged_attention``
    with the builder's plan) otherwise.
    """

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        if not use_aiter(kv_cache):
            super().attend(layer, query, kv_cache, attn_metadata, output)
            return
        # UNVERIFIED: aiter's Triton unified attention (vLLM's argument convention).
        from aiter.ops.triton.unified_attention import unified_attention

        key_cache, value_cache = kv_cache.unbind(1)
        unified_attention(
            q=query, k=key_cache, v=value_cache, out=output,
            cu_seqlens_q=attn_metadata.query_start_loc.contiguous(),  # read densely
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens.contiguous(),
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=self.is_causal(attn_metadata),
            window_size=window(self.sliding_window),
            block_table=attn_metadata.block_table.contiguous(),
            softcap=0,
            q_descale=None, k_descale=None, v_descale=None,
        )


class AiterUnifiedAttentionBackend(AiterBackend):
    """ROCM_AITER_UNIFIED_ATTN: blocks-first NHD cache; aiter when installed, Triton otherwise.

    Cross-layer: the portable Triton kernels are verified bit-exact on per-layer views of a
    cross-layer cache, so the backend opts in when it will run them (aiter not installed). With
    aiter installed it keeps layers outermost: aiter's kernel has not been verified on strided
    pages. The bit-exact cross-layer tests of the Triton path ran on an NVIDIA GPU only, so on
    ROCm the cache stays per-layer (``CROSS_LAYER_PLATFORMS``) until they pass on an AMD GPU.

    Builder: TRITON_ATTN's (its split choice and workspace serve the Triton path; aiter's call
    reads only the common fields). CUDA graphs: not declared, since aiter's kernel has never
    run here, let alone been replayed.
    """

    CROSS_LAYER_PLATFORMS = ("cuda",)

    NAME = "ROCM_AITER_UNIFIED_ATTN"
    IMPL_CLS = AiterUnifiedAttentionImpl
    BUILDER_CLS = TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        if not include_num_layers_dimension:
            return (0, 1, 2, 3, 4)
        return (0, 1, 2, 3, 4, 5) if aiter_installed() else (1, 0, 2, 3, 4, 5)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        # Either kernel source is enough; Triton is the fallback when aiter is missing.
        if aiter_installed():
            return super().unavailable_reasons()
        return [*super().unavailable_reasons(), *triton_unavailable_reasons()]
