"""FLASH_ATTN: flash-attn 2's ``flash_attn_varlen_func`` with a block table.

flash-attn's paged mode takes ``k``/``v`` as ``(num_blocks, page_block_size, nheads_k,
headdim)`` tensors plus a ``(batch, max_blocks_per_seq)`` int32 ``block_table``: the layer's
``kv_cache.unbind(1)`` halves, passed as they are (the kernel takes the block stride from
the tensor; only the last dim must be contiguous). Causal masking is bottom-right aligned
(flash-attn >= 2.1), matching kvcore's convention that a request's queries are its last
tokens. ``cu_seqlens_k`` is the running sum of ``seq_lens``.

Capabilities are flash-attn 2's documented limits: Ampere or newer (capability >= 8.0),
fp16/bf16, head dims up to 256 (multiples of 8: the Python wrapper would otherwise pad, which
on a paged cache means copying it), and paged KV blocks that are a multiple of 256 tokens
(``mha_varlen_fwd``: "Paged KV cache block size must be divisible by 256").

**Unverified:** flash-attn publishes no binary wheel for the GPU machine's torch, so this
backend has never run; it is written from flash-attn 2.8's documented ``flash_attn_varlen_func``
signature. Its selection, validation and reasons are tested on CPU.
"""

from __future__ import annotations

import torch

from kvcore import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionType,
    DeviceCapability,
    MultipleOf,
)
from kvcore.ops import triton_unavailable_reasons
from kvcore_nvidia.backends.common import (
    begin_forward,
    cumulative,
    step_kv,
    write_cache,
)

__all__ = ["FlashAttentionBackend", "FlashAttentionImpl"]


class FlashAttentionBackend(AttentionBackend):
    """flash-attn 2 (``flash-attn``) paged varlen attention on the NHD blocks-first cache."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    SUPPORTED_HEAD_SIZES = (MultipleOf(8, max=256),)
    SUPPORTED_BLOCK_SIZES = (MultipleOf(256),)
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    SUPPORTS_NON_CAUSAL = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda",)
    REQUIRED_PACKAGES = (("flash_attn", "flash-attn"),)

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD; no cross-layer opt-in: never run on strided pages (see the module docstring).
        return tuple(range(6 if include_num_layers_dimension else 5))

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        # The cache write is kvcore's Triton kernel.
        return [*super().unavailable_reasons(), *triton_unavailable_reasons()]


class FlashAttentionImpl(AttentionImpl):
    """Cache write: kvcore's Triton ``reshape_and_cache``. Attention: ``flash_attn_varlen_func``."""

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_cache(self, layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        kv_cache, attn_metadata = step_kv(self, layer, key, value, kv_cache, attn_metadata)
        key_cache, value_cache, n, output = begin_forward(self, query, kv_cache, attn_metadata,
                                                          output)
        if n == 0:
            return output
        causal = self.is_causal(attn_metadata)
        # flash-attn's window: keys in [q - left, q + right]; kvcore's window keeps the last
        # `sliding_window` keys up to the query (and, non-causal, every key after it).
        if self.sliding_window is None:
            window = (-1, -1)
        else:
            window = (self.sliding_window - 1, 0 if causal else -1)
        out = flash_attn_varlen_func(
            query[:n], key_cache, value_cache,
            cu_seqlens_q=attn_metadata.query_start_loc.to(torch.int32),
            cu_seqlens_k=cumulative(attn_metadata.seq_lens),
            max_seqlen_q=attn_metadata.max_query_len,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=causal,
            window_size=window,
            block_table=attn_metadata.block_table.to(torch.int32),
        )
        output[:n].copy_(out)
        return output
