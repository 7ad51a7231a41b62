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


# -- sliding windows: a ring buffer's decode replaces context no query sees ------------------

W, RING_BS = 8, 4
RING = [5, 9]  # a request's ring of 8 tokens: position p in slot p % 8, blocks 5 and 9


def _ring_table(seq_len: int) -> list[int]:
    """The request's block table with logical block j on ring block j % 2 (positions keep
    their ring slots: 4 divides 8)."""
    return [RING[j % len(RING)] for j in range(-(-seq_len // RING_BS))]


def _ring_step(context: int, query: int, window: int | None):
    return kvcore.build_attention_metadata([query], [context], [_ring_table(context + query)],
                                           RING_BS, num_blocks=16, sliding_window=window)


def test_a_ring_decode_may_overwrite_the_slot_that_left_the_window():
    # Decode at position 10 writes ring slot 2 (block 5, offset 2), which holds position 2:
    # context, but 10 - 2 = 8 positions back, outside the window of 8.
    meta = _ring_step(10, 1, W)
    assert meta.slot_mapping.tolist() == [5 * RING_BS + 2]
    assert ops.checked_step_facts(meta.slot_mapping).sliding_window == W
    ops.step_facts_from_tensors(*_engine_tensors(meta, [22]), RING_BS, sliding_window=W)
    # Full attention, or a window of 9 (position 2 is then seen), still refuse it.
    for window in (None, W + 1):
        with pytest.raises(ValueError, match=r"request 0's new token 0 \(row 0\) is written "
                                             r"to slot 22 .* reads as context \(its token 2"):
            _ring_step(10, 1, window)
        with pytest.raises(ValueError, match="the write would replace what it attends to"):
            ops.step_facts_from_tensors(*_engine_tensors(meta, [22]), RING_BS,
                                        sliding_window=window)


def test_an_overwrite_inside_the_window_is_still_refused():
    # Two new tokens at 10 and 11: 11 writes ring slot 3 (position 3), which the query at
    # position 10 sees (10 - 3 = 7 < 8).
    message = (r"request 0's new token 1 \(row 1\) is written to slot 23 \(block 5, offset 3"
               r"\), which the same request reads as context \(its token 3, inside the "
               r"sliding window of 8 of its first new token\)")
    with pytest.raises(ValueError, match=message):
        _ring_step(10, 2, W)
    tensors = _engine_tensors(_ring_step(10, 1, W), [22, 23])
    tensors = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([12], dtype=torch.int32),
               torch.tensor([_ring_table(12)], dtype=torch.int32), tensors[3])
    with pytest.raises(ValueError, match=message):
        ops.step_facts_from_tensors(*tensors, RING_BS, sliding_window=W)


def _spec(window: int | None) -> kvcore.FullAttentionSpec:
    return kvcore.FullAttentionSpec(block_size=RING_BS, num_kv_heads=2, head_size=16,
                                    dtype=torch.float32, sliding_window=window)


@pytest.mark.parametrize("cls", [kvcore.AttentionMetadataBuilder,
                                 kvcore.PersistentMetadataBuilder])
def test_a_builder_checks_with_its_specs_window(cls):
    def builder(window):
        return cls(_spec(window), num_heads=4, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=64, device="cpu")

    meta = _ring_step(10, 1, W)
    engine = kvcore.AttentionMetadata(*_engine_tensors(meta, [22]), max_query_len=1,
                                      max_seq_len=11, num_actual_tokens=1)
    built = builder(W).build(engine)  # unmarked: one device read, with the spec's window
    assert ops.checked_step_facts(built.query_start_loc, built.slot_mapping).sliding_window == W
    builder(W).build(meta)  # marked on the host for the same window: taken as it is
    # A full-attention builder (or a wider window) does not take facts checked for 8: it
    # checks the step again, and refuses it.
    for window in (None, W + 1):
        with pytest.raises(ValueError, match="reads as context"):
            builder(window).build(meta)
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive integer"):
        _spec(0)


def test_windowed_host_and_tensor_checks_agree():
    """Random steps under random windows: the set-based and the tensor check agree, a window
    refuses a subset of what full attention refuses, and a window as long as every request
    refuses exactly the same steps."""
    from kvcore.step_facts import context_overwrites, overwrites_context

    gen = torch.Generator().manual_seed(7)
    found = relaxed = 0
    for _ in range(400):
        bs = int(torch.randint(1, 6, (1,), generator=gen))
        n = int(torch.randint(1, 5, (1,), generator=gen))
        window = int(torch.randint(1, 14, (1,), generator=gen))
        ctx = torch.randint(0, 14, (n,), generator=gen).tolist()
        q = torch.randint(0, 4, (n,), generator=gen).tolist()
        rows = [torch.randint(0, 8, (-(-(c + k) // bs),), generator=gen).tolist()
                for c, k in zip(ctx, q, strict=True)]
        slots = [rows[i][p // bs] * bs + p % bs
                 for i in range(n) for p in range(ctx[i], ctx[i] + q[i])]
        width = max(max(len(r) for r in rows), 1)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        args = (torch.tensor(slots, dtype=torch.int64), torch.tensor(ctx), table, bs)
        full = overwrites_context(slots, ctx, rows, bs)
        host = overwrites_context(slots, ctx, rows, bs, sliding_window=window)
        tensor = bool(context_overwrites(*args, sliding_window=window).any())
        assert host == tensor, (bs, window, ctx, q, rows)
        assert not host or full
        assert overwrites_context(slots, ctx, rows, bs, sliding_window=max(ctx) + 1) == full
        found += host
        relaxed += full and not host
    assert 30 < found < 370 and relaxed > 10  # every outcome was exercised
