"""CPU_MLA: the pure-torch MLA backend, against the unabsorbed float64 MLA of the model."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.ops import mla_attention_ref
from kvcore.testing import contiguous_mla_ref, random_block_tables

#: DeepSeek-V3's MLA proportions (latent 512 + rope 64, nope 128, v 128) scaled down.
RANK, ROPE, NOPE, V = 64, 16, 32, 24
HEADS = 4


def make_impl(dtype, kv_cache_dtype="auto", gen=None, heads=HEADS):
    weight = (torch.randn(heads * (NOPE + V), RANK, generator=gen) * RANK**-0.5).to(dtype)
    backend = kvcore.resolve_backend("CPU_MLA")
    impl = backend.get_impl_cls()(
        num_heads=heads, head_size=RANK + ROPE, scale=(NOPE + ROPE) ** -0.5,
        kv_cache_dtype=kv_cache_dtype, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, kv_b_proj_weight=weight)
    return backend, impl, weight


def run_step(dtype, *, query_lens, context_lens, block_size=16, kv_cache_dtype="auto",
             seed=0, cross_layer=True):
    """Prefixes, then a mixed step, on layer 1 of a 3-layer cache; returns the output and the
    float64 unabsorbed reference of every request over its contiguous latents."""
    gen = torch.Generator().manual_seed(seed)
    backend, impl, weight = make_impl(dtype, kv_cache_dtype, gen)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    caches = kvcore.allocate_kv_caches(
        backend, num_layers=3, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1,
        head_size=RANK + ROPE, dtype=dtype, device="cpu", cross_layer=cross_layer,
        kv_cache_dtype=kv_cache_dtype)
    assert caches.is_cross_layer == cross_layer
    caches.storage.copy_(torch.randn(caches.storage.shape, generator=gen))
    neighbours = [caches.layers[i].clone() for i in (0, 2)]
    scales = kvcore.LayerScales(k_scale=torch.tensor([0.5]) if kv_cache_dtype != "auto" else 1.0)
    kv_c = [torch.randn(s, RANK, generator=gen).to(dtype) for s in seq_lens]
    k_pe = [torch.randn(s, ROPE, generator=gen).to(dtype) for s in seq_lens]
    layer = caches.layers[1]
    prefix = kvcore.build_attention_metadata(context_lens, [0] * len(seq_lens), tables,
                                             block_size)
    cached = list(zip(kv_c, k_pe, context_lens, strict=True))
    impl.do_kv_cache_update(scales, torch.cat([c[:n] for c, _, n in cached]),
                            torch.cat([p[:n] for _, p, n in cached]), layer, prefix.slot_mapping)
    meta = kvcore.build_attention_metadata(query_lens, context_lens, tables, block_size)
    impl.do_kv_cache_update(scales, torch.cat([c[n:] for c, _, n in cached]),
                            torch.cat([p[n:] for _, p, n in cached]), layer, meta.slot_mapping)
    query = torch.randn(sum(query_lens), HEADS, NOPE + ROPE, generator=gen).to(dtype)
    out = impl.forward(scales, query, None, None, layer, meta)
    for before, i in zip(neighbours, (0, 2), strict=True):
        assert torch.equal(before.view(torch.uint8), caches.layers[i].view(torch.uint8))
    s = 0.5 if kv_cache_dtype != "auto" else 1.0

    def stored(x):  # what the cache holds, read back as the kernel reads it
        return kvcore.ops.quantize_to_cache(x, layer.dtype, s).double() * s

    starts = meta.query_start_loc.tolist()
    ref = torch.cat([
        contiguous_mla_ref(query[starts[i]:starts[i + 1]], stored(kv_c[i]), stored(k_pe[i]),
                           weight, (NOPE + ROPE) ** -0.5, qk_nope_head_dim=NOPE, v_head_dim=V)
        for i in range(len(seq_lens))])
    return out, ref


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


#: Relative error norm of the whole output: the roundings of q_latent, the latent output and
#: the output in the model dtype (float32: only the order of operations).
TOL = {torch.float32: 2e-6, torch.bfloat16: 5e-3, torch.float16: 8e-4}


@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size", [16, 5], ids=lambda b: f"bs{b}")
def test_mixed_batch_matches_the_unabsorbed_float64_model(dtype, block_size):
    out, ref = run_step(dtype, query_lens=[1, 1, 9, 23, 1], context_lens=[40, 3, 17, 0, 70],
                        block_size=block_size, seed=block_size)
    assert out.shape == (35, HEADS, V) and out.dtype == dtype
    assert relative_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_matches_the_dequantised_latents(kv_cache_dtype):
    out, ref = run_step(torch.float32, query_lens=[1, 6], context_lens=[30, 11],
                        kv_cache_dtype=kv_cache_dtype, seed=7)
    assert relative_error(out, ref) < 1e-5


def test_cross_layer_view_gives_the_contiguous_bits():
    cross, _ = run_step(torch.bfloat16, query_lens=[1, 5], context_lens=[20, 4], seed=3)
    plain, _ = run_step(torch.bfloat16, query_lens=[1, 5], context_lens=[20, 4], seed=3,
                        cross_layer=False)
    assert torch.equal(cross.view(torch.int16), plain.view(torch.int16))


def test_cpu_mla_is_the_cpu_default_and_cross_layer():
    config = kvcore.AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, use_mla=True)
    backend = kvcore.get_attn_backend(config, platform="cpu")
    assert backend.get_name() == "CPU_MLA" and backend.supports_cross_layer()
    assert backend.get_kv_cache_shape(7, 16, 1, 576) == (7, 16, 576)
    assert issubclass(backend.get_impl_cls(), kvcore.MLACommonImpl)


def test_decodes_batched_equal_each_decode_alone():
    """The batched decode path of mla_attention_ref gives each request its own result."""
    gen = torch.Generator().manual_seed(11)
    lens, bs = [9, 33, 1, 17], 8
    tables = random_block_tables(lens, bs, 20, gen)
    table = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    cache = torch.randn(20, bs, RANK + ROPE, generator=gen, dtype=torch.float64)
    q = torch.randn(len(lens), HEADS, RANK + ROPE, generator=gen, dtype=torch.float64)
    args = dict(kv_lora_rank=RANK, scale=0.1)
    together = mla_attention_ref(q, cache, query_start_loc=torch.arange(len(lens) + 1),
                                 seq_lens=torch.tensor(lens), block_table=table, **args)
    for i, n in enumerate(lens):
        alone = mla_attention_ref(q[i:i + 1], cache, query_start_loc=torch.tensor([0, 1]),
                                  seq_lens=torch.tensor([n]), block_table=table[i:i + 1], **args)
        torch.testing.assert_close(alone, together[i:i + 1], rtol=1e-12, atol=1e-12)


def test_absorbed_reference_equals_unabsorbed_in_float64():
    """mla_attention_ref (absorbed, latent space) is exactly mla_forward_ref (expanded K/V)."""
    gen = torch.Generator().manual_seed(5)
    q_lens, ctx, bs = [1, 4, 7], [12, 0, 9], 4
    lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    meta = kvcore.build_attention_metadata(q_lens, ctx, random_block_tables(lens, bs, 16, gen),
                                           bs)
    cache = torch.randn(16, bs, RANK + ROPE, generator=gen, dtype=torch.float64)
    query = torch.randn(sum(q_lens), HEADS, NOPE + ROPE, generator=gen, dtype=torch.float64)
    w = torch.randn(HEADS * (NOPE + V), RANK, generator=gen, dtype=torch.float64)
    common = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                  block_table=meta.block_table, scale=0.07)
    expected = kvcore.ops.mla_forward_ref(query, cache, w, kv_lora_rank=RANK,
                                          qk_nope_head_dim=NOPE, v_head_dim=V, **common)
    wk = w.view(HEADS, NOPE + V, RANK)
    q_latent = torch.cat([torch.einsum("thn,hnl->thl", query[..., :NOPE], wk[:, :NOPE]),
                          query[..., NOPE:]], -1)
    latent = mla_attention_ref(q_latent, cache, kv_lora_rank=RANK, **common)
    got = torch.einsum("thl,hvl->thv", latent, wk[:, NOPE:])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_kv_heads": 2}, "num_kv_heads=2: MLA has one latent per token"),
    ({"head_size": 100}, "head_size=100 must be the latent size"),
    ({"kv_b_proj_weight": torch.zeros(3, 3)}, "kv_b_proj_weight has shape (3, 3)"),
])
def test_bad_construction_names_the_argument(change, message):
    kwargs = dict(num_heads=HEADS, head_size=RANK + ROPE, scale=0.1, kv_lora_rank=RANK,
                  qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                  kv_b_proj_weight=torch.zeros(HEADS * (NOPE + V), RANK))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvcore.resolve_backend("CPU_MLA").get_impl_cls()(**{**kwargs, **change})
