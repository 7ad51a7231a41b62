"""The NVIDIA backends' cache write (:mod:`kvcore_nvidia.ops.cache_write`): which kernel runs and
why (any machine), where the CUDA C++ sources come from (checkout and wheel), and on a GPU the
CUDA and Triton writes bit-exact against the torch reference for every stride order the
backends declare, per layer and cross-layer, and the backends' forward on the CUDA write."""

from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from kvcore_nvidia import ops
from kvcore_nvidia.ops import _build, cache_write
from nvidia_helpers import mixed_batch, random_caches, reference, rel_err

import kvcore
from kvcore.ops import reshape_and_cache_ref, triton_reshape_and_cache

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    """Forget this process's build attempt and kernel choice (before and after), with the build
    cache in a temporary directory."""
    monkeypatch.setenv("KVCORE_NVIDIA_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("KVCORE_NVIDIA_CACHE_WRITE", raising=False)
    for fn in (_build.load_or_reason, cache_write.cache_write_kernel):
        fn.cache_clear()
    yield tmp_path
    for fn in (_build.load_or_reason, cache_write.cache_write_kernel):
        fn.cache_clear()


def _buildable(monkeypatch) -> None:
    """Pretend this machine has a CUDA torch, a GPU, nvcc and ninja."""
    monkeypatch.setattr(_build, "unavailable_reason", lambda: None)


# -- any machine -----------------------------------------------------------------------------


def test_the_sources_resolve_to_the_top_level_csrc():
    assert _build.missing_sources() == []
    assert _build.CSRC.resolve() == (REPO / "csrc" / "nvidia").resolve()


def test_without_the_extension_the_write_is_triton_and_says_why(fresh_choice, monkeypatch,
                                                                 caplog):
    monkeypatch.setenv("KVCORE_NVIDIA_CACHE_WRITE", "cuda")  # asked for; Triton is the default
    monkeypatch.setattr(_build, "unavailable_reason", lambda: "no NVIDIA GPU is visible")
    assert _build.status() == "unavailable: no NVIDIA GPU is visible"
    assert ops.cache_write_status() == ("triton (the CUDA C++ extension is unavailable: no "
                                        "NVIDIA GPU is visible)")
    with caplog.at_level(logging.WARNING):
        assert ops.cache_write_kernel() == "triton"
    assert "the cache write uses Triton: the CUDA C++ extension is unavailable (no NVIDIA GPU" \
        in caplog.text


def test_a_failed_build_is_a_reason_remembered_across_processes(fresh_choice, monkeypatch):
    _buildable(monkeypatch)
    monkeypatch.setenv("KVCORE_NVIDIA_CACHE_WRITE", "cuda")  # asked for; Triton is the default
    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs["build_directory"])
        raise RuntimeError("Error building extension 'kvcore_nvidia_C'\nnvcc fatal: ...")

    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_load)
    assert ops.cache_write_kernel() == "triton"  # no exception reaches the caller
    directory = _build.build_directory()
    assert calls == [str(directory)]
    assert (directory / "FAILED").read_text() == (
        "RuntimeError: Error building extension 'kvcore_nvidia_C'\n")
    assert ops.cache_write_status() == (
        "triton (the CUDA C++ extension is unavailable: the build failed (RuntimeError: Error "
        f"building extension 'kvcore_nvidia_C'); delete {directory} to retry)")
    with pytest.raises(RuntimeError, match="kvcore-nvidia CUDA C.. kernels are unavailable: "
                                           "the build failed"):
        ops.build_extension()
    # A new process reads the marker instead of running nvcc again.
    _build.load_or_reason.cache_clear()
    module, reason = _build.load_or_reason()
    assert module is None and reason.startswith("the build failed in an earlier run")
    assert f"delete {directory} to retry" in reason and len(calls) == 1


def test_status_before_any_build_promises_a_build_on_first_use(fresh_choice, monkeypatch):
    _buildable(monkeypatch)
    assert _build.status().startswith("not built yet: compiled on first use")
    assert ops.cache_write_status() == "triton (the default)"  # as fast or faster on the H200
    monkeypatch.setenv("KVCORE_NVIDIA_CACHE_WRITE", "cuda")
    assert ops.cache_write_status() == ("cuda (KVCORE_NVIDIA_CACHE_WRITE=cuda; the CUDA C++ "
                                        "extension is not built yet: compiled on first use)")
    directory = _build.build_directory()
    directory.mkdir(parents=True)
    (directory / "kvcore_nvidia_C.so").write_bytes(b"")
    assert _build.status() == f"built ({directory / 'kvcore_nvidia_C.so'})"


def test_the_environment_variable_picks_the_kernel(fresh_choice, monkeypatch):
    _buildable(monkeypatch)
    monkeypatch.setenv("KVCORE_NVIDIA_CACHE_WRITE", "triton")
    assert ops.cache_write_status() == "triton (KVCORE_NVIDIA_CACHE_WRITE=triton)"
    assert ops.cache_write_kernel() == "triton"
    cache_write.cache_write_kernel.cache_clear()
    monkeypatch.setenv("KVCORE_NVIDIA_CACHE_WRITE", "cutlass")
    with pytest.raises(ValueError, match=r"KVCORE_NVIDIA_CACHE_WRITE='cutlass' \(supported: "
                                         r"cuda, triton\); unset it for the default"):
        ops.cache_write_kernel()


def test_cpu_caches_get_the_reference():
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 4, 2, 2, 8, generator=gen).permute(0, 2, 1, 3, 4)  # interleaved
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([3, 15, -1, 0, 9])
    expected = kv.clone()
    reshape_and_cache_ref(key, value, *expected.unbind(1), slots)
    ops.write_kv_cache(key, value, *kv.unbind(1), slots)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("command", ["plugins", "collect-env"])
def test_kvcore_plugins_and_collect_env_show_the_extension_and_the_write(command):
    out = subprocess.run([sys.executable, "-m", "kvcore.cli", command], capture_output=True,
                         text=True, check=True).stdout
    lines = {line.split(": ", 1)[0].strip(): line.split(": ", 1)[1]
             for line in out.splitlines() if line.strip().startswith("nvidia.")}
    assert set(lines) == {"nvidia.cuda_extension", "nvidia.cache_write",
                          "nvidia.cuda_extension_cache", "nvidia.flashinfer_jit_cache"}
    if torch.version.cuda is None:  # the same answer in every process here
        assert lines["nvidia.cuda_extension"] == _build.status()
        assert lines["nvidia.cache_write"] == ops.cache_write_status()


@pytest.mark.slow
def test_a_built_wheel_holds_the_sources(tmp_path):
    """``pip wheel plugins/nvidia`` from the checkout: the symlinked csrc becomes real files."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(REPO / "plugins" / "nvidia")], check=True)
    (wheel,) = tmp_path.glob("kvcore_nvidia-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for name in (*_build.SOURCES, *_build.HEADERS):
            assert zf.read(f"kvcore_nvidia/csrc/{name}") == (_build.CSRC / name).read_bytes()


# -- on the GPU ------------------------------------------------------------------------------

gpu = pytest.mark.gpu
HK, D, BS = 8, 128, 16
#: Every order the NVIDIA backends declare or are about to: per layer, and cross-layer.
ORDERS = {"NHD": ((0, 1, 2, 3, 4), 0), "HND": ((0, 1, 3, 2, 4), 0),
          "interleaved": ((0, 2, 1, 3, 4), 0),
          "cross_layer_NHD": ((1, 0, 2, 3, 4, 5), 3),
          "cross_layer_HND": ((1, 0, 2, 4, 3, 5), 3),
          "cross_layer_interleaved": ((1, 0, 3, 2, 4, 5), 3)}
WRITES = {"cuda": ops.reshape_and_cache_flash, "triton": triton_reshape_and_cache}


def _strided(order: tuple[int, ...], logical: tuple[int, ...], dtype: torch.dtype,
             gen: torch.Generator) -> torch.Tensor:
    """Random contents laid out in ``order`` (outermost first), viewed in ``logical`` shape."""
    physical = torch.randn([logical[i] for i in order], generator=gen).to(dtype).cuda()
    return physical.permute([order.index(i) for i in range(len(order))])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("kernel", list(WRITES))
def test_write_is_bit_exact_for_every_stride_order(kernel, order, kv_cache_dtype):
    gen = torch.Generator().manual_seed(hash((kernel, order, kv_cache_dtype)) % 2**31)
    perm, layers = ORDERS[order]
    cache_dtype = {"auto": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    num_blocks, n = 96, 1000
    pool = _strided(perm, ((layers,) if layers else ()) + (num_blocks, 2, BS, HK, D),
                    cache_dtype, gen)
    before = pool.clone()
    layer = pool[1] if layers else pool
    key = (torch.randn(n, HK, D, generator=gen) * 3).to(torch.bfloat16).cuda()
    value = (torch.randn(n, HK, D, generator=gen) * 3).to(torch.bfloat16).cuda()
    slots = torch.randperm(num_blocks * BS, generator=gen)[:n].cuda()
    slots[::41] = -1
    # Not powers of two: x / s and x * (1 / s) differ in the last bit for some x.
    scales = (torch.tensor([0.37], device="cuda"), 1.7)
    expected = layer.clone()
    reshape_and_cache_ref(key, value, *expected.unbind(1), slots, kv_cache_dtype, *scales)
    WRITES[kernel](key, value, *layer.unbind(1), slots, kv_cache_dtype, *scales)
    torch.cuda.synchronize()
    assert torch.equal(_bits(layer), _bits(expected))
    for i in range(layers):
        if i != 1:
            assert torch.equal(_bits(pool[i]), _bits(before[i])), f"layer {i} was written"


@gpu
@pytest.mark.parametrize("kernel", list(WRITES))
def test_write_reads_slot_mapping_through_its_stride(kernel):
    """slot_mapping as a column of a (tokens, 2) engine buffer whose other column holds a
    valid slot no token names: the write lands where the view's values say, bit for bit."""
    from kvcore.testing import strided_view

    gen = torch.Generator().manual_seed(7)
    num_blocks, n = 96, 1000
    cache = torch.randn(num_blocks, 2, BS, HK, D, generator=gen).to(torch.bfloat16).cuda()
    key = torch.randn(n, HK, D, generator=gen).to(torch.bfloat16).cuda()
    value = torch.randn(n, HK, D, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randperm(num_blocks * BS, generator=gen).cuda()
    view = strided_view(slots[:n], int(slots[n]))  # the gaps: a slot no token names
    expected = cache.clone()
    reshape_and_cache_ref(key, value, *expected.unbind(1), slots[:n])
    WRITES[kernel](key, value, *cache.unbind(1), view)
    torch.cuda.synchronize()
    assert view.stride(0) == 2 and torch.equal(_bits(cache), _bits(expected))


@gpu
@pytest.mark.parametrize("kernel", list(WRITES))
def test_write_on_an_interleaved_cross_layer_pool_beyond_2_pow_31_elements(kernel):
    """Layer 1 of a 2-layer interleaved cross-layer pool (4.3 GB of bf16): its last blocks sit
    more than 2**31 elements from the storage's start."""
    page = 2 * BS * HK * D
    num_blocks = 2**31 // (2 * page) + 8
    physical = torch.empty(num_blocks, 2, BS, 2, HK, D, dtype=torch.bfloat16, device="cuda")
    pool = physical.permute(1, 0, 3, 2, 4, 5)  # logical (L, B, 2, BS, H, D)
    layer = pool[1]
    tail = physical[-4:]
    tail.normal_()
    before = tail.clone()
    n = 64
    key = torch.randn(n, HK, D, device="cuda").to(torch.bfloat16)
    value = torch.randn(n, HK, D, device="cuda").to(torch.bfloat16)
    slots = torch.arange((num_blocks - 4) * BS, num_blocks * BS, device="cuda")[:n]
    assert (num_blocks - 1) * physical.stride(0) > 2**31
    written = tail.permute(0, 1, 3, 2, 4, 5)  # (4 blocks, L, 2, BS, H, D)
    expected = written[:, 1].clone()
    reshape_and_cache_ref(key, value, *expected.unbind(1), slots - (num_blocks - 4) * BS)
    WRITES[kernel](key, value, *layer.unbind(1), slots)
    torch.cuda.synchronize()
    assert torch.equal(_bits(written[:, 1]), _bits(expected))
    assert torch.equal(_bits(tail[:, 0]), _bits(before[:, 0]))  # layer 0 untouched


def _backends() -> list:
    from kvcore_nvidia.backends.flash_attn import FlashAttentionBackend
    from kvcore_nvidia.backends.flashinfer import FlashInferBackend
    from kvcore_nvidia.backends.flex_attention import FlexAttentionBackend

    return [pytest.param(b, id=b.get_name(), marks=pytest.mark.skipif(
        bool(b.unavailable_reasons()), reason="; ".join(b.unavailable_reasons())))
            for b in (FlashInferBackend, FlashAttentionBackend, FlexAttentionBackend)]


@gpu
@pytest.mark.skipif(ops.extension_unavailable_reason() is not None,
                    reason=str(ops.extension_unavailable_reason()))
@pytest.mark.parametrize("backend", _backends())
def test_backend_forward_runs_on_the_cuda_write(backend, monkeypatch):
    monkeypatch.setenv("KVCORE_NVIDIA_CACHE_WRITE", "cuda")  # not the default
    cache_write.cache_write_kernel.cache_clear()
    assert ops.cache_write_kernel() == "cuda", ops.cache_write_status()
    gen = torch.Generator().manual_seed(5)
    kv_cache = random_caches(backend, gen, num_layers=1, num_blocks=512, block_size=BS,
                             num_kv_heads=HK, head_size=D).layers[0]
    before = kv_cache.clone()
    impl = backend.get_impl_cls()(num_heads=32, head_size=D, scale=D**-0.5, num_kv_heads=HK)
    batch = mixed_batch(impl, kv_cache, gen, q_lens=(1, 1, 150, 33),
                        ctx_lens=(700, 15, 64, 0))
    reshape_and_cache_ref(batch.key, batch.value, *before.unbind(1), batch.meta.slot_mapping)
    assert torch.equal(_bits(kv_cache), _bits(before))  # the CUDA write wrote exactly that
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                 batch.meta, output=out)
    assert rel_err(out, reference(impl, batch, kv_cache)) < 1e-2
    cache_write.cache_write_kernel.cache_clear()


def test_a_lock_file_left_by_a_killed_build_does_not_block_the_next(fresh_choice, monkeypatch):
    """torch's build lock file outlives a build killed mid-way (and every later build waits on
    it); under kvcore's OS lock a leftover one is stale and is removed."""
    _buildable(monkeypatch)
    directory = _build.build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lock").write_text("")  # what a killed cpp_extension.load leaves
    seen = []

    def load(**kwargs):
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        raise RuntimeError("stop here")

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    _build.load_or_reason()
    assert seen == [False]
