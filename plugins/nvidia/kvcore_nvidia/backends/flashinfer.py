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
  one tile) when a K/V head serves at least 4 query heads, else its CUDA-core decode kernel;
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
(:class:`FlashInferImpl`).
:meth:`FlashInferMetadataBuilder.warmup` builds FlashInfer's JIT modules of the configuration
at start-up.

A plan fixes the softmax scale, the sliding window and, for prefill, the causal mask, which the
builder's constructor does not receive: it plans for ``1 / sqrt(head_size)``, no window, and
the step's ``causal``, and ``forward`` refuses a layer that needs other values (clear error).
Metadata that did not come from the builder (``forward`` called with
:class:`kvcore.AttentionMetadata` directly) is planned on its first layer (the whole batch on
one wrapper, prefill or decode) and the plan kept for the next layers of the same step
(:class:`~kvcore_nvidia.backends.common.StepCache`); planning there reads the lengths back
from the device, so that path is not capturable.

Cross-layer caches: FLASHINFER opts in. FlashInfer takes the page stride from the tensors: its
prefill and decode kernels give bit-identical outputs on a layer of a cross-layer pool and on a
contiguous copy and leave the other layers untouched
(``test_flashinfer_on_a_cross_layer_view_is_bit_exact``, a GPU test; the runs are recorded in
``benchmarks/RESULTS.md``), and the conformance suite's cross-layer case passes.

The cache write is :func:`kvcore_nvidia.ops.write_kv_cache` (stride-aware, int64 offsets:
kvcore's Triton ``reshape_and_cache`` by default, the plugin's CUDA C++ kernel with
``KVCORE_NVIDIA_CACHE_WRITE=cuda``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import weakref
from typing import Any

import numpy as np
import torch

from kvcore import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionType,
    CudaGraphSupport,
    DeviceCapability,
    PersistentMetadataBuilder,
    build_attention_metadata,
    long_step,
)
from kvcore.ops import checked_step_facts, value_checks_enabled
from kvcore_nvidia.backends.common import (
    HostStaging,
    PagedCacheImpl,
    StagingSlot,
    StepCache,
    cumulative,
    used_blocks,
)
from kvcore_nvidia.caches import flashinfer_jit_cache

__all__ = ["FlashInferBackend", "FlashInferImpl", "FlashInferKernels", "FlashInferLaunch",
           "FlashInferMetadata", "FlashInferMetadataBuilder", "flashinfer_kernels",
           "flashinfer_page_table"]


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
    pages, indices = used_blocks(seq_lens, attn_metadata.block_table, block_size)
    last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * block_size, 0)
    return cumulative(pages), indices, last_page_len.to(torch.int32)


@dataclasses.dataclass(frozen=True)
class FlashInferKernels:
    """The FlashInfer kernels a configuration runs (see :func:`flashinfer_kernels`).

    Attributes:
        prefill: the prefill wrapper's ``backend``: ``"fa3"`` (FlashInfer's SM90 kernels) or
            ``"fa2"``.
        decode_tensor_cores: the decode wrapper's ``use_tensor_cores``.
    """

    prefill: str
    decode_tensor_cores: bool


#: Query heads per K/V head from which tensor-core decode is the faster decode kernel:
#: FlashInfer packs the group's query heads into the rows of one tensor-core tile, so each
#: K/V page is read once for the group; with fewer heads per group the tile is mostly empty
#: and the CUDA-core decode kernel is faster (FlashInfer's own guidance, as in vLLM).
TENSOR_CORE_DECODE_MIN_GROUP = 4


def flashinfer_kernels(capability: tuple[int, int] | None, num_heads: int,
                       num_kv_heads: int) -> FlashInferKernels:
    """The fastest FlashInfer kernels per phase: the one place they are chosen.

    - Prefill: on SM 9.x (Hopper: H100, H200) FlashInfer's SM90 kernels (``"fa3"``: wgmma and
      TMA), which take the cache's strides like fa2 and cover what this backend declares
      (fp16/bf16, head sizes 64/128/256, causal or not, sliding window). On Ampere and Ada
      (8.x) ``"fa2"``, FlashInfer's fastest there. On Blackwell (10.x, 12.x) ``"fa2"`` too:
      FlashInfer's Blackwell prefill kernels (``"cutlass"``, ``"trtllm-gen"``) come with other
      layout and option constraints and have not been verified on kvcore's cache.
      ``capability`` ``None`` (no GPU: the CPU tests' stand-ins) gives ``"fa2"``.
    - Decode: tensor cores when a K/V head serves at least
      :data:`TENSOR_CORE_DECODE_MIN_GROUP` query heads, else the CUDA-core decode kernel.

    A mixed batch runs its decode requests on the decode kernel and the rest on the prefill
    kernel (see the module docstring).
    """
    prefill = "fa3" if capability is not None and capability[0] == 9 else "fa2"
    group = num_heads // max(num_kv_heads, 1)
    return FlashInferKernels(prefill=prefill,
                             decode_tensor_cores=group >= TENSOR_CORE_DECODE_MIN_GROUP)


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _new_wrappers(workspace: torch.Tensor, kernels: FlashInferKernels) -> tuple[Any, Any]:
    """A (prefill, decode) pair of eager wrappers sharing ``workspace``."""
    import flashinfer

    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
                                                             backend=kernels.prefill)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=kernels.decode_tensor_cores, backend="fa2")
    return prefill, decode


@functools.cache
def _wrappers(device: torch.device, kernels: FlashInferKernels) -> tuple[Any, Any]:
    """The (prefill, decode) wrappers of ``device`` for metadata not made by the builder."""
    return _new_wrappers(torch.zeros(FlashInferBackend.WORKSPACE_BYTES, dtype=torch.uint8,
                                     device=device), kernels)


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


#: Batch sizes of eager decode-only steps that get a CUDA-graph-mode decode wrapper of their
#: own (beyond the sizes graph steps were built for), least recently used dropped first: such
#: a wrapper reads the builder's persistent page-list buffers, so a step whose page counts are
#: those of its last plan refreshes the buffers and skips FlashInfer's ``plan``. Each costs
#: FlashInfer's int workspace (8 MiB on the device and 8 MiB page-locked in FlashInfer 0.7).
MAX_EAGER_DECODE_WRAPPERS = 4

#: A block id no cache reaches: a step whose block range was not checked on the host never
#: takes the layers' short path (they validate their tensors instead).
_UNCHECKED_BLOCKS = 2**62


#: The last plan of the shared wrappers (every plan goes through it, so a hit means the
#: wrapper it returns still holds that plan).
_PLANS = StepCache()


def _numpy(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return values.numpy() if isinstance(values, torch.Tensor) else values


@dataclasses.dataclass(frozen=True)
class HostPages:
    """One step's FlashInfer page lists on the host (all int32, CPU).

    Attributes:
        qo_indptr: ``(n + 1,)`` cumulative query tokens.
        seq_lens: ``(n,)`` cached + new tokens per request.
        pages: ``(n,)`` block-table entries each request uses.
        indptr: ``(n + 1,)`` cumulative ``pages``.
        last_page_len: ``(n,)`` tokens in each request's last page (0 for an empty request).
    """

    qo_indptr: torch.Tensor
    seq_lens: torch.Tensor
    pages: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    # (2n + 2,) int32 beside the lists, where tail() writes its rebased offsets (so they are
    # page-locked when the lists are); None: tail() allocates.
    _spare: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    # numpy views of the five lists (the same memory), made once.
    _arrays: tuple[np.ndarray, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self._arrays:
            lists = (self.qo_indptr, self.seq_lens, self.pages, self.indptr, self.last_page_len)
            object.__setattr__(self, "_arrays", tuple(t.numpy() for t in lists))

    @staticmethod
    def words(size: int) -> int:
        """int32 elements the lists of ``size`` requests take in a buffer (see :meth:`of`)."""
        return 7 * size + 4

    @classmethod
    def in_buffer(cls, size: int, out: torch.Tensor) -> HostPages:
        """Lists of ``size`` requests laid out in ``out`` (a contiguous int32 CPU tensor of at
        least :meth:`words` ``(size)`` elements), to be filled by :meth:`refill`: a builder
        keeps one per staging slot and batch size, so a step only recomputes the values."""
        words = cls.words(size)
        if out.dtype != torch.int32 or out.dim() != 1 or out.shape[0] < words:
            raise ValueError(f"out must be a 1-D int32 tensor of at least {words} elements "
                             f"for {size} requests, got {out.dtype} {tuple(out.shape)}")
        # qo_indptr, seq_lens, pages, indptr, last_page_len, then tail()'s spare
        sizes = (size + 1, size, size, size + 1, size, 2 * size + 2)
        return cls(*out.split_with_sizes((*sizes, out.shape[0] - words))[:6])

    @classmethod
    def of(cls, qo_indptr: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray,
           block_size: int, *, size: int | None = None,
           out: torch.Tensor | None = None) -> HostPages:
        """The lists of a step with these host lengths (see :meth:`refill`), padded to
        ``size`` requests (default ``n``), as views of ``out`` (see :meth:`in_buffer`; e.g.
        a page-locked staging slot, so copies to the device run asynchronously; default: a
        new tensor)."""
        n = seq_lens.shape[0]
        size = n if size is None else size
        if out is None:
            out = torch.empty(cls.words(size), dtype=torch.int32)
        return cls.in_buffer(size, out).refill(qo_indptr, seq_lens, block_size)

    def refill(self, qo_indptr: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray,
               block_size: int) -> HostPages:
        """Compute the lists of a step in place, from its host lengths (``(n + 1,)`` and
        ``(n,)`` integers on the CPU, ``n`` at most :attr:`num_seqs`), padded to
        :attr:`num_seqs` requests of one new token and one cached token each (the padding
        requests of :class:`kvcore.PersistentMetadataBuilder`); returns ``self``.

        A few numpy calls on numpy views of the lists' memory: no torch op on tiny tensors,
        no new host tensor.
        """
        n, size = seq_lens.shape[0], self.num_seqs
        if size < n:
            raise ValueError(f"these lists hold {size} requests, fewer than the {n} of "
                             "seq_lens")
        qo, seq, pages, indptr, last = self._arrays
        qo[:n + 1] = _numpy(qo_indptr)
        seq[:n] = _numpy(seq_lens)
        if size > n:
            np.add(np.arange(1, size - n + 1, dtype=np.int32), qo[n], out=qo[n + 1:])
            seq[n:] = 1
        np.add(seq, block_size - 1, out=pages)
        np.floor_divide(pages, block_size, out=pages)
        indptr[0] = 0
        np.add.accumulate(pages, out=indptr[1:])
        # seq - (pages - 1) * block_size; the minimum with seq makes it 0 for a request
        # without pages (elsewhere it is at most seq already)
        np.multiply(pages, -block_size, out=last)
        last += seq
        last += block_size
        np.minimum(last, seq, out=last)
        return self

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def page_counts_key(self) -> bytes:
        """The page counts as bytes: equal keys, equal request and page counts (a cheap
        comparison with a step planned before)."""
        return self._arrays[2].tobytes()

    def leading_decodes(self) -> int:
        """How many requests at the front have exactly one query token."""
        other = np.flatnonzero(np.diff(self._arrays[0]) != 1)
        return int(other[0]) if other.size else self.num_seqs

    def tail(self, k: int) -> HostPages:
        """The lists of requests ``k..n-1``, offsets rebased to 0 (``indices`` start at
        ``indptr[k]``); the rebased offsets are written beside the lists (a later ``tail``
        overwrites them)."""
        if k == 0:
            return self
        m = self.num_seqs - k + 1
        spare = self._spare if self._spare is not None else torch.empty(2 * m,
                                                                          dtype=torch.int32)
        qo_indptr, indptr = spare[:m], spare[m:2 * m]
        qo_array, indptr_array = qo_indptr.numpy(), indptr.numpy()
        qo, seq, pages, full_indptr, last = self._arrays
        np.subtract(qo[k:], qo[k], out=qo_array)
        np.subtract(full_indptr[k:], full_indptr[k], out=indptr_array)
        return HostPages(qo_indptr, self.seq_lens[k:], self.pages[k:], indptr,
                         self.last_page_len[k:], _arrays=(qo_array, seq[k:], pages[k:],
                                                          indptr_array, last[k:]))


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
        signature: the builder's ``(num_heads, num_kv_heads, head_size, block_size, dtype)``,
            one object for all its steps: a layer whose cache was checked against it once
            skips that check in later steps.
        max_block_id: the largest block id the step uses (from the step's checked facts;
            ``-1`` with value checks off): a layer's cache must have more blocks.
        planned: ``(scale, sliding_window, causal)`` the plans were made for (as
            :attr:`FlashInferMetadata.planned`).
    """

    decode: Any
    prefill: Any
    num_decodes: int
    query_shape: tuple[int, int, int]
    signature: tuple
    max_block_id: int
    planned: tuple[float, int | None, bool | None]


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
        planned: ``(scale, sliding_window, causal)`` the plans were made for; ``causal`` is
            ``None`` for a decode-only step (one query per request: causal or not is the same).
        dtype: the query and cache dtype the plans were made for.
        launch: the step's :class:`FlashInferLaunch` (``None`` for an empty step).
    """

    decode_wrapper: Any = None
    prefill_wrapper: Any = None
    num_decodes: int = 0
    planned: tuple[float, int | None, bool | None] = (0.0, None, None)
    dtype: torch.dtype | None = None
    launch: FlashInferLaunch | None = None


class FlashInferMetadataBuilder(PersistentMetadataBuilder):
    """Plans FlashInfer's wrappers once per step (see the module docstring).

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
    FlashInfer's ``plan`` reads these host lists (its scheduler) and enqueues copies from
    them; the slot's event is recorded after the last plan of the step, so a slot is
    rewritten only once those copies have run.

    Attributes:
        kernels: the :class:`FlashInferKernels` the steps run on.
        plans: plans made so far (a CUDA-graph decode step whose page counts did not change
            refreshes the buffers instead).
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
        self.kernels = flashinfer_kernels(_capability(self.device), num_heads, num_kv_heads)
        self.plans = 0
        dev = self.device
        cuda = dev.type == "cuda"
        entries = max_num_seqs * self.max_blocks_per_seq
        with torch.inference_mode(False):
            self.workspace = torch.zeros(FlashInferBackend.WORKSPACE_BYTES, dtype=torch.uint8,
                                         device=dev)
            self._indices = torch.zeros(entries, dtype=torch.int32, device=dev)
            self._positions = torch.zeros(entries, dtype=torch.int64, device=dev)
            self._indptr = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=dev)
            self._last_page_len = torch.zeros(max_num_seqs, dtype=torch.int32, device=dev)
            self._staging = HostStaging(
                {"lists": (HostPages.words(max_num_seqs), torch.int32),
                 "positions": (entries, torch.int64)},
                slots=2, pin=cuda, new_event=torch.cuda.Event if cuda else None)
        self._flat_table = self.block_table.view(-1)
        # The HostPages laid out in each staging slot, per batch size (refilled each step).
        self._lists: dict[tuple[int, int], HostPages] = {}
        self._prefill, self._decode = _new_wrappers(self.workspace, self.kernels)
        self._graph_wrappers: dict[int, Any] = {}
        # Sizes whose graph-mode wrapper only eager decode steps use, oldest first (see
        # MAX_EAGER_DECODE_WRAPPERS); a graph build of a size makes its wrapper permanent.
        self._eager_sizes: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: What a layer's cache is checked against once (FlashInferLaunch.signature).
        self.signature = (num_heads, num_kv_heads, spec.head_size, spec.block_size, spec.dtype)
        # Page counts (HostPages.page_counts_key) each CUDA-graph wrapper was last planned for
        # (the plan depends on them).
        self._graph_plans: dict[int, bytes] = {}
        # Page counts self._positions holds the gather positions of, and those whose indptr
        # self._indptr holds (the graph wrappers of all sizes share it).
        self._gathered: bytes | None = None
        self._indptr_holds: bytes | None = None
        # Per wrapper: an event after its last plan. FlashInfer stages a plan in the wrapper's
        # page-locked buffer and copies it to the device asynchronously; the next plan of that
        # wrapper waits for that copy (the previous step's), not for the device to be idle.
        self._plan_events: dict[int, Any] = {}

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
            self._eager_sizes[size] = None
        import flashinfer

        wrapper = self._graph_wrappers[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.kernels.decode_tensor_cores,
            paged_kv_indptr_buffer=self._indptr[:size + 1],
            paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last_page_len[:size],
            backend="fa2")
        return wrapper

    def _host_pages(self, common: AttentionMetadata, size: int, out: torch.Tensor) -> HostPages:
        """The step's page lists on the host, padded to ``size`` requests (one token each),
        in ``out`` (a staging slot's lists, laid out once per size): from the metadata's host
        copies, else one device read."""
        n = common.num_seqs
        qo, seq = common.query_start_loc_cpu, common.seq_lens_cpu
        if qo is None or seq is None:
            both = torch.cat([common.query_start_loc.to(torch.int32),
                              common.seq_lens.to(torch.int32)]).cpu()
            qo, seq = both[:n + 1], both[n + 1:]
        elif tuple(qo.shape) != (n + 1,) or tuple(seq.shape) != (n,):
            raise ValueError(f"query_start_loc_cpu {tuple(qo.shape)} and seq_lens_cpu "
                             f"{tuple(seq.shape)} must have the shapes of query_start_loc "
                             f"({n + 1},) and seq_lens ({n},)")
        pages = self._lists.get((out.data_ptr(), size))
        if pages is None:
            pages = self._lists[out.data_ptr(), size] = HostPages.in_buffer(size, out)
        return pages.refill(qo, seq, self.spec.block_size)

    def _gather_indices(self, pages: HostPages, counts: bytes, slot: StagingSlot
                        ) -> torch.Tensor:
        """FlashInfer's ``indices``: the used entries of the persistent block table, gathered
        on the device (no sync); the gather positions are computed (in ``slot``) and copied
        only when the page counts (``counts``, :meth:`HostPages.page_counts_key`) changed."""
        _, _, page_counts, indptr, _ = pages._arrays
        total = int(indptr[-1])
        if counts != self._gathered:
            width = self.block_table.shape[1]
            # position of entry j of request i: i * width + (j - indptr[i])
            starts = np.arange(pages.num_seqs, dtype=np.int64) * width - indptr[:-1]
            np.add(np.repeat(starts, page_counts), np.arange(total, dtype=np.int64),
                   out=slot.arrays["positions"][:total])
            self._positions[:total].copy_(slot.tensors["positions"][:total], non_blocking=True)
            self._gathered = counts
        indices = self._indices[:total]
        torch.index_select(self._flat_table, 0, self._positions[:total], out=indices)
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
        return _plan_args(self.num_heads, self.num_kv_heads, self.spec.head_size,
                          self.spec.block_size, self.scale, None, self.spec.dtype,
                          self.spec.dtype)

    def _plan_graph_decode(self, size: int, pages: HostPages, counts: bytes,
                           indices: torch.Tensor, *, eager: bool = False) -> Any:
        wrapper = self._graph_wrapper(size, eager=eager)
        if self._graph_plans.get(size) == counts:
            # Same page counts, same plan and same indptr: only the last pages' lengths are
            # new (indptr too if a step of another size overwrote the shared buffer).
            if self._indptr_holds != counts:
                self._indptr[:size + 1].copy_(pages.indptr, non_blocking=True)
                self._indptr_holds = counts
            self._last_page_len[:size].copy_(pages.last_page_len, non_blocking=True)
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
        if meta.num_seqs == 0 or meta.num_actual_tokens == 0:
            return meta.extend(FlashInferMetadata)
        slot = self._staging.acquire()
        try:
            return self._build(meta, common, graph_batch_size, slot)
        finally:
            # After the step's last copy from the slot (ours and those plan enqueued).
            self._staging.release()

    def _build(self, meta: AttentionMetadata, common: AttentionMetadata,
               graph_batch_size: int | None, slot: StagingSlot) -> FlashInferMetadata:
        size = meta.num_seqs
        pages = self._host_pages(common, size, slot.tensors["lists"])
        counts = pages.page_counts_key()
        indices = self._gather_indices(pages, counts, slot)
        if graph_batch_size is not None or _is_decode(meta):
            # A decode-only step, captured or eager, runs on a graph-mode wrapper of its size:
            # planned only when the page counts change.
            wrapper = self._plan_graph_decode(size, pages, counts, indices,
                                              eager=graph_batch_size is None)
            return self._metadata(meta, wrapper, None, size, None)
        shape, options = self._options()
        k = pages.leading_decodes()
        qo_indptr, indptr = pages.qo_indptr.numpy(), pages.indptr.numpy()
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
        return self._metadata(meta, decode, prefill, k, None if prefill is None else meta.causal)

    def _metadata(self, meta: AttentionMetadata, decode: Any, prefill: Any, k: int,
                  causal: bool | None) -> FlashInferMetadata:
        """The step's metadata with its wrappers and their :class:`FlashInferLaunch`."""
        facts = checked_step_facts(meta.query_start_loc, meta.seq_lens, meta.block_table)
        if facts is not None:
            max_block_id = facts.max_block_id
        else:  # checks off: nothing to compare; on but unmarked: the layers check
            max_block_id = _UNCHECKED_BLOCKS if value_checks_enabled() else -1
        planned = (self.scale, None, causal)
        rows = (meta.num_actual_tokens, self.num_heads, self.spec.head_size)
        launch = FlashInferLaunch(decode, prefill, k, rows, self.signature, max_block_id, planned)
        return meta.extend(FlashInferMetadata, decode_wrapper=decode, prefill_wrapper=prefill,
                           num_decodes=k, planned=planned, dtype=self.spec.dtype, launch=launch)

    def warmup(self) -> dict[str, float]:
        """Build (JIT-compile, or load from FlashInfer's cache) the modules this builder's
        steps run, by planning and running a one-request step of each phase on a two-block
        scratch cache; returns the seconds each phase took (``"decode"``, ``"prefill"``), so
        an engine calls it at start-up and the first request pays nothing."""
        import time

        block_size, dtype = self.spec.block_size, self.spec.dtype
        cache = torch.zeros(2, 2, block_size, self.num_kv_heads, self.spec.head_size,
                            dtype=dtype, device=self.device)
        key_cache, value_cache = cache.unbind(1)
        steps = {"decode": 1}
        if self.max_num_batched_tokens >= 2:
            steps["prefill"] = 2
        seconds = {}
        shape = (f"{str(dtype).removeprefix('torch.')}, {self.num_heads}/{self.num_kv_heads} "
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


class FlashInferImpl(PagedCacheImpl):
    """Cache write: :func:`kvcore_nvidia.ops.write_kv_cache`. Attention: FlashInfer (see
    module). A sliding window on a non-causal layer is refused
    (``FlashInferBackend.NON_CAUSAL_WINDOW_UNSUPPORTED``).

    With the builder's metadata a layer's ``attend`` is the step's
    :class:`FlashInferLaunch` called on its tensors: once a layer's cache passed the full
    checks against a builder's plan (its first step), later steps compare only what can change
    (the tensors' shapes, dtypes, devices and contiguity, the cache object, the step's largest
    block id against the cache's blocks, the plan's parameters) and fall back to the full
    checks on any difference.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            FlashInferBackend.check_non_causal_window(self.sliding_window, causal=False)
        # (weak cache, builder signature, num_blocks, device, data pointer) of the cache that
        # passed the full checks, and the plan parameters (FlashInferLaunch.planned: a
        # decode-only step's and a prefill step's) this layer was found to fit.
        self._checked_cache: tuple | None = None
        self._checked_plans: set[tuple] = set()

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
        kernels = flashinfer_kernels(_capability(key_cache.device), self.num_heads,
                                     self.num_kv_heads)
        prefill, decode = _wrappers(key_cache.device, kernels)
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

    def _check_plan(self, query: torch.Tensor, key_cache: torch.Tensor,
                    attn_metadata: FlashInferMetadata) -> None:
        """Refuse a layer the builder's plan does not fit."""
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
        launch = attn_metadata.launch
        if launch is None:
            return
        heads, kv_heads, head_size, block_size, _ = launch.signature
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

    def _fits(self, launch: FlashInferLaunch, query: torch.Tensor, kv_cache: torch.Tensor,
              output: torch.Tensor) -> bool:
        """Whether this call is one the full checks already accepted, up to the step: the
        cache checked against this builder, the step's blocks inside it, these rows."""
        seen = self._checked_cache
        shape = launch.query_shape
        return (seen is not None and seen[0]() is kv_cache and seen[1] is launch.signature
                and launch.max_block_id < seen[2] and kv_cache.data_ptr() == seen[4]
                and launch.planned in self._checked_plans
                and query.shape == shape and output.shape == shape
                and query.dtype == launch.signature[4] and output.dtype == query.dtype
                and query.device == seen[3] and output.device == seen[3]
                and query.is_contiguous() and output.is_contiguous())

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        launch = attn_metadata.launch if isinstance(attn_metadata, FlashInferMetadata) else None
        if launch is not None and self._fits(launch, query, kv_cache, output):
            kv = kv_cache.unbind(1)
            if launch.prefill is None:
                launch.decode.run(query, kv, out=output)
            elif launch.decode is None:
                launch.prefill.run(query, kv, out=output)
            else:
                k = launch.num_decodes
                launch.decode.run(query[:k], kv, out=output[:k])
                launch.prefill.run(query[k:], kv, out=output[k:])
            return
        self._checked_attend(query, kv_cache, attn_metadata, output)

    def _checked_attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
                        attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        """Every check, then the run; a builder step's cache that passes is remembered (see
        the class docstring)."""
        key_cache, value_cache = self.checked_halves(query, kv_cache, attn_metadata, output)
        q = query.contiguous()
        out = output if output.is_contiguous() else torch.empty_like(q)
        kv = (key_cache, value_cache)
        if isinstance(attn_metadata, FlashInferMetadata) and (
                attn_metadata.decode_wrapper is not None
                or attn_metadata.prefill_wrapper is not None):
            self._check_plan(q, key_cache, attn_metadata)
            k = attn_metadata.num_decodes
            if attn_metadata.decode_wrapper is not None:
                attn_metadata.decode_wrapper.run(q[:k], kv, out=out[:k])
            if attn_metadata.prefill_wrapper is not None:
                attn_metadata.prefill_wrapper.run(q[k:], kv, out=out[k:])
            launch = attn_metadata.launch
            if launch is not None:
                self._checked_cache = (weakref.ref(kv_cache), launch.signature,
                                       kv_cache.shape[0], kv_cache.device, kv_cache.data_ptr())
                self._checked_plans.add(launch.planned)
        else:
            self.plan(q, key_cache, attn_metadata).run(q, kv, out=out)
        if out is not output:
            output.copy_(out)


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
    WORKSPACE_BYTES = 128 * 1024 * 1024
    # The builder plans every step (graph-mode decode wrappers per batch size) and forward
    # only launches: no host sync, no allocation for a contiguous output.
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE

    NAME = "FLASHINFER"
    IMPL_CLS = FlashInferImpl
    BUILDER_CLS = FlashInferMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD, FlashInfer's native paged layout; with layers, blocks outermost (cross-layer):
        # shown bit-exact on per-layer views (module docstring).
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

