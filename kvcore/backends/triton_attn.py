"""TRITON_ATTN: the portable Triton backend for CUDA and ROCm GPUs.

Its kernels (:mod:`kvcore.ops.triton_cache`, :mod:`kvcore.ops.triton_attention`) take every
stride from the views they get, so the backend opts in to cross-layer caches. ``TRITON_ATTN``
stores pages NHD (``(block_size, num_kv_heads, head_size)`` inside a K or V half);
``TRITON_ATTN_HND`` is the same kernels on an HND physical order, for engines and transfer
peers that use that layout. Both are blocks-first, so KV connectors can move their blocks.
"""

from __future__ import annotations

import torch

from kvcore.backend import AttentionBackend, AttentionImpl, PagedAttentionImpl
from kvcore.config import AttentionSelectorConfig
from kvcore.ops import (
    triton_fp8_reasons,
    triton_paged_attention,
    triton_reshape_and_cache,
    triton_unavailable_reasons,
)
from kvcore.platform_types import AttentionType, DeviceCapability, MultipleOf


class TritonAttentionBackend(AttentionBackend):
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # Any head size up to 256: the kernel pads to a power of two and masks.
    SUPPORTED_HEAD_SIZES = (MultipleOf(8, max=256),)
    # Every token's page is looked up on its own, so any block size works.
    SUPPORTED_BLOCK_SIZES = None
    # bf16 tensor-core dots need Ampere (CUDA 8.0); every ROCm capability we know is above.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    SUPPORTS_NON_CAUSAL = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda", "rocm")
    # The cross-layer bit-exact tests have run on NVIDIA only; ROCm stays per-layer until a
    # ROCm run passes them.
    CROSS_LAYER_PLATFORMS = ("cuda",)

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD; with layers, blocks outermost: verified bit-exact on cross-layer views.
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return [*super().unavailable_reasons(), *triton_unavailable_reasons()]

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        return triton_fp8_reasons(config.kv_cache_dtype, device_capability)


class TritonAttentionHNDBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN_HND"

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 4, 3, 5) if include_num_layers_dimension else (0, 1, 3, 2, 4)


class TritonAttentionImpl(PagedAttentionImpl):
    # Called on any device (CPU tensors run under TRITON_INTERPRET=1); triton is imported on
    # first call, not when the backend is registered or selected.
    write_kv = staticmethod(triton_reshape_and_cache)
    attend = staticmethod(triton_paged_attention)
