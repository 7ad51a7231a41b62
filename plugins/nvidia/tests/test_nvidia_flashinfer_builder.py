"""FLASHINFER's builder on CPU, against a stand-in for FlashInfer's wrappers: kernel choice,
host-side page lists, mixed batches split into decode and prefill parts, CUDA-graph decode
wrappers whose plan is skipped while the page counts stay, warmup.

The stand-in keeps FlashInfer's documented contract: an eager wrapper keeps the page lists
``plan`` was given (device tensors by reference, as ``.to(device)`` of a device tensor is the
tensor itself); a CUDA-graph wrapper copies them into the buffers it was made with and reads
those at ``run``; a plan fixes the work split, which depends on the page counts per request,
so a ``run`` whose buffers hold other page counts than the plan's is an error.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from kvcore_nvidia.backends import flashinfer as fi_backend
from kvcore_nvidia.backends.flashinfer import FlashInferBackend
from kvcore_nvidia.backends.flashinfer_builder import (
    MAX_EAGER_DECODE_WRAPPERS,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from kvcore_nvidia.backends.flashinfer_kernels import FlashInferKernels, flashinfer_kernels
from kvcore_nvidia.backends.flashinfer_pages import HostPages
from nvidia_helpers import REL_ERR, mixed_batch, plan_lists, reference, rel_err

import kvcore
from kvcore.testing import contiguous_attention_ref

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 8, 2, 32, 16, 40


class _Wrapper:
    """FlashInfer's paged wrappers as documented (see the module docstring)."""

    made: list[_Wrapper] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **kwargs: object) -> None:
        assert kv_layout == "NHD"
        self.kwargs = kwargs
        self.decode = "use_tensor_cores" in kwargs
        self.graph = bool(kwargs.get("use_cuda_graph"))
        self.plans = 0
        self.lists: dict[str, object] = {}
        _Wrapper.made.append(self)

    def plan(self, *args: object, **kwargs: object) -> None:
        qo, indptr, indices, last, page = plan_lists(self.decode, args, kwargs)
        assert not any(t.device.type == "cuda" for t in (qo, indptr, last)), \
            "host lists are planned on the host"
        if self.graph:
            k = self.kwargs
            assert indptr.numel() == k["paged_kv_indptr_buffer"].numel()
            k["paged_kv_indptr_buffer"].copy_(indptr)
            k["paged_kv_last_page_len_buffer"].copy_(last)
            k["paged_kv_indices_buffer"][:indices.numel()].copy_(indices)
            indptr, last = k["paged_kv_indptr_buffer"], k["paged_kv_last_page_len_buffer"]
            indices = k["paged_kv_indices_buffer"]
        self.lists = dict(qo=qo.clone(), indptr=indptr, indices=indices, last=last, page=page,
                          planned_pages=(indptr[1:] - indptr[:-1]).clone(), **kwargs)
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor, k_scale: float | None = None,
            v_scale: float | None = None) -> torch.Tensor:
        # FlashInfer's contract: the cache's dtype is the planned kv_data_type; k_scale
        # multiplies the softmax scale and v_scale the output, host floats both.
        k_cache, v_cache = paged_kv_cache
        p = self.lists
        assert k_cache.dtype == p["kv_data_type"] and q.dtype == p["q_data_type"]
        assert all(s is None or type(s) is float for s in (k_scale, v_scale))
        indptr = p["indptr"]
        assert torch.equal(indptr[1:] - indptr[:-1], p["planned_pages"]), \
            "run on page counts the plan was not made for"
        assert q.shape[0] == int(p["qo"][-1]) and out.shape == q.shape
        for b in range(indptr.numel() - 1):
            pages = p["indices"][indptr[b]:indptr[b + 1]].long()
            s_k = (pages.numel() - 1) * p["page"] + int(p["last"][b]) if pages.numel() else 0
            rows = slice(int(p["qo"][b]), int(p["qo"][b + 1]))
            s_q = rows.stop - rows.start
            k = k_cache[pages].flatten(0, 1)[:s_k].to(q.dtype)
            v = v_cache[pages].flatten(0, 1)[:s_k].to(q.dtype)
            qi = torch.arange(s_q)[:, None] + s_k - s_q
            allowed = torch.ones(s_q, s_k, dtype=torch.bool)
            if p["causal"]:
                allowed &= torch.arange(s_k)[None, :] <= qi
            if p.get("window_left", -1) >= 0:  # the query and window_left keys before it
                allowed &= torch.arange(s_k)[None, :] >= qi - p["window_left"]
            sm_scale = p["sm_scale"] * (1.0 if k_scale is None else k_scale)
            out[rows] = contiguous_attention_ref(
                q[rows], k, v, sm_scale, allowed=allowed,
                logits_soft_cap=p.get("logits_soft_cap")).to(out.dtype)
        if v_scale is not None and v_scale != 1.0:
            out *= v_scale
        return out


@pytest.fixture(autouse=True)
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper,
                                   BatchDecodeWithPagedKVCacheWrapper=_Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    _Wrapper.made = []
    fi_backend._wrappers.cache_clear()
    yield
    fi_backend._wrappers.cache_clear()


def _builder(max_num_seqs: int = 8, sliding_window: int | None = None,
             **kwargs: object) -> FlashInferMetadataBuilder:
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.float32,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                    sliding_window=sliding_window)
    return FlashInferBackend.get_builder_cls()(
        spec, num_heads=HEADS, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
        max_model_len=512, device="cpu", **kwargs)


def _impl(**kwargs: object) -> kvcore.AttentionImpl:
    return FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE,
                                            scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS,
                                            **kwargs)


def _cache(seed: int) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen), gen


def _forward(impl, batch, kv_cache, meta) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache, meta,
                 output=out)
    return out


@pytest.mark.parametrize(("capability", "heads", "expected"), [
    ((9, 0), (32, 8), FlashInferKernels("fa3", True)),
    ((8, 0), (32, 8), FlashInferKernels("fa2", True)),
    ((8, 9), (32, 16), FlashInferKernels("fa2", True)),
    ((8, 9), (32, 32), FlashInferKernels("fa2", False)),
    ((10, 0), (32, 8), FlashInferKernels("fa2", True)),
    ((12, 0), (8, 8), FlashInferKernels("fa2", False)),
    (None, (32, 8), FlashInferKernels("fa2", True)),
], ids=["hopper", "ampere", "ada-gqa2", "ada-mha", "blackwell", "blackwell-mha", "no-gpu"])
def test_kernels_per_gpu_and_phase(capability, heads, expected):
    assert flashinfer_kernels(capability, *heads) == expected


def test_mha_decode_with_a_window_or_an_fp8_cache_runs_on_tensor_cores():
    """FlashInfer's CUDA-core decode kernel reads the pages a window excludes and converts
    fp8 slowly: a layer with either decodes on tensor cores, whatever its group."""
    assert not flashinfer_kernels((9, 0), 8, 8).decode_tensor_cores
    assert flashinfer_kernels((9, 0), 8, 8, sliding_window=4096).decode_tensor_cores
    assert flashinfer_kernels((9, 0), 8, 8, torch.float8_e4m3fn).decode_tensor_cores


def test_a_builder_that_learns_a_window_decodes_on_the_window_s_kernel():
    """An MHA builder made without a window (CUDA-core decode) that learns one from its first
    layer makes its wrappers again for tensor-core decode, before anything is captured."""
    kv_cache, gen = _cache(14)
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.float32,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)
    builder = FlashInferBackend.get_builder_cls()(
        spec, num_heads=KV_HEADS, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=512, device="cpu")
    assert not builder.kernels.decode_tensor_cores
    impl = FlashInferBackend.get_impl_cls()(num_heads=KV_HEADS, head_size=HEAD_SIZE,
                                            scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS,
                                            sliding_window=20)
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES["decode-only"])
    meta = builder.build(batch.meta)
    assert "use_tensor_cores" in meta.decode_wrapper.kwargs
    assert not meta.decode_wrapper.kwargs["use_tensor_cores"]
    out = _forward(impl, batch, kv_cache, meta)
    assert builder.kernels.decode_tensor_cores and builder.sliding_window == 20
    assert meta.decode_wrapper.kwargs["use_tensor_cores"]
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]


SHAPES = {
    # decodes first, then prefills with and without a cached prefix: split in two
    "mixed-decodes-first": dict(q_lens=(1, 1, 19, 7, 0), ctx_lens=(37, 15, 16, 0, 5)),
    # a decode after a prefill: only the leading decode goes to the decode kernel
    "mixed-decode-after-prefill": dict(q_lens=(1, 19, 1, 7), ctx_lens=(37, 16, 40, 0)),
    "prefill-only": dict(q_lens=(19, 7), ctx_lens=(16, 0)),
    "decode-only": dict(q_lens=(1, 1, 1), ctx_lens=(37, 15, 0)),
    # requests without new tokens after the decodes: nothing for the prefill kernel
    "decodes-then-idle": dict(q_lens=(1, 1, 0), ctx_lens=(37, 15, 5)),
}
SPLITS = {"mixed-decodes-first": 2, "mixed-decode-after-prefill": 1, "prefill-only": 0,
          "decode-only": 3, "decodes-then-idle": 2}
HAS_PREFILL = {"mixed-decodes-first", "mixed-decode-after-prefill", "prefill-only"}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_builder_splits_the_batch_and_matches_the_reference(shape, causal):
    kv_cache, gen = _cache(1)
    impl = _impl()
    batch = mixed_batch(impl, kv_cache, gen, causal=causal, **SHAPES[shape])
    meta = _builder().build(batch.meta)
    k = SPLITS[shape]
    assert meta.num_decodes == k
    assert (meta.decode_wrapper is not None) == (k > 0)
    assert (meta.prefill_wrapper is not None) == (shape in HAS_PREFILL)
    if meta.decode_wrapper is not None:
        assert meta.decode_wrapper.lists["indptr"].numel() == k + 1
    assert rel_err(_forward(impl, batch, kv_cache, meta),
                   reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]


def test_builder_reads_the_lengths_back_when_the_metadata_has_no_host_copies():
    kv_cache, gen = _cache(2)
    impl = _impl()
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES["mixed-decodes-first"])
    plain = dataclasses.replace(batch.meta, query_start_loc_cpu=None, seq_lens_cpu=None)
    out = _forward(impl, batch, kv_cache, _builder().build(plain))
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]
    wrong = dataclasses.replace(batch.meta, seq_lens_cpu=batch.meta.seq_lens_cpu[:-1])
    with pytest.raises(ValueError, match="seq_lens_cpu .* must have the shapes"):
        _builder().build(wrong)


def test_build_attention_metadata_carries_host_copies():
    meta = kvcore.build_attention_metadata([1, 3], [16, 0], [[7, 2], [4]], 16)
    assert torch.equal(meta.query_start_loc_cpu, meta.query_start_loc)
    assert torch.equal(meta.seq_lens_cpu, meta.seq_lens)
    assert meta.seq_lens_cpu.device.type == "cpu"


def test_host_pages_of_a_mixed_batch():
    pages = HostPages.of(torch.tensor([0, 1, 4, 4, 6]), torch.tensor([17, 33, 0, 2]), 16)
    assert pages.indptr.tolist() == [0, 2, 5, 5, 6]
    assert pages.last_page_len.tolist() == [1, 1, 0, 2]
    assert pages.leading_decodes() == 1
    tail = pages.tail(1)
    assert tail.qo_indptr.tolist() == [0, 3, 3, 5]
    assert tail.indptr.tolist() == [0, 3, 3, 4]


def _decode_step(tables, lengths):
    n = len(lengths)
    return kvcore.build_attention_metadata([1] * n, [x - 1 for x in lengths], tables,
                                           BLOCK_SIZE)


def test_graph_decode_plans_only_when_the_page_counts_change():
    """Steps built for one captured size: the wrapper, its buffers and the metadata's tensors
    stay; the plan is skipped while every request keeps its page count, and the output is
    right in every step (the stand-in reads the buffers, as a replay does)."""
    kv_cache, gen = _cache(3)
    impl, builder = _impl(), _builder()
    tables = [[3, 9, 4], [11, 12, 13], [20, 21, 22]]
    steps = [[17, 29], [18, 30], [19, 31], [20, 32],  # same pages (2, 2): plan once
             [33, 32],                                # request 0 enters page 3: plan
             [34, 33, 5]]                             # a third request (padding changes)
    expected_plans = [1, 1, 1, 1, 2, 3]
    wrappers, pointers, launches = set(), set(), []
    for lengths, plans in zip(steps, expected_plans, strict=True):
        common = _decode_step(tables[:len(lengths)], lengths)
        meta = builder.build(common, graph_batch_size=4)
        assert isinstance(meta, FlashInferMetadata) and meta.prefill_wrapper is None
        wrappers.add(id(meta.decode_wrapper))
        pointers.add(tuple(t.data_ptr() for t in (meta.seq_lens, meta.block_table)))
        launches.append(meta.launch)
        assert builder.plans == plans
        n = len(lengths)
        q = torch.randn(4, HEADS, HEAD_SIZE, generator=gen)
        out = torch.full_like(q, float("nan"))
        impl.forward(kvcore.LayerScales(), q, q[:, :KV_HEADS], q[:, :KV_HEADS], kv_cache, meta,
                     output=out)
        ref = kvcore.ops.paged_attention_ref(
            q[:n].double(), *(c.double() for c in kv_cache.unbind(1)),
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
            block_table=common.block_table, scale=impl.scale)
        assert rel_err(out[:n], ref) < REL_ERR[torch.float32]
    assert len(wrappers) == 1 and len(pointers) == 1
    # What a forward reads on the host is frozen into a captured graph: it must not follow the
    # steps' block tables (their largest block id differs from step to step).
    assert all(launch == launches[0] for launch in launches)


def test_builder_reused_across_steps_of_different_shapes():
    kv_cache, _ = _cache(4)
    impl, builder = _impl(), _builder()
    for seed, shape in enumerate(["decode-only", "mixed-decodes-first", "prefill-only",
                                  "mixed-decode-after-prefill", "decode-only"]):
        batch = mixed_batch(impl, kv_cache, torch.Generator().manual_seed(seed),
                            **SHAPES[shape])
        out = _forward(impl, batch, kv_cache, builder.build(batch.meta))
        assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32], shape


def test_warmup_builds_each_phase_once():
    builder = _builder()
    seconds = builder.warmup()
    assert set(seconds) == {"decode", "prefill"}
    assert all(s >= 0 for s in seconds.values())
    assert builder.plans == 2


def test_default_builder_warmup_does_nothing():
    spec = kvcore.FullAttentionSpec(block_size=16, dtype=torch.float32, num_kv_heads=2,
                                    head_size=32)
    builder = kvcore.AttentionMetadataBuilder(spec, num_heads=8, max_num_seqs=4,
                                              max_num_batched_tokens=64, max_model_len=64,
                                              device="cpu")
    assert builder.warmup() == {}


def test_eager_decode_plans_only_when_the_page_counts_change():
    """Eager decode-only steps run on a graph-mode wrapper of their size: the plan is skipped
    while every request keeps its page count; at most MAX_EAGER_DECODE_WRAPPERS sizes keep
    one (least recently used dropped), never dropping a size a graph step was built for."""
    kv_cache, gen = _cache(5)
    impl, builder = _impl(), _builder()
    tables = [[3, 9, 4], [11, 12, 13], [20, 21, 22]]
    for lengths, plans in [([17, 29], 1), ([18, 30], 1), ([19, 31], 1), ([33, 32], 2)]:
        common = _decode_step(tables[:2], lengths)
        meta = builder.build(common)
        assert builder.plans == plans and meta.num_decodes == 2
        q = torch.randn(2, HEADS, HEAD_SIZE, generator=gen)
        out = torch.full_like(q, float("nan"))
        impl.forward(kvcore.LayerScales(), q, q[:, :KV_HEADS], q[:, :KV_HEADS], kv_cache, meta,
                     output=out)
        ref = kvcore.ops.paged_attention_ref(
            q.double(), *(c.double() for c in kv_cache.unbind(1)),
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
            block_table=common.block_table, scale=impl.scale)
        assert rel_err(out, ref) < REL_ERR[torch.float32]
    graph_wrapper = builder.build(_decode_step(tables[:1], [5]), graph_batch_size=1).decode_wrapper
    cap = MAX_EAGER_DECODE_WRAPPERS
    for n in range(1, cap + 3):  # size 1 is a graph size: kept; sizes 2.. cycle through
        builder.build(_decode_step([[i] for i in range(n)], [3] * n))
    assert builder._graph_wrappers[1] is graph_wrapper
    assert sorted(builder._eager_sizes) == list(range(3, cap + 3))  # the last cap sizes
    assert set(builder._graph_wrappers) == {1, *builder._eager_sizes}


def test_layers_after_the_first_skip_the_full_checks(monkeypatch):
    """With the builder's metadata a layer checks its cache fully once per kind of plan (a
    decode-only step's, a step with prefills); later steps and layers run the step's launch
    straight away, and a layer whose call differs (another cache, a cache planned for other
    heads) is checked in full again."""
    from kvcore_nvidia.backends import common

    calls = []
    real = common.validate_paged_attention
    monkeypatch.setattr(common, "validate_paged_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    kv_cache, _ = _cache(6)
    impl, builder = _impl(), _builder()
    for seed, shape in enumerate(["decode-only", "mixed-decodes-first", "prefill-only",
                                  "decode-only"]):
        batch = mixed_batch(impl, kv_cache, torch.Generator().manual_seed(seed),
                            **SHAPES[shape])
        meta = builder.build(batch.meta)
        ref = reference(impl, batch, kv_cache)
        for _ in range(3):  # three layers on the same cache
            assert rel_err(_forward(impl, batch, kv_cache, meta), ref) < REL_ERR[torch.float32]
    assert len(calls) == 2
    other = kv_cache.clone()
    _forward(impl, batch, other, meta)
    assert len(calls) == 3
    wide = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 2 * KV_HEADS, HEAD_SIZE)
    wide_impl = FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE,
                                                 scale=HEAD_SIZE**-0.5, num_kv_heads=2 * KV_HEADS)
    with pytest.raises(ValueError, match="planned by FlashInferMetadataBuilder for 8 query "
                                         "heads, blocks of 16 tokens, 2 K/V heads"):
        _forward(wide_impl, batch, wide, meta)



@pytest.mark.parametrize("built", [True, False], ids=["builder", "plain-metadata"])
@pytest.mark.parametrize("shape", ["mixed-decodes-first", "decode-only", "prefill-only"])
def test_update_and_forward_writes_and_attends_as_the_two_calls(monkeypatch, shape, built):
    """The fused call gives the cache and the output of do_kv_cache_update then forward, on a
    layer's first step (full checks) and on later ones (the step's launch right after the
    write, checked once), with padding rows past the step's tokens left untouched; a layer
    the plan does not fit gets the two calls' error."""
    from kvcore_nvidia.backends import common

    checks = []
    real = common.validate_paged_attention
    monkeypatch.setattr(common, "validate_paged_attention",
                        lambda *a, **k: checks.append(1) or real(*a, **k))
    kv_cache, gen = _cache(16)
    impl = _impl()
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES[shape])
    meta = _builder().build(batch.meta) if built else batch.meta
    n = batch.query.shape[0]
    query = torch.cat([batch.query, torch.randn(3, HEADS, HEAD_SIZE, generator=gen)])
    new_k, new_v = (torch.randn_like(batch.key) for _ in range(2))  # overwrite the step's
    fused, split = _impl(), _impl()
    if built:  # one call: the two are not called
        fused.forward = fused.do_kv_cache_update = lambda *a, **k: pytest.fail("called")
    caches = {fused: kv_cache.clone(), split: kv_cache.clone()}
    for _ in range(3):
        outs = {}
        for layer, cache in caches.items():
            out = outs[layer] = torch.full_like(query, float("nan"))
            if layer is fused:
                got = layer.update_and_forward(kvcore.LayerScales(), query, new_k, new_v, cache,
                                               meta, output=out)
                assert got is out
            else:
                layer.do_kv_cache_update(kvcore.LayerScales(), new_k, new_v, cache,
                                         meta.slot_mapping)
                layer.forward(kvcore.LayerScales(), query, new_k, new_v, cache, meta,
                              output=out)
        assert torch.equal(caches[fused], caches[split])
        assert not torch.equal(caches[fused], kv_cache)  # the new K/V were written
        assert torch.equal(outs[fused][:n], outs[split][:n])
        assert outs[fused][n:].isnan().all()
    assert len(checks) == (2 if built else 6)  # once per layer after the builder's step
    if not built:
        return
    wide = FlashInferBackend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE,
                                            scale=HEAD_SIZE**-0.5, num_kv_heads=2 * KV_HEADS)
    cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 2 * KV_HEADS, HEAD_SIZE)
    k = torch.zeros(n, 2 * KV_HEADS, HEAD_SIZE)
    errors = []
    for call in (lambda: wide.update_and_forward(kvcore.LayerScales(), query, k, k, cache, meta,
                                                 output=torch.empty_like(query)),
                 lambda: (wide.do_kv_cache_update(kvcore.LayerScales(), k, k, cache,
                                                  meta.slot_mapping),
                          wide.forward(kvcore.LayerScales(), query, k, k, cache, meta,
                                       output=torch.empty_like(query)))):
        with pytest.raises(ValueError) as raised:
            call()
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "planned by FlashInferMetadataBuilder for" in errors[0]


# -- the logit soft-cap: planned per step, refused for a layer of another cap --------------

CAP = 2.0  # small enough to change every score of these random batches


@pytest.mark.parametrize("shape", ["mixed-decodes-first", "prefill-only", "decode-only"])
def test_builder_plans_its_soft_cap_and_the_layer_matches_the_reference(shape):
    kv_cache, gen = _cache(7)
    impl, builder = _impl(logits_soft_cap=CAP), _builder(logits_soft_cap=CAP)
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES[shape])
    meta = builder.build(batch.meta)
    wrappers = [w for w in (meta.decode_wrapper, meta.prefill_wrapper) if w is not None]
    assert wrappers and all(w.lists["logits_soft_cap"] == CAP for w in wrappers)
    assert meta.planned[2] == CAP
    out = _forward(impl, batch, kv_cache, meta)
    ref = reference(impl, batch, kv_cache)
    assert rel_err(out, ref) < REL_ERR[torch.float32]
    # The cap changes the result: a dropped cap would not pass.
    assert rel_err(reference(_impl(), batch, kv_cache), ref) > 100 * REL_ERR[torch.float32]


@pytest.mark.parametrize(("planned", "layer", "fix"), [
    (None, CAP, r"build the steps with FlashInferMetadataBuilder\(\.\.\., "
                r"logits_soft_cap=2\.0\), the model's cap"),
    (CAP, None, r"build the steps with FlashInferMetadataBuilder\(\.\.\., "
                r"logits_soft_cap=None\), the model's cap"),
    (CAP, 30.0, r"build the steps with FlashInferMetadataBuilder\(\.\.\., "
                r"logits_soft_cap=30\.0\), the model's cap"),
], ids=["uncapped-plan", "uncapped-layer", "other-cap"])
def test_once_a_layer_ran_on_the_plan_a_layer_of_another_soft_cap_is_refused(planned, layer,
                                                                             fix):
    kv_cache, gen = _cache(8)
    impl = _impl(logits_soft_cap=layer)
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES["mixed-decodes-first"])
    builder = _builder(logits_soft_cap=planned)
    meta = builder.build(batch.meta)
    _forward(_impl(logits_soft_cap=planned), batch, kv_cache, meta)  # settles the plan
    assert builder.settled
    with pytest.raises(ValueError, match=(
            rf"this layer needs scale=.*, sliding_window=None, logits_soft_cap={layer}, "
            rf"causal=True but the step was planned by FlashInferMetadataBuilder for "
            rf"scale=.*, sliding_window=None, logits_soft_cap={planned}, causal=True \(a "
            rf"FlashInfer plan fixes them for every layer of a step\): {fix}")):
        _forward(impl, batch, kv_cache, meta)


@pytest.mark.parametrize("shape", ["mixed-decodes-first", "prefill-only", "decode-only"])
@pytest.mark.parametrize(("window", "cap"), [(None, CAP), (8, None), (8, CAP)],
                         ids=["cap", "window", "window-and-cap"])
def test_the_builder_learns_the_first_layer_s_window_and_cap(shape, window, cap):
    """An engine that does not tell the builder the model's cap or window: the first layer's
    step is planned again for them, bit for bit a step planned for them from the start, and
    the later steps are planned for them."""
    kv_cache, gen = _cache(11)
    impl = _impl(sliding_window=window, logits_soft_cap=cap)
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES[shape])
    told = _builder(logits_soft_cap=cap)
    told.sliding_window = window  # what a builder that learned them plans with
    expected = _forward(impl, batch, kv_cache, told.build(batch.meta))
    builder = _builder()
    meta = builder.build(batch.meta)
    assert meta.planned[1:3] == (None, None) and not builder.settled
    out = _forward(impl, batch, kv_cache, meta)
    assert builder.settled and meta.planned[1:3] == (window, cap)
    assert (builder.sliding_window, builder.logits_soft_cap) == (window, cap)
    assert torch.equal(out, expected)
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]
    later = builder.build(batch.meta)
    assert later.planned[1:3] == (window, cap)
    assert torch.equal(_forward(impl, batch, kv_cache, later), expected)
    # Settled: a layer that needs other values is refused, naming the fix.
    with pytest.raises(ValueError, match=r"this layer needs .* but the step was planned by "
                                         r"FlashInferMetadataBuilder .*: (give layers of other "
                                         r"windows their own builder|build the steps with)"):
        _forward(_impl(sliding_window=16), batch, kv_cache, later)


@pytest.mark.parametrize("shape", ["mixed-decodes-first", "decode-only"])
def test_a_builder_whose_spec_names_the_window_plans_for_it_from_the_first_step(shape):
    """An engine that gives a window its own builder (FullAttentionSpec(sliding_window=...)):
    the first step is planned for the window, with no second plan when its first layer runs."""
    kv_cache, gen = _cache(12)
    impl = _impl(sliding_window=8)
    batch = mixed_batch(impl, kv_cache, gen, **SHAPES[shape])
    builder = _builder(sliding_window=8)
    meta = builder.build(batch.meta)
    assert meta.planned[1] == 8
    plans = builder.plans
    out = _forward(impl, batch, kv_cache, meta)
    assert builder.plans == plans and builder.settled
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), True, "50"])
def test_builder_refuses_a_soft_cap_that_is_not_a_positive_float(cap):
    with pytest.raises(ValueError, match=rf"logits_soft_cap={cap!r} must be None or a finite "
                                         r"float > 0"):
        _builder(logits_soft_cap=cap)


def test_layers_of_different_caps_on_plain_metadata_each_plan_their_own():
    """Without the builder each layer plans for its own cap (and window): a step that
    alternates capped and uncapped layers plans again when the cap changes and matches the
    reference each time."""
    kv_cache, gen = _cache(10)
    capped, plain = _impl(logits_soft_cap=CAP), _impl()
    batch = mixed_batch(plain, kv_cache, gen, **SHAPES["prefill-only"])
    for impl in (capped, capped, plain, capped):
        out = _forward(impl, batch, kv_cache, batch.meta)
        assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]
    prefill = [w for w in _Wrapper.made if not w.decode]
    assert [w.lists["logits_soft_cap"] for w in prefill] == [CAP]
    assert prefill[0].plans == 3  # capped, plain, capped: the repeat reuses the plan


def test_flashinfer_declares_the_soft_cap_for_the_selector(monkeypatch):
    """A soft-capped configuration (Gemma 2) has no soft-cap reason against FLASHINFER (the
    stand-in module is removed: whether FlashInfer is installed is another reason)."""
    monkeypatch.delitem(sys.modules, "flashinfer")
    assert FlashInferBackend.SUPPORTS_LOGITS_SOFT_CAP
    reasons = FlashInferBackend.validate_configuration(
        head_size=256, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=kvcore.DeviceCapability(9, 0),
        attn_type=kvcore.AttentionType.DECODER, has_logits_soft_cap=True)
    assert not [r for r in reasons if "soft" in r], reasons


def test_graph_steps_of_one_choice_share_their_launch():
    """A graph decode step's launch (wrappers, rows, bounds, plan parameters) is one object
    per choice, so the runner and the layers find its contents once; another size or plan
    parameters give another."""
    builder = _builder()
    first = builder.build(_decode_step([[1, 2], [3]], [20, 9]), graph_batch_size=4)
    second = builder.build(_decode_step([[4], [5, 6]], [3, 30]), graph_batch_size=4)
    assert second.launch is first.launch and second.planned is first.launch.planned
    other = builder.build(_decode_step([[4], [5, 6]], [3, 30]), graph_batch_size=2)
    assert other.launch is not first.launch and other.launch.num_decodes == 2
    builder.scale = 0.5
    assert builder.build(_decode_step([[4]], [3]), graph_batch_size=4).launch.planned[0] == 0.5


# -- fp8 caches: FlashInfer's mixed-precision kernels, the layer's scales as host floats -----

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: fp8 rounding of K and V (the cache's, the same in the reference) leaves only the float32
#: attention's error: the stand-in and the reference read the same stored values.
FP8_REL_ERR = 1e-5


def _fp8_setup(kv: str, seed: int, shape: str, layer: kvcore.LayerScales):
    spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.float32,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                    kv_cache_dtype=kv)
    builder = FlashInferBackend.get_builder_cls()(
        spec, num_heads=HEADS, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
        device="cpu")
    impl = _impl(kv_cache_dtype=kv)
    kv_cache, gen = _cache(seed)
    kv_cache = kv_cache.to(FP8[kv])
    batch = mixed_batch(impl, kv_cache, gen, layer=layer, dtype=torch.float32, **SHAPES[shape])
    return builder, impl, kv_cache, batch


def _fp8_forward(impl, layer, batch, kv_cache, meta) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(layer, batch.query, batch.key, batch.value, kv_cache, meta, output=out)
    return out


@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("shape", ["mixed-decodes-first", "prefill-only", "decode-only"])
def test_an_fp8_cache_runs_on_its_plan_with_the_layer_s_scales(shape, kv):
    layer = kvcore.LayerScales(k_scale=torch.tensor(0.25), v_scale=torch.tensor(3.0))
    builder, impl, kv_cache, batch = _fp8_setup(kv, 11, shape, layer)
    meta = builder.build(batch.meta)
    assert (meta.dtype, meta.cache_dtype) == (torch.float32, FP8[kv])
    wrappers = [w for w in (meta.decode_wrapper, meta.prefill_wrapper) if w is not None]
    assert wrappers and all(w.lists["kv_data_type"] == FP8[kv] for w in wrappers)
    ref = reference(impl, batch, kv_cache, layer)
    for _ in range(2):  # the full checks, then the layer's short path
        assert rel_err(_fp8_forward(impl, layer, batch, kv_cache, meta), ref) < FP8_REL_ERR
    # The scales matter: read with scale 1 the result is far off.
    assert rel_err(reference(impl, batch, kv_cache), ref) > 0.1


def test_fp8_scales_are_read_once_and_again_when_changed_in_place(monkeypatch):
    layer = kvcore.LayerScales(k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0))
    builder, impl, kv_cache, batch = _fp8_setup("fp8_e4m3", 12, "decode-only", layer)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    for _ in range(3):
        _fp8_forward(impl, layer, batch, kv_cache, builder.build(batch.meta))
    assert len(reads) == 2  # k and v, once
    layer.v_scale.fill_(4.0)  # calibrated in place: its version counter moves
    out = _fp8_forward(impl, layer, batch, kv_cache, builder.build(batch.meta))
    assert len(reads) == 4
    assert rel_err(out, reference(impl, batch, kv_cache, layer)) < FP8_REL_ERR


@pytest.mark.parametrize(("k_scale", "match"), [
    (torch.ones(KV_HEADS), r"layer\.k_scale has shape \(2,\): FLASHINFER takes one scale"),
    (0.0, r"layer\.k_scale=0\.0: an fp8 cache's scale must be a finite float > 0"),
], ids=["per-head", "zero"])
def test_fp8_scales_flashinfer_cannot_take_are_refused(k_scale, match):
    good = kvcore.LayerScales()
    builder, impl, kv_cache, batch = _fp8_setup("fp8_e4m3", 13, "decode-only", good)
    with pytest.raises(ValueError, match=match):
        _fp8_forward(impl, kvcore.LayerScales(k_scale=k_scale), batch, kv_cache,
                     builder.build(batch.meta))


def test_fp8_prefill_runs_on_fa2_on_hopper():
    """FlashInfer's SM90 prefill reads an fp8 cache only with fp8 queries."""
    assert flashinfer_kernels((9, 0), 32, 8, torch.float8_e4m3fn) == FlashInferKernels("fa2",
                                                                                       True)
    assert flashinfer_kernels((9, 0), 32, 8, torch.bfloat16).prefill == "fa3"


@pytest.mark.parametrize(("capability", "refused"), [((9, 0), False), ((8, 0), True)],
                         ids=["hopper", "ampere"])
def test_flashinfer_declares_fp8_caches_for_the_selector(monkeypatch, capability, refused):
    """fp8 caches are FLASHINFER's where kvcore's Triton cache write converts to fp8."""
    monkeypatch.delitem(sys.modules, "flashinfer")
    reasons = FlashInferBackend.validate_configuration(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=kvcore.DeviceCapability(*capability),
        attn_type=kvcore.AttentionType.DECODER)
    fp8 = [r for r in reasons if "fp8" in r]
    assert bool(fp8) == refused, reasons
    if refused:
        assert "needs device capability >= 8.9" in fp8[0]
