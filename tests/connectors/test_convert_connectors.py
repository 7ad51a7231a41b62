"""Connectors that convert layouts on transfer: blocks written by one layout load into caches
of another, equal value for value through the logical views."""

from __future__ import annotations

import random

import pytest
import torch
from kv_helpers import keys_for, make_caches

from kvcore import KVCaches
from kvcore.connectors import get_connector


def logical_blocks(kv: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """``(layers, blocks, ...)`` bytes of the blocks through the logical views: equal for two
    layouts exactly when they hold the same values."""
    idx = torch.tensor(block_ids)
    return torch.stack([layer.index_select(0, idx).contiguous().view(torch.uint8)
                        for layer in kv.layers])


@pytest.mark.parametrize("writer, reader", [
    (("nhd", False), ("hnd", True)),
    (("hnd", True), ("interleaved", False)),
    (("interleaved", False), ("nhd", True)),
], ids=["nhd-per-layer->hnd-cross-layer", "hnd-cross-layer->interleaved-per-layer",
        "interleaved-per-layer->nhd-cross-layer"])
def test_storage_loads_blocks_another_layout_wrote(tmp_path, writer, reader):
    source = make_caches(layout=writer[0], cross_layer=writer[1])
    keys = keys_for(random.randrange(2**31), 3)
    with get_connector("storage", root=tmp_path) as conn:
        conn.register_kv_caches(source)
        assert conn.save(keys, [4, 1, 7]).wait().ok
    dest = make_caches(layout=reader[0], cross_layer=reader[1])
    untouched = logical_blocks(dest, [0, 2, 3])
    with get_connector("storage", root=tmp_path) as plain:
        plain.register_kv_caches(make_caches(layout=reader[0], cross_layer=reader[1]))
        assert plain.lookup(keys) == 0  # without convert=True: this layout's blocks only
    with get_connector("storage", root=tmp_path, convert=True) as conn:
        conn.register_kv_caches(dest)
        assert conn.lookup(keys) == 3
        result = conn.load(keys, [5, 9, 6]).wait()
    assert result.ok and result.succeeded == (5, 9, 6)
    assert torch.equal(logical_blocks(dest, [5, 9, 6]), logical_blocks(source, [4, 1, 7]))
    assert torch.equal(logical_blocks(dest, [0, 2, 3]), untouched)


def test_storage_does_not_offer_blocks_it_cannot_convert(tmp_path):
    """Another block size (keys name other tokens), MLA, or another dtype: not found."""
    keys = keys_for(random.randrange(2**31), 2)
    for kind in ({"block_size": 8}, {"layout": "mla"}, {"dtype": "fp8"}):
        with get_connector("storage", root=tmp_path) as conn:
            conn.register_kv_caches(make_caches(cross_layer=False, **kind))
            assert conn.save(keys, [0, 1]).wait().ok
    with get_connector("storage", root=tmp_path, convert=True) as conn:
        conn.register_kv_caches(make_caches(layout="hnd", cross_layer=True))
        assert conn.lookup(keys) == 0
        assert "no file for key" in conn.load(keys, [2, 3]).wait().failed[2]


def test_offload_loads_into_caches_reallocated_with_another_backend():
    before = make_caches(layout="nhd", cross_layer=True)
    keys = keys_for(random.randrange(2**31), 4)
    with get_connector("offload", capacity_bytes=1 << 20) as conn:
        conn.register_kv_caches(before)
        assert conn.save(keys[:3], [2, 5, 6]).wait().ok
        after = make_caches(layout="hnd", cross_layer=False)  # the engine switched backends
        conn.reregister_kv_caches(after)
        assert conn.save(keys[3:], [0]).wait().ok  # saved in the new layout
        untouched = logical_blocks(after, [1, 3])
        result = conn.load(keys, [7, 8, 9, 10]).wait()
        assert result.ok and set(result.succeeded) == {7, 8, 9, 10}
        assert torch.equal(logical_blocks(after, [7, 8, 9]), logical_blocks(before, [2, 5, 6]))
        assert torch.equal(logical_blocks(after, [10]), logical_blocks(after, [0]))
        assert torch.equal(logical_blocks(after, [1, 3]), untouched)
        # Back to the first backend: the first blocks load as they were, the later converted.
        again = make_caches(layout="nhd", cross_layer=True)
        conn.reregister_kv_caches(again)
        assert conn.load(keys, [1, 2, 3, 4]).wait().ok
        assert torch.equal(logical_blocks(again, [1, 2, 3]), logical_blocks(before, [2, 5, 6]))
        assert torch.equal(logical_blocks(again, [4]), logical_blocks(after, [0]))


def test_offload_reregistration_keeps_the_block_size():
    with get_connector("offload", capacity_bytes=1 << 20) as conn:
        conn.register_kv_caches(make_caches(layout="nhd", cross_layer=True))
        with pytest.raises(ValueError, match=r"differ in size from the pool's"):
            conn.reregister_kv_caches(make_caches(layout="hnd", cross_layer=True, block_size=8))
        with pytest.raises(ValueError, match=r"an MLA latent cache and a K/V cache"):
            conn.reregister_kv_caches(make_caches(layout="mla", cross_layer=False))
