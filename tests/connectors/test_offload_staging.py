"""The ``offload`` connector's batched path: gather blocks of every layer into a staging
buffer, one copy per run of pool slots, scatter back. The same logic runs on CPU tensors, so
chunking, ordering and bit-exactness are checked here; the CUDA streams only add overlap."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_helpers import CUDA_SIZES, DTYPES, block_bytes, keys_for, make_caches, randomize

from kvcore.connectors import get_connector
from kvcore.connectors.offload import OffloadConnector
from kvcore.connectors.offload.views import stacked_layers, word_size


def offload_for(kv, blocks: int, chunk_blocks: int | None = None) -> OffloadConnector:
    block = kv.num_layers * kv.page_size_bytes
    options = {} if chunk_blocks is None else {"chunk_bytes": chunk_blocks * block}
    conn = get_connector("offload", capacity_bytes=blocks * block, **options)
    conn.register_kv_caches(kv)
    return conn


def roundtrip(kv, conn, src: list[int], dst: list[int]) -> None:
    """Save ``src``, overwrite the cache, load into ``dst``: bit-exact, nothing else written."""
    keys = keys_for(random.randrange(2**31), len(src))
    expected = block_bytes(kv, src)
    result = conn.save(keys, src).wait()
    assert result.ok and result.succeeded == tuple(src)
    randomize(kv)
    others = [b for b in range(kv.num_blocks) if b not in dst]
    untouched = block_bytes(kv, others)
    result = conn.load(keys, dst).wait()
    assert result.ok and result.succeeded == tuple(dst)
    assert result.num_bytes == len(dst) * kv.num_layers * kv.page_size_bytes
    assert torch.equal(block_bytes(kv, dst), expected)
    assert torch.equal(block_bytes(kv, others), untouched)


# -- which path -------------------------------------------------------------------------------


def test_cross_layer_contiguous_copies_directly_and_scattered_goes_through_staging():
    kv = make_caches(cross_layer=True, num_blocks=40)
    with offload_for(kv, 40, chunk_blocks=4) as conn:
        keys = keys_for(random.randrange(2**31), 12)
        assert conn.save(keys, list(range(12))).wait().ok
        assert conn.paths == {"direct": 1, "staged": 0, "copier": 0, "copies": 1, "chunks": 0}
        scattered = random.sample(range(40), 12)
        assert conn.load(keys, scattered).wait().ok
        # 12 slots in a row, 4 blocks per chunk: 3 gathers/scatters and 3 copies, not 12
        assert conn.paths == {"direct": 1, "staged": 1, "copier": 0, "copies": 4, "chunks": 3}


def test_per_layer_always_goes_through_staging_with_one_copy_per_chunk():
    kv = make_caches(cross_layer=False, num_blocks=40)
    with offload_for(kv, 40, chunk_blocks=5) as conn:
        keys = keys_for(random.randrange(2**31), 12)
        assert conn.save(keys, list(range(12))).wait().ok  # 3 layers: 3 copies before
        assert conn.paths == {"direct": 0, "staged": 1, "copier": 0, "copies": 3, "chunks": 3}
        assert conn.load(keys, random.sample(range(40), 12)).wait().ok
        assert conn.paths == {"direct": 0, "staged": 2, "copier": 0, "copies": 6, "chunks": 6}


def test_staging_is_bounded_by_chunk_bytes_and_the_pool():
    kv = make_caches(cross_layer=False, num_blocks=40)
    block = kv.num_layers * kv.page_size_bytes
    cases = [(block * 7 + 5, 30, 7), (block - 1, 30, 1), (block * 100, 30, 30)]
    for chunk_bytes, slots, expected in cases:
        conn = get_connector("offload", capacity_bytes=slots * block, chunk_bytes=chunk_bytes)
        with conn:
            conn.register_kv_caches(kv)
            assert conn.chunk_blocks == expected
            for staging in conn._staging.values():
                assert len(staging.buffers) == 2  # double-buffered
                for buf in staging.buffers:
                    assert buf.shape[0] == expected
                    assert buf.numel() * buf.element_size() == expected * block


# -- bit-exact round trips through staging ----------------------------------------------------


@pytest.mark.parametrize("chunk_blocks", [1, 3, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_scattered_roundtrip_through_staging_is_bit_exact(cross, dtype, chunk_blocks):
    kv = make_caches(cross_layer=cross, dtype=dtype, num_blocks=40)
    ids = random.sample(range(40), 34)
    src, dst = ids[:17], ids[17:]
    with offload_for(kv, 20, chunk_blocks=chunk_blocks) as conn:
        roundtrip(kv, conn, src, dst)
        if cross and chunk_blocks == 1:  # a copy per block either way: no staging kernel
            assert (conn.paths["direct"], conn.paths["staged"]) == (2, 0)
        else:  # scattered: both transfers staged
            assert conn.paths["direct"] == 0
            assert conn.paths["chunks"] == 2 * -(-17 // min(chunk_blocks, 20))


@pytest.mark.parametrize("layout,cross", [("hnd", False), ("hnd", True), ("mla", False),
                                          ("mla", True), ("interleaved", False)])
def test_roundtrip_of_other_layouts_through_staging_is_bit_exact(layout, cross):
    kv = make_caches(cross_layer=cross, layout=layout, num_blocks=24)
    ids = random.sample(range(24), 20)
    with offload_for(kv, 12, chunk_blocks=4) as conn:
        roundtrip(kv, conn, ids[:10], ids[10:])


@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_load_of_fragmented_slots_copies_each_run_and_is_bit_exact(cross):
    kv = make_caches(cross_layer=cross, num_blocks=32)
    with offload_for(kv, 12, chunk_blocks=5) as conn:
        first = keys_for(random.randrange(2**31), 12)
        assert conn.save(first, list(range(12))).wait().ok  # slots 0..11
        expected = block_bytes(kv, list(range(12)))
        # Use the even keys again: the odd ones are now least recently used and get evicted,
        # so the next 6 blocks land in slots 1, 3, 5, ... (runs of one slot).
        assert conn.lookup(first[0::2][:1]) == 1
        for key in first[2::2]:
            assert conn.lookup([key]) == 1
        second = keys_for(random.randrange(2**31), 6)
        assert conn.save(second, list(range(12, 18))).wait().ok
        assert sorted(conn._index.get(k).slot for k in second) == [1, 3, 5, 7, 9, 11]
        expected_second = block_bytes(kv, list(range(12, 18)))
        randomize(kv)
        before = dict(conn.paths)
        keys = first[0::2] + second
        dst = random.sample(range(32), 12)
        assert conn.load(keys, dst).wait().ok
        # slots 0..11 in one transfer, 5 per chunk: 3 chunks, one copy each (runs restored)
        assert conn.paths["chunks"] - before["chunks"] == 3
        assert conn.paths["copies"] - before["copies"] == 3
        got = block_bytes(kv, dst)
        assert torch.equal(got[:6], expected[0::2])
        assert torch.equal(got[6:], expected_second)


def test_layers_that_are_not_equally_spaced_gather_layer_by_layer():
    kv = make_caches(cross_layer=False, num_blocks=20)
    with offload_for(kv, 10, chunk_blocks=3) as conn:
        assert conn._dev3 is not None  # one storage, equally spaced: one indexed copy
        conn._dev3 = None  # as if the layers were separate tensors
        ids = random.sample(range(20), 16)
        roundtrip(kv, conn, ids[:8], ids[8:])


# -- helpers ----------------------------------------------------------------------------------


def test_stacked_layers_view_is_every_layer_of_each_block():
    kv = make_caches(cross_layer=False, num_blocks=6)
    views = kv.layer_block_views()
    stacked = stacked_layers(views)
    assert stacked.shape == (6, kv.num_layers, kv.page_size_bytes)
    assert stacked.data_ptr() == views[0].data_ptr()
    assert torch.equal(stacked, torch.stack(views, dim=1))
    assert stacked_layers(views[::-1]) is None  # descending addresses
    assert stacked_layers([views[0], views[2], views[1]]) is None  # not equally spaced
    assert stacked_layers([views[0], views[1].clone()]) is None  # another storage
    cross = make_caches(cross_layer=True, num_blocks=6).block_view()
    assert stacked_layers([cross]).shape == (6, 1, cross.shape[1])


def test_word_size_is_the_widest_that_divides_rows_and_strides():
    base = torch.zeros(64, dtype=torch.uint8)
    assert word_size(16, [base.view(4, 16)]) == 8
    assert word_size(12, [base[:48].view(4, 12)]) == 4
    assert word_size(6, [base[:48].view(8, 6)]) == 2
    assert word_size(5, [base[:40].view(8, 5)]) == 1
    assert word_size(16, [base[1:49].view(3, 16)]) == 1  # odd address


# -- model-based: any sequence of saves and loads ---------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.integers(1, 7), st.randoms(use_true_random=False),
       st.lists(st.tuples(st.sampled_from(["save", "load"]), st.integers(1, 9)),
                min_size=1, max_size=8))
def test_any_sequence_of_saves_and_loads_matches_a_dictionary(cross, chunk_blocks, rnd, ops):
    kv = make_caches(cross_layer=cross, num_blocks=16, seed=rnd.randrange(2**31))
    model: dict[str, torch.Tensor] = {}  # key -> bytes saved under it
    with offload_for(kv, 10, chunk_blocks=chunk_blocks) as conn:
        for op, n in ops:
            ids = rnd.sample(range(16), n)
            if op == "save":
                keys = keys_for(rnd.randrange(2**31), n)
                stored = set(conn.cached_keys())  # saved again: kept as is, not copied
                expected = block_bytes(kv, ids)
                result = conn.save(keys, ids).wait()
                assert result.ok
                for key, row in zip(keys, expected, strict=True):
                    if key not in stored:
                        model[key] = row
                randomize(kv, rnd.randrange(2**31))
            elif model:
                cached = conn.cached_keys()
                keys = rnd.sample(cached, min(n, len(cached)))
                ids = ids[:len(keys)]
                result = conn.load(keys, ids).wait()
                assert result.ok and result.succeeded == tuple(ids)
                got = block_bytes(kv, ids)
                for key, row in zip(keys, got, strict=True):
                    assert torch.equal(row, model[key])


# -- CUDA: the same path on streams -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_cuda_staged_transfers_back_to_back_and_concurrent_are_bit_exact(cross):
    kv = make_caches(cross_layer=cross, device="cuda", **CUDA_SIZES)
    with offload_for(kv, 192, chunk_blocks=7) as conn:
        assert conn._pool.is_pinned()
        groups = [random.sample(range(128), 40) for _ in range(3)]
        keys = [keys_for(random.randrange(2**31), 40) for _ in groups]
        expected = [block_bytes(kv, g).cpu() for g in groups]
        torch.cuda._sleep(500_000_000)  # busy engine stream: transfers queue behind it
        # three saves without waiting: the staging buffers are reused across transfers
        saves = [conn.save(k, g) for k, g in zip(keys, groups, strict=True)]
        assert not saves[0].done()  # nothing waited on the host
        # a load of the first group while the later saves may still run, into other blocks
        dst = random.sample(range(128, 256), 40)
        load = conn.load(keys[0], dst)
        more = conn.save(keys_for(random.randrange(2**31), 40), random.sample(range(128), 40))
        for handle in [*saves, load, more]:
            assert handle.wait(timeout=60).ok
        assert conn.paths["direct"] == 0 and conn.paths["staged"] == 5
        assert torch.equal(block_bytes(kv, dst).cpu(), expected[0])
        for k, e in zip(keys[1:], expected[1:], strict=True):
            out = random.sample(range(128, 256), 40)
            assert conn.load(k, out).wait(timeout=60).ok
            assert torch.equal(block_bytes(kv, out).cpu(), e)


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_cuda_overlapping_transfers_behind_a_busy_engine_match_a_dictionary(cross, monkeypatch):
    """Rounds of saves and loads issued while the engine's stream sleeps: every call returns
    at once (nothing waits for the device), and every load holds exactly what was saved under
    its key. The id ring is made tiny so that it wraps within a round: an id region reused
    before its copy ran would move the wrong blocks."""
    import time

    from kvcore.connectors.offload import connector

    monkeypatch.setattr(connector, "ID_RING_ENTRIES", 48)
    rnd = random.Random(1234)
    kv = make_caches(cross_layer=cross, device="cuda", **CUDA_SIZES)
    sources, targets = range(128), range(128, 256)
    model: dict[str, torch.Tensor] = {}  # key -> the bytes saved under it
    with offload_for(kv, 200, chunk_blocks=9) as conn:
        for _ in range(5):
            kv.storage.copy_(torch.randn(kv.storage.shape, device="cuda"))
            snapshot = block_bytes(kv, list(sources)).cpu()  # what this round's saves read
            torch.cuda._sleep(1_000_000_000)  # the engine is busy for a good while
            issued = time.perf_counter()
            saves, loads = [], []
            free_targets = rnd.sample(targets, len(targets))
            for _ in range(4):
                ids = rnd.sample(sources, 25)
                keys = keys_for(rnd.randrange(2**31), 25)
                saves.append((conn.save(keys, ids), keys, ids))
                # loads of keys saved earlier, this round or before, into blocks no other
                # load of the round writes
                known = [k for k in conn.cached_keys() if k in model or k in keys]
                wanted = rnd.sample(known, min(20, len(known)))
                dst = [free_targets.pop() for _ in wanted]
                for k, b in zip(keys, ids, strict=True):
                    model.setdefault(k, snapshot[b])
                loads.append((conn.load(wanted, dst), wanted, dst))
            elapsed = time.perf_counter() - issued
            assert not saves[0][0].done(), "the engine's stream should still be asleep"
            if not os.environ.get("TORCH_CUDA_SANITIZER"):  # it slows every op down
                assert elapsed < 0.25, f"issuing 8 transfers took {elapsed:.3f} s: the host " \
                    "waited for the device"
            for handle, _, _ in saves:
                assert handle.wait(timeout=60).ok
            for handle, wanted, dst in loads:
                assert handle.wait(timeout=60).ok
                got = block_bytes(kv, dst).cpu()
                for key, row in zip(wanted, got, strict=True):
                    assert torch.equal(row, model[key]), "a loaded block differs from its save"
        assert conn.paths["staged"] > 0
