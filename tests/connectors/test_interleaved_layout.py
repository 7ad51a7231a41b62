"""K and V interleaved per token, the stride orders of FLASH_ATTN and FLEX_ATTENTION:
``(0, 2, 1, 3, 4)`` per layer (physical ``B,N,2,H,D``) and ``(1, 0, 3, 2, 4, 5)`` with layers
(``B,L,N,2,H,D``). Every connector moves such blocks bit-exactly, per layer and cross-layer,
and writes nothing outside the blocks it loads."""

from __future__ import annotations

import random

import pytest
import torch
from kv_helpers import InterleavedBackend, block_bytes, keys_for, make_caches, randomize
from pull_cases import NIXL, round_trip_between_two_processes
from test_p2p import pair

import kvcore
from kvcore.connectors import (
    extract_kv_from_layer,
    get_connector,
    inject_kv_into_layer,
    virtually_split_kv_in_blocks,
)

CROSS = pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLEX_ATTENTION", InterleavedBackend],
                         ids=["flash_attn", "flex_attention", "test_backend"])
def test_the_interleaved_orders_are_what_the_backends_declare(backend):
    backend = kvcore.resolve_backend(backend) if isinstance(backend, str) else backend
    assert backend.get_kv_cache_stride_order() == (0, 2, 1, 3, 4)
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (
        1, 0, 3, 2, 4, 5)
    layout = kvcore.KVCacheLayout.from_backend(
        backend, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64,
        dtype=torch.bfloat16, num_layers=3, cross_layer=True)
    assert str(layout) == "B,L,N,2,H,D" and layout.is_cross_layer and layout.is_blocks_first


@CROSS
def test_the_layer_views_address_k_and_v_side_by_side(cross):
    kv = make_caches(cross_layer=cross, layout="interleaved")
    assert str(kv.layout) == ("B,L,N,2,H,D" if cross else "L,B,N,2,H,D")
    layer = kv.layers[1]
    key_cache, value_cache = layer.unbind(1)
    _, block_size, heads, dim = key_cache.shape
    # Token t of block b: K then V, H * D elements each.
    assert key_cache.stride()[1:] == (2 * heads * dim, dim, 1)
    assert value_cache.data_ptr() - key_cache.data_ptr() == heads * dim * layer.element_size()
    assert key_cache.stride(0) == (kv.num_layers if cross else 1) * block_size * 2 * heads * dim
    # The byte view of block 5 of layer 1 is exactly that layer's K and V of block 5.
    view = kv.block_view(1)[5]
    expected = torch.stack([key_cache[5], value_cache[5]], dim=1)  # (N, 2, H, D)
    assert torch.equal(view.view(kv.storage.dtype).view(expected.shape), expected)


@CROSS
def test_split_gives_whole_blocks_since_k_and_v_are_not_halves(cross):
    kv = make_caches(cross_layer=cross, layout="interleaved")
    views = virtually_split_kv_in_blocks(kv)
    page = kv.page_size_bytes
    if cross:
        assert [tuple(v.shape) for v in views] == [(kv.num_blocks, 1, kv.num_layers * page)]
        assert torch.equal(views[0][:, 0], kv.block_view())
    else:
        assert [tuple(v.shape) for v in views] == [(kv.num_blocks, 1, page)] * kv.num_layers
        for i, view in enumerate(views):
            assert torch.equal(view[:, 0], kv.block_view(i))


@CROSS
def test_extract_then_inject_is_bit_exact_and_touches_only_its_blocks(cross):
    src = make_caches(cross_layer=cross, layout="interleaved", dtype="fp16")
    dst = make_caches(cross_layer=cross, layout="interleaved", dtype="fp16")
    before = dst.storage.view(torch.uint8).clone()
    kv = extract_kv_from_layer(src.layers[1], torch.tensor([5, 0, 9]))
    inject_kv_into_layer(dst.layers[1], kv, [1, 2, 3], request_id="req-1")
    assert torch.equal(dst.layers[1][[1, 2, 3]].view(torch.uint8),
                       src.layers[1][[5, 0, 9]].view(torch.uint8))
    changed = (dst.storage.view(torch.uint8) != before).flatten(2).any(-1).nonzero().tolist()
    # Physical (B, L, ...) cross-layer, (L, B, ...) per layer: layer 1 of blocks 1-3 only.
    allowed = {(b, 1) for b in (1, 2, 3)} if cross else {(1, b) for b in (1, 2, 3)}
    assert changed and {tuple(c) for c in changed} <= allowed


@CROSS
def test_offload_round_trip_is_bit_exact(cross):
    kv = make_caches(cross_layer=cross, layout="interleaved")
    keys = keys_for(random.randrange(2**31), 4)
    src, dst = [3, 4, 9, 0], [7, 1, 11, 2]
    conn = get_connector("offload", capacity_bytes=8 * kv.num_layers * kv.page_size_bytes)
    conn.register_kv_caches(kv)
    with conn:
        saved = block_bytes(kv, src)
        assert conn.save(keys, src).wait().ok
        randomize(kv)
        others = block_bytes(kv, [5, 6, 8])
        assert conn.load(keys, dst).wait().succeeded == tuple(dst)
    assert torch.equal(block_bytes(kv, dst), saved)
    assert torch.equal(block_bytes(kv, [5, 6, 8]), others)


@CROSS
def test_storage_round_trip_is_bit_exact(tmp_path, cross):
    writer = make_caches(cross_layer=cross, layout="interleaved")
    reader = make_caches(cross_layer=cross, layout="interleaved")
    keys = keys_for(random.randrange(2**31), 3)
    for kv, action in ((writer, "save"), (reader, "load")):
        conn = get_connector("storage", root=tmp_path)
        conn.register_kv_caches(kv)
        with conn:
            if action == "save":
                assert conn.save(keys, [2, 5, 10]).wait().ok
            else:
                untouched = block_bytes(reader, [0, 1])
                assert conn.load(keys, [9, 3, 4]).wait().succeeded == (9, 3, 4)
    assert torch.equal(block_bytes(reader, [9, 3, 4]), block_bytes(writer, [2, 5, 10]))
    assert torch.equal(block_bytes(reader, [0, 1]), untouched)


@CROSS
def test_p2p_blocks_arrive_bit_exact(cross):
    kv0 = make_caches(cross_layer=cross, layout="interleaved")
    kv1 = make_caches(cross_layer=cross, layout="interleaved")
    keys = keys_for(random.randrange(2**31), 3)
    untouched = block_bytes(kv1, [0, 1])
    with pair(kv0, kv1) as (c0, c1):
        assert c0.save(keys, [8, 3, 5]).wait(timeout=5).ok
        assert c1.load(keys, [9, 4, 10]).wait(timeout=5).succeeded == (9, 4, 10)
    assert torch.equal(block_bytes(kv1, [9, 4, 10]), block_bytes(kv0, [8, 3, 5]))
    assert torch.equal(block_bytes(kv1, [0, 1]), untouched)


def test_p2p_refuses_a_peer_with_the_nhd_order():
    ours = make_caches(cross_layer=False, layout="interleaved").layout
    theirs = make_caches(cross_layer=False, layout="nhd").layout
    assert "physical order L,B,N,2,H,D vs L,B,2,N,H,D" in ours.differences(theirs)


@NIXL.needs
@CROSS
def test_nixl_round_trip_between_two_processes_is_bit_exact(cross):
    round_trip_between_two_processes(NIXL, 13, layout="interleaved", cross=cross)
