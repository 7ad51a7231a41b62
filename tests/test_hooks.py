"""One end-to-end test per hook of ``kvcore/hookspecs.py``, named ``test_hook_<hook>``.

Each registers a plugin at run time (as an engine with private backends does) and follows the
registration through to what a user sees: selection, platform detection, ``get_connector``.
``tests/test_meta.py`` checks that every hook has such a test.
"""

from __future__ import annotations

import json

import pytest
import torch

import kvcore
from kvcore.backends.cpu_attn import CpuAttentionBackend
from kvcore.cli import main as kvcore_cli
from kvcore.connectors import BlockCopier, get_block_copier, get_connector
from kvcore.connectors.offload import OffloadConnector
from kvcore.testing import KernelCase
from kvcore.testing.compile_check import TARGETS, case_providers


class AcmeBackend(CpuAttentionBackend):
    """CPU_ATTN's kernels under another name, for the ``acme`` platform only."""

    PLATFORMS = ("acme",)

    @staticmethod
    def get_name() -> str:
        return "ACME_ATTN"


class AcmePlatform(kvcore.Platform):
    name = "acme"
    device_type = "cpu"
    detection_priority = -1  # never detected ahead of the real platforms

    def probe(self) -> str | None:
        return "no ACME accelerator in this machine"

    def get_backend_priorities(self, config, device_capability):
        return ["ACME_ATTN"]


class AcmePlugin:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register("ACME_ATTN", f"{__name__}:AcmeBackend")

    @kvcore.hookimpl
    def kvcore_register_platforms(self, register):
        register("acme", f"{__name__}:AcmePlatform")

    @kvcore.hookimpl
    def kvcore_register_connectors(self, register):
        register("acme_offload", "kvcore.connectors.offload:OffloadConnector")

    @kvcore.hookimpl
    def kvcore_register_block_copiers(self, register):
        register("acme_rows", f"{__name__}:AcmeRowCopier")

    @kvcore.hookimpl
    def kvcore_register_kernel_compile_cases(self, register):
        register("acme_kernels", f"{__name__}:acme_compile_cases")

    @kvcore.hookimpl
    def kvcore_register_status_reports(self, register):
        register("acme", f"{__name__}:acme_status")
        register("acme_broken", f"{__name__}:acme_broken_status")


def acme_status():
    return {"extension": "built (/tmp/acme.so)", "cache_write": "acme (the default)"}


def acme_broken_status():
    raise RuntimeError("the ACME driver is not loaded")


def acme_compile_cases(target):
    """One case per target; the launch is never run here (the session interprets Triton)."""
    return [KernelCase(f"acme write on {target.name}", lambda: None)]


class AcmeRowCopier(BlockCopier):
    """Copies rows with index_select/index_copy_ (CPU caches only)."""

    name = "acme_rows"

    def unavailable_reason(self, device):
        return None if device.type == "cpu" else f"acme_rows copies CPU tensors, not {device}"

    def copy_blocks(self, src, dst, block_mapping):
        dst.index_copy_(0, block_mapping[:, 1], src.index_select(0, block_mapping[:, 0]))
        return block_mapping.shape[0]


@pytest.fixture
def acme(fresh_kvcore):
    kvcore.register_plugin(AcmePlugin(), "acme")
    yield
    kvcore.unregister_plugin("acme")


def test_hook_kvcore_register_backends(acme, capsys):
    registration = kvcore.backend_registry().get("acme_attn")
    assert (registration.name, registration.plugin) == ("ACME_ATTN", "acme")
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    assert kvcore.get_attn_backend(config, backend="ACME_ATTN", platform="acme") is AcmeBackend
    report = kvcore.explain_selection(config, platform="cpu")
    (candidate,) = [c for c in report.candidates if c.name == "ACME_ATTN"]
    assert candidate.reasons == ["platform=cpu (supported: acme)"]
    assert kvcore_cli(["list", "--wide"]) == 0
    assert any(line.split()[:2] == ["ACME_ATTN", "acme"]
               for line in capsys.readouterr().out.splitlines())


def test_hook_kvcore_register_platforms(acme, monkeypatch):
    assert kvcore.get_platform("acme").probe() == "no ACME accelerator in this machine"
    assert kvcore.current_platform().name != "acme"  # absent, so never detected
    monkeypatch.setenv("KVCORE_PLATFORM", "acme")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "2.1")
    kvcore.clear_platform_cache()
    platform = kvcore.current_platform()
    assert (platform.name, platform.is_simulated) == ("acme", True)
    assert platform.get_device_capability() == kvcore.DeviceCapability(2, 1)
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    assert kvcore.get_attn_backend(config) is AcmeBackend


def test_hook_kvcore_register_connectors(acme):
    assert kvcore.connector_registry().get("acme_offload").plugin == "acme"
    connector = get_connector("acme_offload", capacity_bytes=1 << 16)
    assert type(connector) is OffloadConnector
    connector.close()
    with pytest.raises(kvcore.UnknownNameError, match="valid options are: .*acme_offload"):
        get_connector("acme_offlaod")


def test_hook_kvcore_register_block_copiers(acme):
    assert kvcore.block_copier_registry().get("acme_rows").plugin == "acme"
    assert isinstance(get_block_copier("ACME_ROWS"), AcmeRowCopier)
    kv = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=2, num_blocks=8, block_size=4,
                                   num_kv_heads=1, head_size=8, dtype=torch.float32,
                                   device="cpu", cross_layer=False)
    kv.storage.copy_(torch.randn(kv.storage.shape))
    before = [layer.clone() for layer in kv.layers]
    with get_connector("offload", capacity_bytes=1 << 16, block_copier="acme_rows") as conn:
        conn.register_kv_caches(kv)
        keys = [f"{i:064x}" for i in range(3)]
        assert conn.save(keys, [5, 1, 6]).wait().ok
        assert conn.load(keys, [0, 2, 7]).wait().ok
        assert conn.paths["copier"] == 2
    for layer_before, layer in zip(before, kv.layers, strict=True):
        assert torch.equal(layer[[0, 2, 7]], layer_before[[5, 1, 6]])
    with pytest.raises(kvcore.UnknownNameError, match="valid options are: .*acme_rows"):
        get_block_copier("acme_rowz")


def test_hook_kvcore_register_kernel_compile_cases(acme):
    providers = {owner: (path, provider) for owner, path, provider in case_providers()}
    assert providers["acme_kernels"][0] == f"{__name__}:acme_compile_cases"
    (case,) = providers["acme_kernels"][1](TARGETS["gfx942"])
    assert case.name == "acme write on gfx942"
    # kvcore's own kernels come through the same hook, as do the installed plugins'.
    assert {"kvcore", "kvcore_mla", "kvcore_rocm"} <= set(providers)


def test_hook_kvcore_register_status_reports(acme, capsys):
    reports = kvcore.plugin_status_reports()
    assert reports["acme"] == {"extension": "built (/tmp/acme.so)",
                               "cache_write": "acme (the default)"}
    # One plugin's failing report is its error; the others still report.
    assert reports["acme_broken"] == {"error": "RuntimeError: the ACME driver is not loaded"}
    assert kvcore_cli(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "  acme.extension: built (/tmp/acme.so)\n" in out
    assert "  acme_broken.error: RuntimeError: the ACME driver is not loaded" in out
    assert kvcore_cli(["collect-env", "--format", "json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["plugin_status"]["acme.cache_write"] == "acme (the default)"
