"""The Triton kernel of :func:`kvcore.ops.split_kv.merge_kv_splits` (see that module for the
partial-result convention). This module imports triton; :mod:`kvcore.ops` imports it lazily."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_launch import KernelLaunch
from kvcore.ops.triton_utils import is_interpreted, next_power_of_2, to_output

__all__ = ["launch_merge"]


@triton.jit
def _merge_splits_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, sinks_ptr, v_dim,
    stride_pt, stride_ph, stride_ps, stride_pd,
    stride_qt, stride_qh, stride_qs,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    WRITE_LSE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_DV: tl.constexpr, INTERPRET: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD).to(tl.int64)
    part_lse = part_lse_ptr + token * stride_qt + head * stride_qh
    m = tl.max(tl.load(part_lse + splits * stride_qs, mask=splits < NUM_SPLITS,
                       other=float("-inf")), 0)
    if HAS_SINKS:  # the head's sink logit (base 2) joins the denominator once, here
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, BLOCK_DV).to(tl.int64)
    d_valid = d < v_dim
    part = part_ptr + token * stride_pt + head * stride_ph + d * stride_pd
    # One 1-D row a split, the splits unrolled: every thread sums its own channels over the
    # splits in registers. A [splits, channels] tile let Triton spread 16-bit rows over warps
    # on the splits axis, and its sum then crossed warps through shared memory (2x slower).
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    total = 0.0
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(part_lse + s * stride_qs) - m_use)  # 0 for an empty split
        row = tl.load(part + s * stride_ps, mask=d_valid, other=0.0).to(tl.float32)
        acc += w * row
        total += w
    if HAS_SINKS:
        total += tl.exp2(sink - m_use)
    has_keys = total > 0
    out = acc / tl.where(has_keys, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
             to_output(out, out_ptr.dtype.element_ty, INTERPRET), mask=d_valid)
    if WRITE_LSE:
        lse = tl.where(has_keys, (m_use + tl.log2(tl.where(has_keys, total, 1.0))), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh,
                 (lse * 0.6931471805599453).to(lse_ptr.dtype.element_ty))  # x ln(2)


def launch_merge(partials: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, sinks: torch.Tensor | None = None) -> None:
    """Launch the merge on tensors :func:`~kvcore.ops.split_kv.merge_kv_splits` describes,
    unchecked (kernels that built the partials call this directly)."""
    num_tokens, num_heads, num_splits, v_dim = partials.shape
    lse_arg = lse if lse is not None else out
    found = (num_splits, v_dim, partials.dtype, partial_lse.dtype, out.dtype, lse_arg.dtype,
             lse is not None, None if sinks is None else sinks.dtype)
    launch = _LAUNCHES.get(found)
    if launch is None:
        block_dv = max(16, next_power_of_2(v_dim))
        launch = KernelLaunch(
            _merge_splits_kernel, found,
            dict(WRITE_LSE=lse is not None, NUM_SPLITS=num_splits,
                 SPLITS_PAD=next_power_of_2(num_splits), BLOCK_DV=block_dv,
                 INTERPRET=is_interpreted(_merge_splits_kernel), HAS_SINKS=sinks is not None),
            # 16 bytes a thread a row: 4 warps on float32 rows of 512, 2 on 16-bit ones.
            dict(num_warps=max(1, min(8, block_dv * partials.element_size() // 512))))
        _LAUNCHES[found] = launch
    strides = (partials.stride(), partial_lse.stride(), out.stride(),
               lse.stride() if lse is not None else (0, 0))
    launch((num_tokens, num_heads, 1),
           (partials, partial_lse, out, lse_arg, out if sinks is None else sinks, v_dim,
            *strides[0], *strides[1], *strides[2], *strides[3]),
           (partials.data_ptr() & 15, partial_lse.data_ptr() & 15, out.data_ptr() & 15,
            lse_arg.data_ptr() & 15, None if sinks is None else sinks.data_ptr() & 15,
            strides))


#: Merge launches by what fixes their compile (split count, sizes, dtypes, flags).
_LAUNCHES: dict[tuple, KernelLaunch] = {}
