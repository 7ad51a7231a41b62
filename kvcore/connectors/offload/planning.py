"""How one transfer moves: direct runs, staged chunks, or the block copier.

A transfer is a list of ``(block_id, slot)`` pairs: device block ``block_id`` is saved to (or
loaded from) pool slot ``slot``. Planning runs on the host and touches no device.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.blocks import block_runs

__all__ = ["DIRECT_MIN_RUN_BYTES", "Chunk", "TransferPlan", "chunk_slots", "plan_transfer",
           "slot_runs"]

#: Cross-layer runs at least this large on average are copied directly (no staging kernel).
DIRECT_MIN_RUN_BYTES = 16 << 20


def slot_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(block_id, slot)`` pairs as ``(first_block, first_slot, count)`` runs where both
    advance by one, so each run is a single copy; sorted by block, then slot."""
    runs = block_runs([b for b, _ in pairs], [s for _, s in pairs])
    return [(b, s, n) for b, s, n in runs.tolist()]


@dataclass(frozen=True)
class Chunk:
    """Rows ``start:stop`` of a staged transfer (in slot order) that go through staging at
    once; each segment ``(row, slot, count)`` (row counted from ``start``) is one copy
    between staging rows ``row:row + count`` and pool slots ``slot:slot + count``."""

    start: int
    stop: int
    segments: tuple[tuple[int, int, int], ...]


def chunk_slots(slots: list[int], chunk_blocks: int) -> list[Chunk]:
    """Cut a transfer whose ``i``-th row goes to or from pool slot ``slots[i]`` into chunks
    of at most ``chunk_blocks`` rows, each with its runs of consecutive slots."""
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks={chunk_blocks} must be >= 1")
    chunks: list[Chunk] = []
    start = 0
    segments: list[list[int]] = []
    for i, slot in enumerate(slots):
        if i - start == chunk_blocks:
            chunks.append(Chunk(start, i, tuple(map(tuple, segments))))
            start, segments = i, []
        if segments and slot == segments[-1][1] + segments[-1][2]:
            segments[-1][2] += 1
        else:
            segments.append([i - start, slot, 1])
    if segments:
        chunks.append(Chunk(start, len(slots), tuple(map(tuple, segments))))
    return chunks


@dataclass(frozen=True)
class TransferPlan:
    """How one transfer moves: ``runs`` (direct), ``blocks`` + ``chunks`` (staged) or
    ``pairs`` (through the block copier)."""

    runs: list[tuple[int, int, int]] | None = None
    blocks: list[int] | None = None  # device block of each staged row, in slot order
    chunks: list[Chunk] | None = None
    pairs: list[tuple[int, int]] | None = None  # (block, slot) for the block copier

    @property
    def path(self) -> str:
        """``"direct"``, ``"staged"`` or ``"copier"``."""
        return ("direct" if self.runs is not None else "staged" if self.chunks is not None
                else "copier")


def plan_transfer(pairs: list[tuple[int, int]], *, single_view: bool, chunk_blocks: int,
                  block_bytes: int, copier: bool) -> TransferPlan:
    """Plan the transfer of ``(block_id, slot)`` pairs.

    Direct run copies (no device kernel at all) when the cache is one view (cross-layer) and
    its blocks and slots form runs that are few (no more copies than staging would issue) or
    long (at least :data:`DIRECT_MIN_RUN_BYTES` on average); else the block copier when there
    is one; else staged chunks of at most ``chunk_blocks`` rows, in slot order.

    Args:
        pairs: ``(block_id, slot)`` of each block moved.
        single_view: whether the cache is a single ``(num_blocks, block_bytes)`` view (a
            cross-layer cache), so a run of blocks is one contiguous device region.
        chunk_blocks: rows per staging chunk (at least 1).
        block_bytes: bytes of one block, every layer.
        copier: whether a block copier takes the transfers that would be staged.
    """
    if not pairs:
        return TransferPlan(runs=[])
    if single_view:
        runs = slot_runs(pairs)
        staged_copies = -(-len(pairs) // chunk_blocks)  # at least one per chunk
        if (len(runs) <= staged_copies
                or len(pairs) * block_bytes >= DIRECT_MIN_RUN_BYTES * len(runs)):
            return TransferPlan(runs=runs)
    if copier:
        return TransferPlan(pairs=pairs)
    by_slot = sorted(pairs, key=lambda p: p[1])
    return TransferPlan(blocks=[b for b, _ in by_slot],
                        chunks=chunk_slots([s for _, s in by_slot], chunk_blocks))
