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
