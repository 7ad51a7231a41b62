"""The Triton kernel behind :func:`kvcore_rocm.ops.shuffle.reshape_and_cache_shuffle`.

Imports triton at import time; :mod:`kvcore_rocm.ops.shuffle` imports this module on first use.
Arguments are validated by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_utils import next_power_of_2


@triton.jit
def _reshape_and_cache_shuffle_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    k_cache_block_stride, v_cache_block_stride,
    block_size, num_kv_heads, head_size,
    X: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    n = slot % block_size

    heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    dims = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)

    page = block_size * head_size  # elements of one head inside a half-page
    # K half-page (H, D // X, N, X); V half-page (H, N // X, D, X).
    k_off = heads * page + (dims // X) * (block_size * X) + n * X + dims % X
    v_off = heads * page + (n // X) * (head_size * X) + dims * X + n % X
    tl.store(key_cache_ptr + block * k_cache_block_stride + k_off,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + block * v_cache_block_stride + v_off,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def launch_reshape_and_cache_shuffle(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    x: int,
) -> None:
    """Launch one program per token; ``x`` is the shuffle width (16 bytes of the cache dtype)."""
    num_tokens, num_kv_heads, head_size = key.shape
    _reshape_and_cache_shuffle_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(),
        key_cache.stride(0), value_cache.stride(0),
        key_cache.shape[1], num_kv_heads, head_size,
        X=x, BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_size),
        num_warps=4,
    )
