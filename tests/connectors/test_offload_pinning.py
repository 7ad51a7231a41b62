"""The offload pool is allocated in pinned chunks in the background and used only where it
exists.

Pinned allocation needs CUDA; here a stand-in ``alloc_fn`` records the chunks and can be held
back or fail, which is exactly what the pool's bookkeeping sees on a GPU. The H200 figures
(start-up and first transfers) come from ``benchmarks/bench_offload.py``.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from kv_helpers import block_bytes, keys_for, make_caches

import kvcore.connectors.offload.connector as offload_connector
from kvcore.connectors import get_connector
from kvcore.connectors.offload.pinning import HostPool
from kvcore.connectors.offload.slots import SlotIndex


class FakePinning:
    """Stand-in for torch's pinned allocation: records each chunk's rows in call order;
    chunks with an index in ``hold`` (or every chunk but the first, ``hold_rest``) wait for
    ``release``; chunk ``fail_at`` raises."""

    def __init__(self, hold: frozenset[int] = frozenset(), fail_at: int | None = None,
                 hold_rest: bool = False) -> None:
        self.chunks: list[torch.Tensor] = []
        self.hold, self.fail_at, self.hold_rest = hold, fail_at, hold_rest
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls = 0
        self.active = self.most_active = 0  # allocations in progress, and the most at once

    def alloc(self, rows: int, row_bytes: int) -> torch.Tensor:
        with self.lock:
            index, self.calls = self.calls, self.calls + 1
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            return self._alloc(index, rows, row_bytes)
        finally:
            with self.lock:
                self.active -= 1

    def _alloc(self, index: int, rows: int, row_bytes: int) -> torch.Tensor:
        if index in self.hold or (self.hold_rest and index):
            assert self.release.wait(10)
        if index == self.fail_at:
            raise RuntimeError("CUDA error: out of memory")
        chunk = torch.empty((rows, row_bytes), dtype=torch.uint8)
        with self.lock:
            self.chunks.append(chunk)
        return chunk

    def pool(self, num_slots: int, slot_bytes: int, *, pin: bool = True,
             background: bool = True, workers: int = 1) -> HostPool:
        """A pool allocated through this stand-in in chunks of two slots (``pin`` is ignored:
        the connector asks for none on CPU). One worker: chunks are requested in order."""
        return HostPool(num_slots, slot_bytes, pin=True, background=background,
                        chunk_bytes=2 * slot_bytes, workers=workers, alloc_fn=self.alloc)


def test_the_pool_is_usable_once_its_first_chunk_exists_and_grows_in_order():
    fake = FakePinning(hold=frozenset({2}))  # chunk 2 (slots 4-5) waits
    pool = fake.pool(8, 64)
    assert pool.ready_slots() == 2  # the first chunk, allocated before returning
    pool.start()
    assert not pool.wait(0.2)  # chunk 3 waits behind chunk 2 (one at a time, in order)
    assert pool.ready_slots() == 4 and pool.pinned_seconds is None
    fake.release.set()
    assert pool.wait(10) and pool.ready_slots() == 8
    assert sorted(c.shape[0] for c in fake.chunks) == [2, 2, 2, 2]
    assert pool.pinned_seconds is not None and pool.startup_seconds <= pool.pinned_seconds
    pool.close()
    assert pool.ready_slots() == 0


def test_a_background_pool_allocates_nothing_more_until_started_then_one_chunk_at_a_time():
    """The rest of the pool waits for start() (the connector calls it after its own CUDA
    set-up, which cudaHostAlloc's driver lock would otherwise hold up), then comes one chunk
    at a time."""
    fake = FakePinning()
    pool = fake.pool(10, 64, workers=4)
    assert not pool.wait(0.2)
    assert fake.calls == 1 and pool.ready_slots() == 2 and pool.pinned_seconds is None
    pool.start()
    pool.start()  # again: nothing more
    assert pool.wait(10) and pool.ready_slots() == 10 and fake.calls == 5
    assert fake.most_active == 1
    pool.close()


def test_pool_at_once_allocates_in_parallel_before_returning():
    fake = FakePinning(hold=frozenset({1, 2}))
    threading.Timer(0.3, fake.release.set).start()  # both held chunks wait side by side
    pool = fake.pool(8, 64, background=False, workers=3)
    assert pool.ready_slots() == 8 and pool.wait(0) and fake.most_active >= 2
    pool.close()


def test_registration_starts_pinning_the_rest_after_its_own_setup(monkeypatch):
    kv = make_caches(cross_layer=True)
    fake = FakePinning()
    seen: dict[str, object] = {}

    def pool(*args, **kwargs):
        made = fake.pool(*args, **kwargs)
        start = made.start

        def spy() -> None:
            seen["calls"] = fake.calls
            seen["set_up"] = all(hasattr(conn, name) for name in
                                 ("_index", "_staging", "_streams", "_ids"))
            start()

        made.start = spy
        return made

    monkeypatch.setattr(offload_connector, "HostPool", pool)
    slot_bytes = kv.num_layers * kv.page_size_bytes
    conn = get_connector("offload", capacity_bytes=7 * slot_bytes, pin_in_background=True)
    conn.register_kv_caches(kv)
    try:
        assert seen == {"calls": 1, "set_up": True}  # started once, by registration
        assert conn.wait_pinned(10) and conn.ready_slots == 7
    finally:
        conn.close()


def test_runs_are_cut_at_chunk_boundaries_and_address_the_right_rows():
    fake = FakePinning()
    pool = fake.pool(7, 16, background=False)
    assert pool.ready_slots() == 7 and [c.shape[0] for c in fake.chunks] == [2, 2, 2, 1]
    for i in range(4):
        pool.chunk(i).copy_(torch.arange(pool.chunk(i).numel()).view(-1, 16) + 100 * i)
    pieces = list(pool.pieces(1, 5))  # slots 1..5: chunk 0 row 1, chunks 1 and 2
    assert [(off, rows.shape[0]) for off, rows in pieces] == [(0, 1), (1, 2), (3, 2)]
    assert pieces[0][1].data_ptr() == pool.chunk(0)[1].data_ptr()
    assert pieces[2][1].data_ptr() == pool.chunk(2).data_ptr()
    assert torch.equal(pool.rows([6, 1]), torch.stack([pool.chunk(3)[0], pool.chunk(0)[1]]))
    pool.close()


def test_background_false_allocates_everything_before_returning():
    fake = FakePinning()
    pool = fake.pool(7, 64, background=False, workers=3)
    assert pool.ready_slots() == 7 and len(fake.chunks) == 4  # 2 + 2 + 2 + 1 slots
    pool.close()


def test_a_failed_chunk_leaves_the_allocated_prefix_and_says_why():
    fake = FakePinning(fail_at=2)
    pool = fake.pool(8, 64, background=False)
    assert pool.ready_slots() == 4
    assert pool.error.startswith("allocating pinned slots from 4 on of the CPU pool failed: "
                                 "RuntimeError: CUDA error: out of memory; the pool keeps the "
                                 "4 slots")
    pool.close()


def test_a_failed_first_chunk_fails_registration_with_the_reason(monkeypatch):
    kv = make_caches(cross_layer=True)
    fake = FakePinning(fail_at=0)
    monkeypatch.setattr(offload_connector, "HostPool", fake.pool)
    conn = get_connector("offload", capacity_bytes=8 * kv.num_layers * kv.page_size_bytes)
    with pytest.raises(RuntimeError, match="CPU pool could not be allocated: allocating pinned "
                       "slots from 0 on .* out of memory"):
        conn.register_kv_caches(kv)


def test_slot_index_hands_out_only_available_slots():
    index = SlotIndex(6, available=2)
    assert [index.allocate(k).slot for k in "ab"] == [0, 1]
    index.get("a").pins = index.get("b").pins = 1
    assert index.allocate("c") is None  # nothing evictable, and slots 2-5 are not ready
    index.grow(4)
    assert [index.allocate(k).slot for k in "cd"] == [2, 3]
    index.grow(99)
    assert index.available == 6


def test_saves_never_use_a_slot_that_is_not_pinned_yet(monkeypatch):
    """The connector with a pool still being pinned: saves land in the pinned prefix only
    (evicting there, or failing with the reason), and use the rest once it is pinned."""
    kv = make_caches(cross_layer=True)
    slot_bytes = kv.num_layers * kv.page_size_bytes
    fake = FakePinning(hold_rest=True)
    monkeypatch.setattr(offload_connector, "HostPool", fake.pool)
    num_slots = 7  # chunks of 2 slots
    conn = get_connector("offload", capacity_bytes=num_slots * slot_bytes,
                         pin_in_background=True)
    conn.register_kv_caches(kv)
    try:
        ready = conn.ready_slots
        assert ready == 2 < conn.num_slots == num_slots
        n = min(ready + 1, kv.num_blocks)
        keys = keys_for(random.randrange(2**31), n + 1)
        result = conn.save(keys[:n], list(range(n))).wait()
        assert result.failed == {n - 1: (
            f"CPU pool full: all {ready} usable slots hold blocks with transfers in flight "
            f"({num_slots - ready} more are still being pinned)")}
        assert {conn._index.get(k).slot for k in keys[:ready]} == set(range(ready))
        assert conn.save(keys[n - 1:n], [n - 1]).wait().ok  # evicts within the prefix
        assert conn._index.get(keys[n - 1]).slot < ready
        fake.release.set()
        assert conn.wait_pinned(10) and conn.ready_slots == num_slots
        assert conn.pinned_seconds is not None
        assert conn.save(keys[n:], [0]).wait().ok
        slot = conn._index.get(keys[n]).slot
        assert slot == ready  # the lowest newly pinned slot
        assert torch.equal(conn._pool.rows([slot]).view(1, kv.num_layers, -1),
                           block_bytes(kv, [0]))
        assert conn.register_seconds > 0
    finally:
        conn.close()


def roundtrip_spanning_chunks(kv, conn, copier: bool = False) -> None:
    """Save blocks into slots that cross chunk boundaries (contiguous runs: direct for a
    cross-layer cache, and scattered ids: staged or the copier), load them into other blocks,
    bit-exact; the blocks not loaded into are untouched."""
    n = kv.num_blocks // 2
    for src, dst in ((list(range(n)), list(range(n, 2 * n))),
                     (random.sample(range(2 * n), n), None)):
        dst = dst or [b for b in range(2 * n) if b not in src]
        keys = keys_for(random.randrange(2**31), n)
        saved = block_bytes(kv, src)
        untouched = block_bytes(kv, src)  # src blocks are never loaded into
        assert conn.save(keys, src).wait().ok
        slots = [conn._index.get(k).slot for k in keys]
        assert len({conn._pool.chunk_of(s)[0] for s in slots}) > 1  # spans chunks
        assert torch.equal(conn._pool.rows(slots).view(n, kv.num_layers, -1).to(saved.device),
                           saved)
        assert conn.load(keys, dst).wait().ok
        assert torch.equal(block_bytes(kv, dst), saved)
        assert torch.equal(block_bytes(kv, src), untouched)
        for key in keys:  # free the slots: the next round starts from slot 0 again
            conn._index.discard(key)
    assert conn.paths["copier" if copier else "staged"] >= 1
    if kv.is_cross_layer:
        assert conn.paths["direct"] >= 1


@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_transfers_whose_slots_span_chunks_are_bit_exact(monkeypatch, cross):
    kv = make_caches(cross_layer=cross)
    fake = FakePinning()
    monkeypatch.setattr(offload_connector, "HostPool", fake.pool)  # chunks of 2 slots
    conn = get_connector("offload", capacity_bytes=kv.num_blocks * kv.num_layers
                         * kv.page_size_bytes, chunk_bytes=3 * kv.num_layers
                         * kv.page_size_bytes)
    conn.register_kv_caches(kv)
    try:
        assert conn.wait_pinned(10) and conn._pool.chunk_slots == 2
        assert conn.ready_slots == kv.num_blocks
        roundtrip_spanning_chunks(kv, conn)
    finally:
        conn.close()


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_cuda_pool_of_small_pinned_chunks_moves_runs_across_chunks(monkeypatch, cross):
    import functools

    kv = make_caches(cross_layer=cross, device="cuda")
    slot = kv.num_layers * kv.page_size_bytes
    monkeypatch.setattr(offload_connector, "HostPool",
                        functools.partial(HostPool, chunk_bytes=2 * slot))
    conn = get_connector("offload", capacity_bytes=kv.num_blocks * slot,
                         chunk_bytes=3 * slot)
    conn.register_kv_caches(kv)
    try:
        assert conn.wait_pinned(60) and conn._pool.is_pinned()
        roundtrip_spanning_chunks(kv, conn)
    finally:
        conn.close()


@pytest.mark.gpu
def test_registration_returns_before_a_large_pool_is_pinned():
    kv = make_caches(cross_layer=True, device="cuda")
    slot = kv.num_layers * kv.page_size_bytes
    conn = get_connector("offload", capacity_bytes=max(1, (4 << 30) // slot) * slot,
                         pin_in_background=True)
    conn.register_kv_caches(kv)
    try:
        assert 1 <= conn.ready_slots < conn.num_slots  # 64 chunks; registration took one
        assert conn._pool.is_pinned()
        assert conn.wait_pinned(120) and conn.ready_slots == conn.num_slots
        assert conn._pool.is_pinned()
        keys = keys_for(random.randrange(2**31), 2)
        saved = block_bytes(kv, [0, 1])
        assert conn.save(keys, [0, 1]).wait().ok and conn.load(keys, [2, 3]).wait().ok
        assert torch.equal(block_bytes(kv, [2, 3]), saved)
    finally:
        conn.close()
