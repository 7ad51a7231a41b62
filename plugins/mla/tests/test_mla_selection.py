"""MLA selection on simulated CUDA and ROCm machines: MLA configs get MLA backends only,
non-MLA configs never get one, and unsupported features are rejected with a reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kvcore


@pytest.fixture
def simulate(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``simulate(platform, capability)`` forces the platform; caches are cleared around it."""

    def apply(platform: str, capability: str) -> None:
        monkeypatch.setenv("KVCORE_PLATFORM", platform)
        monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", capability)
        kvcore.clear_platform_cache()
        kvcore.clear_selection_cache()

    monkeypatch.delenv("KVCORE_ATTENTION_BACKEND", raising=False)
    yield apply
    kvcore.clear_platform_cache()
    kvcore.clear_selection_cache()


PLATFORMS = [("cuda", "9.0"), ("rocm", "gfx942")]
MLA_CONFIG = dict(head_size=576, dtype=torch.bfloat16, block_size=64, use_mla=True)


def test_plugin_registers_triton_mla_through_its_entry_point() -> None:
    info = next(p for p in kvcore.list_plugins() if p.name == "mla")
    assert (info.distribution, info.source, info.status) == ("kvcore-mla", "entry point", "loaded")
    assert kvcore.backend_registry().get("TRITON_MLA").plugin == "mla"


@pytest.mark.parametrize(("platform", "capability"), PLATFORMS)
def test_mla_config_selects_triton_mla(simulate, platform: str, capability: str) -> None:
    simulate(platform, capability)
    config = kvcore.AttentionSelectorConfig(**MLA_CONFIG)
    report = kvcore.explain_selection(config)
    # On CUDA >= 9.0, kvcore-nvidia's FLASHINFER_MLA comes first where it can run (FlashInfer
    # installed); TRITON_MLA is the choice otherwise.
    first = next((c for c in report.candidates if c.name == "FLASHINFER_MLA" and c.valid), None)
    expected = "FLASHINFER_MLA" if first is not None else "TRITON_MLA"
    assert kvcore.get_attn_backend(config).get_name() == expected
    for candidate in report.candidates:
        if candidate.valid:
            assert kvcore.resolve_backend(candidate.name).IS_MLA, candidate.name


@pytest.mark.parametrize(("platform", "capability"), PLATFORMS)
@pytest.mark.parametrize("head_size", [64, 128, 576])
def test_non_mla_config_never_gets_an_mla_backend(simulate, platform: str, capability: str,
                                                  head_size: int) -> None:
    simulate(platform, capability)
    config = kvcore.AttentionSelectorConfig(head_size=head_size, dtype=torch.bfloat16)
    report = kvcore.explain_selection(config)
    triton_mla = next(c for c in report.candidates if c.name == "TRITON_MLA")
    assert "use_mla=False but TRITON_MLA only runs MLA layers" in triton_mla.reasons
    for candidate in report.candidates:
        if candidate.valid:
            assert not kvcore.resolve_backend(candidate.name).IS_MLA, candidate.name


def test_forcing_triton_mla_for_a_non_mla_layer_raises_its_reason(simulate, monkeypatch) -> None:
    simulate("cuda", "9.0")
    monkeypatch.setenv("KVCORE_ATTENTION_BACKEND", "TRITON_MLA")
    config = kvcore.AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16)
    with pytest.raises(kvcore.BackendSelectionError, match="only runs MLA layers"):
        kvcore.get_attn_backend(config)


@pytest.mark.parametrize(("platform", "capability"), PLATFORMS)
def test_sparse_mla_is_rejected_with_a_reason(simulate, platform: str, capability: str) -> None:
    simulate(platform, capability)
    config = kvcore.AttentionSelectorConfig(**MLA_CONFIG, use_sparse=True)
    with pytest.raises(kvcore.NoValidBackendError) as info:
        kvcore.get_attn_backend(config)
    triton_mla = next(c for c in info.value.report.candidates if c.name == "TRITON_MLA")
    assert "use_sparse=True: TRITON_MLA does not support sparse attention" in triton_mla.reasons
    assert "use_sparse=True: TRITON_MLA" in str(info.value)


@pytest.mark.parametrize(("platform", "capability", "kv_cache_dtype", "dtype", "reason"), [
    ("cuda", "8.0", "fp8", torch.bfloat16, "kv_cache_dtype=fp8 needs device capability >= 8.9"),
    ("cuda", "7.5", "auto", torch.float16, "device capability 7.5 (supported: >= 8.0)"),
    ("cuda", "9.0", "fp8", torch.bfloat16, None),
    ("cuda", "8.0", "auto", torch.bfloat16, None),
    ("rocm", "gfx942", "fp8", torch.bfloat16, None),
])
def test_device_limits_are_reasons(simulate, platform: str, capability: str,
                                   kv_cache_dtype: str, dtype: torch.dtype,
                                   reason: str | None) -> None:
    simulate(platform, capability)
    config = kvcore.AttentionSelectorConfig(head_size=576, dtype=dtype, block_size=64,
                                            use_mla=True, kv_cache_dtype=kv_cache_dtype)
    report = kvcore.explain_selection(config)
    triton_mla = next(c for c in report.candidates if c.name == "TRITON_MLA")
    if reason is None:
        assert triton_mla.valid, triton_mla.reasons
    else:
        assert any(reason in r for r in triton_mla.reasons), triton_mla.reasons


def test_cpu_runs_mla_on_cpu_mla_not_triton_mla(simulate) -> None:
    simulate("cpu", "")  # a CPU has no device capability (9.0 there is refused)
    report = kvcore.explain_selection(kvcore.AttentionSelectorConfig(**MLA_CONFIG))
    assert report.selected.name == "CPU_MLA"
    triton_mla = next(c for c in report.candidates if c.name == "TRITON_MLA")
    assert "platform=cpu (supported: cuda, rocm)" in triton_mla.reasons


def test_triton_mla_is_cross_layer_on_cuda_only(simulate) -> None:
    """Verified bit-exact on NVIDIA only: per-layer caches on ROCm until a ROCm run passes the
    cross-layer tests, and the explanation says so."""
    backend = kvcore.resolve_backend("TRITON_MLA")
    assert backend.supports_cross_layer("cuda") and not backend.supports_cross_layer("rocm")
    args = dict(num_layers=2, num_blocks=4, block_size=64, num_kv_heads=1, head_size=576,
                dtype=torch.bfloat16, device="meta")
    assert kvcore.allocate_kv_caches(backend, platform="cuda", **args).is_cross_layer
    assert not kvcore.allocate_kv_caches(backend, platform="rocm", **args).is_cross_layer
    with pytest.raises(ValueError, match="TRITON_MLA's cross-layer layout is verified on cuda "
                                         "only; on rocm"):
        kvcore.allocate_kv_caches(backend, platform="rocm", cross_layer=True, **args)
    simulate("rocm", "gfx942")
    report = kvcore.explain_selection(kvcore.AttentionSelectorConfig(**MLA_CONFIG))
    mla = next(c for c in report.candidates if c.name == "TRITON_MLA")
    assert mla.selected and mla.notes == [backend.cross_layer_note("rocm")]
