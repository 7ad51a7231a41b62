"""CPU_MLA: the pure-torch MLA backend, the embedded default for MLA layers on the CPU.

The same cache and the same implementation interface as every MLA backend
(:class:`~kvcore.mla.MLACommonImpl`: the latent cache ``(num_blocks,
block_size, kv_lora_rank + qk_rope_head_dim)``, the model's ``kv_b_proj`` weight at
construction, the absorbed forward), so an engine switches between CPU_MLA and TRITON_MLA by
name only. Its kernels are the references of :mod:`kvcore.ops.mla_reference`: a vectorised
gather and batched products (decodes of a step together, each prefill on its own), computed in
float32. They index pages through the views' strides, so cross-layer caches are supported.
"""

from __future__ import annotations

import torch

from kvcore.metadata import AttentionLayer, AttentionMetadata
from kvcore.mla import MLACommonBackend, MLACommonImpl
from kvcore.ops.mla_reference import concat_and_cache_mla_ref, mla_attention_ref

__all__ = ["CpuMLABackend", "CpuMLAImpl"]


class CpuMLAImpl(MLACommonImpl):
    """:class:`~kvcore.MLACommonImpl` on the pure-torch ops (same arguments as TRITON_MLA's)."""

    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write latents: ``key`` = ``kv_c`` ``(num_tokens, kv_lora_rank)``, ``value`` =
        ``k_pe`` ``(num_tokens, [1,] qk_rope_head_dim)``; fp8 caches use ``layer.k_scale``."""
        concat_and_cache_mla_ref(key, value, kv_cache, slot_mapping, self.kv_cache_dtype,
                                 layer.k_scale)

    def _latent_attention(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                          attn_metadata: AttentionMetadata) -> torch.Tensor:
        return mla_attention_ref(
            q, kv_cache, kv_lora_rank=self.kv_lora_rank,
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype, k_scale=layer.k_scale)


class CpuMLABackend(MLACommonBackend):
    """MLA in pure torch on any device; cross-layer KV caches supported (verified)."""

    SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    PLATFORMS = ("cpu",)

    NAME = "CPU_MLA"
    IMPL_CLS = CpuMLAImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """``B,N,D``; with layers ``B,L,N,D`` (cross-layer): the reference ops index through
        the view's strides."""
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)
