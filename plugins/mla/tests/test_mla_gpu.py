"""The MLA kernels at real sizes on a GPU (DeepSeek: kv_lora_rank 512, rope 64, 16 and 128
heads, blocks of 64 and 16, thousands of tokens), through the public dispatching ops, and on a
cross-layer pool of more than 2**31 elements."""

from __future__ import annotations

import functools

import kvcore_mla.ops as ops
import pytest
import torch
from kvcore_mla import TritonMLABackend
from mla_helpers import assert_close, block_tables, cross_layer_view, generator, other_layers, randn

import kvcore

pytestmark = pytest.mark.gpu

RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
ENTRY = RANK + ROPE


def _decode(q, k, v, table, lens, page_size, num_splits, is_mla, out_dtype=torch.bfloat16,
            impl=None):
    batch, heads, _ = q.shape
    v_dim = v.shape[-1]
    o = torch.empty(batch, heads, v_dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32 if out_dtype != torch.float64
                      else torch.float64, device=q.device)
    logits = torch.empty(batch, heads, num_splits, v_dim + 1, dtype=torch.float32,
                         device=q.device)
    (impl or ops.decode_attention_fwd)(q, k, v, o, lse, table, lens, logits, num_splits,
                                       q.shape[-1] ** -0.5, page_size, is_mla)
    return o, lse


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_concat_and_cache_mla_real_sizes_cross_layer(kv_cache_dtype: str) -> None:
    gen = generator("gpu-concat", kv_cache_dtype)
    num_blocks, block_size, num_tokens = 256, 64, 8192
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    fused = randn((num_tokens, ENTRY), torch.bfloat16, gen)
    kv_c, k_pe = fused[:, :RANK], fused[:, RANK:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
    scale = torch.tensor([0.3], device="cuda")
    expected = torch.zeros(num_blocks, block_size, ENTRY, dtype=cache_dtype, device="cuda")
    ops.concat_and_cache_mla_ref(kv_c, k_pe, expected, slots, kv_cache_dtype, scale)
    pool, view = cross_layer_view((num_blocks, block_size, ENTRY), 3, 1, cache_dtype, gen)
    neighbours = other_layers(pool, 1)
    view.zero_()
    ops.concat_and_cache_mla(kv_c, k_pe, view, slots, kv_cache_dtype, scale)
    assert torch.equal(view.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(other_layers(pool, 1), neighbours)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [0.3, 0.37, 1.0, 2.5])
def test_concat_and_cache_mla_fp8_every_bf16_value(cache_dtype: torch.dtype, scale: float) -> None:
    """Every finite bf16 value (+-0, subnormals, ties, saturation) through the kernel's fp8
    path, bytes equal to the reference's ``fp8(clamp(x * float32(1 / scale)))``."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    x = torch.cat([x, torch.zeros((-x.numel()) % ENTRY, dtype=torch.bfloat16)]).view(-1, ENTRY)
    x = x.cuda()
    n = x.shape[0]
    kind = "fp8" if cache_dtype == torch.float8_e4m3fn else "fp8_e5m2"
    slots = torch.arange(n, device="cuda")
    s = torch.tensor([scale], device="cuda")
    expected = torch.zeros(-(-n // 64), 64, ENTRY, dtype=cache_dtype, device="cuda")
    ops.concat_and_cache_mla_ref(x[:, :RANK], x[:, RANK:], expected, slots, kind, s)
    pool, view = cross_layer_view(expected.shape, 2, 1, cache_dtype, generator("fp8-all"))
    neighbours = other_layers(pool, 1)
    view.zero_()
    ops.concat_and_cache_mla(x[:, :RANK], x[:, RANK:], view, slots, kind, s)
    assert torch.equal(other_layers(pool, 1), neighbours)
    diff = (view.view(torch.uint8) != expected.view(torch.uint8)).flatten()
    assert diff.sum().item() == 0, (
        f"{diff.sum().item()} bytes differ, e.g. x={x.flatten()[diff.nonzero()[:8, 0]].tolist()}")


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_indexer_write_real_sizes_matches_reference(scale_fmt: str | None) -> None:
    gen = generator("gpu-indexer", scale_fmt)
    k = randn((8192, 128), torch.bfloat16, gen, scale=3.0)
    num_blocks = 257
    slots = torch.randperm(num_blocks * 64, generator=gen)[:8192].cuda()
    cache = torch.zeros(num_blocks, 64, ops.indexer_cache_head_size(), dtype=torch.uint8,
                        device="cuda")
    expected = cache.clone()
    ops.indexer_k_quant_and_cache(k, cache, slots, 128, scale_fmt)
    ops.indexer_k_quant_and_cache_ref(k, expected, slots, 128, scale_fmt)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("page_size", [64, 16])
def test_mla_decode_real_sizes(num_heads: int, page_size: int) -> None:
    gen = generator("gpu-decode", num_heads, page_size)
    lens = [4096, 3001, 1, 777]
    num_pages = sum(-(-n // page_size) for n in lens) + 7
    table = block_tables(lens, page_size, num_pages, gen)
    b_seq_len = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = randn((len(lens), num_heads, ENTRY), torch.bfloat16, gen)
    _, view = cross_layer_view((num_pages, page_size, 1, ENTRY), 3, 1, torch.bfloat16, gen)
    cache = view.contiguous()
    # One split and eight at block 64; eight at block 16 (each count is a separate compile).
    for splits in (1, 8) if page_size == 64 else (8,):
        o, lse = _decode(q, cache, cache[..., :RANK], table, b_seq_len, page_size, splits, True)
        o_xl, lse_xl = _decode(q, view, view[..., :RANK], table, b_seq_len, page_size, splits,
                               True)
        assert torch.equal(o, o_xl) and torch.equal(lse, lse_xl)
        c64 = cache.double()
        o_ref, lse_ref = _decode(q.double(), c64, c64[..., :RANK], table, b_seq_len, page_size,
                                 splits, True, torch.float64, ops.decode_attention_ref)
        assert_close(o, o_ref, torch.bfloat16, f"o (splits={splits})")
        assert_close(lse, lse_ref, torch.bfloat16, f"lse (splits={splits})")


def test_decode_cross_layer_upstream_shapes() -> None:
    """The upstream decode kernel's own MLA test sizes: 3 requests of 1027 tokens, a
    16384-token cache."""
    num_heads, num_kv_heads, qk_dim, v_dim = 16, 1, 576, 512
    gen = generator("gpu-upstream", (num_heads, num_kv_heads, qk_dim, v_dim, True))
    page_size, num_pages, lens = 16, 16384 // 16, [1027, 1027, 1027]
    table = block_tables(lens, page_size, num_pages, gen)
    b_seq_len = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = randn((3, num_heads, qk_dim), torch.bfloat16, gen)
    _, k_view = cross_layer_view((num_pages, page_size, num_kv_heads, qk_dim), 3, 1,
                                      torch.bfloat16, gen)
    k = k_view.contiguous()
    v, v_view = k[..., :v_dim], k_view[..., :v_dim]
    o, lse = _decode(q, k, v, table, b_seq_len, page_size, 8, True)
    o_xl, lse_xl = _decode(q, k_view, v_view, table, b_seq_len, page_size, 8, True)
    assert torch.equal(o, o_xl) and torch.equal(lse, lse_xl)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_mla_backend_real_sizes(kv_cache_dtype: str) -> None:
    """DeepSeek-V3 dims, 128 heads: a prefill with a 2000-token prefix plus decodes."""
    gen = generator("gpu-backend", kv_cache_dtype)
    num_heads, block_size = 128, 64
    w = randn((num_heads * (NOPE + V_DIM), RANK), torch.bfloat16, gen, scale=RANK ** -0.5)
    impl = TritonMLABackend.get_impl_cls()(
        num_heads, ENTRY, (NOPE + ROPE) ** -0.5, kv_cache_dtype=kv_cache_dtype,
        kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        kv_b_proj_weight=w)
    caches = kvcore.allocate_kv_caches(
        TritonMLABackend, num_layers=2, num_blocks=256, block_size=block_size, num_kv_heads=1,
        head_size=ENTRY, dtype=torch.bfloat16, device="cuda", kv_cache_dtype=kv_cache_dtype)
    cache = caches.layers[1]
    layer = kvcore.LayerScales(k_scale=torch.tensor([0.5], device="cuda"))
    lens = [3000, 4000, 1500]
    table = block_tables(lens, block_size, 256, gen).tolist()
    history = kvcore.build_attention_metadata(lens, [0, 0, 0], table, block_size, device="cuda")
    kv_c = randn((history.num_actual_tokens, RANK), torch.bfloat16, gen)
    k_pe = randn((history.num_actual_tokens, ROPE), torch.bfloat16, gen)
    impl.do_kv_cache_update(layer, kv_c, k_pe, cache, history.slot_mapping)
    for query_lens in ([1000, 1, 1], [1, 1, 1]):
        meta = kvcore.build_attention_metadata(
            query_lens, [n - q for n, q in zip(lens, query_lens, strict=True)], table,
            block_size, device="cuda")
        query = randn((meta.num_actual_tokens, num_heads, NOPE + ROPE), torch.bfloat16, gen)
        out = impl.forward(layer, query, None, None, cache, meta)
        expected = ops.mla_forward_ref(
            query.double(), cache, w, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
            v_head_dim=V_DIM, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
            block_table=meta.block_table, scale=impl.scale, kv_cache_dtype=kv_cache_dtype,
            k_scale=layer.k_scale)
        assert_close(out, expected, torch.bfloat16, f"output {query_lens}")


# Launch variants the benchmark sweeps beside the table's rows (a failing one must fail here,
# not only lose the sweep): latent halves, smaller key tiles, 32-head programs. One split count
# each (5 splits and 4 compile to one kernel): a 64-head tile takes ~15 s to compile.
_VARIANTS = [(64, 64, 8, 2, True), (64, 32, 8, 3, False), (32, 64, 8, 3, False),
             (16, 64, 8, 3, True)]


@pytest.mark.parametrize("variant", _VARIANTS, ids=lambda v: "h{}n{}w{}s{}{}".format(
    *v[:4], "-halves" if v[4] else ""))
def test_mla_decode_launch_variants_real_sizes(variant: tuple) -> None:
    """Each variant at 128 heads, blocks of 64: against float64, cross-layer bit-exact, and
    on a pool of more than 2**31 elements (its high blocks) bit-exact against a small cache."""
    from kvcore_mla.ops import mla_configs
    from kvcore_mla.ops import triton_mla_attention as tma

    block_h, block_n, warps, stages, halves = variant
    cls = mla_configs.TritonMLAHalvesConfig if halves else mla_configs.TritonMLADecodeConfig
    config = cls(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
    gen = generator("gpu-decode-variant", variant)
    page, lens = 64, [4096, 3001, 1, 777]
    num_pages = sum(-(-n // page) for n in lens) + 7
    table = block_tables(lens, page, num_pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = randn((len(lens), 128, ENTRY), torch.bfloat16, gen)
    pool, view = cross_layer_view((num_pages, page, ENTRY), 3, 1, torch.bfloat16, gen)
    cache = view.contiguous()
    before = pool.clone()

    def run(c, t, s, splits):
        return _decode(q[: t.shape[0]], c, c[..., :RANK], t, s, page, splits, True,
                       impl=functools.partial(tma.decode_attention_fwd, config=config))

    from triton.runtime.errors import OutOfResources

    try:
        o, lse = run(cache, table, seq_lens, 5)
    except OutOfResources as exc:  # a variant may need more shared memory than a GPU has
        pytest.skip(f"{variant} does not fit on this GPU: {exc}")
    o_xl, lse_xl = run(view, table, seq_lens, 5)
    assert torch.equal(o, o_xl) and torch.equal(lse, lse_xl)
    c64 = cache.double()
    o_ref, lse_ref = _decode(q.double(), c64, c64[..., :RANK], table, seq_lens, page, 5, True,
                             torch.float64, ops.decode_attention_ref)
    assert_close(o, o_ref, torch.bfloat16, "o")
    assert_close(lse, lse_ref, torch.bfloat16, "lse")
    assert torch.equal(pool, before)

    caches = kvcore.allocate_kv_caches(
        TritonMLABackend, num_layers=4, num_blocks=16384, block_size=page, num_kv_heads=1,
        head_size=ENTRY, dtype=torch.bfloat16, device="cuda")
    big = caches.layers[3]
    high = torch.arange(16384 - 64, 16384, device="cuda")
    assert int(high[0]) * big.stride(0) > 2**31
    big[high] = cache[:64]
    one = seq_lens[:1]
    far = run(big, high[None].int(), one, 4)
    near = run(cache, torch.arange(64, device="cuda")[None].int(), one, 4)
    assert torch.equal(far[0], near[0]) and torch.equal(far[1], near[1])


def test_cross_layer_pool_beyond_2_pow_31_elements() -> None:
    """Layer 3 of a 4-layer cross-layer pool of 2.4e9 elements: blocks past element 2**31
    are written and read exactly like a small contiguous cache's, neighbours untouched."""
    gen = generator("gpu-int64")
    num_blocks, block_size, num_layers = 16384, 64, 4
    caches = kvcore.allocate_kv_caches(
        TritonMLABackend, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=1, head_size=ENTRY, dtype=torch.bfloat16, device="cuda")
    assert caches.storage.numel() > 2**31 and caches.is_cross_layer
    view = caches.layers[3]
    high = torch.arange(num_blocks - 40, num_blocks, device="cuda")  # element offsets > 2**31
    assert int(high[0]) * view.stride(0) + 3 * block_size * ENTRY > 2**31
    lens = [40 * block_size - 5]
    num_tokens = lens[0]
    kv_c = randn((num_tokens, RANK), torch.bfloat16, gen)
    k_pe = randn((num_tokens, ROPE), torch.bfloat16, gen)
    pos = torch.arange(num_tokens, device="cuda")
    big_slots = high[pos // block_size] * block_size + pos % block_size
    ops.concat_and_cache_mla(kv_c, k_pe, view, big_slots)
    small = torch.zeros(40, block_size, ENTRY, dtype=torch.bfloat16, device="cuda")
    ops.concat_and_cache_mla(kv_c, k_pe, small, pos)
    assert torch.equal(view[high], small)
    assert caches.layers[2][high].abs().max().item() == 0  # the neighbour layer is untouched

    q = randn((1, 128, ENTRY), torch.bfloat16, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    big = _decode(q, view, view[..., :RANK], high[None].int(), lens_t, block_size, 4, True)
    ref = _decode(q, small, small[..., :RANK], torch.arange(40, device="cuda")[None].int(),
                  lens_t, block_size, 4, True)
    assert torch.equal(big[0], ref[0]) and torch.equal(big[1], ref[1])


def test_indexer_write_beyond_2_pow_31_bytes() -> None:
    gen = generator("gpu-indexer-int64")
    num_blocks, block_size, num_layers, entry = 65536, 64, 4, ops.indexer_cache_head_size()
    pool = torch.zeros(num_blocks, num_layers, block_size, entry, dtype=torch.uint8,
                       device="cuda")
    assert pool.numel() > 2**31
    view = pool[:, 3]
    k = randn((4096, 128), torch.bfloat16, gen)
    high = torch.arange(num_blocks - 64, num_blocks, device="cuda")
    pos = torch.arange(4096, device="cuda")
    ops.indexer_k_quant_and_cache(k, view, high[pos // block_size] * block_size
                                  + pos % block_size, 128, "ue8m0")
    small = torch.zeros(64, block_size, entry, dtype=torch.uint8, device="cuda")
    ops.indexer_k_quant_and_cache_ref(k, small, pos, 128, "ue8m0")
    assert torch.equal(view[high], small)
    assert pool[high, 2].max().item() == 0


@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_decode_graph_replays_a_later_step(num_heads: int) -> None:
    """TRITON_MLA's decode step captured once in a CUDA graph through its builder (the table's
    launch config, splits for max_model_len, the persistent workspace), replayed for a later
    step of other lengths and pages: equal to the float64 reference, and to eager."""
    gen = generator("gpu-decode-graph", num_heads)
    page, max_len, batch = 64, 8192, 6
    spec = kvcore.MLAAttentionSpec(block_size=page, dtype=torch.bfloat16, kv_lora_rank=RANK,
                                   qk_rope_head_dim=ROPE)
    builder = TritonMLABackend.get_builder_cls()(
        spec, num_heads=num_heads, max_num_seqs=batch, max_num_batched_tokens=batch,
        max_model_len=max_len, device="cuda")
    num_pages = batch * max_len // page
    cache = randn((num_pages, page, ENTRY), torch.bfloat16, gen)
    q = torch.empty(batch, num_heads, ENTRY, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(batch, num_heads, RANK, dtype=torch.bfloat16, device="cuda")

    def step(lens: list[int]) -> kvcore.AttentionMetadata:
        table = block_tables(lens, page, num_pages, gen).tolist()
        common = kvcore.build_attention_metadata([1] * batch, [n - 1 for n in lens], table,
                                                 page, device="cuda")
        return builder.build(common, graph_batch_size=batch)

    def run(meta) -> None:
        from kvcore_mla.ops.triton_mla_attention import mla_attention

        mla_attention(q, cache, kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                      seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.07,
                      output=out, max_query_len=meta.max_query_len,
                      max_seq_len=meta.max_seq_len, plan=meta.plan)

    meta = step([4096, 1, 700, 8192, 63, 2000])
    q.copy_(randn((batch, num_heads, ENTRY), torch.bfloat16, gen))
    run(meta)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(meta)
    later = step([5, 8000, 64, 129, 3333, 1])  # the same buffers, new values
    q.copy_(randn((batch, num_heads, ENTRY), torch.bfloat16, gen))
    graph.replay()
    replayed = out.clone()
    run(later)
    assert torch.equal(replayed, out)
    expected = ops.mla_attention_ref(q.double(), cache.double(), kv_lora_rank=RANK,
                                     query_start_loc=later.query_start_loc,
                                     seq_lens=later.seq_lens, block_table=later.block_table,
                                     scale=0.07)
    assert_close(replayed, expected, torch.bfloat16, "replayed decode")
