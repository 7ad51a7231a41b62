"""ROCM_ATTN (legacy layout) and ROCM_AITER_UNIFIED_ATTN (Triton fallback, cross-layer) against
CPU_ATTN and a float64 reference on a mixed batch; ROCM_AITER_FA's cache write through its
impl; block movement refusing ROCM_ATTN's layout."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore.testing import run_mixed_step

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
BLOCK_SIZE, HEAD_SIZE = 16, 64


def run_mixed_batch(backend_name, dtype, num_heads=4, num_kv_heads=2, window=None, seed=0,
                    cross_layer="auto"):
    """Decode, decode, prefill on a cached prefix, fresh prefill, on shuffled blocks of layer 1
    of a 3-layer cache whose other bytes are random. Returns (output, float64 reference, caches,
    storage before the step)."""
    rng = random.Random(seed)
    step = run_mixed_step(
        backend_name, query_lens=[1, 1, 6, 9],
        context_lens=[rng.randint(1, 30), rng.randint(17, 40), rng.randint(3, 20), 0],
        block_size=BLOCK_SIZE, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE, dtype=dtype, gen=torch.Generator().manual_seed(seed),
        sliding_window=window, cross_layer=cross_layer)
    return step.output, step.reference(), step.caches, step.before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", ["ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"])
def test_against_cpu_attn_and_float64(backend, dtype):
    window = 12 if dtype == torch.float16 else None
    out, ref, caches, before = run_mixed_batch(backend, dtype, window=window)
    cpu_out, _, _, _ = run_mixed_batch("CPU_ATTN", dtype, window=window, cross_layer=False)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, cpu_out, atol=TOL[dtype], rtol=TOL[dtype])
    assert caches.is_cross_layer == (backend == "ROCM_AITER_UNIFIED_ATTN")
    # Layers 0 and 2 are byte-identical: the kernels wrote only through layer 1's view.
    for layer in (0, 2):
        assert torch.equal(caches.layers[layer], before.permute(
            caches.layout.inverse_stride_order())[layer])


def test_rocm_attn_gqa_float32_layout():
    out, ref, caches, _ = run_mixed_batch("ROCM_ATTN", torch.float32, num_heads=8,
                                          num_kv_heads=1, seed=3)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert str(caches.layout) == "L,2,B,N,H,D"
    assert caches.layers[0].shape[0] == 2  # legacy: K/V split first


def test_aiter_fa_cache_write_and_forward_without_aiter():
    """The FA impl writes shuffled pages (CPU: the reference) that round-trip; forward needs
    aiter and says so."""
    from kvcore_rocm.ops.shuffle import gather_shuffled_kv

    backend = kvcore.resolve_backend("ROCM_AITER_FA")
    caches = kvcore.allocate_kv_caches(backend, num_layers=2, num_blocks=4, block_size=16,
                                       num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                       device="cpu")
    impl = backend.get_impl_cls()(2, 64, 0.125, 2)
    key = torch.randn(20, 2, 64).bfloat16()
    value = torch.randn(20, 2, 64).bfloat16()
    meta = kvcore.build_attention_metadata([20], [0], [[3, 1]], 16)
    impl.do_kv_cache_update(kvcore.LayerScales(), key, value, caches.layers[1], meta.slot_mapping)
    k, v, _ = gather_shuffled_kv(*caches.layers[1].unbind(1), meta.block_table, meta.seq_lens)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert not caches.layers[0].any()
    with pytest.raises(RuntimeError, match=r"ROCM_AITER_FA needs aiter .*amd-aiter not installed"):
        impl.forward(kvcore.LayerScales(), key, key, value, caches.layers[1], meta)


@pytest.mark.parametrize("direction", ["swap_out_blocks_to_host", "insert_blocks_to_device"])
def test_block_movement_refuses_rocm_attn_layout(rocm, direction):
    rocm("gfx942")
    caches = kvcore.allocate_kv_caches("ROCM_ATTN", num_layers=1, num_blocks=4, block_size=16,
                                       num_kv_heads=1, head_size=32, dtype=torch.float16,
                                       device="cpu", cross_layer=False)
    host = torch.zeros_like(caches.layers[0])
    move = getattr(kvcore.current_platform(), direction)
    with pytest.raises(ValueError, match=r"the cache layout L,2,B,N,H,D is not blocks-first"):
        move(caches.layers[0], host, torch.tensor([0]), torch.tensor([1]),
             layout=caches.layout)
    # The blocks-first backends' layouts are accepted.
    ok = kvcore.allocate_kv_caches("ROCM_AITER_UNIFIED_ATTN", num_layers=1, num_blocks=4,
                                   block_size=16, num_kv_heads=1, head_size=64,
                                   dtype=torch.float16, device="cpu")
    ok.layers[0].normal_()
    dst = torch.zeros_like(ok.layers[0])
    move(ok.layers[0], dst, torch.tensor([2]), torch.tensor([0]), layout=ok.layout)
    assert torch.equal(dst[0], ok.layers[0][2])


def test_rocm_attn_keeps_the_legacy_halves_per_cache():
    """ROCM_ATTN's split_kv: ``unbind(0)`` views, the same objects while the cache is the same
    (the ops find their checks by them); a cache of another shape refused."""
    impl = kvcore.resolve_backend("ROCM_ATTN").get_impl_cls()(2, 64, 0.125, 2)
    kv = torch.zeros(2, 4, 16, 2, 64)
    halves = impl.split_kv(kv)
    assert impl.split_kv(kv) is halves
    assert [h.data_ptr() for h in halves] == [h.data_ptr() for h in kv.unbind(0)]
    assert halves[0].shape == (4, 16, 2, 64)
    with pytest.raises(ValueError, match=r"ROCM_ATTN expects the legacy \(2, num_blocks"):
        impl.split_kv(torch.zeros(4, 2, 16, 2, 64))
