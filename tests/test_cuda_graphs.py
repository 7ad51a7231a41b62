"""CudaGraphRunner on a GPU: a multi-layer decode step captured per batch size, replayed for
later steps of other sizes, lengths and block tables, equals the eager step and the
reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcore
from kvcore import ops
from kvcore.ops.reference import paged_attention_ref

pytestmark = pytest.mark.gpu

BS, HQ, HK, D, LAYERS, BLOCKS = 16, 8, 2, 64, 4, 64


@pytest.fixture
def engine():
    """A 4-layer attention-only "model" over TRITON_ATTN: each layer writes its K/V and
    attends; the step returns every layer's output side by side."""
    backend = kvcore.resolve_backend("TRITON_ATTN")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    caches = kvcore.allocate_kv_caches(backend, num_layers=LAYERS, num_blocks=BLOCKS,
                                       block_size=BS, num_kv_heads=HK, head_size=D,
                                       dtype=torch.bfloat16, device=device)
    caches.storage.copy_(torch.randn(caches.storage.shape, generator=gen))
    spec = kvcore.FullAttentionSpec(block_size=BS, dtype=torch.bfloat16, num_kv_heads=HK,
                                    head_size=D)
    builder = backend.get_builder_cls()(spec, num_heads=HQ, max_num_seqs=8,
                                        max_num_batched_tokens=64, max_model_len=4096,
                                        device=device)
    impl = backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK)
    scales = kvcore.LayerScales()

    def step_fn(inputs, meta):
        outs = []
        for i, layer in enumerate(caches.layers):
            q = inputs["query"] * (i + 1)
            impl.do_kv_cache_update(scales, inputs["key"], inputs["value"], layer,
                                    meta.slot_mapping)
            outs.append(impl.forward(scales, q, inputs["key"], inputs["value"], layer, meta,
                                     output=torch.empty_like(q)))
        return torch.stack(outs, dim=1)

    return builder, step_fn, caches


def capture_inputs():
    """One decode token's query, key and value (zeros): the inputs a capture runs on."""
    return {"query": torch.zeros(1, HQ, D, dtype=torch.bfloat16, device="cuda"),
            "key": torch.zeros(1, HK, D, dtype=torch.bfloat16, device="cuda"),
            "value": torch.zeros(1, HK, D, dtype=torch.bfloat16, device="cuda")}


def decode_step(gen, context_lens, device="cuda"):
    ids = torch.randperm(BLOCKS, generator=gen).tolist()
    tables, start = [], 0
    for c in context_lens:
        n = -(-(c + 1) // BS)
        tables.append(ids[start:start + n])
        start += n
    meta = kvcore.build_attention_metadata([1] * len(context_lens), context_lens, tables, BS,
                                           device=device)
    n = len(context_lens)
    inputs = {"query": torch.randn(n, HQ, D, generator=gen).to(device, torch.bfloat16),
              "key": torch.randn(n, HK, D, generator=gen).to(device, torch.bfloat16),
              "value": torch.randn(n, HK, D, generator=gen).to(device, torch.bfloat16)}
    return meta, inputs


def padded(inputs, size):
    return {k: torch.cat([v, v.new_zeros((size - v.shape[0], *v.shape[1:]))])
            for k, v in inputs.items()}


def test_replayed_steps_equal_eager_steps_and_the_reference(engine):
    builder, step_fn, caches = engine
    runner = kvcore.CudaGraphRunner(builder, step_fn, num_blocks=BLOCKS,
                                    batch_sizes=[1, 2, 4, 8])
    runner.capture(capture_inputs())
    gen = torch.Generator().manual_seed(1)
    for context_lens in ([300], [5, 200, 31], [15, 16, 17, 100, 400], [7, 8]):
        meta, inputs = decode_step(gen, context_lens)
        replayed = runner.run(inputs, meta).clone()
        size = runner.graph_size(meta)
        eager = step_fn(padded(inputs, size), builder.build(meta, graph_batch_size=size))
        n = len(context_lens)
        assert torch.equal(replayed, eager[:n]), context_lens
        for i, layer in enumerate(caches.layers):
            k, v = layer.unbind(1)
            ref = paged_attention_ref(
                (inputs["query"] * (i + 1)).double(), k.double(), v.double(),
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                block_table=meta.block_table, scale=D**-0.5)
            torch.testing.assert_close(replayed[:, i].double(), ref, atol=2e-2, rtol=2e-2)
    assert (runner.replayed_steps, runner.eager_steps) == (4, 0)


def test_mixed_and_oversized_steps_run_eagerly(engine):
    builder, step_fn, _ = engine
    runner = kvcore.CudaGraphRunner(builder, step_fn, num_blocks=BLOCKS, batch_sizes=[2])
    runner.capture(capture_inputs())
    gen = torch.Generator().manual_seed(2)
    meta, inputs = decode_step(gen, [3, 4, 5])
    assert runner.graph_size(meta) is None
    assert runner.run(inputs, meta).shape[0] == 3
    assert (runner.replayed_steps, runner.eager_steps) == (0, 1)


def test_a_replay_refuses_ids_beyond_the_cache(engine):
    builder, step_fn, _ = engine
    runner = kvcore.CudaGraphRunner(builder, step_fn, num_blocks=8, batch_sizes=[2])
    runner.capture(capture_inputs())
    meta = kvcore.build_attention_metadata([1], [3], [[9]], BS, device="cuda")
    inputs = decode_step(torch.Generator().manual_seed(3), [3])[1]
    with pytest.raises(ValueError, match="block_table refers to block id 9, but the cache has "
                                         "8 blocks"):
        runner.run(inputs, meta)


def test_a_builder_that_moves_its_tensors_cannot_replay(engine):
    builder, step_fn, _ = engine

    class Moving(type(builder)):
        """Returns a new ``seq_lens`` every step, marked with the step's facts (so the ops
        skip their value reads, as for the real buffers) and kept alive (so the allocator
        cannot hand the next step the same address)."""

        kept = []

        def build(self, common, *, graph_batch_size=None):
            meta = super().build(common, graph_batch_size=graph_batch_size)
            moved = dataclasses.replace(meta, seq_lens=meta.seq_lens.clone())
            facts = ops.checked_step_facts(meta.query_start_loc, meta.seq_lens,
                                           meta.block_table, meta.slot_mapping)
            ops.mark_step_checked(facts, query_start_loc=moved.query_start_loc,
                                  seq_lens=moved.seq_lens, block_table=moved.block_table,
                                  slot_mapping=moved.slot_mapping)
            self.kept.append(moved.seq_lens)
            return moved

    moving = Moving(builder.spec, num_heads=HQ, max_num_seqs=8, max_num_batched_tokens=64,
                    max_model_len=512, device="cuda")
    runner = kvcore.CudaGraphRunner(moving, step_fn, num_blocks=BLOCKS, batch_sizes=[2])
    runner.capture(capture_inputs())
    meta, inputs = decode_step(torch.Generator().manual_seed(4), [3, 9])
    with pytest.raises(RuntimeError, match="returned other tensors or host values than at "
                                           "capture"):
        runner.run(inputs, meta)


def test_a_builder_that_leaves_its_tensors_unmarked_cannot_capture(engine):
    """Unmarked metadata would make every op read it back (a sync) inside the capture."""
    builder, step_fn, _ = engine

    class Unmarked(type(builder)):
        def build(self, common, *, graph_batch_size=None):
            meta = super().build(common, graph_batch_size=graph_batch_size)
            return dataclasses.replace(meta, seq_lens=meta.seq_lens.clone())

    unmarked = Unmarked(builder.spec, num_heads=HQ, max_num_seqs=8, max_num_batched_tokens=64,
                        max_model_len=512, device="cuda")
    runner = kvcore.CudaGraphRunner(unmarked, step_fn, num_blocks=BLOCKS, batch_sizes=[2])
    with pytest.raises(ValueError, match=r"Unmarked.build\(graph_batch_size=2\) returned "
                                         "metadata tensors not marked"):
        runner.capture(capture_inputs())
