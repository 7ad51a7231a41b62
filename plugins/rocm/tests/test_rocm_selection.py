"""Selection and validation of the ROCm backends on a simulated ROCm platform."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvcore

AITER_MISSING = ("amd-aiter not installed (pip install 'kvcore-rocm[aiter]'); ROCM_AITER_FA's "
                 "shuffled-cache attention runs only on aiter (use ROCM_AITER_UNIFIED_ATTN "
                 "without it)")
ROCM_ATTN_CONNECTOR = ("KV connector not supported: ROCM_ATTN keeps the legacy "
                       "(2, num_blocks, ...) layout; use ROCM_AITER_UNIFIED_ATTN")


def _config(**kw) -> kvcore.AttentionSelectorConfig:
    return kvcore.AttentionSelectorConfig(**{"head_size": 128, "dtype": torch.bfloat16, **kw})


def _reasons(backend, config, capability) -> list[str]:
    return backend.validate_configuration(**config.as_kwargs(), device_capability=capability)


@pytest.mark.parametrize(("capability", "plain", "with_connector"), [
    # gfx90a (MI200) is below AITER's gfx942, so a connector falls through to TRITON_ATTN.
    ("gfx90a", "ROCM_ATTN", "TRITON_ATTN"),
    ("gfx942", "ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"),
    ("gfx950", "ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"),
])
def test_selection_with_and_without_connector(rocm, capability, plain, with_connector):
    rocm(capability)
    assert kvcore.current_platform().name == "rocm"
    assert kvcore.get_attn_backend(_config()).get_name() == plain
    chosen = kvcore.get_attn_backend(_config(use_kv_connector=True))
    assert chosen.get_name() == with_connector
    assert chosen.supports_kv_connector()


def test_backends_come_from_the_rocm_plugin(rocm):
    rocm("gfx942")
    report = kvcore.explain_selection(_config(use_kv_connector=True))
    by_name = {c.name: c for c in report.candidates}
    for name in ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN", "ROCM_AITER_FA"):
        assert by_name[name].plugin == "rocm"
    assert not by_name["ROCM_ATTN"].in_priority_list  # dropped by the platform
    assert ROCM_ATTN_CONNECTOR in by_name["ROCM_ATTN"].reasons
    assert AITER_MISSING in by_name["ROCM_AITER_FA"].reasons


def test_validation_reasons_exact_text(rocm):
    rocm("gfx942")
    fa = kvcore.resolve_backend("ROCM_AITER_FA")
    unified = kvcore.resolve_backend("ROCM_AITER_UNIFIED_ATTN")
    rocm_attn = kvcore.resolve_backend("ROCM_ATTN")
    gfx942 = kvcore.DeviceCapability.parse("gfx942")
    assert _reasons(fa, _config(head_size=80), gfx942) == [
        "head_size=80 (supported: 64, 128, 256)", AITER_MISSING]
    assert _reasons(unified, _config(head_size=80), gfx942) == [
        "head_size=80 (supported: 64, 128, 256)"]
    assert _reasons(rocm_attn, _config(head_size=48), gfx942) == [
        "head_size=48 (supported: 32, 64, 80, 96, 128, 160, 192, 224, 256)"]
    assert _reasons(unified, _config(), kvcore.DeviceCapability.parse("gfx90a")) == [
        "device capability gfx90a (9.0) (supported: >= gfx942 (9.4) and <= gfx950 (9.5))"]
    assert _reasons(rocm_attn, _config(use_kv_connector=True), gfx942) == [
        ROCM_ATTN_CONNECTOR]
    assert _reasons(unified, _config(use_kv_connector=True), gfx942) == []


def test_forced_rocm_attn_with_connector_raises(rocm, monkeypatch):
    rocm("gfx942")
    with pytest.raises(kvcore.BackendSelectionError) as err:
        kvcore.get_attn_backend(_config(use_kv_connector=True), backend="ROCM_ATTN")
    assert ROCM_ATTN_CONNECTOR in str(err.value)
    monkeypatch.setenv("KVCORE_ATTENTION_BACKEND", "ROCM_ATTN")
    kvcore.clear_selection_cache()
    with pytest.raises(kvcore.BackendSelectionError, match="legacy"):
        kvcore.get_attn_backend(_config(use_kv_connector=True))


def test_layout_capabilities():
    fa = kvcore.resolve_backend("ROCM_AITER_FA")
    unified = kvcore.resolve_backend("ROCM_AITER_UNIFIED_ATTN")
    rocm_attn = kvcore.resolve_backend("ROCM_ATTN")
    assert fa.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    assert unified.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    assert rocm_attn.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert unified.supports_cross_layer()  # Triton path (aiter is not installed here)
    # ... verified on an NVIDIA GPU only: per-layer caches on ROCm until an AMD run passes.
    assert not unified.supports_cross_layer("rocm") and unified.supports_cross_layer("cuda")
    assert "verified on cuda only" in unified.cross_layer_note("rocm")
    assert not fa.supports_cross_layer() and not rocm_attn.supports_cross_layer()
    assert not rocm_attn.supports_kv_connector()
    assert rocm_attn.capabilities()["min_device_capability"] == "gfx90a (9.0)"
    layout = kvcore.KVCacheLayout.from_backend(
        rocm_attn, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64,
        dtype=torch.float16)
    assert not layout.is_blocks_first and str(layout) == "2,B,N,H,D"


def test_cli_explain_shows_rocm_attn_excluded():
    env = {**os.environ, "KVCORE_PLUGINS": "rocm"}
    for var in ("KVCORE_PLATFORM", "KVCORE_DEVICE_CAPABILITY", "KVCORE_ATTENTION_BACKEND"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "select", "--explain", "--platform", "rocm",
         "--capability", "gfx942", "--kv-connector"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    lines = out.splitlines()
    assert "selected: ROCM_AITER_UNIFIED_ATTN" in lines
    row = lines.index("  ROCM_ATTN: rejected [plugin rocm]")
    assert lines[row + 1] == f"    - {ROCM_ATTN_CONNECTOR}"
