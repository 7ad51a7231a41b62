"""The ``cuda_batch`` block copier: registered by the entry point without importing anything
heavy, refused with a reason off CUDA, and on a GPU the ``offload`` connector's transfers
through it are bit-exact and never wait for the engine."""

from __future__ import annotations

import random
import time

import pytest
import torch

import kvcore
from kvcore.connectors import get_block_copier, get_connector


def test_the_plugin_registers_cuda_batch():
    entry = kvcore.block_copier_registry().get("cuda_batch")
    assert (entry.plugin, entry.target) == ("nvidia", "kvcore_nvidia.ops.copier:CudaBatchCopier")
    copier = get_block_copier("cuda_batch")  # (other tests may re-import the plugin's modules)
    assert (type(copier).__module__, type(copier).__qualname__, copier.name) == (
        "kvcore_nvidia.ops.copier", "CudaBatchCopier", "cuda_batch")


def test_a_cpu_cache_is_refused_with_what_to_do_instead():
    kv = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=2, num_blocks=8, block_size=4,
                                   num_kv_heads=1, head_size=8, dtype=torch.float32,
                                   device="cpu", cross_layer=False)
    conn = get_connector("offload", capacity_bytes=1 << 20, block_copier="cuda_batch")
    with pytest.raises(ValueError, match=r"block_copier='cuda_batch' cannot move the blocks of "
                                         r"this cache: cuda_batch moves blocks with CUDA's copy "
                                         r"engines and the cache is on cpu; leave block_copier "
                                         r"unset"):
        conn.register_kv_caches(kv)


def _rows(kv, ids):
    idx = torch.tensor(ids, device=kv.storage.device)
    return torch.stack([layer.index_select(0, idx).contiguous().view(torch.uint8).flatten(1)
                        for layer in kv.layers], dim=1).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_offload_through_cuda_batch_is_bit_exact_and_asynchronous(cross):
    kv = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=4, num_blocks=256, block_size=16,
                                   num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                   device="cuda", cross_layer=cross)
    kv.storage.copy_(torch.randn(kv.storage.shape, device="cuda"))
    block = kv.num_layers * kv.page_size_bytes
    src = random.sample(range(128), 100)
    dst = random.sample(range(128, 256), 100)
    keys = [f"{random.getrandbits(256):064x}" for _ in src]
    with get_connector("offload", capacity_bytes=160 * block, block_copier="cuda_batch") as conn:
        conn.register_kv_caches(kv)
        expected = _rows(kv, src)
        torch.cuda._sleep(1_000_000_000)  # a busy engine stream
        issued = time.perf_counter()
        save = conn.save(keys, src)
        load = conn.load(keys, dst)  # waits on the device for the save, not on the host
        elapsed = time.perf_counter() - issued
        assert not save.done() and elapsed < 0.2, f"save+load took {elapsed:.3f} s to return"
        assert save.wait(timeout=60).ok and load.wait(timeout=60).ok
        assert conn.paths["copier"] == 2 and conn.paths["staged"] == 0
    assert torch.equal(_rows(kv, dst), expected)
