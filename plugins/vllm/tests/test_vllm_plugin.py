"""kvcore-vllm against the installed vLLM, in process: registration, capabilities, refusals,
and every private vLLM attribute the plugin reads."""

from __future__ import annotations

import importlib

import pytest
import torch

import kvcore

vllm = pytest.importorskip("vllm")

from kvcore_vllm import backends, plugin, vllm_private  # noqa: E402


@pytest.fixture(scope="module")
def registered():
    plugin.register()
    return vllm_private.backend_enum()


def test_every_kvcore_backend_is_a_vllm_backend(registered):
    for name in kvcore.backend_registry().names():
        member = registered[f"KVCORE_{name}"]
        cls = member.get_class()
        assert cls.get_name() == f"KVCORE_{name}" and cls.KVCORE_NAME == name
    assert registered["KVCORE"].get_class().KVCORE_NAME is None


def test_cpu_attn_stands_in_through_kvcore(registered):
    assert registered.CPU_ATTN.get_class().get_name() == "KVCORE"


def test_kvcore_reasons_surface_in_vllm_validation(registered):
    triton = registered["KVCORE_TRITON_ATTN"].get_class()
    reasons = triton.validate_configuration(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=None, attn_type="decoder")
    assert any("kvcore cannot run" in r and "TRITON_ATTN" in r for r in reasons), reasons
    cpu = registered["KVCORE_CPU_ATTN"].get_class()
    assert cpu.validate_configuration(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=None, attn_type="decoder") == []


def test_layouts_and_graph_levels_follow_kvcore_declarations(registered):
    cpu = registered["KVCORE_CPU_ATTN"].get_class()
    names = [layout.name for layout in cpu.supported_kv_cache_layouts()]
    assert names == list(kvcore.resolve_backend("CPU_ATTN").supported_vllm_layouts("cpu"))
    from vllm.v1.attention.backend import AttentionCGSupport

    assert backends.CUDA_GRAPH_LEVELS[kvcore.CudaGraphSupport.UNIFORM_DECODE] is (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert set(backends.CUDA_GRAPH_LEVELS) == set(kvcore.CudaGraphSupport)


def test_vllm_layout_names_are_vllms():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: m.value for m in KVCacheLayout} == kvcore.VLLM_LAYOUTS


@pytest.mark.parametrize("owner, attribute, why", vllm_private.PRIVATE_ATTRIBUTES,
                         ids=[a for _, a, _ in vllm_private.PRIVATE_ATTRIBUTES])
def test_private_vllm_attribute_still_exists(owner, attribute, why):
    """Fails when vLLM renames or drops a private attribute the plugin reads."""
    module, _, name = owner.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    assert hasattr(layer, attribute), f"vLLM no longer sets {owner}.{attribute} ({why})"
    from vllm.v1.attention.backend import AttentionLayer

    assert attribute in AttentionLayer.__annotations__, (
        f"vLLM's AttentionLayer protocol no longer declares {attribute} ({why}); "
        f"{cls.__name__} may have moved it")
    assert vllm_private.layer_scales(layer) == (1.0, 1.0)


def test_vllm_interface_points_exist():
    """The public vLLM names the plugin builds on (renamed between minors before)."""
    from vllm.v1.attention.backend import AttentionBackend, CommonAttentionMetadata

    fields = CommonAttentionMetadata.__dataclass_fields__
    for field in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs",
                  "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping",
                  "causal"):
        assert field in fields, f"CommonAttentionMetadata lost {field}"
    assert hasattr(AttentionBackend, "supported_kv_cache_layouts")
    assert hasattr(vllm.forward_context, "is_forward_context_available")


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_the_builder_s_kvcore_spec_has_the_model_dtype_the_cache_dtype_and_the_window(
        cache_dtype):
    """vLLM's spec holds the cache's storage dtype (fp8 for an fp8 cache): kvcore's spec takes
    the model's dtype and the kv_cache_dtype instead, and a sliding group's window."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    storage = torch.bfloat16 if cache_dtype == "auto" else torch.float8_e4m3fn
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16),
                             cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    full = backends.kvcore_spec(FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                  dtype=storage), config)
    assert (full.dtype, full.kv_cache_dtype, full.cache_dtype, full.sliding_window) == (
        torch.bfloat16, cache_dtype, storage, None)
    sliding = backends.kvcore_spec(SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=storage, sliding_window=128), config)
    assert (sliding.dtype, sliding.cache_dtype, sliding.sliding_window) == (
        torch.bfloat16, storage, 128)


def test_a_builder_takes_the_backend_its_layers_impls_chose():
    """One builder serves a KV-cache group: it takes the backend its layers' kvcore impls
    chose (they know sinks, the soft-cap and the heads; the group's spec does not), refuses
    a group whose impls disagree, and leaves the choice to the spec when none is kvcore's."""
    triton, cpu = kvcore.resolve_backend("TRITON_ATTN"), kvcore.resolve_backend("CPU_ATTN")

    def impl(backend):
        made = object.__new__(backends.KvcoreImpl)
        made.kvcore_backend = backend
        return made

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    assert backends.impls_backend([impl(triton), impl(triton), object()], names) is triton
    assert backends.impls_backend([object()], names) is None
    with pytest.raises(RuntimeError, match="chose different kvcore backends .CPU_ATTN, "
                                           "TRITON_ATTN."):
        backends.impls_backend([impl(triton), impl(cpu)], names)


def test_a_v_head_size_other_than_k_is_refused():
    """vLLM's head_size_v (some models' V heads differ from their K heads): kvcore's caches
    hold K and V of one head size, so the builder refuses such layers, naming both sizes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert "head_size_v" in FullAttentionSpec.__dataclass_fields__
    differ = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=32,
                               dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="head_size_v=32 \\(V\\) and head_size=64 "
                                                  "\\(K\\); kvcore's KV caches hold K and V "
                                                  "of one head size"):
        backends.check_head_size_v(differ)
    backends.check_head_size_v(FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                 dtype=torch.float32))
    # A layer view of such a layer (C = 64 + 32) is refused by kvcore itself too.
    view = torch.zeros(4, 2, 16, 96)
    with pytest.raises(ValueError, match="head_size_v=32 differs from head_size=64"):
        kvcore.from_vllm_layer_view("CPU_ATTN", view, head_size=64)


def test_a_vllm_outside_the_supported_range_gets_no_backend_and_a_reason(monkeypatch, caplog):
    assert plugin.unsupported_vllm() is None  # the installed vLLM
    assert plugin.unsupported_vllm("0.32.3.dev7+gabc") is None
    reason = plugin.unsupported_vllm("0.31.0")
    assert reason == ("kvcore-vllm supports vLLM >=0.32,<0.33 but vLLM 0.31.0 is installed; it "
                      "registers no backend, so vLLM runs its own (install a vLLM in that "
                      "range, or pip uninstall kvcore-vllm)")
    assert plugin.unsupported_vllm("0.33.0") is not None
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    registered = []
    monkeypatch.setattr(vllm_private, "register_backend", lambda *a: registered.append(a))
    with caplog.at_level("ERROR", logger="kvcore_vllm.plugin"):
        plugin.register()
    assert registered == [] and reason in caplog.text
