"""FLASHINFER: FlashInfer's paged attention on kvcore's blocks-first NHD cache.

FlashInfer's NHD paged layout is ``(max_num_pages, 2, page_size, num_kv_heads, head_dim)``
with ``paged_kv_cache[:, 0]`` the keys: exactly kvcore's logical shape with the identity
stride order, so the layer's ``kv_cache.unbind(1)`` halves are passed as they are (FlashInfer
takes the page, token and head strides from the tensors, its SM90 kernels included; K and V
share their strides, as those require; nothing is copied).

Kernels (chosen in one place, :func:`flashinfer_kernels`, per GPU and phase):

- prefill (and prefill with a cached prefix) through ``BatchPrefillWithPagedKVCacheWrapper``
  on FlashInfer's SM90 kernels (``backend="fa3"``) on Hopper, its ``fa2`` kernels elsewhere;
  the causal mask is bottom-right aligned (the queries are the last tokens of each request),
  as kvcore's convention requires;
- decode (one new token per request) through ``BatchDecodeWithPagedKVCacheWrapper``, with
  tensor cores (FlashInfer's fa2 prefill kernel, the query heads of a K/V head packed into
  one tile) when a K/V head serves at least 2 query heads, on a layer with a sliding window
  and on an fp8 cache, else (MHA) its CUDA-core decode kernel;
- a mixed batch whose decode requests come first (the order engines schedule them in) is
  split: the decode requests run on the decode kernel, the rest on the prefill kernel, each
  writing its own rows of the output. Otherwise the whole batch runs on the prefill kernel.

The builder (:class:`FlashInferMetadataBuilder`, what an engine uses) plans once per step in
``build()``, never in ``forward``, from host-side lengths (the metadata's
``query_start_loc_cpu`` / ``seq_lens_cpu``, which :func:`kvcore.build_attention_metadata`
fills; one device read otherwise), so a build does not wait for the device: the host prepares
step N+1 while the GPU runs step N (it waits only when two builds ahead of the copies, which
read the host lists from page-locked staging slots used in turn). It owns a 128 MiB float
workspace (:data:`FlashInferBackend.WORKSPACE_BYTES`, FlashInfer's recommended size), the page
lists in device buffers sized at start-up (the used block-table entries are gathered into them
on the device), one prefill and one decode wrapper, and for every batch size a step is built
for with ``graph_batch_size`` a decode wrapper in FlashInfer's CUDA-graph mode over those
buffers: so uniform-decode steps can be captured (``CUDA_GRAPH_SUPPORT = UNIFORM_DECODE``).
FlashInfer's plan of a decode wrapper depends on the pages per request, not on the tokens in
the last page (its scheduler splits work by page counts): a decode step with the same page
counts as the last one planned on that wrapper refreshes the buffers and skips the plan (a
request crosses into a new page once every ``block_size`` steps). Only a CUDA-graph-mode
wrapper reads its page lists from buffers the builder owns (an eager one keeps private device
copies made by ``plan``), so an eager decode-only step runs on the graph-mode wrapper of its
batch size too (:data:`MAX_EAGER_DECODE_WRAPPERS` such sizes beyond the graph ones).

A layer's call is the step's :class:`FlashInferLaunch` (the planned wrappers' ``run``, the
rows each serves, the facts checked for the step), resolved once in ``build()``; the layer's
own tensors are checked in full on its first step and compared cheaply after that
(:class:`FlashInferImpl`). A wrapper's ``run`` is FlashInfer's argument work (some forty
arguments derived from the plan) before its kernel: the first layer of a plan records the
arguments and the other layers call FlashInfer's compiled module with them
(:class:`~kvcore_nvidia.backends.flashinfer_bound.BoundRun`; a value scale other than 1
goes through ``run``).
:meth:`FlashInferMetadataBuilder.warmup` builds FlashInfer's JIT modules of the configuration
at start-up.

A plan fixes the softmax scale, the sliding window, the logit soft-cap and, for prefill, the
causal mask. The builder's constructor does not receive the layers' scale and window: it plans
for ``1 / sqrt(head_size)``, no window and the soft-cap it was given (its ``logits_soft_cap``
keyword; none by default), learns the model's values from the first layer that runs (that
step planned again for them) and settles them from then on; ``forward`` refuses a layer that
needs other values than settled ones (clear error; see :class:`FlashInferMetadataBuilder`).
Soft-capping (``SUPPORTS_LOGITS_SOFT_CAP``) is FlashInfer's own: ``cap * tanh(s / cap)`` of the
scaled score, on every kernel above.
Metadata that did not come from the builder (``forward`` called with
:class:`kvcore.AttentionMetadata` directly) is planned on its first layer (the whole batch on
one wrapper, prefill or decode) and the plan kept for the next layers of the same step
(:class:`~kvcore_nvidia.backends.common.StepCache`); planning there reads the lengths back
from the device, so that path is not capturable.

fp8 caches (``kv_cache_dtype`` ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) run on FlashInfer's
mixed-precision kernels: fp16/bf16 queries and output, the fp8 K/V converted in registers, so
a decode step reads half the bytes. The plans name the cache's storage dtype; prefill is
FlashInfer's ``fa2`` then, also on Hopper (its SM90 kernels read an fp8 cache only with fp8
queries). FlashInfer takes the layer's ``k_scale`` (folded into the softmax scale) and
``v_scale`` (multiplying the output) as host floats: each layer reads its scale tensors once
and again only when they change (:class:`~kvcore_nvidia.backends.flashinfer_kernels.HostScales`:
another tensor, or the same one written in place), never inside a graph capture. The cache
write stores ``x * (1 / scale)`` as kvcore's reference does; it is kvcore's Triton kernel,
whose fp8 conversions need capability 8.9 (a selection reason below that).

Cross-layer caches: FLASHINFER opts in. FlashInfer takes the page stride from the tensors: its
prefill and decode kernels give bit-identical outputs on a layer of a cross-layer pool and on a
contiguous copy and leave the other layers untouched
(``test_flashinfer_on_a_cross_layer_view_is_bit_exact``, a GPU test; the runs are recorded in
``benchmarks/RESULTS.md``), and the conformance suite's cross-layer case passes.

The cache write is :func:`kvcore_nvidia.ops.write_kv_cache` (stride-aware, int64 offsets:
kvcore's Triton ``reshape_and_cache`` by default, the plugin's CUDA C++ kernel with
``KVCORE_NVIDIA_CACHE_WRITE=cuda``).

Modules: this one declares the backend (:class:`FlashInferBackend`) and holds the layer's
hooks (:class:`FlashInferImpl`); :mod:`kvcore_nvidia.backends.flashinfer_kernels` the kernel
choice, the wrappers and the plan arguments; :mod:`kvcore_nvidia.backends.flashinfer_pages`
the page lists (from a device block table, and on the host); and
:mod:`kvcore_nvidia.backends.flashinfer_builder` the builder, the step's metadata and its
:class:`~kvcore_nvidia.backends.flashinfer_builder.FlashInferLaunch`.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionSelectorConfig,
    AttentionType,
    CudaGraphSupport,
    DeviceCapability,
    is_uniform_decode,
)
from kvcore.ops import triton_fp8_reasons
from kvcore_nvidia.backends.common import PagedCacheImpl, StepCache, _cache_write
from kvcore_nvidia.backends.flashinfer_bound import BoundRun
from kvcore_nvidia.backends.flashinfer_builder import (
    FlashInferLaunch,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from kvcore_nvidia.backends.flashinfer_kernels import (
    WORKSPACE_BYTES,
    FlashInferKernels,
    HostScales,
    cuda_capability,
    flashinfer_kernels,
    new_wrappers,
    plan_args,
)
from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

__all__ = ["FlashInferBackend", "FlashInferImpl"]


@functools.cache
def _wrappers(device: torch.device, kernels: FlashInferKernels) -> tuple[Any, Any]:
    """The (prefill, decode) wrappers of ``device`` for metadata not made by the builder."""
    return new_wrappers(torch.zeros(FlashInferBackend.WORKSPACE_BYTES, dtype=torch.uint8,
                                    device=device), kernels)


#: ``run``'s keywords for a cache of the model's dtype (no scales).
_NO_SCALES: dict[str, float] = {}

def _launch_run(launch: FlashInferLaunch, wrapper: Any, scales: dict[str, float],
                query: torch.Tensor, kv: tuple[torch.Tensor, ...],
                output: torch.Tensor) -> None:
    """``wrapper.run(query, kv, out=output, **scales)`` through the launch's
    :class:`~kvcore_nvidia.backends.flashinfer_bound.BoundRun` of the wrapper's current plan
    (recorded on the step's first layer, again after the wrapper is planned again)."""
    key = (id(wrapper), tuple(scales.values()))
    run = launch.runs.get(key)
    if run is None or not run.current(wrapper):
        run = launch.runs[key] = BoundRun(wrapper, query, kv, output, scales)
    run(query, kv, output)


#: The last plan of the shared wrappers (every plan goes through it, so a hit means the
#: wrapper it returns still holds that plan).
_PLANS = StepCache()


class FlashInferImpl(PagedCacheImpl):
    """Cache write: :func:`kvcore_nvidia.ops.write_kv_cache`. Attention: FlashInfer (see
    module). A sliding window on a non-causal layer is refused
    (``FlashInferBackend.NON_CAUSAL_WINDOW_UNSUPPORTED``).

    With the builder's metadata a layer's ``attend`` is the step's
    :class:`FlashInferLaunch` called on its tensors: once a layer's cache passed the full
    checks against a builder's plan (its first step), later steps compare only what can change
    (the tensors' shapes, dtypes, devices and contiguity, the cache by the K/V views
    :meth:`split_kv` keeps for it (the same object, address, shape and strides), the step's
    largest block id against the cache's blocks, the plan's parameters) and fall back to the
    full checks on any difference. The layer's calls make no views of the cache after its
    first: the cache write finds its checks by the kept views too. :meth:`update_and_forward`
    writes and runs the launch on one pair of those views, in one call.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            FlashInferBackend.check_non_causal_window(self.sliding_window, causal=False)
        # (weak key view of the split_kv halves, builder signature, num_blocks, device) of the
        # cache that passed the full checks (split_kv hands those halves back only while the
        # cache object, address, shape, strides and dtype are unchanged; the weak reference
        # dies when another cache's halves replace them), and the plan parameters
        # (FlashInferLaunch.planned: a decode-only step's and a prefill step's) this layer
        # was found to fit.
        self._checked_cache: tuple | None = None
        self._checked_plans: set[tuple] = set()
        # An fp8 cache's run takes the layer's K/V scales as host floats (read once, again
        # only when they change: HostScales).
        self._host_scales = HostScales() if self.kv_cache_dtype != "auto" else None

    def plan(self, query: torch.Tensor, key_cache: torch.Tensor,
             attn_metadata: AttentionMetadata) -> Any:
        """The wrapper that runs this batch, planned (ready for ``run``).

        ``query`` is ``(num_actual_tokens, num_heads, head_size)``; ``key_cache`` one
        ``(num_blocks, block_size, num_kv_heads, head_size)`` half of the layer's cache.
        Reuses the last plan when it was made for this metadata and these parameters.
        """
        extra = (key_cache.device, key_cache.shape[1], key_cache.dtype, query.dtype,
                 self.num_heads, self.num_kv_heads, self.head_size, self.scale,
                 self.sliding_window, self.logits_soft_cap, self.is_causal(attn_metadata))
        return _PLANS.get(attn_metadata, extra,
                          lambda: self._plan(query, key_cache, attn_metadata))

    def _plan(self, query: torch.Tensor, key_cache: torch.Tensor,
              attn_metadata: AttentionMetadata) -> Any:
        block_size = key_cache.shape[1]
        indptr, indices, last_page_len = flashinfer_page_table(attn_metadata, block_size)
        kernels = flashinfer_kernels(cuda_capability(key_cache.device), self.num_heads,
                                     self.num_kv_heads, key_cache.dtype, self.sliding_window)
        prefill, decode = _wrappers(key_cache.device, kernels)
        shape, options = plan_args(self.num_heads, self.num_kv_heads, self.head_size,
                                   block_size, self.scale, self.sliding_window, query.dtype,
                                   key_cache.dtype, self.logits_soft_cap)
        if is_uniform_decode(attn_metadata) and query.shape[0] == attn_metadata.num_seqs:
            # One query per request sees every key up to itself: causal or not is the same.
            decode.plan(indptr, indices, last_page_len, *shape, **options)
            return decode
        prefill.plan(attn_metadata.query_start_loc.to(torch.int32), indptr, indices,
                     last_page_len, *shape, causal=self.is_causal(attn_metadata), **options)
        return prefill

    def _learn_plan(self, key_cache: torch.Tensor, attn_metadata: FlashInferMetadata) -> None:
        """Let the step's builder learn this layer's scale, window and soft-cap when its plan
        was made for others and its values are not settled yet (outside a graph capture); a
        layer that runs on the plan settles them."""
        builder = attn_metadata.builder
        if builder is None or builder.settled:
            return
        scale, window, cap, _ = attn_metadata.planned
        if (math.isclose(self.scale, scale, rel_tol=1e-6)
                and (self.sliding_window, self.logits_soft_cap) == (window, cap)):
            builder.settled = True
        elif not (key_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
            builder.learn_layer(attn_metadata, self.scale, self.sliding_window,
                                self.logits_soft_cap)

    def _check_plan(self, query: torch.Tensor, key_cache: torch.Tensor,
                    attn_metadata: FlashInferMetadata) -> None:
        """Refuse a layer the builder's plan does not fit."""
        scale, window, cap, causal = attn_metadata.planned
        wanted = (self.scale, self.sliding_window, self.logits_soft_cap,
                  None if causal is None else self.is_causal(attn_metadata))
        same_scale = math.isclose(self.scale, scale, rel_tol=1e-6)
        if not same_scale or wanted[1:] != attn_metadata.planned[1:]:
            # Only the soft-cap differs: the builder takes the model's.
            only_cap = same_scale and (self.sliding_window, wanted[3]) == (window, causal)
            fix = (f"build the steps with FlashInferMetadataBuilder(..., logits_soft_cap="
                   f"{self.logits_soft_cap}), the model's cap" if only_cap else
                   "give layers of other windows their own builder (as vLLM's KV-cache groups "
                   "do), or use a backend without per-step plans (e.g. TRITON_ATTN)")
            raise ValueError(
                f"this layer needs scale={self.scale}, sliding_window={self.sliding_window}, "
                f"logits_soft_cap={self.logits_soft_cap}"
                f"{'' if causal is None else f', causal={wanted[3]}'} but the step was "
                f"planned by FlashInferMetadataBuilder for scale={scale}, "
                f"sliding_window={window}, logits_soft_cap={cap}"
                f"{'' if causal is None else f', causal={causal}'} (a FlashInfer plan fixes "
                f"them for every layer of a step): {fix}")
        cache_dtype = attn_metadata.cache_dtype or attn_metadata.dtype
        if (query.dtype, key_cache.dtype) != (attn_metadata.dtype, cache_dtype):
            raise ValueError(f"query is {query.dtype} and the cache {key_cache.dtype} but the "
                             f"step was planned for a {attn_metadata.dtype} query on a "
                             f"{cache_dtype} cache (the builder's spec.dtype and "
                             "spec.kv_cache_dtype): build the step with a builder made for "
                             "this layer's spec")
        launch = attn_metadata.launch
        if launch is None:
            return
        heads, kv_heads, head_size, block_size, _, _ = launch.signature
        have = (query.shape[1], *key_cache.shape[1:])
        if have != (heads, block_size, kv_heads, head_size):
            raise ValueError(
                f"this layer has {have[0]} query heads and a cache of blocks of {have[1]} "
                f"tokens with {have[2]} K/V heads of {have[3]}, but the step was planned by "
                f"FlashInferMetadataBuilder for {heads} query heads, blocks of {block_size} "
                f"tokens, {kv_heads} K/V heads of {head_size}: build the step with a builder "
                "made for this layer's spec and num_heads")

    def check_forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      attn_metadata: AttentionMetadata, output: torch.Tensor | None) -> None:
        if self.sliding_window is not None:
            FlashInferBackend.check_non_causal_window(self.sliding_window,
                                                      self.is_causal(attn_metadata))

    def _fits(self, launch: FlashInferLaunch, query: torch.Tensor, kv: tuple,
              output: torch.Tensor) -> bool:
        """Whether this call is one the full checks already accepted, up to the step: the
        cache (its :meth:`split_kv` halves ``kv``) checked against this builder, the step's
        blocks inside it, these rows."""
        seen = self._checked_cache
        shape = launch.query_shape
        return (seen is not None and seen[0]() is kv[0] and seen[1] is launch.signature
                and launch.max_block_id < seen[2] and launch.planned in self._checked_plans
                and query.shape == shape and output.shape == shape
                and query.dtype == launch.signature[4] and output.dtype == query.dtype
                and query.device == seen[3] and output.device == seen[3]
                and query.is_contiguous() and output.is_contiguous())

    def _run(self, layer: AttentionLayer, launch: FlashInferLaunch, query: torch.Tensor,
             kv: tuple, output: torch.Tensor) -> bool:
        """Run the step's launch on this call when it fits (:meth:`_fits`); returns whether
        it did."""
        if not self._fits(launch, query, kv, output):
            return False
        scales = _NO_SCALES if self._host_scales is None else self._host_scales.kwargs(layer)
        if launch.prefill is None:
            _launch_run(launch, launch.decode, scales, query, kv, output)
        elif launch.decode is None:
            _launch_run(launch, launch.prefill, scales, query, kv, output)
        else:
            k = launch.num_decodes
            _launch_run(launch, launch.decode, scales, query[:k], kv, output[:k])
            _launch_run(launch, launch.prefill, scales, query[k:], kv, output[k:])
        return True

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        launch = attn_metadata.launch if isinstance(attn_metadata, FlashInferMetadata) else None
        if launch is None or not self._run(layer, launch, query, self.split_kv(kv_cache),
                                           output):
            self._checked_attend(layer, query, kv_cache, attn_metadata, output)

    def update_and_forward(self, layer: AttentionLayer, query: torch.Tensor,
                           key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           attn_metadata: AttentionMetadata,
                           output: torch.Tensor | None = None) -> torch.Tensor:
        """The cache write and the attention on one pair of :meth:`split_kv` views, the
        step's launch run straight after the write when the call fits it (same result and
        errors as :meth:`do_kv_cache_update` then :meth:`forward`). Metadata not from the
        builder, no ``output``, an encoder-only layer, or a subclass with its own
        :meth:`write_kv_cache` or :meth:`attend` takes the two calls."""
        launch = attn_metadata.launch if isinstance(attn_metadata, FlashInferMetadata) else None
        cls = type(self)
        if (launch is None or output is None or not self.writes_kv_cache()
                or cls.write_kv_cache is not PagedCacheImpl.write_kv_cache
                or cls.attend is not FlashInferImpl.attend):
            return super().update_and_forward(layer, query, key, value, kv_cache,
                                              attn_metadata, output)
        kv = self.split_kv(kv_cache)
        _cache_write()(key, value, kv[0], kv[1], attn_metadata.slot_mapping,
                       self.kv_cache_dtype, layer.k_scale, layer.v_scale)
        self.check_forward(query, kv_cache, attn_metadata, output)
        n = attn_metadata.num_actual_tokens
        if n:  # views of the real rows only where there are padding rows
            rows = output if output.shape[0] == n else output[:n]
            if query.shape[0] != n:
                query = query[:n]
            if not self._run(layer, launch, query, kv, rows):
                self._checked_attend(layer, query, kv_cache, attn_metadata, rows)
        return output

    def _checked_attend(self, layer: AttentionLayer, query: torch.Tensor,
                        kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                        output: torch.Tensor) -> None:
        """Every check, then the run; a builder step's cache that passes is remembered (see
        the class docstring)."""
        kv = self.checked_halves(query, kv_cache, attn_metadata, output)
        key_cache = kv[0]
        scales = _NO_SCALES if self._host_scales is None else self._host_scales.kwargs(layer)
        q = query.contiguous()
        out = output if output.is_contiguous() else torch.empty_like(q)
        if isinstance(attn_metadata, FlashInferMetadata) and (
                attn_metadata.decode_wrapper is not None
                or attn_metadata.prefill_wrapper is not None):
            self._learn_plan(key_cache, attn_metadata)
            self._check_plan(q, key_cache, attn_metadata)
            k = attn_metadata.num_decodes
            if attn_metadata.decode_wrapper is not None:
                attn_metadata.decode_wrapper.run(q[:k], kv, out=out[:k], **scales)
            if attn_metadata.prefill_wrapper is not None:
                attn_metadata.prefill_wrapper.run(q[k:], kv, out=out[k:], **scales)
            launch = attn_metadata.launch
            if launch is not None:
                self._checked_cache = (weakref.ref(key_cache), launch.signature,
                                       kv_cache.shape[0], kv_cache.device)
                self._checked_plans.add(launch.planned)
        else:
            self.plan(q, key_cache, attn_metadata).run(q, kv, out=out, **scales)
        if out is not output:
            output.copy_(out)


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged prefill/decode (``flashinfer-python``) on the NHD blocks-first cache."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    # fp8 caches on FlashInfer's mixed-precision kernels (fp16/bf16 queries, fp8 K/V read and
    # converted in registers; the layer's scales folded into the softmax scale and output).
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # The head dims FlashInfer's fa2 paged kernels are instantiated for.
    SUPPORTED_HEAD_SIZES = (64, 128, 256)
    SUPPORTED_BLOCK_SIZES = (16, 32, 64)
    # bf16 and the fa2 tensor-core paths need Ampere.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    SUPPORTS_NON_CAUSAL = True
    # FlashInfer's plans take logits_soft_cap (its soft-capped kernel variants).
    SUPPORTS_LOGITS_SOFT_CAP = True
    NON_CAUSAL_WINDOW_UNSUPPORTED = (
        "FlashInfer's window (window_left) is one-sided, so it would not cut the keys after "
        "each query that the symmetric window of a non-causal layer excludes; run such layers "
        "on FLASH_ATTN or TRITON_ATTN")
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda",)
    REQUIRED_PACKAGES = (("flashinfer", "flashinfer-python"),)
    # The cache write is kvcore's Triton kernel.
    USES_TRITON = True
    #: Bytes of the float workspace shared by the wrappers of one builder (or device).
    WORKSPACE_BYTES = WORKSPACE_BYTES
    # The builder plans every step (graph-mode decode wrappers per batch size) and forward
    # only launches: no host sync, no allocation for a contiguous output.
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE

    NAME = "FLASHINFER"
    IMPL_CLS = FlashInferImpl
    BUILDER_CLS = FlashInferMetadataBuilder

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        # An fp8 cache is written by kvcore's Triton kernel (the default cache write), whose
        # fp8 conversions need capability 8.9 on CUDA.
        return triton_fp8_reasons(config.kv_cache_dtype, device_capability)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD, FlashInfer's native paged layout; with layers, blocks outermost (cross-layer):
        # shown bit-exact on per-layer views (module docstring).
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

