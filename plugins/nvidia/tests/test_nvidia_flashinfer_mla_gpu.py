"""FLASHINFER_MLA on an NVIDIA GPU at DeepSeek sizes (kv_lora_rank 512, rope 64, nope 128,
v 128; 16 and 128 heads; bf16, fp8 cache on Hopper): decode and mixed batches against the
unabsorbed float64 reference, one builder across steps of different shapes, a captured step
replayed like the same step run eagerly, a layer over 2**31 elements, and the cross-layer test
families (latent write, attention and the whole forward on a per-layer view of a cross-layer
pool: bit-exact against a contiguous cache, neighbouring layers untouched) that must pass
before FLASHINFER_MLA may opt in to cross-layer caches.

Skipped without a GPU (the ``gpu`` marker) or without flashinfer-python. kvcore's conformance
suite runs separately: ``pytest --kvcore-backend FLASHINFER_MLA --kvcore-device cuda``.
"""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends import flashinfer_mla
from kvcore_nvidia.backends.flashinfer_mla import FlashInferMLABackend
from nvidia_helpers import fill_layers, rel_err

import kvcore
from kvcore.ops import mla_forward_ref
from kvcore.testing import random_block_tables

_MISSING = FlashInferMLABackend.unavailable_reasons()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(bool(_MISSING), reason="; ".join(_MISSING) or "available")]

RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
ENTRY = RANK + ROPE
#: ||out - ref|| / ||ref|| against float64: the absorbed bf16 path rounds q_latent, the
#: probabilities and o_latent (about 4e-3 each); a wrong kernel is far above.
REL_ERR = 2e-2
DEV = "cuda"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="FlashInfer's fp8 MLA cache needs a "
                                                        "Hopper GPU (capability 9.x)")


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype=torch.bfloat16,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEV)


def _impl(num_heads: int, gen: torch.Generator, kv_cache_dtype: str = "auto",
          scale: float = (NOPE + ROPE) ** -0.5) -> kvcore.MLACommonImpl:
    weight = _randn((num_heads * (NOPE + V_DIM), RANK), gen, scale=RANK**-0.5)
    impl = FlashInferMLABackend.get_impl_cls()(
        num_heads, ENTRY, scale, kv_cache_dtype=kv_cache_dtype, kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        kv_b_proj_weight=weight)
    impl.kv_b_proj_weight = weight  # for the reference
    return impl


def _layer(kv_cache_dtype: str) -> kvcore.LayerScales:
    if kv_cache_dtype == "auto":
        return kvcore.LayerScales()
    return kvcore.LayerScales(k_scale=torch.tensor([0.25], device=DEV),
                              v_scale=torch.tensor([0.25], device=DEV))


def _caches(num_blocks: int, block_size: int, gen: torch.Generator, kv_cache_dtype="auto",
            num_layers: int = 1, cross_layer: bool = False) -> kvcore.KVCaches:
    # A cross-layer pool takes CPU_MLA's layout (the same logical shape, blocks outermost), so
    # the check does not depend on FLASHINFER_MLA's own opt-in, which it is the evidence for.
    caches = kvcore.allocate_kv_caches(
        "CPU_MLA" if cross_layer else FlashInferMLABackend, num_layers=num_layers,
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_size=ENTRY,
        dtype=torch.bfloat16, device=DEV, cross_layer=cross_layer,
        kv_cache_dtype=kv_cache_dtype)
    assert caches.is_cross_layer == cross_layer
    fill_layers(caches, gen)  # the same values per layer whatever the physical order
    return caches


class Step:
    """Requests with cached histories written into a cache, and this step's queries."""

    def __init__(self, impl, layer, cache: torch.Tensor, query_lens: list[int],
                 context_lens: list[int], gen: torch.Generator, write: bool = True) -> None:
        block_size = cache.shape[1]
        lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        self.tables = random_block_tables(lens, block_size, cache.shape[0], gen)
        if write:  # every token of every request, as the earlier steps would have
            history = kvcore.build_attention_metadata(lens, [0] * len(lens), self.tables,
                                                      block_size, device=DEV)
            n = history.num_actual_tokens
            impl.do_kv_cache_update(layer, _randn((n, RANK), gen), _randn((n, ROPE), gen),
                                    cache, history.slot_mapping)
        self.meta = kvcore.build_attention_metadata(query_lens, context_lens, self.tables,
                                                    block_size, device=DEV)
        self.query = _randn((self.meta.num_actual_tokens, impl.num_heads, NOPE + ROPE), gen)

    def reference(self, impl, layer, cache: torch.Tensor) -> torch.Tensor:
        m = self.meta
        return mla_forward_ref(
            self.query.double(), cache, impl.kv_b_proj_weight, kv_lora_rank=RANK,
            qk_nope_head_dim=NOPE, v_head_dim=V_DIM,
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table,
            scale=impl.scale, kv_cache_dtype=impl.kv_cache_dtype, k_scale=layer.k_scale)


def _forward(impl, layer, step: Step, cache: torch.Tensor, meta=None) -> torch.Tensor:
    out = torch.full((step.query.shape[0], impl.num_heads, V_DIM), float("nan"),
                     dtype=torch.bfloat16, device=DEV)
    impl.forward(layer, step.query, None, None, cache, step.meta if meta is None else meta,
                 output=out)
    return out


def _builder(num_heads: int, block_size: int, kv_cache_dtype: str = "auto",
             max_num_seqs: int = 64, max_model_len: int = 8192):
    spec = kvcore.MLAAttentionSpec(block_size=block_size, dtype=torch.bfloat16,
                                   kv_cache_dtype=kv_cache_dtype)
    return FlashInferMLABackend.get_builder_cls()(
        spec, num_heads=num_heads, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
        max_model_len=max_model_len, device=DEV)


MIXED = dict(query_lens=[1, 1, 300, 257, 1], context_lens=[1000, 15, 64, 0, 4095])
DECODE = dict(query_lens=[1] * 48, context_lens=list(range(40, 48 * 97, 97)))


@pytest.mark.parametrize(("num_heads", "shape", "block_size", "kv_cache_dtype"), [
    (16, "decode", 64, "auto"), (16, "mixed", 64, "auto"),
    (128, "decode", 64, "auto"), (128, "mixed", 64, "auto"),
    (128, "mixed", 16, "auto"), (128, "mixed", 32, "auto"),
    pytest.param(16, "decode", 64, "fp8", marks=needs_hopper),
    pytest.param(128, "mixed", 64, "fp8", marks=needs_hopper),
], ids=lambda v: str(v))
def test_forward_matches_the_float64_reference(num_heads, shape, block_size, kv_cache_dtype):
    """With plain metadata (planned on the first layer) and with the builder's."""
    gen = _gen("ref", num_heads, shape, block_size, kv_cache_dtype)
    impl = _impl(num_heads, gen, kv_cache_dtype)
    layer = _layer(kv_cache_dtype)
    cache = _caches(8192 * 64 // block_size, block_size, gen, kv_cache_dtype).layers[0]
    step = Step(impl, layer, cache, gen=gen, **(MIXED if shape == "mixed" else DECODE))
    ref = step.reference(impl, layer, cache)
    plain = _forward(impl, layer, step, cache)
    assert rel_err(plain, ref) < REL_ERR
    built = _forward(impl, layer, step, cache,
                     _builder(num_heads, block_size, kv_cache_dtype).build(step.meta))
    assert rel_err(built, ref) < REL_ERR


def test_one_builder_serves_steps_of_different_shapes_without_planning_in_forward(monkeypatch):
    gen = _gen("builder")
    impl = _impl(128, gen)
    layer = _layer("auto")
    cache = _caches(8192, 64, gen).layers[0]
    builder = _builder(128, 64)
    monkeypatch.setattr(flashinfer_mla, "_PLANS", None)  # forward must not plan
    shapes = [MIXED, DECODE, dict(query_lens=[1, 1, 1], context_lens=[5, 700, 63]), MIXED]
    for i, shape in enumerate(shapes):
        step = Step(impl, layer, cache, gen=gen, **shape)
        out = _forward(impl, layer, step, cache, builder.build(step.meta))
        assert rel_err(out, step.reference(impl, layer, cache)) < REL_ERR, f"step {i}"


def test_a_layer_the_step_was_not_planned_for_is_refused():
    gen = _gen("refuse")
    cache = _caches(512, 64, gen).layers[0]
    impl16 = _impl(16, gen)
    step = Step(impl16, _layer("auto"), cache, gen=gen, query_lens=[1, 4],
                context_lens=[30, 70])
    meta = _builder(16, 64).build(step.meta)
    impl128 = _impl(128, gen)
    query = _randn((step.meta.num_actual_tokens, 128, NOPE + ROPE), gen)
    with pytest.raises(ValueError, match="this layer runs 128 heads, .* but the step was "
                                         "planned by FlashInferMLAMetadataBuilder for 16 heads"):
        impl128.forward(_layer("auto"), query, None, None, cache, meta)


@pytest.mark.parametrize("num_heads", [16, 128])
def test_a_captured_step_replays_like_the_same_step_run_eagerly(num_heads):
    """Two layers with different softmax scales, captured for 4 and 8 requests; later steps
    of other lengths and tables replay bit-exactly like the same padded step run eagerly, and
    match the reference."""
    gen = _gen("graph", num_heads)
    num_blocks, block_size = 1024, 64
    caches = _caches(num_blocks, block_size, gen, num_layers=2)
    impls = [_impl(num_heads, gen, scale=s) for s in ((NOPE + ROPE) ** -0.5, 0.11)]
    layer = _layer("auto")
    builder = _builder(num_heads, block_size, max_num_seqs=8, max_model_len=4096)

    def step_fn(inputs, meta):
        outs = []
        for impl, cache in zip(impls, caches.layers, strict=True):
            impl.do_kv_cache_update(layer, inputs["kv_c"], inputs["k_pe"], cache,
                                    meta.slot_mapping)
            outs.append(impl.forward(layer, inputs["query"], None, None, cache, meta))
        return torch.stack(outs, dim=1)

    runner = kvcore.CudaGraphRunner(builder, step_fn, num_blocks=num_blocks, batch_sizes=[4, 8])
    runner.capture({"query": torch.zeros(1, num_heads, NOPE + ROPE, dtype=torch.bfloat16,
                                         device=DEV),
                    "kv_c": torch.zeros(1, RANK, dtype=torch.bfloat16, device=DEV),
                    "k_pe": torch.zeros(1, ROPE, dtype=torch.bfloat16, device=DEV)})
    for context_lens in ([3000, 1, 64, 127, 2, 900, 63, 4000], [200, 5, 4095]):
        n = len(context_lens)
        step = Step(impls[0], layer, caches.layers[0], [1] * n, context_lens, gen, write=False)
        for cache in caches.layers:  # histories (the new token is written by the step)
            hist = kvcore.build_attention_metadata(context_lens, [0] * n, step.tables,
                                                   block_size, device=DEV)
            impls[0].do_kv_cache_update(layer, _randn((hist.num_actual_tokens, RANK), gen),
                                        _randn((hist.num_actual_tokens, ROPE), gen), cache,
                                        hist.slot_mapping)
        inputs = {"query": step.query, "kv_c": _randn((n, RANK), gen),
                  "k_pe": _randn((n, ROPE), gen)}
        before = runner.replayed_steps
        replayed = runner.run(inputs, step.meta).clone()
        assert runner.replayed_steps == before + 1
        size = runner.graph_size(step.meta)
        padded = {k: torch.cat([v, v.new_zeros((size - n, *v.shape[1:]))])
                  for k, v in inputs.items()}
        eager = step_fn(padded, builder.build(step.meta, graph_batch_size=size))[:n]
        assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16))
        for i, (impl, cache) in enumerate(zip(impls, caches.layers, strict=True)):
            assert rel_err(replayed[:, i], step.reference(impl, layer, cache)) < REL_ERR


def test_a_layer_beyond_2_pow_31_elements_reads_the_right_pages():
    """Requests in the last blocks of a 4.3 GB layer: exactly what the same pages give as a
    small cache (the same page lists, renumbered, so the same plan)."""
    gen = _gen("int64")
    block_size = 64
    num_blocks = 2**31 // (block_size * ENTRY) + 64
    cache = torch.zeros(num_blocks, block_size, ENTRY, dtype=torch.bfloat16, device=DEV)
    impl = _impl(16, gen)
    layer = _layer("auto")
    tables = [[num_blocks - 1, num_blocks - 3], [num_blocks - 2, 5, num_blocks - 60]]
    used = sorted({b for t in tables for b in t})
    cache[used] = _randn((len(used), block_size, ENTRY), gen)
    meta = kvcore.build_attention_metadata([20, 1], [70, 150], tables, block_size, device=DEV)
    assert max(used) * cache.stride(0) > 2**31
    query = _randn((meta.num_actual_tokens, 16, NOPE + ROPE), gen)
    out = impl.forward(layer, query, None, None, cache, meta)
    renumber = {b: i for i, b in enumerate(used)}
    small = cache[used].clone()
    small_meta = kvcore.build_attention_metadata(
        [20, 1], [70, 150], [[renumber[b] for b in t] for t in tables], block_size, device=DEV)
    assert torch.equal(out, impl.forward(layer, query, None, None, small, small_meta))


# -- cross-layer: the evidence FLASHINFER_MLA's opt-in would rest on -----------------------

NUM_LAYERS, LAYER = 3, 1


def _pool(num_blocks: int, block_size: int, gen: torch.Generator,
          dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(num_blocks, 3, block_size, 576)`` pool and its middle-layer view."""
    pool = torch.randn(num_blocks, NUM_LAYERS, block_size, ENTRY, generator=gen).to(dtype)
    pool = pool.to(DEV)
    return pool, pool[:, LAYER]


def _others(pool: torch.Tensor) -> torch.Tensor:
    return pool[:, [i for i in range(NUM_LAYERS) if i != LAYER]].clone().view(torch.uint8)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_latent_write_into_the_middle_layer_equals_contiguous(kv_cache_dtype):
    gen = _gen("xl-write", kv_cache_dtype)
    impl = _impl(16, gen, kv_cache_dtype)
    layer = _layer(kv_cache_dtype)
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    num_blocks, block_size, tokens = 64, 64, 3000
    kv_c, k_pe = _randn((tokens, RANK), gen), _randn((tokens, 1, ROPE), gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEV)
    contiguous = torch.zeros(num_blocks, block_size, ENTRY, dtype=cache_dtype, device=DEV)
    impl.do_kv_cache_update(layer, kv_c, k_pe, contiguous, slots)
    pool, view = _pool(num_blocks, block_size, gen, cache_dtype)
    view.zero_()
    neighbours = _others(pool)
    impl.do_kv_cache_update(layer, kv_c, k_pe, view, slots)
    assert torch.equal(view.view(torch.uint8), contiguous.view(torch.uint8))
    assert torch.equal(_others(pool), neighbours)
    expected = torch.zeros_like(contiguous)
    kvcore.ops.concat_and_cache_mla_ref(kv_c, k_pe, expected, slots, kv_cache_dtype,
                                        layer.k_scale)
    assert torch.equal(contiguous.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(("num_heads", "shape"), [(16, "decode"), (16, "mixed"),
                                                  (128, "decode"), (128, "mixed")])
def test_attention_on_a_cross_layer_view_equals_contiguous(num_heads, shape):
    gen = _gen("xl-attn", num_heads, shape)
    impl = _impl(num_heads, gen)
    layer = _layer("auto")
    pool, view = _pool(4096, 64, gen)
    neighbours = _others(pool)
    step = Step(impl, layer, view, gen=gen, write=False,
                **(MIXED if shape == "mixed" else DECODE))
    contiguous = view.contiguous()
    assert view.stride(0) == NUM_LAYERS * contiguous.stride(0)
    builder = _builder(num_heads, 64)
    out_view = _forward(impl, layer, step, view, builder.build(step.meta))
    out_plain = _forward(impl, layer, step, contiguous, builder.build(step.meta))
    assert torch.equal(out_view, out_plain)
    assert torch.equal(_others(pool), neighbours)


def test_forward_on_a_cross_layer_allocation_equals_layers_outermost():
    """Write + forward on layer 1 of a cross-layer allocation and of a per-layer one with
    the same history: the same cache bytes after the write and the same output bit for bit,
    the other layers untouched.

    Both allocations are filled layer by layer (:func:`nvidia_helpers.fill_layers`): filled
    through ``caches.storage`` they would hold different histories (the physical orders
    differ) and the comparison would fail where the view-based tests pass;
    ``test_nvidia_flashinfer_mla.py`` runs the same comparison on the CPU."""
    gen = _gen("xl-forward")
    impl = _impl(128, gen)
    layer = _layer("auto")
    lens, query_lens = [700, 64, 1], [9, 1, 1]
    tables = random_block_tables(lens, 64, 32, gen)
    context_lens = [n - q for n, q in zip(lens, query_lens, strict=True)]
    meta = kvcore.build_attention_metadata(query_lens, context_lens, tables, 64, device=DEV)
    tokens = meta.num_actual_tokens
    kv_c, k_pe = _randn((tokens, RANK), gen), _randn((tokens, ROPE), gen)
    query = _randn((tokens, 128, NOPE + ROPE), gen)
    outputs, written = [], []
    for cross_layer in (True, False):
        caches = _caches(32, 64, _gen("history"), num_layers=NUM_LAYERS, cross_layer=cross_layer)
        before = [caches.layers[i].clone() for i in range(NUM_LAYERS) if i != LAYER]
        impl.do_kv_cache_update(layer, kv_c, k_pe, caches.layers[LAYER], meta.slot_mapping)
        written.append(caches.layers[LAYER].clone())
        outputs.append(impl.forward(layer, query, None, None, caches.layers[LAYER],
                                    _builder(128, 64).build(meta)))
        after = [caches.layers[i] for i in range(NUM_LAYERS) if i != LAYER]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(written[0], written[1])  # layer 1 holds the same bytes in both
    assert torch.equal(outputs[0], outputs[1])
