"""FLASHINFER_MLA without a GPU: its declared capabilities and the reasons derived from them,
its place in the CUDA MLA priority list (simulated devices, FlashInfer simulated present or
absent), the argument checks of its impl and builder, its latent write (the reference
path on CPU tensors) against the MLA reference, bit for bit, on a cross-layer view, and the
GPU test's cross-layer allocation comparison with the MLA reference in FlashInfer's place,
the softmax scale and the fp8 scale (read by the builder once per step, never per layer)
through a stand-in for FlashInfer's wrapper."""

from __future__ import annotations

import gc
import importlib.util
import sys
import types
import weakref

import pytest
import torch
from kvcore_nvidia.backends import flashinfer_mla
from kvcore_nvidia.backends.flashinfer_mla import FlashInferMLABackend, mla_page_lists
from nvidia_helpers import fill_layers, rel_err

import kvcore
from kvcore.ops import concat_and_cache_mla_ref, mla_attention_ref
from kvcore.testing import random_block_tables

FLASHINFER_MISSING = "flashinfer-python not installed (pip install flashinfer-python)"
MLA = dict(head_size=576, dtype=torch.bfloat16, block_size=64, use_mla=True)
RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128


def _reasons(**changes) -> list[str]:
    config = kvcore.AttentionSelectorConfig(**{**MLA, **changes})
    return FlashInferMLABackend.validate_configuration(
        **config.as_kwargs(), device_capability=kvcore.DeviceCapability(9, 0))


def _without_install_reasons(reasons: list[str]) -> list[str]:
    return [r for r in reasons if "not installed" not in r]


@pytest.mark.parametrize(("change", "reason"), [
    (dict(head_size=512), "head_size=512 (supported: 576)"),
    (dict(block_size=128), "block_size=128 (supported: 16, 32, 64)"),
    (dict(dtype=torch.float32), "dtype=float32 (supported: float16, bfloat16)"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype=fp8_e5m2 (supported: auto, fp8, fp8_e4m3)"),
    (dict(kv_cache_dtype="fp8", dtype=torch.float16),
     "kv_cache_dtype=fp8 with dtype=float16: FlashInfer's fp8 MLA kernels take bfloat16 queries "
     "only; use dtype=bfloat16 or kv_cache_dtype=auto"),
    (dict(use_mla=False), "use_mla=False but FLASHINFER_MLA only runs MLA layers"),
], ids=["head-size", "block-size", "dtype", "e5m2", "fp8-fp16", "not-mla"])
def test_declared_capabilities_give_full_reasons(change, reason):
    assert _without_install_reasons(_reasons(**change)) == [reason]


@pytest.mark.parametrize(("capability", "fp8_ok"), [("8.0", False), ("8.9", False),
                                                    ("9.0", True), ("10.0", False)])
def test_fp8_cache_is_hopper_only(capability, fp8_ok):
    cap = kvcore.DeviceCapability.parse(capability)
    reasons = _without_install_reasons(FlashInferMLABackend.validate_configuration(
        **kvcore.AttentionSelectorConfig(**MLA, kv_cache_dtype="fp8").as_kwargs(),
        device_capability=cap))
    expected = [] if fp8_ok else [
        f"kv_cache_dtype=fp8 needs device capability 9.x (Hopper) for FlashInfer's fp8 MLA "
        f"kernels (got {cap}); use kv_cache_dtype=auto"]
    assert reasons == expected


def test_capability_below_ampere_is_refused():
    reasons = FlashInferMLABackend.validate_configuration(
        **kvcore.AttentionSelectorConfig(**MLA).as_kwargs(),
        device_capability=kvcore.DeviceCapability(7, 5))
    assert "device capability 7.5 (supported: >= 8.0)" in reasons


@pytest.fixture
def flashinfer_present(monkeypatch):
    """``flashinfer_present(True)``: pretend flashinfer-python is installed (the class the
    registry resolves no longer requires it); ``False`` leaves it required."""

    def set_present(present: bool) -> None:
        if present:
            monkeypatch.setattr(kvcore.resolve_backend("FLASHINFER_MLA"), "REQUIRED_PACKAGES",
                                ())
        kvcore.clear_selection_cache()

    return set_present


@pytest.mark.parametrize(("capability", "present", "selected", "order"), [
    ("9.0", True, "FLASHINFER_MLA", ["FLASHINFER_MLA", "TRITON_MLA"]),
    ("10.0", True, "FLASHINFER_MLA", ["FLASHINFER_MLA", "TRITON_MLA"]),
    ("8.0", True, "TRITON_MLA", ["TRITON_MLA", "FLASHINFER_MLA"]),
    ("9.0", False, "TRITON_MLA", ["FLASHINFER_MLA", "TRITON_MLA"]),
], ids=["hopper", "blackwell", "ampere", "hopper-without-flashinfer"])
def test_mla_priority_on_cuda(kvcore_simulate, flashinfer_present, capability, present,
                              selected, order):
    kvcore_simulate("cuda", capability, plugins=("nvidia", "mla"))
    if importlib.util.find_spec("flashinfer") is not None and not present:
        pytest.skip("flashinfer is installed here: its absence cannot be simulated this way")
    flashinfer_present(present)
    config = kvcore.AttentionSelectorConfig(**MLA)
    report = kvcore.explain_selection(config)
    assert [c.name for c in report.candidates][:2] == order
    assert kvcore.get_attn_backend(config).get_name() == selected
    fi = next(c for c in report.candidates if c.name == "FLASHINFER_MLA")
    assert fi.plugin == "nvidia"
    if present:
        assert fi.valid
    else:
        assert fi.reasons == [FLASHINFER_MISSING]


def test_a_non_mla_config_never_gets_flashinfer_mla(kvcore_simulate, flashinfer_present):
    kvcore_simulate("cuda", "9.0", plugins=("nvidia", "mla"))
    flashinfer_present(True)
    report = kvcore.explain_selection(kvcore.AttentionSelectorConfig(head_size=576,
                                                                     dtype=torch.bfloat16))
    fi = next(c for c in report.candidates if c.name == "FLASHINFER_MLA")
    assert fi.reasons == ["use_mla=False but FLASHINFER_MLA only runs MLA layers"]


def _weight(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(num_heads * (NOPE + V_DIM), RANK, generator=gen)
            * RANK**-0.5).to(torch.bfloat16)


def _impl(num_heads: int = 16, scale: float = (NOPE + ROPE) ** -0.5,
          **kw) -> kvcore.AttentionImpl:
    gen = torch.Generator().manual_seed(num_heads)
    return FlashInferMLABackend.get_impl_cls()(
        num_heads, RANK + ROPE, scale, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_DIM, kv_b_proj_weight=_weight(num_heads, gen), **kw)


def test_impl_refuses_head_counts_and_caches_it_cannot_run():
    with pytest.raises(ValueError, match=r"num_heads=12 \(FLASHINFER_MLA supports 1, 2, 4, 8, "
                                         r"16, 32, 64, 128 query heads per layer"):
        _impl(12)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' \(FLASHINFER_MLA supports "
                                         r"auto, fp8, fp8_e4m3\)"):
        _impl(kv_cache_dtype="fp8_e5m2")


def test_builder_refuses_specs_and_head_counts_it_cannot_plan():
    cls = FlashInferMLABackend.get_builder_cls()
    sizes = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, device="cpu")
    full = kvcore.FullAttentionSpec(block_size=64, dtype=torch.bfloat16, num_kv_heads=1,
                                    head_size=576)
    with pytest.raises(TypeError, match="spec must be a kvcore.MLAAttentionSpec"):
        cls(full, num_heads=16, **sizes)
    small = kvcore.MLAAttentionSpec(block_size=64, dtype=torch.bfloat16, kv_lora_rank=256)
    with pytest.raises(ValueError, match="kv_lora_rank=256, qk_rope_head_dim=64; FLASHINFER_MLA "
                                         "supports 512 and 64"):
        cls(small, num_heads=16, **sizes)
    spec = kvcore.MLAAttentionSpec(block_size=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_heads=24 "):
        cls(spec, num_heads=24, **sizes)


def test_forward_on_cpu_tensors_is_refused_before_any_kernel():
    impl = _impl()
    meta = kvcore.build_attention_metadata([1], [10], [[0]], 64)
    cache = torch.randn(2, 64, RANK + ROPE).to(torch.bfloat16)
    query = torch.randn(1, 16, NOPE + ROPE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache is on cpu; FLASHINFER_MLA runs FlashInfer's "
                                         "CUDA kernels on GPU tensors"):
        impl.forward(kvcore.LayerScales(), query, None, None, cache, meta)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_latent_write_into_a_cross_layer_view_equals_the_mla_reference(kv_cache_dtype):
    """The two 288-channel halves written through reshape_and_cache are exactly the latent
    concat_and_cache_mla_ref writes, in the middle layer of a 3-layer pool only."""
    gen = torch.Generator().manual_seed(5 if kv_cache_dtype == "auto" else 6)
    impl = _impl(kv_cache_dtype=kv_cache_dtype)
    block_size, num_blocks, tokens = 16, 6, 40
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    kv_c = torch.randn(tokens, RANK, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(tokens, 1, ROPE, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1  # a padding token writes nothing
    layer = kvcore.LayerScales(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.25]))

    expected = torch.zeros(num_blocks, block_size, RANK + ROPE).to(cache_dtype)
    concat_and_cache_mla_ref(kv_c, k_pe, expected, slots, kv_cache_dtype, layer.k_scale)
    pool = torch.randn(num_blocks, 3, block_size, RANK + ROPE, generator=gen).to(cache_dtype)
    view = pool[:, 1]
    view.zero_()
    neighbours = pool[:, [0, 2]].clone()
    impl.do_kv_cache_update(layer, kv_c, k_pe, view, slots)
    assert torch.equal(view.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(pool[:, [0, 2]].view(torch.uint8), neighbours.view(torch.uint8))


def test_page_lists_are_the_used_block_table_entries_in_order():
    seq_lens = torch.tensor([1, 64, 65, 0, 130], dtype=torch.int32)
    table = torch.tensor([[7, 99, 99], [3, 99, 99], [4, 5, 99], [99, 99, 99], [8, 9, 10]],
                         dtype=torch.int32)
    indptr, indices = mla_page_lists(seq_lens, table, 64)
    assert indptr.tolist() == [0, 1, 2, 4, 4, 7]
    assert indices.tolist() == [7, 3, 4, 5, 8, 9, 10]
    assert indptr.dtype == indices.dtype == torch.int32


def test_write_and_forward_on_a_cross_layer_allocation_equal_layers_outermost(monkeypatch):
    """The GPU test's allocation comparison on the CPU, FlashInfer's kernel replaced by the
    MLA reference reading the same layer view: a cross-layer and a layers-outermost allocation
    filled layer by layer from equal generators hold the same history, so the latent write
    leaves the same bytes and the forward gives the same output; the other layers untouched."""

    def latent_ref(self, layer, q, kv_cache, m):
        return mla_attention_ref(q, kv_cache, kv_lora_rank=RANK,
                                 query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                                 block_table=m.block_table, scale=self.scale)

    impl_cls = FlashInferMLABackend.get_impl_cls()
    monkeypatch.setattr(impl_cls, "_latent_attention", latent_ref)
    # the common pipeline's hook, which hands the whole latent query to _latent_attention
    monkeypatch.setattr(impl_cls, "_latent_attention_into",
                        kvcore.MLACommonImpl._latent_attention_into)
    gen = torch.Generator().manual_seed(11)
    impl = _impl()
    block_size, num_blocks, num_layers, index = 16, 12, 3, 1
    lens, query_lens = [70, 20, 1], [5, 1, 1]
    tables = random_block_tables(lens, block_size, num_blocks, gen)
    meta = kvcore.build_attention_metadata(
        query_lens, [n - q for n, q in zip(lens, query_lens, strict=True)], tables, block_size)
    n = meta.num_actual_tokens
    kv_c = torch.randn(n, RANK, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(n, ROPE, generator=gen).to(torch.bfloat16)
    query = torch.randn(n, 16, NOPE + ROPE, generator=gen).to(torch.bfloat16)
    written, outputs = [], []
    for cross_layer in (True, False):
        caches = kvcore.allocate_kv_caches(
            "CPU_MLA" if cross_layer else FlashInferMLABackend, num_layers=num_layers,
            num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_size=RANK + ROPE,
            dtype=torch.bfloat16, device="cpu", cross_layer=cross_layer)
        assert caches.is_cross_layer == cross_layer
        fill_layers(caches, torch.Generator().manual_seed(12))
        others = [caches.layers[i].clone() for i in range(num_layers) if i != index]
        impl.do_kv_cache_update(kvcore.LayerScales(), kv_c, k_pe, caches.layers[index],
                                meta.slot_mapping)
        written.append(caches.layers[index].clone())
        outputs.append(impl.forward(kvcore.LayerScales(), query, None, None,
                                    caches.layers[index], meta))
        assert all(torch.equal(a, caches.layers[i]) for a, i in
                   zip(others, [i for i in range(num_layers) if i != index], strict=True))
    assert torch.equal(written[0], written[1])
    assert torch.equal(outputs[0], outputs[1])


# -- the softmax scale, through a stand-in for FlashInfer's MLA wrapper ---------------------

#: ||out - ref|| / ||ref|| of a bf16 latent attention against float64 (a query rescaled in
#: bf16 adds one rounding; a wrong scale is far above).
REL_ERR = 2e-2


class _FakeMLAWrapper:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` as FLASHINFER_MLA calls it: ``plan``
    keeps the CSR page lists and ``sm_scale``, ``run`` is the MLA reference over those pages
    with the planned scale (``run`` takes none, like FlashInfer's fa2/fa3 kernels)."""

    def __init__(self, workspace, use_cuda_graph=False, backend="auto", **buffers) -> None:
        self.plans: list[dict] = []

    def plan(self, *, metadata, sm_scale, page_size, causal, **options) -> None:
        self.plans.append(dict(metadata=metadata, sm_scale=sm_scale, page_size=page_size,
                               causal=causal))

    def run(self, *, query, kv_cache, out):
        plan = self.plans[-1]
        qo_indptr, kv_indptr, kv_indices, kv_len = plan["metadata"]
        tables = torch.zeros(len(kv_len), int((kv_indptr[1:] - kv_indptr[:-1]).max()),
                             dtype=torch.int32)
        for i in range(len(kv_len)):
            pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
            tables[i, :len(pages)] = pages
        out.copy_(mla_attention_ref(torch.cat(query, -1), torch.cat(kv_cache, -1),
                                    kv_lora_rank=RANK, query_start_loc=qo_indptr,
                                    seq_lens=kv_len, block_table=tables,
                                    scale=plan["sm_scale"]))
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """``flashinfer`` replaced by the stand-in above (its ``fa2`` family, never Hopper's)."""
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeMLAWrapper
    mla.MLAPlanMetadata = types.SimpleNamespace(csr=lambda *tensors: tensors)
    utils = types.ModuleType("flashinfer.utils")
    utils.is_sm90a_supported = lambda device: False
    package = types.ModuleType("flashinfer")
    package.mla, package.utils = mla, utils
    for name, module in (("flashinfer", package), ("flashinfer.mla", mla),
                         ("flashinfer.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)


def _scale_step(num_heads: int = 16):
    gen = torch.Generator().manual_seed(21)
    cache = torch.randn(12, 16, RANK + ROPE, generator=gen).to(torch.bfloat16)
    tables = random_block_tables([40, 17, 3], 16, 12, gen)
    meta = kvcore.build_attention_metadata([1, 4, 3], [39, 13, 0], tables, 16)
    q = torch.randn(meta.num_actual_tokens, num_heads, RANK + ROPE,
                    generator=gen).to(torch.bfloat16)
    return cache, meta, q


def _latent(impl, meta, q, cache) -> torch.Tensor:
    """The impl's latent attention as ``_latent_attention`` runs it once planned (that method
    refuses CPU tensors before reaching FlashInfer)."""
    wrapper, planned_scale = impl._planned(q, cache, meta)
    out = q.new_empty(q.shape[0], impl.num_heads, RANK)
    flashinfer_mla._run(wrapper, planned_scale, impl.scale, q[..., :RANK], q[..., RANK:], cache,
                        out, None)
    return out


def _ref(q, cache, meta, scale) -> torch.Tensor:
    return mla_attention_ref(q, cache, kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                             seq_lens=meta.seq_lens, block_table=meta.block_table, scale=scale)


def _mla_builder(**kw):
    spec = kvcore.MLAAttentionSpec(block_size=16, dtype=torch.bfloat16)
    return FlashInferMLABackend.get_builder_cls()(
        spec, num_heads=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
        device="cpu", **kw)


@pytest.mark.parametrize(("query_lens", "causal"), [([1, 1], False), ([1, 3], True),
                                                    ([0, 2], True)],
                         ids=["decode", "mixed", "two-tokens-and-none"])
def test_a_step_is_planned_non_causal_exactly_when_it_is_uniform_decode(fake_flashinfer,
                                                                        query_lens, causal):
    gen = torch.Generator().manual_seed(23)
    tables = random_block_tables([40, 20], 16, 12, gen)
    common = kvcore.build_attention_metadata(query_lens, [39, 18], tables, 16)
    assert kvcore.is_uniform_decode(common) is not causal
    assert _mla_builder().build(common).wrapper.plans[-1]["causal"] is causal
    # A step of no requests is planned by no one: the builder hands it on unplanned.
    assert _mla_builder().build(kvcore.build_attention_metadata([], [], [], 16)).wrapper is None


def test_a_builder_plans_for_the_scale_it_is_given(fake_flashinfer):
    """Through the public ``plan(sm_scale=...)``: a layer of the builder's scale runs the plan
    as it is (exactly the reference at that scale), a layer of another scale carries the
    ratio in its query (the reference at its own scale, to bf16 rounding)."""
    cache, meta, q = _scale_step()
    builder = _mla_builder(scale=0.2)
    step = builder.build(meta)
    assert step.scale == 0.2 and [p["sm_scale"] for p in step.wrapper.plans] == [0.2]
    same, other = _impl(scale=0.2), _impl(scale=0.05)
    assert torch.equal(_latent(same, step, q, cache), _ref(q, cache, meta, 0.2))
    rescaled = _latent(other, step, q, cache)
    assert step.wrapper.plans[-1]["sm_scale"] == 0.2  # nothing planned per layer
    assert rel_err(rescaled, _ref(q.double(), cache.double(), meta, 0.05)) < REL_ERR
    assert not torch.equal(rescaled, _ref(q, cache, meta, 0.2))
    assert builder.scale == 0.2  # a given scale is kept


def test_a_builder_without_a_scale_plans_for_the_first_layer_s_from_the_next_step(
        fake_flashinfer):
    cache, meta, q = _scale_step()
    builder = _mla_builder()
    first = builder.build(meta)
    assert first.scale == flashinfer_mla.DEFAULT_SCALE == (NOPE + ROPE) ** -0.5
    layers = [_impl(scale=0.11), _impl(scale=0.3)]
    outs = []
    for impl in layers:
        outs.append(_latent(impl, first, q, cache))
        assert rel_err(outs[-1], _ref(q.double(), cache.double(), meta, impl.scale)) < REL_ERR
    assert builder.scale == 0.11
    # The first layer re-planned the step at its scale: no query rescaling, so the first step
    # gives bit for bit what later steps give (the second layer's scale still goes by ratio).
    assert first.scale == 0.11 and first.wrapper.plans[-1]["sm_scale"] == 0.11
    second = builder.build(meta)
    assert second.scale == 0.11 and second.wrapper.plans[-1]["sm_scale"] == 0.11
    assert torch.equal(_latent(layers[0], second, q, cache), _ref(q, cache, meta, 0.11))
    assert torch.equal(outs[0], _latent(layers[0], second, q, cache))


def test_a_captured_step_keeps_the_scale_it_was_planned_for(fake_flashinfer):
    """Once a CUDA-graph step was built, a layer's scale no longer changes the plan: the graph
    holds the layers' query rescaling for the scale it was captured with, and a replay planned
    for the layer's own scale would apply the ratio twice (the conformance rule
    ``cuda-graph-replay`` checks this on a GPU)."""
    gen = torch.Generator().manual_seed(22)
    cache = torch.randn(12, 16, RANK + ROPE, generator=gen).to(torch.bfloat16)
    tables = random_block_tables([40, 17, 3], 16, 12, gen)
    meta = kvcore.build_attention_metadata([1, 1, 1], [39, 16, 2], tables, 16)
    q = torch.randn(3, 16, RANK + ROPE, generator=gen).to(torch.bfloat16)
    builder = _mla_builder()
    captured = builder.build(meta, graph_batch_size=4)
    assert captured.scale == flashinfer_mla.DEFAULT_SCALE
    layer = _impl(scale=0.11)
    padded = torch.cat([q, q[:1]])  # a query for the builder's padding request
    _latent(layer, captured, padded, cache)
    assert builder.scale == flashinfer_mla.DEFAULT_SCALE  # not the layer's: fixed for good
    replay = builder.build(meta, graph_batch_size=4)
    assert replay.wrapper is captured.wrapper
    assert [p["sm_scale"] for p in replay.wrapper.plans] == [flashinfer_mla.DEFAULT_SCALE] * 2
    assert builder.build(meta).scale == flashinfer_mla.DEFAULT_SCALE  # eager steps too
    out = _latent(layer, replay, padded, cache)[:3]
    assert rel_err(out, _ref(q.double(), cache.double(), meta, 0.11)) < REL_ERR


def test_plain_metadata_is_planned_for_its_first_layer_s_scale(fake_flashinfer):
    cache, meta, q = _scale_step()
    first, second = _impl(scale=0.13), _impl(scale=0.07)
    assert torch.equal(_latent(first, meta, q, cache), _ref(q, cache, meta, 0.13))
    wrapper, planned = second._planned(q, cache, meta)
    assert planned == 0.13 and len(wrapper.plans) == 1  # the step's plan, kept
    out = _latent(second, meta, q, cache)
    assert rel_err(out, _ref(q.double(), cache.double(), meta, 0.07)) < REL_ERR


def test_a_builder_refuses_a_scale_that_is_not_a_positive_float():
    with pytest.raises(ValueError, match="scale=-1.0 must be a finite, positive float"):
        _mla_builder(scale=-1.0)


# -- the fp8 scale tensor: read by the builder once per step, never in a layer's forward ----

#: Tensor calls that read a tensor's value back to the host (a device sync on a GPU).
_HOST_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "cpu", "to", "numpy"}


class _WatchedScale(torch.Tensor):
    """A scale tensor that records every host read made on it (and on tensors made from it)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


class _FakeFp8Wrapper(_FakeMLAWrapper):
    """The stand-in wrapper, recording the fp8 scales each ``run`` is given (not computing)."""

    scales: list[float] = []

    def run(self, *, query, kv_cache, out, ckv_scale=None, kpe_scale=None):
        assert isinstance(ckv_scale, float) and ckv_scale == kpe_scale
        self.scales.append(ckv_scale)
        return out


def test_fp8_scale_tensors_are_read_once_per_step_by_the_builder_not_per_layer(
        fake_flashinfer, monkeypatch):
    monkeypatch.setattr(sys.modules["flashinfer.mla"], "BatchMLAPagedAttentionWrapper",
                        _FakeFp8Wrapper)
    monkeypatch.setattr(_FakeFp8Wrapper, "scales", [])
    monkeypatch.setattr(_WatchedScale, "reads", [])
    monkeypatch.setattr(flashinfer_mla, "_check_on_gpu", lambda kv_cache: None)  # CPU tensors
    gen = torch.Generator().manual_seed(5)
    spec = kvcore.MLAAttentionSpec(block_size=16, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    builder = FlashInferMLABackend.get_builder_cls()(
        spec, num_heads=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
        device="cpu")
    cache = torch.randn(12, 16, RANK + ROPE, generator=gen).to(torch.float8_e4m3fn)
    tables = random_block_tables([40, 17, 3], 16, 12, gen)
    common = kvcore.build_attention_metadata([1, 4, 3], [39, 13, 0], tables, 16)
    query = torch.randn(common.num_actual_tokens, 16, NOPE + ROPE,
                        generator=gen).to(torch.bfloat16)
    values = [0.5, 0.25, 2.0]
    layers = [kvcore.LayerScales(k_scale=torch.tensor([v]).as_subclass(_WatchedScale))
              for v in values]
    impls = [_impl(kv_cache_dtype="fp8") for _ in layers]

    def step() -> tuple[list[str], list[str]]:
        """One step: the host reads of the builder, then those of all the layers' forwards."""
        _WatchedScale.reads.clear()
        meta = builder.build(common)
        in_build = list(_WatchedScale.reads)
        _WatchedScale.reads.clear()
        for impl, layer in zip(impls, layers, strict=True):
            impl.forward(layer, query, None, None, cache, meta)
        return in_build, list(_WatchedScale.reads)

    in_build, in_forward = step()  # each layer reads its scale once, handing it to the builder
    assert in_build == [] and len(in_forward) == len(layers)
    for _ in range(2):
        in_build, in_forward = step()
        assert in_build == ["to"] * len(layers) + ["tolist"]  # one read back for all layers
        assert in_forward == []
    layers[1].k_scale.fill_(0.125)  # a scale changed between steps is read at the next build
    step()
    assert _FakeFp8Wrapper.scales == values * 3 + [0.5, 0.125, 2.0]
    # A layer that replaces its scale tensor: the new one is read from then on, and the
    # builder lets the old one go (no longer read at build, no longer kept alive).
    replaced = weakref.ref(layers[2].k_scale)
    layers[2].k_scale = torch.tensor([4.0]).as_subclass(_WatchedScale)
    in_build, in_forward = step()  # the new tensor is read in its forward, as on a first step
    assert in_build == ["to"] * len(layers) + ["tolist"] and len(in_forward) == 1
    in_build, in_forward = step()
    assert in_build == ["to"] * len(layers) + ["tolist"] and in_forward == []
    gc.collect()
    assert replaced() is None
    assert _FakeFp8Wrapper.scales[-6:] == [0.5, 0.125, 4.0] * 2


def test_the_pipeline_passes_the_query_parts_apart_into_the_step_buffers(fake_flashinfer,
                                                                         monkeypatch):
    """Through the builder: FlashInfer gets the absorbed query as the step buffer's first
    channels and ``q_pe`` as a view of the layer's query (no concatenation), writes the step's
    latent-output buffer, and the layer's output equals CPU_MLA's forward; a layer checks its
    cache in full on its first step only (later layers and steps take the short path)."""
    monkeypatch.setattr(flashinfer_mla, "_check_on_gpu", lambda kv_cache: None)
    calls, runs = [], []
    real_validate, real_run = flashinfer_mla.validate_mla_attention, _FakeMLAWrapper.run
    monkeypatch.setattr(flashinfer_mla, "validate_mla_attention",
                        lambda *a, **k: calls.append(1) or real_validate(*a, **k))
    monkeypatch.setattr(_FakeMLAWrapper, "run",
                        lambda self, **kw: runs.append(kw) or real_run(self, **kw))
    cache, meta, _ = _scale_step()
    gen = torch.Generator().manual_seed(23)
    query = torch.randn(meta.num_actual_tokens, 16, NOPE + ROPE, generator=gen).to(torch.bfloat16)
    impl = _impl()
    cpu = kvcore.get_attn_backend(kvcore.AttentionSelectorConfig(**MLA),
                                  backend="CPU_MLA", platform="cpu").get_impl_cls()(
        16, RANK + ROPE, impl.scale, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        kv_b_proj_weight=_weight(16, torch.Generator().manual_seed(16)))
    expected = cpu.forward(kvcore.LayerScales(), query, None, None, cache, meta)
    builder = _mla_builder()
    for _ in range(2):  # two steps of three layers
        step = builder.build(meta)
        for _ in range(3):
            out = impl.forward(kvcore.LayerScales(), query, None, None, cache, step)
            assert rel_err(out.double(), expected.double()) < REL_ERR
            q_nope, q_pe = runs[-1]["query"]
            assert q_pe.data_ptr() == query[..., NOPE:].data_ptr()
            assert q_nope.data_ptr() == builder.step_buffers.q_latent.data_ptr()
            assert runs[-1]["out"].data_ptr() == builder.step_buffers.o_latent.data_ptr()
    assert len(calls) == 1 and len(runs) == 6
