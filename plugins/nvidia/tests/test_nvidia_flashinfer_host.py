"""FLASHINFER's builder on the host, on CPU: the page lists computed with numpy in staging
memory equal the torch formulas for every list (random lengths, empty requests, block sizes
1/16/64, padding to a graph size, the decode/prefill split), the staging ring waits for a
slot's event before reusing it and records it after the step's last plan, and every plan and
every CUDA-graph refresh hands FlashInfer exactly the lists the step's metadata gives.

The reference lists are the torch formulas the builder used before its host lists moved to
numpy staging (``ceil(seq / block_size)`` pages, their cumulative sum, the tokens in the last
page, 0 for an empty request).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import sys
import types

import pytest
import torch
from kvcore_nvidia.backends import flashinfer as fi_backend
from kvcore_nvidia.backends.common import HostStaging
from kvcore_nvidia.backends.flashinfer import FlashInferBackend
from kvcore_nvidia.backends.flashinfer_builder import FlashInferMetadataBuilder
from kvcore_nvidia.backends.flashinfer_pages import HostPages
from torch.utils._python_dispatch import TorchDispatchMode

import kvcore


@dataclasses.dataclass
class _Ref:
    qo_indptr: torch.Tensor
    seq_lens: torch.Tensor
    pages: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor


def _reference(qo_indptr: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
               size: int | None = None) -> _Ref:
    """The torch formulas, padded to ``size`` requests of one token (query and cache)."""
    qo, seq = qo_indptr.to(torch.int32), seq_lens.to(torch.int32)
    n = seq.shape[0]
    size = n if size is None else size
    if size > n:
        qo = torch.cat([qo, qo[-1] + torch.arange(1, size - n + 1, dtype=torch.int32)])
        seq = torch.cat([seq, torch.ones(size - n, dtype=torch.int32)])
    pages = (seq + block_size - 1) // block_size
    indptr = torch.zeros(size + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    last = torch.where(pages > 0, seq - (pages - 1) * block_size, 0).to(torch.int32)
    return _Ref(qo, seq, pages.to(torch.int32), indptr, last)


_LISTS = ("qo_indptr", "seq_lens", "pages", "indptr", "last_page_len")


def _assert_lists(got: HostPages | _Ref, want: _Ref) -> None:
    for i, name in enumerate(_LISTS):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.int32 and a.device.type == "cpu", name
        assert a.tolist() == b.tolist(), name
        if isinstance(got, HostPages) and a.numel():  # its numpy views: the same memory
            assert got._arrays[i].ctypes.data == a.data_ptr() and got._arrays[i].size == a.numel()


def _lengths(rng: random.Random, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random query lengths (decodes, prefills, requests without new tokens) and total
    lengths (empty requests among them)."""
    q = [rng.choice([0, 1, 1, 1, rng.randint(2, 40)]) for _ in range(n)]
    seq = [0 if rng.random() < 0.15 and q[i] == 0 else q[i] + rng.randint(0, 300)
           for i in range(n)]
    qo = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(q, dtype=torch.int64), 0, out=qo[1:])
    return qo, torch.tensor(seq, dtype=torch.int64)


@pytest.mark.parametrize("pad", [0, 3], ids=["unpadded", "padded"])
@pytest.mark.parametrize("n", [0, 1, 7, 64])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_host_pages_equal_the_torch_formulas(block_size, n, pad):
    rng = random.Random(1000 * block_size + 10 * n + pad)
    for trial in range(5):
        qo, seq = _lengths(rng, n)
        if trial % 2:  # int32 inputs, as build_attention_metadata's host copies
            qo, seq = qo.to(torch.int32), seq.to(torch.int32)
        size = n + pad
        out = torch.full((HostPages.words(size) + 5,), -7, dtype=torch.int32)
        got = HostPages.of(qo, seq, block_size, size=size, out=out)
        _assert_lists(got, _reference(qo, seq, block_size, size))
        storage = out.untyped_storage().data_ptr()
        assert all(getattr(got, name).untyped_storage().data_ptr() == storage
                   for name in (*_LISTS, "_spare"))  # views of out, no new memory
        assert out[HostPages.words(size):].tolist() == [-7] * 5  # nothing written past words
        _assert_lists(HostPages.of(qo, seq, block_size, size=size),  # its own memory
                      _reference(qo, seq, block_size, size))


def test_host_pages_of_an_edge_batch():
    """Lengths at page boundaries (0, 1, block_size, block_size + 1) and a padded step."""
    seq = torch.tensor([0, 1, 16, 17, 32, 33], dtype=torch.int32)
    qo = torch.arange(7, dtype=torch.int32)
    pages = HostPages.of(qo, seq, 16, size=8)
    assert pages.pages.tolist() == [0, 1, 1, 2, 2, 3, 1, 1]
    assert pages.indptr.tolist() == [0, 0, 1, 2, 4, 6, 9, 10, 11]
    assert pages.last_page_len.tolist() == [0, 1, 16, 1, 16, 1, 1, 1]
    assert pages.qo_indptr.tolist() == list(range(9))
    assert pages.seq_lens.tolist() == [0, 1, 16, 17, 32, 33, 1, 1]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_tail_and_leading_decodes_equal_the_torch_formulas(block_size):
    rng = random.Random(block_size)
    for n in (1, 2, 9, 40):
        qo, seq = _lengths(rng, n)
        pages = HostPages.of(qo, seq, block_size, out=torch.empty(HostPages.words(n),
                                                                  dtype=torch.int32))
        ref = _reference(qo, seq, block_size)
        q_lens = (ref.qo_indptr[1:] - ref.qo_indptr[:-1]).tolist()
        leading = next((i for i, x in enumerate(q_lens) if x != 1), n)
        assert pages.leading_decodes() == leading
        assert pages.tail(0) is pages
        for k in range(n + 1):
            tail = pages.tail(k)
            want = _Ref(ref.qo_indptr[k:] - ref.qo_indptr[k], ref.seq_lens[k:], ref.pages[k:],
                        ref.indptr[k:] - ref.indptr[k], ref.last_page_len[k:])
            _assert_lists(tail, want)
            _assert_lists(pages, ref)  # the lists themselves untouched by tail()


def test_host_pages_refuses_a_short_out_and_a_small_size():
    qo, seq = torch.tensor([0, 1, 2]), torch.tensor([5, 6])
    with pytest.raises(ValueError, match="out must be a 1-D int32 tensor of at least 18"):
        HostPages.of(qo, seq, 16, out=torch.empty(17, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be a 1-D int32"):
        HostPages.of(qo, seq, 16, out=torch.empty(40, dtype=torch.int64))
    with pytest.raises(ValueError, match="hold 1 requests, fewer than the 2 of seq_lens"):
        HostPages.of(qo, seq, 16, size=1)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_refill_reuses_the_layout_for_later_steps(block_size):
    """A builder lays out a slot once per batch size and refills it every step: each refill
    gives that step's lists, whatever the previous step left in the memory."""
    rng = random.Random(7 * block_size)
    out = torch.full((HostPages.words(12),), -3, dtype=torch.int32)
    pages = HostPages.in_buffer(12, out)
    for n in (12, 3, 0, 12, 5):
        qo, seq = _lengths(rng, n)
        assert pages.refill(qo, seq, block_size) is pages
        _assert_lists(pages, _reference(qo, seq, block_size, 12))
        for name, array in zip(_LISTS, pages._arrays, strict=True):  # numpy views, same memory
            assert array.tolist() == getattr(pages, name).tolist()
        assert pages.page_counts_key() == pages.pages.numpy().tobytes()


class _Event:
    """A CUDA event as the staging ring uses it, logging record/synchronize."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self) -> None:
        self.log.append(("record", self.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


def _logged_events(log: list):
    made = iter(range(100))
    return lambda: _Event(log, f"e{next(made)}")


def test_staging_waits_for_a_slot_before_reusing_it():
    log: list = []
    staging = HostStaging({"a": (5, torch.int32), "b": (3, torch.int64)}, slots=2,
                          new_event=_logged_events(log))
    first = staging.acquire()
    assert log == []  # never used: nothing to wait for
    staging.release()
    assert log == [("record", "e0")]
    second = staging.acquire()
    assert second is not first and log == [("record", "e0")]
    staging.release()
    again = staging.acquire()
    assert again is first
    assert log[-1] == ("synchronize", "e0")  # the slot's copies ran before it is rewritten
    staging.release()
    assert log[-1] == ("record", "e0")  # one event per slot, recorded again
    assert staging.acquire() is second and log[-1] == ("synchronize", "e1")


def test_staging_slot_views():
    staging = HostStaging({"lists": (7, torch.int32), "positions": (5, torch.int64)}, slots=3)
    slots = [staging.slots[i] for i in range(3)]
    ptrs = set()
    for slot in slots:
        lists, positions = slot.tensors["lists"], slot.tensors["positions"]
        assert lists.shape == (7,) and lists.dtype == torch.int32
        assert positions.shape == (5,) and positions.dtype == torch.int64
        assert positions.data_ptr() % 64 == 0 and not lists.is_pinned()
        slot.arrays["positions"][:] = [1, 2, 3, 4, 5]  # numpy views share the memory
        assert positions.tolist() == [1, 2, 3, 4, 5]
        ptrs.add(lists.data_ptr())
    assert len(ptrs) == 3
    for expected in (0, 1, 2, 0):  # in turn, without events (CPU: copies are synchronous)
        assert staging.acquire() is slots[expected]
        staging.release()


def test_staging_refuses_misuse():
    staging = HostStaging({"a": (1, torch.int32)})
    with pytest.raises(RuntimeError, match="without acquire"):
        staging.release()
    staging.acquire()
    with pytest.raises(RuntimeError, match="called twice"):
        staging.acquire()
    with pytest.raises(ValueError, match="slots=0 must be at least 1"):
        HostStaging({"a": (1, torch.int32)}, slots=0)


# ------------------------------------------------------------------ the builder's plans


class _Recorder:
    """FlashInfer's wrapper reduced to what the builder hands it: each plan's arguments
    (copied, as FlashInfer copies them before plan returns); a CUDA-graph wrapper copies the
    lists into its buffers, as FlashInfer's does."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.graph = bool(kwargs.get("use_cuda_graph"))
        self.decode = "use_tensor_cores" in kwargs
        self.planned: list[tuple] = []

    def plan(self, *args: object, **kwargs: object) -> None:
        _LOG.append(("plan", self))
        copied = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.planned.append((copied, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                      for k, v in kwargs.items()}))
        if self.graph:
            indptr, indices, last = args[:3]
            self.kwargs["paged_kv_indptr_buffer"].copy_(indptr)
            self.kwargs["paged_kv_last_page_len_buffer"].copy_(last)
            self.kwargs["paged_kv_indices_buffer"][:indices.numel()].copy_(indices)

    def run(self, *args: object, **kwargs: object) -> None:
        _LOG.append(("run", self))


_LOG: list = []


@pytest.fixture(autouse=True)
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Recorder,
                                   BatchDecodeWithPagedKVCacheWrapper=_Recorder)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    _LOG.clear()
    fi_backend._wrappers.cache_clear()
    yield
    fi_backend._wrappers.cache_clear()


MAX_SEQS, MAX_LEN = 12, 300


def _builder(block_size: int) -> FlashInferMetadataBuilder:
    spec = kvcore.FullAttentionSpec(block_size=block_size, dtype=torch.float32,
                                    num_kv_heads=2, head_size=32)
    return FlashInferBackend.get_builder_cls()(
        spec, num_heads=8, max_num_seqs=MAX_SEQS, max_num_batched_tokens=512,
        max_model_len=MAX_LEN, device="cpu")


def _step(rng: random.Random, block_size: int, lens: list[int] | None, size: int | None,
          graph: bool):
    """A random step: uniform decode (mostly the last decode step's requests one token longer,
    mostly on the same graph size) or a mixed batch; returns (metadata, the decode lengths,
    graph size or None)."""
    if graph:
        if lens is None or rng.random() < 0.2:
            lens = [rng.randint(1, MAX_LEN - 80) for _ in range(rng.randint(1, MAX_SEQS))]
        elif rng.random() < 0.8:
            lens = [x + 1 for x in lens]
        # else the same lengths again (the same step rebuilt)
        n = len(lens)
        q, ctx = [1] * n, [x - 1 for x in lens]
        if size is None or size < n or rng.random() < 0.3:
            size = rng.choice([s for s in (1, 2, 4, 8, 12) if s >= n])
    else:
        n = rng.randint(1, MAX_SEQS)
        q = [rng.choice([0, 1, 1, rng.randint(2, 30)]) for _ in range(n)]
        q[rng.randrange(n)] = max(q[0], 1)
        ctx = [0 if rng.random() < 0.2 else rng.randint(0, 200) for _ in range(n)]
        size = None
    ids = list(range(MAX_SEQS * -(-MAX_LEN // block_size)))
    rng.shuffle(ids)
    tables, pos = [], 0
    for ql, c in zip(q, ctx, strict=True):
        need = -(-(ql + c) // block_size)
        tables.append(ids[pos:pos + need])
        pos += need
    common = kvcore.build_attention_metadata(q, ctx, tables, block_size,
                                             causal=rng.random() < 0.7)
    if rng.random() < 0.15:  # no host copies: the builder reads the lengths back
        common = dataclasses.replace(common, query_start_loc_cpu=None, seq_lens_cpu=None)
    return common, lens, size


def _expected_indices(common, ref: _Ref) -> torch.Tensor:
    n = common.num_seqs
    rows = [common.block_table[i, :int(ref.pages[i])] for i in range(n)]
    rows += [torch.zeros(1, dtype=torch.int32)] * (ref.pages.shape[0] - n)  # padding: block 0
    return torch.cat(rows).to(torch.int32)


def _assert_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_every_plan_and_refresh_gets_the_lists_of_its_step(block_size):
    """Random steps, CUDA-graph decode (plans, refreshes with the same page counts, sizes
    sharing the indptr buffer) and eager batches (a decode-only one on the graph-mode wrapper
    of its size, refreshed the same way): the arguments of every plan, and the graph buffers
    a replay reads after every build, equal the torch formulas on the step."""
    rng = random.Random(block_size)
    builder = _builder(block_size)
    lens, last_size, refreshes = None, None, 0
    for _ in range(120):
        common, lens, size = _step(rng, block_size, lens, last_size, graph=rng.random() < 0.6)
        last_size = size or last_size
        _LOG.clear()
        meta = builder.build(common, graph_batch_size=size)
        qo, seq = common.query_start_loc.cpu(), common.seq_lens.cpu()
        ref = _reference(qo, seq, block_size, size)
        indices = _expected_indices(common, ref)
        plans = [w for _, w in _LOG]
        decode_only = bool((qo[1:] - qo[:-1] == 1).all()) and common.num_seqs > 0
        if size is not None or decode_only:
            wrapper = meta.decode_wrapper
            refreshes += not plans
            if plans:
                assert plans == [wrapper]
                (indptr, got_indices, last, *shape), options = wrapper.planned[-1]
                _assert_tensor(indptr, ref.indptr)
                _assert_tensor(last, ref.last_page_len)
                _assert_tensor(got_indices, indices)
                assert shape == [8, 2, 32, block_size] and options["sm_scale"] == 32 ** -0.5
            buffers = wrapper.kwargs  # what a replay reads
            _assert_tensor(buffers["paged_kv_indptr_buffer"], ref.indptr)
            _assert_tensor(buffers["paged_kv_last_page_len_buffer"], ref.last_page_len)
            _assert_tensor(buffers["paged_kv_indices_buffer"][:indices.numel()], indices)
            continue
        k = meta.num_decodes
        q_lens = (ref.qo_indptr[1:] - ref.qo_indptr[:-1]).tolist()
        assert k == next((i for i, x in enumerate(q_lens) if x != 1), len(q_lens))
        expected = []
        if k:
            expected.append(meta.decode_wrapper)
            args, _ = meta.decode_wrapper.planned[-1]
            for got, want in zip(args[:3], (ref.indptr[:k + 1], indices[:int(ref.indptr[k])],
                                            ref.last_page_len[:k]), strict=True):
                _assert_tensor(got, want)
        if meta.prefill_wrapper is not None:
            expected.append(meta.prefill_wrapper)
            args, options = meta.prefill_wrapper.planned[-1]
            start = int(ref.indptr[k])
            for got, want in zip(args[:4], (ref.qo_indptr[k:] - ref.qo_indptr[k],
                                            ref.indptr[k:] - start, indices[start:],
                                            ref.last_page_len[k:]), strict=True):
                _assert_tensor(got, want)
            _assert_tensor(options["seq_lens"], ref.seq_lens[k:])
            assert options["causal"] == common.causal
        else:
            assert int(ref.qo_indptr[-1]) == int(ref.qo_indptr[k])
        assert plans == expected
    assert refreshes >= 5  # the refresh path ran


def test_build_stages_in_slots_in_turn_and_records_after_the_plans():
    """Each build writes its lists into the next staging slot, waits for that slot's event
    before writing and records it after the step's last plan (FlashInfer enqueues copies from
    the host lists in plan)."""
    builder = _builder(16)
    builder._staging = HostStaging(
        {"lists": (HostPages.words(MAX_SEQS), torch.int32),
         "positions": (MAX_SEQS * builder.max_blocks_per_seq, torch.int64)},
        slots=2, new_event=_logged_events(_LOG))
    slots = builder._staging.slots
    step = kvcore.build_attention_metadata([1, 5], [40, 3], [[1, 2, 3], [4]], 16)
    decode = kvcore.build_attention_metadata([1, 1], [40, 3], [[1, 2, 3], [4]], 16)
    for i, (common, size) in enumerate([(step, None), (decode, 2), (step, None)]):
        _LOG.clear()
        meta = builder.build(common, graph_batch_size=size)
        kinds = [entry[0] for entry in _LOG]
        if i < 2:
            assert "synchronize" not in kinds
        else:  # slot 0 again: wait for step 0's copies first
            assert kinds[0] == "synchronize" and _LOG[0][1] == "e0"
        assert kinds[-1] == "record" and kinds.count("record") == 1
        assert kinds.count("plan") == (2 if size is None else 1)
        # this step's lists are in its slot: indptr after qo_indptr, seq_lens and pages
        assert slots[i % 2].arrays["lists"][7:10].tolist() == [0, 3, 4]
        (indptr, *_), _ = meta.decode_wrapper.planned[-1]
        assert indptr.tolist() == ([0, 3] if size is None else [0, 3, 4])


def test_graph_refresh_copies_only_what_changed():
    """Same page counts as the last plan of that size: no plan, last_page_len copied, indptr
    copied only after a step of another size overwrote the shared buffer (what was not
    copied keeps a poisoned value)."""
    builder = _builder(16)
    tables = [[3, 9, 4], [11, 12, 13], [20, 21, 22]]

    def step(lengths):
        n = len(lengths)
        return kvcore.build_attention_metadata([1] * n, [x - 1 for x in lengths], tables[:n],
                                               16)

    builder.build(step([17, 29]), graph_batch_size=2)
    assert builder.plans == 1 and builder._indptr[:3].tolist() == [0, 2, 4]
    builder._indptr.fill_(-1)
    builder._last_page_len.fill_(-1)
    builder.build(step([18, 30]), graph_batch_size=2)
    assert builder.plans == 1
    assert builder._last_page_len[:2].tolist() == [2, 14]
    assert builder._indptr[:3].tolist() == [-1, -1, -1]  # unchanged since the plan: not copied
    builder.build(step([40, 5, 7]), graph_batch_size=4)
    assert builder.plans == 2 and builder._indptr[:5].tolist() == [0, 3, 4, 5, 6]
    builder.build(step([19, 31]), graph_batch_size=2)
    assert builder.plans == 2
    assert builder._indptr[:3].tolist() == [0, 2, 4]  # overwritten by size 4: copied again
    assert builder._last_page_len[:2].tolist() == [3, 15]


def test_a_decode_refill_counts_its_query_rows_and_keeps_nothing_after_another_layout():
    """``refill(None, ...)`` (a uniform decode) gives the lists of query rows 0, 1, ..., the
    padding included, after a mixed step's refill of the same lists and before one; a refill
    after another size's lists wrote the same memory (:meth:`HostPages.forget`) computes
    every list again."""
    rng = random.Random(3)
    out = torch.full((HostPages.words(9),), -3, dtype=torch.int32)
    small, large = HostPages.in_buffer(4, out), HostPages.in_buffer(9, out)
    for n, mixed in [(4, False), (4, True), (3, False), (3, False), (2, True), (4, False)]:
        qo, seq = _lengths(rng, n)
        if not mixed:
            qo, seq = torch.arange(n + 1), seq.clamp(min=1)
        small.refill(qo if mixed else None, seq, 16)
        _assert_lists(small, _reference(qo, seq, 16, 4))
    for _ in range(2):  # the same page counts again, around the other layout's refill
        large.refill(*_lengths(rng, 9), 16)
        small.forget()
        small.refill(None, seq, 16)
        _assert_lists(small, _reference(qo, seq, 16, 4))


class _TensorOps(TorchDispatchMode):
    """Counts the torch ops dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _tensor_ops(fn) -> collections.Counter[str]:
    with _TensorOps() as mode:
        fn()
    return mode.ops


@pytest.mark.parametrize("size", [None, 3, 4], ids=["eager", "graph", "graph-padded"])
def test_a_decode_step_on_the_same_pages_costs_three_tensor_ops_beyond_the_base_builder(size):
    """The host path held to its cost: a decode step whose page counts are those of the last
    plan (every request still in its last page) runs the tensor ops of
    :class:`kvcore.PersistentMetadataBuilder`'s build and three more: the host lengths into
    staging, the gather of the used block-table entries and the last pages' lengths to the
    device; no plan, nothing allocated. A request entering a new page adds the gather
    positions' copy and one plan."""
    builder = _builder(16)
    base = kvcore.PersistentMetadataBuilder(
        builder.spec, num_heads=8, max_num_seqs=MAX_SEQS, max_num_batched_tokens=512,
        max_model_len=MAX_LEN, device="cpu")
    tables = [[3, 9, 4], [11, 12, 13], [20, 21, 22]]

    def step(lengths: list[int]) -> kvcore.AttentionMetadata:
        return kvcore.build_attention_metadata([1] * 3, [x - 1 for x in lengths], tables, 16)

    for i in range(2):  # both staging slots laid out, the views of the size made
        builder.build(step([17 + i, 33 + i, 40 + i]), graph_batch_size=size)
        base.build(step([17 + i, 33 + i, 40 + i]), graph_batch_size=size)
    plans = builder.plans
    for i in range(2, 8):
        common = step([17 + i, 33 + i, 40 + i])
        got = _tensor_ops(lambda common=common: builder.build(common, graph_batch_size=size))
        want = _tensor_ops(lambda common=common: base.build(common, graph_batch_size=size))
        assert got["aten.index_select.out"] == 1
        assert sum(got.values()) == sum(want.values()) + 3
    assert builder.plans == plans
    common = step([33, 40, 48])  # request 0 enters its third page
    got = _tensor_ops(lambda: builder.build(common, graph_batch_size=size))
    assert builder.plans == plans + 1
    want = _tensor_ops(lambda: base.build(common, graph_batch_size=size))
    want.update({"aten.copy_.default": 2, "aten.index_select.out": 1})
    assert got >= want  # and the stand-in plan's own copies
