"""FLASHINFER's builder: :class:`FlashInferMetadataBuilder` plans FlashInfer's wrappers once
per step from host-side lengths, in page-locked staging, and resolves the step's
:class:`FlashInferLaunch`, which every layer's ``attend`` runs (see
:mod:`kvcore_nvidia.backends.flashinfer`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import numpy as np
import torch

from kvcore import (
    AttentionMetadata,
    PersistentMetadataBuilder,
    build_attention_metadata,
    is_uniform_decode,
    long_step,
)
from kvcore.ops import StepFacts
from kvcore_nvidia.backends.common import (
    UNCHECKED_BLOCKS,
    HostStaging,
    StagingSlot,
    current_cuda_stream,
    launch_block_bound,
)
from kvcore_nvidia.backends.flashinfer_kernels import (
    WORKSPACE_BYTES,
    FlashInferKernels,
    cuda_capability,
    flashinfer_kernels,
    new_wrappers,
    plan_args,
)
from kvcore_nvidia.backends.flashinfer_pages import HostPages
from kvcore_nvidia.caches import flashinfer_jit_cache

__all__ = ["MAX_EAGER_DECODE_WRAPPERS", "FlashInferLaunch", "FlashInferMetadata",
           "FlashInferMetadataBuilder"]


#: Batch sizes of eager decode-only steps that get a CUDA-graph-mode decode wrapper of their
#: own (beyond the sizes graph steps were built for), least recently used dropped first: such
#: a wrapper reads the builder's persistent page-list buffers, so a step whose page counts are
#: those of its last plan refreshes the buffers and skips FlashInfer's ``plan``. Each costs
#: FlashInfer's int workspace (8 MiB on the device and 8 MiB page-locked in FlashInfer 0.7).
MAX_EAGER_DECODE_WRAPPERS = 4

@dataclasses.dataclass(frozen=True, slots=True)
class FlashInferLaunch:
    """What every layer of a step launches, resolved once in
    :meth:`FlashInferMetadataBuilder.build` (so a layer's ``attend`` makes no plan, builds no
    arguments and repeats no check the step already passed).

    Attributes:
        decode: the planned decode wrapper (rows ``[0, num_decodes)``), or ``None``.
        prefill: the planned prefill wrapper (rows ``[num_decodes, num_actual_tokens)``), or
            ``None``.
        num_decodes: query rows the decode wrapper serves.
        query_shape: ``(num_actual_tokens, num_heads, head_size)``: the query and output rows
            a layer of this step passes (the plan's).
        signature: the builder's ``(num_heads, num_kv_heads, head_size, block_size, dtype,
            cache_dtype)``,
            one object for all its steps: a layer whose cache was checked against it once
            skips that check in later steps.
        max_block_id: the largest block id the step uses (from the step's checked facts;
            ``-1`` with value checks off): a layer's cache must have more blocks.
        planned: ``(scale, sliding_window, logits_soft_cap, causal)`` the plans were made
            for (as :attr:`FlashInferMetadata.planned`).
        runs: the wrappers' recorded runs
            (:class:`~kvcore_nvidia.backends.flashinfer_bound.BoundRun`) by wrapper and
            scales, filled by the layers' calls; each is checked against its wrapper's
            current plan when used.
    """

    decode: Any
    prefill: Any
    num_decodes: int
    query_shape: tuple[int, int, int]
    signature: tuple
    max_block_id: int
    planned: tuple[float, int | None, float | None, bool | None]
    runs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass
class FlashInferMetadata(AttentionMetadata):
    """:class:`~kvcore.AttentionMetadata` plus the wrappers :class:`FlashInferMetadataBuilder`
    planned for the step.

    Attributes:
        decode_wrapper: planned for the first ``num_decodes`` requests (one query token each:
            query rows ``[0, num_decodes)``), or ``None``.
        prefill_wrapper: planned for the other requests (rows ``[num_decodes,
            num_actual_tokens)``), or ``None``.
        num_decodes: requests (and query rows) the decode wrapper serves.
        planned: ``(scale, sliding_window, logits_soft_cap, causal)`` the plans were made
            for; ``causal`` is ``None`` for a decode-only step (one query per request: causal
            or not is the same).
        dtype: the query (and output) dtype the plans were made for.
        cache_dtype: the cache's storage dtype the plans were made for (``dtype``, or an fp8
            dtype for an fp8 cache).
        launch: the step's :class:`FlashInferLaunch` (``None`` for an empty step).
        builder: the :class:`FlashInferMetadataBuilder` that planned the step (it learns the
            model's scale, window and soft-cap from the first layer, see its docstring).
        graph_batch_size: the ``graph_batch_size`` the step was built with.
    """

    decode_wrapper: Any = None
    prefill_wrapper: Any = None
    num_decodes: int = 0
    planned: tuple[float, int | None, float | None, bool | None] = (0.0, None, None, None)
    dtype: torch.dtype | None = None
    cache_dtype: torch.dtype | None = None
    launch: FlashInferLaunch | None = None
    builder: Any = None
    graph_batch_size: int | None = None


class FlashInferMetadataBuilder(PersistentMetadataBuilder):
    """Plans FlashInfer's wrappers once per step (see
    :mod:`kvcore_nvidia.backends.flashinfer`).

    The step's tensors live in the persistent buffers of
    :class:`kvcore.PersistentMetadataBuilder`; FlashInfer's page lists are made on the host
    from the step's host-side lengths, and the used block-table entries gathered on the device
    into a buffer of ``max_num_seqs * ceil(max_model_len / block_size)`` int32 (beside it the
    same number of int64 gather positions, and ``max_num_seqs + 1`` / ``max_num_seqs`` int32
    for ``indptr`` / ``last_page_len``, the buffers of the CUDA-graph decode wrappers). A
    step built with ``graph_batch_size`` is planned on that size's CUDA-graph wrapper, made on
    the first build for that size, outside any capture (:class:`kvcore.CudaGraphRunner`
    builds each size before capturing it).

    Host side, a step costs little and allocates nothing: its host lists are computed with
    numpy straight into a slot of :class:`~kvcore_nvidia.backends.common.HostStaging`
    (page-locked on a GPU, two slots used in turn, each :meth:`HostPages.words`
    ``(max_num_seqs)`` int32 plus the gather positions above), whose copies to the device
    run asynchronously; the gather positions are recomputed and copied only when the page
    counts change, and a CUDA-graph decode step with the page counts of its last plan copies
    only ``last_page_len`` (and ``indptr`` when another batch size's step overwrote it).
    Such a decode step (eager or captured) costs the base builder's tensor ops and three
    more: the host lengths into staging, the gather of the used block-table entries and that
    copy; ``indptr`` (and a decode's query rows) stay on the host from the slot's last step
    with those page counts, and the views the copies take are made once.
    FlashInfer's ``plan`` reads these host lists (its scheduler) and enqueues copies from
    them; the slot's event is recorded after the last plan of the step, so a slot is
    rewritten only once those copies have run.

    A plan fixes the softmax scale, the sliding window and the logit soft-cap for every layer
    of the step. The builder starts from ``1 / sqrt(head_size)``, the spec's window
    (``FullAttentionSpec.sliding_window``: an engine that gives each window its own builder
    says it there; ``None``: none) and ``logits_soft_cap`` (keyword, beyond the builder
    contract: the model's cap when the engine knows it, e.g. Gemma 2's 50.0; ``None`` by
    default), and **learns the model's values from
    the first layer that runs**: if that layer needs others, the step is planned again for
    them (bit for bit what a step planned for them from the start gives) and every later step
    is planned for them. Once a layer ran on the builder's values (or a step was captured into
    a CUDA graph) they are settled: a layer that needs others is refused by its ``forward``
    (layers of one builder share one plan; vLLM gives each window its own KV-cache group and
    builder). A step whose first layer runs inside a graph capture is not re-planned there:
    run one eager step first (``CudaGraphRunner`` does) or pass ``logits_soft_cap``.

    Attributes:
        kernels: the :class:`FlashInferKernels` the steps run on.
        plans: plans made so far (a CUDA-graph decode step whose page counts did not change
            refreshes the buffers instead).
    """

    def __init__(self, spec, *, num_heads, max_num_seqs, max_num_batched_tokens,
                 max_model_len, device, logits_soft_cap: float | None = None) -> None:
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        if logits_soft_cap is not None and (
                isinstance(logits_soft_cap, bool)
                or not isinstance(logits_soft_cap, (int, float))
                or not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0)):
            raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be None or a finite "
                             "float > 0 (the layers' AttentionImpl logits_soft_cap)")
        num_kv_heads = self.spec_kv_heads()
        self.num_kv_heads = num_kv_heads
        #: The softmax scale every plan is made for (see the backend's module).
        self.scale = spec.head_size ** -0.5
        #: The logit soft-cap every plan is made for (``None``: none).
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        #: The sliding window every plan is made for (``None``: none).
        self.sliding_window: int | None = getattr(spec, "sliding_window", None)
        #: Whether the plan parameters above are the model's (a layer ran on them, or a step
        #: was captured): from then on they are never changed (see the class docstring).
        self.settled = False
        self.kernels = self._kernels()
        self.plans = 0
        dev = self.device
        cuda = dev.type == "cuda"
        entries = max_num_seqs * self.max_blocks_per_seq
        with torch.inference_mode(False):
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            self._indices = torch.zeros(entries, dtype=torch.int32, device=dev)
            self._positions = torch.zeros(entries, dtype=torch.int64, device=dev)
            self._indptr = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=dev)
            self._last_page_len = torch.zeros(max_num_seqs, dtype=torch.int32, device=dev)
            self._staging = HostStaging(
                {"lists": (HostPages.words(max_num_seqs), torch.int32),
                 "positions": (entries, torch.int64)},
                slots=2, pin=cuda, new_event=torch.cuda.Event if cuda else None,
                stream=functools.partial(current_cuda_stream, dev) if cuda else None)
        self._flat_table = self.block_table.view(-1)
        # The HostPages laid out in each staging slot, per batch size (refilled each step),
        # and the one each slot (by address) was last refilled through: another size's
        # layout of the same memory overwrote what a refill would keep.
        self._lists: dict[tuple[int, int], HostPages] = {}
        self._slot_lists: dict[int, HostPages] = {}
        # Per batch size, the views of _indptr and _last_page_len its graph-mode wrapper
        # reads (made with the wrapper).
        self._graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._new_wrappers()
        #: What a layer's cache is checked against once (FlashInferLaunch.signature).
        self.signature = (num_heads, num_kv_heads, spec.head_size, spec.block_size, spec.dtype,
                          spec.cache_dtype)
        # Page counts self._positions holds the gather positions of (and the views of
        # _positions and _indices their total takes), and those whose indptr self._indptr
        # holds (the graph wrappers of all sizes share it).
        self._gathered: bytes | None = None
        self._gather_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._indptr_holds: bytes | None = None
        # The facts this step's check() established (None: value checks off).
        self._facts: StepFacts | None = None

    def _kernels(self) -> FlashInferKernels:
        return flashinfer_kernels(cuda_capability(self.device), self.num_heads,
                                  self.num_kv_heads, self.spec.cache_dtype, self.sliding_window)

    def _new_wrappers(self) -> None:
        """The eager wrappers for :attr:`kernels`, and no graph-mode ones yet (made per batch
        size when first used)."""
        self._prefill, self._decode = new_wrappers(self.workspace, self.kernels)
        self._graph_wrappers: dict[int, Any] = {}
        # Sizes whose graph-mode wrapper only eager decode steps use, oldest first (see
        # MAX_EAGER_DECODE_WRAPPERS); a graph build of a size makes its wrapper permanent.
        self._eager_sizes: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Page counts (HostPages.page_counts_key) each CUDA-graph wrapper was last planned for
        # (the plan depends on them).
        self._graph_plans: dict[int, bytes] = {}
        # Per wrapper: an event after its last plan. FlashInfer stages a plan in the wrapper's
        # page-locked buffer and copies it to the device asynchronously; the next plan of that
        # wrapper waits for that copy (the previous step's), not for the device to be idle.
        self._plan_events: dict[int, Any] = {}
        # The FlashInferLaunch of each choice (_metadata), keyed by the wrappers' ids (the
        # launch keeps its wrappers, so their ids are not reused while it is here).
        self._launches: dict[tuple, FlashInferLaunch] = {}

    def _graph_wrapper(self, size: int, *, eager: bool = False) -> Any:
        wrapper = self._graph_wrappers.get(size)
        if wrapper is not None:
            if size in self._eager_sizes:
                if eager:
                    self._eager_sizes.move_to_end(size)
                else:  # a graph step of this size: its wrapper stays for good
                    del self._eager_sizes[size]
            return wrapper
        if eager:
            if len(self._eager_sizes) >= MAX_EAGER_DECODE_WRAPPERS:
                old, _ = self._eager_sizes.popitem(last=False)
                dropped = self._graph_wrappers.pop(old)
                self._graph_plans.pop(old, None)
                self._plan_events.pop(id(dropped), None)
                self._launches = {key: launch for key, launch in self._launches.items()
                                  if launch.decode is not dropped}
            self._eager_sizes[size] = None
        import flashinfer

        indptr, last_page_len = self._graph_buffers.setdefault(
            size, (self._indptr[:size + 1], self._last_page_len[:size]))
        wrapper = self._graph_wrappers[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.kernels.decode_tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=last_page_len, backend="fa2")
        return wrapper

    def _host_pages(self, common: AttentionMetadata, size: int, out: torch.Tensor,
                    decode: bool) -> HostPages:
        """The step's page lists on the host, padded to ``size`` requests (one token each),
        in ``out`` (a staging slot's lists, laid out once per size): from the metadata's host
        copies, else one device read. ``decode``: a uniform decode (query rows counting)."""
        n = common.num_seqs
        qo, seq = common.query_start_loc_cpu, common.seq_lens_cpu
        if qo is None or seq is None:
            both = torch.cat([common.query_start_loc.to(torch.int32),
                              common.seq_lens.to(torch.int32)]).cpu()
            qo, seq = both[:n + 1], both[n + 1:]
        elif qo.shape != (n + 1,) or seq.shape != (n,):
            raise ValueError(f"query_start_loc_cpu {tuple(qo.shape)} and seq_lens_cpu "
                             f"{tuple(seq.shape)} must have the shapes of query_start_loc "
                             f"({n + 1},) and seq_lens ({n},)")
        ptr = out.data_ptr()
        pages = self._lists.get((ptr, size))
        if pages is None:
            pages = self._lists[ptr, size] = HostPages.in_buffer(size, out)
        if self._slot_lists.get(ptr) is not pages:
            pages.forget()
            self._slot_lists[ptr] = pages
        return pages.refill(None if decode else qo, seq, self.spec.block_size)

    def _gather_indices(self, pages: HostPages, counts: bytes, slot: StagingSlot
                        ) -> torch.Tensor:
        """FlashInfer's ``indices``: the used entries of the persistent block table, gathered
        on the device (no sync); the gather positions are computed (in ``slot``) and copied
        only when the page counts (``counts``, :meth:`HostPages.page_counts_key`) changed."""
        if counts != self._gathered:
            _, _, page_counts, indptr, _ = pages._arrays
            total = int(indptr[-1])
            width = self.block_table.shape[1]
            # position of entry j of request i: i * width + (j - indptr[i])
            starts = np.arange(pages.num_seqs, dtype=np.int64) * width - indptr[:-1]
            np.add(np.repeat(starts, page_counts), np.arange(total, dtype=np.int64),
                   out=slot.arrays["positions"][:total])
            self._positions[:total].copy_(slot.tensors["positions"][:total], non_blocking=True)
            self._gathered = counts
            self._gather_views = (self._positions[:total], self._indices[:total])
        positions, indices = self._gather_views
        torch.index_select(self._flat_table, 0, positions, out=indices)
        return indices

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        event = self._plan_events.get(id(wrapper))
        if event is not None:
            event.synchronize()
        wrapper.plan(*args, **kwargs)
        self.plans += 1
        if self.device.type == "cuda":
            if event is None:
                event = self._plan_events[id(wrapper)] = torch.cuda.Event()
            event.record()

    def _options(self) -> tuple[tuple, dict]:
        return plan_args(self.num_heads, self.num_kv_heads, self.spec.head_size,
                         self.spec.block_size, self.scale, self.sliding_window,
                         self.spec.dtype, self.spec.cache_dtype, self.logits_soft_cap)

    def learn_layer(self, meta: FlashInferMetadata, scale: float, sliding_window: int | None,
                    logits_soft_cap: float | None) -> bool:
        """Take a layer's plan parameters as the model's and plan ``meta``'s step again for
        them (its wrappers and launch replaced in place), unless the builder's are settled;
        returns whether it did. Called by the first layer of a step whose plan does not fit
        it, outside any graph capture."""
        if self.settled:
            return False
        self.scale, self.sliding_window, self.logits_soft_cap = (
            scale, sliding_window, logits_soft_cap)
        self.settled = True
        kernels = self._kernels()
        if kernels != self.kernels:  # a window learned: its decode kernel (no graph yet)
            self.kernels = kernels
            self._new_wrappers()
        # Graph-mode wrappers were planned for the old values: plan them again when used.
        self._graph_plans.clear()
        slot = self._staging.acquire()
        try:
            fresh = self._build(meta, meta, meta.graph_batch_size, slot,
                                launch_block_bound(meta, meta.graph_batch_size))
        finally:
            self._staging.release()
        for field in ("decode_wrapper", "prefill_wrapper", "num_decodes", "planned", "launch"):
            setattr(meta, field, getattr(fresh, field))
        return True

    def _plan_graph_decode(self, size: int, pages: HostPages, counts: bytes,
                           indices: torch.Tensor, *, eager: bool = False) -> Any:
        wrapper = self._graph_wrapper(size, eager=eager)
        if self._graph_plans.get(size) == counts:
            # Same page counts, same plan and same indptr: only the last pages' lengths are
            # new (indptr too if a step of another size overwrote the shared buffer).
            indptr, last_page_len = self._graph_buffers[size]
            if self._indptr_holds != counts:
                indptr.copy_(pages.indptr, non_blocking=True)
                self._indptr_holds = counts
            last_page_len.copy_(pages.last_page_len, non_blocking=True)
            return wrapper
        shape, options = self._options()
        # FlashInfer copies indptr and last_page_len into the wrapper's buffers (unknown
        # contents until the plan has returned).
        self._indptr_holds = None
        self._plan(wrapper, pages.indptr, indices, pages.last_page_len, *shape, **options)
        self._graph_plans[size] = self._indptr_holds = counts
        return wrapper

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> FlashInferMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        facts, self._facts = self._facts, None
        if meta.num_seqs == 0 or meta.num_actual_tokens == 0:
            return meta.extend(FlashInferMetadata)
        # launch_block_bound's value without reading the views' marks back: an eager step
        # is not padded, so its views were marked with the checked largest block id.
        bound = (-1 if facts is None else facts.max_block_id if graph_batch_size is None
                 else UNCHECKED_BLOCKS)
        slot = self._staging.acquire()
        try:
            return self._build(meta, common, graph_batch_size, slot, bound)
        finally:
            # After the step's last copy from the slot (ours and those plan enqueued).
            self._staging.release()

    def check(self, common: AttentionMetadata) -> StepFacts | None:
        """:meth:`kvcore.AttentionMetadataBuilder.check`; :meth:`build` keeps the facts for
        its launch (the step's largest block id)."""
        facts = self._facts = super().check(common)
        return facts

    def _build(self, meta: AttentionMetadata, common: AttentionMetadata,
               graph_batch_size: int | None, slot: StagingSlot,
               max_block_id: int) -> FlashInferMetadata:
        size = meta.num_seqs
        uniform = graph_batch_size is not None or is_uniform_decode(meta)
        pages = self._host_pages(common, size, slot.tensors["lists"], uniform)
        counts = pages.page_counts_key()
        indices = self._gather_indices(pages, counts, slot)
        if uniform:
            # A decode-only step, captured or eager, runs on a graph-mode wrapper of its size:
            # planned only when the page counts change.
            wrapper = self._plan_graph_decode(size, pages, counts, indices,
                                              eager=graph_batch_size is None)
            return self._metadata(meta, wrapper, None, size, None, graph_batch_size,
                                  max_block_id)
        shape, options = self._options()
        k = pages.leading_decodes()
        qo_indptr, indptr = pages._arrays[0], pages._arrays[3]
        decode = prefill = None
        if k:
            decode = self._decode
            self._plan(decode, pages.indptr[:k + 1], indices[:int(indptr[k])],
                       pages.last_page_len[:k],
                       *shape, **options)
        if int(qo_indptr[-1]) > int(qo_indptr[k]):  # query tokens after the decodes
            rest = pages.tail(k)
            prefill = self._prefill
            self._plan(prefill, rest.qo_indptr, rest.indptr, indices[int(indptr[k]):],
                       rest.last_page_len, *shape, causal=meta.causal,
                       seq_lens=rest.seq_lens, **options)
        return self._metadata(meta, decode, prefill, k, None if prefill is None else meta.causal,
                              graph_batch_size, max_block_id)

    def _metadata(self, meta: AttentionMetadata, decode: Any, prefill: Any, k: int,
                  causal: bool | None, graph_batch_size: int | None,
                  max_block_id: int) -> FlashInferMetadata:
        """The step's metadata with its wrappers and their :class:`FlashInferLaunch`
        (``max_block_id``: :func:`~kvcore_nvidia.backends.common.launch_block_bound`'s)."""
        key = (id(decode), id(prefill), k, meta.num_actual_tokens, max_block_id, self.scale,
               self.sliding_window, self.logits_soft_cap, causal)
        launch = self._launches.get(key)
        if launch is None:
            # One launch per choice (a graph step's is the same every step: the runner finds
            # its contents once, and the layers' check of it too).
            if len(self._launches) >= 256:
                self._launches.clear()
            planned = (self.scale, self.sliding_window, self.logits_soft_cap, causal)
            rows = (meta.num_actual_tokens, self.num_heads, self.spec.head_size)
            launch = self._launches[key] = FlashInferLaunch(
                decode, prefill, k, rows, self.signature, max_block_id, planned)
        return meta.extend(FlashInferMetadata, decode_wrapper=decode, prefill_wrapper=prefill,
                           num_decodes=k, planned=launch.planned, dtype=self.spec.dtype,
                           cache_dtype=self.spec.cache_dtype,
                           launch=launch, builder=self, graph_batch_size=graph_batch_size)

    def warmup(self) -> dict[str, float]:
        """Build (JIT-compile, or load from FlashInfer's cache) the modules this builder's
        steps run, by planning and running a one-request step of each phase on a two-block
        scratch cache; returns the seconds each phase took (``"decode"``, ``"prefill"``), so
        an engine calls it at start-up and the first request pays nothing."""
        import time

        block_size, dtype = self.spec.block_size, self.spec.dtype
        cache = torch.zeros(2, 2, block_size, self.num_kv_heads, self.spec.head_size,
                            dtype=self.spec.cache_dtype, device=self.device)
        key_cache, value_cache = cache.unbind(1)
        steps = {"decode": 1}
        if self.max_num_batched_tokens >= 2:
            steps["prefill"] = 2
        seconds = {}
        cache_dtype = "" if self.spec.cache_dtype == dtype else (
            f" ({str(self.spec.cache_dtype).removeprefix('torch.')} cache)")
        shape = (f"{str(dtype).removeprefix('torch.')}{cache_dtype}, "
                 f"{self.num_heads}/{self.num_kv_heads} "
                 f"heads of {self.spec.head_size}, block {block_size}")
        for phase, q_len in steps.items():
            t0 = time.perf_counter()
            # FlashInfer JIT-compiles a module per configuration on its first plan/run.
            with long_step(f"FlashInfer: compiling the {phase} kernels ({shape})",
                                  estimate="about 1-2 min", cache=flashinfer_jit_cache()):
                common = build_attention_metadata([q_len], [1], [[0]], block_size,
                                                  device=self.device)
                meta = self.build(common)
                query = torch.zeros(q_len, self.num_heads, self.spec.head_size, dtype=dtype,
                                    device=self.device)
                wrapper = meta.decode_wrapper if phase == "decode" else meta.prefill_wrapper
                wrapper.run(query, (key_cache, value_cache), out=torch.empty_like(query))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            seconds[phase] = time.perf_counter() - t0
        return seconds
