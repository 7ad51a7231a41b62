"""The Triton kernel ``"triton_mla_mixed"``: latent-space MLA for a batch that mixes prefill
(with a cached prefix) and decode requests, causal.

A program owns ``BLOCK_Q`` consecutive query tokens of one request times ``BLOCK_H`` query
heads (``BLOCK_M = BLOCK_Q * BLOCK_H`` rows; MLA's single latent is shared by all heads), and
one of ``NUM_SPLITS`` contiguous parts of the keys its tile sees. It streams ``BLOCK_N`` keys a
step, each token's page looked up in the block table and addressed as ``page * stride(0) +
offset * stride(1)`` with the cache's *real* strides, so a per-layer view of a cross-layer pool
(page stride ``num_layers`` times the page size) reads exactly the bytes of its layer and gives
bit-identical results. Latent tiles are loaded once: the ``[0, kv_lora_rank)`` channels serve
as the value tile and as the first part of the key, the rope channels as a second, small key
part (576 = 512 + 64 needs no padding to 1024). Scores use ``exp2`` with ``log2(e)`` folded
into the scale; with splits each split's normalised output and base-2 log-sum-exp go to a
float32 workspace that :func:`kvcore.ops.merge_kv_splits` reduces; with one split the kernel
writes the output itself. Programs are numbered with the head block fastest, then the split,
then the query tile, so the programs that read the same keys run side by side (L2).

All address arithmetic is int64. Under ``TRITON_INTERPRET=1`` tiles are cast to float32 before
``tl.dot`` (the interpreter mishandles low-precision dots); on a GPU the dots run in the query
dtype. This module imports triton; :mod:`kvcore_mla.ops` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops import LOG2E, KVScale, merge_kv_splits
from kvcore.ops.triton_launch import KernelLaunch, arg_class, int_class
from kvcore.ops.triton_utils import find_sequence, is_interpreted, next_power_of_2, scale_arg
from kvcore_mla.ops.mla_configs import TritonMLAMixedConfig
from kvcore_mla.ops.triton_utils import pointer_classes
from kvcore_mla.ops.validation import FP8_DTYPES

__all__ = ["launch_triton_mla_mixed"]


@triton.jit
def _mla_mixed_kernel(
    q_ptr, kv_ptr, out_ptr, part_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, qk_scale,
    num_seqs, num_heads, num_head_blocks, kv_lora_rank, k_dim,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kd,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_ps, stride_pd,
    stride_bts, stride_btb,
    PAGE_SIZE: tl.constexpr, HAS_PE: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DPE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    pid = tl.program_id(0)
    head_block = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % NUM_SPLITS
    tile = rest // NUM_SPLITS

    seq = find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    # Keys this tile sees (causal): up to its last query.
    kv_end = seq_len - q_len + tl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // BLOCK_H
    h = head_block * BLOCK_H + rows % BLOCK_H
    row_valid = (q_idx < q_len) & (h < num_heads)
    head = h.to(tl.int64)
    token = (q_start + q_idx).to(tl.int64)
    q_pos = context_len + q_idx
    q_row = q_ptr + token * stride_qt + head * stride_qh

    dk = tl.arange(0, BLOCK_DK).to(tl.int64)
    dk_valid = dk < kv_lora_rank
    q = tl.load(q_row[:, None] + dk[None, :] * stride_qd,
                mask=row_valid[:, None] & dk_valid[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    if HAS_PE:
        dpe = kv_lora_rank + tl.arange(0, BLOCK_DPE).to(tl.int64)
        dpe_valid = dpe < k_dim
        q_pe = tl.load(q_row[:, None] + dpe[None, :] * stride_qd,
                       mask=row_valid[:, None] & dpe_valid[None, :], other=0.0)
        if INTERPRET:
            q_pe = q_pe.to(tl.float32)

    if FP8:
        if SCALE_IS_TENSOR:
            ks = tl.load(k_scale).to(tl.float32)
        else:
            ks = k_scale
        qk_scale = qk_scale * ks

    # The keys are cut into NUM_SPLITS parts of whole BLOCK_N tiles.
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bts
    for t in range(t_lo, t_hi):
        k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        page = tl.load(bt_row + (k_pos // PAGE_SIZE) * stride_btb, mask=k_valid, other=0)
        in_page = (k_pos % PAGE_SIZE).to(tl.int64)
        # The page's address from the cache's own page stride: see the module docstring.
        k_row = kv_ptr + page.to(tl.int64) * stride_kb + in_page * stride_ks
        k = tl.load(k_row[:, None] + dk[None, :] * stride_kd,
                    mask=k_valid[:, None] & dk_valid[None, :], other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)  # fp8 -> model dtype is exact; the scale is applied outside
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_PE:
            k_pe = tl.load(k_row[:, None] + dpe[None, :] * stride_kd,
                           mask=k_valid[:, None] & dpe_valid[None, :], other=0.0)
            if INTERPRET:
                k_pe = k_pe.to(tl.float32)
            else:
                k_pe = k_pe.to(q.dtype)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = s * qk_scale
        # Causal within the tile's queries.
        mask = row_valid[:, None] & k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(mask, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # The latent's first kv_lora_rank channels are the value.
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * ks
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    d_out = tl.arange(0, BLOCK_DK).to(tl.int64)
    out_mask = row_valid[:, None] & (d_out[None, :] < kv_lora_rank)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None]
                 + d_out[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Workspace (tokens, heads, splits, kv_lora_rank + 1): the split's normalised output,
        # then its base-2 log-sum-exp.
        lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part = part_ptr + token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part[:, None] + d_out[None, :] * stride_pd, out, mask=out_mask)
        tl.store(part + kv_lora_rank * stride_pd, lse2, mask=row_valid)


def launch_triton_mla_mixed(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: KVScale,
    num_splits: int,
    config: TritonMLAMixedConfig,
) -> None:
    """Launch the mixed kernel (and the merge when split) on ``q`` ``(num_tokens, num_heads,
    kv_lora_rank + rope)`` over ``kv_cache`` ``(num_pages, page_size, kv_lora_rank + rope)``
    of any strides, into ``out`` ``(num_tokens, num_heads, kv_lora_rank)``. ``workspace``:
    with splits, ``(num_tokens, num_heads, num_splits, >= kv_lora_rank + 1)`` float32 rows
    (a split's normalised output, then its base-2 log-sum-exp); ``k_scale`` is used for fp8
    caches."""
    num_tokens, num_heads, k_dim = q.shape
    page_size = kv_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    # The kernel indexes these densely (the block table goes with its strides); an engine's
    # view of a larger buffer may have stride > 1 (contiguous() returns a dense tensor as is).
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    num_head_blocks = -(-num_heads // config.block_h)
    num_tiles = num_tokens // config.block_q + num_seqs
    pe_dim = k_dim - kv_lora_rank
    fp8 = kv_cache.dtype in FP8_DTYPES
    ks = scale_arg(k_scale if fp8 else None, q.device)
    block_dk = max(16, next_power_of_2(kv_lora_rank))
    split = num_splits > 1
    part = workspace if split else out
    part_strides = workspace.stride() if split else (0, 0, 0, 0)
    scale_is_tensor = isinstance(ks, torch.Tensor)
    found = (config, page_size, pe_dim > 0, fp8, scale_is_tensor, q.dtype == torch.float32,
             block_dk, pe_dim, num_splits)
    kernel = _LAUNCHES.get(found)
    if kernel is None:
        kernel = _LAUNCHES[found] = _mixed_launch(found)
    args = (q, kv_cache, out, part, query_start_loc, seq_lens, block_table,
            ks, float(scale) * LOG2E,
            num_seqs, num_heads, num_head_blocks, kv_lora_rank, k_dim,
            *q.stride(), *kv_cache.stride(), *out.stride(), *part_strides, *block_table.stride())
    # Triton specialises the pointers (dtype, alignment), the scale's kind and the ints (the
    # request count, which changes every step, by its class).
    kernel((num_tiles * num_splits * num_head_blocks, 1, 1), args,
           (pointer_classes(q, kv_cache, out, part, query_start_loc, seq_lens, block_table),
            arg_class(ks), int_class(num_seqs), args[10:]))
    if split:
        merge_kv_splits(workspace[..., :kv_lora_rank], workspace[..., kv_lora_rank], out)


#: The kernel's launches by what fixes their compile (config, sizes, dtypes' kinds, flags).
_LAUNCHES: dict[tuple, KernelLaunch] = {}


def _mixed_launch(found: tuple) -> KernelLaunch:
    """The launch of :func:`launch_triton_mla_mixed`'s lookup key ``found``: its constexprs
    and options, exactly those the kernel has always been compiled with."""
    config, page_size, has_pe, fp8, scale_is_tensor, fp32, block_dk, pe_dim, num_splits = found
    return KernelLaunch(
        _mla_mixed_kernel, found,
        dict(PAGE_SIZE=page_size, HAS_PE=has_pe,
             FP8=fp8, SCALE_IS_TENSOR=scale_is_tensor,
             INTERPRET=is_interpreted(_mla_mixed_kernel),
             # fp32 queries (tests) get exact dots; others the backend's default (names
             # differ between NVIDIA and AMD, so none is spelled out).
             DOT_PRECISION="ieee" if fp32 else None,
             BLOCK_Q=config.block_q, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
             BLOCK_DK=block_dk, BLOCK_DPE=max(16, next_power_of_2(max(pe_dim, 1))),
             NUM_SPLITS=num_splits),
        dict(num_warps=config.num_warps, num_stages=config.num_stages))
