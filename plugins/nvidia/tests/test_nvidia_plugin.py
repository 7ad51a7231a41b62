"""kvcore-nvidia as a third party ships it: its installed distribution's entry point, lazy
registration, and the layout each backend declares."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import kvcore

BACKENDS = {
    "FLASHINFER": "kvcore_nvidia.backends.flashinfer:FlashInferBackend",
    "FLASH_ATTN": "kvcore_nvidia.backends.flash_attn:FlashAttentionBackend",
    "FLEX_ATTENTION": "kvcore_nvidia.backends.flex_attention:FlexAttentionBackend",
}


def test_the_installed_distribution_declares_the_entry_point():
    dist = metadata.distribution("kvcore-nvidia")
    points = [ep for ep in dist.entry_points if ep.group == "kvcore.plugins"]
    assert [(ep.name, ep.value) for ep in points] == [("nvidia", "kvcore_nvidia.plugin")]


def test_entry_point_discovery_registers_the_backends(cuda):
    cuda("9.0")  # KVCORE_PLUGINS=nvidia: loaded from entry points, as a third party is
    info = next(p for p in kvcore.list_plugins() if p.name == "nvidia")
    assert (info.distribution, info.module, info.source, info.status) == (
        "kvcore-nvidia", "kvcore_nvidia.plugin", "entry point", "loaded")
    registry = kvcore.backend_registry()
    for name, path in BACKENDS.items():
        entry = registry.get(name)
        assert (entry.plugin, entry.target) == ("nvidia", path)
        assert kvcore.resolve_backend(name).get_name() == name


def test_registration_and_validation_import_no_kernel_library():
    code = (
        "import json, sys, kvcore, torch\n"
        "cfg = kvcore.AttentionSelectorConfig(head_size=128)\n"
        "names = kvcore.backend_registry().names()\n"
        "reasons = kvcore.explain_selection(cfg, platform='cuda').to_dict()\n"
        "heavy = ['flashinfer', 'flash_attn', 'torch.nn.attention.flex_attention',\n"
        "         'kvcore_nvidia.ops._build', 'torch.utils.cpp_extension']\n"
        "print(json.dumps({'names': names, 'loaded': [m for m in heavy if m in sys.modules]}))\n")
    env_out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**_clean_env(), "KVCORE_PLUGINS": "nvidia",
                                              "KVCORE_DEVICE_CAPABILITY": "9.0"}).stdout
    result = json.loads(env_out)
    assert set(BACKENDS) <= set(result["names"])
    assert result["loaded"] == []


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if k not in ("KVCORE_PLATFORM", "KVCORE_ATTENTION_BACKEND", "KVCORE_PLUGINS",
                         "KVCORE_DISABLE_PLUGIN_AUTOLOAD", "KVCORE_DEVICE_CAPABILITY")}


# (per-layer order, order with layers, layout of a 2-layer cache on CUDA). FLASHINFER is NHD;
# FLASH_ATTN and FLEX_ATTENTION interleave K and V per token as upstream does. FLASHINFER and
# FLASH_ATTN are cross-layer on CUDA (bit-exact on the H200); FLEX_ATTENTION stays per-layer
# there until its cross-layer GPU test passes.
LAYOUTS = {
    "FLASHINFER": ((0, 1, 2, 3, 4), (1, 0, 2, 3, 4, 5), "B,L,2,N,H,D"),
    "FLASH_ATTN": ((0, 2, 1, 3, 4), (1, 0, 3, 2, 4, 5), "B,L,N,2,H,D"),
    "FLEX_ATTENTION": ((0, 2, 1, 3, 4), (1, 0, 3, 2, 4, 5), "L,B,N,2,H,D"),
}


@pytest.mark.parametrize("name", BACKENDS)
def test_layout_is_blocks_first_and_connector_safe(name):
    backend = kvcore.resolve_backend(name)
    per_layer, with_layers, on_cuda = LAYOUTS[name]
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    assert backend.get_kv_cache_stride_order() == per_layer
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == with_layers
    assert backend.supports_cross_layer()  # the order opts in ...
    assert backend.supports_cross_layer("cuda") is on_cuda.startswith("B")  # ... verified?
    assert backend.supports_kv_connector()
    caches = kvcore.allocate_kv_caches(backend, num_layers=2, num_blocks=3, block_size=16,
                                       num_kv_heads=2, head_size=64, dtype=torch.float16,
                                       device="meta", platform="cuda")
    assert caches.layout.is_blocks_first and str(caches.layout) == on_cuda


def test_capabilities_are_listed_for_operators():
    rows = {name: kvcore.resolve_backend(name).capabilities() for name in BACKENDS}
    assert rows["FLASHINFER"]["head_sizes"] == "64, 128, 256"
    assert rows["FLASH_ATTN"]["block_sizes"] == "any"  # the envelope; per library below
    assert rows["FLASH_ATTN"]["head_sizes"] == "multiples of 8 up to 256"
    assert [(k["library"], k["devices"], k["head_sizes"], k["block_sizes"])
            for k in rows["FLASH_ATTN"]["libraries"]] == [
        ("flash-attn-4", "9.0-9.x", "multiples of 8 up to 256", "any"),
        ("flash-attn-4", "10.0-11.x", "multiples of 8 up to 128, 256", "any"),
        ("flash-attn 2", ">= 8.0", "multiples of 8 up to 256", "multiples of 256")]
    assert rows["FLEX_ATTENTION"]["platforms"] == ["cuda", "cpu"]
    assert rows["FLEX_ATTENTION"]["min_device_capability"] is None
    assert {rows[n]["min_device_capability"] for n in ("FLASHINFER", "FLASH_ATTN")} == {"8.0"}
