"""The ``offload`` connector with a block copier: transfers that would be staged go to a
copier registered by a plugin (here a CPU stand-in counting its calls); direct ones stay
direct, and no staging buffers are allocated."""

from __future__ import annotations

import random

import pytest
import torch
from kv_helpers import DTYPES, block_bytes, keys_for, make_caches, randomize

import kvcore
from kvcore.connectors import BlockCopier, get_connector
from kvcore.registry import ResolveError


class CountingCopier(BlockCopier):
    name = "counting"
    calls: list[tuple[tuple[int, ...], int]] = []  # (row shape, mapping rows) per call

    def copy_blocks(self, src, dst, block_mapping):
        assert block_mapping.dtype == torch.int64 and block_mapping.device.type == "cpu"
        assert src[0].is_contiguous() and dst[0].is_contiguous()
        CountingCopier.calls.append((tuple(src.shape[1:]), block_mapping.shape[0]))
        dst.index_copy_(0, block_mapping[:, 1], src.index_select(0, block_mapping[:, 0]))
        return block_mapping.shape[0]


class GpuOnlyCopier(CountingCopier):
    name = "gpu_only"

    def unavailable_reason(self, device):
        if device.type == "cuda":
            return None
        return f"gpu_only moves CUDA blocks, the cache is on {device}; leave block_copier unset"


class MisnamedCopier(CountingCopier):
    name = "something_else"


class CopierPlugin:
    @kvcore.hookimpl
    def kvcore_register_block_copiers(self, register):
        register("counting", f"{__name__}:CountingCopier")
        register("gpu_only", f"{__name__}:GpuOnlyCopier")
        register("misnamed", f"{__name__}:MisnamedCopier")


@pytest.fixture
def copiers(fresh_kvcore):
    kvcore.register_plugin(CopierPlugin(), "test_copiers")
    CountingCopier.calls.clear()
    yield
    kvcore.unregister_plugin("test_copiers")


def offload_with_copier(kv, blocks: int, copier: str = "counting"):
    conn = get_connector("offload", capacity_bytes=blocks * kv.num_layers * kv.page_size_bytes,
                         block_copier=copier)
    conn.register_kv_caches(kv)
    return conn


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_scattered_roundtrip_through_the_copier_is_bit_exact(copiers, cross, dtype):
    kv = make_caches(cross_layer=cross, dtype=dtype, num_blocks=24)
    src, dst = random.sample(range(12), 7), random.sample(range(12, 24), 7)
    keys = keys_for(random.randrange(2**31), 7)
    expected = block_bytes(kv, src)
    with offload_with_copier(kv, 16) as conn:
        assert conn._staging == {}  # no device staging with a copier
        assert conn.save(keys, src).wait().ok
        randomize(kv)
        untouched = block_bytes(kv, list(range(12)))
        assert conn.load(keys, dst).wait().ok
        assert torch.equal(block_bytes(kv, dst), expected)
        assert torch.equal(block_bytes(kv, list(range(12))), untouched)
        assert conn.paths["copier"] == 2 and conn.paths["staged"] == 0
    # one call per direction moving every (layer, block) row: the layers lie back to back
    layers = 1 if cross else kv.num_layers
    assert [rows for _, rows in CountingCopier.calls] == [7 * layers] * 2  # save, load


def test_layers_not_back_to_back_go_one_call_per_layer(copiers):
    kv = make_caches(cross_layer=False, num_blocks=24)
    src, dst = random.sample(range(12), 5), random.sample(range(12, 24), 5)
    keys = keys_for(random.randrange(2**31), 5)
    expected = block_bytes(kv, src)
    with offload_with_copier(kv, 16) as conn:
        assert conn._flat is not None
        conn._flat = None  # as if the layers were separate tensors
        assert conn.save(keys, src).wait().ok
        randomize(kv)
        assert conn.load(keys, dst).wait().ok
    assert torch.equal(block_bytes(kv, dst), expected)
    assert [rows for _, rows in CountingCopier.calls] == [5] * (2 * kv.num_layers)


def test_contiguous_cross_layer_blocks_stay_direct(copiers):
    kv = make_caches(cross_layer=True, num_blocks=24)
    with offload_with_copier(kv, 16) as conn:
        calls = len(CountingCopier.calls)
        assert conn.save(keys_for(random.randrange(2**31), 8), list(range(8))).wait().ok
        assert conn.paths["direct"] == 1 and conn.paths["copier"] == 0
        assert len(CountingCopier.calls) == calls


def test_a_copier_that_cannot_move_this_cache_is_refused_with_its_reason(copiers):
    kv = make_caches(cross_layer=False)
    conn = get_connector("offload", capacity_bytes=1 << 20, block_copier="gpu_only")
    with pytest.raises(ValueError, match=r"block_copier='gpu_only' cannot move the blocks of "
                                         r"this cache: gpu_only moves CUDA blocks, the cache is "
                                         r"on cpu; leave block_copier unset"):
        conn.register_kv_caches(kv)


def test_unknown_or_misnamed_copiers_are_refused_when_the_connector_is_made(copiers):
    with pytest.raises(kvcore.UnknownNameError,
                       match="unknown block copier 'countin'; valid options are: .*counting"):
        get_connector("offload", capacity_bytes=1 << 20, block_copier="countin")
    with pytest.raises(ResolveError, match="registered as 'misnamed' has name "
                                           "'something_else'"):
        get_connector("offload", capacity_bytes=1 << 20, block_copier="misnamed")
    with pytest.raises(TypeError, match="block_copier must be a registered copier's name"):
        get_connector("offload", capacity_bytes=1 << 20, block_copier=CountingCopier())


@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_copier_transfers_whose_slots_span_pool_chunks_are_bit_exact(copiers, monkeypatch,
                                                                     cross):
    """A pool in chunks of two slots: the copier is called once per chunk with that chunk's
    rows, and the round trip is bit-exact."""
    from test_offload_pinning import FakePinning, roundtrip_spanning_chunks

    import kvcore.connectors.offload.connector as offload_connector

    kv = make_caches(cross_layer=cross)
    monkeypatch.setattr(offload_connector, "HostPool", FakePinning().pool)
    conn = offload_with_copier(kv, kv.num_blocks)
    try:
        assert conn.wait_pinned(10) and conn._pool.chunk_slots == 2
        roundtrip_spanning_chunks(kv, conn, copier=True)
        assert CountingCopier.calls  # the copier moved the scattered transfers
    finally:
        conn.close()
