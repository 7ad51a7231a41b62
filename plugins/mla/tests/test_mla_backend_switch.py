"""An engine switches between kvcore's CPU_MLA and TRITON_MLA by name only: same constructor
arguments, same cache layout, same bytes written, outputs within the kernel's tolerance."""

from __future__ import annotations

import pytest
import torch
from mla_helpers import DEVICE, assert_close, generator, randn

import kvcore
from kvcore.testing import random_block_tables

RANK, ROPE, NOPE, V, HEADS, BS = 64, 16, 32, 24, 4, 16


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_cpu_mla_and_triton_mla_are_interchangeable(kv_cache_dtype):
    gen = generator("switch", kv_cache_dtype)
    dtype = torch.bfloat16
    weight = randn((HEADS * (NOPE + V), RANK), dtype, gen, scale=RANK**-0.5)
    kwargs = dict(num_heads=HEADS, head_size=RANK + ROPE, scale=(NOPE + ROPE) ** -0.5,
                  kv_cache_dtype=kv_cache_dtype, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                  qk_rope_head_dim=ROPE, v_head_dim=V, kv_b_proj_weight=weight)
    backends = [kvcore.resolve_backend(n) for n in ("CPU_MLA", "TRITON_MLA")]
    shapes = {b.get_kv_cache_shape(9, BS, 1, RANK + ROPE) for b in backends}
    orders = {b.get_kv_cache_stride_order(True) for b in backends}
    assert len(shapes) == 1 and len(orders) == 1
    q_lens, ctx = [1, 6, 1], [21, 10, 0]
    lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    meta = kvcore.build_attention_metadata(q_lens, ctx, random_block_tables(lens, BS, 9, gen),
                                           BS, device=DEVICE)
    scales = kvcore.LayerScales(k_scale=torch.tensor([0.5], device=DEVICE))
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype != "auto" else dtype
    start = randn((9, BS, RANK + ROPE), torch.float32, gen).to(cache_dtype)
    n = meta.num_actual_tokens
    kv_c, k_pe = randn((n, RANK), dtype, gen), randn((n, ROPE), dtype, gen)
    query = randn((n, HEADS, NOPE + ROPE), dtype, gen)
    caches, outputs = [], []
    for backend in backends:
        impl = backend.get_impl_cls()(**kwargs)
        cache = start.clone()
        impl.do_kv_cache_update(scales, kv_c, k_pe, cache, meta.slot_mapping)
        outputs.append(impl.forward(scales, query, None, None, cache, meta))
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert_close(outputs[1], outputs[0].double(), dtype, "TRITON_MLA against CPU_MLA")
