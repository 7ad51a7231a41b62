"""kvcore_nvidia.ops: argument checks and the unavailable reason on any machine; on a GPU, the
CUDA C++ cache write bit-exact against kvcore's reference (cross-layer views, fp8, a layer
over 2**31 elements) and the batched block copy against plain indexing."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia import ops
from kvcore_nvidia.ops import _build
from nvidia_helpers import random_caches

from kvcore.ops import reshape_and_cache_ref

# -- any machine -----------------------------------------------------------------------------


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a torch build without CUDA")
def test_unavailable_reason_on_a_cpu_torch():
    assert ops.extension_unavailable_reason() == (
        f"this torch build ({torch.__version__}) has no CUDA support; kvcore-nvidia's CUDA C++ "
        "kernels need a CUDA build of torch and an NVIDIA GPU")
    key = torch.zeros(1, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="key_cache is on cpu; reshape_and_cache_flash runs on "
                                         r"CUDA tensors \(kvcore.ops.reshape_and_cache_ref"):
        ops.reshape_and_cache_flash(key, key, cache, cache.clone(), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="kvcore-nvidia CUDA C..? kernels are unavailable: "
                                           "this torch build"):
        ops.build_extension()


def test_unavailable_reason_without_nvcc(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_build, "_cuda_home", lambda: None)
    assert ops.extension_unavailable_reason() == (
        "nvcc not found: the CUDA C++ kernels are compiled on first use; install the CUDA "
        "toolkit matching torch's CUDA 13.0 and set CUDA_HOME")


def test_build_directory_is_keyed_by_sources_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCORE_NVIDIA_BUILD_DIR", str(tmp_path))
    first = _build.build_directory()
    assert first.parent == tmp_path and first.name.startswith("kvcore_nvidia_C-")
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert _build.build_directory() != first


def test_cache_write_arguments_are_checked_before_anything_is_built():
    key = torch.zeros(3, 2, 8, dtype=torch.float64)
    cache = torch.zeros(4, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64, got torch.float32"):
        ops.reshape_and_cache_flash(key, key, cache, cache.clone(), torch.zeros(3))
    with pytest.raises(TypeError, match="key has dtype torch.float64; reshape_and_cache_flash "
                                        "supports float16, bfloat16 and float32"):
        ops.reshape_and_cache_flash(key, key, cache, cache.clone(), torch.arange(3))


def test_copy_arguments_name_what_is_wrong():
    # Shapes and the mapping are checked before where the memory lives, so meta tensors do.
    dev = torch.zeros(4, 64, dtype=torch.uint8, device="meta")
    pairs = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match=r"method='fast' \(supported: batch, per_run, kernel\)"):
        ops.copy_blocks(dev, dev, pairs, method="fast")
    with pytest.raises(ValueError, match="streams=0 must be an integer from 1 to 8"):
        ops.copy_blocks(dev, dev, pairs, streams=0)
    with pytest.raises(ValueError, match=r"src blocks have shape \(32,\) but dst blocks have "
                                         r"\(64,\)"):
        ops.copy_blocks(dev[:, :32], dev, pairs)
    with pytest.raises(ValueError, match="src's blocks are not contiguous"):
        ops.copy_blocks(dev.view(4, 2, 32).transpose(1, 2), dev.view(4, 32, 2), pairs)
    with pytest.raises(ValueError, match=r"block_mapping must be \(num_pairs, 2\)"):
        ops.copy_blocks(dev, dev, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"block_mapping\[:, 1\] contains block id 4, outside "
                                         r"the cache's 4 blocks \(valid ids: 0..3\)"):
        ops.copy_blocks(dev, dev, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"block_mapping\[:, 1\] repeats block ids \[1\]"):
        ops.copy_blocks(dev, dev, torch.tensor([[0, 1], [2, 1]]))
    with pytest.raises(ValueError, match="src is in pageable host memory; copy_blocks needs "
                                         "pinned memory"):
        ops.copy_blocks(torch.zeros(4, 64, dtype=torch.uint8), dev, pairs)
    with pytest.raises(ValueError, match="src is on meta; copy_blocks moves CUDA and pinned"):
        ops.copy_blocks(dev, dev, pairs)


# -- on the GPU ------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).cuda()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("layout", ["standard", "cross_layer", "fused_qkv", "dim_stride_2"])
def test_cache_write_is_bit_exact_against_the_reference(layout, dtype, kv_cache_dtype):
    gen = _gen("write", layout, dtype, kv_cache_dtype)
    num_layers, num_blocks, block_size, heads, head_size, n = 3, 64, 16, 8, 128, 700
    backend = "TRITON_ATTN"  # opts in to cross-layer: the per-layer views get strided pages
    caches = random_caches(
        backend, gen, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=heads, head_size=head_size, dtype=dtype,
        cross_layer=layout == "cross_layer", kv_cache_dtype=kv_cache_dtype)
    layer = caches.layers[1]
    before = [_bits(caches.layers[i]) for i in (0, 2)]
    if layout == "fused_qkv":  # K and V sliced out of a QKV projection: 16-byte vector path
        qkv = _rand((n, 3 * heads, head_size), dtype, gen)
        key, value = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    elif layout == "dim_stride_2":  # no contiguous innermost dim: the one-element path
        key = _rand((n, heads, 2 * head_size), dtype, gen)[..., ::2]
        value = _rand((n, heads, 2 * head_size), dtype, gen)[..., 1::2]
    else:
        key, value = _rand((n, heads, head_size), dtype, gen), _rand((n, heads, head_size),
                                                                     dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].cuda()
    slots[::50] = -1  # padding rows are skipped
    # Tensor scales on the device for e4m3, host floats for e5m2: both argument forms.
    scales = ((torch.tensor([0.5], device="cuda"), torch.tensor([0.25], device="cuda"))
              if kv_cache_dtype == "fp8_e4m3" else (0.5, 0.25))
    expected = layer.clone()
    reshape_and_cache_ref(key, value, *expected.unbind(1), slots, kv_cache_dtype, *scales)
    ops.reshape_and_cache_flash(key, value, *layer.unbind(1),
                                slots.to(torch.int32) if dtype == torch.float16 else slots,
                                kv_cache_dtype, *scales)
    torch.cuda.synchronize()
    assert torch.equal(_bits(layer), _bits(expected))
    assert all(torch.equal(_bits(caches.layers[i]), b) for i, b in zip((0, 2), before,
                                                                        strict=True))


@gpu
def test_cache_write_beyond_2_pow_31_elements():
    """One layer of 2**31 + 8 blocks' elements (4.3 GB bf16); tokens land in the last blocks."""
    block_size, heads, head_size = 16, 8, 128
    page = 2 * block_size * heads * head_size
    num_blocks = 2**31 // page + 8
    kv_cache = torch.zeros(num_blocks, 2, block_size, heads, head_size, dtype=torch.bfloat16,
                           device="cuda")
    gen = _gen("int64")
    n = 5 * block_size
    key, value = _rand((n, heads, head_size), torch.bfloat16, gen), _rand(
        (n, heads, head_size), torch.bfloat16, gen)
    slots = torch.arange((num_blocks - 5) * block_size, num_blocks * block_size, device="cuda")
    ops.reshape_and_cache_flash(key, value, *kv_cache.unbind(1), slots)
    tail = kv_cache[num_blocks - 5:]
    expected = torch.zeros_like(tail)
    reshape_and_cache_ref(key, value, *expected.unbind(1),
                          slots - (num_blocks - 5) * block_size)
    assert torch.equal(_bits(tail), _bits(expected))
    assert int(kv_cache[: num_blocks - 5].view(torch.int16).abs().amax()) == 0  # nothing stray


@gpu
@pytest.mark.parametrize(("method", "streams"), [("batch", 1), ("batch", 3), ("per_run", 1),
                                                 ("per_run", 2), ("kernel", 1)])
@pytest.mark.parametrize(("cross_layer", "layer"), [(False, 1), (True, None), (True, 1)],
                         ids=["one_layer", "cross_layer_all_layers", "cross_layer_one_layer"])
def test_copy_blocks_round_trip_through_pinned_memory(method, streams, cross_layer, layer):
    gen = _gen("copy", method, streams, cross_layer, layer)
    caches = random_caches(
        "TRITON_ATTN", gen, num_layers=2, num_blocks=96, block_size=16, num_kv_heads=2,
        head_size=64, cross_layer=cross_layer)
    device_blocks = caches.block_view(layer)
    host = torch.zeros((64, device_blocks.shape[1]), dtype=torch.uint8, pin_memory=True)
    # A run of 5 adjacent blocks, two singles, and three blocks whose order flips.
    src = torch.tensor([10, 11, 12, 13, 14, 40, 70, 33, 32, 31])
    dst = torch.tensor([0, 1, 2, 3, 4, 20, 63, 7, 8, 9])
    copies = ops.copy_blocks(device_blocks, host, torch.stack([src, dst], 1), method, streams)
    # One layer of a cross-layer cache has strided blocks: no run can span two of them.
    assert copies == (10 if cross_layer and layer is not None else 6)
    torch.cuda.synchronize()
    assert torch.equal(host[dst], device_blocks[src].cpu())
    # And back into other device blocks, leaving every other byte of the cache untouched.
    back = torch.tensor([90, 91, 92, 93, 94, 0, 1, 60, 61, 62])
    expected = device_blocks.clone()
    expected[back] = device_blocks[src]
    other = None if layer is None else caches.block_view(0).clone()
    ops.copy_blocks(host, device_blocks, torch.stack([dst, back], 1), method, streams)
    torch.cuda.synchronize()
    assert torch.equal(device_blocks, expected)
    if other is not None:
        assert torch.equal(caches.block_view(0), other)
