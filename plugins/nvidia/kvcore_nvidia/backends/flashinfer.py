"""FLASHINFER: FlashInfer's paged attention on kvcore's blocks-first NHD cache.

FlashInfer's NHD paged layout is ``(max_num_pages, 2, page_size, num_kv_heads, head_dim)``
with ``paged_kv_cache[:, 0]`` the keys: exactly kvcore's logical shape with the identity
stride order, so the layer's ``kv_cache.unbind(1)`` halves are passed as they are (FlashInfer
takes the page, token and head strides from the tensors; nothing is copied).

Per call, :meth:`FlashInferImpl.forward` turns :class:`kvcore.AttentionMetadata` into
FlashInfer's page lists (``indptr`` = cumulative pages per request, ``indices`` = the used
block-table entries in order, ``last_page_len``), plans, and runs:

- a decode-only batch (one new token per request) through ``BatchDecodeWithPagedKVCacheWrapper``
  with tensor cores;
- anything else (prefill, prefill with a cached prefix, mixed batches) through
  ``BatchPrefillWithPagedKVCacheWrapper``, whose causal mask is bottom-right aligned
  (the queries are the last tokens of each request), as kvcore's convention requires.

Both wrappers use FlashInfer's ``fa2`` kernels, so one JIT-built module (per dtype, head size
and sliding-window on/off) serves decode and prefill. They share one 128 MiB float workspace per
device (:data:`FlashInferBackend.WORKSPACE_BYTES`, FlashInfer's recommended size), created on
first use. kvcore has no per-step metadata hook, so ``forward`` plans when it sees a new step:
the plan is kept for the next layers that get the same metadata object, unmodified, with the
same layer parameters (:class:`~kvcore_nvidia.backends.common.StepCache`). Planning syncs
with the host, so ``forward`` is not CUDA-graph capturable.

Cross-layer caches: FLASHINFER opts in. FlashInfer takes the page stride from the tensors: its
prefill and decode kernels give bit-identical outputs on a layer of a cross-layer pool and on a
contiguous copy and leave the other layers untouched
(``test_flashinfer_on_a_cross_layer_view_is_bit_exact``, a GPU test; the runs are recorded in
``benchmarks/RESULTS.md``), and the conformance suite's cross-layer case passes.

The cache write is kvcore's Triton ``reshape_and_cache`` (stride-aware, int64 offsets).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionType,
    DeviceCapability,
)
from kvcore.ops import triton_unavailable_reasons
from kvcore_nvidia.backends.common import (
    StepCache,
    begin_forward,
    cumulative,
    pages_per_request,
    step_kv,
    write_cache,
)

__all__ = ["FlashInferBackend", "FlashInferImpl", "flashinfer_page_table"]


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged prefill/decode (``flashinfer-python``) on the NHD blocks-first cache."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    # The head dims FlashInfer's fa2 paged kernels are instantiated for.
    SUPPORTED_HEAD_SIZES = (64, 128, 256)
    SUPPORTED_BLOCK_SIZES = (16, 32, 64)
    # bf16 and the fa2 tensor-core paths need Ampere.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    SUPPORTS_NON_CAUSAL = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda",)
    REQUIRED_PACKAGES = (("flashinfer", "flashinfer-python"),)
    #: Bytes of the float workspace shared by the wrappers of one device.
    WORKSPACE_BYTES = 128 * 1024 * 1024

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD, FlashInfer's native paged layout; with layers, blocks outermost (cross-layer):
        # shown bit-exact on per-layer views (module docstring).
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        # The cache write is kvcore's Triton kernel.
        return [*super().unavailable_reasons(), *triton_unavailable_reasons()]


def flashinfer_page_table(
    attn_metadata: AttentionMetadata, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kvcore's block table as FlashInfer's ragged page lists.

    Returns:
        ``(indptr, indices, last_page_len)``: ``(num_seqs + 1,)`` cumulative page counts,
        ``(indptr[-1],)`` the used block-table entries request after request, and
        ``(num_seqs,)`` tokens in each request's last page (0 for a request with no tokens);
        all int32 on the block table's device.
    """
    seq_lens = attn_metadata.seq_lens.to(torch.int32)
    pages = pages_per_request(seq_lens, block_size)
    table = attn_metadata.block_table
    used = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
    indices = table.to(torch.int32)[used]  # row-major: request after request
    last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * block_size, 0)
    return cumulative(pages), indices, last_page_len.to(torch.int32)


#: The last plan of the shared wrappers (every plan goes through it, so a hit means the
#: wrapper it returns still holds that plan).
_PLANS = StepCache()


@functools.cache
def _wrappers(device: torch.device) -> tuple[Any, Any]:
    """The (prefill, decode) wrappers of ``device``, sharing one float workspace."""
    import flashinfer

    workspace = torch.zeros(FlashInferBackend.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=True, backend="fa2")
    return prefill, decode


class FlashInferImpl(AttentionImpl):
    """Cache write: kvcore's Triton ``reshape_and_cache``. Attention: FlashInfer (see module)."""

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_cache(self, layer, key, value, kv_cache, slot_mapping)

    def plan(self, query: torch.Tensor, key_cache: torch.Tensor,
             attn_metadata: AttentionMetadata) -> Any:
        """The wrapper that runs this batch, planned (ready for ``run``).

        ``query`` is ``(num_actual_tokens, num_heads, head_size)``; ``key_cache`` one
        ``(num_blocks, block_size, num_kv_heads, head_size)`` half of the layer's cache.
        Reuses the last plan when it was made for this metadata and these parameters.
        """
        extra = (key_cache.device, key_cache.shape[1], key_cache.dtype, query.dtype,
                 self.num_heads, self.num_kv_heads, self.head_size, self.scale,
                 self.sliding_window, self.is_causal(attn_metadata))
        return _PLANS.get(attn_metadata, extra,
                          lambda: self._plan(query, key_cache, attn_metadata))

    def _plan(self, query: torch.Tensor, key_cache: torch.Tensor,
              attn_metadata: AttentionMetadata) -> Any:
        block_size = key_cache.shape[1]
        indptr, indices, last_page_len = flashinfer_page_table(attn_metadata, block_size)
        prefill, decode = _wrappers(key_cache.device)
        window_left = -1 if self.sliding_window is None else self.sliding_window - 1
        common = dict(window_left=window_left, sm_scale=self.scale, q_data_type=query.dtype,
                      kv_data_type=key_cache.dtype)
        n = query.shape[0]
        if attn_metadata.max_query_len == 1 and n == attn_metadata.num_seqs:
            # One query per request sees every key up to itself: causal or not is the same.
            decode.plan(indptr, indices, last_page_len, self.num_heads, self.num_kv_heads,
                        self.head_size, block_size, **common)
            return decode
        prefill.plan(attn_metadata.query_start_loc.to(torch.int32), indptr, indices,
                     last_page_len, self.num_heads, self.num_kv_heads, self.head_size,
                     block_size, causal=self.is_causal(attn_metadata), **common)
        return prefill

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
        kv_cache, attn_metadata = step_kv(self, layer, key, value, kv_cache, attn_metadata)
        key_cache, value_cache, n, output = begin_forward(self, query, kv_cache, attn_metadata,
                                                          output)
        if n == 0:
            return output
        q = query[:n].contiguous()
        wrapper = self.plan(q, key_cache, attn_metadata)
        target = output[:n]
        out = target if target.is_contiguous() else torch.empty_like(q)
        wrapper.run(q, (key_cache, value_cache), out=out)
        if out is not target:
            target.copy_(out)
        return output
