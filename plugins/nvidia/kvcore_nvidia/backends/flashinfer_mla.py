"""FLASHINFER_MLA: FlashInfer's MLA kernels (``flashinfer.mla.BatchMLAPagedAttentionWrapper``)
on kvcore's latent cache.

kvcore's MLA cache ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` holds ``[kv_c, k_pe]``
per token; FlashInfer's MLA wrapper takes the compressed KV and the rope keys as two paged
tensors ``(num_pages, page_size, 512)`` and ``(num_pages, page_size, 64)`` and reads the page
and token strides from them. So the layer's cache is passed as the two views
``kv_cache[..., :512]`` and ``kv_cache[..., 512:]``: nothing is copied. The query's two parts
are passed apart as well (FlashInfer reads each by its token and head strides): the absorbed
``W_UK^T q_nope``, which :class:`kvcore.MLACommonImpl` writes into the builder's step buffer
(:meth:`kvcore.MLACommonBackend.new_step_buffers`), and ``q_pe``, a view of the layer's query
(copied into the buffer only when its channels are not contiguous or its rows not 16-byte
aligned). The kernel writes the latent output into the step buffer and ``W_UV`` the layer's
output: no concatenation, no intermediate allocated per layer.

How a step runs. The kernels are FlashInfer's ``fa3`` MLA family on Hopper and ``fa2``
elsewhere (named explicitly, :func:`_fa_backend`). Every request, prefill or decode, goes
through the absorbed path of :class:`kvcore.MLACommonImpl` and the same wrapper: they take ragged
queries (``qo_indptr``), so a mixed batch is one launch. A batch with a request of more than
one new token is planned ``causal`` (bottom-right aligned: the queries are the last tokens of
their request, as kvcore's convention requires); a decode-only batch is planned non-causal,
which for one query per request is the same attention. Long prefills pay the absorbed path's
compute (576 multiply-adds per score instead of 192); nothing is delegated to another backend.

The builder (:class:`FlashInferMLAMetadataBuilder`, what an engine uses) plans once per step
in ``build()``: it turns the step into FlashInfer's CSR page lists (``kv_indptr``,
``kv_indices`` = the used block-table entries request after request, ``kv_len_arr`` =
``seq_lens``) and plans an eager wrapper, or, for a step built with ``graph_batch_size``, that
size's wrapper in FlashInfer's CUDA-graph mode (its metadata buffers made once, on the first
build for that size, outside any capture; every later ``build()`` plans it again in place).
For a uniform decode of a fixed head count FlashInfer's plan keeps the same launch grid and
workspace offsets, so a step captured once replays for every later step of that size
(``CUDA_GRAPH_SUPPORT = UNIFORM_DECODE``). The layers' forward only launches. Metadata that
did not come from the builder (``forward`` called with :class:`kvcore.AttentionMetadata`
directly) is planned on its first layer and the plan kept for the next layers of the same
step; planning reads the step back to the host, so that path is not capturable.

The softmax scale. FlashInfer takes it in ``plan(sm_scale=...)`` only (its ``run`` has no
scale argument for the fa2/fa3 kernels), so a step is planned for one scale: the builder's
``scale`` when it was given one; else the scale of the first layer that ran a step of that
builder (:data:`DEFAULT_SCALE`, DeepSeek's ``(128 + 64) ** -0.5``, until one has, and for
good once a CUDA-graph step was built: a captured step holds the query rescaling of its
layers, so its replays must be planned for the scale it was captured with); for plain
metadata, the scale of the step's first layer. All layers of a model share one scale in
practice, so they run the plan as it is. A layer with another scale multiplies its latent
query by the ratio first (one more elementwise pass and one more rounding of the query to
the model dtype, well inside the bf16 error of the absorbed path); it is never refused.

fp8: FlashInfer's MLA kernels read an e4m3 cache with bf16 queries on Hopper (capability 9.x)
only; they take the dequantisation scale as a host float (``run(ckv_scale=, kpe_scale=)``, no
tensor form for a per-tensor scale). A tensor ``layer.k_scale`` is therefore read back on the
host, but once per step, not once per layer: a layer's first step reads its own scale and
hands the tensor to the builder, and from then on the builder reads all the layers' scale
tensors in ``build()`` (one device read per step, beside the plan's); forward takes its float
from the step's metadata and never reads the tensor. A layer that replaces its ``k_scale``
tensor is handled like a first step (the builder then reads the new tensor, not the old). A
scale is read when the step is built, so it must not change between ``build()`` and the
layer's forward. A captured step keeps the scale it was captured with (a graph replays it).
Plain metadata (no builder) reads the scale in every layer, as that path already reads the
step back to plan it.

An fp8 step is not faster than a bf16 one: FlashInfer's ``fa3`` kernel (0.7.2, what this
backend runs on Hopper) dequantises inside the kernel, tile by tile, not the cache or the
step's pages into a bf16 copy. Each 64-token tile reaches shared memory as fp8; one warpgroup
then converts the whole tile to bf16 times the scale into a shared staging tile, between two
block-wide barriers, and the bf16 tensor-core products read that. The conversion does not
overlap the products, so a decode step takes about twice a bf16 one rather than half
(``benchmarks/bench_mla_fp8_decode.py`` times both). Its other scale form, ``ckv_scale_arr``
(one scale per 128 channels of each token), takes the same path, and Hopper has no fp8-query
MLA kernel (those are Blackwell's). Nothing kvcore passes changes this (the cache's two views,
as they are); where TRITON_MLA's fp8 path is faster, the platform's ranking is what picks it.

Cross-layer caches: FLASHINFER_MLA declares the cross-layer order ``B,L,N,D`` on CUDA (the
same as TRITON_MLA). FlashInfer takes the page and token strides from the two views (int64
page offsets), and the cross-layer test families of ``test_nvidia_flashinfer_mla_gpu.py``
passed together in one H200 run: the latent write into a layer view of a cross-layer pool and
attention on it bit-identical to a contiguous copy, and write + forward on a cross-layer
allocation bit-identical to a layers-outermost one with the same history, the other layers
untouched.

The cache write is kvcore's stride-aware Triton ``reshape_and_cache``: the latent
``[kv_c, k_pe]`` (576 channels) is written as two equal halves of 288 channels, the "key" and
"value" of a one-head cache view, which is exactly the latent's bytes (fp8 with the same
scale on both halves).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any, ClassVar

import torch

from kvcore import (
    AttentionLayer,
    AttentionMetadata,
    AttentionSelectorConfig,
    CudaGraphSupport,
    DeviceCapability,
    MLAAttentionSpec,
    MLACommonBackend,
    MLACommonImpl,
    MLAMetadata,
    MLAStepViews,
    PersistentMetadataBuilder,
    is_uniform_decode,
)
from kvcore.ops import (
    FP8_KV_CACHE_DTYPES,
    check_scale,
    check_softmax_scale,
    reshape_and_cache,
    scale_value,
    validate_concat_and_cache_mla,
    validate_mla_attention,
)
from kvcore_nvidia.backends.common import (
    UNCHECKED_BLOCKS,
    StepCache,
    cumulative,
    launch_block_bound,
    used_blocks,
)

__all__ = ["DEFAULT_SCALE", "FlashInferMLABackend", "FlashInferMLAImpl", "FlashInferMLAMetadata",
           "FlashInferMLAMetadataBuilder", "mla_page_lists"]

#: The only MLA shape FlashInfer's fp8 path is built for, and DeepSeek-V2/V3's.
KV_LORA_RANK, ROPE_DIM = 512, 64
#: fp8 reads need Hopper (FlashInfer's fp8 MLA repack is SM90-only).
_FP8_CAPABILITY = DeviceCapability(9, 0)
#: The softmax scale a builder given none plans for until a layer has run one of its steps:
#: DeepSeek's ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` without YaRN.
DEFAULT_SCALE = (128 + ROPE_DIM) ** -0.5


def _check_num_heads(num_heads: int) -> None:
    reason = FlashInferMLABackend.num_heads_reason(num_heads)
    if reason:
        raise ValueError(reason)


def mla_page_lists(seq_lens: torch.Tensor, block_table: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kvcore's block table as FlashInfer's CSR page lists.

    Returns ``(kv_indptr, kv_indices)``: ``(num_seqs + 1,)`` cumulative page counts and
    ``(kv_indptr[-1],)`` the used block-table entries request after request, int32 on the
    block table's device (this reads the page count back to size ``kv_indices``).
    """
    pages, indices = used_blocks(seq_lens, block_table, block_size)
    return cumulative(pages), indices


def _check_on_gpu(kv_cache: torch.Tensor) -> None:
    if kv_cache.device.type != "cuda":
        raise ValueError(f"kv_cache is on {kv_cache.device}; FLASHINFER_MLA runs "
                         "FlashInfer's CUDA kernels on GPU tensors")


def _new_wrapper(workspace: torch.Tensor, size: int | None = None,
                 max_pages: int = 0) -> Any:
    """An eager wrapper, or (``size`` given) one in CUDA-graph mode with its metadata buffers
    for ``size`` requests of at most ``max_pages`` pages in all."""
    import flashinfer.mla

    backend = _fa_backend(workspace.device)
    if size is None:
        return flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    dev = workspace.device

    def buf(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=dev)

    return flashinfer.mla.BatchMLAPagedAttentionWrapper(
        workspace, use_cuda_graph=True, qo_indptr=buf(size + 1), kv_indptr=buf(size + 1),
        kv_indices=buf(max(max_pages, 1)), kv_len_arr=buf(size), backend=backend)


def _fa_backend(device: torch.device) -> str:
    """FlashInfer's MLA kernel family used: ``fa3`` on Hopper (FlashInfer's own test for it),
    ``fa2`` elsewhere.

    Named explicitly (not FlashInfer's ``auto``, which picks these two on Ampere and Hopper
    too): both schedule on the host and both can be planned again in CUDA-graph mode; other
    families differ in these.
    """
    from flashinfer.utils import is_sm90a_supported  # Hopper with a CUDA >= 12.3 torch

    return "fa3" if is_sm90a_supported(device) else "fa2"


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a wrapper was planned for: the checks a layer's forward makes before it runs."""

    num_heads: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int


def _plan(wrapper: Any, meta: AttentionMetadata, num_heads: int, block_size: int,
          q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> _Plan:
    """Plan ``wrapper`` for the step ``meta`` with softmax ``scale`` (host sync: FlashInfer
    schedules on the host)."""
    import flashinfer.mla

    kv_indptr, kv_indices = mla_page_lists(meta.seq_lens, meta.block_table, block_size)
    # FlashInfer takes contiguous int32 metadata; the builder's buffers already are.
    metadata = flashinfer.mla.MLAPlanMetadata.csr(
        meta.query_start_loc.to(torch.int32).contiguous(), kv_indptr, kv_indices,
        meta.seq_lens.to(torch.int32).contiguous())
    try:
        wrapper.plan(metadata=metadata, num_heads=num_heads, head_dim_ckv=KV_LORA_RANK,
                     head_dim_kpe=ROPE_DIM, page_size=block_size,
                     causal=not is_uniform_decode(meta), sm_scale=scale, q_data_type=q_dtype,
                     kv_data_type=kv_dtype, query_layout="split", kv_cache_layout="split")
    except ValueError as exc:  # FlashInfer's refusals (work-item capacity, shapes) are these
        raise ValueError(
            f"FlashInfer cannot plan this MLA step ({meta.num_seqs} requests, "
            f"{meta.num_actual_tokens} tokens, longest {meta.max_seq_len}, {num_heads} heads): "
            f"{exc}; run fewer tokens per step or use TRITON_MLA") from exc
    return _Plan(num_heads, q_dtype, kv_dtype, block_size)


def _run(wrapper: Any, planned_scale: float, scale: float, q_nope: torch.Tensor,
         q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
         kv_scale: float | None) -> None:
    """Run ``wrapper`` (planned for softmax ``planned_scale``) for a layer of softmax
    ``scale``: a different scale is carried by the query (see the module docstring)."""
    if not math.isclose(scale, planned_scale, rel_tol=1e-6):
        ratio = scale / planned_scale
        q_nope, q_pe = q_nope * ratio, q_pe * ratio
    fp8 = {} if kv_scale is None else {"ckv_scale": kv_scale, "kpe_scale": kv_scale}
    wrapper.run(query=(q_nope, q_pe),
                kv_cache=(kv_cache[..., :KV_LORA_RANK], kv_cache[..., KV_LORA_RANK:]),
                out=out, **fp8)


def _readable(q_pe: torch.Tensor) -> bool:
    """Whether FlashInfer's kernels can read ``q_pe`` in place: contiguous channels, rows and
    heads 16-byte aligned (its loads are 16-byte vectors)."""
    size = q_pe.element_size()
    return (q_pe.stride(2) == 1 and q_pe.data_ptr() % 16 == 0
            and (q_pe.stride(0) * size) % 16 == 0 and (q_pe.stride(1) * size) % 16 == 0)


@dataclasses.dataclass
class FlashInferMLAMetadata(MLAMetadata):
    """:class:`~kvcore.MLAMetadata` (the step's views of the builder's buffers) plus the
    wrapper :class:`FlashInferMLAMetadataBuilder` planned for the step.

    Attributes:
        wrapper: the planned ``BatchMLAPagedAttentionWrapper`` (``None`` for an empty step).
        plan: the heads, dtypes and block size it was planned for.
        scale: the softmax scale it was planned for.
        builder: the builder that planned it (a layer tells it the model's scale and hands it
            its fp8 scale tensor).
        kv_scales: the values of the layers' fp8 scale tensors at this step, read by the
            builder, keyed by ``id(tensor)`` (see the module docstring).
        max_block_id: the largest block id the step uses (from its checked facts; ``-1``
            with value checks off): a layer whose cache passed the full checks once compares
            only this with its block count.
    """

    wrapper: Any = None
    plan: _Plan | None = None
    scale: float | None = None
    builder: FlashInferMLAMetadataBuilder | None = None
    kv_scales: dict[int, float] = dataclasses.field(default_factory=dict)
    max_block_id: int = UNCHECKED_BLOCKS


class FlashInferMLAMetadataBuilder(PersistentMetadataBuilder):
    """Plans FlashInfer's MLA wrapper once per step (see the module docstring).

    The step's tensors live in the persistent buffers of
    :class:`kvcore.PersistentMetadataBuilder`. The builder owns a float workspace of
    :attr:`FlashInferMLABackend.WORKSPACE_BYTES`, one eager wrapper, and one CUDA-graph
    wrapper per ``graph_batch_size`` it was asked for, with metadata buffers of
    ``graph_batch_size + 1``, ``graph_batch_size + 1``, ``graph_batch_size *
    ceil(max_model_len / block_size)`` and ``graph_batch_size`` int32 made on its first build
    (:class:`kvcore.CudaGraphRunner` builds each size before capturing it). ``spec`` must be a
    :class:`kvcore.MLAAttentionSpec` of kv_lora_rank 512 and rope 64; ``num_heads`` one of
    :attr:`FlashInferMLABackend.SUPPORTED_NUM_HEADS`.

    ``scale`` (optional, beyond the arguments every builder takes): the layers' softmax scale,
    which every step is planned for. Without it the builder plans for :data:`DEFAULT_SCALE`
    until a layer runs one of its steps, then for that layer's scale (see the module
    docstring); :attr:`scale` is the one it plans for now.

    The fp8 scale tensors the layers hand it (:meth:`add_kv_scale`) are read once per
    ``build()``, all in one device read, into the step's ``kv_scales``.
    """

    def __init__(self, spec, *, num_heads, max_num_seqs, max_num_batched_tokens,
                 max_model_len, device, scale: float | None = None) -> None:
        if not isinstance(spec, MLAAttentionSpec):
            raise TypeError(f"spec must be a kvcore.MLAAttentionSpec (latent cache), got "
                            f"{type(spec).__name__}")
        if (spec.kv_lora_rank, spec.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
            raise ValueError(f"spec has kv_lora_rank={spec.kv_lora_rank}, qk_rope_head_dim="
                             f"{spec.qk_rope_head_dim}; FLASHINFER_MLA supports "
                             f"{KV_LORA_RANK} and {ROPE_DIM}")
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        _check_num_heads(self.num_heads)
        if scale is not None:
            check_softmax_scale(scale)
        #: The softmax scale steps are planned for.
        self.scale = DEFAULT_SCALE if scale is None else float(scale)
        self._scale_known = scale is not None
        with torch.inference_mode(False):
            self.workspace = torch.zeros(FlashInferMLABackend.WORKSPACE_BYTES,
                                         dtype=torch.uint8, device=self.device)
        self._eager = _new_wrapper(self.workspace)
        self._graph_wrappers: dict[int, Any] = {}
        #: The absorbed forward's intermediates (latent query and output) for every step.
        self.step_buffers = FlashInferMLABackend.new_step_buffers(
            spec, num_heads=num_heads, max_num_tokens=max_num_batched_tokens, device=self.device)
        # What every step is planned for, one object: a layer checked against it once
        # compares it by identity afterwards.
        self._planned = _Plan(self.num_heads, spec.dtype, spec.cache_dtype, spec.block_size)
        #: Each layer's current fp8 scale tensor, by ``id(layer)`` (the layer is held, so its
        #: id cannot be recycled).
        self._kv_scale_tensors: dict[int, tuple[AttentionLayer, torch.Tensor]] = {}
        #: Scale tensors a layer replaced during the current step: held until the next
        #: ``build()``, so no new tensor can take the id the step's ``kv_scales`` knows them by.
        self._replaced: list[torch.Tensor] = []

    def layer_scale(self, scale: float) -> None:
        """A layer of ``scale`` ran a step of this builder: without a ``scale`` given at
        construction, and before any CUDA-graph step was built, the first such layer's is the
        one later steps are planned for."""
        if not self._scale_known:
            self.scale, self._scale_known = scale, True

    def add_kv_scale(self, layer: AttentionLayer, k_scale: torch.Tensor) -> None:
        """``layer``'s fp8 scale tensor, read from the next ``build()`` on (once per step); it
        replaces the tensor ``layer`` handed before, which is then no longer read or held."""
        previous = self._kv_scale_tensors.get(id(layer))
        if previous is not None and previous[1] is not k_scale:
            self._replaced.append(previous[1])
        self._kv_scale_tensors[id(layer)] = (layer, k_scale)

    def _read_kv_scales(self) -> dict[int, float]:
        """Every known scale tensor's value, in one read back to the host."""
        self._replaced.clear()  # a new step: no metadata still in use knows their ids
        tensors = {id(t): t for _, t in self._kv_scale_tensors.values()}
        if not tensors:
            return {}
        values = torch.stack([t.detach().reshape(()).to(self.device, torch.float64)
                              for t in tensors.values()]).tolist()
        return dict(zip(tensors, values, strict=True))

    def _graph_wrapper(self, size: int) -> Any:
        wrapper = self._graph_wrappers.get(size)
        if wrapper is None:
            # A step captured now bakes the layers' query rescaling (scale / planned scale)
            # into the graph, so the planned scale is fixed from here on: a replay re-planned
            # for another scale would apply the ratio twice.
            self._scale_known = True
            wrapper = _new_wrapper(self.workspace, size, size * self.max_blocks_per_seq)
            self._graph_wrappers[size] = wrapper
        return wrapper

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> FlashInferMLAMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        if meta.num_seqs == 0 or meta.num_actual_tokens == 0:
            return meta.extend(FlashInferMLAMetadata)
        wrapper = (self._eager if graph_batch_size is None
                   else self._graph_wrapper(graph_batch_size))
        _plan(wrapper, meta, self.num_heads, self.spec.block_size, self.spec.dtype,
              self.spec.cache_dtype, self.scale)
        return meta.extend(FlashInferMLAMetadata, wrapper=wrapper, plan=self._planned,
                           scale=self.scale, builder=self, kv_scales=self._read_kv_scales(),
                           mla_views=self.step_buffers.for_step(meta.num_actual_tokens),
                           max_block_id=launch_block_bound(meta, graph_batch_size))


@functools.cache
def _device_wrapper(device: torch.device) -> Any:
    """The eager wrapper of ``device`` for metadata not made by the builder."""
    return _new_wrapper(torch.zeros(FlashInferMLABackend.WORKSPACE_BYTES, dtype=torch.uint8,
                                    device=device))


#: The last plan of the device wrappers (every such plan goes through it, so a hit means the
#: wrapper it returns still holds that plan).
_PLANS = StepCache()


class FlashInferMLAImpl(MLACommonImpl):
    """:class:`kvcore.MLACommonImpl` on FlashInfer's MLA kernels (the same arguments as
    CPU_MLA's and TRITON_MLA's; see the module docstring).

    With the builder's metadata and a bf16/fp16 cache, a layer's latent attention is checked
    in full on its first step; later steps on the same cache and builder plan compare only
    what can change (the cache object, the step's largest block id against its blocks, the
    planned scale, ``q_pe``'s dtype and strides) and call the planned wrapper's ``run``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (weak cache, data pointer, num_blocks, the builder's plan) that passed the checks.
        self._checked_cache: tuple | None = None
        _check_num_heads(self.num_heads)
        if self.kv_lora_rank != KV_LORA_RANK:
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank}: FLASHINFER_MLA supports "
                             f"{KV_LORA_RANK} (with qk_rope_head_dim={ROPE_DIM})")
        if self.kv_cache_dtype not in FlashInferMLABackend.SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} (FLASHINFER_MLA supports "
                f"{', '.join(FlashInferMLABackend.SUPPORTED_KV_CACHE_DTYPES)})")

    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write latents: ``key`` = ``kv_c`` ``(num_tokens, kv_lora_rank)``, ``value`` =
        ``k_pe`` ``(num_tokens, [1,] qk_rope_head_dim)``; fp8 caches use ``layer.k_scale``.

        One launch of :func:`kvcore.ops.reshape_and_cache` on the latent's two 288-channel
        halves (see the module docstring); stride-aware, int64 offsets, negative slots
        skipped.
        """
        k_pe = validate_concat_and_cache_mla(key, value, kv_cache, slot_mapping,
                                             self.kv_cache_dtype, layer.k_scale)
        half = kv_cache.shape[-1] // 2
        latent = torch.cat([key, k_pe], dim=-1)[:, None, :]
        cache = kv_cache[:, :, None, :]
        reshape_and_cache(latent[..., :half], latent[..., half:], cache[..., :half],
                          cache[..., half:], slot_mapping, self.kv_cache_dtype, layer.k_scale,
                          layer.k_scale)

    def _fp8_scale(self, layer: AttentionLayer, meta: AttentionMetadata) -> float | None:
        """The cache's dequantisation scale as a float (``None`` for a bf16/fp16 cache): for a
        tensor, the value the builder read for this step; read here only on the layer's first
        step (which hands the tensor to the builder) and for plain metadata."""
        if self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            return None
        scale = layer.k_scale
        check_scale("k_scale", scale)  # its type and size; the value is checked as a float
        if not isinstance(scale, torch.Tensor):
            return scale_value(scale)
        step = meta if isinstance(meta, FlashInferMLAMetadata) else None
        if step is not None and id(scale) in step.kv_scales:
            return step.kv_scales[id(scale)]
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "FLASHINFER_MLA takes the fp8 cache scale as a host float: run the step once "
                "eagerly before capturing it, so the layer's k_scale tensor is read outside "
                "the capture (CudaGraphRunner.capture does)")
        value = scale_value(scale)
        if step is not None and step.builder is not None:
            step.builder.add_kv_scale(layer, scale)
            step.kv_scales[id(scale)] = value  # a capture of this step reuses it
        return value

    def _planned(self, q: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[Any, float]:
        """The wrapper planned for this step and the softmax scale it was planned for: the
        builder's, checked against this layer, or one planned here on the step's first
        layer."""
        want = _Plan(self.num_heads, q.dtype, kv_cache.dtype, kv_cache.shape[1])
        if isinstance(meta, FlashInferMLAMetadata) and meta.wrapper is not None:
            if meta.plan != want:
                raise ValueError(
                    f"this layer runs {want.num_heads} heads, query {want.q_dtype}, cache "
                    f"{want.kv_dtype} in blocks of {want.block_size}, but the step was planned "
                    f"by FlashInferMLAMetadataBuilder for {meta.plan.num_heads} heads, query "
                    f"{meta.plan.q_dtype}, cache {meta.plan.kv_dtype}, blocks of "
                    f"{meta.plan.block_size}: build the step with a builder made for this "
                    "layer's spec and num_heads")
            if meta.builder is not None:
                meta.builder.layer_scale(self.scale)
                if (meta.scale != meta.builder.scale == self.scale
                        and not (kv_cache.is_cuda and torch.cuda.is_current_stream_capturing())):
                    # Planned before any layer told the builder the model's scale: plan the
                    # step again at it, so a first step gives bit for bit what a later one
                    # does (a query scaled by the ratio of the scales rounds differently).
                    _plan(meta.wrapper, meta, self.num_heads, meta.plan.block_size,
                          meta.plan.q_dtype, meta.plan.kv_dtype, self.scale)
                    meta.scale = self.scale
            return meta.wrapper, meta.scale

        def plan() -> tuple[Any, float]:
            wrapper = _device_wrapper(kv_cache.device)
            _plan(wrapper, meta, self.num_heads, kv_cache.shape[1], q.dtype, kv_cache.dtype,
                  self.scale)
            return wrapper, self.scale

        return _PLANS.get(meta, (kv_cache.device, want), plan)

    def _latent_attention(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                          attn_metadata: AttentionMetadata) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads, self.kv_lora_rank)
        self._checked_run(layer, q, q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:], kv_cache,
                          attn_metadata, out)
        return out

    def _latent_attention_into(self, layer: AttentionLayer, views: MLAStepViews,
                               q_pe: torch.Tensor, kv_cache: torch.Tensor,
                               attn_metadata: AttentionMetadata) -> None:
        """FlashInfer reads the absorbed query (``views.q_nope``) and ``q_pe`` apart and writes
        ``views.o_latent`` (see the class docstring for the short path)."""
        m = attn_metadata
        seen = self._checked_cache
        if (seen is not None and isinstance(m, FlashInferMLAMetadata) and m.plan is seen[3]
                and seen[0]() is kv_cache and kv_cache.data_ptr() == seen[1]
                and m.max_block_id < seen[2] and m.scale == self.scale
                and q_pe.dtype == m.plan.q_dtype and _readable(q_pe)):
            m.wrapper.run(query=(views.q_nope, q_pe),
                          kv_cache=(kv_cache[..., :KV_LORA_RANK], kv_cache[..., KV_LORA_RANK:]),
                          out=views.o_latent)
            return
        if not _readable(q_pe):
            views.q_rope.copy_(q_pe)
            q_pe = views.q_rope
        self._checked_run(layer, views.q_latent, views.q_nope, q_pe, kv_cache, m,
                          views.o_latent)

    def _checked_run(self, layer: AttentionLayer, q: torch.Tensor, q_nope: torch.Tensor,
                     q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     attn_metadata: AttentionMetadata, out: torch.Tensor) -> None:
        """Every check (``q``: the ``(num_tokens, num_heads, 576)`` latent query the two
        parts belong to, for the shape checks), then the run; a builder step's bf16/fp16
        cache that passes at the planned scale is remembered for the short path."""
        m = attn_metadata
        kv_scale = self._fp8_scale(layer, m)
        # The float, not the tensor: the check then reads nothing back from the device.
        validate_mla_attention(q, kv_cache, self.kv_lora_rank, m.query_start_loc, m.seq_lens,
                               m.block_table, self.scale, self.kv_cache_dtype,
                               layer.k_scale if kv_scale is None else kv_scale, None)
        _check_on_gpu(kv_cache)
        if kv_cache.stride(-1) != 1:
            raise ValueError(f"kv_cache has strides {kv_cache.stride()}; FlashInfer reads "
                             "each latent's channels contiguously (last stride 1)")
        wrapper, planned_scale = self._planned(q, kv_cache, m)
        _run(wrapper, planned_scale, self.scale, q_nope, q_pe, kv_cache, out, kv_scale)
        if (isinstance(m, FlashInferMLAMetadata) and m.wrapper is not None and kv_scale is None
                and planned_scale == self.scale):
            self._checked_cache = (weakref.ref(kv_cache), kv_cache.data_ptr(),
                                   kv_cache.shape[0], m.plan)


class FlashInferMLABackend(MLACommonBackend):
    """FlashInfer's paged MLA kernels (``flashinfer-python``) on the latent cache."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    # FlashInfer's fp8 MLA cache is e4m3 (``"fp8"`` is e4m3 in kvcore); e5m2 is not read.
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
    # kv_lora_rank 512 + rope 64: the dims FlashInfer's MLA kernels are built and tested for.
    SUPPORTED_HEAD_SIZES = (KV_LORA_RANK + ROPE_DIM,)
    # FlashInfer's kernels take any page size; these are the ones the GPU tests run.
    SUPPORTED_BLOCK_SIZES = (16, 32, 64)
    #: Query heads per layer (per rank): FlashInfer tiles (query x head) rows by 64 or 128, and
    #: its causal tiling is exact only when the head count divides the tile.
    SUPPORTED_NUM_HEADS: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64, 128)
    # FlashInfer's fa2 MLA kernels need Ampere; Hopper runs its fa3 kernels.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    PLATFORMS = ("cuda",)
    # The cache write is kvcore's Triton kernel.
    USES_TRITON = True
    REQUIRED_PACKAGES = (("flashinfer", "flashinfer-python"),)
    #: Bytes of the float workspace of one builder (or device): FlashInfer's recommended size.
    WORKSPACE_BYTES: ClassVar[int] = 128 * 1024 * 1024
    # The builder plans every step (graph-mode wrappers per batch size) and reads the fp8
    # scales; forward only launches: no host sync, no plan.
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE
    # The cross-layer tests ran on NVIDIA (module docstring); CUDA is this backend's platform.
    CROSS_LAYER_PLATFORMS = ("cuda",)

    NAME = "FLASHINFER_MLA"
    IMPL_CLS = FlashInferMLAImpl
    BUILDER_CLS = FlashInferMLAMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """``B,N,D``; with layers ``B,L,N,D`` (cross-layer): FlashInfer reads the page stride
        of each layer's view."""
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        """FlashInfer reads an fp8 MLA cache with bf16 queries on Hopper (9.x) only."""
        if config.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            return []
        reasons = []
        if config.dtype != torch.bfloat16:
            reasons.append(f"kv_cache_dtype={config.kv_cache_dtype} with dtype="
                           f"{str(config.dtype).removeprefix('torch.')}: FlashInfer's fp8 MLA "
                           "kernels take bfloat16 queries only; use dtype=bfloat16 or "
                           "kv_cache_dtype=auto")
        if device_capability is not None and device_capability.major != 9:
            reasons.append(f"kv_cache_dtype={config.kv_cache_dtype} needs device capability "
                           f"9.x (Hopper) for FlashInfer's fp8 MLA kernels (got "
                           f"{device_capability}); use kv_cache_dtype=auto")
        return reasons

    @classmethod
    def num_heads_reason(cls, num_heads: int) -> str | None:
        """Why ``num_heads`` query heads per layer cannot run, or ``None``."""
        if num_heads in cls.SUPPORTED_NUM_HEADS:
            return None
        return (f"num_heads={num_heads} (FLASHINFER_MLA supports "
                f"{', '.join(map(str, cls.SUPPORTED_NUM_HEADS))} query heads per layer: "
                "FlashInfer's causal MLA tiles are exact only for these); use TRITON_MLA")
