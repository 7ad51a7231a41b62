"""TRITON_ATTN's paged kernel: ``triton_decode``, and ``triton_split_kv`` with ``SPLIT_KV``.

A program owns one *query tile* of one request and one KV head: ``BLOCK_Q`` consecutive query
tokens times the ``num_heads // num_kv_heads`` query heads that share the KV head (padded to
``G_PAD``), i.e. ``BLOCK_M = BLOCK_Q * G_PAD`` rows. It streams the request's keys in tiles of
``BLOCK_N`` tokens gathered through the block table (each token's page looked up on its own, so
a tile may span pages and block ids are arbitrary), so every K/V byte is read once per
(request, KV head, query tile). The page ids of the next tile are loaded one iteration ahead,
so the K/V loads of a tile depend only on loop-carried values and Triton's pipeliner keeps
``num_stages - 1`` tiles in flight. Tiles entirely before the sliding window or after the last
query's position (causal) are never visited. Programs find their request by a binary search
over ``query_start_loc``, so the grid needs no host-side metadata and no device sync.

Split-KV: with ``SPLIT_KV`` the key range of every (query tile, KV head) is cut into
``num_splits`` contiguous parts processed by separate programs, each writing a normalised
partial output and its base-2 log-sum-exp to a float32 workspace
``(num_tokens, num_heads, num_splits, head_size)`` / ``(num_tokens, num_heads, num_splits)``,
which :func:`kvcore.ops.split_kv.merge_kv_splits` merges. Each request is split by its *own*
length, read on the device.

Features, compile-time switches that leave the kernel unchanged when off: ``SOFT_CAP`` > 0
caps every scaled score at ``cap * tanh(score / cap)`` before masking
(:func:`soft_cap_scores`); ``HAS_SINKS`` starts each row's online softmax with its head's sink
logit (:func:`initial_row_state`). A split launch leaves ``HAS_SINKS`` off and the merge adds
the sink once.

fp8 caches (``FP8``): K/V tiles are converted to the products' dtype in the loop (exact) and the
per-tensor scales go on the scores (``qk_scale * k_scale``) and the output (``* v_scale``), once
each. With ``FP8_FP16`` (the config's ``fp8_fp16``) bf16 queries meet them in fp16 products
(:func:`fp16_query` scales each query row by a power of two into fp16's range), because fp8 ->
fp16 is one conversion instruction per two elements and fp8 -> bf16 three; and V is converted
before it is staged in shared memory, so the ``P @ V`` operand is read back with 16-bit
matrix loads instead of single bytes.

The prologue (:func:`load_query_tile`) and page lookup (:func:`page_ids`, :func:`page_slots`) are
shared with the prefill kernel (:mod:`kvcore.ops.triton_prefill`). ``PAGE`` > 0 compiles the
block size in (shifts instead of integer divisions per key row).

This module imports triton; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcore.ops.triton_utils import load_kv_scales, locate_query_tile, to_output

__all__ = ["fp16_query", "initial_row_state", "load_query_tile", "page_ids", "page_slots",
           "paged_attention_kernel", "soft_cap_scores"]

#: ``log2(e)`` (as :data:`kvcore.ops.split_kv.LOG2E`): scores here are in base 2.
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def soft_cap_scores(s, SOFT_CAP: tl.constexpr):
    """Base-2 scores ``s`` (``score * LOG2E``) soft-capped: ``cap * tanh(score / cap)``,
    in base 2. ``tanh`` from one ``exp2`` of ``-2|y|`` (never overflows), sign restored."""
    cap2: tl.constexpr = SOFT_CAP * _LOG2E
    y = s * (1.0 / cap2)
    e = tl.exp2(tl.abs(y) * (-2.0 * _LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t) * cap2


@triton.jit
def initial_row_state(sinks_ptr, head, row_valid, HAS_SINKS: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """The online softmax's starting ``(m_i, l_i)`` of the program's rows: nothing seen
    (``-inf``, 0), or with ``HAS_SINKS`` each row's sink logit already in (its base-2
    logit, 1): the sink then sits in the denominator once and adds no value."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


@triton.jit
def fp16_query(q, INTERPRET: tl.constexpr):
    """A bf16 query tile ``(BLOCK_M, BLOCK_D)`` for fp16 products with fp8 keys, and the power
    of two per row that undoes its scaling: ``(q16, up)`` with ``q16 * up[:, None] == q``
    (``q16`` fp16, fp32 holding fp16 values under the interpreter; ``up`` fp32
    ``(BLOCK_M,)``). Each row is scaled by the power of two that puts its largest ``|q|`` in
    ``[2**14, 2**15)``, where fp16 holds every bf16 value exactly (8 significant bits in 11,
    none over 65504): elements down to ``2**-31`` of their row's largest stay exact, smaller
    ones become fp16 subnormals and may round."""
    qf = q.to(tl.float32)
    exponent = (tl.max(tl.abs(qf), 1).to(tl.int32, bitcast=True) >> 23) - 127
    # Clamped so both powers of two are normal float32 (rows of zeros, inf and NaN too).
    shift = tl.minimum(tl.maximum(exponent - 14, -100), 113)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    q16 = (qf * down[:, None]).to(tl.float16)
    if INTERPRET:
        q16 = q16.to(tl.float32)
    return q16, up


@triton.jit
def load_query_tile(
    q_ptr, seq_lens_ptr, seq, q_start, q_len, q_tile, kv_head, num_queries_per_kv, head_size,
    stride_qt, stride_qh, stride_qd,
    INTERPRET: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The program's rows (``BLOCK_Q`` tokens x ``G_PAD`` query heads of ``kv_head``) and its
    query tile: ``(q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q,
    last_q)``, positions counted in the request's keys."""
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    row_valid = (q_idx < q_len) & (g < num_queries_per_kv)
    head = (kv_head * num_queries_per_kv + g).to(tl.int64)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dims64 = dims.to(tl.int64)
    d_valid = dims < head_size
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + dims64[None, :] * stride_qd,
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    first_q = context_len + q_tile * BLOCK_Q
    last_q = context_len + tl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q) - 1
    return q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q, last_q


@triton.jit
def page_ids(bt_row, k_pos, kv_end, block_size, stride_btb, PAGE: tl.constexpr):
    """Block ids of key positions ``k_pos`` (0 past ``kv_end``, never read). ``PAGE`` > 0 is
    the block size as a compile-time constant (shifts instead of integer divisions)."""
    if PAGE > 0:
        idx = k_pos // PAGE
    else:
        idx = k_pos // block_size
    return tl.load(bt_row + idx * stride_btb, mask=k_pos < kv_end, other=0)


@triton.jit
def page_slots(k_pos, block_size, PAGE: tl.constexpr):
    """int64 slots of key positions ``k_pos`` in their blocks."""
    if PAGE > 0:
        slot = k_pos % PAGE
    else:
        slot = k_pos % block_size
    return slot.to(tl.int64)


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, v_scale, sinks_ptr, qk_scale,
    num_seqs, num_heads, num_queries_per_kv, block_size, head_size, sliding_window, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_KV: tl.constexpr, PAGE: tl.constexpr, FP8_FP16: tl.constexpr,
    SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq, q_start, q_len, q_tile = locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
        return
    q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q, last_q = \
        load_query_tile(q_ptr, seq_lens_ptr, seq, q_start, q_len, q_tile, kv_head,
                         num_queries_per_kv, head_size, stride_qt, stride_qh, stride_qd,
                         INTERPRET=INTERPRET, BLOCK_Q=BLOCK_Q, G_PAD=G_PAD, BLOCK_D=BLOCK_D)

    # Keys this tile can see: up to its last query (causal) or its window's end (non-causal
    # windows are symmetric), and from its first query's window.
    if CAUSAL:
        kv_end = last_q + 1
    elif USE_WINDOW:
        kv_end = last_q + tl.minimum(seq_len - last_q, sliding_window)
    else:
        kv_end = seq_len
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(first_q - sliding_window + 1, 0) // BLOCK_N
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT_KV:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    # fp8 K/V meet bf16 queries in fp16 products (see the module docstring).
    FP16_DOTS: tl.constexpr = FP8 and FP8_FP16 and q_ptr.dtype.element_ty == tl.bfloat16
    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR)
        qk_scale = qk_scale * ks
    if FP16_DOTS:
        q, row_up = fp16_query(q, INTERPRET)
        row_scale = qk_scale * row_up

    m_i, l_i = initial_row_state(sinks_ptr, head, row_valid, HAS_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bts
    kv_head64 = kv_head.to(tl.int64)
    # Page ids are fetched one tile ahead and carried, so the K/V addresses of a tile do not
    # wait on a load issued in the same iteration and the K/V loads can be pipelined deeper.
    offs_n = tl.arange(0, BLOCK_N)
    page = page_ids(bt_row, tile_lo * BLOCK_N + offs_n, kv_end, block_size, stride_btb, PAGE)
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + offs_n
        k_valid = k_pos < kv_end
        page64 = page.to(tl.int64)
        page = page_ids(bt_row, k_pos + BLOCK_N, kv_end, block_size, stride_btb, PAGE)
        in_page = page_slots(k_pos, block_size, PAGE)
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + (page64 * stride_kb + in_page * stride_ks
                                   + kv_head64 * stride_kh)[:, None]
                    + dims64[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (page64 * stride_vb + in_page * stride_vs
                                   + kv_head64 * stride_vh)[:, None]
                    + dims64[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif FP8 and FP8_FP16:
            # fp8 -> the products' dtype is exact; the scales go on the scores and output.
            k = k.to(q.dtype)
            # V converted where it was loaded, so it reaches shared memory as 16-bit rows that
            # the P @ V operand is read from with transposing matrix loads: converted after
            # shared memory (where Triton would move a bare conversion), the fp8 operand is
            # read a byte at a time and its copies are 8 bytes wide. The select is always
            # true (t < tile_hi); Triton does not move conversions past one, LLVM drops it.
            v = tl.where(t < tile_hi, v.to(q.dtype), 0.0)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        if FP16_DOTS:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * row_scale[:, None]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP > 0:
            s = soft_cap_scores(s, SOFT_CAP)
        mask = row_valid[:, None] & k_valid[None, :]
        if CAUSAL:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
            if not CAUSAL:
                mask &= (k_pos[None, :] - q_pos[:, None]) < sliding_window
        s = tl.where(mask, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * vs
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if not SPLIT_KV:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims64[None, :] * stride_od,
                 to_output(out, out_ptr.dtype.element_ty, INTERPRET), mask=store_mask)
    else:
        # Workspace (num_tokens, num_heads, num_splits, head_size), contiguous float32.
        part = (token * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * head_size + dims64[None, :], out,
                 mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)

