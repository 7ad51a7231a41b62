"""FLEX_ATTENTION on CPU (eager flex_attention): numerics against the float64 reference and
CPU_ATTN on mixed batches, logit soft-capping and attention sinks, the block mask it builds,
its compiled entry points' graphs, its int32 limit, and kvcore's conformance suite."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends.flex_attention import (
    Q_TILE,
    FlexAttentionBackend,
    build_block_mask,
    compiled_flex,
    padded_rows,
    paged_sequence_views,
)
from nvidia_helpers import REL_ERR, mixed_batch, reference, rel_err
from torch.nn.attention.flex_attention import create_mask

import kvcore
from kvcore.ops import paged_attention_ref
from kvcore.testing import conformance_cases, random_block_tables

BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_SIZE, NUM_BLOCKS = 16, 2, 8, 32, 24


def _setup(dtype: torch.dtype, seed: int, sliding_window: int | None = None,
           attn_type: kvcore.AttentionType = kvcore.AttentionType.DECODER):
    gen = torch.Generator().manual_seed(seed)
    caches = kvcore.allocate_kv_caches(
        FlexAttentionBackend, num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=dtype, device="cpu")
    kv_cache = caches.layers[0]
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen).to(dtype))  # stale data shows
    impl = FlexAttentionBackend.get_impl_cls()(
        num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS, sliding_window=sliding_window, attn_type=attn_type)
    return gen, kv_cache, impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_mixed_batch_matches_float64_reference_and_cpu_attn(dtype, causal):
    gen, kv_cache, impl = _setup(dtype, seed=1)
    batch = mixed_batch(impl, kv_cache, gen, causal=causal)
    out = torch.full_like(batch.query, float("nan"))  # every row must be written
    returned = impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value,
                            kv_cache, batch.meta, output=out)
    assert returned is out
    ref = reference(impl, batch, kv_cache)
    assert rel_err(out, ref) < REL_ERR[dtype]
    cpu_impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(
        num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS)
    cpu_out = cpu_impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value,
                               kv_cache, batch.meta)
    assert rel_err(out, cpu_out) < 2 * REL_ERR[dtype]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_sliding_window_and_shared_prefix_pages(causal):
    """Requests sharing their first two pages (prefix caching) and a window of 9 keys."""
    gen, kv_cache, impl = _setup(torch.float32, seed=2, sliding_window=9)
    batch = mixed_batch(impl, kv_cache, gen, q_lens=(1, 5, 18), ctx_lens=(40, 33, 32),
                        shared_prefix=2, causal=causal)
    out = impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                       batch.meta)
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]


def test_encoder_only_layers_ignore_the_causal_flag_and_never_write_the_cache():
    gen, kv_cache, impl = _setup(torch.float32, seed=3,
                                 attn_type=kvcore.AttentionType.ENCODER_ONLY)
    kv_cache.normal_(generator=gen)
    before = kv_cache.clone()
    batch = mixed_batch(impl, kv_cache, gen, q_lens=(9, 20), ctx_lens=(0, 0))
    out = impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                       batch.meta)
    assert torch.equal(kv_cache, before)  # encoder-only: no cache write, not even in forward
    # Expected: the same tokens written into a scratch cache by a decoder layer, non-causal.
    writer = FlexAttentionBackend.get_impl_cls()(num_heads=NUM_HEADS, head_size=HEAD_SIZE,
                                                 scale=HEAD_SIZE**-0.5,
                                                 num_kv_heads=NUM_KV_HEADS)
    scratch = torch.zeros_like(kv_cache)
    writer.do_kv_cache_update(kvcore.LayerScales(), batch.key, batch.value, scratch,
                              batch.meta.slot_mapping)
    assert rel_err(out, reference(impl, batch, scratch)) < REL_ERR[torch.float32]


def _mask_builds(monkeypatch) -> list[int | None]:
    """The sliding window of every block mask the impl builds from now on (patched where the
    impl looks it up: another test may have re-imported the module)."""
    namespace = FlexAttentionBackend.get_impl_cls().attend.__globals__
    builds = []
    build = namespace["build_block_mask"]
    monkeypatch.setitem(namespace, "build_block_mask",
                        lambda *a, **k: (builds.append(a[-1]), build(*a, **k))[1])
    return builds


def _windowed(window: int) -> kvcore.AttentionImpl:
    return FlexAttentionBackend.get_impl_cls()(
        num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS, sliding_window=window)


def test_the_block_mask_is_built_once_per_step(monkeypatch):
    builds = _mask_builds(monkeypatch)
    gen, kv_cache, impl = _setup(torch.float32, seed=6)
    windowed = _windowed(5)
    batch = mixed_batch(impl, kv_cache, gen)
    for layer in (impl, impl, windowed, windowed):
        out = layer.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                            batch.meta)
        assert rel_err(out, reference(layer, batch, kv_cache)) < REL_ERR[torch.float32]
    assert builds == [None, 5]
    batch.meta.block_table[0, 0] = batch.meta.block_table[0, 0]  # an in-place write
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                 batch.meta)
    assert builds == [None, 5, None]


def test_the_builders_steps_build_each_layer_kinds_mask_once(monkeypatch):
    """With the builder's metadata, layers alternating a sliding window and none build two
    masks per step (not one per layer); a new step builds them again."""
    builds = _mask_builds(monkeypatch)
    gen, kv_cache, impl = _setup(torch.float32, seed=8)
    windowed = _windowed(5)
    batch = mixed_batch(impl, kv_cache, gen)
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.float32,
                                    num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    builder = FlexAttentionBackend.get_builder_cls()(
        spec, num_heads=NUM_HEADS, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE, device="cpu")
    for _step in range(2):
        meta = builder.build(batch.meta)
        for layer in (impl, windowed, impl, windowed):
            out = layer.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value,
                                kv_cache, meta)
            assert rel_err(out, reference(layer, batch, kv_cache)) < REL_ERR[torch.float32]
    assert builds == [None, 5, None, 5]


def _featured(dtype: torch.dtype, gen: torch.Generator, soft_cap: float | None, sinks: bool,
              sliding_window: int | None) -> kvcore.AttentionImpl:
    """A layer with a soft-cap and/or sinks; sink logits near the rows' log-sum-exp (about
    log of the keys they see), so each takes a visible share of the softmax."""
    return FlexAttentionBackend.get_impl_cls()(
        num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS, sliding_window=sliding_window, logits_soft_cap=soft_cap,
        sinks=(torch.randn(NUM_HEADS, generator=gen) + 3).to(dtype) if sinks else None)


def _feature_reference(impl: kvcore.AttentionImpl, batch, kv_cache: torch.Tensor, *,
                       soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """float64 reference of the batch with the given features (the layer's window)."""
    m = batch.meta
    return paged_attention_ref(
        batch.query.double(), *(c.double() for c in kv_cache.unbind(1)),
        query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table,
        scale=impl.scale, causal=impl.is_causal(m), sliding_window=impl.sliding_window,
        logits_soft_cap=soft_cap, sinks=sinks)


FEATURES = {"softcap": (2.0, False), "sinks": (None, True), "softcap-sinks": (2.0, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 9], ids=["full", "window9"])
@pytest.mark.parametrize("feature", FEATURES)
def test_soft_cap_and_sinks_match_float64_reference(feature, window, dtype):
    """A mixed step (decodes, prefills with and without a cached prefix, GQA 4:1): the soft-cap
    (score_mod) and the sinks (log-sum-exp) against the float64 reference, and the reference
    without the feature is far off (a dropped feature fails)."""
    soft_cap, sinks = FEATURES[feature]
    gen, kv_cache, _ = _setup(dtype, seed=20 + 2 * list(FEATURES).index(feature)
                              + (window is not None))
    impl = _featured(dtype, gen, soft_cap, sinks, window)
    batch = mixed_batch(impl, kv_cache, gen, q_lens=(1, 1, 19, 7, 1),
                        ctx_lens=(37, 15, 16, 0, 60))
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                 batch.meta, output=out)
    ref = _feature_reference(impl, batch, kv_cache, soft_cap=soft_cap, sinks=impl.sinks)
    assert rel_err(out, ref) < REL_ERR[dtype]
    dropped = ([{"soft_cap": None, "sinks": impl.sinks}] if soft_cap else []) + (
        [{"soft_cap": soft_cap, "sinks": None}] if sinks else [])
    for features in dropped:
        other = _feature_reference(impl, batch, kv_cache, **features)
        assert rel_err(other, ref) > 5 * REL_ERR[torch.bfloat16], features


def test_capped_and_sink_layers_share_the_steps_block_mask(monkeypatch):
    """The cap and the sinks leave the mask alone: a step's plain, capped and sink layers
    (two with different sink values) of one window build one block mask."""
    builds = _mask_builds(monkeypatch)
    gen, kv_cache, plain = _setup(torch.float32, seed=30, sliding_window=9)
    layers = [plain, _featured(torch.float32, gen, 2.0, False, 9),
              _featured(torch.float32, gen, None, True, 9),
              _featured(torch.float32, gen, None, True, 9)]
    batch = mixed_batch(plain, kv_cache, gen)
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.float32,
                                    num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    step = FlexAttentionBackend.get_builder_cls()(
        spec, num_heads=NUM_HEADS, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE, device="cpu").build(batch.meta)
    for impl in layers:
        out = impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                           step)
        ref = _feature_reference(impl, batch, kv_cache, soft_cap=impl.logits_soft_cap,
                                 sinks=impl.sinks)
        assert rel_err(out, ref) < REL_ERR[torch.float32]
    assert builds == [9]


@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma-2-9b"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_sink_and_soft_cap_presets_can_select_flex_attention(model, platform, cuda):
    """Every layer kind of gpt-oss (sinks, head 64) and Gemma 2 (soft-cap, head 256) is a
    valid FLEX_ATTENTION configuration, on the CPU and on a simulated H100."""
    if platform == "cuda":
        cuda("9.0")
    for layer in kvcore.get_model(model).layers:
        report = kvcore.explain_selection(layer.selector_config(torch.bfloat16), platform)
        flex = next(c for c in report.candidates if c.name == "FLEX_ATTENTION")
        assert flex.valid, report.format()


@pytest.mark.parametrize(("layout", "page_stride"), [("own", 1), ("nhd", 2)])
def test_block_mask_lists_each_needed_page_once(layout, page_stride):
    """Every (query, key) pair the mask allows lies in a page its query tile lists, and no
    tile lists a page twice (shared prefix pages included): on CPU flex runs densely, so only
    this check covers the block-sparse structure the CUDA kernel follows. On FLEX_ATTENTION's
    own ``B,N,2,H,D`` cache the pages are adjacent (``m = 1``); on an NHD ``B,2,N,H,D`` cache
    the V page of each block lies between two K pages (``m = 2``)."""
    gen, kv_cache, impl = _setup(torch.float32, seed=4)
    if layout == "nhd":
        kv_cache = kv_cache.contiguous()
    # Every request caches at least the shared page: a new token written into it would
    # overwrite the others' context (refused).
    batch = mixed_batch(impl, kv_cache, gen, q_lens=(1, 1, 3, 30, 1),
                        ctx_lens=(60, 16, 20, 17, 16), shared_prefix=1)
    key_cache, value_cache = kv_cache.unbind(1)
    _, _, m = paged_sequence_views(key_cache, value_cache)
    assert m == page_stride
    mask = build_block_mask(batch.meta, NUM_BLOCKS, BLOCK_SIZE, m, causal=True,
                            sliding_window=None)
    n, length = mask.seq_lengths
    dense = create_mask(mask.mask_mod, 1, 1, n, length, device="cpu")[0, 0]
    counts, indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    for tile in range(counts.shape[0]):
        listed = indices[tile, : counts[tile]].tolist()
        assert len(listed) == len(set(listed))
        assert all(b % m == 0 for b in listed)  # only K pages
        rows = dense[tile * Q_TILE:(tile + 1) * Q_TILE]
        needed = set((rows.any(dim=0).nonzero().squeeze(1) // BLOCK_SIZE).tolist())
        assert needed <= set(listed), (tile, needed - set(listed))
    # Each query sees exactly its own request's keys up to its position.
    assert int(dense.sum()) == sum(
        sum(range(ctx + 1, ctx + q + 1)) for q, ctx in zip((1, 1, 3, 30, 1),
                                                           (60, 16, 20, 17, 16), strict=True))


def test_padded_block_mask_adds_rows_that_attend_to_nothing():
    """The compiled path's mask (``pad=True``): whole tiles, at least 128 rows, the rows past
    the batch's tokens keep no key and their tiles list no page; the batch's rows are
    unchanged."""
    gen, kv_cache, impl = _setup(torch.float32, seed=9)
    batch = mixed_batch(impl, kv_cache, gen, q_lens=(1,), ctx_lens=(40,))
    plain = build_block_mask(batch.meta, NUM_BLOCKS, BLOCK_SIZE, 1, True, None)
    padded = build_block_mask(batch.meta, NUM_BLOCKS, BLOCK_SIZE, 1, True, None, pad=True)
    assert [padded_rows(n) for n in (1, 16, 128, 129, 150)] == [128, 128, 128, 144, 160]
    assert padded.seq_lengths == (128, plain.seq_lengths[1])
    assert padded.kv_num_blocks[0, 0].tolist() == [3] + [0] * 7
    dense = create_mask(padded.mask_mod, 1, 1, *padded.seq_lengths, device="cpu")[0, 0]
    assert torch.equal(dense[:1], create_mask(plain.mask_mod, 1, 1, *plain.seq_lengths,
                                              device="cpu")[0, 0])
    assert not dense[1:].any()


def _random_step(gen: torch.Generator, kv_cache: torch.Tensor, num_blocks: int,
                 q_lens: list[int], ctx_lens: list[int]):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    tables = random_block_tables(seq_lens, BLOCK_SIZE, num_blocks, gen)
    meta = kvcore.build_attention_metadata(q_lens, ctx_lens, tables, BLOCK_SIZE)
    k_seq, v_seq, m = paged_sequence_views(*kv_cache[:num_blocks].unbind(1))
    return meta, k_seq, v_seq, build_block_mask(meta, num_blocks, BLOCK_SIZE, m, True, None,
                                                pad=True)


def _graphs(run) -> int:
    """Graphs dynamo holds for one compiled entry point (the cache entries of its code)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(run._torchdynamo_orig_callable.__code__))


def _aot_eager_with_cuda_lowering_guards(gm: torch.fx.GraphModule, example_inputs: list):
    """``aot_eager`` plus the guard inductor's CUDA lowering of flex_attention adds to every
    graph: it asks whether the query has fewer than 128 rows (the condition of its decoding
    kernel) even under ``FORCE_USE_FLEX_ATTENTION``, so a graph with a dynamic row count
    serves only one side of 128. The question is asked here of the same symbolic size."""
    calls = gm.graph.find_nodes(op="call_function",
                                target=torch.ops.higher_order.flex_attention)
    assert calls, gm.graph
    for call in calls:
        bool(call.args[0].meta["example_value"].shape[-2] < 128)
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.slow
@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(),
                    reason="torch.compile is not supported on this Python")
def test_compiled_flex_compiles_a_bounded_number_of_graphs_over_varying_shapes():
    """Batch size, context length, query length (decodes, prefills past 128 tokens, mixed
    steps) and cache size change every step, and so do the sink values: each configuration
    (plain, soft-capped, with sinks, both) stays within three graphs
    (``fail_on_recompile_limit_hit`` raises past them), configurations do not share one
    budget, and sink values never add a graph. Every output against the float64 reference.
    Compiled with ``aot_eager`` and the CUDA lowering's guard on the query rows: dynamo's
    guards are those on CUDA, without inductor's CPU compile time."""
    gen = torch.Generator().manual_seed(10)
    # (blocks, 2, block_size, H, D) in FLEX_ATTENTION's physical B,N,2,H,D order.
    kv_cache = torch.randn(160, BLOCK_SIZE, 2, NUM_KV_HEADS, HEAD_SIZE,
                           generator=gen).transpose(1, 2)
    steps = [([1], [30]), ([1] * 4, [30, 40, 50, 17]), ([5, 1, 1], [0, 90, 3]),
             ([1] * 8, [10] * 8), ([33, 1], [0, 100]), ([150], [0]), ([17, 2], [40, 60]),
             ([1] * 16, [20] * 16), ([1], [3])]
    graphs = {}
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for feature, num_heads in (("plain", NUM_HEADS), ("plain", 2 * NUM_HEADS),
                                   ("softcap", NUM_HEADS), ("sinks", NUM_HEADS),
                                   ("softcap-sinks", 2 * NUM_HEADS)):
            soft_cap, has_sinks = FEATURES.get(feature, (None, False))
            backend = _aot_eager_with_cuda_lowering_guards
            run = compiled_flex(("test", feature, num_heads), backend)
            assert run is compiled_flex(("test", feature, num_heads), backend)
            for i, (q_lens, ctx_lens) in enumerate(steps):
                num_blocks = 160 - 7 * i
                meta, k_seq, v_seq, mask = _random_step(gen, kv_cache, num_blocks, q_lens,
                                                        ctx_lens)
                q = torch.randn(1, num_heads, mask.seq_lengths[0], HEAD_SIZE, generator=gen)
                sinks = torch.randn(num_heads, generator=gen) + 3 if has_sinks else None
                out = run(q, k_seq, v_seq, mask, 0.25, True, {}, soft_cap, sinks)
                n = meta.num_actual_tokens
                ref = paged_attention_ref(
                    q[0, :, :n].transpose(0, 1).double(),
                    *(c.double() for c in kv_cache[:num_blocks].unbind(1)),
                    query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                    block_table=meta.block_table, scale=0.25, logits_soft_cap=soft_cap,
                    sinks=sinks)
                assert rel_err(out[0, :, :n].transpose(0, 1), ref) < REL_ERR[torch.float32], (
                    feature, i)
            graphs[feature, num_heads] = _graphs(run)
    assert set(graphs.values()) == {graphs["plain", NUM_HEADS]}, graphs
    assert graphs["plain", NUM_HEADS] <= 3


def test_sequence_views_address_every_page_of_the_cache():
    _, kv_cache, _ = _setup(torch.float32, seed=5)
    key_cache, value_cache = kv_cache.unbind(1)
    k_seq, v_seq, m = paged_sequence_views(key_cache, value_cache)
    for block in (0, 7, NUM_BLOCKS - 1):
        start = block * m * BLOCK_SIZE
        assert torch.equal(k_seq[0, :, start:start + BLOCK_SIZE].transpose(0, 1), key_cache[block])
        assert torch.equal(v_seq[0, :, start:start + BLOCK_SIZE].transpose(0, 1),
                           value_cache[block])


def test_sequence_views_refuse_pages_no_token_stride_reaches():
    cache = torch.zeros(4, 2, 16, 2, 32)
    odd = cache[:, :, :15]  # 15 of 16 slots: block stride 2048 is not a multiple of 15 * 64
    with pytest.raises(ValueError, match=r"the block stride 2048 is not a multiple of "
                                         r"block_size \* token stride = 960"):
        paged_sequence_views(*odd.unbind(1))


def test_refuses_a_cache_beyond_2_pow_31_elements_before_launching():
    # 2**31 + one block of elements, on the meta device: only shapes and strides are read.
    num_blocks = 2**31 // (2 * 16 * 8 * 128) + 1
    kv_cache = torch.empty(num_blocks, 2, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    impl = FlexAttentionBackend.get_impl_cls()(num_heads=8, head_size=128, scale=1.0)
    meta = kvcore.build_attention_metadata([1], [0], [[0]], 16)
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as err:
        impl.forward(kvcore.LayerScales(), q, q, q, kv_cache, meta)
    assert str(err.value) == (
        "kv_cache spans 2147516416 elements (shape (65537, 2, 16, 8, 128), strides "
        "(32768, 16384, 1024, 128, 1)), over FLEX_ATTENTION's limit of 2**31 elements per "
        "layer: torch's flex_attention kernel computes K/V offsets in int32 (pytorch issue "
        "185262) and would read wrong memory. Allocate fewer blocks per layer "
        "(FlexAttentionBackend.max_num_blocks gives the limit) or use another backend")


def test_size_reasons_state_the_limit_and_the_largest_allowed_cache():
    assert FlexAttentionBackend.MAX_KV_CACHE_SPAN == 2**31
    assert FlexAttentionBackend.max_num_blocks(16, 8, 128) == 65536
    assert FlexAttentionBackend.kv_cache_size_reasons(65536, 16, 8, 128) == []
    assert FlexAttentionBackend.kv_cache_size_reasons(65537, 16, 8, 128) == [
        "num_blocks=65537: one layer's cache would hold 2147516416 elements, over "
        "FLEX_ATTENTION's limit of 2**31 (torch's flex_attention kernel computes K/V offsets "
        "in int32 (pytorch issue 185262)); use at most 65536 blocks per layer at "
        "block_size=16, num_kv_heads=8, head_size=128, or another backend"]


CONFORMANCE = conformance_cases(FlexAttentionBackend, devices=["cpu"])


@pytest.mark.parametrize("case", CONFORMANCE, ids=str)
def test_conforms(case):
    case.run()
