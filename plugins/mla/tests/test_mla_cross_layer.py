"""Every MLA kernel on a per-layer view of a cross-layer pool: bit-identical to the contiguous
cache, and not one byte of the neighbouring layers touched.

The view is layer 1 of a ``(num_blocks, 3, ...)`` pool whose other layers hold random data: its
page stride is three pages, so a kernel that computes page addresses from sizes instead of
``stride(0)`` reads or writes a neighbour. These are the tests a backend must pass before its
``get_kv_cache_stride_order(True)`` may return ``(1, 0, 2, 3)``.
"""

from __future__ import annotations

import pytest
import torch
from kvcore_mla import TritonMLABackend
from kvcore_mla.ops import indexer_cache_head_size
from mla_helpers import DEVICE, block_tables, cross_layer_view, generator, other_layers, randn

import kvcore

triton_cache = pytest.importorskip("kvcore_mla.ops.triton_cache")
tma = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")

NUM_LAYERS, LAYER = 3, 1


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_concat_and_cache_mla_into_the_middle_layer(kv_cache_dtype: str) -> None:
    gen = generator("xl-concat", kv_cache_dtype)
    rank, rope, block_size, num_blocks, num_tokens = 512, 64, 16, 6, 40
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    kv_c = randn((num_tokens, rank), torch.bfloat16, gen)
    k_pe = randn((num_tokens, rope), torch.bfloat16, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    scale = torch.tensor([0.5], device=DEVICE)

    contiguous = torch.zeros(num_blocks, block_size, rank + rope, dtype=cache_dtype,
                             device=DEVICE)
    triton_cache.concat_and_cache_mla(kv_c, k_pe, contiguous, slots, kv_cache_dtype, scale)
    pool, view = cross_layer_view((num_blocks, block_size, rank + rope), NUM_LAYERS, LAYER,
                                  cache_dtype, gen)
    assert view.stride(0) == NUM_LAYERS * block_size * (rank + rope)
    neighbours = other_layers(pool, LAYER)
    view.zero_()
    triton_cache.concat_and_cache_mla(kv_c, k_pe, view, slots, kv_cache_dtype, scale)

    assert torch.equal(view.view(torch.uint8), contiguous.view(torch.uint8))
    assert torch.equal(other_layers(pool, LAYER), neighbours)


def test_indexer_write_into_the_middle_layer() -> None:
    gen = generator("xl-indexer")
    head_dim, qbs, block_size, num_blocks, num_tokens = 128, 64, 16, 4, 30
    k = randn((num_tokens, head_dim), torch.bfloat16, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    entry = indexer_cache_head_size(head_dim, qbs)

    contiguous = torch.zeros(num_blocks, block_size, entry, dtype=torch.uint8, device=DEVICE)
    triton_cache.indexer_k_quant_and_cache(k, contiguous, slots, qbs, "ue8m0")
    pool, view = cross_layer_view((num_blocks, block_size, entry), NUM_LAYERS, LAYER,
                                  torch.uint8, gen)
    neighbours = other_layers(pool, LAYER)
    view.zero_()
    triton_cache.indexer_k_quant_and_cache(k, view, slots, qbs, "ue8m0")

    assert torch.equal(view, contiguous)
    assert torch.equal(other_layers(pool, LAYER), neighbours)


def test_decode_attention_on_a_cross_layer_view_equals_contiguous() -> None:
    """MLA decode (values = the latent's first channels) at the upstream decode kernel's own
    test sizes: a per-layer view of a cross-layer pool gives the contiguous cache's bits."""
    num_heads, qk_dim, v_dim = 16, 576, 512
    gen = generator("xl-decode", (num_heads, 1, qk_dim, v_dim, True))
    page_size, num_pages, num_splits = 16, 24, 2
    seq_lens = [99, 1, 50]
    dtype = torch.bfloat16
    q = randn((len(seq_lens), num_heads, qk_dim), dtype, gen)
    table = block_tables(seq_lens, page_size, num_pages, gen)
    b_seq_len = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    k_ref = randn((num_pages, page_size, 1, qk_dim), dtype, gen)
    v_ref = k_ref[..., :v_dim]
    _, k_view = cross_layer_view(tuple(k_ref.shape), NUM_LAYERS, LAYER, dtype, gen)
    k_view.copy_(k_ref)
    v_view = k_view[..., :v_dim]

    def run(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.zeros(len(seq_lens), num_heads, v_dim, dtype=dtype, device=DEVICE)
        lse = torch.zeros(len(seq_lens), num_heads, dtype=torch.float32, device=DEVICE)
        logits = torch.empty(len(seq_lens), num_heads, num_splits, v_dim + 1,
                             dtype=torch.float32, device=DEVICE)
        tma.decode_attention_fwd(q, k, v, o, lse, table, b_seq_len, logits, num_splits,
                                 qk_dim ** -0.5, page_size, is_mla=True)
        return o, lse

    o_ref, lse_ref = run(k_ref, v_ref)
    o_xl, lse_xl = run(k_view, v_view)
    assert torch.equal(o_ref, o_xl)
    assert torch.equal(lse_ref, lse_xl)


def test_mixed_batch_latent_attention_on_a_cross_layer_view_equals_contiguous() -> None:
    gen = generator("xl-mla-prefill")
    num_heads, rank, rope, page_size, num_pages = 16, 64, 16, 16, 40
    meta = kvcore.build_attention_metadata(
        query_lens=[19, 1, 40], context_lens=[30, 60, 0],
        block_tables=[[3, 17, 8, 9], [0, 21, 22, 23, 24], [30, 31, 32]], block_size=page_size)
    q = randn((meta.num_actual_tokens, num_heads, rank + rope), torch.bfloat16, gen)
    cache = randn((num_pages, page_size, rank + rope), torch.bfloat16, gen)
    _, view = cross_layer_view(tuple(cache.shape), NUM_LAYERS, LAYER, torch.bfloat16, gen)
    view.copy_(cache)
    args = dict(kv_lora_rank=rank, query_start_loc=meta.query_start_loc.to(DEVICE),
                seq_lens=meta.seq_lens.to(DEVICE), block_table=meta.block_table.to(DEVICE),
                scale=0.1, max_query_len=meta.max_query_len)
    assert torch.equal(tma.mla_attention(q, cache, **args), tma.mla_attention(q, view, **args))


def test_triton_mla_forward_on_a_cross_layer_allocation_equals_layers_outermost() -> None:
    gen = generator("xl-backend")
    num_heads, rank, rope, nope, v_dim, block_size = 16, 64, 16, 32, 32, 16
    w = randn((num_heads * (nope + v_dim), rank), torch.bfloat16, gen, scale=rank ** -0.5)
    impl = TritonMLABackend.get_impl_cls()(
        num_heads, rank + rope, (nope + rope) ** -0.5, kv_lora_rank=rank,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim, kv_b_proj_weight=w)
    meta = kvcore.build_attention_metadata(
        query_lens=[9, 1, 1], context_lens=[20, 35, 0],
        block_tables=[[5, 2], [7, 1, 0], [4]], block_size=block_size, device=DEVICE)
    tokens = meta.num_actual_tokens
    kv_c = randn((tokens, rank), torch.bfloat16, gen)
    k_pe = randn((tokens, rope), torch.bfloat16, gen)
    query = randn((tokens, num_heads, nope + rope), torch.bfloat16, gen)
    layer = kvcore.LayerScales()

    outputs = []
    for cross_layer in (True, False):
        caches = kvcore.allocate_kv_caches(
            TritonMLABackend, num_layers=NUM_LAYERS, num_blocks=8, block_size=block_size,
            num_kv_heads=1, head_size=rank + rope, dtype=torch.bfloat16, device=DEVICE,
            cross_layer=cross_layer)
        assert caches.is_cross_layer == cross_layer
        # Same random history in every layer of both allocations (seeded per layer).
        for i, cache in enumerate(caches.layers):
            cache.copy_(randn(tuple(cache.shape), torch.bfloat16, generator("history", i)))
        before = [caches.layers[i].clone() for i in range(NUM_LAYERS) if i != LAYER]
        impl.do_kv_cache_update(layer, kv_c, k_pe, caches.layers[LAYER], meta.slot_mapping)
        outputs.append(impl.forward(layer, query, None, None, caches.layers[LAYER], meta))
        after = [caches.layers[i] for i in range(NUM_LAYERS) if i != LAYER]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(outputs[0], outputs[1])
