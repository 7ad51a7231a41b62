"""FLASHINFER and FLEX_ATTENTION on an NVIDIA GPU at real sizes (Hq 32, Hk 8, D 128, bf16,
blocks of 16): mixed batches against the float64 reference, cross-layer views bit-exact
against a contiguous copy, a layer over 2**31 elements, and kvcore's conformance cases.

Every FlashInfer case here is bf16, so the run builds FlashInfer JIT modules for head sizes
128 and 64, each with and without a sliding window (64 for the conformance suite's cases, whose
soft-cap cases add the capped variants), and head size 256 with a soft-cap (Gemma 2)."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends.flashinfer import FlashInferBackend
from kvcore_nvidia.backends.flex_attention import FlexAttentionBackend
from nvidia_helpers import mixed_batch, random_caches, reference, rel_err

import kvcore
from kvcore.testing import conformance_cases

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 32, 8, 128, 16, 16384
#: ||out - ref|| / ||ref|| of a bf16 kernel against float64 (bf16 rounding is ~4e-3 per value).
BF16_REL_ERR = 1e-2
_FI_MISSING = FlashInferBackend.unavailable_reasons()
needs_flashinfer = pytest.mark.skipif(bool(_FI_MISSING), reason="; ".join(_FI_MISSING))

MIXED = dict(q_lens=(1, 1, 300, 257, 1), ctx_lens=(1000, 15, 64, 0, 4095))
DECODE = dict(q_lens=(1,) * 48, ctx_lens=tuple(range(40, 48 * 97, 97)))


def _impl(backend: type[kvcore.AttentionBackend], sliding_window: int | None = None,
          ) -> kvcore.AttentionImpl:
    return backend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5,
                                  num_kv_heads=KV_HEADS, sliding_window=sliding_window)


def _cache(backend: type[kvcore.AttentionBackend], num_blocks: int, gen: torch.Generator,
           num_layers: int = 1, cross_layer: bool = False) -> kvcore.KVCaches:
    # Cross-layer pools take TRITON_ATTN's layout (same logical shape, blocks outermost), so
    # the check does not depend on the backend's own opt-in, which it is the evidence for.
    return random_caches(
        "TRITON_ATTN" if cross_layer else backend, gen, num_layers=num_layers,
        num_blocks=num_blocks, block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE, cross_layer=cross_layer)


def _forward(impl: kvcore.AttentionImpl, batch, kv_cache: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                 batch.meta, output=out)
    return out


@needs_flashinfer
@pytest.mark.parametrize(("shape", "causal", "window"), [
    ("mixed", True, None), ("mixed", False, None), ("decode", True, None),
    ("mixed", True, 256), ("decode", True, 256)])
def test_flashinfer_matches_float64_reference(shape, causal, window):
    gen = torch.Generator().manual_seed(hash((shape, causal, window)) % 2**31)
    kv_cache = _cache(FlashInferBackend, NUM_BLOCKS, gen).layers[0]
    impl = _impl(FlashInferBackend, window)
    batch = mixed_batch(impl, kv_cache, gen, causal=causal,
                        **(MIXED if shape == "mixed" else DECODE))
    out = _forward(impl, batch, kv_cache)
    assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR


@needs_flashinfer
@pytest.mark.parametrize("shape", ["mixed", "decode"])
def test_flashinfer_builder_plans_once_and_refuses_a_layer_it_did_not_plan_for(shape):
    """The builder's plan serves every layer with the planned parameters (no plan in forward);
    a layer with a sliding window is refused with the reason, not run on the wrong plan."""
    gen = torch.Generator().manual_seed(11 if shape == "mixed" else 12)
    kv_cache = _cache(FlashInferBackend, NUM_BLOCKS, gen).layers[0]
    impl = _impl(FlashInferBackend)
    batch = mixed_batch(impl, kv_cache, gen, **(MIXED if shape == "mixed" else DECODE))
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)
    builder = FlashInferBackend.get_builder_cls()(
        spec, num_heads=HEADS, max_num_seqs=64, max_num_batched_tokens=1024,
        max_model_len=8192, device="cuda")
    meta = builder.build(batch.meta)
    planned = impl.plan
    impl.plan = lambda *a: pytest.fail("forward planned although the builder had")
    try:
        out = torch.full_like(batch.query, float("nan"))
        impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache, meta,
                     output=out)
    finally:
        impl.plan = planned
    assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR
    with pytest.raises(ValueError, match="this layer needs .*sliding_window=256.* but the step "
                                         "was planned by FlashInferMetadataBuilder"):
        _impl(FlashInferBackend, 256).forward(kvcore.LayerScales(), batch.query, batch.key,
                                              batch.value, kv_cache, meta)


@needs_flashinfer
@pytest.mark.parametrize("shape", ["mixed", "decode"])
def test_flashinfer_builder_learns_the_first_layer_s_window(shape):
    """A builder not told the model's window plans its first step again for the first
    layer's (bit for bit a step planned for it from the start) and later steps for it."""
    gen = torch.Generator().manual_seed(13 if shape == "mixed" else 14)
    kv_cache = _cache(FlashInferBackend, NUM_BLOCKS, gen).layers[0]
    impl = _impl(FlashInferBackend, 256)
    batch = mixed_batch(impl, kv_cache, gen, **(MIXED if shape == "mixed" else DECODE))
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)

    def builder():
        return FlashInferBackend.get_builder_cls()(
            spec, num_heads=HEADS, max_num_seqs=64, max_num_batched_tokens=1024,
            max_model_len=8192, device="cuda")

    def run(meta):
        out = torch.full_like(batch.query, float("nan"))
        impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache, meta,
                     output=out)
        return out

    told = builder()
    told.sliding_window = 256
    expected = run(told.build(batch.meta))
    learner = builder()
    out = run(learner.build(batch.meta))
    assert learner.settled and learner.sliding_window == 256
    assert torch.equal(out, expected)
    assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR
    assert torch.equal(run(learner.build(batch.meta)), expected)


#: Gemma 2 (9B) per layer: 16 query heads, 8 K/V heads of 256, scores soft-capped at 50.
GEMMA = dict(num_heads=16, num_kv_heads=8, head_size=256, logits_soft_cap=50.0)
PREFILL = dict(q_lens=(300, 257, 64), ctx_lens=(0, 1000, 17))


@needs_flashinfer
@pytest.mark.parametrize("builder", [True, False], ids=["builder", "plain-metadata"])
@pytest.mark.parametrize("shape", ["decode", "prefill", "mixed"])
def test_flashinfer_soft_cap_matches_float64_reference_at_gemma2_shapes(shape, builder):
    """FlashInfer's soft-capped kernels (decode, prefill, a mixed step split between them),
    planned by the builder for the model's cap or per layer from plain metadata. The queries
    are scaled so the scores reach about +-100: the cap changes the result far beyond the
    bf16 bound (checked), so a dropped cap fails."""
    gen = torch.Generator().manual_seed(21)
    kv_cache = random_caches(
        FlashInferBackend, gen, num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        num_kv_heads=GEMMA["num_kv_heads"], head_size=GEMMA["head_size"]).layers[0]
    impl = FlashInferBackend.get_impl_cls()(scale=GEMMA["head_size"] ** -0.5, **GEMMA)
    batch = mixed_batch(impl, kv_cache, gen,
                        **{"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}[shape])
    batch.query.mul_(30)
    meta = batch.meta
    if builder:
        spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                                        num_kv_heads=GEMMA["num_kv_heads"],
                                        head_size=GEMMA["head_size"])
        meta = FlashInferBackend.get_builder_cls()(
            spec, num_heads=GEMMA["num_heads"], max_num_seqs=64, max_num_batched_tokens=1024,
            max_model_len=8192, device="cuda",
            logits_soft_cap=GEMMA["logits_soft_cap"]).build(batch.meta)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache, meta,
                 output=out)
    ref = reference(impl, batch, kv_cache)
    assert rel_err(out, ref) < BF16_REL_ERR
    uncapped = FlashInferBackend.get_impl_cls()(
        scale=GEMMA["head_size"] ** -0.5, **{**GEMMA, "logits_soft_cap": None})
    assert rel_err(reference(uncapped, batch, kv_cache), ref) > 10 * BF16_REL_ERR


@pytest.mark.parametrize("shape", ["mixed", "decode"])
def test_flashinfer_on_a_cross_layer_view_is_bit_exact(shape):
    """The evidence behind FLASHINFER's cross-layer opt-in: on layer 1 of a 3-layer
    cross-layer pool it returns exactly what it returns on a contiguous copy."""
    gen = torch.Generator().manual_seed(7 if shape == "mixed" else 8)
    caches = _cache(FlashInferBackend, NUM_BLOCKS, gen, num_layers=3, cross_layer=True)
    view = caches.layers[1]
    assert not view.is_contiguous()
    impl = _impl(FlashInferBackend)
    neighbours = [caches.layers[i].clone() for i in (0, 2)]
    batch = mixed_batch(impl, view, gen, **(MIXED if shape == "mixed" else DECODE))
    out_view = _forward(impl, batch, view)
    out_plain = _forward(impl, batch, view.contiguous())
    assert torch.equal(out_view, out_plain)
    assert all(torch.equal(caches.layers[i], n) for i, n in zip((0, 2), neighbours, strict=True))


@needs_flashinfer
def test_flashinfer_beyond_2_pow_31_elements():
    """Requests in the last blocks of a 4.3 GB layer read the right pages."""
    page = 2 * BLOCK_SIZE * KV_HEADS * HEAD_SIZE
    num_blocks = 2**31 // page + 8
    gen = torch.Generator().manual_seed(9)
    kv_cache = torch.zeros(num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                           dtype=torch.bfloat16, device="cuda")
    impl = _impl(FlashInferBackend)
    tables = [[num_blocks - 1, num_blocks - 3], [num_blocks - 2, 5]]
    meta = kvcore.build_attention_metadata([20, 1], [0, 30], tables, BLOCK_SIZE, device="cuda")
    n = meta.num_actual_tokens
    kv_cache[[5, num_blocks - 2]] = torch.randn(2, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                                                generator=gen).to(torch.bfloat16).cuda()
    q, k, v = (torch.randn(n, h, HEAD_SIZE, generator=gen).to(torch.bfloat16).cuda()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    impl.do_kv_cache_update(kvcore.LayerScales(), k, v, kv_cache, meta.slot_mapping)
    out = impl.forward(kvcore.LayerScales(), q, k, v, kv_cache, meta)
    used = torch.tensor(sorted({b for t in tables for b in t}), device="cuda")
    compact = kv_cache[used]
    renumber = {b: i for i, b in enumerate(used.tolist())}
    compact_meta = kvcore.build_attention_metadata(
        [20, 1], [0, 30], [[renumber[b] for b in t] for t in tables], BLOCK_SIZE, device="cuda")
    ref = kvcore.ops.paged_attention_ref(
        q.double(), *(c.double() for c in compact.unbind(1)),
        query_start_loc=compact_meta.query_start_loc, seq_lens=compact_meta.seq_lens,
        block_table=compact_meta.block_table, scale=impl.scale)
    assert rel_err(out, ref) < BF16_REL_ERR


def _bf16_cases(backend: type[kvcore.AttentionBackend]) -> list:
    """Every conformance case but the fp16 ones: each (dtype, head size) is a FlashInfer JIT
    module to build, and the bf16 ones (head sizes 64 and 128) cover every rule, cross-layer
    and int64 offsets included."""
    return [c for c in conformance_cases(backend, ["cuda"]) if "-fp16-" not in f"{c.id}-"]


@needs_flashinfer
@pytest.mark.parametrize("case", _bf16_cases(FlashInferBackend), ids=str)
def test_flashinfer_conforms(case):
    case.run()


@pytest.mark.parametrize("shape", ["mixed", "decode"])
def test_flex_attention_compiled_matches_float64_reference(shape):
    gen = torch.Generator().manual_seed(11 if shape == "mixed" else 12)
    kv_cache = _cache(FlexAttentionBackend, NUM_BLOCKS, gen).layers[0]
    impl = _impl(FlexAttentionBackend)
    batch = mixed_batch(impl, kv_cache, gen, **(MIXED if shape == "mixed" else DECODE))
    out = _forward(impl, batch, kv_cache)
    assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR


def test_flex_attention_stays_within_three_graphs_per_layer_kind_as_steps_vary():
    """An engine's steps change batch size, context and query lengths and the cache's size;
    a global and a windowed layer each compile their own entry point and stay within three
    graphs (torch raises past them), every output against the float64 reference."""
    gen = torch.Generator().manual_seed(13)
    full = _cache(FlexAttentionBackend, NUM_BLOCKS, gen).layers[0]
    layers = (_impl(FlexAttentionBackend), _impl(FlexAttentionBackend, sliding_window=256))
    steps = [((1,), (30,)), ((1,) * 4, (300, 40, 5000, 17)), ((64, 1, 1), (0, 900, 3)),
             ((1,) * 64, tuple(range(10, 64 * 30, 30))), ((333, 1), (0, 1000)),
             ((1,), (2000,)), ((17,) * 8, (40,) * 8)]
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for i, (q_lens, ctx_lens) in enumerate(steps):
            kv_cache = full[:NUM_BLOCKS - 1000 * (i % 3)]
            for impl in layers:
                batch = mixed_batch(impl, kv_cache, gen, q_lens=q_lens, ctx_lens=ctx_lens)
                out = _forward(impl, batch, kv_cache)
                assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR, (i, impl)
