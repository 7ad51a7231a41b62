"""The offload pool is pinned in chunks in the background and used only where it is pinned.

Pinning itself needs CUDA; here a stand-in ``pin_fn`` records the regions and can be held
back, which is exactly what the pool's bookkeeping sees on a GPU. The H200 figures (start-up
and first transfers) come from ``benchmarks/bench_offload.py``.
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
    """Stand-in for cudaHostRegister: records pinned regions; chunks at byte offsets in
    ``hold`` wait for ``release``; the chunk at ``fail_at`` raises. The first call is the
    pool's first chunk (pinned before anything else), which gives the base address."""

    def __init__(self, hold: frozenset[int] = frozenset(), fail_at: int | None = None) -> None:
        self.pinned: dict[int, int] = {}
        self.unpinned: list[int] = []
        self.hold, self.fail_at = hold, fail_at
        self.release = threading.Event()
        self.base: int | None = None
        self.lock = threading.Lock()

    def pin(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            if self.base is None:
                self.base = ptr
        offset = ptr - self.base
        if offset in self.hold:
            assert self.release.wait(10)
        if offset == self.fail_at:
            raise RuntimeError("cudaErrorMemoryAllocation (2)")
        with self.lock:
            self.pinned[ptr] = nbytes

    def unpin(self, ptr: int) -> None:
        self.unpinned.append(ptr)

    def pool(self, num_slots: int, slot_bytes: int, *, pin: bool = True,
             background: bool = True) -> HostPool:
        """A pool pinned through this stand-in, two slots per chunk (``pin`` is ignored: the
        connector asks for none on CPU)."""
        return HostPool(num_slots, slot_bytes, pin=True, background=background,
                        chunk_bytes=2 * slot_bytes, workers=3, pin_fn=self.pin,
                        unpin_fn=self.unpin)


def test_the_pool_is_usable_once_its_first_chunk_is_pinned_and_grows_in_order():
    fake = FakePinning(hold={2 * 64})  # chunk 1 (slots 2-3) waits
    pool = fake.pool(8, 64)
    assert pool.ready_slots() == 2  # the first chunk, pinned before returning
    assert not pool.wait(0.2)  # chunks 2 and 3 finish, but the prefix stops at chunk 1
    assert pool.ready_slots() == 2 and pool.pinned_seconds is None
    fake.release.set()
    assert pool.wait(10) and pool.ready_slots() == 8
    assert sorted(p - fake.base for p in fake.pinned) == [0, 128, 256, 384]
    assert set(fake.pinned.values()) == {128}
    assert pool.pinned_seconds is not None and pool.startup_seconds <= pool.pinned_seconds
    pool.close()
    assert sorted(fake.unpinned) == sorted(fake.pinned)


def test_background_false_pins_everything_before_returning():
    fake = FakePinning()
    pool = fake.pool(7, 64, background=False)
    assert pool.ready_slots() == 7 and len(fake.pinned) == 4  # 2 + 2 + 2 + 1 slots
    pool.close()


def test_a_failed_chunk_leaves_the_pinned_prefix_and_says_why():
    fake = FakePinning(fail_at=4 * 64)
    pool = fake.pool(8, 64, background=False)
    assert pool.ready_slots() == 4
    assert pool.error.startswith("pinning slots 4..5 of the CPU pool failed: RuntimeError: "
                                 "cudaErrorMemoryAllocation (2); the pool keeps the 4 slots")
    pool.close()
    assert sorted(fake.unpinned) == sorted(fake.pinned)


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
    (evicting there), and use the rest once it is pinned."""
    kv = make_caches(cross_layer=True)
    slot_bytes = kv.num_layers * kv.page_size_bytes
    fake = FakePinning(hold=frozenset({2 * slot_bytes}))
    monkeypatch.setattr(offload_connector, "HostPool", fake.pool)
    conn = get_connector("offload", capacity_bytes=8 * slot_bytes)
    conn.register_kv_caches(kv)
    try:
        assert conn.ready_slots == 2 and conn.num_slots == 8
        keys = keys_for(random.randrange(2**31), 5)
        result = conn.save(keys[:3], [3, 4, 5]).wait()
        assert result.failed == {5: "CPU pool full: all 2 usable slots hold blocks with "
                                    "transfers in flight (6 more are still being pinned)"}
        assert conn.save(keys[2:3], [5]).wait().ok  # evicts the oldest, within the prefix
        assert {conn._index.get(k).slot for k in keys[1:3]} == {0, 1}
        assert conn.lookup(keys[:1]) == 0
        fake.release.set()
        assert conn.wait_pinned(10) and conn.ready_slots == 8
        assert conn.pinned_seconds is not None
        assert conn.save(keys[3:], [6, 7]).wait().ok
        assert {conn._index.get(k).slot for k in keys[3:]} == {2, 3}
        assert torch.equal(conn._host[[2, 3]].view(2, kv.num_layers, -1),
                           block_bytes(kv, [6, 7]))
        assert conn.register_seconds > 0
    finally:
        conn.close()
    assert sorted(fake.unpinned) == sorted(fake.pinned)


@pytest.mark.gpu
def test_registration_returns_before_a_large_pool_is_pinned():
    kv = make_caches(cross_layer=True, device="cuda")
    slot = kv.num_layers * kv.page_size_bytes
    conn = get_connector("offload", capacity_bytes=max(1, (4 << 30) // slot) * slot)
    conn.register_kv_caches(kv)
    try:
        assert conn.ready_slots >= 1
        assert conn.wait_pinned(120) and conn.ready_slots == conn.num_slots
        assert conn._host.is_pinned()
        keys = keys_for(random.randrange(2**31), 2)
        saved = block_bytes(kv, [0, 1])
        assert conn.save(keys, [0, 1]).wait().ok and conn.load(keys, [2, 3]).wait().ok
        assert torch.equal(block_bytes(kv, [2, 3]), saved)
    finally:
        conn.close()
