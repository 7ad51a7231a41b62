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
and sliding-window on/off) serves decode and prefill.

The builder (:class:`FlashInferMetadataBuilder`, what an engine uses) plans once per step in
``build()``, never in ``forward``: it owns a 128 MiB float workspace
(:data:`FlashInferBackend.WORKSPACE_BYTES`, FlashInfer's recommended size), one prefill and one
decode wrapper, and for every batch size a step is built for with ``graph_batch_size`` a decode
wrapper in FlashInfer's CUDA-graph mode (``use_cuda_graph=True``, its page lists in buffers of
that size made once), planned again by every ``build()`` before the replay: so uniform-decode
steps can be captured (``CUDA_GRAPH_SUPPORT = UNIFORM_DECODE``). A plan fixes the softmax
scale, the sliding window and, for prefill, the causal mask, which the builder's constructor
does not receive: it plans for ``1 / sqrt(head_size)``, no window, and the step's ``causal``,
and ``forward`` refuses a layer that needs other values (clear error). Metadata that did not
come from the builder (``forward`` called with :class:`kvcore.AttentionMetadata` directly) is
planned on its first layer and the plan kept for the next layers of the same step
(:class:`~kvcore_nvidia.backends.common.StepCache`); planning syncs with the host, so that path
is not capturable.

Cross-layer caches: FLASHINFER opts in. FlashInfer takes the page stride from the tensors: its
prefill and decode kernels give bit-identical outputs on a layer of a cross-layer pool and on a
contiguous copy and leave the other layers untouched
(``test_flashinfer_on_a_cross_layer_view_is_bit_exact``, a GPU test; the runs are recorded in
``benchmarks/RESULTS.md``), and the conformance suite's cross-layer case passes.

The cache write is kvcore's Triton ``reshape_and_cache`` (stride-aware, int64 offsets).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CudaGraphSupport,
    DeviceCapability,
    PersistentMetadataBuilder,
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

__all__ = ["FlashInferBackend", "FlashInferImpl", "FlashInferMetadata",
           "FlashInferMetadataBuilder", "flashinfer_page_table"]


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
    #: Bytes of the float workspace shared by the wrappers of one builder (or device).
    WORKSPACE_BYTES = 128 * 1024 * 1024
    # The builder plans every step (graph-mode decode wrappers per batch size) and forward
    # only launches: no host sync, no allocation for a contiguous output.
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashInferMetadataBuilder

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


def _new_wrappers(workspace: torch.Tensor) -> tuple[Any, Any]:
    """A (prefill, decode) pair of eager wrappers sharing ``workspace``."""
    import flashinfer

    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=True, backend="fa2")
    return prefill, decode


@functools.cache
def _wrappers(device: torch.device) -> tuple[Any, Any]:
    """The (prefill, decode) wrappers of ``device`` for metadata not made by the builder."""
    return _new_wrappers(torch.zeros(FlashInferBackend.WORKSPACE_BYTES, dtype=torch.uint8,
                                     device=device))


def _plan_args(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               scale: float, sliding_window: int | None, q_dtype: torch.dtype,
               kv_dtype: torch.dtype) -> tuple[tuple, dict]:
    window_left = -1 if sliding_window is None else sliding_window - 1
    return ((num_heads, num_kv_heads, head_size, block_size),
            dict(window_left=window_left, sm_scale=scale, q_data_type=q_dtype,
                 kv_data_type=kv_dtype))


def _is_decode(attn_metadata: AttentionMetadata) -> bool:
    return (attn_metadata.max_query_len == 1
            and attn_metadata.num_actual_tokens == attn_metadata.num_seqs)


@dataclasses.dataclass
class FlashInferMetadata(AttentionMetadata):
    """:class:`~kvcore.AttentionMetadata` plus the wrapper :class:`FlashInferMetadataBuilder`
    planned for the step.

    Attributes:
        wrapper: the planned FlashInfer wrapper (``run`` is all a layer does).
        planned: ``(scale, sliding_window, causal)`` the plan was made for; ``causal`` is
            ``None`` for a decode plan (one query per request: causal or not is the same).
        dtype: the query and cache dtype the plan was made for.
    """

    wrapper: Any = None
    planned: tuple[float, int | None, bool | None] = (0.0, None, None)
    dtype: torch.dtype | None = None


class FlashInferMetadataBuilder(PersistentMetadataBuilder):
    """Plans FlashInfer's wrappers once per step (see the module docstring).

    The step's tensors live in the persistent buffers of
    :class:`kvcore.PersistentMetadataBuilder`; FlashInfer's page lists are made from them in
    ``build()``. A step built with ``graph_batch_size`` is planned on that size's CUDA-graph
    wrapper, whose page-list buffers (``graph_batch_size + 1``, ``graph_batch_size *
    ceil(max_model_len / block_size)`` and ``graph_batch_size`` int32) are made on the first
    build for that size, outside any capture (:class:`kvcore.CudaGraphRunner` builds each size
    before capturing it).
    """

    def __init__(self, spec, *, num_heads, max_num_seqs, max_num_batched_tokens,
                 max_model_len, device) -> None:
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        num_kv_heads = getattr(spec, "num_kv_heads", None)
        if num_kv_heads is None:
            raise TypeError(f"spec must be a kvcore.FullAttentionSpec (K/V heads), got "
                            f"{type(spec).__name__}")
        self.num_kv_heads = num_kv_heads
        #: The softmax scale every plan is made for (see the module docstring).
        self.scale = spec.head_size ** -0.5
        self.workspace = torch.zeros(FlashInferBackend.WORKSPACE_BYTES, dtype=torch.uint8,
                                     device=self.device)
        self._prefill, self._decode = _new_wrappers(self.workspace)
        self._graph_wrappers: dict[int, Any] = {}

    def _graph_wrapper(self, size: int) -> Any:
        wrapper = self._graph_wrappers.get(size)
        if wrapper is None:
            import flashinfer

            dev = self.device
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(size * self.max_blocks_per_seq,
                                                    dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=dev),
                backend="fa2")
            self._graph_wrappers[size] = wrapper
        return wrapper

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> FlashInferMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
        if meta.num_seqs == 0 or meta.num_actual_tokens == 0:
            return FlashInferMetadata(**fields)
        block_size = self.spec.block_size
        indptr, indices, last_page_len = flashinfer_page_table(meta, block_size)
        shape, options = _plan_args(self.num_heads, self.num_kv_heads, self.spec.head_size,
                                    block_size, self.scale, None, self.spec.dtype,
                                    self.spec.dtype)
        if graph_batch_size is not None or _is_decode(meta):
            wrapper = (self._graph_wrapper(graph_batch_size) if graph_batch_size is not None
                       else self._decode)
            wrapper.plan(indptr, indices, last_page_len, *shape, **options)
            causal = None
        else:
            wrapper, causal = self._prefill, meta.causal
            wrapper.plan(meta.query_start_loc, indptr, indices, last_page_len, *shape,
                         causal=causal, **options)
        return FlashInferMetadata(**fields, wrapper=wrapper, planned=(self.scale, None, causal),
                                  dtype=self.spec.dtype)


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
        shape, options = _plan_args(self.num_heads, self.num_kv_heads, self.head_size,
                                    block_size, self.scale, self.sliding_window, query.dtype,
                                    key_cache.dtype)
        if _is_decode(attn_metadata) and query.shape[0] == attn_metadata.num_seqs:
            # One query per request sees every key up to itself: causal or not is the same.
            decode.plan(indptr, indices, last_page_len, *shape, **options)
            return decode
        prefill.plan(attn_metadata.query_start_loc.to(torch.int32), indptr, indices,
                     last_page_len, *shape, causal=self.is_causal(attn_metadata), **options)
        return prefill

    def _planned_wrapper(self, query: torch.Tensor, key_cache: torch.Tensor,
                         attn_metadata: FlashInferMetadata) -> Any:
        """The builder's plan, after checking it fits this layer."""
        scale, window, causal = attn_metadata.planned
        wanted = (self.scale, self.sliding_window,
                  None if causal is None else self.is_causal(attn_metadata))
        if (not math.isclose(self.scale, scale, rel_tol=1e-6)
                or wanted[1:] != attn_metadata.planned[1:]):
            raise ValueError(
                f"this layer needs scale={self.scale}, sliding_window={self.sliding_window}"
                f"{'' if causal is None else f', causal={wanted[2]}'} but the step was "
                f"planned by FlashInferMetadataBuilder for scale={scale}, "
                f"sliding_window={window}{'' if causal is None else f', causal={causal}'} "
                "(a FlashInfer plan fixes them for every layer of a step): use a backend "
                "without per-step plans (e.g. TRITON_ATTN) for this model")
        dtypes = (query.dtype, key_cache.dtype)
        if any(d != attn_metadata.dtype for d in dtypes):
            raise ValueError(f"query is {query.dtype} and the cache {key_cache.dtype} but the "
                             f"step was planned for {attn_metadata.dtype} (the builder's "
                             "spec.dtype)")
        return attn_metadata.wrapper

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
        if isinstance(attn_metadata, FlashInferMetadata) and attn_metadata.wrapper is not None:
            wrapper = self._planned_wrapper(q, key_cache, attn_metadata)
        else:
            wrapper = self.plan(q, key_cache, attn_metadata)
        target = output[:n]
        out = target if target.is_contiguous() else torch.empty_like(q)
        wrapper.run(q, (key_cache, value_cache), out=out)
        if out is not target:
            target.copy_(out)
        return output
