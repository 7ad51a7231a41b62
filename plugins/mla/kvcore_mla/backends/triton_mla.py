"""TRITON_MLA: portable MLA backend (NVIDIA and AMD) on kvcore-mla's Triton kernels.

Writes latents with :func:`kvcore_mla.ops.triton_cache.concat_and_cache_mla` and computes the
absorbed latent-space attention of :class:`kvcore.MLACommonImpl` with
:func:`kvcore_mla.ops.triton_mla_attention.mla_attention`: split-KV decode for pure-decode
batches, causal query tiles for mixed prefill/decode batches. Both kernels address pages
through the cache's real strides and are verified bit-exact on per-layer views of cross-layer
pools, so this backend opts in to cross-layer KV caches.

Importing this module imports no kernel library: triton is imported when the impl first runs.
"""

from __future__ import annotations

import torch

from kvcore import (
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionSelectorConfig,
    DeviceCapability,
    MLACommonBackend,
    MLACommonImpl,
)
from kvcore.ops import triton_fp8_reasons, triton_unavailable_reasons

__all__ = ["TritonMLABackend", "TritonMLAImpl"]


class TritonMLABackend(MLACommonBackend):
    """MLA on Triton kernels; cross-layer KV caches supported (verified)."""

    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # bf16 tensor-core dots need Ampere (CUDA 8.0); every ROCm capability kvcore knows is above.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    PLATFORMS = ("cuda", "rocm")

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonMLAImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """``B,N,D``; with layers ``B,L,N,D`` (cross-layer): both kernels take the page stride
        from the cache and pass the cross-layer tests."""
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return [*super().unavailable_reasons(), *triton_unavailable_reasons()]

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        """fp8 caches need Triton's fp8 conversions, which NVIDIA GPUs have from 8.9 on."""
        return triton_fp8_reasons(config.kv_cache_dtype, device_capability)


def _check_runnable(kv_cache: torch.Tensor) -> None:
    from kvcore.ops.triton_utils import interpreting

    if kv_cache.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"kv_cache is on {kv_cache.device}; TRITON_MLA runs Triton kernels on GPU tensors "
            "(set TRITON_INTERPRET=1 to run them on the CPU for testing)"
        )


class TritonMLAImpl(MLACommonImpl):
    """:class:`kvcore.MLACommonImpl` on the Triton kernels (the same arguments as CPU_MLA's)."""

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write latents: ``key`` = ``kv_c`` ``(num_tokens, kv_lora_rank)``, ``value`` =
        ``k_pe`` ``(num_tokens, [1,] qk_rope_head_dim)``; fp8 caches use ``layer.k_scale``."""
        _check_runnable(kv_cache)
        from kvcore_mla.ops.triton_cache import concat_and_cache_mla

        concat_and_cache_mla(key, value, kv_cache, slot_mapping, self.kv_cache_dtype,
                             layer.k_scale)

    def _latent_attention(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        _check_runnable(kv_cache)
        from kvcore_mla.ops.triton_mla_attention import mla_attention

        return mla_attention(
            q, kv_cache, kv_lora_rank=self.kv_lora_rank,
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype, k_scale=layer.k_scale,
            max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len,
        )
