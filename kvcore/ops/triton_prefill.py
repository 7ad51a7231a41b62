"""TRITON_ATTN's prefill kernel, ``triton_prefill``: batches with more tokens than requests
(prefill, chunked prefill, mixed).

The program tile of the paged kernel (:mod:`kvcore.ops.triton_decode`), with the key loop cut
in up to three loops (:func:`_prefill_tiles`): key tiles every query of the query tile sees
(after the window's lower edge of its last query, up to its first query's position) run with no
mask, no load guard and the softmax scale folded into one multiply-add before ``exp2``; only
the tiles on the causal diagonal, on the window's lower edge and past the last key mask scores
and loads. The dots take bf16/fp16 operands and accumulate in fp32 (``tl.dot(p, v, acc)``).
Programs run last query tile first, so the longest causal tiles start first and the short ones
fill the last wave. ``EDGE_STAGES`` > 0 pipelines the masked edge loops that deep instead of
the launch's ``num_stages``. ``SOFT_CAP`` and ``HAS_SINKS`` as in the paged kernel
(:mod:`kvcore.ops.triton_decode`); with the soft-cap on, unmasked tiles cap the scaled scores
instead of folding the scale into ``exp2``.

fp8 caches (``FP8``) as in the paged kernel: K/V tiles converted in the loop (exact), the
scales on the scores and the output. With ``FP8_FP16`` (the config's ``fp8_fp16``) bf16
queries meet them in fp16 products (:func:`~kvcore.ops.triton_decode.fp16_query`: each query
row scaled by a power of two into fp16's range, the scores scaled back per row), because fp8
-> fp16 is one conversion instruction per two elements and fp8 -> bf16 three. The fp16 query
goes through the program's own output rows (:func:`_reloaded_query`) so that Hopper's
products read it from shared memory, as they read a bf16 query; V is converted where it is
loaded, so mma.sync targets read its operand with 16-bit matrix loads instead of single
bytes.

This module imports triton; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcore.ops.triton_decode import (
    fp16_query,
    initial_row_state,
    load_query_tile,
    page_ids,
    page_slots,
    soft_cap_scores,
)
from kvcore.ops.triton_utils import load_kv_scales, locate_query_tile, prefill_key_tiles, to_output

__all__ = ["prefill_attention_kernel"]


@triton.jit
def _reloaded_query(q, out_ptr, token, head, dims64, row_valid, d_valid,
                    stride_ot, stride_oh, stride_od, INTERPRET: tl.constexpr):
    """The fp16 query tile ``q`` ``(BLOCK_M, BLOCK_D)`` written to the program's own output
    rows and read back (fp16; float32 holding its values under the interpreter), so that
    Triton stages it in shared memory once for the products, as it does a query loaded from
    memory: a tile computed in registers becomes a register operand of Hopper's wgmma, read
    back from shared memory at every key step (sm_90a, sm90 row, Triton 3.9: 8 matrix loads a
    step and 200 instead of 178 registers at head size 64; spills inside the loop at 128).
    The rows are this program's alone and are overwritten by its output; an fp32 output holds
    each fp16 value in its first half."""
    UNITS: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth // 16
    o16 = out_ptr.to(tl.pointer_type(tl.float16))
    offs = (token[:, None] * stride_ot + head[:, None] * stride_oh
            + dims64[None, :] * stride_od) * UNITS
    mask = row_valid[:, None] & d_valid[None, :]
    tl.store(o16 + offs, q, mask=mask)
    tl.debug_barrier()  # other threads read what this one wrote
    q = tl.load(o16 + offs, mask=mask, other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    return q


@triton.jit
def _prefill_step(
    acc, l_i, m_i, page, t, hi, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
    d_valid, kv_end, block_size, sliding_window, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SOFT_CAP: tl.constexpr,
    V_EARLY: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """Key tile ``t`` of one query tile (its block ids ``page``); returns the updated state
    and the next tile's block ids."""
    k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    page64 = page.to(tl.int64)
    # The next tile's page ids, carried: the K/V addresses below depend only on loop-carried
    # values, so the pipeliner keeps num_stages - 1 tiles in flight.
    page = page_ids(bt_row, k_pos + BLOCK_N, kv_end, block_size, stride_btb, PAGE)
    in_page = page_slots(k_pos, block_size, PAGE)
    k_ptrs = (k_cache_ptr + (page64 * stride_kb + in_page * stride_ks
                             + kv_head64 * stride_kh)[:, None] + dims64[None, :] * stride_kd)
    v_ptrs = (v_cache_ptr + (page64 * stride_vb + in_page * stride_vs
                             + kv_head64 * stride_vh)[:, None] + dims64[None, :] * stride_vd)
    if MASKED:
        k_valid = k_pos < kv_end
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif V_EARLY:
        k = k.to(q.dtype)
        # V converted where it was loaded (as in the paged kernel, whose comment says why):
        # the select is always true (t < hi) and keeps Triton from moving the conversion
        # after shared memory, where mma.sync targets read the fp8 operand a byte at a time.
        # Hopper's wgmma takes V from shared memory in the products' dtype either way.
        v = tl.where(t < hi, v.to(q.dtype), 0.0)
    else:
        k = k.to(q.dtype)  # fp8 -> model dtype is exact; the scale is applied outside
        v = v.to(q.dtype)
    # The scores' scale: per row with ROW_SCALE (the fp16 query rows' powers of two).
    if ROW_SCALE:
        scale = qk_scale[:, None]
    else:
        scale = qk_scale

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        mask = k_valid[None, :]
        if CAUSAL:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
            if not CAUSAL:
                mask &= (k_pos[None, :] - q_pos[:, None]) < sliding_window
        s = s * scale
        if SOFT_CAP > 0:
            s = soft_cap_scores(s, SOFT_CAP)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
    elif SOFT_CAP > 0:
        s = soft_cap_scores(s * scale, SOFT_CAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    else:
        # qk_scale > 0 (validated; per row, also each row's power of two), so the row maximum
        # of the scaled scores is the scaled maximum, and the scale folds into one
        # multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new, page


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64, d_valid,
    lo, hi, kv_end, block_size, sliding_window, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr, SOFT_CAP: tl.constexpr,
    V_EARLY: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """Key tiles ``lo <= t < hi`` of one query tile. ``MASKED=False`` tiles are entirely
    visible to every query of the tile (no mask, no load guard); ``MASKED`` ones (the causal
    diagonal, the window's lower edge, the tail past ``kv_end``) mask scores and loads.
    ``STAGES`` > 0 pipelines this loop that deep instead of the launch's ``num_stages``."""
    page = page_ids(bt_row, lo * BLOCK_N + tl.arange(0, BLOCK_N), kv_end, block_size,
                     stride_btb, PAGE)
    if STAGES > 0:
        for t in tl.range(lo, hi, num_stages=STAGES):
            acc, l_i, m_i, page = _prefill_step(
                acc, l_i, m_i, page, t, hi, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64,
                dims64, d_valid, kv_end, block_size, sliding_window, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
                MASKED=MASKED, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, EVEN_D=EVEN_D,
                INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, PAGE=PAGE,
                SOFT_CAP=SOFT_CAP, V_EARLY=V_EARLY, ROW_SCALE=ROW_SCALE)
    else:
        for t in range(lo, hi):
            acc, l_i, m_i, page = _prefill_step(
                acc, l_i, m_i, page, t, hi, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64,
                dims64, d_valid, kv_end, block_size, sliding_window, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
                MASKED=MASKED, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, EVEN_D=EVEN_D,
                INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, PAGE=PAGE,
                SOFT_CAP=SOFT_CAP, V_EARLY=V_EARLY, ROW_SCALE=ROW_SCALE)
    return acc, l_i, m_i


@triton.jit
def prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, v_scale, sinks_ptr, qk_scale,
    num_seqs, num_queries_per_kv, block_size, head_size, sliding_window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, PAGE: tl.constexpr, EDGE_STAGES: tl.constexpr,
    FP8_FP16: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    # Last tiles first: under a causal mask they have the most keys, and the short ones then
    # fill the last wave.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    seq, q_start, q_len, q_tile = locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
        return
    q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q, last_q = \
        load_query_tile(q_ptr, seq_lens_ptr, seq, q_start, q_len, q_tile, kv_head,
                         num_queries_per_kv, head_size, stride_qt, stride_qh, stride_qd,
                         INTERPRET=INTERPRET, BLOCK_Q=BLOCK_Q, G_PAD=G_PAD, BLOCK_D=BLOCK_D)

    # With FP8_FP16, fp8 K/V meet bf16 queries in fp16 products (see the module docstring).
    FP8_16: tl.constexpr = FP8 and FP8_FP16
    FP16_DOTS: tl.constexpr = FP8_16 and q_ptr.dtype.element_ty == tl.bfloat16
    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR)
        qk_scale = qk_scale * ks
    if FP16_DOTS:
        q, row_up = fp16_query(q, INTERPRET)
        qk_scale = qk_scale * row_up
        q = _reloaded_query(q, out_ptr, token, head, dims64, row_valid, d_valid,
                            stride_ot, stride_oh, stride_od, INTERPRET)

    kv_end, lo, hi, full_lo, full_hi = prefill_key_tiles(
        first_q, last_q, seq_len, sliding_window, CAUSAL, USE_WINDOW, BLOCK_N)

    m_i, l_i = initial_row_state(sinks_ptr, head, row_valid, HAS_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bts
    kv_head64 = kv_head.to(tl.int64)
    if USE_WINDOW:
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
            d_valid, lo, full_lo, kv_end, block_size, sliding_window, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, stride_btb, MASKED=True, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
            EVEN_D=EVEN_D, INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
            PAGE=PAGE, STAGES=EDGE_STAGES, SOFT_CAP=SOFT_CAP, V_EARLY=FP8_16,
        ROW_SCALE=FP16_DOTS)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
        d_valid, full_lo, full_hi, kv_end, block_size, sliding_window, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
        stride_vd, stride_btb, MASKED=False, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        EVEN_D=EVEN_D, INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        PAGE=PAGE, STAGES=0, SOFT_CAP=SOFT_CAP, V_EARLY=FP8_16, ROW_SCALE=FP16_DOTS)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
        d_valid, full_hi, hi, kv_end, block_size, sliding_window, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
        stride_vd, stride_btb, MASKED=True, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        EVEN_D=EVEN_D, INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        PAGE=PAGE, STAGES=EDGE_STAGES, SOFT_CAP=SOFT_CAP, V_EARLY=FP8_16,
        ROW_SCALE=FP16_DOTS)

    if FP8:
        acc = acc * vs
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
             + dims64[None, :] * stride_od,
             to_output(out, out_ptr.dtype.element_ty, INTERPRET),
             mask=row_valid[:, None] & d_valid[None, :])

