"""FLASHINFER's builder on an NVIDIA GPU at real sizes (Hq 32, Hk 8, D 128, bf16, blocks of
16): prefill, decode and mixed batches on the kernels :func:`flashinfer_kernels` picks for
the GPU (SM90 prefill on Hopper) against the float64 reference; one builder reused across
steps of different shapes; a captured decode step replayed after rebuilding with other
lengths equals the eager step; steps built while the device lags behind (staging reuse);
warmup; fp8 caches (e4m3, e5m2) eager and replayed."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends.flashinfer import FlashInferBackend
from nvidia_helpers import Batch, mixed_batch, random_caches, reference, rel_err

import kvcore

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 32, 8, 128, 16, 4096
#: ||out - ref|| / ||ref|| of a bf16 kernel against float64 (bf16 rounding is ~4e-3 per value).
BF16_REL_ERR = 1e-2
_MISSING = FlashInferBackend.unavailable_reasons()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_MISSING), reason="; ".join(_MISSING))]

SHAPES = {
    "prefill": dict(q_lens=(300, 257), ctx_lens=(0, 0)),
    "chunked-prefill": dict(q_lens=(128, 64, 200), ctx_lens=(2000, 640, 33)),
    "decode": dict(q_lens=(1,) * 24, ctx_lens=tuple(range(40, 24 * 97, 97))),
    "mixed-decodes-first": dict(q_lens=(1, 1, 1, 300, 57), ctx_lens=(1000, 15, 4095, 64, 0)),
    "mixed-decode-last": dict(q_lens=(1, 300, 257, 1), ctx_lens=(1000, 64, 0, 4095)),
}


def _impl() -> kvcore.AttentionImpl:
    return FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE,
                                            scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS)


def _cache(gen: torch.Generator) -> torch.Tensor:
    return random_caches(FlashInferBackend, gen, num_layers=1, num_blocks=NUM_BLOCKS,
                         block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
                         head_size=HEAD_SIZE).layers[0]


def _builder(max_num_seqs: int = 64) -> kvcore.AttentionMetadataBuilder:
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)
    return FlashInferBackend.get_builder_cls()(
        spec, num_heads=HEADS, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
        max_model_len=8192, device="cuda")


def _forward(impl, batch, kv_cache, meta) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache, meta,
                 output=out)
    return out


def test_kernels_on_this_gpu():
    builder = _builder()
    major = torch.cuda.get_device_capability()[0]
    assert builder.kernels.prefill == ("fa3" if major == 9 else "fa2")
    assert builder.kernels.decode_tensor_cores  # 4 query heads per K/V head


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_builder_matches_float64_reference(shape, causal):
    gen = torch.Generator().manual_seed(len(shape) * 31 + causal)
    kv_cache = _cache(gen)
    impl = _impl()
    batch = mixed_batch(impl, kv_cache, gen, causal=causal, **SHAPES[shape])
    meta = _builder().build(batch.meta)
    out = _forward(impl, batch, kv_cache, meta)
    assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR


def test_builder_reused_across_steps_of_different_shapes():
    gen = torch.Generator().manual_seed(5)
    kv_cache = _cache(gen)
    impl, builder = _impl(), _builder()
    for shape in ["decode", "mixed-decodes-first", "prefill", "chunked-prefill",
                  "mixed-decode-last", "decode"]:
        batch = mixed_batch(impl, kv_cache, gen, **SHAPES[shape])
        out = _forward(impl, batch, kv_cache, builder.build(batch.meta))
        assert rel_err(out, reference(impl, batch, kv_cache)) < BF16_REL_ERR, shape


def test_captured_decode_step_replays_after_rebuild():
    """A decode step captured for 8 requests, replayed after ``build()`` of steps with other
    lengths (the same page counts: plan skipped; new page counts: planned again) and fewer
    requests, equals the eager step on the same metadata and the float64 reference."""
    gen = torch.Generator().manual_seed(6)
    kv_cache = _cache(gen)
    impl, builder = _impl(), _builder(max_num_seqs=8)
    size = 8
    q = torch.randn(size, HEADS, HEAD_SIZE, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(q)
    ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [ids[i * 64:(i + 1) * 64] for i in range(size)]

    def common(lengths):
        n = len(lengths)
        return kvcore.build_attention_metadata([1] * n, [x - 1 for x in lengths], tables[:n],
                                               BLOCK_SIZE, device="cuda")

    first = [100 + 37 * i for i in range(size)]
    meta = builder.build(common(first), graph_batch_size=size)

    def step():
        impl.forward(kvcore.LayerScales(), q, q[:, :KV_HEADS], q[:, :KV_HEADS], kv_cache, meta,
                     output=out)

    step()  # outside the capture: nothing lazy left
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    plans = builder.plans
    for lengths in ([101 + 37 * i for i in range(size)],   # same page counts: no plan
                    [900 - 50 * i for i in range(size)],   # new page counts: planned
                    [33, 17, 1000, 5, 64]):                # fewer requests: padded
        c = common(lengths)
        rebuilt = builder.build(c, graph_batch_size=size)
        assert all(a.data_ptr() == b.data_ptr() for a, b in (
            (rebuilt.seq_lens, meta.seq_lens), (rebuilt.block_table, meta.block_table)))
        assert rebuilt.decode_wrapper is meta.decode_wrapper
        graph.replay()
        replayed = out.clone()
        eager = torch.empty_like(out)
        impl.forward(kvcore.LayerScales(), q, q[:, :KV_HEADS], q[:, :KV_HEADS], kv_cache,
                     rebuilt, output=eager)
        n = len(lengths)
        assert torch.equal(replayed[:n], eager[:n])
        k, v = kv_cache.unbind(1)
        ref = kvcore.ops.paged_attention_ref(
            q[:n].double(), k.double(), v.double(), query_start_loc=c.query_start_loc,
            seq_lens=c.seq_lens, block_table=c.block_table, scale=impl.scale)
        assert rel_err(replayed[:n], ref) < BF16_REL_ERR
    assert builder.plans - plans == 2  # the first rebuild kept the plan


def test_warmup_builds_the_modules_then_costs_little():
    first = _builder().warmup()
    assert set(first) == {"decode", "prefill"}
    again = _builder().warmup()
    assert all(again[p] < max(first[p], 1.0) for p in again)


def test_steps_built_ahead_of_a_busy_device_stay_correct():
    """The builder's page-locked staging slots are reused while the device is still busy with
    earlier steps (a sleep kernel before each step keeps the host ahead, no sync until the
    end): each step's copies from its slot must have run before the host rewrites that slot.
    Replayed decode steps (same and new page counts, fewer requests) interleaved with eager
    mixed steps (on their own cache, disjoint blocks per step) all equal the float64
    reference computed at the end."""
    gen = torch.Generator().manual_seed(8)
    kv_cache, mixed_cache = _cache(gen), _cache(gen)
    impl, builder = _impl(), _builder(max_num_seqs=8)
    size = 8
    q = torch.randn(size, HEADS, HEAD_SIZE, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(q)
    ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [ids[i * 64:(i + 1) * 64] for i in range(size)]

    def decode(lengths):
        n = len(lengths)
        return kvcore.build_attention_metadata([1] * n, [x - 1 for x in lengths], tables[:n],
                                               BLOCK_SIZE, device="cuda")

    def mixed(j):
        """Decodes first, then prefills; blocks [200 j, 200 (j + 1)) of mixed_cache."""
        q_lens, ctx_lens = (1, 1, 1, 40 + j, 9), (300 + 7 * j, 15, 1000, 64, 0)
        blocks = iter(range(200 * j, 200 * (j + 1)))
        step_tables = [[next(blocks) for _ in range(-(-(a + b) // BLOCK_SIZE))]
                       for a, b in zip(q_lens, ctx_lens, strict=True)]
        meta = kvcore.build_attention_metadata(q_lens, ctx_lens, step_tables, BLOCK_SIZE,
                                               device="cuda")
        n = meta.num_actual_tokens
        query, key, value = (torch.randn(n, h, HEAD_SIZE, generator=gen).to("cuda",
                                                                           torch.bfloat16)
                             for h in (HEADS, KV_HEADS, KV_HEADS))
        impl.do_kv_cache_update(kvcore.LayerScales(), key, value, mixed_cache,
                                meta.slot_mapping)
        return Batch(meta, query, key, value)

    lengths = [100 + 37 * i for i in range(size)]
    meta = builder.build(decode(lengths), graph_batch_size=size)

    def step():
        impl.forward(kvcore.LayerScales(), q, q[:, :KV_HEADS], q[:, :KV_HEADS], kv_cache, meta,
                     output=out)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    results = []
    for i in range(24):
        torch.cuda._sleep(1_000_000)  # the device falls behind the host
        if i % 4 == 3:  # an eager mixed step between the replays
            batch = mixed(i // 4)
            results.append((batch, _forward(impl, batch, mixed_cache,
                                            builder.build(batch.meta))))
            continue
        lengths = [x + (17 if i % 3 else 1) for x in lengths]  # new page counts, or the same
        common = decode(lengths[:size - (i % 5 == 0)])
        builder.build(common, graph_batch_size=size)
        graph.replay()
        results.append((common, out[:common.num_seqs].clone()))
    torch.cuda.synchronize()
    k, v = (c.double() for c in kv_cache.unbind(1))
    for i, (step_meta, got) in enumerate(results):
        if isinstance(step_meta, Batch):
            ref = reference(impl, step_meta, mixed_cache)
        else:
            ref = kvcore.ops.paged_attention_ref(
                q[:step_meta.num_seqs].double(), k, v,
                query_start_loc=step_meta.query_start_loc, seq_lens=step_meta.seq_lens,
                block_table=step_meta.block_table, scale=impl.scale)
        assert rel_err(got, ref) < BF16_REL_ERR, f"step {i}"


def _fp8_cache(gen: torch.Generator, kv: str) -> torch.Tensor:
    return random_caches(FlashInferBackend, gen, num_layers=1, num_blocks=NUM_BLOCKS,
                         block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                         kv_cache_dtype=kv).layers[0]


def _impl_and_builder(kv_cache_dtype: str) -> tuple[kvcore.AttentionImpl,
                                                    kvcore.AttentionMetadataBuilder]:
    """A layer and a builder of the test's shapes with bf16 queries on a
    ``kv_cache_dtype`` cache."""
    impl = FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE,
                                            scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS,
                                            kv_cache_dtype=kv_cache_dtype)
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                    kv_cache_dtype=kv_cache_dtype)
    builder = FlashInferBackend.get_builder_cls()(
        spec, num_heads=HEADS, max_num_seqs=64, max_num_batched_tokens=2048,
        max_model_len=8192, device="cuda")
    return impl, builder


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 caches need capability >= 8.9 (kvcore's Triton cache write)")
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape", ["decode", "chunked-prefill", "mixed-decodes-first"])
def test_an_fp8_cache_matches_float64_reference_eager_and_replayed(shape, kv):
    """An fp8 cache (scales 0.5 and 2.0, written by the layer) on FlashInfer's
    mixed-precision kernels, eager, then a decode step captured and replayed, against the
    float64 reference reading the same stored values."""
    gen = torch.Generator().manual_seed(9)
    kv_cache = _fp8_cache(gen, kv)
    layer = kvcore.LayerScales(k_scale=torch.tensor(0.5, device="cuda"),
                               v_scale=torch.tensor(2.0, device="cuda"))
    impl, builder = _impl_and_builder(kv)
    batch = mixed_batch(impl, kv_cache, gen, layer=layer, dtype=torch.bfloat16, **SHAPES[shape])
    ref = reference(impl, batch, kv_cache, layer)
    out = torch.full_like(batch.query, float("nan"))

    def step(meta):
        impl.forward(layer, batch.query, batch.key, batch.value, kv_cache, meta, output=out)

    step(builder.build(batch.meta))
    assert rel_err(out, ref) < BF16_REL_ERR
    if shape != "decode":
        return
    meta = builder.build(batch.meta, graph_batch_size=batch.meta.num_seqs)
    step(meta)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(meta)
    out.fill_(float("nan"))
    graph.replay()
    assert rel_err(out, ref) < BF16_REL_ERR


@pytest.mark.parametrize("scales", [None, (1.0, 1.0), (0.5, 2.0)], ids=["bf16", "fp8-unit",
                                                                       "fp8-scaled"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_recorded_runs_equal_flashinfer_run_bit_for_bit(shape, scales):
    """A layer's later calls of a step go through the launch's recorded runs (FlashInfer's
    compiled module called with the arguments its ``run`` built for the plan's first layer):
    bit-identical to ``wrapper.run`` on two layers' caches, for every phase split, bf16 and
    fp8 caches; a value scale other than 1 is not recorded (it goes through ``run``)."""
    if scales is not None and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 caches need capability >= 8.9 (kvcore's Triton cache write)")
    gen = torch.Generator().manual_seed(len(shape) * 7 + (scales is None))
    kv = "auto" if scales is None else "fp8_e4m3"
    caches = [_cache(gen) if scales is None else _fp8_cache(gen, kv) for _ in range(2)]
    layer = kvcore.LayerScales() if scales is None else kvcore.LayerScales(*scales)
    impl, builder = _impl_and_builder(kv)
    batch = mixed_batch(impl, caches[0], gen, layer=layer, dtype=torch.bfloat16,
                        **SHAPES[shape])
    impl.do_kv_cache_update(layer, batch.key, batch.value, caches[1], batch.meta.slot_mapping)
    meta = builder.build(batch.meta)
    run_kwargs = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    k = meta.num_decodes
    for kv_cache in caches:
        want = torch.full_like(batch.query, float("nan"))
        halves = tuple(kv_cache.unbind(1))
        if meta.decode_wrapper is not None:
            meta.decode_wrapper.run(batch.query[:k], halves, out=want[:k], **run_kwargs)
        if meta.prefill_wrapper is not None:
            meta.prefill_wrapper.run(batch.query[k:], halves, out=want[k:], **run_kwargs)
        for _ in range(3):  # the first call checks in full; the later ones take the launch
            got = torch.full_like(batch.query, float("nan"))
            impl.forward(layer, batch.query, batch.key, batch.value, kv_cache, meta,
                         output=got)
            assert torch.equal(got, want)
    runs = list(meta.launch.runs.values())
    assert runs and all(run.bound == (scales is None or scales[1] == 1.0) for run in runs)
    # Planned again (other lengths, other page counts): recorded again, still exact.
    batch2 = mixed_batch(impl, caches[0], gen, layer=layer, dtype=torch.bfloat16,
                         q_lens=SHAPES[shape]["q_lens"],
                         ctx_lens=tuple(c + 3 * BLOCK_SIZE for c in SHAPES[shape]["ctx_lens"]))
    meta2 = builder.build(batch2.meta)
    outs = []
    for _ in range(2):
        outs.append(torch.full_like(batch2.query, float("nan")))
        impl.forward(layer, batch2.query, batch2.key, batch2.value, caches[0], meta2,
                     output=outs[-1])
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], reference(impl, batch2, caches[0], layer)) < BF16_REL_ERR
