"""The Triton MLA decode kernel and its named variants (a cache of one latent per token, as
DeepSeek-class models have).

A program owns one request, one group of ``BLOCK_H`` query heads and one of the request's KV
splits; it loads ``BLOCK_N`` latents a step, each read once for the whole head group, and
computes the group's scores with ``tl.dot`` (``[BLOCK_H, kv_lora_rank] x [kv_lora_rank,
BLOCK_N]`` plus the rope part), so 16 heads (8-way tensor parallelism) are bandwidth-bound and
128 heads (one GPU) run on the tensor cores. The value is the same tile (``acc += p x
latent``). A tile that lies in one page costs one block-table read. Programs are numbered with
the head block fastest, then the split, then the request: the programs that read the same keys
run side by side and share them through L2.

One ``@triton.jit`` kernel, three named variants (:data:`VARIANTS`, configurations in
:mod:`~kvcore_mla.ops.mla_configs`), selected by compile-time constants:

- ``"triton_mla_decode"``: pointer loads of the whole latent;
- ``"triton_mla_decode_halves"``: the latent in two column halves, an accumulator each;
- ``"triton_mla_decode_tma_keysplit"``: latent tiles through tensor descriptors (TMA) and the
  score tile shared by keys.

TMA loads: two ``tl.make_tensor_descriptor`` built on the device over the cache seen as rows of
its token stride (the ``kv_lora_rank`` channels, and the rope channels), a tile being
``BLOCK_N`` rows at ``page * (page stride / token stride) + offset in page``. On Hopper and
newer the TMA unit copies tiles into shared memory asynchronously, with no per-element address
registers; elsewhere Triton lowers the descriptor loads to ordinary loads. It needs ``BLOCK_N``
to divide the page size, contiguous channels and 16-byte aligned base, token stride and rope
offset (:func:`~kvcore_mla.ops.descriptors.tma_unmet`, checked before launch). Full tiles load
unmasked; a request's last, partial tile loads through two more descriptors whose rows end at
the request's last key, so the hardware zero-fills the stale rows past it (what the pointer
path's masked loads read), in a loop of its own so it too streams to shared memory. The kernel
builds its descriptors on the device, so a launch needs Triton's global scratch allocator
(:func:`~kvcore_mla.ops.descriptors.with_scratch_allocator`).

Warps of the score tile (key-split scores): Triton lays out a dot whose result feeds another
dot with every warp along its rows, so a softmax row stays inside one warp. For a 64-head
program of 8 warps that covers 128 rows: both warpgroups compute the same ``[64, BLOCK_N]``
scores, about half of MLA decode's FLOPs, twice. With key-split scores the two warpgroups
compute half the keys each (Triton's layout for a dot that feeds no dot); the row max then
crosses warpgroups through shared memory each step, and so do the probabilities on their way to
the value dot. The row sums are kept per key column and added up once after the loop (a
per-step row sum would cross warpgroups too). Triton decides by following the score's uses:
scaling each score part before they are added (otherwise the parts fuse into one accumulating
chain of dots), and the softmax inside a branch on a runtime condition that always holds
(``seq_len > 0``), end that walk before the value dot. The results agree within rounding (each
part is scaled before the sum); a compile test checks the layout Triton gives it.

fp8 caches: the tiles are converted in the loop (fp8 -> 16 bits is exact) and the per-tensor
scale goes on the scores and the output, once each. Converted to the query's dtype (the
config's ``fp8_fp16`` off), on sm_90a the latent tile is loaded in the loop without being
pipelined, staged in shared memory as fp8, and each dot converts its own operand: every latent
is converted twice, fp8 -> fp16 -> bf16 (the second step one conversion instruction per
element), and one operand is read a byte at a time. With ``FP8_FP16`` (the config's
``fp8_fp16``) the products run in fp16: bf16 queries are scaled per head by a power of two into
fp16's range (:func:`_fp16_rows`, exact), fp8 -> fp16 is one instruction per two elements, and
each tile is converted once, where it is loaded, and stored to shared memory once, in fp16, for
both dots (:func:`_opaque_fp16`: without it Triton moves the conversion past shared memory,
and it lays out both dots' operands for 8-bit data, the query's included, with a second fp16
copy of the tile for the score dot). The sm_90a loop of the 16-head tile on pages of 16 is
about 1200 instructions instead of 2800 (1770 for bf16), its latent tiles pipelined through
``cp.async`` as bf16 ones are (``benchmarks/bench_mla_fp8_decode.py`` times the options). The
PTX move makes the path NVIDIA's: the launcher refuses it on ROCm.

Scores use ``exp2`` with ``log2(e)`` folded into the scale; each split's normalised output and
base-2 log-sum-exp go to partial buffers that :func:`kvcore.ops.merge_kv_splits` reduces. All
address arithmetic is int64. Under ``TRITON_INTERPRET=1`` tiles are cast to float32 before
``tl.dot`` (the interpreter mishandles low-precision dots); on a GPU the dots run in the query
dtype.

This module imports triton; :mod:`kvcore_mla.ops` imports it lazily.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcore.ops import LOG2E, KVScale, merge_kv_splits
from kvcore.ops.triton_launch import KernelLaunch, arg_class
from kvcore.ops.triton_utils import is_interpreted, next_power_of_2, scale_arg
from kvcore_mla.ops.descriptors import tma_rows, with_scratch_allocator
from kvcore_mla.ops.mla_configs import (
    TritonMLADecodeConfig,
    TritonMLAHalvesConfig,
    TritonMLATMAKeySplitConfig,
)
from kvcore_mla.ops.triton_utils import is_rocm, pointer_classes
from kvcore_mla.ops.validation import FP8_DTYPES

__all__ = ["VARIANTS", "launch_triton_mla_decode"]

#: The kernel's named variants: ``(split_latent, tma, split_score_keys)`` by kernel name.
VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    TritonMLADecodeConfig.kernel: (False, False, False),
    TritonMLAHalvesConfig.kernel: (True, False, False),
    TritonMLATMAKeySplitConfig.kernel: (False, True, True),
}


@triton.jit
def _load_latent(rows, cols, stride_d, valid, like, width: tl.constexpr, EVEN: tl.constexpr,
                 CONVERT_AT_LOAD: tl.constexpr):
    """Columns ``cols`` of the latent rows ``rows`` (masked rows read 0) in ``like``'s dtype
    (the query tile's: fp8 -> model dtype is exact, the scale is applied outside; float32 under
    the interpreter). The column mask is left out when every column is inside ``width``, so
    the loads stay 16-byte vectors. ``CONVERT_AT_LOAD`` (fp8 tiles into fp16 products): the
    converted tile passes :func:`_opaque_fp16`, so it is stored to shared memory once, in
    fp16, for both dots (module docstring)."""
    if EVEN:
        tile = tl.load(rows[:, None] + cols[None, :] * stride_d, mask=valid[:, None], other=0.0)
    else:
        tile = tl.load(rows[:, None] + cols[None, :] * stride_d,
                       mask=valid[:, None] & (cols < width)[None, :], other=0.0)
    if CONVERT_AT_LOAD:
        return _opaque_fp16(tile.to(like.dtype))
    return tile.to(like.dtype)


@triton.jit
def _opaque_fp16(tile):
    """``tile`` (fp16) unchanged, through a PTX register move that Triton treats as having side
    effects: Triton neither moves the conversion before it past it nor looks through it for the
    dtype the dot operand came from (module docstring). ptxas drops the move."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tile], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def _load_query(q_rows, cols, stride_d, h_valid, width: tl.constexpr, INTERPRET: tl.constexpr):
    """Query columns ``cols`` of the head rows ``q_rows`` (float32 under the interpreter, which
    mishandles low-precision dots)."""
    q = tl.load(q_rows[:, None] + cols[None, :] * stride_d,
                mask=h_valid[:, None] & (cols < width)[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    return q


@triton.jit
def _fp16_rows(q0, q1, q_pe, SPLIT_LATENT: tl.constexpr, HAS_PE: tl.constexpr,
               INTERPRET: tl.constexpr):
    """The query parts of a head group (bf16 ``[BLOCK_H, *]`` tiles; float32 under the
    interpreter) for fp16 products with fp8 latents, and the power of two per head that undoes
    their scaling: ``(q0, q1, q_pe, up)``, each part times ``1 / up[:, None]`` in fp16 (float32
    holding fp16 values under the interpreter; a part that is absent is returned as it came).
    A head's parts share one factor (the score sums them), the one that puts its largest
    ``|q|`` in ``[2**14, 2**15)``, where fp16 holds every bf16 value exactly: elements down to
    ``2**-31`` of the head's largest stay exact, smaller ones become fp16 subnormals and may
    round."""
    top = tl.max(tl.abs(q0.to(tl.float32)), 1)
    if SPLIT_LATENT:
        top = tl.maximum(top, tl.max(tl.abs(q1.to(tl.float32)), 1))
    if HAS_PE:
        top = tl.maximum(top, tl.max(tl.abs(q_pe.to(tl.float32)), 1))
    exponent = (top.to(tl.int32, bitcast=True) >> 23) - 127
    # Clamped so both powers of two are normal float32 (heads of zeros, inf and NaN too).
    shift = tl.minimum(tl.maximum(exponent - 14, -100), 113)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)[:, None]
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    q0 = _fp16_part(q0, down, INTERPRET)
    if SPLIT_LATENT:
        q1 = _fp16_part(q1, down, INTERPRET)
    if HAS_PE:
        q_pe = _fp16_part(q_pe, down, INTERPRET)
    return q0, q1, q_pe, up


@triton.jit
def _fp16_part(q, down, INTERPRET: tl.constexpr):
    """``q * down`` rounded to fp16 (held in float32 under the interpreter)."""
    q16 = (q.to(tl.float32) * down).to(tl.float16)
    if INTERPRET:
        q16 = q16.to(tl.float32)
    return q16


@triton.jit
def _store_rows(base, cols, stride_d, values, h_valid, width: tl.constexpr):
    """``values`` into columns ``cols`` (those inside ``width``) of the head rows ``base``."""
    tl.store(base[:, None] + cols[None, :] * stride_d, values.to(base.dtype.element_ty),
             mask=h_valid[:, None] & (cols < width)[None, :])


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile's online-softmax step on the scaled, masked scores ``s`` ``[BLOCK_H,
    BLOCK_N]``: the new running max and sum, the tile's probabilities ``p`` and the factor
    ``alpha`` that rescales the accumulators (``acc = acc * alpha + p x value``)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _score_part(q, kv, qk_scale, SPLIT_SCORE_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One part (latent, latent half or rope) of a tile's scores ``[BLOCK_H, BLOCK_N]``: ``q x
    kv^T``, already scaled with ``SPLIT_SCORE_KEYS`` (the parts are then summed as separate
    dots: added unscaled, Triton fuses them into one accumulating chain of dots, which keeps
    the chained-dot layout; module docstring); the caller scales the sum otherwise."""
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
    if SPLIT_SCORE_KEYS:
        s = s * qk_scale
    return s


@triton.jit
def _softmax_step(s, m_i, l_i, like, live, SPLIT_SCORE_KEYS: tl.constexpr):
    """:func:`_online_softmax` with ``p`` in ``like``'s dtype. ``SPLIT_SCORE_KEYS``: inside a
    branch on ``live`` (a runtime condition that always holds), which ends Triton's walk from
    the score dot to the value dot (module docstring); the other branch is never taken. There
    ``l_i`` is ``[BLOCK_H, BLOCK_N]``, each key column's running sum, added up once after the
    loop: a row sum per step would cross the warpgroups through shared memory, as the row
    max does."""
    if SPLIT_SCORE_KEYS:
        if live:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_new = l_i * alpha[:, None] + p
            p = p.to(like.dtype)
        else:
            m_new = m_i
            l_new = l_i
            p = tl.zeros(s.shape, like.dtype)
            alpha = tl.full(m_i.shape, 1.0, tl.float32)
    else:
        m_new, l_new, p, alpha = _online_softmax(s, m_i, l_i)
        p = p.to(like.dtype)
    return m_new, l_new, p, alpha


@triton.jit
def _tma_tile(q0, q1, q_pe, nope_desc, pe_desc, row, m_i, l_i, acc0, acc1, valid, qk_scale,
              live, D_PE: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_LATENT: tl.constexpr,
              SPLIT_SCORE_KEYS: tl.constexpr, MASKED: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """One latent tile of the TMA path: ``BLOCK_N`` rows from ``row`` of the descriptors,
    read once as keys (scores against the head group) and values (``acc += p x latent``).
    ``MASKED``: scores of keys where ``valid`` is False are dropped (a request's last tile).
    ``live``: see :func:`_softmax_step`."""
    kv0 = nope_desc.load([row, 0]).to(q0.dtype)
    s = _score_part(q0, kv0, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
    if SPLIT_LATENT:
        kv1 = nope_desc.load([row, BLOCK_C]).to(q0.dtype)
        s += _score_part(q1, kv1, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
    if D_PE > 0:
        kpe = pe_desc.load([row, 0]).to(q0.dtype)
        s += _score_part(q_pe, kpe, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
    if not SPLIT_SCORE_KEYS:
        s = s * qk_scale
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, kv0, live, SPLIT_SCORE_KEYS)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0, input_precision=DOT_PRECISION)
    if SPLIT_LATENT:
        acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1, input_precision=DOT_PRECISION)
    return m_i, l_i, acc0, acc1


@triton.jit
def _mla_decode_kernel(
    q_ptr, kv_ptr, out_ptr, lse_ptr, part_ptr, part_lse_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, qk_scale, num_heads, num_head_blocks, num_splits, kv_rows, page_rows,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kd,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_sb, stride_sh, stride_ss,
    stride_btb, stride_btp,
    D_NOPE: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_LATENT: tl.constexpr, BLOCK_C: tl.constexpr,
    TMA: tl.constexpr, SPLIT_SCORE_KEYS: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr, SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_FP16: tl.constexpr,
):
    """One (head group, KV split, request) of MLA decode; see :func:`launch_triton_mla_decode`."""
    pid = tl.program_id(0)
    head_block = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % num_splits
    seq = (rest // num_splits).to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, num_tiles)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = heads < num_heads
    heads64 = heads.to(tl.int64)
    # SPLIT_LATENT: the latent is two column halves of BLOCK_C = BLOCK_D / 2, each its own key
    # part, value tile and float32 accumulator (same P): two independent dot chains a tile.
    c0 = tl.arange(0, BLOCK_C).to(tl.int64)
    c1 = BLOCK_C + c0
    # Latent rows are masked by token only when the width is a power of two (MLA's 512): a
    # mask along the contiguous dim could cost the 16-byte vector loads.
    EVEN_D: tl.constexpr = BLOCK_D == D_NOPE
    q_rows = q_ptr + seq * stride_qb + heads64 * stride_qh
    q0 = _load_query(q_rows, c0, stride_qd, h_valid, D_NOPE, INTERPRET)
    # Placeholders where a part is absent (never read: the constexpr flags skip it), so the
    # tile helpers take one signature.
    q1 = q0
    q_pe = q0
    if SPLIT_LATENT:
        q1 = _load_query(q_rows, c1, stride_qd, h_valid, D_NOPE, INTERPRET)
    if D_PE > 0:
        dpe = D_NOPE + tl.arange(0, BLOCK_PE).to(tl.int64)
        q_pe = _load_query(q_rows, dpe, stride_qd, h_valid, D_NOPE + D_PE, INTERPRET)
    if FP8:
        if SCALE_IS_TENSOR:
            ks = tl.load(k_scale).to(tl.float32)
        else:
            ks = k_scale
        qk_scale = qk_scale * ks
    # FP8_FP16 (module docstring): bf16 queries scaled per head into fp16, the power of two
    # that undoes it goes on the scores with the softmax scale ([BLOCK_H, 1] from here on) ...
    FP16_QUERY: tl.constexpr = FP8 and FP8_FP16 and q_ptr.dtype.element_ty == tl.bfloat16
    if FP16_QUERY:
        q0, q1, q_pe, up = _fp16_rows(q0, q1, q_pe, SPLIT_LATENT, D_PE > 0, INTERPRET)
        qk_scale = (qk_scale * up)[:, None]
    # ... and each pointer-loaded tile converted once, where it is loaded, for 16-bit queries
    # (float32 ones keep float32 products; the interpreter's tiles are float32 already).
    CONVERT_AT_LOAD: tl.constexpr = (FP8 and FP8_FP16 and not INTERPRET
                                     and q_ptr.dtype.element_ty != tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if SPLIT_SCORE_KEYS:  # per key column, summed after the loop (see _softmax_step)
        l_i = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    acc1 = 0.0  # a scalar placeholder: no second accumulator carried without SPLIT_LATENT
    if SPLIT_LATENT:
        acc1 = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    bt_row = block_table_ptr + seq * stride_btb
    offs_n = tl.arange(0, BLOCK_N)
    live = seq_len > 0  # true wherever a tile is computed: see _softmax_step
    # Page ids are read one tile ahead and carried into the next iteration: a latent load whose
    # address comes from a block-table load of the same iteration is not multi-buffered by
    # Triton's pipeliner (one tile in flight); from a carried value it is (num_stages - 1).
    if PAGE_SIZE % BLOCK_N == 0:  # a tile lies in one page: one block-table read a tile
        page_next = tl.load(bt_row + ((t_lo * BLOCK_N) // PAGE_SIZE) * stride_btp,
                            mask=t_lo < t_hi, other=0)
    else:
        pos_next = t_lo * BLOCK_N + offs_n
        page_next = tl.load(bt_row + (pos_next // PAGE_SIZE) * stride_btp,
                            mask=pos_next < seq_len, other=0)
    if TMA:
        # The cache as rows of stride_ks (a page starts every page_rows rows: the page size,
        # more on a cross-layer view), as two descriptors: the first D_NOPE channels and the
        # rope channels (the hardware zero-fills columns past each width). PAGE_SIZE % BLOCK_N
        # == 0 (checked on the host): a tile is BLOCK_N consecutive rows of one page.
        nope_desc = tl.make_tensor_descriptor(kv_ptr, shape=[kv_rows, D_NOPE],
                                              strides=[stride_ks, 1],
                                              block_shape=[BLOCK_N, BLOCK_C])
        pe_desc = nope_desc
        if D_PE > 0:
            pe_desc = tl.make_tensor_descriptor(kv_ptr + D_NOPE, shape=[kv_rows, D_PE],
                                                strides=[stride_ks, 1],
                                                block_shape=[BLOCK_N, BLOCK_PE])
        # Tiles whose every key is < seq_len load unmasked; only a request's last tile can be
        # partial, and it is done after the loop.
        t_full = tl.minimum(t_hi, seq_len // BLOCK_N)
        for t in tl.range(t_lo, t_full):
            start = t * BLOCK_N
            row = page_next.to(tl.int32) * page_rows + start % PAGE_SIZE
            page_next = tl.load(bt_row + ((start + BLOCK_N) // PAGE_SIZE) * stride_btp,
                                mask=t + 1 < t_hi, other=0)
            m_i, l_i, acc0, acc1 = _tma_tile(
                q0, q1, q_pe, nope_desc, pe_desc, row, m_i, l_i, acc0, acc1, offs_n, qk_scale,
                live, D_PE=D_PE, BLOCK_C=BLOCK_C, SPLIT_LATENT=SPLIT_LATENT,
                SPLIT_SCORE_KEYS=SPLIT_SCORE_KEYS, MASKED=False, DOT_PRECISION=DOT_PRECISION)
        if (t_lo <= t_full) & (t_full < t_hi):
            # The request's last tile, partly past seq_len, if it is this split's. The rows past
            # seq_len are stale cache bytes (any value, NaN included): descriptors whose rows
            # end at seq_len have the hardware zero-fill them, as the default path's masked
            # loads read them. A loop (of this one tile) so the pipeliner streams it to shared
            # memory as in the main loop instead of through registers.
            start = t_full * BLOCK_N
            tail = kv_ptr + (page_next.to(tl.int64) * page_rows + start % PAGE_SIZE) * stride_ks
            tail_nope = tl.make_tensor_descriptor(tail, shape=[seq_len - start, D_NOPE],
                                                  strides=[stride_ks, 1],
                                                  block_shape=[BLOCK_N, BLOCK_C])
            tail_pe = tail_nope
            if D_PE > 0:
                tail_pe = tl.make_tensor_descriptor(tail + D_NOPE, shape=[seq_len - start, D_PE],
                                                    strides=[stride_ks, 1],
                                                    block_shape=[BLOCK_N, BLOCK_PE])
            for t in tl.range(t_full, t_hi):
                m_i, l_i, acc0, acc1 = _tma_tile(
                    q0, q1, q_pe, tail_nope, tail_pe, (t - t_full) * BLOCK_N,  # 0: one tile
                    m_i, l_i, acc0, acc1, t * BLOCK_N + offs_n < seq_len, qk_scale, live,
                    D_PE=D_PE, BLOCK_C=BLOCK_C, SPLIT_LATENT=SPLIT_LATENT,
                    SPLIT_SCORE_KEYS=SPLIT_SCORE_KEYS, MASKED=True, DOT_PRECISION=DOT_PRECISION)
    else:
        for t in tl.range(t_lo, t_hi):
            start = t * BLOCK_N
            pos = start + offs_n
            valid = pos < seq_len  # every tile holds at least one key: rows never see only -inf
            page = page_next.to(tl.int64)
            if PAGE_SIZE % BLOCK_N == 0:
                rows = kv_ptr + page * stride_kb + ((start % PAGE_SIZE) + offs_n).to(tl.int64) * \
                    stride_ks
                page_next = tl.load(bt_row + ((start + BLOCK_N) // PAGE_SIZE) * stride_btp,
                                    mask=t + 1 < t_hi, other=0)
            else:
                rows = kv_ptr + page * stride_kb + (pos % PAGE_SIZE).to(tl.int64) * stride_ks
                pos_next = pos + BLOCK_N
                page_next = tl.load(bt_row + (pos_next // PAGE_SIZE) * stride_btp,
                                    mask=(pos_next < seq_len) & (pos_next < t_hi * BLOCK_N),
                                    other=0)
            # The latent tile, read once: keys (with the rope part) and values.
            kv0 = _load_latent(rows, c0, stride_kd, valid, q0, D_NOPE, EVEN_D, CONVERT_AT_LOAD)
            s = _score_part(q0, kv0, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
            if SPLIT_LATENT:
                kv1 = _load_latent(rows, c1, stride_kd, valid, q0, D_NOPE, EVEN_D,
                                   CONVERT_AT_LOAD)
                s += _score_part(q1, kv1, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
            if D_PE > 0:
                kpe = _load_latent(rows, dpe, stride_kd, valid, q0, D_NOPE + D_PE,
                                   BLOCK_PE == D_PE, CONVERT_AT_LOAD)
                s += _score_part(q_pe, kpe, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
            if not SPLIT_SCORE_KEYS:
                s = s * qk_scale
            m_i, l_i, p, alpha = _softmax_step(tl.where(valid[None, :], s, float("-inf")),
                                               m_i, l_i, kv0, live, SPLIT_SCORE_KEYS)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0, input_precision=DOT_PRECISION)
            if SPLIT_LATENT:
                acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1, input_precision=DOT_PRECISION)

    if FP8:
        acc0 = acc0 * ks
        if SPLIT_LATENT:
            acc1 = acc1 * ks
    if SPLIT_SCORE_KEYS:
        l_i = tl.sum(l_i, 1)
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)[:, None]
    lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    if SPLIT:
        # Partials (batch, heads, splits, D_NOPE): normalised output; (batch, heads, splits):
        # base-2 LSE.
        part = part_ptr + seq * stride_pb + heads64 * stride_ph + split * stride_ps
        _store_rows(part, c0, stride_pd, acc0 / l_safe, h_valid, D_NOPE)
        if SPLIT_LATENT:
            _store_rows(part, c1, stride_pd, acc1 / l_safe, h_valid, D_NOPE)
        tl.store(part_lse_ptr + seq * stride_sb + heads64 * stride_sh + split * stride_ss, lse2,
                 mask=h_valid)
    else:
        o_rows = out_ptr + seq * stride_ob + heads64 * stride_oh
        _store_rows(o_rows, c0, stride_od, acc0 / l_safe, h_valid, D_NOPE)
        if SPLIT_LATENT:
            _store_rows(o_rows, c1, stride_od, acc1 / l_safe, h_valid, D_NOPE)
        if WRITE_LSE:
            tl.store(lse_ptr + seq * stride_lb + heads64 * stride_lh,
                     (lse2 * 0.6931471805599453).to(lse_ptr.dtype.element_ty),  # x ln(2)
                     mask=h_valid)


def launch_triton_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: KVScale,
    num_splits: int,
    config: TritonMLADecodeConfig,
) -> None:
    """MLA decode: one program per (head group of ``config.block_h`` heads, KV split,
    request), head group fastest so the programs that read the same latents run side by side
    (L2). Each streams ``config.block_n`` latents a step, read once: scores against the whole
    head group with ``tl.dot`` (``[block_h, kv_lora_rank] x [kv_lora_rank, block_n]`` plus the
    rope part), online softmax in float32 with ``exp2``, and the same tile as the value
    (``acc += p x latent``). With splits, each split's normalised output and base-2 LSE go to
    ``partials`` (``(batch, heads, splits, kv_lora_rank)`` float32 or 16-bit, ``(batch, heads,
    splits)`` float32: :func:`~kvcore_mla.ops.triton_mla_attention.decode_partials`) and
    :func:`kvcore.ops.merge_kv_splits` reduces them. ``config`` names the variant (one of
    :data:`VARIANTS`' kernels). ``kv_cache`` is 3-dim ``(num_pages, page_size,
    kv_lora_rank + rope)`` of any strides; ``q`` ``(batch, heads, kv_lora_rank + rope)``;
    k_scale is used for fp8 caches."""
    batch, num_heads, k_dim = q.shape
    if batch == 0:
        return
    seq_lens = seq_lens.contiguous()  # read densely (see _launch)
    part, part_lse = partials if num_splits > 1 else (None, None)
    variant = VARIANTS.get(config.kernel)
    if variant is None:
        raise ValueError(f"config names the kernel {config.kernel!r}; this launcher runs "
                         f"{', '.join(VARIANTS)}")
    tma = variant[1]
    page_size = kv_cache.shape[1]
    pe_dim = k_dim - kv_lora_rank
    fp8 = kv_cache.dtype in FP8_DTYPES
    if fp8 and config.fp8_fp16 and is_rocm():
        raise ValueError(f"config.fp8_fp16=True on ROCm: its fp8 path is NVIDIA's (a PTX "
                         f"move); use dataclasses.replace(config, fp8_fp16=False) ({config})")
    ks = scale_arg(k_scale if fp8 else None, q.device)
    num_head_blocks = -(-num_heads // config.block_h)
    split = num_splits > 1
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0)
    part_strides = part.stride() if split else (0, 0, 0, 0)
    part_lse_strides = part_lse.stride() if split else (0, 0, 0)
    if not split:
        part = part_lse = out
    kv_rows = page_rows = 0
    if tma:
        kv_rows, page_rows = tma_rows(kv_cache, kv_lora_rank, config.block_n)
    scale_is_tensor = isinstance(ks, torch.Tensor)
    found = (config, kv_lora_rank, pe_dim, page_size, fp8, scale_is_tensor, split,
             lse is not None, q.dtype == torch.float32)
    kernel = _LAUNCHES.get(found)
    if kernel is None:
        kernel = _LAUNCHES[found] = _decode_launch(found)
    args = (q, kv_cache, out, lse_arg, part, part_lse, seq_lens, block_table,
            ks, float(scale) * LOG2E, num_heads, num_head_blocks, num_splits, kv_rows,
            page_rows, *q.stride(), *kv_cache.stride(), *out.stride(), *lse_strides,
            *part_strides, *part_lse_strides, *block_table.stride())
    # Triton specialises the pointers (dtype, alignment), the scale's kind and the ints.
    key = (pointer_classes(q, kv_cache, out, lse_arg, part, part_lse, seq_lens, block_table),
           arg_class(ks), args[10:])
    grid = (num_head_blocks * num_splits * batch, 1, 1)
    if tma:
        with_scratch_allocator(q.device, functools.partial(kernel, grid, args, key))
    else:
        kernel(grid, args, key)
    if split:
        merge_kv_splits(part, part_lse, out, lse)


#: The kernel's launches by what fixes their compile (config, sizes, dtypes' kinds, flags).
_LAUNCHES: dict[tuple, KernelLaunch] = {}


def _decode_launch(found: tuple) -> KernelLaunch:
    """The launch of :func:`launch_triton_mla_decode`'s lookup key ``found``: its constexprs
    and options, exactly those the kernel has always been compiled with."""
    (config, kv_lora_rank, pe_dim, page_size, fp8, scale_is_tensor, split, write_lse,
     fp32) = found
    split_latent, tma, split_score_keys = VARIANTS[config.kernel]
    block_d = max(16, next_power_of_2(kv_lora_rank))
    return KernelLaunch(
        _mla_decode_kernel, found,
        dict(D_NOPE=kv_lora_rank, D_PE=pe_dim, BLOCK_D=block_d,
             BLOCK_PE=max(16, next_power_of_2(max(pe_dim, 1))),
             PAGE_SIZE=page_size, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
             SPLIT_LATENT=split_latent, BLOCK_C=block_d // 2 if split_latent else block_d,
             TMA=tma, SPLIT_SCORE_KEYS=split_score_keys,
             FP8=fp8, SCALE_IS_TENSOR=scale_is_tensor, SPLIT=split,
             WRITE_LSE=write_lse, INTERPRET=is_interpreted(_mla_decode_kernel),
             DOT_PRECISION="ieee" if fp32 else None, FP8_FP16=fp8 and config.fp8_fp16),
        dict(num_warps=config.num_warps, num_stages=config.num_stages))
