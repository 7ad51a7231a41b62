"""Selection on each (simulated) platform, with exact reasons."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import AttentionSelectorConfig as Config

pytestmark = pytest.mark.platform_matrix


def test_cpu_selects_cpu_attn(fresh_kvcore):
    assert kvcore.get_attn_backend(Config(head_size=80), platform="cpu").get_name() == "CPU_ATTN"


def test_config_is_frozen_hashable_and_normalised():
    a = Config(head_size=128, dtype="bf16", attn_type="decoder")
    b = Config(head_size=128, dtype=torch.bfloat16)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.head_size = 64  # type: ignore[misc]


def test_head_counts_change_no_validity_and_are_named_only_when_given(fresh_kvcore):
    plain = Config(head_size=128)
    headed = Config(head_size=128, num_heads=8, num_kv_heads=1)
    assert "num_heads" not in plain.describe()
    assert headed.describe().endswith("num_heads=8, num_kv_heads=1")
    for name in ("cpu", "cuda"):
        a, b = kvcore.explain_selection(plain, name), kvcore.explain_selection(headed, name)
        # The order may differ (a shipped ranking narrows to the same heads), not a reason.
        assert {c.name: c.reasons for c in a.candidates} == \
            {c.name: c.reasons for c in b.candidates}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_size": 0}, "head_size=0 must be a positive integer"),
        ({"head_size": 64, "block_size": -16}, "block_size=-16 must be a positive integer"),
        ({"head_size": 64, "dtype": "int7"}, "dtype='int7' is not a known dtype name"),
        ({"head_size": 64, "kv_cache_dtype": "int4"}, "kv_cache_dtype='int4' (supported: auto"),
        ({"head_size": 64, "num_kv_heads": 0}, "num_kv_heads=0 must be a positive integer or"),
        ({"head_size": 64, "num_heads": True}, "num_heads=True must be a positive integer or"),
        ({"head_size": 64, "num_heads": 12, "num_kv_heads": 8},
         "num_heads=12 is not a multiple of num_kv_heads=8"),
    ],
    ids=["head_size", "block_size", "dtype", "kv_cache_dtype", "num_kv_heads", "num_heads-bool",
         "heads-not-a-multiple"],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Config(**kwargs)


def test_no_valid_backend_lists_config_and_every_reason(fresh_kvcore):
    with pytest.raises(kvcore.NoValidBackendError) as err:
        kvcore.get_attn_backend(Config(head_size=64, use_mla=True, has_sink=True), platform="cpu")
    text = str(err.value)
    assert "no valid attention backend for this config on cpu" in text
    assert "config: head_size=64, dtype=bfloat16" in text
    assert "  CPU_ATTN: rejected [plugin builtin_backends]\n" \
           "    - use_mla=True but CPU_ATTN is not an MLA backend (choose an MLA backend)" in text
    assert "  CPU_MLA: rejected [plugin builtin_backends]\n" \
           "    - has_sink=True: CPU_MLA does not support attention sinks" in text
    assert err.value.report.selected is None


def test_cpu_picks_cpu_mla_for_mla_layers(fresh_kvcore):
    assert kvcore.get_attn_backend(Config(head_size=576, use_mla=True),
                                   platform="cpu").get_name() == "CPU_MLA"


def test_cuda_without_vendor_plugins_explains_what_to_install(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_PLATFORM", "cuda")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    report = kvcore.explain_selection(Config(head_size=128))
    assert report.platform == "cuda" and report.simulated
    assert report.device_capability == kvcore.DeviceCapability(9, 0)
    names = [c.name for c in report.candidates]
    assert names[:2] == ["FLASHINFER", "FLASH_ATTN"]
    flash = report.candidates[1]
    if "FLASH_ATTN" not in kvcore.backend_registry():
        assert flash.reasons == [
            "FLASH_ATTN is not registered by any installed plugin; it ships in kvcore-nvidia "
            "(pip install -e plugins/nvidia)"]
    cpu = next(c for c in report.candidates if c.name == "CPU_ATTN")
    assert cpu.reasons == ["platform=cuda (supported: cpu)"] and not cpu.in_priority_list


def test_cuda_priorities_lead_with_its_shipped_order_where_it_measured(fresh_kvcore):
    """On 9.0 the order of CUDA's shipped ranking (kvcore tune on Hopper) leads; on other
    capabilities the unmeasured order stands, MLA layers depending on the capability."""
    cuda = kvcore.get_platform("cuda")
    config = Config(head_size=128)
    unmeasured = ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
    for capability in ("8.0", "10.0"):
        assert cuda.get_backend_priorities(
            config, kvcore.DeviceCapability.parse(capability)) == unmeasured
        assert cuda.phase_rankings(config, kvcore.DeviceCapability.parse(capability)) == ()
    nine = kvcore.DeviceCapability(9, 0)
    shipped = cuda.shipped_order(config, nine)
    assert cuda.get_backend_priorities(config, nine) == shipped.reorder(unmeasured)
    assert cuda.get_backend_priorities(config, nine)[0] == shipped.order[0]
    assert cuda.phase_rankings(config, nine) == shipped.phases
    mla = Config(head_size=576, use_mla=True)  # no MLA case shipped yet: the unmeasured order
    assert cuda.get_backend_priorities(mla, nine) == ["FLASHINFER_MLA", "TRITON_MLA"]
    assert cuda.get_backend_priorities(mla, kvcore.DeviceCapability(8, 0))[0] == "TRITON_MLA"
    assert cuda.phase_rankings(config, None) == ()
    assert kvcore.get_platform("cpu").phase_rankings(config, None) == ()
    with pytest.raises(ValueError, match="tiers"):
        kvcore.PhaseRanking("decode", (), "nothing")


def test_rocm_drops_rocm_attn_with_kv_connector(with_plugins, monkeypatch, caplog):
    with_plugins("standin_rocm")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "gfx942")
    plain = kvcore.get_attn_backend(Config(head_size=128), platform="rocm")
    assert plain.get_name() == "ROCM_ATTN"
    with caplog.at_level("INFO", logger="kvcore.platforms.rocm"):
        report = kvcore.explain_selection(Config(head_size=128, use_kv_connector=True), "rocm")
    assert report.selected.name == "ROCM_AITER_UNIFIED_ATTN"
    rocm_attn = next(c for c in report.candidates if c.name == "ROCM_ATTN")
    assert not rocm_attn.in_priority_list
    # a backend the platform left out is listed with the non-platform ones, never tried first
    names = [c.name for c in report.candidates]
    assert names.index("ROCM_ATTN") > names.index("CPU_ATTN")
    assert rocm_attn.reasons == [
        "KV connector not supported: ROCM_ATTN keeps the legacy (2, num_blocks, ...) layout; "
        "use ROCM_AITER_UNIFIED_ATTN"]
    assert "ROCM_ATTN left out of the ROCm candidates" in caplog.text


def test_rocm_capability_too_old_is_a_reason(with_plugins, monkeypatch):
    with_plugins("standin_rocm")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "gfx90a")
    report = kvcore.explain_selection(Config(head_size=128, use_kv_connector=True), "rocm")
    aiter = next(c for c in report.candidates if c.name == "ROCM_AITER_UNIFIED_ATTN")
    assert aiter.reasons == ["device capability gfx90a (9.0) (supported: >= 9.4)"]


def test_unknown_capability_says_how_to_set_it(with_plugins):
    with_plugins("standin_rocm")
    report = kvcore.explain_selection(Config(head_size=128), "rocm")
    aiter = next(c for c in report.candidates if c.name == "ROCM_AITER_UNIFIED_ATTN")
    assert aiter.reasons == [
        "device capability unknown; ROCM_AITER_UNIFIED_ATTN needs >= 9.4 "
        "(set KVCORE_DEVICE_CAPABILITY=gfx942 to simulate such a device)"]  # rocm's spelling


def test_forced_backend_that_is_invalid_raises_with_reasons(with_plugins, monkeypatch):
    with_plugins("standin_rocm")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "gfx942")
    with pytest.raises(kvcore.BackendSelectionError) as err:
        kvcore.get_attn_backend(Config(head_size=128, use_kv_connector=True),
                                backend="ROCM_ATTN", platform="rocm")
    assert str(err.value).startswith(
        "attention backend ROCM_ATTN was requested by the backend argument but cannot run this "
        "config on rocm: KV connector not supported: ROCM_ATTN keeps the legacy")


def test_forced_backend_from_env_never_falls_back(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_ATTENTION_BACKEND", "CPU_ATTN")
    with pytest.raises(kvcore.BackendSelectionError,
                       match=r"requested by KVCORE_ATTENTION_BACKEND=CPU_ATTN .*"
                             r"platform=cuda \(supported: cpu\)"):
        kvcore.get_attn_backend(Config(head_size=64), platform="cuda")


def test_forced_unknown_backend_lists_valid_names(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_ATTENTION_BACKEND", "FLASH_ATTN_9000")
    with pytest.raises(kvcore.BackendSelectionError,
                       match="KVCORE_ATTENTION_BACKEND=FLASH_ATTN_9000: unknown attention "
                             "backend 'FLASH_ATTN_9000'; valid options are: .*CPU_ATTN"):
        kvcore.get_attn_backend(Config(head_size=64), platform="cpu")


def test_forced_valid_backend_is_selected(fresh_kvcore):
    backend = kvcore.get_attn_backend(Config(head_size=64), backend="cpu_attn", platform="cpu")
    assert backend.get_name() == "CPU_ATTN"


def test_import_error_inside_checks_becomes_a_reason(fresh_kvcore):
    class NeedsAcme(kvcore.AttentionBackend):
        PLATFORMS = ("cpu",)

        @staticmethod
        def get_name():
            return "NEEDS_ACME"

        @staticmethod
        def get_impl_cls():
            raise NotImplementedError

        @classmethod
        def check_combination(cls, config, device_capability):
            import acme_kernels  # noqa: F401  (not installed)
            return []

    import sys
    import types

    module = types.ModuleType("kvcore_test_needs_acme")
    module.NeedsAcme = NeedsAcme
    sys.modules[module.__name__] = module

    class Plugin:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("NEEDS_ACME", "kvcore_test_needs_acme:NeedsAcme")

    kvcore.register_plugin(Plugin(), "needs-acme")
    try:
        report = kvcore.explain_selection(Config(head_size=64), "cpu")
        acme = next(c for c in report.candidates if c.name == "NEEDS_ACME")
        assert acme.reasons == [
            "NEEDS_ACME could not check the config: ModuleNotFoundError: "
            "No module named 'acme_kernels'"]
        assert report.selected.name == "CPU_ATTN"
    finally:
        kvcore.unregister_plugin("needs-acme")
        sys.modules.pop(module.__name__)


def test_selection_is_cached_and_cache_clears(fresh_kvcore, monkeypatch):
    from kvcore import selector

    config = Config(head_size=64)
    kvcore.get_attn_backend(config, platform="cpu")
    calls = []
    monkeypatch.setattr(selector, "explain_selection",
                        lambda *a, **k: calls.append(a) or pytest.fail("not cached"))
    kvcore.get_attn_backend(config, platform="cpu")
    assert not calls
    kvcore.clear_selection_cache()
    with pytest.raises(pytest.fail.Exception):
        kvcore.get_attn_backend(config, platform="cpu")


def test_plugin_changes_forget_cached_selections(fresh_kvcore, monkeypatch):
    from kvcore import selector

    class Other:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("OTHER_ATTN", "kvcore.backends.cpu_attn:CpuAttentionBackend")

    config = Config(head_size=64)
    kvcore.get_attn_backend(config, platform="cpu")
    monkeypatch.setattr(selector, "explain_selection",
                        lambda *a, **k: pytest.fail("not re-selected"))
    kvcore.get_attn_backend(config, platform="cpu")  # cached
    kvcore.register_plugin(Other(), "other")
    try:
        with pytest.raises(pytest.fail.Exception, match="not re-selected"):
            kvcore.get_attn_backend(config, platform="cpu")
    finally:
        kvcore.unregister_plugin("other")


def test_unknown_platform_lists_valid_names(fresh_kvcore):
    with pytest.raises(kvcore.UnknownNameError,
                       match="unknown platform 'tpu'; valid options are: cpu, cuda, rocm"):
        kvcore.get_platform("tpu")


def test_report_serialises(fresh_kvcore):
    data = kvcore.explain_selection(Config(head_size=64), "cpu").to_dict()
    assert data["selected"] == "CPU_ATTN" and data["config"]["dtype"] == "bfloat16"
    assert data["config"]["attn_type"] == "decoder"


def test_cuda_picks_triton_when_no_vendor_backend_is_valid(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    monkeypatch.setenv("KVCORE_PLUGINS", "")  # no vendor plugins, whatever is installed
    kvcore.reset_plugins()
    report = kvcore.explain_selection(Config(head_size=128), "cuda")
    assert report.selected.name == "TRITON_ATTN"
    assert [c.name for c in report.candidates[:4]] == [
        "FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]


@pytest.mark.parametrize(
    ("capability", "kwargs", "reason"),
    [("7.5", {}, "device capability 7.5 (supported: >= 8.0)"),
     ("8.0", {"kv_cache_dtype": "fp8"},
      "kv_cache_dtype=fp8 needs device capability >= 8.9 on CUDA for fp8 conversions (got 8.0); "
      "use kv_cache_dtype=auto"),
     ("9.0", {"head_size": 320}, "head_size=320 (supported: multiples of 8 up to 256)")],
    ids=["turing", "fp8-on-ampere", "head-size-320"],
)
def test_triton_attn_reasons(fresh_kvcore, monkeypatch, capability, kwargs, reason):
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", capability)
    report = kvcore.explain_selection(Config(**{"head_size": 128, **kwargs}), "cuda")
    triton_attn = next(c for c in report.candidates if c.name == "TRITON_ATTN")
    assert reason in triton_attn.reasons


def test_a_backend_listed_twice_by_a_platform_is_one_candidate(fresh_kvcore, monkeypatch):
    cpu = kvcore.get_platform("cpu")
    monkeypatch.setattr(type(cpu), "get_backend_priorities",
                        lambda self, config, capability: ["CPU_ATTN", "cpu_attn"])
    report = kvcore.explain_selection(Config(head_size=64, dtype=torch.float32), platform=cpu)
    names = [c.name for c in report.candidates]
    assert names.count("CPU_ATTN") == 1 and report.selected.name == "CPU_ATTN"
