"""``gluon_ws_pingpong``: prefill and chunked-prefill attention for Hopper in Gluon
(``triton.experimental.gluon``), Triton's lower-level language where the program places
layouts, shared memory, copies, barriers and wgmma waits itself. It computes what the Triton
prefill kernel (:mod:`kvcore.ops.triton_prefill`) computes (same program tile, same masks,
per-head sink logits; no logit soft-cap) and runs for a
:class:`~kvcore.ops.attention_config.GluonPrefillConfig`; it needs Triton 3.6 or newer and is
imported only then.

One program per (query tile, KV head), 12 warps in three warpgroups (``gl.warp_specialize``):
``BLOCK_Q`` query tokens x the ``G_PAD`` query heads that share the KV head, 128 rows, each of
two *consumer* warpgroups owning 64 of them whole (so the softmax never crosses warpgroups),
and a *copy* warpgroup (48 registers a thread, the consumers 232) that gathers K and V tiles of
``BLOCK_N`` keys through the block table by ``cp.async`` (any page size, any page stride) into
``STAGES`` shared-memory stages; masked rows are zero-filled, so no byte past a request's
visible keys is read and stale cache bytes never reach a product. Stages are handed over on
mbarriers: ``full`` receives each copy thread's ``cp.async.mbarrier.arrive``, ``empty`` one
arrive from each consumer. There is no CTA-wide barrier, so copies run up to ``STAGES`` tiles
ahead.

Each consumer step overlaps the softmax with the tensor cores, as FlashAttention-3 does: the
scores of tile ``i + 1`` are issued, then P x V of tile ``i`` (P from registers), the
warpgroup waits for the scores only and runs their softmax while P x V runs, then waits for
P x V and rescales the accumulator. The two consumers take turns issuing their wgmmas (an
mbarrier ``turn`` each: *ping-pong*), so that one's softmax runs while the other's products
do. Only tiles on the causal diagonal, on the window's lower edge or past the last key compute
a mask. The consumers store their output through their own query tile, so the kernel needs no
shared memory beyond its buffers (a layout conversion's scratch would stay reserved for the
whole kernel and leave no room for 128 keys x 3 stages).

Why not the Triton kernel: Triton waits every wgmma at once (``pendings = 0``) when its result
feeds the next dot, so its softmax never overlaps the tensor cores on Hopper. Most of this
kernel's lead came from the copy warpgroup's address arithmetic: its instructions share the
SMs' schedulers with the consumers, so what does not change between tiles is computed once
(:func:`_ws_loader`). Measurements: :mod:`kvcore.ops.attention_config` (Tuned rows).

Triton API differences handled here: 3.6 has ``gl.thread_barrier`` and
``async_copy.async_copy_global_to_shared``; 3.9 ``gl.barrier`` and ``async_copy.async_load``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# Scalar Triton helpers run in Gluon kernels too: request lookup and key-tile ranges are shared
# with the Triton prefill kernel.
from kvcore.ops.split_kv import LOG2E
from kvcore.ops.triton_utils import locate_query_tile, prefill_key_tiles

_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# 3.9 keeps the old name only to raise, so the new one is looked up first.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

#: The rows of one program: query tokens x padded GQA group.
BLOCK_M = 128
_LOG2E = gl.constexpr(LOG2E)


@gluon.constexpr_function
def _row_layout(warps, head_d):
    """Loads and stores of ``warps`` warps: 16 bytes a thread along a row of ``head_d``
    16-bit channels, rows across the warps."""
    row_threads = head_d // 8
    return gl.BlockedLayout(size_per_thread=[1, 8],
                            threads_per_warp=[32 // row_threads, row_threads],
                            warps_per_cta=[warps, 1], order=[1, 0])


@gluon.constexpr_function
def _mma_layout(warps, n):
    """A wgmma result of ``warps`` warps (rows 16 a warp) and ``n`` columns: the scores
    (``n`` = keys a step) or the accumulator (``n`` = head size)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def _mask_scores(s, t, q_pos, kv_end, sliding_window, CAUSAL: gl.constexpr,
                 USE_WINDOW: gl.constexpr, BLOCK_N: gl.constexpr):
    """Scores of key tile ``t`` with the keys a row must not see set to ``-inf``: past
    ``kv_end``, after the row's position (causal), outside its window (before it; after it
    too when not causal: the window is symmetric)."""
    k_pos = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    ok = (k_pos < kv_end)[None, :]
    if CAUSAL:
        ok = ok & (k_pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        ok = ok & ((q_pos[:, None] - k_pos[None, :]) < sliding_window)
        if not CAUSAL:
            ok = ok & ((k_pos[None, :] - q_pos[:, None]) < sliding_window)
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale):
    """Online softmax step (base 2, ``qk_scale`` = softmax scale x log2(e), > 0 so the scale
    folds into one multiply-add per score): ``(p, alpha, m_new, l_new)``. A row that has seen
    no key yet keeps ``m = -inf`` and gets ``p = 0``."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _tile_keys(seq_lens_ptr, seq, q_len, q_tile, sliding_window, CAUSAL: gl.constexpr,
               USE_WINDOW: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key tiles of query tile ``q_tile`` of request ``seq`` (:func:`prefill_key_tiles`):
    ``(first_q, kv_end, lo, n, full_lo, full_hi)``, ``n`` tiles from ``lo`` on, positions
    counted in the request's keys."""
    seq_len = gl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    first_q = context_len + q_tile * BLOCK_Q
    last_q = context_len + gl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q) - 1
    kv_end, lo, hi, full_lo, full_hi = prefill_key_tiles(
        first_q, last_q, seq_len, sliding_window, CAUSAL, USE_WINDOW, BLOCK_N)
    return first_q, kv_end, lo, hi - lo, full_lo, full_hi


@gluon.jit
def _stage_query(q_ptr, q_s, q_tile, q_start, q_len, kv_head, num_queries_per_kv, stride_qt,
                 stride_qh, stride_qd, ROW0: gl.constexpr, ROWS: gl.constexpr,
                 LD: gl.constexpr, BLOCK_Q: gl.constexpr, G_PAD: gl.constexpr,
                 HEAD_D: gl.constexpr):
    """Rows ``ROW0`` to ``ROW0 + ROWS - 1`` of the program's query tile into ``q_s`` (row r:
    query token r // G_PAD of the tile, query head r % G_PAD of the KV head's group; rows past
    the request or the group read 0): ``(token, head, row_ok, dims)`` of those rows, in ``LD``,
    for :func:`_store_rows`."""
    rows = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LD))
    q_idx = q_tile * BLOCK_Q + rows // G_PAD
    group = rows % G_PAD
    row_ok = (q_idx < q_len) & (group < num_queries_per_kv)
    head = (kv_head * num_queries_per_kv + group).to(gl.int64)
    token = (q_start + q_idx).to(gl.int64)
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LD)).to(gl.int64)
    q = gl.load(q_ptr + (token * stride_qt + head * stride_qh)[:, None]
                + dims[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    q_s.store(q)
    return token, head, row_ok, dims


@gluon.jit
def _initial_rows(sinks_ptr, kv_head, num_queries_per_kv, ROW0: gl.constexpr,
                  ROWS: gl.constexpr, S_L: gl.constexpr, HAS_SINKS: gl.constexpr,
                  G_PAD: gl.constexpr):
    """The online softmax's starting ``(m_i, l_i)`` of rows ``ROW0`` to ``ROW0 + ROWS - 1``
    (in the scores' row layout): nothing seen (``-inf``, 0), or with ``HAS_SINKS`` each row's
    sink logit already in (its base-2 logit, 1), as the Triton kernels start: the sink sits
    in the denominator once and adds no value. Rows past the group read 0 (never stored)."""
    if HAS_SINKS:
        group = (ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))) % G_PAD
        head = kv_head * num_queries_per_kv + group
        m_i = gl.load(sinks_ptr + head, mask=group < num_queries_per_kv,
                      other=0.0).to(gl.float32) * _LOG2E
        l_i = gl.full([ROWS], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
    else:
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, S_L))
    return m_i, l_i


@gluon.jit
def _masked_softmax(s, t, full_lo, full_hi, q_pos, kv_end, sliding_window, m_i, l_i, qk_scale,
                    CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr, BLOCK_N: gl.constexpr):
    """:func:`_softmax` of key tile ``t``'s scores, masked (:func:`_mask_scores`) only where
    some row does not see the whole tile."""
    if (t < full_lo) | (t >= full_hi):
        s = _mask_scores(s, t, q_pos, kv_end, sliding_window, CAUSAL, USE_WINDOW, BLOCK_N)
    return _softmax(s, m_i, l_i, qk_scale)


@gluon.jit
def _store_rows(out_ptr, acc, l_i, token, head, dims, row_ok, stride_ot, stride_oh, stride_od,
                staging, O_L: gl.constexpr, LD: gl.constexpr):
    """The normalised output (``acc / l``; a row that saw no key stores 0) at the rows
    :func:`_stage_query` read. The rows go from the accumulator's layout to ``LD`` through
    ``staging``, the warpgroup's own query tile (free once its last wgmma is waited), instead
    of a layout conversion, whose shared-memory scratch the compiler would reserve on top of
    the stages for the whole kernel."""
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, O_L)), 1)
    out = out.to(out_ptr.dtype.element_ty)
    staging.store(out)
    _cta_barrier()
    out = staging.load(LD)
    gl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None] + dims[None, :] * stride_od,
             out, mask=row_ok[:, None])


def gluon_prefill_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, scale: float, causal: bool, sliding_window: int | None,
    block_q: int, g_pad: int, block_n: int, num_stages: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Prefill attention into ``out`` with ``gluon_ws_pingpong``; arguments as
    :func:`kvcore.ops.triton_attention.paged_attention` takes them, already validated there
    (:func:`kvcore.ops.attention_dispatch.gluon_prefill_unmet` included), with the tile of its
    :class:`~kvcore.ops.attention_config.GluonPrefillConfig`: ``block_q`` tokens x ``g_pad``
    heads = :data:`BLOCK_M` rows, ``block_n`` keys a step, ``num_stages`` shared-memory
    stages; ``sinks`` ``(num_heads,)`` per-head sink logits in the softmax's denominator, or
    ``None``."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # The kernel launches its default partition (the first consumer warpgroup); its other two
    # warpgroups come with gl.warp_specialize.
    _gluon_prefill_ws_kernel[grid](
        query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
        query if sinks is None else sinks, float(scale) * LOG2E, num_seqs,
        num_heads // num_kv_heads,
        sliding_window or 0, *query.stride(), *key_cache.stride()[:3],
        *value_cache.stride()[:3], *out.stride(), *block_table.stride(),
        CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, BLOCK_Q=block_q,
        G_PAD=g_pad, BLOCK_N=block_n, HEAD_D=head_size, PAGE=key_cache.shape[1],
        STAGES=num_stages, KV_SAME=key_cache.stride()[:3] == value_cache.stride()[:3],
        num_warps=4,
    )


#: Registers a thread of each worker partition gets (the second consumer warpgroup, the copy
#: warpgroup); the default partition (the first consumer) gets the rest of the SM's 64K: the
#: three warpgroups' shares add up to 512 a thread-slot.
WS_CONSUMER_REGS = gl.constexpr(232)
WS_LOADER_REGS = gl.constexpr(48)


@gluon.jit
def _ws_loader(k_ptr, v_ptr, k_s, v_s, full, empty, bt_row, lo, n, kv_end, kv_head64,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
               BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, PAGE: gl.constexpr,
               STAGES: gl.constexpr, KV_SAME: gl.constexpr):
    """The copy warpgroup: K and V of each key tile gathered by ``cp.async`` into the stage
    its consumers released (``empty``). Each copy thread's ``cp.async.mbarrier.arrive`` lands
    on the tile's ``full`` barrier (count: the warpgroup's 128 threads) once its copies have,
    so the warpgroup never blocks on a copy and runs up to ``STAGES`` tiles ahead. (Arriving
    only after waiting for a tile's copies deadlocks at two stages: the wait for a released
    stage would come before the arrive the consumers need to release it.)"""
    LD: gl.constexpr = _row_layout(4, HEAD_D)
    CHUNK: gl.constexpr = 32
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LD))
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LD))[None, :]
    # Address arithmetic is most of this warpgroup's instructions, and they take issue slots
    # from the consumers, so what does not change is computed once: the head's offset goes
    # into the base pointers; a row's slot offset is fixed when pages divide the chunk, and a
    # chunk lies in one page (one block id) when the chunk divides pages; with KV_SAME (K and
    # V caches of equal strides, the usual allocation) V's copies reuse K's offsets.
    k_head = k_ptr + kv_head64 * stride_kh
    v_head = v_ptr + kv_head64 * stride_vh
    if PAGE % CHUNK == 0:
        in_page = (rows.to(gl.int64) * stride_ks)[:, None] + dims
    else:
        in_page = ((rows % PAGE).to(gl.int64) * stride_ks)[:, None] + dims
    for j in range(0, n):
        st = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(st), (j // STAGES - 1) & 1)
        # In chunks of CHUNK keys, so that a chunk's addresses are all a thread holds.
        for c in gl.static_range(BLOCK_N // CHUNK):
            start = (lo + j) * BLOCK_N + c * CHUNK
            k_pos = start + rows
            ok = k_pos < kv_end
            # block: the chunk's one block id, or each row's; slot: each row's in its block.
            if PAGE % CHUNK == 0:
                block = gl.load(bt_row + (start // PAGE).to(gl.int64) * stride_btb,
                                mask=start < kv_end, other=0).to(gl.int64)
                slot = start % PAGE + rows
                k_off = block * stride_kb + (start % PAGE).to(gl.int64) * stride_ks + in_page
            else:
                block = gl.load(bt_row + (k_pos // PAGE).to(gl.int64) * stride_btb, mask=ok,
                                other=0).to(gl.int64)
                slot = k_pos % PAGE
                if CHUNK % PAGE == 0:
                    k_off = (block * stride_kb)[:, None] + in_page
                else:
                    k_off = (block * stride_kb + slot.to(gl.int64) * stride_ks)[:, None] + dims
            _async_load(k_s.index(st).slice(c * CHUNK, CHUNK), k_head + k_off,
                        mask=ok[:, None])
            if KV_SAME:
                v_off = k_off
            else:
                v_off = (block * stride_vb + slot.to(gl.int64) * stride_vs)[:, None] + dims
            _async_load(v_s.index(st).slice(c * CHUNK, CHUNK), v_head + v_off,
                        mask=ok[:, None])
        async_copy.mbarrier_arrive(full.index(st), increment_count=False)


@gluon.jit
def _take_turn(turn, k, WG: gl.constexpr):
    """Before its ``k``-th issue of wgmmas, consumer ``WG`` waits until the other consumer has
    issued its previous ones (consumer 0's first turn is given at launch)."""
    mbarrier.wait(turn.index(WG), k & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr):
    """This consumer's wgmmas are issued; the other consumer's turn."""
    mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _ws_consumer(q_ptr, out_ptr, sinks_ptr, q_s, k_s, v_s, full, empty, turn, q_start,
                 q_len, q_tile, first_q,
                 kv_head, num_queries_per_kv, qk_scale, sliding_window, lo, n, full_lo,
                 full_hi, kv_end, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
                 stride_od, WG: gl.constexpr, CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr,
                 HAS_SINKS: gl.constexpr, BLOCK_Q: gl.constexpr, G_PAD: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup: rows ``64 * WG`` to ``64 * WG + 63`` of the program's tile (the
    next tile's scores and this tile's P x V on the tensor cores while the softmax runs), with
    the stages' readiness and release signalled through mbarriers, so the two consumers never
    wait on each other. They take turns issuing their wgmmas (``turn``, as FlashAttention-3
    schedules its warpgroups), so that one's softmax runs while the other's products do."""
    ROWS: gl.constexpr = 64
    S_L: gl.constexpr = _mma_layout(4, BLOCK_N)
    O_L: gl.constexpr = _mma_layout(4, HEAD_D)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    LD: gl.constexpr = _row_layout(4, HEAD_D)
    DTYPE: gl.constexpr = q_ptr.dtype.element_ty
    q_my = q_s.index(WG)

    token, head, row_ok, dims = _stage_query(
        q_ptr, q_my, q_tile, q_start, q_len, kv_head, num_queries_per_kv, stride_qt, stride_qh,
        stride_qd, WG * ROWS, ROWS, LD, BLOCK_Q, G_PAD, HEAD_D)
    hopper.fence_async_shared()
    _cta_barrier()  # this warpgroup's query rows are in place for its wgmmas
    q_pos = first_q + (WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))) // G_PAD

    m_i, l_i = _initial_rows(sinks_ptr, kv_head, num_queries_per_kv, WG * ROWS, ROWS, S_L,
                             HAS_SINKS, G_PAD)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=O_L)
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_L)
    mbarrier.wait(full.index(0), 0)
    hopper.fence_async_shared()  # the copies (generic proxy) before the wgmma reads (async)
    _take_turn(turn, 0, WG)
    s = hopper.warpgroup_mma(q_my, k_s.index(0).permute((1, 0)), zeros, is_async=True)
    _pass_turn(turn, WG)
    s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
    p, alpha, m_i, l_i = _masked_softmax(s, lo, full_lo, full_hi, q_pos, kv_end, sliding_window,
                                         m_i, l_i, qk_scale, CAUSAL, USE_WINDOW, BLOCK_N)
    p = gl.convert_layout(p.to(DTYPE), P_L)
    for i in range(0, n - 1):
        t = lo + i + 1
        nxt = (i + 1) % STAGES
        mbarrier.wait(full.index(nxt), ((i + 1) // STAGES) & 1)
        hopper.fence_async_shared()
        _take_turn(turn, i + 1, WG)
        s = hopper.warpgroup_mma(q_my, k_s.index(nxt).permute((1, 0)), zeros, is_async=True)
        acc = hopper.warpgroup_mma(p, v_s.index(i % STAGES), acc, is_async=True)
        _pass_turn(turn, WG)
        s = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[s])
        p_next, alpha, m_i, l_i = _masked_softmax(s, t, full_lo, full_hi, q_pos, kv_end,
                                                  sliding_window, m_i, l_i, qk_scale, CAUSAL,
                                                  USE_WINDOW, BLOCK_N)
        acc, p = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
        _cta_barrier()  # all four warps are done with tile i's stage
        mbarrier.arrive(empty.index(i % STAGES), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        p = gl.convert_layout(p_next.to(DTYPE), P_L)
    _take_turn(turn, n, WG)
    acc = hopper.warpgroup_mma(p, v_s.index((n - 1) % STAGES), acc, is_async=True)
    _pass_turn(turn, WG)
    acc, p = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
    _store_rows(out_ptr, acc, l_i, token, head, dims, row_ok, stride_ot, stride_oh, stride_od,
                q_my, O_L, LD)


@gluon.jit
def _gluon_prefill_ws_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    sinks_ptr, qk_scale, num_seqs, num_queries_per_kv, sliding_window,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_od, stride_bts, stride_btb,
    CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
    BLOCK_Q: gl.constexpr, G_PAD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
    PAGE: gl.constexpr, STAGES: gl.constexpr, KV_SAME: gl.constexpr,
):
    """One (query tile, KV head) of prefill attention, warp-specialised: two consumer
    warpgroups (64 rows each) and a copy warpgroup; see :func:`gluon_prefill_attention`."""
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    seq, q_start, q_len, q_tile = locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return
    first_q, kv_end, lo, n, full_lo, full_hi = _tile_keys(
        seq_lens_ptr, seq, q_len, q_tile, sliding_window, CAUSAL, USE_WINDOW, BLOCK_Q, BLOCK_N)

    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)
    DTYPE: gl.constexpr = q_ptr.dtype.element_ty
    k_s = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_D], SH)
    v_s = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_D], SH)
    q_s = gl.allocate_shared_memory(DTYPE, [2, 64, HEAD_D], SH)
    # full: an arrive from each of the copy warpgroup's threads a tile; empty: one from each
    # consumer warpgroup.
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(full.index(j), count=128)
        mbarrier.init(empty.index(j), count=2)
    # turn: consumer w issues its wgmmas after turn[w] completes a phase; the first phase of
    # consumer 0's is completed here.
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0), count=1)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bts
    gl.warp_specialize(
        [(_ws_consumer, (q_ptr, out_ptr, sinks_ptr, q_s, k_s, v_s, full, empty, turn,
                         q_start, q_len, q_tile, first_q, kv_head, num_queries_per_kv,
                         qk_scale, sliding_window, lo, n, full_lo, full_hi, kv_end, stride_qt,
                         stride_qh, stride_qd, stride_ot, stride_oh, stride_od, 0, CAUSAL,
                         USE_WINDOW, HAS_SINKS, BLOCK_Q, G_PAD, BLOCK_N, HEAD_D, STAGES)),
         (_ws_consumer, (q_ptr, out_ptr, sinks_ptr, q_s, k_s, v_s, full, empty, turn,
                         q_start, q_len, q_tile, first_q, kv_head, num_queries_per_kv,
                         qk_scale, sliding_window, lo, n, full_lo, full_hi, kv_end, stride_qt,
                         stride_qh, stride_qd, stride_ot, stride_oh, stride_od, 1, CAUSAL,
                         USE_WINDOW, HAS_SINKS, BLOCK_Q, G_PAD, BLOCK_N, HEAD_D, STAGES)),
         (_ws_loader, (k_ptr, v_ptr, k_s, v_s, full, empty, bt_row, lo, n, kv_end,
                       kv_head.to(gl.int64), stride_kb, stride_ks, stride_kh, stride_vb,
                       stride_vs, stride_vh, stride_btb, BLOCK_N, HEAD_D, PAGE, STAGES,
                       KV_SAME))],
        [4, 4], [WS_CONSUMER_REGS, WS_LOADER_REGS])
