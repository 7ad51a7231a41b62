"""CPU_ATTN against a float64 attention reference on contiguous (non-paged) K/V."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore.testing import contiguous_attention_ref, random_block_tables

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def run_case(seed, block_size, num_heads, num_kv_heads, head_size, dtype, window=None,
             cross_layer=True, kv_cache_dtype="auto", backend_name="CPU_ATTN"):
    """A mixed batch (decode, prefill with cached prefix, fresh prefill) on shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    query_lens = [1, 1, 7, 19]
    context_lens = [rng.randint(1, 40), rng.randint(30, 70), rng.randint(5, 33), 0]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)  # unordered pages
    caches = kvcore.allocate_kv_caches(backend_name, num_layers=3, num_blocks=num_blocks,
                                       block_size=block_size, num_kv_heads=num_kv_heads,
                                       head_size=head_size, dtype=dtype, device="cpu",
                                       cross_layer=cross_layer, kv_cache_dtype=kv_cache_dtype)
    caches.storage.copy_(torch.randn(caches.storage.shape, generator=gen))  # random neighbours
    kv_cache = caches.layers[1]
    backend = kvcore.resolve_backend(backend_name)
    scale = head_size ** -0.5
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                  sliding_window=window, kv_cache_dtype=kv_cache_dtype)
    layer = kvcore.LayerScales(k_scale=0.5, v_scale=0.25) if kv_cache_dtype != "auto" \
        else kvcore.LayerScales()
    full_k = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]
    # step 1: the cached prefixes
    prefix = kvcore.build_attention_metadata(context_lens, [0] * 4, tables, block_size)
    pairs = list(zip(full_k, full_v, context_lens, strict=True))
    impl.do_kv_cache_update(layer, torch.cat([k[:c] for k, _, c in pairs]),
                            torch.cat([v[:c] for _, v, c in pairs]), kv_cache, prefix.slot_mapping)
    # step 2: this step's new tokens
    meta = kvcore.build_attention_metadata(query_lens, context_lens, tables, block_size)
    new_k = torch.cat([k[c:] for k, _, c in pairs])
    new_v = torch.cat([v[c:] for _, v, c in pairs])
    impl.do_kv_cache_update(layer, new_k, new_v, kv_cache, meta.slot_mapping)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype)
    out = impl.forward(layer, query, new_k, new_v, kv_cache, meta)
    return out, query, full_k, full_v, meta, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)],
                         ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32, 5], ids=lambda b: f"bs{b}")
def test_mixed_batch_matches_float64_reference(dtype, num_heads, num_kv_heads, block_size):
    out, query, full_k, full_v, meta, scale = run_case(
        seed=block_size * 100 + num_heads, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_size=32, dtype=dtype)
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        ref = contiguous_attention_ref(query[starts[i]:starts[i + 1]], full_k[i], full_v[i], scale)
        got = out[starts[i]:starts[i + 1]].double()
        assert (got - ref).abs().max() <= TOL[dtype] * max(1.0, ref.abs().max()), f"request {i}"


@pytest.mark.parametrize("window", [1, 8, 37], ids=lambda w: f"window{w}")
def test_sliding_window(window):
    out, query, full_k, full_v, meta, scale = run_case(
        seed=window, block_size=16, num_heads=4, num_kv_heads=2, head_size=16,
        dtype=torch.float32, window=window)
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        ref = contiguous_attention_ref(query[starts[i]:starts[i + 1]], full_k[i], full_v[i],
                                       scale, sliding_window=window)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].double(), ref, atol=2e-5,
                                   rtol=2e-5)


def test_fp8_cache_within_fp8_error():
    out, query, full_k, full_v, meta, scale = run_case(
        seed=3, block_size=16, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
        kv_cache_dtype="fp8")
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        ref = contiguous_attention_ref(query[starts[i]:starts[i + 1]], full_k[i], full_v[i], scale)
        assert (out[starts[i]:starts[i + 1]].double() - ref).abs().max() < 0.15


def test_cross_layer_view_gives_bit_identical_output():
    a = run_case(seed=11, block_size=16, num_heads=8, num_kv_heads=2, head_size=32,
                 dtype=torch.bfloat16, cross_layer=True)[0]
    b = run_case(seed=11, block_size=16, num_heads=8, num_kv_heads=2, head_size=32,
                 dtype=torch.bfloat16, cross_layer=False)[0]
    assert torch.equal(a, b)


def test_cache_update_skips_negative_slots_and_touches_nothing_else():
    caches = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=3, num_blocks=4, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    caches.storage.copy_(torch.randn(caches.storage.shape))
    before = caches.storage.clone()
    impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(1, 8, 1.0)
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    impl.do_kv_cache_update(kvcore.LayerScales(), key, value, caches.layers[1],
                            torch.tensor([9, -1, 2]))
    layer = caches.layers[1]
    assert torch.equal(layer[2, 0, 1], key[0]) and torch.equal(layer[2, 1, 1], value[0])
    assert torch.equal(layer[0, 0, 2], key[2])
    expected = before.clone().permute(caches.layout.inverse_stride_order())
    expected[1, 2, 0, 1], expected[1, 2, 1, 1] = key[0], value[0]
    expected[1, 0, 0, 2], expected[1, 0, 1, 2] = key[2], value[2]
    assert torch.equal(caches.storage.permute(caches.layout.inverse_stride_order()), expected)


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [(lambda a: a.update(slot_mapping=torch.tensor([0, 99])), ValueError,
      "slot_mapping contains slot 99, but the cache holds only 4 blocks x 4 tokens = 16 slots"),
     (lambda a: a.update(key=a["key"].double()), TypeError,
      "value has dtype torch.float32 but key has torch.float64"),
     (lambda a: a.update(slot_mapping=torch.tensor([0.0, 1.0])), TypeError,
      "slot_mapping must be int32 or int64"),
     (lambda a: a.update(key=a["key"][:, :, :4]), ValueError, "value has shape")],
    ids=["slot-out-of-range", "dtype-mismatch", "float-slots", "shape-mismatch"],
)
def test_cache_update_bad_input(mutate, error, message):
    caches = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=1, num_blocks=4, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    args = dict(key=torch.randn(2, 1, 8), value=torch.randn(2, 1, 8),
                slot_mapping=torch.tensor([0, 1]))
    mutate(args)
    impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(1, 8, 1.0)
    with pytest.raises(error, match=message):
        impl.do_kv_cache_update(kvcore.LayerScales(), args["key"], args["value"],
                                caches.layers[0], args["slot_mapping"])


def test_forward_rejects_block_table_out_of_range():
    caches = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=1, num_blocks=2, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(2, 8, 1.0, 1)
    meta = kvcore.build_attention_metadata([1], [4], [[0, 5]], 4)
    with pytest.raises(ValueError, match="block_table refers to block id 5, but the cache has 2"):
        impl.forward(kvcore.LayerScales(), torch.randn(1, 2, 8), None, None, caches.layers[0],
                     meta)


def test_metadata_builder():
    meta = kvcore.build_attention_metadata([2, 1], [3, 0], [[4, 1], [7]], block_size=3)
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.seq_lens.tolist() == [5, 1]
    # request 0 writes positions 3 and 4 (block 1, offsets 0 and 1); request 1 position 0
    assert meta.slot_mapping.tolist() == [1 * 3 + 0, 1 * 3 + 1, 7 * 3 + 0]
    assert meta.block_table.tolist() == [[4, 1], [7, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (2, 5, 3)
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks but 5 tokens need 3"):
        kvcore.build_attention_metadata([2], [3], [[4]], block_size=2)
    with pytest.raises(ValueError, match="must have one entry per request"):
        kvcore.build_attention_metadata([2], [3, 1], [[4]], block_size=2)
