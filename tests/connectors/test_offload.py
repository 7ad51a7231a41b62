"""The ``offload`` connector: bounded CPU pool, LRU eviction, in-flight protection."""

from __future__ import annotations

import random

import pytest
import torch
from kv_helpers import CUDA_SIZES, DTYPES, block_bytes, keys_for, make_caches, randomize

from kvcore.connectors import get_connector
from kvcore.connectors.offload import OffloadConnector


def offload_for(kv, blocks: int) -> OffloadConnector:
    conn = get_connector("offload", capacity_bytes=blocks * kv.num_layers * kv.page_size_bytes)
    conn.register_kv_caches(kv)
    return conn


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_save_drop_load_into_other_blocks_is_bit_exact(cross, dtype):
    kv = make_caches(cross_layer=cross, dtype=dtype)
    keys = keys_for(random.randrange(2**31), 5)
    src, dst = [3, 4, 5, 9, 0], [7, 1, 11, 2, 6]
    with offload_for(kv, 8) as conn:
        saved_bytes = block_bytes(kv, src)
        assert conn.save(keys, src).wait().succeeded == tuple(src)
        randomize(kv)  # drop: the device cache now holds other data everywhere
        others = block_bytes(kv, [8, 10])
        result = conn.load(keys, dst).wait()
        assert result.succeeded == tuple(dst) and not result.failed
        assert result.num_bytes == 5 * kv.num_layers * kv.page_size_bytes
        assert torch.equal(block_bytes(kv, dst), saved_bytes)
        assert torch.equal(block_bytes(kv, [8, 10]), others)  # nothing else written


def test_pool_is_slot_major_whatever_the_cache_layout():
    per_layer, cross = make_caches(cross_layer=False), make_caches(cross_layer=True)
    with offload_for(per_layer, 4) as a, offload_for(cross, 4) as b:
        block = per_layer.num_layers * per_layer.page_size_bytes
        # a slot is a whole block, layer-major: consecutive slots are one contiguous region
        for pool in (a._pool, b._pool):
            assert pool.chunk(0).shape == (4, block) and pool.chunk(0).is_contiguous()
        for conn, kv in ((a, per_layer), (b, cross)):
            keys = keys_for(random.randrange(2**31), 3)
            assert conn.save(keys, [7, 2, 5]).wait().ok
            slots = [conn._index.get(k).slot for k in keys]
            assert slots == [0, 1, 2]
            assert torch.equal(conn._pool.rows(slots).view(3, kv.num_layers, -1),
                               block_bytes(kv, [7, 2, 5]))


def test_lru_evicts_the_least_recently_used_block():
    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 4)
    with offload_for(kv, 3) as conn:
        assert conn.save(keys[:3], [0, 1, 2]).wait().ok
        assert conn.lookup(keys[:1]) == 1  # keys[0] used again: keys[1] is now the oldest
        expected = block_bytes(kv, [0])
        assert conn.save(keys[3:], [3]).wait().ok
        assert conn.cached_keys() == [keys[2], keys[0], keys[3]]
        assert conn.stats.evictions == 1
        result = conn.load([keys[1], keys[0]], [5, 6]).wait()
        assert result.succeeded == (6,) and list(result.failed) == [5]
        assert "not in the CPU pool" in result.failed[5]
        assert torch.equal(block_bytes(kv, [6]), expected)


def test_lookup_counts_leading_keys_and_hits_and_misses():
    kv = make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 4)
    with offload_for(kv, 8) as conn:
        conn.save([keys[0], keys[1], keys[3]], [0, 1, 3]).wait()
        assert conn.lookup(keys) == 2
        assert (conn.stats.hits, conn.stats.misses) == (2, 2)


def test_saving_a_stored_key_copies_nothing():
    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 2)
    with offload_for(kv, 4) as conn:
        conn.save(keys, [0, 1]).wait()
        again = conn.save(keys, [0, 1]).wait()
        assert again.succeeded == (0, 1) and again.num_bytes == 0


@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_a_save_never_evicts_a_key_it_counts_as_stored(cross):
    """A save whose new key comes before a key it holds already, that key the least recently
    used: the new key must evict another entry, not the held one (which would then be copied
    again, from a block that need not hold the bytes saved under that key)."""
    kv = make_caches(cross_layer=cross)
    held, other, new = keys_for(random.randrange(2**31), 3)
    with offload_for(kv, 2) as conn:
        assert conn.save([held], [0]).wait().ok
        expected = block_bytes(kv, [0])
        assert conn.save([other], [1]).wait().ok
        randomize(kv)
        result = conn.save([new, held], [2, 3]).wait()
        assert sorted(result.succeeded) == [2, 3]
        assert result.num_bytes == conn.block_bytes  # one copy: `new`
        assert sorted(conn.cached_keys()) == sorted([held, new])
        assert conn.stats.evictions == 1  # `other`, nothing else
        assert conn.load([held], [4]).wait().ok
        assert torch.equal(block_bytes(kv, [4]), expected)


def test_a_save_larger_than_what_it_may_evict_keeps_the_keys_it_holds():
    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 3)
    with offload_for(kv, 2) as conn:
        assert conn.save(keys[1:], [1, 2]).wait().ok
        result = conn.save(keys, [3, 4, 5]).wait()
        assert result.succeeded == (4, 5) and result.num_bytes == 0
        assert result.failed == {3: "CPU pool full: all 2 usable slots hold blocks with "
                                    "transfers in flight or blocks this save keeps"}
        assert conn.cached_keys() == keys[1:] and conn.stats.evictions == 0


def test_capacity_below_one_block_names_capacity_bytes():
    kv = make_caches(cross_layer=True)
    conn = get_connector("offload", capacity_bytes=kv.num_layers * kv.page_size_bytes - 1)
    message = r"capacity_bytes=767 holds no block: .* 768 bytes \(3 layers x 256\)"
    with conn, pytest.raises(ValueError, match=message):
        conn.register_kv_caches(kv)


@pytest.mark.parametrize("capacity", [0, -5, 1.5, True])
def test_bad_capacity_is_refused(capacity):
    with pytest.raises(ValueError, match=f"capacity_bytes={capacity!r} must be a positive"):
        get_connector("offload", capacity_bytes=capacity)
    with pytest.raises(ValueError, match=f"chunk_bytes={capacity!r} must be a positive"):
        get_connector("offload", capacity_bytes=1 << 20, chunk_bytes=capacity)


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_cuda_roundtrip_is_asynchronous_and_bit_exact(cross):
    kv = make_caches(cross_layer=cross, device="cuda", **CUDA_SIZES)
    keys = keys_for(random.randrange(2**31), 128)
    src = list(range(0, 256, 2))
    dst = random.sample(range(256), 128)
    with offload_for(kv, 200) as conn:
        assert conn._pool.is_pinned()
        expected = block_bytes(kv, src).cpu()
        torch.cuda._sleep(2_000_000_000)  # busy engine stream: the save waits behind it
        save = conn.save(keys, src)
        assert not save.done()
        # The 128 blocks being saved are in flight: filling the pool must evict none of them.
        more = conn.save(keys_for(random.randrange(2**31), 100), list(range(1, 200, 2)))
        assert len(more.wait().failed) == 28  # 200 slots, 128 in flight -> 72 fit
        assert save.wait().ok
        kv.storage.copy_(torch.randn(kv.storage.shape, device="cuda"))
        assert conn.load(keys, dst).wait(timeout=30).ok
        assert torch.equal(block_bytes(kv, dst).cpu(), expected)
