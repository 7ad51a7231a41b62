"""The ROCm attention backends.

================================  =====================================  ==================
backend                           one layer's KV cache (logical shape)   KV connectors
================================  =====================================  ==================
``ROCM_AITER_UNIFIED_ATTN``       ``(num_blocks, 2, N, H, D)``            yes
``ROCM_AITER_FA``                 ``(num_blocks, 2, N, H, D)``, pages     yes
                                  shuffled (:mod:`kvcore_rocm.shuffle`)
``ROCM_ATTN``                     legacy ``(2, num_blocks, N, H, D)``     no
================================  =====================================  ==================

(``N`` = block_size, ``H`` = num_kv_heads, ``D`` = head_size.) The blocks-first backends split
K and V with ``kv_cache.unbind(1)``; ROCM_ATTN with ``kv_cache.unbind(0)``.

Kernels:

- ``ROCM_AITER_UNIFIED_ATTN`` calls aiter's ``unified_attention`` when ``amd-aiter`` is
  installed and the tensors are on the GPU; otherwise kvcore's portable Triton kernels
  (``kvcore.ops.triton_reshape_and_cache`` / ``triton_paged_attention``), which take every stride
  from the views, so the backend opts in to cross-layer caches when it runs on them.
- ``ROCM_AITER_FA`` writes the cache with the stride-aware Triton
  :func:`~kvcore_rocm.shuffle.reshape_and_cache_shuffle` and needs aiter for attention: the
  shuffled K page interleaves ``head_size`` with ``block_size`` (``(H, D // x, N, x)``), which no
  ``(block, token, head, dim)`` stride set can describe, so the portable kernels cannot read it.
- ``ROCM_ATTN`` runs kvcore's Triton kernels on the two halves of the legacy cache.

**Unverified:** the aiter calls (``aiter.ops.triton.unified_attention.unified_attention`` and
``aiter.flash_attn_varlen_func``) are written from aiter's documented Python entry points but
have never run: no machine here has an AMD GPU or aiter. Everything else is tested on CPU under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    DeviceCapability,
    MultipleOf,
    PagedAttentionImpl,
)
from kvcore.ops import triton_available, triton_paged_attention, triton_reshape_and_cache

__all__ = [
    "AITER_DISTRIBUTION",
    "AiterFlashAttentionBackend",
    "AiterUnifiedAttentionBackend",
    "RocmAttentionBackend",
    "aiter_installed",
]

#: The distribution that provides the ``aiter`` module. Checked by distribution name because the
#: PyPI project called ``aiter`` is an unrelated asyncio library with the same import name.
AITER_DISTRIBUTION = "amd-aiter"
_AITER_HINT = f"{AITER_DISTRIBUTION} not installed (pip install 'kvcore-rocm[aiter]')"

# AITER ships kernels for CDNA GPUs (MI200 gfx90a .. MI350 gfx950); gfx942 (MI300) is the oldest
# its FA kernels and unified attention are built for.
_GFX942 = DeviceCapability.parse("gfx942")
_GFX950 = DeviceCapability.parse("gfx950")
_GFX90A = DeviceCapability.parse("gfx90a")


def aiter_installed() -> bool:
    """Whether AMD's aiter is installed (by distribution metadata; nothing is imported)."""
    try:
        importlib.metadata.distribution(AITER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _use_aiter(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and aiter_installed()


def _triton_reasons() -> list[str]:
    ok, reason = triton_available()
    return [] if ok else [reason]


def _window(sliding_window: int | None) -> tuple[int, int]:
    """flash-attn style ``(left, right)`` window: ``window`` keys including the query itself."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


# -- ROCM_ATTN ------------------------------------------------------------------------------


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
    MIN_DEVICE_CAPABILITY = _GFX90A
    PLATFORMS = ("rocm",)

    @staticmethod
    def get_name() -> str:
        return "ROCM_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return RocmAttentionImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """Legacy ``(2, num_blocks, block_size, num_kv_heads, head_size)``: K/V split first."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def kv_connector_unsupported_reason(cls) -> str:
        return ("ROCM_ATTN keeps the legacy (2, num_blocks, ...) layout; "
                "use ROCM_AITER_UNIFIED_ATTN")

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return [*super().unavailable_reasons(), *_triton_reasons()]


class RocmAttentionImpl(PagedAttentionImpl):
    """Triton kernels on ``kv_cache.unbind(0)``: K and V ``(num_blocks, N, H, D)`` halves."""

    write_kv = staticmethod(triton_reshape_and_cache)
    attend = staticmethod(triton_paged_attention)

    def split_kv(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _legacy_halves(kv_cache)


def _legacy_halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; ROCM_ATTN expects the legacy "
            "(2, num_blocks, block_size, num_kv_heads, head_size)"
        )
    key_cache, value_cache = kv_cache.unbind(0)
    return key_cache, value_cache


# -- ROCM_AITER_UNIFIED_ATTN ----------------------------------------------------------------


class AiterUnifiedAttentionBackend(AttentionBackend):
    """ROCM_AITER_UNIFIED_ATTN: blocks-first NHD cache; aiter when installed, Triton otherwise.

    Cross-layer: the portable Triton kernels are verified bit-exact on per-layer views of a
    cross-layer cache, so the backend opts in when it will run them (aiter not installed). With
    aiter installed it keeps layers outermost: aiter's kernel has not been verified on strided
    pages.
    """

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    SUPPORTED_HEAD_SIZES = (64, 128, 256)
    SUPPORTED_BLOCK_SIZES = (MultipleOf(16),)
    MIN_DEVICE_CAPABILITY = _GFX942
    MAX_DEVICE_CAPABILITY = _GFX950
    PLATFORMS = ("rocm",)

    @staticmethod
    def get_name() -> str:
        return "ROCM_AITER_UNIFIED_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return AiterUnifiedAttentionImpl

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
        return [*super().unavailable_reasons(), *_triton_reasons()]


class AiterUnifiedAttentionImpl(PagedAttentionImpl):
    """Cache write: kvcore's Triton ``reshape_and_cache`` on ``kv_cache.unbind(1)`` (both paths).

    Attention: aiter's ``unified_attention`` (UNVERIFIED, see the module docstring) for GPU
    tensors when aiter is installed, the portable Triton ``paged_attention`` otherwise.
    """

    write_kv = staticmethod(triton_reshape_and_cache)
    attend = staticmethod(triton_paged_attention)

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
        key_cache, value_cache = self.split_kv(kv_cache)
        if not _use_aiter(key_cache):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        output = torch.empty_like(query) if output is None else output
        self._aiter_forward(query, key_cache, value_cache, attn_metadata, output)
        return output

    def _aiter_forward(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata, output: torch.Tensor,
    ) -> None:
        """UNVERIFIED: aiter's Triton unified attention (vLLM's argument convention)."""
        from aiter.ops.triton.unified_attention import unified_attention

        n = attn_metadata.num_actual_tokens
        unified_attention(
            q=query[:n], k=key_cache, v=value_cache, out=output[:n],
            cu_seqlens_q=attn_metadata.query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            window_size=_window(self.sliding_window),
            block_table=attn_metadata.block_table,
            softcap=0,
            q_descale=None, k_descale=None, v_descale=None,
        )


# -- ROCM_AITER_FA --------------------------------------------------------------------------


class AiterFlashAttentionBackend(AttentionBackend):
    """ROCM_AITER_FA: blocks-first cache with AITER's shuffled pages; attention needs aiter.

    The logical shape and stride order are the standard NHD blocks-first ones, so the pages
    are what connectors and :class:`kvcore.KVCacheLayout` expect; only the element order inside
    each K/V half-page is AITER's (defined in :mod:`kvcore_rocm.shuffle`). No cross-layer
    opt-in: the attention path (aiter) has not been verified on strided pages.
    """

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    SUPPORTED_HEAD_SIZES = (64, 128, 256)
    # Multiples of the shuffle width x (8 for fp16/bf16) as AITER's paged kernels tile them.
    SUPPORTED_BLOCK_SIZES = (MultipleOf(16),)
    MIN_DEVICE_CAPABILITY = _GFX942
    MAX_DEVICE_CAPABILITY = _GFX950
    PLATFORMS = ("rocm",)

    @staticmethod
    def get_name() -> str:
        return "ROCM_AITER_FA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return AiterFlashAttentionImpl

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = [*super().unavailable_reasons(), *_triton_reasons()]
        if not aiter_installed():
            reasons.append(
                f"{_AITER_HINT}; ROCM_AITER_FA's shuffled-cache attention runs only on aiter "
                "(use ROCM_AITER_UNIFIED_ATTN without it)"
            )
        return reasons


class AiterFlashAttentionImpl(AttentionImpl):
    """Cache write: Triton :func:`~kvcore_rocm.shuffle.reshape_and_cache_shuffle` on GPU
    tensors, :func:`~kvcore_rocm.shuffle.reshape_and_cache_shuffle_ref` on CPU tensors.

    Attention (UNVERIFIED, needs aiter): the requests' tokens are read out of the shuffled
    pages with :func:`~kvcore_rocm.shuffle.gather_shuffled_kv` (verified on CPU) and passed to
    ``aiter.flash_attn_varlen_func`` with bottom-right causal alignment.
    """

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from kvcore_rocm import shuffle

        key_cache, value_cache = kv_cache.unbind(1)
        write = (shuffle.reshape_and_cache_shuffle if key_cache.device.type == "cuda"
                 else shuffle.reshape_and_cache_shuffle_ref)
        write(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype)

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
        if not _use_aiter(kv_cache):
            raise RuntimeError(
                f"ROCM_AITER_FA needs aiter on an AMD GPU for attention (kv_cache is on "
                f"{kv_cache.device}; {'aiter installed' if aiter_installed() else _AITER_HINT})"
            )
        from aiter import flash_attn_varlen_func

        from kvcore_rocm.shuffle import gather_shuffled_kv

        key_cache, value_cache = kv_cache.unbind(1)
        keys, values, cu_seqlens_k = gather_shuffled_kv(
            key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens)
        n = attn_metadata.num_actual_tokens
        output = torch.empty_like(query) if output is None else output
        kwargs: dict[str, Any] = dict(
            cu_seqlens_q=attn_metadata.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=attn_metadata.max_query_len, max_seqlen_k=attn_metadata.max_seq_len,
            dropout_p=0.0, softmax_scale=self.scale, causal=attn_metadata.causal,
            window_size=_window(self.sliding_window), out=output[:n],
        )
        flash_attn_varlen_func(query[:n], keys, values, **kwargs)
        return output

