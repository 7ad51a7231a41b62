"""The KV-cache layout of DeepSeek-V3.2's sparse-attention indexer.

DeepSeek-V3.2 ("DSA") runs a lightweight indexer beside MLA: per token it caches one key of
``head_dim`` (128) channels, quantised to fp8 with a float32 scale per ``quant_block_size``
channels, and picks each query's top-k tokens from the indexer's scores. Its cache is a layer
cache like any other (allocated, offloaded and transferred in blocks), so it has a backend
class declaring its layout: uint8 ``(num_blocks, block_size, head_dim + 4 * head_dim //
quant_block_size)`` (132 bytes per token for DeepSeek-V3.2, see
:func:`kvcore_mla.ops.indexer_cache_head_size`); inside a block, all fp8 keys, then all scales.

It is not an attention backend and is not registered with kvcore's selector: the indexer layer
allocates its cache with ``kvcore.allocate_kv_caches(DeepseekV32IndexerBackend, ...,
head_size=indexer_cache_head_size(), dtype=torch.uint8)`` and writes it with
:func:`kvcore_mla.ops.indexer_k_quant_and_cache`.

Cross-layer: opted out. The write kernel addresses blocks through ``kv_cache.stride(0)`` and
is verified on cross-layer views, but the kernels that read this cache (the indexer's fp8
paged logits, e.g. DeepGEMM's, and its gather for prefill) are not part of kvcore-mla and are
not verified on strided pages.
"""

from __future__ import annotations

import torch

from kvcore import AttentionBackend, AttentionImpl, DeviceCapability, latent_cache_shape

__all__ = ["DeepseekV32IndexerBackend"]


class DeepseekV32IndexerBackend(AttentionBackend):
    """Layout of the DeepSeek-V3.2 indexer key cache (see the module docstring)."""

    SUPPORTED_DTYPES = (torch.uint8,)
    PLATFORMS = ("cuda", "rocm")
    # Its write quantises to fp8 e4m3, which Triton converts on NVIDIA from 8.9 on
    # (`kvcore kernels --target sm80` does not compile it).
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 9)

    NAME = "DEEPSEEK_V32_INDEXER"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """Not an attention backend: always raises ``NotImplementedError`` naming what to use."""
        raise NotImplementedError(
            "DEEPSEEK_V32_INDEXER only declares the indexer cache's layout; write its keys with "
            "kvcore_mla.ops.indexer_k_quant_and_cache (the indexer's top-k scoring is the "
            "engine's)"
        )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, block_size, head_size)`` bytes; ``head_size`` from
        :func:`kvcore_mla.ops.indexer_cache_head_size`, ``num_kv_heads`` 1."""
        return latent_cache_shape("DEEPSEEK_V32_INDEXER", num_blocks, block_size, num_kv_heads,
                                  head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Identity: not cross-layer (its readers are not verified on strided pages)."""
        return (0, 1, 2, 3) if include_num_layers_dimension else (0, 1, 2)
