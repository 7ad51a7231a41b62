"""paged_attention_torch (CPU_ATTN's kernel) against paged_attention_ref, its oracle."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore.ops import paged_attention_ref, paged_attention_torch, reshape_and_cache_ref
from kvcore.ops.torch_attention import CHUNK_TOKENS


def make_batch(query_lens, context_lens, *, block_size, num_heads=8, num_kv_heads=2,
               head_size=32, dtype=torch.float64, cache_dtype=None, seed=0):
    """Shuffled pages of a cache whose unused slots hold NaN, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in pages:
        tables.append(ids[pos:pos + n])
        pos += n
    cache_dtype = cache_dtype or dtype
    kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_size), float("nan"),
                    dtype=dtype).to(cache_dtype)
    key_cache, value_cache = kv.unbind(1)
    meta = kvcore.build_attention_metadata(query_lens, context_lens, tables, block_size)
    # Every token of every request written (context and new), through the cache write.
    all_meta = kvcore.build_attention_metadata(seq_lens, [0] * len(seq_lens), tables,
                                               block_size)
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_size, generator=gen, dtype=torch.float64)
    v = torch.randn(total, num_kv_heads, head_size, generator=gen, dtype=torch.float64)
    fp8 = "fp8" if cache_dtype == torch.float8_e4m3fn else "auto"
    reshape_and_cache_ref(k.to(dtype), v.to(dtype), key_cache, value_cache,
                          all_meta.slot_mapping, fp8, 0.5, 0.25)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen,
                        dtype=torch.float64).to(dtype)
    args = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                block_table=meta.block_table, scale=head_size ** -0.5,
                kv_cache_dtype=fp8, k_scale=0.5, v_scale=0.25)
    return query, key_cache, value_cache, args


LENS = {  # (query_lens, context_lens)
    "decodes": ([1, 1, 1, 1], [3, 40, 300, 700]),
    "mixed": ([1, 7, 1, 19, 1], [600, 33, 0, 0, 257]),
    "prefill-long": ([300], [20]),
}


@pytest.mark.parametrize("block_size", [16, 5, 512], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("lens", list(LENS), ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)], ids=["gqa4", "mha", "mqa"])
@pytest.mark.parametrize("mask", ["causal", "non-causal", "window37"])
def test_matches_the_reference_in_float64(block_size, lens, heads, mask):
    query, key_cache, value_cache, args = make_batch(
        *LENS[lens], block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1])
    args.update(causal=mask != "non-causal",
                sliding_window=37 if mask == "window37" else None)
    want = paged_attention_ref(query, key_cache, value_cache, **args)
    got = paged_attention_torch(query, key_cache, value_cache, **args)
    assert not got.isnan().any(), "NaN of unused cache slots leaked into the output"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_and_fp8_match_the_reference(dtype):
    for cache_dtype in (dtype, torch.float8_e4m3fn):
        query, key_cache, value_cache, args = make_batch(
            *LENS["mixed"], block_size=16, dtype=dtype, cache_dtype=cache_dtype, seed=2)
        want = paged_attention_ref(query, key_cache, value_cache, **args)
        out = torch.full_like(query, 7.0)
        got = paged_attention_torch(query, key_cache, value_cache, output=out, **args)
        assert got is out
        # Both compute in float32 from the same cache bytes: only summation order differs.
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_a_decode_gets_the_same_bits_alone_as_in_a_batch_of_longer_requests():
    # The batch pads the short decode to the 700-token request: several more chunks of keys.
    assert 700 > 2 * CHUNK_TOKENS
    query, key_cache, value_cache, args = make_batch(
        [1, 1, 5], [9, 700, 40], block_size=16, dtype=torch.float32, seed=4)
    together = paged_attention_torch(query, key_cache, value_cache, **args)
    alone_args = dict(args, query_start_loc=torch.tensor([0, 1]),
                      seq_lens=args["seq_lens"][:1], block_table=args["block_table"][:1])
    alone = paged_attention_torch(query[:1], key_cache, value_cache, **alone_args)
    assert torch.equal(alone, together[:1])


def test_forward_reads_the_cache_only():
    query, key_cache, value_cache, args = make_batch(*LENS["mixed"], block_size=16,
                                                     dtype=torch.float32)
    before = key_cache.clone(), value_cache.clone()
    paged_attention_torch(query, key_cache, value_cache, **args)
    for was, now in zip(before, (key_cache, value_cache), strict=True):
        assert torch.equal(was.nan_to_num(), now.nan_to_num())
        assert torch.equal(was.isnan(), now.isnan())
