"""Compile-check case providers for ``test_compile_check.py``: one that must fail the check
(a paged-attention tile needing more LDS than gfx942 has) and one that must pass.

Run in a subprocess without ``TRITON_INTERPRET`` as ``kvcore kernels --cases
broken_compile_cases:FUNCTION`` (this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import torch

from kvcore.ops import TritonAttentionPlan, TritonPrefillConfig
from kvcore.testing import CompileTarget, KernelCase


def _paged_attention(config) -> None:
    from kvcore.ops.triton_attention import paged_attention

    num_seqs, q_len, context, heads, kv_heads, head_size = 2, 64, 64, 8, 2, 256
    k_cache = torch.empty(16, 16, kv_heads, head_size, dtype=torch.bfloat16)
    block_table = torch.arange(num_seqs * 8, dtype=torch.int32).reshape(num_seqs, 8) % 16
    paged_attention(
        torch.empty(num_seqs * q_len, heads, head_size, dtype=torch.bfloat16),
        k_cache, torch.empty_like(k_cache),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32) * q_len,
        seq_lens=torch.full((num_seqs,), context + q_len, dtype=torch.int32),
        block_table=block_table, scale=0.0625, plan=TritonAttentionPlan(config=config))


def too_much_lds(target: CompileTarget) -> list[KernelCase]:
    """THE BUG: 128 query rows x 64 keys x head_size 256, three stages: two K/V tiles of
    64 x 256 bf16 in flight (128 KiB) beside the query tile; gfx942 has 64 KiB of LDS."""
    config = TritonPrefillConfig(block_q=32, g_pad=4, block_n=64, num_warps=8, num_stages=3)
    return [KernelCase("prefill 128x64 tile D256 3 stages", lambda: _paged_attention(config))]


def fits(target: CompileTarget) -> list[KernelCase]:
    """The cache write: a few registers, no shared memory, on every target."""
    def launch() -> None:
        from kvcore.ops.triton_cache import reshape_and_cache

        key = torch.empty(64, 2, 128, dtype=torch.bfloat16)
        cache = torch.empty(16, 16, 2, 128, dtype=torch.bfloat16)
        reshape_and_cache(key, torch.empty_like(key), cache, torch.empty_like(cache),
                          torch.arange(64))

    return [KernelCase("cache write bf16", launch)]
