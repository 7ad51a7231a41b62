"""The ``offload`` connector's planner: runs, staging chunks and the choice of path, checked
directly against simple models on fresh random id patterns."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.connectors.offload.planning import (
    DIRECT_MIN_RUN_BYTES,
    Chunk,
    chunk_slots,
    plan_transfer,
    slot_runs,
)


def model_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Runs by walking the sorted pairs one at a time."""
    runs: list[list[int]] = []
    for block, slot in sorted(pairs):
        if runs and block == runs[-1][0] + runs[-1][2] and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([block, slot, 1])
    return [(b, s, n) for b, s, n in runs]


def random_pairs(rnd: random.Random, n: int, num_blocks: int = 64, num_slots: int = 64,
                 repeat_blocks: bool = False) -> list[tuple[int, int]]:
    """``n`` (block, slot) pairs with unique slots: contiguous stretches mixed with jumps (a
    save may name a block twice, under two keys)."""
    slots = rnd.sample(range(num_slots), n)
    if rnd.random() < 0.5:
        slots.sort()
    if repeat_blocks:
        blocks = [rnd.randrange(num_blocks) for _ in range(n)]
    else:
        blocks = rnd.sample(range(num_blocks), n)
        if rnd.random() < 0.5:
            blocks.sort()
    return list(zip(blocks, slots, strict=True))


# -- runs -------------------------------------------------------------------------------------


def test_runs_merge_consecutive_blocks_and_slots():
    assert slot_runs([(5, 0), (6, 1), (7, 2), (9, 3), (10, 5), (2, 7)]) == [
        (2, 7, 1), (5, 0, 3), (9, 3, 1), (10, 5, 1)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("repeat_blocks", [False, True], ids=["unique", "repeated_blocks"])
def test_runs_of_random_patterns_match_the_model(repeat_blocks):
    rnd = random.Random(random.randrange(2**31))
    for _ in range(200):
        pairs = random_pairs(rnd, rnd.randint(1, 40), repeat_blocks=repeat_blocks)
        runs = slot_runs(pairs)
        assert runs == model_runs(pairs), pairs
        assert all(isinstance(v, int) for run in runs for v in run)
        covered = sorted((b + i, s + i) for b, s, n in runs for i in range(n))
        assert covered == sorted(pairs)


# -- chunks -----------------------------------------------------------------------------------


def test_chunks_cut_at_chunk_boundaries_and_split_runs_of_slots():
    assert chunk_slots([0, 1, 2, 3, 4], 2) == [
        Chunk(0, 2, ((0, 0, 2),)), Chunk(2, 4, ((0, 2, 2),)), Chunk(4, 5, ((0, 4, 1),))]
    # one chunk, two runs of slots: one gather, two copies
    assert chunk_slots([0, 1, 5, 6, 7, 9], 4) == [
        Chunk(0, 4, ((0, 0, 2), (2, 5, 2))), Chunk(4, 6, ((0, 7, 1), (1, 9, 1)))]
    assert chunk_slots([3, 4, 5], 3) == [Chunk(0, 3, ((0, 3, 3),))]
    assert chunk_slots([], 4) == []
    with pytest.raises(ValueError, match="chunk_blocks=0 must be >= 1"):
        chunk_slots([1], 0)


@given(st.sets(st.integers(0, 200), max_size=80), st.integers(1, 20))
def test_chunks_cover_every_row_once_in_runs_of_consecutive_slots(slots, chunk_blocks):
    slots = sorted(slots)
    chunks = chunk_slots(slots, chunk_blocks)
    rebuilt = []
    assert [c.start for c in chunks] == list(range(0, len(slots), chunk_blocks))
    for chunk in chunks:
        assert 0 < chunk.stop - chunk.start <= chunk_blocks
        row = 0
        for seg_row, slot, n in chunk.segments:
            assert seg_row == row and n >= 1  # segments tile the chunk's rows in order
            rebuilt += range(slot, slot + n)
            row += n
        assert row == chunk.stop - chunk.start
    assert rebuilt == slots
    # runs split only at chunk boundaries: no two segments of a chunk could merge
    for chunk in chunks:
        for (r0, s0, n0), (_, s1, _) in zip(chunk.segments, chunk.segments[1:], strict=False):
            assert s1 != s0 + n0, (r0, chunk)


# -- the path ---------------------------------------------------------------------------------


def test_contiguous_cross_layer_blocks_go_direct_in_one_run():
    pairs = [(b, b - 3) for b in range(3, 15)]
    plan = plan_transfer(pairs, single_view=True, chunk_blocks=4, block_bytes=1024,
                         copier=False)
    assert plan.path == "direct" and plan.runs == [(3, 0, 12)]


def test_scattered_small_blocks_are_staged_and_large_ones_go_direct():
    pairs = [(b, s) for s, b in enumerate([9, 2, 30, 17, 5, 22])]  # six runs of one block
    small = plan_transfer(pairs, single_view=True, chunk_blocks=4, block_bytes=1 << 10,
                          copier=False)
    assert small.path == "staged"  # 6 copies direct, 2 staged
    assert small.blocks == [9, 2, 30, 17, 5, 22]
    assert small.chunks == [Chunk(0, 4, ((0, 0, 4),)), Chunk(4, 6, ((0, 4, 2),))]
    large = plan_transfer(pairs, single_view=True, chunk_blocks=4,
                          block_bytes=DIRECT_MIN_RUN_BYTES, copier=False)
    assert large.path == "direct" and len(large.runs) == 6  # each copy moves enough


def test_per_layer_caches_never_go_direct():
    pairs = [(b, b) for b in range(8)]
    for copier, path in ((False, "staged"), (True, "copier")):
        plan = plan_transfer(pairs, single_view=False, chunk_blocks=4,
                             block_bytes=DIRECT_MIN_RUN_BYTES, copier=copier)
        assert plan.path == path
    assert plan.pairs == pairs


def test_an_empty_transfer_is_direct_with_no_runs():
    for single_view in (False, True):
        plan = plan_transfer([], single_view=single_view, chunk_blocks=4, block_bytes=64,
                             copier=True)
        assert plan.path == "direct" and plan.runs == []


def model_path(pairs, single_view, chunk_blocks, block_bytes, copier) -> str:
    """Direct when run copies are no more than the staged chunks, or long on average."""
    if not pairs:
        return "direct"
    if single_view:
        runs = len(model_runs(pairs))
        chunks = -(-len(pairs) // chunk_blocks)
        if runs <= chunks or len(pairs) * block_bytes / runs >= DIRECT_MIN_RUN_BYTES:
            return "direct"
    return "copier" if copier else "staged"


def test_plans_of_random_patterns_match_the_model_and_move_every_pair_once():
    rnd = random.Random(random.randrange(2**31))
    for _ in range(300):
        pairs = random_pairs(rnd, rnd.randint(0, 40), repeat_blocks=rnd.random() < 0.3)
        single_view, copier = rnd.random() < 0.5, rnd.random() < 0.3
        chunk_blocks = rnd.randint(1, 12)
        block_bytes = rnd.choice([256, 1 << 20, 4 << 20, DIRECT_MIN_RUN_BYTES])
        plan = plan_transfer(pairs, single_view=single_view, chunk_blocks=chunk_blocks,
                             block_bytes=block_bytes, copier=copier)
        case = (pairs, single_view, chunk_blocks, block_bytes, copier)
        assert plan.path == model_path(*case), case
        if plan.path == "direct":
            assert plan.runs == model_runs(pairs)
        elif plan.path == "copier":
            assert plan.pairs == pairs
        else:
            by_slot = sorted(pairs, key=lambda p: p[1])
            assert plan.blocks == [b for b, _ in by_slot]
            rows = [(plan.blocks[c.start + row + i], slot + i)
                    for c in plan.chunks for row, slot, n in c.segments for i in range(n)]
            assert rows == by_slot
            assert all(c.stop - c.start <= chunk_blocks for c in plan.chunks)
