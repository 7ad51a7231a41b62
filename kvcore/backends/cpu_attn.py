"""CPU_ATTN: the pure-torch backend, the embedded default and the numerical reference.

Writes the cache with :func:`kvcore.ops.reshape_and_cache_ref` and attends with
:func:`kvcore.ops.paged_attention_torch` (the decode requests of a batch in one batched
matmul; tested against the float64-checkable :func:`kvcore.ops.paged_attention_ref`). Both
take strides from the views they get, so CPU_ATTN runs on cross-layer caches unchanged.
"""

from __future__ import annotations

import torch

from kvcore.backend import AttentionBackend
from kvcore.impl import PagedAttentionImpl
from kvcore.layout_names import vllm_layout_order
from kvcore.ops.reference import reshape_and_cache_ref
from kvcore.ops.torch_attention import paged_attention_torch
from kvcore.platform_types import AttentionType


class CpuAttentionImpl(PagedAttentionImpl):
    reshape_and_cache = staticmethod(reshape_and_cache_ref)
    paged_attention = staticmethod(paged_attention_torch)


class CpuAttentionBackend(AttentionBackend):
    SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    SUPPORTED_HEAD_SIZES = None
    SUPPORTED_BLOCK_SIZES = None
    SUPPORTS_NON_CAUSAL = True
    SUPPORTS_SINK = True
    SUPPORTS_LOGITS_SOFT_CAP = True
    # paged_attention_torch gives a request the same bits alone as in any batch.
    SUPPORTS_BATCH_INVARIANT = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cpu",)
    # The ops index through the views' strides, so K and V side by side per token and head
    # (vLLM's layouts) read as well as the split halves; also with heads outside the blocks.
    EXTRA_STRIDE_ORDERS = tuple(vllm_layout_order(name, include_num_layers_dimension=False)
                                for name in ("LBHNC", "LBNHC", "LHBNC"))

    NAME = "CPU_ATTN"
    IMPL_CLS = CpuAttentionImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # The ops index through the views' strides: cross-layer is safe.
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)
