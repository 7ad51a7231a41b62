"""The engine step contract: builders, step value checks done once, persistent buffers."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcore
from kvcore import is_uniform_decode, ops, step_facts
from kvcore.builder import graph_batch_sizes
from kvcore.ops import validation
from kvcore.ops.reference import paged_attention_ref, reshape_and_cache_ref

BS = 4
SPEC = kvcore.FullAttentionSpec(block_size=BS, dtype=torch.float32, num_kv_heads=2,
                                head_size=16)
LIMITS = dict(num_heads=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
              device="cpu")


def step(query_lens=(1, 3), context_lens=(5, 0), tables=((2, 4), (7,)), **kw):
    return kvcore.build_attention_metadata(list(query_lens), list(context_lens),
                                           [list(t) for t in tables], BS, **kw)


def facts_of(meta):
    return ops.checked_step_facts(meta.query_start_loc, meta.seq_lens, meta.block_table,
                                  meta.slot_mapping)


def caches(num_blocks=8, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, BS, 2, 16, generator=gen)
    return k, torch.randn(num_blocks, BS, 2, 16, generator=gen)


def attend(meta, key_cache, value_cache, query=None):
    n = meta.num_actual_tokens
    q = query if query is not None else torch.randn(n, 4, 16,
                                                    generator=torch.Generator().manual_seed(1))
    return paged_attention_ref(q, key_cache, value_cache, query_start_loc=meta.query_start_loc,
                               seq_lens=meta.seq_lens, block_table=meta.block_table,
                               scale=0.25)


@pytest.fixture
def count_reads(monkeypatch):
    """Counts the ops' value checks that read metadata tensors back (the slow path)."""
    calls = []
    real = validation._check_lengths
    monkeypatch.setattr(validation, "_check_lengths",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


# -- declarations -----------------------------------------------------------------------------

def test_backends_declare_builders_and_graph_support():
    cpu = kvcore.resolve_backend("CPU_ATTN")
    triton = kvcore.resolve_backend("TRITON_ATTN")
    assert cpu.get_builder_cls() is kvcore.AttentionMetadataBuilder
    assert cpu.CUDA_GRAPH_SUPPORT is kvcore.CudaGraphSupport.NEVER
    assert issubclass(triton.get_builder_cls(), kvcore.PersistentMetadataBuilder)
    assert triton.CUDA_GRAPH_SUPPORT is kvcore.CudaGraphSupport.UNIFORM_DECODE
    assert cpu.capabilities()["cuda_graphs"] == "never"
    assert triton.capabilities()["cuda_graphs"] == "uniform_decode"


def test_select_explain_names_the_graph_support_of_the_pick():
    config = kvcore.AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, block_size=16)
    report = kvcore.explain_selection(config, "cpu")
    assert "cuda graphs: never (the selected backend's CUDA_GRAPH_SUPPORT)" in \
        report.format().splitlines()
    assert report.to_dict()["candidates"][0]["cuda_graphs"] in ("never", "uniform_decode",
                                                                "always")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_heads": 0}, "num_heads=0 must be a positive integer"),
    ({"max_num_seqs": -1}, "max_num_seqs=-1 must be a positive integer"),
    ({"max_model_len": 2.5}, "max_model_len=2.5 must be a positive integer"),
])
def test_builder_constructor_names_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kvcore.AttentionMetadataBuilder(SPEC, **{**LIMITS, **kwargs})


def test_builder_needs_a_spec():
    with pytest.raises(TypeError, match="spec must be a kvcore.KVCacheSpec"):
        kvcore.AttentionMetadataBuilder("bf16", **LIMITS)


# -- value checks once per step ---------------------------------------------------------------

def test_build_attention_metadata_marks_its_tensors_with_the_step_facts():
    facts = facts_of(step())
    assert facts == ops.StepFacts(num_tokens=4, num_seqs=2, block_size=BS, max_blocks_per_seq=2,
                                  max_block_id=7, max_slot=30)


def test_build_attention_metadata_refuses_ids_beyond_num_blocks():
    with pytest.raises(ValueError, match=r"block_tables\[1\] refers to block id 7, but the "
                                         r"cache has 6 blocks \(valid ids: 0..5\)"):
        step(num_blocks=6)
    assert facts_of(step(num_blocks=8)) is not None


def test_build_attention_metadata_marks_even_inside_inference_mode():
    with torch.inference_mode():
        meta = step()
    assert not meta.seq_lens.is_inference()
    assert facts_of(meta) is not None


def test_ops_take_the_facts_instead_of_reading_marked_tensors(count_reads):
    meta = step()
    k, v = caches()
    attend(meta, k, v)
    assert count_reads == []
    unmarked = kvcore.AttentionMetadata(
        meta.query_start_loc.clone(), meta.seq_lens.clone(), meta.block_table.clone(),
        meta.slot_mapping.clone(), meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens)
    attend(unmarked, k, v)
    assert count_reads == [1]


def test_marked_results_equal_unmarked_results():
    meta = step()
    k, v = caches()
    clones = [t.clone() for t in (meta.query_start_loc, meta.seq_lens, meta.block_table)]
    q = torch.randn(4, 4, 16)
    fast = attend(meta, k, v, q)
    slow = paged_attention_ref(q, k, v, query_start_loc=clones[0], seq_lens=clones[1],
                               block_table=clones[2], scale=0.25)
    assert torch.equal(fast, slow)


def test_marked_ids_are_still_checked_against_each_cache(count_reads):
    meta = step()
    k, v = caches(num_blocks=6)
    with pytest.raises(ValueError, match=r"block_table refers to block id 7, but the cache has "
                                         r"6 blocks \(valid ids: 0..5\)"):
        attend(meta, k, v)
    key = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping contains slot 30, but the cache holds "
                                         "only 6 blocks x 4 tokens = 24 slots"):
        reshape_and_cache_ref(key, key, k, v, meta.slot_mapping)
    assert count_reads == []


def test_an_in_place_write_after_marking_is_checked_again(count_reads):
    meta = step()
    meta.seq_lens[0] = 40  # beyond the two blocks of request 0's table row
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=40 needs 10 blocks of 4 but "
                                         "block_table has only 2 columns"):
        attend(meta, *caches())
    meta = step()
    meta.slot_mapping.fill_(1000)
    with pytest.raises(ValueError, match="slot_mapping contains slot 1000"):
        reshape_and_cache_ref(torch.randn(4, 2, 16), torch.randn(4, 2, 16), *caches(),
                              meta.slot_mapping)


def test_views_and_tensors_of_another_step_are_checked(count_reads):
    a, b = step(), step(query_lens=(1, 2), context_lens=(5, 1))
    k, v = caches()
    mixed = kvcore.AttentionMetadata(a.query_start_loc, b.seq_lens, a.block_table,
                                     a.slot_mapping, 3, 6, 4)
    attend(mixed, k, v)
    assert count_reads == [1]
    view = kvcore.AttentionMetadata(a.query_start_loc[:], a.seq_lens, a.block_table,
                                    a.slot_mapping, 3, 6, 4)
    attend(view, k, v)
    assert count_reads == [1, 1]


def test_inference_tensors_are_never_marked():
    meta = step()
    with torch.inference_mode():
        seq_lens = meta.seq_lens.clone()
    facts = facts_of(meta)
    assert not ops.mark_step_checked(facts, query_start_loc=meta.query_start_loc.clone(),
                                     seq_lens=seq_lens, block_table=meta.block_table.clone())
    assert getattr(seq_lens, step_facts._MARK, None) is None


def test_mark_step_checked_compares_shapes_with_the_facts():
    meta = step()
    with pytest.raises(ValueError, match=r"seq_lens has shape \(3,\) but the step's facts "
                                         r"describe 2 sequences"):
        ops.mark_step_checked(facts_of(meta), query_start_loc=meta.query_start_loc,
                              seq_lens=torch.ones(3, dtype=torch.int32),
                              block_table=meta.block_table)


def test_step_facts_from_tensors_reads_once_and_marks():
    meta = step()
    clones = [t.clone() for t in (meta.query_start_loc, meta.seq_lens, meta.block_table,
                                  meta.slot_mapping)]
    facts = ops.step_facts_from_tensors(*clones, BS)
    assert facts == facts_of(meta)
    assert ops.checked_step_facts(*clones) is facts


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t[1].__setitem__(1, 2), r"seq_lens\[1\]=2 is shorter than its 3 query tokens"),
    (lambda t: t[0].__setitem__(0, 1), "query_start_loc must start at 0"),
    (lambda t: t[2].__setitem__((1, 0), -3), "block_table refers to block id -3"),
    (lambda t: t[1].__setitem__(1, 30), r"seq_lens\[1\]=30 needs 8 blocks of 4 but "
     "block_table has only 2 columns"),
])
def test_step_facts_from_tensors_names_what_is_wrong(change, message):
    meta = step()
    tensors = [t.clone() for t in (meta.query_start_loc, meta.seq_lens, meta.block_table,
                                   meta.slot_mapping)]
    change(tensors)
    with pytest.raises(ValueError, match=message):
        ops.step_facts_from_tensors(*tensors, BS)


def test_marks_are_safe_across_threads():
    errors = []

    def work(seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            k, v = caches(gen=gen)
            for i in range(30):
                meta = step(context_lens=(i % 4 + 1, 0))
                q = torch.randn(4, 4, 16, generator=gen)
                fast = attend(meta, k, v, q)
                clones = [t.clone() for t in (meta.query_start_loc, meta.seq_lens,
                                              meta.block_table)]
                slow = paged_attention_ref(q, k, v, query_start_loc=clones[0],
                                           seq_lens=clones[1], block_table=clones[2],
                                           scale=0.25)
                assert torch.equal(fast, slow)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- the default builder ----------------------------------------------------------------------

def test_default_builder_returns_the_step_and_marks_engine_made_tensors(count_reads):
    builder = kvcore.AttentionMetadataBuilder(SPEC, **LIMITS)
    meta = step()
    assert builder.build(meta) is meta
    own = kvcore.AttentionMetadata(meta.query_start_loc.clone(), meta.seq_lens.clone(),
                                   meta.block_table.clone(), meta.slot_mapping.clone(), 3, 6, 4)
    assert facts_of(own) is None
    builder.build(own)
    assert facts_of(own) == facts_of(meta)
    attend(own, *caches())
    assert count_reads == []


@pytest.mark.parametrize(("limit", "message"), [
    ({"max_num_seqs": 1}, "the step has 2 requests but the builder was made for max_num_seqs=1"),
    ({"max_num_batched_tokens": 3}, "the step has 4 token rows but the builder was made for "
                                    "max_num_batched_tokens=3"),
    ({"max_model_len": 5}, "the step has a request of 6 tokens but the builder was made for "
                           "max_model_len=5"),
])
def test_builder_refuses_steps_beyond_its_maxima(limit, message):
    builder = kvcore.AttentionMetadataBuilder(SPEC, **{**LIMITS, **limit})
    with pytest.raises(ValueError, match=message):
        builder.build(step())


def test_builder_refuses_metadata_of_another_block_size():
    builder = kvcore.AttentionMetadataBuilder(
        kvcore.FullAttentionSpec(block_size=8, dtype=torch.float32, num_kv_heads=2,
                                 head_size=16), **LIMITS)
    with pytest.raises(ValueError, match="built for block_size=4 but the builder's spec has "
                                         "block_size=8"):
        builder.build(step())


def test_default_builder_refuses_graph_steps():
    builder = kvcore.AttentionMetadataBuilder(SPEC, **LIMITS)
    with pytest.raises(ValueError, match="keeps no persistent buffers"):
        builder.build(step(), graph_batch_size=4)


def test_builder_without_value_checks_reads_nothing(monkeypatch):
    monkeypatch.setattr(validation, "_value_checks", False)
    builder = kvcore.AttentionMetadataBuilder(SPEC, **LIMITS)
    meta = step()
    own = kvcore.AttentionMetadata(meta.query_start_loc.clone(), meta.seq_lens.clone(),
                                   meta.block_table.clone(), meta.slot_mapping.clone(), 3, 6, 4)
    assert builder.check(own) is None
    assert facts_of(own) is None


# -- persistent buffers -----------------------------------------------------------------------

def decode(context_lens, tables):
    return step(query_lens=[1] * len(context_lens), context_lens=context_lens, tables=tables)


def pointers(meta):
    return [t.data_ptr() for t in (meta.query_start_loc, meta.seq_lens, meta.block_table,
                                   meta.slot_mapping)]


def test_persistent_builder_reuses_its_buffers_for_steps_of_any_shape():
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    first = builder.build(step())
    second = builder.build(decode([3, 9, 0], [[1], [5, 6, 0], [4]]))
    expected = [t.data_ptr() for t in builder.buffers().values()]
    assert pointers(first) == pointers(second) == expected
    assert second.seq_lens.tolist() == [4, 10, 1]
    assert second.block_table[:, :3].tolist()[1] == [5, 6, 0]
    assert second.slot_mapping.tolist() == [7, 1, 16]
    assert facts_of(second).max_block_id == 6


class BufferCopies(TorchDispatchMode):
    """Counts ``copy_`` calls into the storages of ``buffers``."""

    def __init__(self, buffers) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in buffers}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten.copy_.default
                and args[0].untyped_storage().data_ptr() in self.storages):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph_batch_size=4"])
def test_persistent_builder_copies_nothing_an_engine_wrote_in_place(graph):
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    buffers = builder.buffers()
    fresh = decode([3, 9, 0], [[1], [5, 6, 0], [4]])
    with BufferCopies(buffers.values()) as control:
        expected = builder.build(fresh, graph_batch_size=4 if graph else None)
    expected = dict(qsl=expected.query_start_loc.clone(), seq_lens=expected.seq_lens.clone(),
                    table=expected.block_table.clone(), slots=expected.slot_mapping.clone())
    assert control.count >= 4  # the control: a step in tensors of its own is copied
    # The engine writes the same step into the buffers itself and passes views of them.
    for name in buffers:
        buffers[name].fill_(-7)
    n, rows, width = 3, 3, fresh.block_table.shape[1]
    buffers["query_start_loc"][:n + 1].copy_(fresh.query_start_loc)
    buffers["seq_lens"][:n].copy_(fresh.seq_lens)
    buffers["block_table"][:n, :width].copy_(fresh.block_table)
    buffers["slot_mapping"][:rows].copy_(fresh.slot_mapping)
    in_place = kvcore.AttentionMetadata(
        buffers["query_start_loc"][:n + 1], buffers["seq_lens"][:n],
        buffers["block_table"][:n, :width], buffers["slot_mapping"][:rows],
        fresh.max_query_len, fresh.max_seq_len, fresh.num_actual_tokens,
        query_start_loc_cpu=fresh.query_start_loc_cpu, seq_lens_cpu=fresh.seq_lens_cpu)
    with BufferCopies(buffers.values()) as mode:
        meta = builder.build(in_place, graph_batch_size=4 if graph else None)
    assert meta.seq_lens.tolist() == expected["seq_lens"].tolist()
    assert meta.slot_mapping.tolist() == expected["slots"].tolist()
    assert meta.query_start_loc.tolist() == expected["qsl"].tolist()
    # The real requests' rows; a padding request reads only its first column.
    assert meta.block_table[:n, :width].tolist() == expected["table"][:n, :width].tolist()
    assert meta.block_table[n:, :1].tolist() == expected["table"][n:, :1].tolist()
    # Eager: nothing copied. Graph: only the padding request's query_start_loc entry.
    assert mode.count == (1 if graph else 0)


def test_persistent_builder_results_equal_the_steps_own():
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    k, v = caches()
    q = torch.randn(4, 4, 16)
    builder.build(decode([3, 9, 0], [[1], [5, 6, 0], [4]]))  # leaves stale columns behind
    meta = step()
    assert torch.equal(attend(builder.build(meta), k, v, q), attend(meta, k, v, q))


def test_graph_build_pads_a_decode_step_with_harmless_requests():
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    meta = builder.build(decode([3, 9], [[1], [5, 6, 0]]), graph_batch_size=4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [4, 10, 1, 1]
    assert meta.block_table[2:, 0].tolist() == [0, 0]
    assert meta.slot_mapping.tolist() == [7, 1, -1, -1]
    assert (meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (4, 1, 64)
    facts = facts_of(meta)
    assert (facts.num_seqs, facts.num_tokens, facts.max_slot) == (4, 4, 7)
    same_host = builder.build(decode([20], [[3, 2, 1, 0, 7, 6]]), graph_batch_size=4)
    assert pointers(same_host) == pointers(meta)
    assert (same_host.num_actual_tokens, same_host.max_seq_len) == (4, 64)


@pytest.mark.parametrize(("common", "size", "message"), [
    (lambda: step(), 4, "needs a uniform-decode step"),
    (lambda: decode([1, 2, 3], [[0], [1], [2]]), 2, "the step has 3 requests, more than "
                                                    "graph_batch_size=2"),
    (lambda: decode([1], [[0]]), 9, "graph_batch_size=9 exceeds max_num_seqs=8"),
])
def test_graph_build_refuses_what_it_cannot_replay(common, size, message):
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    with pytest.raises(ValueError, match=message):
        builder.build(common(), graph_batch_size=size)


def test_is_uniform_decode_and_default_graph_sizes():
    assert is_uniform_decode(decode([1, 2], [[0], [1]]))
    assert not is_uniform_decode(step())
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_cuda_graph_runner_needs_a_persistent_builder():
    with pytest.raises(TypeError, match="keeps no persistent buffers"):
        kvcore.CudaGraphRunner(kvcore.AttentionMetadataBuilder(SPEC, **LIMITS), lambda i, m: i,
                               num_blocks=8)
    runner = kvcore.CudaGraphRunner(kvcore.PersistentMetadataBuilder(SPEC, **LIMITS),
                                    lambda i, m: i["x"], num_blocks=8, batch_sizes=[2, 1])
    assert runner.batch_sizes == [1, 2]
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        runner.capture({"x": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"batch_sizes=\[0, 1\] must be integers in "
                                         "1..max_num_seqs=8"):
        kvcore.CudaGraphRunner(kvcore.PersistentMetadataBuilder(SPEC, **LIMITS),
                               lambda i, m: i["x"], num_blocks=8, batch_sizes=[0, 1])


def test_uncaptured_runner_runs_steps_eagerly_through_the_builder():
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    seen = []
    runner = kvcore.CudaGraphRunner(builder, lambda i, m: (seen.append(m), i["x"] * 2)[1],
                                    num_blocks=8)
    assert runner.replayable(decode([1, 2], [[0], [1]])) and not runner.replayable(step())
    assert runner.graph_size(decode([1, 2], [[0], [1]])) is None  # nothing captured yet
    out = runner.run({"x": torch.ones(2)}, decode([1, 2], [[0], [1]]))
    assert out.tolist() == [2.0, 2.0]
    assert (runner.eager_steps, runner.replayed_steps) == (1, 0)
    assert pointers(seen[0]) == [t.data_ptr() for t in builder.buffers().values()]


def test_bench_step_smoke_runs_on_the_cpu(tmp_path):
    """benchmarks/bench_step.py --smoke: the script's CPU path, end to end."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_step.py"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "bench_step.json").read_text())
    assert results["correctness"] and all(c["ok"] for c in results["correctness"])
    assert {c["variant"] for c in results["checks"]} >= {"value checks off",
                                                         "value checks on (step facts, default)"}
    assert "vs checks off" in done.stdout
    # Section 6, the MLA pipeline: direct's row and CPU_MLA's, checked against direct.
    assert [row["path"] for row in results["mla_pipeline"]] == ["direct", "CPU_MLA"]
    assert "MLA pipeline" in done.stdout


def test_step_facts_of_steps_without_requests_or_columns():
    empty = kvcore.build_attention_metadata([], [], [], BS)
    assert facts_of(empty).num_seqs == 0
    facts = ops.step_facts_from_tensors(torch.tensor([0, 0, 0], dtype=torch.int32),
                                        torch.zeros(2, dtype=torch.int32),
                                        torch.zeros(2, 0, dtype=torch.int32),
                                        torch.zeros(0, dtype=torch.int64), BS)
    assert (facts.num_seqs, facts.max_blocks_per_seq, facts.max_block_id) == (2, 0, -1)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=1 needs 1 blocks of 4 but block_table "
                                         "has only 0 columns"):
        ops.step_facts_from_tensors(torch.tensor([0, 1], dtype=torch.int32),
                                    torch.ones(1, dtype=torch.int32),
                                    torch.zeros(1, 0, dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int64), BS)


@dataclasses.dataclass
class _PlannedMetadata(kvcore.AttentionMetadata):
    plan: str | None = None
    splits: int = 1


def test_extend_carries_every_common_field_into_a_backend_subclass():
    common = kvcore.build_attention_metadata([3, 1], [5, 9], [[4, 7], [2]], 16, causal=False)
    ours = common.extend(_PlannedMetadata, plan="p", splits=4)
    assert type(ours) is _PlannedMetadata and (ours.plan, ours.splits) == ("p", 4)
    for field in dataclasses.fields(kvcore.AttentionMetadata):
        assert getattr(ours, field.name) is getattr(common, field.name), field.name
    assert ours.causal is False and ours.num_seqs == 2
    assert common.extend(_PlannedMetadata).plan is None  # the subclass's defaults
    with pytest.raises(TypeError, match="nope"):
        common.extend(_PlannedMetadata, nope=1)


def decode_step(context_lens, tables, **kw):
    return step([1] * len(context_lens), context_lens, tables, **kw)


def test_graph_steps_copy_query_start_loc_only_when_the_buffer_does_not_count(monkeypatch):
    """A graph step's query_start_loc is 0..size: copied while the buffer may hold anything
    else (first step, after an eager step, after a write by anyone, without a host copy that
    shows 0..n), skipped otherwise; the buffer's contents are those of a copy either way."""
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    copies = []
    copy = torch.Tensor.copy_

    def counting(self, src, *args, **kwargs):
        if self.data_ptr() == builder.query_start_loc.data_ptr():
            copies.append(tuple(self.shape))
        return copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    expected = torch.arange(5, dtype=torch.int32)

    def graph_step(common, *, copied):
        copies.clear()
        meta = builder.build(common, graph_batch_size=4)
        assert torch.equal(meta.query_start_loc, expected)
        assert bool(copies) == copied
        assert facts_of(meta) is not None  # marked as before

    graph_step(decode_step([5, 9], [[2, 4], [7, 1, 3]]), copied=True)
    graph_step(decode_step([6, 10, 2], [[2, 4], [7, 1, 3], [5]]), copied=False)
    builder.build(step())  # eager: writes 0, 1, 4
    graph_step(decode_step([5, 9], [[2, 4], [7, 1, 3]]), copied=True)
    graph_step(decode_step([5], [[2, 4]]), copied=False)
    builder.query_start_loc[2].fill_(7)  # someone else's write
    graph_step(decode_step([5], [[2, 4]]), copied=True)
    no_host = dataclasses.replace(decode_step([5], [[2, 4]]), query_start_loc_cpu=None)
    graph_step(no_host, copied=True)
    graph_step(no_host, copied=True)
    graph_step(decode_step([5], [[2, 4]]), copied=True)
    graph_step(decode_step([5, 9], [[2, 4], [7, 1, 3]]), copied=False)
    copies.clear()
    builder.build(decode_step([5, 9], [[2, 4], [7, 1, 3]]), graph_batch_size=8)
    assert copies  # a larger size than the buffer is known to count to


def test_graph_signature_finds_nested_tensors_once_and_still_reads_them():
    """The runner's signature of a step: the metadata's own host values and every tensor's
    address, shape and strides, nested ones included (a plan's workspace); the tensors of an
    immutable part are found once, their addresses read every step."""
    from kvcore.cuda_graphs import _Signatures

    @dataclasses.dataclass(frozen=True)
    class Plan:
        splits: int
        workspace: tuple

    @dataclasses.dataclass
    class Meta(kvcore.AttentionMetadata):
        plan: object = None
        other: object = None

    workspace = (torch.zeros(4), torch.zeros(2, 3))
    plan = Plan(2, workspace)
    base = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS).build(step())
    meta = base.extend(Meta, plan=plan, other=[torch.zeros(1)])
    signature = _Signatures()
    first = signature(meta)
    tensors = [meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping,
               *workspace, meta.other[0]]
    assert first[:6] == (("max_query_len", 3), ("max_seq_len", 6), ("num_actual_tokens", 4),
                         ("causal", True), ("query_start_loc_cpu", None), ("seq_lens_cpu", None))
    assert first[-len(tensors):] == tuple((t.data_ptr(), t.shape, t.stride()) for t in tensors)
    assert signature(meta) == first
    workspace[1].set_(torch.zeros(6).view(2, 3))  # same object, other memory
    assert signature(meta) != first
    meta.other[0] = torch.zeros(1)  # a mutable part is walked every step
    assert signature(meta)[-1] == (meta.other[0].data_ptr(), (1,), (1,))
