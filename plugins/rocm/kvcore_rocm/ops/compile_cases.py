"""kvcore-rocm's Triton kernel for kvcore's compile check (``kvcore kernels``).

The shuffled cache write of ROCM_AITER_FA
(:func:`kvcore_rocm.ops.shuffle.reshape_and_cache_shuffle`) runs only on ROCm, so it is
compiled for the AMD targets only; ROCM_ATTN and ROCM_AITER_UNIFIED_ATTN launch kvcore's
portable kernels, which kvcore's own cases compile. Registered by :mod:`kvcore_rocm.plugin`.
"""

from __future__ import annotations

import torch

import kvcore
from kvcore.testing import CompileTarget, KernelCase

__all__ = ["compile_cases"]

_NUM_BLOCKS = 64  # at least; a write gets one slot per token (a slot written twice is refused)


def _shuffle_write_case(name: str, *, num_tokens: int, num_kv_heads: int, head_size: int,
                        dtype: torch.dtype) -> KernelCase:
    def launch() -> None:
        from kvcore_rocm.ops.shuffle import reshape_and_cache_shuffle

        block_size = 16
        num_blocks = max(_NUM_BLOCKS, -(-num_tokens // block_size))
        kv = kvcore.allocate_kv_caches("ROCM_AITER_FA", num_layers=2, num_blocks=num_blocks,
                                       block_size=block_size, num_kv_heads=num_kv_heads,
                                       head_size=head_size, dtype=dtype, device="cpu")
        key_cache, value_cache = kv.layers[1].unbind(1)
        key = torch.empty(num_tokens, num_kv_heads, head_size, dtype=dtype)
        slots = torch.arange(num_tokens)
        reshape_and_cache_shuffle(key, torch.empty_like(key), key_cache, value_cache, slots)

    return KernelCase(name, launch)


def compile_cases(target: CompileTarget) -> list[KernelCase]:
    """The shuffled cache write in bf16 and fp16 (its cache dtypes), on AMD targets."""
    if not target.is_rocm:
        return []
    return [
        _shuffle_write_case(f"shuffle write 2048 tok Hk8 D128 {tag}", num_tokens=2048,
                            num_kv_heads=8, head_size=128, dtype=dtype)
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))
    ]
