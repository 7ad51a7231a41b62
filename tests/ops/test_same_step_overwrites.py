"""A step's new tokens must not land on slots the same step reads as context: the write
happens before attention, so the reading request would attend to the new token in place of
its own. Refused once per step, by build_attention_metadata on the host lists and by
step_facts_from_tensors (the builders' check of engine-made metadata)."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import ops


def _engine_tensors(meta: kvcore.AttentionMetadata, slot_mapping: list[int]):
    """The step's tensors as an engine would make them (unmarked), with its own slots."""
    return (meta.query_start_loc.clone(), meta.seq_lens.clone(), meta.block_table.clone(),
            torch.tensor(slot_mapping, dtype=torch.int64))


@pytest.mark.parametrize(("query_lens", "context_lens", "tables", "message"), [
    # Both new tokens land on tokens 0 and 1 of the request's own context (block 3 twice).
    ([2], [4], [[3, 3]], r"request 0's new token 0 \(row 0\) is written to slot 12 \(block 3, "
     r"offset 0\), which the same request reads as context \(its token 0\)"),
    # Request 1's new token goes to block 5, which request 0 reads as context.
    ([1, 1], [5, 4], [[3, 5], [8, 5]], r"request 1's new token 0 \(row 1\) is written to "
     r"slot 20 \(block 5, offset 0\), which request 0 reads as context \(its token 4\)"),
    # Across requests the other way round: request 0 writes into request 1's prefix block.
    ([2, 1], [0, 3], [[7], [7]], r"request 0's new token 0 \(row 0\) is written to slot 28 "
     r"\(block 7, offset 0\), which request 1 reads as context"),
], ids=["own-context", "other-request-context", "into-a-later-request"])
def test_new_tokens_on_context_slots_are_refused(query_lens, context_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        kvcore.build_attention_metadata(query_lens, context_lens, tables, 4, num_blocks=16)


def test_engine_made_metadata_is_refused_by_the_step_check():
    good = kvcore.build_attention_metadata([1, 1], [5, 4], [[3, 5], [8, 6]], 4)
    # The engine's own slot_mapping puts request 1's token in block 5 offset 0 (request 0's
    # context token 4); the block tables alone are fine.
    tensors = _engine_tensors(good, [21, 20])
    with pytest.raises(ValueError, match=r"request 1's new token 0 \(row 1\) is written to "
                                         r"slot 20 .* which request 0 reads as context"):
        ops.step_facts_from_tensors(*tensors, 4)
    builder = kvcore.AttentionMetadataBuilder(
        kvcore.FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16,
                                 dtype=torch.float32),
        num_heads=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
        device="cpu")
    bad = kvcore.AttentionMetadata(*tensors, max_query_len=1, max_seq_len=6,
                                   num_actual_tokens=2)
    with pytest.raises(ValueError, match="reads as context"):
        builder.build(bad)


def test_steps_that_only_share_read_only_prefixes_pass():
    """Requests sharing cached prefix blocks (read by both, written by neither) and writing
    the free tail of their partial block are fine, on both paths."""
    meta = kvcore.build_attention_metadata([2, 1, 3], [5, 4, 0], [[3, 5], [3, 9], [11]], 4,
                                           num_blocks=16)
    assert ops.checked_step_facts(meta.slot_mapping) is not None
    slots = meta.slot_mapping.tolist()
    assert slots == [21, 22, 36, 44, 45, 46]
    ops.step_facts_from_tensors(*_engine_tensors(meta, slots), 4)
    # Padding rows (slot -1) and padding columns of the table (block 0) are not context.
    padded = _engine_tensors(meta, slots)
    ops.step_facts_from_tensors(padded[0], padded[1], padded[2],
                                torch.tensor([21, 22, 36, 44, 45, -1]), 4)


def test_the_check_is_vectorised_over_a_large_step():
    """Thousands of requests and tokens: one pass of tensor ops, not a loop over slots."""
    n, ctx, bs = 2048, 64, 16
    blocks = torch.arange(n * 5).reshape(n, 5)
    meta = kvcore.build_attention_metadata([1] * n, [ctx] * n, blocks, bs)
    hits = ops.step_facts_from_tensors(*_engine_tensors(meta, meta.slot_mapping.tolist()), bs)
    assert hits.num_seqs == n
    slots = meta.slot_mapping.clone()
    slots[-1] = int(blocks[7, 1]) * bs + 3  # the last request writes request 7's context
    with pytest.raises(ValueError, match=r"request 2047's new token 0 .* which request 7 "):
        ops.step_facts_from_tensors(*_engine_tensors(meta, slots.tolist()), bs)


def test_the_host_and_tensor_checks_agree():
    """build_attention_metadata's set-based check and the tensor one (step_facts_from_tensors)
    find the same steps, over random steps whose requests draw blocks from a small pool."""
    from kvcore.step_facts import context_overwrites, overwrites_context

    gen = torch.Generator().manual_seed(5)
    found = 0
    for _ in range(300):
        bs = int(torch.randint(1, 6, (1,), generator=gen))
        n = int(torch.randint(1, 5, (1,), generator=gen))
        ctx = torch.randint(0, 12, (n,), generator=gen).tolist()
        q = torch.randint(0, 4, (n,), generator=gen).tolist()
        rows = [torch.randint(0, 10, (-(-(c + k) // bs),), generator=gen).tolist()
                for c, k in zip(ctx, q, strict=True)]
        slots = [rows[i][p // bs] * bs + p % bs
                 for i in range(n) for p in range(ctx[i], ctx[i] + q[i])]
        width = max(max(len(r) for r in rows), 1)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        host = overwrites_context(slots, ctx, rows, bs)
        tensor = bool(context_overwrites(torch.tensor(slots, dtype=torch.int64),
                                         torch.tensor(ctx), table, bs).any())
        assert host == tensor, (bs, ctx, q, rows)
        found += host
    assert 30 < found < 270  # both outcomes were exercised
