"""The shuffled cache write: Triton bit-exact against the pure-torch reference on standard,
``unbind(1)`` and cross-layer views, neighbours untouched; the layout round-trips."""

from __future__ import annotations

import pytest
import torch
from kvcore_rocm.ops.shuffle import (
    gather_shuffled_kv,
    reshape_and_cache_shuffle,
    reshape_and_cache_shuffle_ref,
    shuffled_views,
)

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 6, 16, 2, 32


def _tokens(gen, n, dtype):
    k = torch.randn(n, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(n, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    return k, v


def _slots(gen, n):
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:n]
    slots[1] = -1  # padding token: skipped
    return slots


def _storage(kind, gen, dtype):
    """Random-filled storage and a function returning the (key_cache, value_cache) halves."""
    if kind == "standard":  # one layer, blocks-first (B, 2, N, H, D): kv_cache.unbind(1)
        store = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=gen)
        return store.to(dtype), lambda s: s.unbind(1)
    if kind == "cross_layer":  # (B, L=3, 2, N, H, D): layer 1's halves, block stride 3 pages
        store = torch.randn(NUM_BLOCKS, 3, 2, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=gen)
        return store.to(dtype), lambda s: s[:, 1].unbind(1)
    # "split": separate K and V tensors (B, N, H, D), each half contiguous per block
    store = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=gen)
    return store.to(dtype), lambda s: (s[0], s[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["standard", "cross_layer", "split"])
def test_triton_matches_reference_bit_exact(kind, dtype):
    gen = torch.Generator().manual_seed(7)
    store, halves = _storage(kind, gen, dtype)
    key, value = _tokens(gen, 11, dtype)
    key = key.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous token stride
    slots = _slots(gen, 11)
    expected, got = store.clone(), store.clone()
    reshape_and_cache_shuffle_ref(key, value, *halves(expected), slots)
    reshape_and_cache_shuffle(key, value, *halves(got), slots)
    assert torch.equal(got.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.uint8 if dtype != torch.float32 else torch.int32))
    if kind == "cross_layer":  # layers 0 and 2 byte-identical to before
        for layer in (0, 2):
            assert torch.equal(got[:, layer], store[:, layer])
    changed = (got != store).reshape(-1).nonzero().numel()
    assert 0 < changed <= 10 * 2 * HEADS * HEAD_SIZE  # only the 10 written slots


def test_reference_matches_layout_definition():
    """Element (n, h, d) of block b lies at the documented offsets inside each half-page."""
    gen = torch.Generator().manual_seed(3)
    store = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=torch.float16)
    key, value = _tokens(gen, 3, torch.float16)
    slots = torch.tensor([5 * BLOCK_SIZE + 9, 2 * BLOCK_SIZE + 0, 0 * BLOCK_SIZE + 15])
    reshape_and_cache_shuffle(key, value, *store.unbind(1), slots)
    x, n_, d_ = 8, BLOCK_SIZE, HEAD_SIZE
    for t, slot in enumerate(slots.tolist()):
        b, n = divmod(slot, BLOCK_SIZE)
        k_page = store[b, 0].reshape(-1)
        v_page = store[b, 1].reshape(-1)
        for h in range(HEADS):
            for d in range(HEAD_SIZE):
                assert k_page[h * d_ * n_ + (d // x) * n_ * x + n * x + d % x] == key[t, h, d]
                assert v_page[h * n_ * d_ + (n // x) * d_ * x + d * x + n % x] == value[t, h, d]
    k_view, v_view = shuffled_views(*store.unbind(1))
    assert k_view.shape == (NUM_BLOCKS, HEADS, HEAD_SIZE // x, BLOCK_SIZE, x)
    assert v_view.shape == (NUM_BLOCKS, HEADS, BLOCK_SIZE // x, HEAD_SIZE, x)


def test_gather_round_trips_on_cross_layer_view():
    gen = torch.Generator().manual_seed(11)
    store, halves = _storage("cross_layer", gen, torch.bfloat16)
    seq_lens = torch.tensor([20, 5])
    table = torch.tensor([[4, 1], [3, 0]], dtype=torch.int32)
    key, value = _tokens(gen, 25, torch.bfloat16)
    slots = torch.tensor([int(table[0, p // 16]) * 16 + p % 16 for p in range(20)]
                         + [int(table[1, 0]) * 16 + p for p in range(5)])
    reshape_and_cache_shuffle(key, value, *halves(store), slots)
    k, v, cu = gather_shuffled_kv(*halves(store), table, seq_lens)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert cu.tolist() == [0, 20, 25]


def test_bad_arguments_name_the_argument():
    cache = torch.zeros(4, 2, 16, 2, 12, dtype=torch.float16)  # head_size 12: not a multiple of 8
    key = torch.zeros(1, 2, 12, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"head_size=12 must be multiples of x=8"):
        reshape_and_cache_shuffle(key, key, *cache.unbind(1), torch.tensor([0]))
    hnd = torch.zeros(4, 2, 2, 16, 16, dtype=torch.float16).transpose(2, 3)  # HND pages
    key = torch.zeros(1, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"key_cache has strides .* NHD blocks-first"):
        reshape_and_cache_shuffle(key, key, *hnd.unbind(1), torch.tensor([0]))
    good = torch.zeros(4, 2, 16, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        reshape_and_cache_shuffle(key, key, *good.unbind(1), torch.tensor([0]), "fp8")
    with pytest.raises(ValueError, match="slot_mapping contains slot 64"):
        reshape_and_cache_shuffle(key, key, *good.unbind(1), torch.tensor([64]))
