"""The plugin as kvcore sees it once installed: discovered, selectable, its connector usable."""

import pytest
import torch

import kvcore
from kvcore.connectors import get_connector, hash_request_tokens


def test_entry_point_registers_backend_and_connector():
    (info,) = [p for p in kvcore.list_plugins() if p.name == "example"]
    assert (info.distribution, info.status) == ("kvcore-example-plugin", "loaded")
    assert kvcore.backend_registry().get("SDPA_GATHER").plugin == "example"
    assert kvcore.connector_registry().get("example_memory").plugin == "example"


def test_selected_when_forced_and_explained_otherwise():
    config = kvcore.AttentionSelectorConfig(head_size=80, dtype=torch.float16)
    assert kvcore.get_attn_backend(config, backend="SDPA_GATHER", platform="cpu").get_name() \
        == "SDPA_GATHER"
    report = kvcore.explain_selection(
        kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float64), platform="cpu")
    (candidate,) = [c for c in report.candidates if c.name == "SDPA_GATHER"]
    assert candidate.reasons == ["dtype=float64 (supported: float16, bfloat16, float32)"]


def _filled_caches(cross_layer):
    caches = kvcore.allocate_kv_caches(
        "SDPA_GATHER", num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_size=16,
        dtype=torch.bfloat16, device="cpu", cross_layer=cross_layer)
    caches.storage.copy_(torch.randn(caches.storage.shape))
    return caches


@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross-layer", "per-layer"])
def test_saved_blocks_load_back_bit_exact_into_other_blocks(cross_layer):
    caches = _filled_caches(cross_layer)
    connector = get_connector("example_memory", max_blocks=4)
    connector.register_kv_caches(caches)
    keys = hash_request_tokens(list(range(12)), block_size=4)
    original = [layer[[1, 5, 6]].clone() for layer in caches.layers]
    assert connector.save(keys, [1, 5, 6]).wait().ok
    caches.storage.copy_(torch.randn(caches.storage.shape))
    result = connector.load(keys, [0, 2, 7]).wait()
    assert (result.succeeded, dict(result.failed)) == ((0, 2, 7), {})
    for layer, saved in zip(caches.layers, original, strict=True):
        assert torch.equal(layer[[0, 2, 7]].view(torch.int16), saved.view(torch.int16))


def test_full_store_and_unknown_keys_fail_per_block():
    connector = get_connector("example_memory", max_blocks=2)
    connector.register_kv_caches(_filled_caches(True))
    keys = hash_request_tokens(list(range(12)), block_size=4)
    saved = connector.save(keys, [1, 2, 3]).wait()
    assert (saved.succeeded, dict(saved.failed)) == ((1, 2), {3: "store full (2 blocks)"})
    assert connector.lookup(keys) == 2
    loaded = connector.load(keys, [4, 5, 6]).wait()
    assert loaded.succeeded == (4, 5) and list(loaded.failed) == [6]
    assert "never saved" in loaded.failed[6]


def test_options_are_checked_by_name():
    with pytest.raises(TypeError, match="unknown option.*capacity_bytes.*options: "
                                        "failure_policy, max_blocks"):
        get_connector("example_memory", capacity_bytes=1 << 20)
    with pytest.raises(ValueError, match="max_blocks=0 must be a positive integer"):
        get_connector("example_memory", max_blocks=0)
