"""Platforms: detection, overrides, and block movement along dim 0."""

from __future__ import annotations

import pytest
import torch

import kvcore


def test_detection_falls_back_to_cpu_here(fresh_kvcore):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert kvcore.current_platform().name == "cpu"
    reasons = dict(kvcore.available_platforms())
    assert reasons["cpu"] is None
    assert reasons["cuda"].startswith("this torch build") or "is_available" in reasons["cuda"]


def test_env_forces_a_simulated_platform_and_capability(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_PLATFORM", "rocm")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "gfx950")
    platform = kvcore.current_platform()
    assert platform.name == "rocm"
    # simulated exactly when this machine has no ROCm device (independent of the probe's code)
    has_rocm = getattr(torch.version, "hip", None) is not None and torch.cuda.is_available()
    assert platform.is_simulated is not has_rocm
    assert platform.get_device_capability() == kvcore.DeviceCapability(9, 5)
    assert "gfx950" in platform.describe()


def _caches(num_blocks, device="cpu"):
    return kvcore.allocate_kv_caches("CPU_ATTN", num_layers=3, num_blocks=num_blocks,
                                     block_size=4, num_kv_heads=2, head_size=8,
                                     dtype=torch.float32, device=device)


def test_swap_out_and_insert_move_whole_blocks_along_dim0():
    cpu = kvcore.get_platform("cpu")
    device_caches, host_caches = _caches(6), _caches(4)
    device_caches.storage.copy_(torch.randn(device_caches.storage.shape))
    host_caches.storage.copy_(torch.randn(host_caches.storage.shape))
    src, dst = device_caches.layers[1], host_caches.layers[1]
    neighbours = host_caches.layers[0].clone(), host_caches.layers[2].clone()
    cpu.swap_out_blocks_to_host(src, dst, torch.tensor([5, 0]), torch.tensor([1, 3]),
                                layout=device_caches.layout)
    assert torch.equal(dst[1], src[5]) and torch.equal(dst[3], src[0])
    assert torch.equal(host_caches.layers[0], neighbours[0])
    assert torch.equal(host_caches.layers[2], neighbours[1])
    back = _caches(6)
    cpu.insert_blocks_to_device(dst, back.layers[1], torch.tensor([1, 3]), torch.tensor([2, 4]),
                                layout=back.layout)
    assert torch.equal(back.layers[1][2], src[5]) and torch.equal(back.layers[1][4], src[0])


@pytest.mark.parametrize(
    ("src_idx", "dst_idx", "message"),
    [([6], [0], r"src_block_indices contains block id 6, outside the cache's 6 blocks"),
     ([0], [-1], r"dst_block_indices contains block id -1"),
     ([0, 1], [0], "src_block_indices has 2 entries but dst_block_indices has 1"),
     ([[0]], [0], r"src_block_indices must be 1-D")],
    ids=["src-out-of-range", "dst-negative", "length-mismatch", "not-1d"],
)
def test_block_movement_validates_indices(src_idx, dst_idx, message):
    cpu = kvcore.get_platform("cpu")
    with pytest.raises(ValueError, match=message):
        src = _caches(6)
        cpu.swap_out_blocks_to_host(src.layers[0], _caches(4).layers[0],
                                    torch.tensor(src_idx), torch.tensor(dst_idx),
                                    layout=src.layout)


def test_block_movement_refuses_a_layout_that_is_not_blocks_first():
    legacy = kvcore.KVCacheLayout((2, 6, 4, 2, 8), (0, 1, 2, 3, 4), ("2", "B", "N", "H", "D"),
                                  torch.float32)
    cache = torch.randn(2, 6, 4, 2, 8)
    with pytest.raises(ValueError, match="the cache layout 2,B,N,H,D is not blocks-first"):
        kvcore.get_platform("cpu").swap_out_blocks_to_host(
            cache, torch.empty_like(cache), torch.tensor([0]), torch.tensor([1]), layout=legacy)


def test_block_movement_refuses_mismatched_pages():
    caches = _caches(4)
    with pytest.raises(ValueError, match=r"dst_cache has shape \(4, 2, 4, 2, 4\), which is not"):
        kvcore.get_platform("cpu").insert_blocks_to_device(
            caches.layers[0], caches.layers[0][..., :4], torch.tensor([0]), torch.tensor([0]),
            layout=caches.layout)


@pytest.mark.parametrize("direction", ["swap_out_blocks_to_host", "insert_blocks_to_device"])
def test_block_movement_requires_the_layout(direction):
    """Without the layout a legacy (2, num_blocks, ...) cache would have its K halves moved
    as if they were blocks: the layout is a required keyword, None is refused."""
    legacy = torch.randn(2, 6, 4, 2, 8)
    move = getattr(kvcore.get_platform("cpu"), direction)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'layout'"):
        move(legacy, torch.empty_like(legacy), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(TypeError, match="layout must be the caches' KVCacheLayout"):
        move(legacy, torch.empty_like(legacy), torch.tensor([0]), torch.tensor([1]), layout=None)


@pytest.mark.gpu
def test_round_trip_through_the_gpu():
    platform = kvcore.current_platform()
    device_caches, host_caches = _caches(6, platform.device()), _caches(4)
    device_caches.storage.copy_(torch.randn(device_caches.storage.shape))
    platform.swap_out_blocks_to_host(device_caches.layers[1], host_caches.layers[1],
                                     torch.tensor([5]), torch.tensor([2]),
                                     layout=device_caches.layout)
    platform.insert_blocks_to_device(host_caches.layers[1], device_caches.layers[2],
                                     torch.tensor([2]), torch.tensor([0]),
                                     layout=device_caches.layout)
    assert torch.equal(device_caches.layers[2][0], device_caches.layers[1][5])


def test_block_movement_refuses_duplicate_destination_ids():
    src, dst = _caches(4), _caches(4)
    before = dst.storage.clone()
    with pytest.raises(ValueError, match=r"dst_block_indices repeats block ids \[2\]"):
        kvcore.get_platform("cpu").insert_blocks_to_device(
            src.layers[0], dst.layers[0], torch.tensor([0, 1]), torch.tensor([2, 2]),
            layout=dst.layout)
    assert torch.equal(dst.storage, before)  # nothing moved
    # A repeated *source* is fine: one block copied to two places.
    kvcore.get_platform("cpu").insert_blocks_to_device(
        src.layers[0], dst.layers[0], torch.tensor([1, 1]), torch.tensor([2, 3]),
        layout=dst.layout)


class _ExplodingPlatform(kvcore.Platform):
    name = "exploding"
    device_type = "cpu"
    detection_priority = 1000  # probed first

    def probe(self):
        raise RuntimeError("driver exploded")

    def get_backend_priorities(self, config, device_capability):
        return []


class _ExplodingPlugin:
    @kvcore.hookimpl
    def kvcore_register_platforms(self, register):
        register("exploding", f"{__name__}:_ExplodingPlatform")


def test_a_platform_whose_probe_raises_does_not_break_detection(fresh_kvcore):
    kvcore.register_plugin(_ExplodingPlugin(), "exploding")
    try:
        assert kvcore.current_platform().name == "cpu"
    finally:
        kvcore.unregister_plugin("exploding")


def test_plugin_changes_forget_platform_instances(fresh_kvcore):
    kvcore.register_plugin(_ExplodingPlugin(), "exploding")
    assert isinstance(kvcore.get_platform("exploding"), _ExplodingPlatform)
    kvcore.unregister_plugin("exploding")
    with pytest.raises(kvcore.UnknownNameError, match="exploding"):
        kvcore.get_platform("exploding")


def test_a_simulated_capability_belongs_to_the_forced_platform_only(fresh_kvcore, monkeypatch):
    """KVCORE_DEVICE_CAPABILITY simulates KVCORE_PLATFORM's device: asking another platform
    (a CPU selection during a CUDA simulation) sees that platform's own hardware, not an error;
    without KVCORE_PLATFORM the capability is the current platform's and checked there."""
    monkeypatch.setenv("KVCORE_PLATFORM", "cuda")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "8.0")
    assert fresh_kvcore.get_platform("cuda").get_device_capability() == \
        fresh_kvcore.DeviceCapability(8, 0)
    assert fresh_kvcore.get_platform("cpu").get_device_capability() is None
    monkeypatch.delenv("KVCORE_PLATFORM")
    with pytest.raises(ValueError, match="KVCORE_DEVICE_CAPABILITY=8.0 does not belong to "
                                         "platform cpu"):
        fresh_kvcore.get_platform("cpu").get_device_capability()
