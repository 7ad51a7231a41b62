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


# FLASHINFER opts in to cross-layer caches (bit-exact on a GPU); FLASH_ATTN never ran
# anywhere; FLEX_ATTENTION would multiply its int32-limited span by the number of layers.
CROSS_LAYER = {"FLASHINFER": True, "FLASH_ATTN": False, "FLEX_ATTENTION": False}


@pytest.mark.parametrize("name", BACKENDS)
def test_layout_is_blocks_first_nhd_and_connector_safe(name):
    backend = kvcore.resolve_backend(name)
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    with_layers = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    assert with_layers == ((1, 0, 2, 3, 4, 5) if CROSS_LAYER[name] else tuple(range(6)))
    assert backend.supports_cross_layer() is CROSS_LAYER[name]
    assert backend.supports_kv_connector()
    block_size = 256 if name == "FLASH_ATTN" else 16  # a declared block size
    caches = kvcore.allocate_kv_caches(backend, num_layers=2, num_blocks=3, block_size=block_size,
                                       num_kv_heads=2, head_size=64, dtype=torch.float16,
                                       device="meta")
    assert caches.layout.is_blocks_first and caches.is_cross_layer is CROSS_LAYER[name]
    assert str(caches.layout) == ("B,L,2,N,H,D" if CROSS_LAYER[name] else "L,B,2,N,H,D")


def test_capabilities_are_listed_for_operators():
    rows = {name: kvcore.resolve_backend(name).capabilities() for name in BACKENDS}
    assert rows["FLASHINFER"]["head_sizes"] == "64, 128, 256"
    assert rows["FLASH_ATTN"]["block_sizes"] == "multiples of 256"
    assert rows["FLASH_ATTN"]["head_sizes"] == "multiples of 8 up to 256"
    assert rows["FLEX_ATTENTION"]["platforms"] == ["cuda", "cpu"]
    assert rows["FLEX_ATTENTION"]["min_device_capability"] is None
    assert {rows[n]["min_device_capability"] for n in ("FLASHINFER", "FLASH_ATTN")} == {"8.0"}
