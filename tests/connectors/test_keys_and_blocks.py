"""Block keys, extract/inject on the blocks-first view, and the virtual K/V split."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import torch
from kv_helpers import make_caches

from kvcore.connectors import (
    check_block_keys,
    extract_kv_from_layer,
    hash_block_tokens,
    hash_request_tokens,
    inject_kv_into_layer,
    virtually_split_kv_in_blocks,
)

# -- keys -------------------------------------------------------------------------------------


def test_key_is_sha256_of_parent_tokens_and_extra():
    tokens = [random.randrange(2**40) for _ in range(16)]
    parent = hashlib.sha256(b"any parent").hexdigest()
    expected = hashlib.sha256(
        b"kvcore-block-key-v2\0" + b"\1" + struct.pack("<Q", 32) + bytes.fromhex(parent)
        + b"\1" + struct.pack("<Q16q", 16, *tokens)
        + b"\1" + struct.pack("<Q", 7) + b"model-a").hexdigest()
    assert hash_block_tokens(parent, tokens, extra="model-a") == expected
    assert hash_block_tokens(parent, torch.tensor(tokens)) == hash_block_tokens(parent, tokens)


def test_keys_chain_through_the_prefix():
    tokens = [random.randrange(32000) for _ in range(4 * 8 + 3)]
    keys = hash_request_tokens(tokens, 8)
    assert len(keys) == 4  # the partial last block has no key
    assert keys[1] == hash_block_tokens(keys[0], tokens[8:16])
    changed = list(tokens)
    changed[9] += 1  # a token of block 1 changes the keys of blocks 1..3, not 0
    other = hash_request_tokens(changed, 8)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:], strict=True))
    assert hash_request_tokens(tokens, 8, extra="model-b")[0] != keys[0]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [(lambda: hash_block_tokens("../../etc/passwd", [1]), ValueError,
      "parent_hash='../../etc/passwd' is not a block key"),
     (lambda: hash_block_tokens(None, [1, -2]), ValueError,
      r"token_ids\[1\]=-2 is outside 0..2\*\*63-1"),
     (lambda: hash_block_tokens(None, [1.5]), TypeError, r"token_ids\[0\]=1.5 must be an int"),
     (lambda: hash_block_tokens(None, "abc"), TypeError, "token_ids must be a sequence of ints"),
     (lambda: hash_block_tokens(None, torch.ones(2, 2, dtype=torch.int64)), ValueError,
      "token_ids must be a 1-D integer tensor"),
     (lambda: hash_block_tokens(None, [1], extra=3), TypeError, "extra must be a str or None"),
     (lambda: hash_request_tokens([1, 2], 0), ValueError, "block_size=0 must be a positive")],
    ids=["parent_path", "token_negative", "token_float", "token_str", "token_2d", "extra_int",
         "block_size"])
def test_bad_key_inputs_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_only_hex_digests_are_keys():
    key = hash_block_tokens(None, [1])
    assert check_block_keys((key,)) == [key]
    for bad in ("../../etc/passwd", key.upper(), key[:15], "g" * 64, key + "/x", ""):
        with pytest.raises(ValueError, match=r"keys\[0\]=.* is not a block key"):
            check_block_keys([bad])


@pytest.mark.parametrize("length", [16, 32, 48, 63, 65, 80, 128])
def test_keys_have_exactly_one_length(length):
    """A key of any other length is refused, as a key and as a parent: the parent field has
    one size, so it cannot absorb the start of the tokens."""
    bad = (hash_block_tokens(None, [7]) * 3)[:length]
    with pytest.raises(ValueError, match="lowercase SHA-256 hex digests of exactly 64"):
        check_block_keys([bad])
    with pytest.raises(ValueError, match="parent_hash=.* is not a block key"):
        hash_block_tokens(bad, [1, 2])


def test_a_parent_cannot_absorb_tokens():
    """The collision of parents accepted at several lengths: a 48-character parent with the
    tokens [3, 101, 102, 103] hashed the same bytes as the 64-character parent made of those
    48 characters and the count 4, with the tokens [101, 102, 103]."""
    short = "ab" * 24
    long = short + struct.pack("<Q", 4).hex()
    results = []
    for parent, tokens in ((short, [3, 101, 102, 103]), (long, [101, 102, 103])):
        try:
            results.append(hash_block_tokens(parent, tokens))
        except ValueError:
            results.append(None)
    assert None in results or results[0] != results[1]


def test_the_hashed_bytes_are_length_framed():
    """The documented encoding, recomputed independently: presence byte and uint64 length
    before the parent, the token count before the tokens, and the length before extra."""
    parent = hash_block_tokens(None, [5])

    def framed(data):
        return b"\0" if data is None else b"\1" + struct.pack("<Q", len(data)) + data

    for par, tokens, extra in ((None, [1, 2, 3], None), (parent, [9, 2**40], "model-a"),
                               (parent, [], ""), (None, [0], "x" * 300)):
        raw = (b"kvcore-block-key-v2\0" + framed(par and bytes.fromhex(par))
               + b"\1" + struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens)
               + framed(None if extra is None else extra.encode()))
        assert hash_block_tokens(par, tokens, extra) == hashlib.sha256(raw).hexdigest()
    # None and "" are different extras; the split between tokens and extra is fixed.
    assert hash_block_tokens(None, [1], None) != hash_block_tokens(None, [1], "")


# -- extract / inject -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["nhd", "hnd", "mla"])
def test_extract_then_inject_moves_blocks_exactly(layout):
    cross = layout != "mla"
    src, dst = (make_caches(cross_layer=cross, layout=layout, dtype="fp16") for _ in range(2))
    for layer_src, layer_dst in zip(src.layers, dst.layers, strict=True):
        kv = extract_kv_from_layer(layer_src, torch.tensor([5, 0, 9]))
        assert kv.shape == (3, *layer_src.shape[1:]) and kv.is_contiguous()
        inject_kv_into_layer(layer_dst, kv, [1, 2, 3], request_id="req-7")
        assert torch.equal(layer_dst[[1, 2, 3]].view(torch.uint8),
                           layer_src[[5, 0, 9]].view(torch.uint8))


@pytest.mark.parametrize(("src", "dst"), [((2, 5), [3, 4, 5]), ((3, 6), [1, 2, 3]),
                                         ((2, 5), [5, 4, 3])],
                         ids=["shift-up", "shift-down", "reversed"])
@pytest.mark.parametrize("cross", [True, False], ids=["cross-layer", "per-layer"])
def test_inject_from_a_view_of_the_same_layer_copies_the_source_first(src, dst, cross):
    """A source that aliases the destination (blocks moved within one cache) lands as it was
    before the call: index_copy_ would otherwise read blocks it has already overwritten."""
    kv = make_caches(cross_layer=cross)
    layer = kv.layers[1]
    before = [layer.clone() for layer in kv.layers]
    inject_kv_into_layer(layer, layer[src[0]:src[1]], dst, "move")
    expected = before[1].clone()
    expected[dst] = before[1][src[0]:src[1]]
    assert torch.equal(layer, expected)
    for i in (0, 2):  # the other layers of the same storage are untouched
        assert torch.equal(kv.layers[i], before[i])
    # Another layer's blocks as the source: the same storage, no shared bytes.
    inject_kv_into_layer(kv.layers[0], kv.layers[2][0:2], [7, 8], "copy")
    assert torch.equal(kv.layers[0][7:9], before[2][0:2])


def test_inject_writes_only_its_blocks_in_a_cross_layer_cache():
    kv = make_caches(cross_layer=True)
    before = kv.storage.clone()
    new = torch.randn(2, *kv.layers[1].shape[1:]).to(kv.storage.dtype)
    inject_kv_into_layer(kv.layers[1], new, [4, 6], request_id="req-1")
    changed = (kv.storage.view(torch.uint8) != before.view(torch.uint8))
    # Physical (B, L, ...): only layer 1 of blocks 4 and 6 differ.
    touched = changed.flatten(2).any(-1).nonzero().tolist()
    assert touched and {tuple(t) for t in touched} <= {(4, 1), (6, 1)}


@pytest.mark.parametrize(
    ("kv_blocks", "block_ids", "error", "message"),
    [(2, [1, 2, 3], ValueError, "request 'req-9': kv holds 2 blocks but block_ids names 3"),
     (2, [1, 1], ValueError, r"request 'req-9': block_ids has duplicates: \[1, 1\]"),
     (2, [1, 12], ValueError, r"block_ids\[1\]=12 is outside the layer's 12 blocks"),
     (2, torch.tensor([1.0, 2.0]), TypeError, "block_ids must be a 1-D int32/int64 tensor")],
    ids=["count", "duplicates", "range", "float_ids"])
def test_inject_refuses_bad_input(kv_blocks, block_ids, error, message):
    kv = make_caches(cross_layer=False)
    kv_in = torch.randn(kv_blocks, *kv.layers[0].shape[1:]).to(kv.storage.dtype)
    with pytest.raises(error, match=message):
        inject_kv_into_layer(kv.layers[0], kv_in, block_ids, request_id="req-9")


def test_inject_refuses_another_page_shape_or_dtype():
    kv = make_caches(cross_layer=False)
    with pytest.raises(ValueError, match=r"request 'r': kv has shape \(1, 2, 4, 2, 4\) but the "
                                         r"layer's blocks have shape \(2, 4, 2, 8\)"):
        inject_kv_into_layer(kv.layers[0], torch.zeros(1, 2, 4, 2, 4, dtype=torch.bfloat16),
                             [0], "r")
    with pytest.raises(TypeError, match="request 'r': kv is torch.float32 but the layer is "
                                        "torch.bfloat16"):
        inject_kv_into_layer(kv.layers[0], torch.zeros(1, 2, 4, 2, 8), [0], "r")


# -- virtual K/V split ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_split_gives_the_k_and_v_halves_of_each_block(layout):
    kv = make_caches(cross_layer=False, layout=layout)
    views = virtually_split_kv_in_blocks(kv)
    half = kv.page_size_bytes // 2
    assert [tuple(v.shape) for v in views] == [(kv.num_blocks, 2, half)] * kv.num_layers
    for layer, view in zip(kv.layers, views, strict=True):
        for part, half_cache in enumerate(layer.unbind(1)):  # K, then V: (B, N, H, D)
            in_memory_order = half_cache.transpose(1, 2) if layout == "hnd" else half_cache
            assert torch.equal(view[:, part].view(kv.storage.dtype),
                               in_memory_order.flatten(1))
    b, part = 5, 1
    v0 = views[2]
    assert v0.data_ptr() + b * v0.stride(0) + part * v0.stride(1) == \
        kv.layers[2][b, 1].data_ptr()


def test_split_views_share_memory_with_the_cache():
    kv = make_caches(cross_layer=False)
    views = virtually_split_kv_in_blocks(kv)
    fresh = torch.randint(0, 256, views[0][3, 1].shape, dtype=torch.uint8)
    views[0][3, 1] = fresh
    assert torch.equal(kv.layers[0][3, 1].contiguous().view(torch.uint8).flatten(), fresh)


@pytest.mark.parametrize(("layout", "cross", "expected"),
                         [("nhd", True, [(12, 1, 3 * 256)]),
                          ("interleaved", False, [(12, 1, 256)] * 3),
                          ("mla", False, [(12, 1, 64)] * 3)],
                         ids=["cross_layer", "interleaved", "mla"])
def test_split_returns_whole_blocks_where_k_and_v_are_not_halves(layout, cross, expected):
    kv = make_caches(cross_layer=cross, layout=layout)
    views = virtually_split_kv_in_blocks(kv)
    assert [tuple(v.shape) for v in views] == expected
    if cross:
        assert torch.equal(views[0][:, 0], kv.block_view())


def test_split_refuses_a_non_cache():
    with pytest.raises(TypeError, match="kv_caches must be a kvcore.KVCaches, got Tensor"):
        virtually_split_kv_in_blocks(torch.zeros(2))


def test_a_list_of_keys_is_checked_without_a_check_per_key(monkeypatch):
    """Hundreds of keys per load are checked in a few passes of C code; the per-key check
    only runs to name a bad one."""
    import kvcore.connectors.keys as keys_module

    keys = [hash_block_tokens(None, [i]) for i in range(512)]
    checked = keys_module._check_key
    calls = []
    monkeypatch.setattr(keys_module, "_check_key",
                        lambda *args: calls.append(args) or checked(*args))
    assert check_block_keys(tuple(keys)) == keys and not calls
    for bad in (keys[3].upper(), keys[3][:63] + " ", keys[3][:63] + "\u00e9", keys[3] + "0"):
        with pytest.raises(ValueError, match=r"keys\[3\]=.* is not a block key"):
            check_block_keys([*keys[:3], bad, *keys[4:]])
    with pytest.raises(TypeError, match=r"keys\[1\] must be a str hex digest, got bytes"):
        check_block_keys([keys[0], keys[1].encode()])
