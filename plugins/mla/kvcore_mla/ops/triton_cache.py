"""Triton cache writes of MLA: the latent cache and the DeepSeek-V3.2 indexer cache.

``concat_and_cache_mla`` and ``indexer_k_quant_and_cache`` compute exactly their references
(:func:`kvcore.ops.concat_and_cache_mla_ref`,
:func:`kvcore_mla.ops.reference.indexer_k_quant_and_cache_ref`; bit for bit, fp8 included).
Both address a block through the cache's real ``stride(0)``, never through
``block_size * entry_size``: a per-layer view of a cross-layer pool has a block stride
``num_layers`` times larger, and a kernel that assumed packed pages would write into the
neighbouring layers (the bug behind garbled MLA output with KV offloading). All address
arithmetic is int64, so views more than 2**31 elements into a pool work.

This module imports triton at import time; :mod:`kvcore_mla.ops` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops import FP8_KV_CACHE_DTYPES, KVScale, validate_concat_and_cache_mla
from kvcore.ops.triton_launch import KernelLaunch, arg_class
from kvcore.ops.triton_utils import (
    fp8_format,
    is_interpreted,
    next_power_of_2,
    round_to_fp8_grid,
    scale_arg,
)
from kvcore_mla.ops.reference import INDEXER_FP8_MAX
from kvcore_mla.ops.triton_utils import pointer_classes
from kvcore_mla.ops.validation import validate_indexer_k_quant_and_cache

__all__ = ["concat_and_cache_mla", "indexer_k_quant_and_cache"]


@triton.jit
def _concat_and_cache_mla_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, scale,
    stride_ct, stride_cd, stride_pt, stride_pd,
    stride_cache_b, stride_cache_s, stride_cache_d,
    block_size, kv_lora_rank, rope_dim,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr, FP8_MAX: tl.constexpr,
    EXACT_FP8_ROUNDING: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size

    c = tl.arange(0, BLOCK_C).to(tl.int64)
    c_mask = c < kv_lora_rank
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    r_mask = r < rope_dim
    kv_c = tl.load(kv_c_ptr + token * stride_ct + c * stride_cd, mask=c_mask)
    k_pe = tl.load(k_pe_ptr + token * stride_pt + r * stride_pd, mask=r_mask)
    if FP8:
        if SCALE_IS_TENSOR:
            s = tl.load(scale).to(tl.float32)
        else:
            s = scale
        # The reference's definition (kvcore.ops.fp8_inverse_scale): one IEEE
        # float32 reciprocal (div_rn: Triton's "/" is approximate on NVIDIA), then a float32
        # multiply. Not x / s: torch on CUDA computes x * (1/s) for a scalar s, and the two
        # differ in the last bit often enough to change fp8 bytes.
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), s.to(tl.float32))
        kv_c = tl.clamp(kv_c.to(tl.float32) * inv, -FP8_MAX, FP8_MAX)
        k_pe = tl.clamp(k_pe.to(tl.float32) * inv, -FP8_MAX, FP8_MAX)
        if EXACT_FP8_ROUNDING:
            kv_c = round_to_fp8_grid(kv_c, MANTISSA_BITS, MIN_EXPONENT)
            k_pe = round_to_fp8_grid(k_pe, MANTISSA_BITS, MIN_EXPONENT)

    # fp32 -> fp8 is round-to-nearest-even (cvt.rn.satfinite on sm_89+), values already
    # clamped to the finite range, like torch's .to(float8). The block's address comes from
    # the cache's own stride(0): see the module docstring.
    dst = cache_ptr + block * stride_cache_b + offset * stride_cache_s
    tl.store(dst + c * stride_cache_d, kv_c.to(cache_ptr.dtype.element_ty), mask=c_mask)
    tl.store(dst + (kv_lora_rank + r) * stride_cache_d, k_pe.to(cache_ptr.dtype.element_ty),
             mask=r_mask)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                         scale: KVScale = None) -> None:
    """Write each token's latent ``[kv_c, k_pe]`` into the MLA cache, in place (Triton).

    Args:
        kv_c: ``(num_tokens, kv_lora_rank)``, any strides.
        k_pe: ``(num_tokens, rope_dim)`` or ``(num_tokens, 1, rope_dim)``, any strides.
        kv_cache: ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` of any strides (a
            per-layer view of a cross-layer pool included); the model dtype, or fp8
            (e4m3/e5m2) when ``kv_cache_dtype`` says so.
        slot_mapping: ``(num_tokens,)`` int32/int64 ``block * block_size + offset``;
            negative entries are padding and are skipped.
        kv_cache_dtype: ``"auto"`` or an fp8 name; fp8 stores ``clamp(x * inv_scale)``
            rounded to nearest even, ``inv_scale = float32(1 / float32(scale))`` (see
            :func:`kvcore.ops.fp8_inverse_scale`).
        scale: per-tensor fp8 scale: a 1-element tensor (read on the device) or a float;
            ignored unless the cache is fp8.
    """
    k_pe = validate_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                                         scale)
    num_tokens, kv_lora_rank = kv_c.shape
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()  # read densely; a view may have stride > 1
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    s = scale_arg(scale if fp8 else None, kv_cache.device)
    rope_dim = k_pe.shape[1]
    found = (fp8, isinstance(s, torch.Tensor), kv_cache.dtype, kv_lora_rank, rope_dim)
    kernel = _LAUNCHES.get(found)
    if kernel is None:
        kernel = _LAUNCHES[found] = _concat_launch(found)
    args = (kv_c, k_pe, kv_cache, slot_mapping, s, *kv_c.stride(), *k_pe.stride(),
            *kv_cache.stride(), kv_cache.shape[1], kv_lora_rank, rope_dim)
    # Triton specialises the pointers (dtype, alignment), the scale's kind and the ints.
    kernel((num_tokens, 1, 1), args,
           (pointer_classes(kv_c, k_pe, kv_cache, slot_mapping), arg_class(s), args[5:]))


#: The cache write's launches by what fixes their compile (fp8, scale kind, sizes).
_LAUNCHES: dict[tuple, KernelLaunch] = {}


def _concat_launch(found: tuple) -> KernelLaunch:
    """The launch of :func:`concat_and_cache_mla`'s lookup key ``found``: its constexprs and
    options, exactly those the kernel has always been compiled with."""
    fp8, scale_is_tensor, cache_dtype, kv_lora_rank, rope_dim = found
    fp8_max, mantissa_bits, min_exponent = fp8_format(cache_dtype)
    return KernelLaunch(
        _concat_and_cache_mla_kernel, found,
        dict(FP8=fp8, SCALE_IS_TENSOR=scale_is_tensor, FP8_MAX=fp8_max,
             EXACT_FP8_ROUNDING=fp8 and is_interpreted(_concat_and_cache_mla_kernel),
             MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent,
             BLOCK_C=next_power_of_2(kv_lora_rank), BLOCK_R=next_power_of_2(rope_dim)),
        dict(num_warps=4))


@triton.jit
def _ceil_pow2(x):
    """The smallest power of two >= ``x`` (positive, normal fp32), exactly, from the bits."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _indexer_k_quant_and_cache_kernel(
    k_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kd, stride_cache_b,
    block_size, head_dim,
    QUANT_BLOCK: tl.constexpr, UE8M0: tl.constexpr, FP8_MAX: tl.constexpr,
    EXACT_FP8_ROUNDING: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    num_groups = head_dim // QUANT_BLOCK

    d = tl.arange(0, BLOCK_Q).to(tl.int64)
    mask = d < QUANT_BLOCK
    channel = group * QUANT_BLOCK + d
    x = tl.load(k_ptr + token * stride_kt + channel * stride_kd, mask=mask, other=0.0)
    x = x.to(tl.float32)
    # IEEE divisions (div_rn), as in the reference: Triton's "/" is approximate on NVIDIA.
    amax = tl.maximum(tl.max(tl.abs(x), 0), 1e-4)
    scale = tl.math.div_rn(amax, tl.full([], FP8_MAX, tl.float32))
    if UE8M0:
        scale = _ceil_pow2(scale)
    y = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    if EXACT_FP8_ROUNDING:
        y = round_to_fp8_grid(y, 3, -6)

    # Block base from the cache's own stride(0) (bytes: the cache is uint8). Inside a block:
    # block_size * head_dim fp8 keys, then block_size * num_groups float32 scales.
    base = cache_ptr + block * stride_cache_b
    tl.store(base + offset * head_dim + channel,
             y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
    scale_ptr = base + block_size * head_dim + (offset * num_groups + group) * 4
    tl.store(scale_ptr.to(tl.pointer_type(tl.float32)), scale)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int = 128, scale_fmt: str | None = None) -> None:
    """Quantise DeepSeek-V3.2 indexer keys to fp8 with per-block scales and cache them (Triton).

    Semantics and layout are those of
    :func:`kvcore_mla.ops.reference.indexer_k_quant_and_cache_ref`: ``k`` ``(num_tokens,
    head_dim)``; ``kv_cache`` uint8 ``(num_blocks, block_size, head_dim + 4 * head_dim //
    quant_block_size)`` whose blocks are contiguous runs at ``stride(0)`` apart (one layer of
    a cross-layer pool included); negative slots skipped; ``scale_fmt`` ``None`` or
    ``"ue8m0"``. One program quantises one ``quant_block_size`` group of one token.
    """
    validate_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)
    num_tokens, head_dim = k.shape
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()  # read densely; a view may have stride > 1
    _indexer_k_quant_and_cache_kernel[(num_tokens, head_dim // quant_block_size)](
        k, kv_cache, slot_mapping,
        *k.stride(), kv_cache.stride(0),
        kv_cache.shape[1], head_dim,
        QUANT_BLOCK=quant_block_size, UE8M0=scale_fmt == "ue8m0", FP8_MAX=INDEXER_FP8_MAX,
        EXACT_FP8_ROUNDING=is_interpreted(_indexer_k_quant_and_cache_kernel),
        BLOCK_Q=next_power_of_2(quant_block_size),
        num_warps=4,
    )
