"""TRITON_ATTN end to end through the backend contract (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from test_cpu_backend import assert_each_request_close, run_case

import kvcore

pytest.importorskip("triton")

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("backend_name", ["TRITON_ATTN", "TRITON_ATTN_HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_mixed_batch_matches_float64_reference(backend_name, dtype):
    step = run_case(seed=5, block_size=16, num_heads=8, num_kv_heads=2, head_size=32,
                    dtype=dtype, backend_name=backend_name)
    assert_each_request_close(step, TOL[dtype])


def test_cross_layer_equals_stacked_bit_exactly():
    a = run_case(seed=7, block_size=16, num_heads=4, num_kv_heads=4, head_size=16,
                 dtype=torch.float32, cross_layer=True, backend_name="TRITON_ATTN").output
    b = run_case(seed=7, block_size=16, num_heads=4, num_kv_heads=4, head_size=16,
                 dtype=torch.float32, cross_layer=False, backend_name="TRITON_ATTN").output
    assert torch.equal(a, b)


def test_hnd_layout_is_blocks_first_and_cross_layer():
    caches = kvcore.allocate_kv_caches("TRITON_ATTN_HND", num_layers=2, num_blocks=3,
                                       block_size=16, num_kv_heads=2, head_size=8,
                                       dtype=torch.bfloat16, device="cpu")
    assert str(caches.layout) == "B,L,2,H,N,D" and caches.layout.is_blocks_first
