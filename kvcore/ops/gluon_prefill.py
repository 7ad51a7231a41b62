"""Prefill and chunked-prefill attention for Hopper in Gluon (``triton.experimental.gluon``),
Triton's lower-level language where the program places layouts, shared memory, copies,
barriers and wgmma waits itself. It computes what :func:`kvcore.ops.triton_attention.
paged_attention`'s prefill kernel computes (same program tile, same masks) and runs when its
:class:`~kvcore.ops.triton_attention.AttentionConfig` has ``gluon=True``; it needs Triton 3.6
or newer and is imported only then.

One program per (query tile, KV head), 8 warps: ``BLOCK_Q`` query tokens x the ``G_PAD``
query heads that share the KV head, 128 rows, each warpgroup 64 of them (a warpgroup owns its
rows whole, so the softmax never crosses warpgroups). The query tile sits in shared memory; K
and V tiles of ``BLOCK_N`` keys are gathered through the block table by ``cp.async`` (any page
size, any page stride) into ``STAGES`` shared-memory stages, K and V in separate copy groups
so the scores of a tile wait for its K only; masked rows are zero-filled, so no byte past a
request's visible keys is read and stale cache bytes never reach a product.

Each step overlaps the softmax with the tensor cores, as FlashAttention-3 does within a
warpgroup: the scores of tile ``i + 1`` are issued, then P x V of tile ``i`` (P from
registers), the program waits for the scores only and runs their softmax while P x V runs,
then waits for P x V and rescales the accumulator. Right behind the step's wgmmas go the
refills: the K stage of tile ``i`` (its scores are done) and the V stage of tile ``i - 1`` (its
P x V is done) take the tiles ``STAGES`` ahead, so at two stages a copy has a whole step to
land; one CTA barrier a step makes the landed copies visible and the freed stages safe to
overwrite. Only tiles on the causal diagonal, on the window's lower edge or past the last key
compute a mask.

Why not the Triton kernel (``_prefill_attention_kernel``): Triton waits every wgmma at once
(``pendings = 0``) when its result feeds the next dot, so its softmax never overlaps the
tensor cores on Hopper (``benchmarks/RESULTS.md``, the Gluon prefill sections).

Triton API differences handled here: 3.6 has ``gl.thread_barrier`` and
``async_copy.async_copy_global_to_shared``; 3.9 ``gl.barrier`` and ``async_copy.async_load``.

Two kernels. :func:`_gluon_prefill_kernel` is the one described above: eight warps that both
copy and compute, meeting at one CTA barrier a step. :func:`_gluon_prefill_ws_kernel`
(``warp_specialize`` in the config as well as ``gluon``) splits them with
``gl.warp_specialize``: two consumer warpgroups of 64 rows run the same schedule, and a copy
warpgroup (48 registers a thread, the consumers 232) gathers K/V by ``cp.async`` into the
stages. Stages are handed over on mbarriers: ``full`` receives each copy thread's
``cp.async.mbarrier.arrive``, ``empty`` one arrive from each consumer. There is no CTA-wide
barrier, so neither consumer waits for the other, and copies run up to ``STAGES`` tiles ahead.
With ``pingpong`` as well, the two consumers take turns issuing their wgmmas (an mbarrier
``turn`` each, FlashAttention-3's warpgroup schedule), so that one's softmax runs while the
other's products do. The consumers store their output through their own query tile, so the
kernel needs no shared memory beyond its buffers (a layout conversion's scratch would stay
reserved for the whole kernel and leave no room for 128 keys x 3 stages).

Status (2026-12-02, H200, Triton 3.6): both kernels pass their GPU tests
(``tests/ops/test_gluon_prefill.py``), ping-pong included. sm90's
:data:`~kvcore.ops.triton_attention.GLUON_PREFILL_TILES` row is the warp-specialised kernel
with ping-pong, 128 keys, 3 stages: 0.94x / 1.01x / 0.95x FlashInfer's speed on the three
prefill cases of ``bench_triton_prefill.py`` (4 x 2048, 1 x 8192, 4 x 512 over 16k cached).
Most of that came from the copy warpgroup's address arithmetic: its instructions share the
SMs' schedulers with the consumers, and halving them (769 to 403 a tile) took 17-20% off.
The plain kernel is slower than the Triton row and runs only when a config asks for it
(``benchmarks/RESULTS.md``, the Gluon prefill sections).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# Scalar Triton helpers run in Gluon kernels too: request lookup and key-tile ranges are shared
# with the Triton prefill kernel (kvcore.ops.triton_attention, which imports this module, never
# the other way round).
from kvcore.ops.triton_utils import locate_query_tile, prefill_key_tiles

_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# 3.9 keeps the old name only to raise, so the new one is looked up first.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

#: Scores use exp2: the softmax scale is multiplied by log2(e).
_LOG2E = 1.4426950408889634
#: The rows of one program (query tokens x padded GQA group) and its warps.
BLOCK_M = 128
NUM_WARPS = 8


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
def _tile_pages(bt_row, t, kv_end, stride_btb, LD: gl.constexpr, BLOCK_N: gl.constexpr,
                PAGE: gl.constexpr):
    """Block ids of key tile ``t``'s rows (0 past ``kv_end``: those rows are never read)."""
    k_pos = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    return gl.load(bt_row + (k_pos // PAGE).to(gl.int64) * stride_btb, mask=k_pos < kv_end,
                   other=0)


@gluon.jit
def _issue_tile(cache_ptr, buf, pages, t, kv_end, kv_head64, stride_b, stride_s, stride_h,
                LD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                PAGE: gl.constexpr):
    """``cp.async`` copies of key tile ``t`` of one cache (K or V; rows in blocks ``pages``)
    into ``buf``, not yet committed. Rows at or past ``kv_end`` are zero-filled, not read."""
    k_pos = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    slot = (k_pos % PAGE).to(gl.int64)
    rows = cache_ptr + (pages.to(gl.int64) * stride_b + slot * stride_s
                        + kv_head64 * stride_h)[:, None]
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LD))[None, :]
    _async_load(buf, rows + dims, mask=(k_pos < kv_end)[:, None])


@gluon.jit
def _copies_landed(pending: gl.constexpr):
    """Wait until at most ``pending`` copy groups of this thread are in flight, then make
    every thread's landed copies visible to the tensor cores (wgmma reads shared memory
    through the async proxy; ``cp.async`` writes through the generic one)."""
    async_copy.wait_group(pending)
    hopper.fence_async_shared()
    _cta_barrier()


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
def _masked_softmax(s, t, full_lo, full_hi, q_pos, kv_end, sliding_window, m_i, l_i, qk_scale,
                    CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr, BLOCK_N: gl.constexpr):
    """:func:`_softmax` of key tile ``t``'s scores, masked (:func:`_mask_scores`) only where
    some row does not see the whole tile."""
    if (t < full_lo) | (t >= full_hi):
        s = _mask_scores(s, t, q_pos, kv_end, sliding_window, CAUSAL, USE_WINDOW, BLOCK_N)
    return _softmax(s, m_i, l_i, qk_scale)


@gluon.jit
def _store_rows(out_ptr, acc, l_i, token, head, dims, row_ok, stride_ot, stride_oh, stride_od,
                staging, O_L: gl.constexpr, LD: gl.constexpr, STAGED: gl.constexpr):
    """The normalised output (``acc / l``; a row that saw no key stores 0) at the rows
    :func:`_stage_query` read. ``STAGED``: the rows go from the accumulator's layout to
    ``LD`` through ``staging``, the warpgroup's own query tile (free once its last wgmma is
    waited), instead of a layout conversion, whose shared-memory scratch the compiler would
    reserve on top of the stages for the whole kernel."""
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, O_L)), 1)
    out = out.to(out_ptr.dtype.element_ty)
    if STAGED:
        staging.store(out)
        _cta_barrier()
        out = staging.load(LD)
    else:
        out = gl.convert_layout(out, LD)
    gl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None] + dims[None, :] * stride_od,
             out, mask=row_ok[:, None])


@gluon.jit
def _gluon_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, num_seqs, num_queries_per_kv, sliding_window,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_od, stride_bts, stride_btb,
    CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr, BLOCK_Q: gl.constexpr,
    G_PAD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, PAGE: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One (query tile, KV head) of prefill attention; see :func:`gluon_prefill_attention`."""
    BLOCK_M: gl.constexpr = BLOCK_Q * G_PAD
    # Last tiles first: under a causal mask they have the most keys, the short ones then fill
    # the last wave.
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    seq, q_start, q_len, q_tile = locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
        return
    first_q, kv_end, lo, n, full_lo, full_hi = _tile_keys(
        seq_lens_ptr, seq, q_len, q_tile, sliding_window, CAUSAL, USE_WINDOW, BLOCK_Q, BLOCK_N)

    S_L: gl.constexpr = _mma_layout(8, BLOCK_N)
    O_L: gl.constexpr = _mma_layout(8, HEAD_D)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    LD: gl.constexpr = _row_layout(8, HEAD_D)
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)
    DTYPE: gl.constexpr = q_ptr.dtype.element_ty

    k_s = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_D], SH)
    v_s = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_D], SH)
    q_s = gl.allocate_shared_memory(DTYPE, [BLOCK_M, HEAD_D], SH)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bts
    kv_head64 = kv_head.to(gl.int64)
    # Copy groups, in commit order: K and V of the first STAGES tiles (before the query is
    # read); then two a step: V of the tile before the step's (an empty group in the first
    # step) and K of the tile STAGES ahead, each into the stage its tile's last reader freed.
    for j in gl.static_range(STAGES):
        pages = _tile_pages(bt_row, lo + j, kv_end, stride_btb, LD, BLOCK_N, PAGE)
        _issue_tile(k_ptr, k_s.index(j), pages, lo + j, kv_end, kv_head64, stride_kb,
                    stride_ks, stride_kh, LD, BLOCK_N, HEAD_D, PAGE)
        async_copy.commit_group()
        _issue_tile(v_ptr, v_s.index(j), pages, lo + j, kv_end, kv_head64, stride_vb,
                    stride_vs, stride_vh, LD, BLOCK_N, HEAD_D, PAGE)
        async_copy.commit_group()
    # Block ids are read a step before the copies that use them (K's), and V's reuse K's of
    # the step before, so no copy waits on a block-table read: at the start of step i,
    # ``pages_v`` holds tile lo + i + STAGES - 1's (the newest K issued), ``pages_ahead`` the
    # next tile's. (``pages_v`` must not start as the same value as ``pages_ahead``: Triton
    # carries a variable through a loop only if its value differs after the body from before
    # the loop, and ``pages_v = pages_ahead`` would then pin it to its first value.)
    pages_v = pages
    pages_ahead = _tile_pages(bt_row, lo + STAGES, kv_end, stride_btb, LD, BLOCK_N, PAGE)

    token, head, row_ok, dims = _stage_query(
        q_ptr, q_s, q_tile, q_start, q_len, kv_head, num_queries_per_kv, stride_qt, stride_qh,
        stride_qd, 0, BLOCK_M, LD, BLOCK_Q, G_PAD, HEAD_D)
    q_pos = first_q + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L)) // G_PAD

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=O_L)
    zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    _copies_landed(2 * STAGES - 1)  # K of tile lo (and the query's store)
    s = hopper.warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), zeros, is_async=True)
    s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
    p, alpha, m_i, l_i = _masked_softmax(s, lo, full_lo, full_hi, q_pos, kv_end, sliding_window,
                                         m_i, l_i, qk_scale, CAUSAL, USE_WINDOW, BLOCK_N)
    p = gl.convert_layout(p.to(DTYPE), P_L)
    for i in range(0, n - 1):
        t = lo + i + 1
        stage = i % STAGES
        # V of tile i and K of tile i + 1 (the count holds from the first step on, where it
        # waits a little more than it must); every warp is then past step i - 1, so the K
        # stage of tile i (its scores are done) and the V stage of tile i - 1 are free.
        _copies_landed(2 * STAGES - 4)
        s = hopper.warpgroup_mma(q_s, k_s.index((i + 1) % STAGES).permute((1, 0)), zeros,
                                 is_async=True)
        acc = hopper.warpgroup_mma(p, v_s.index(stage), acc, is_async=True)
        # The refills go out while the tensor cores run.
        if i > 0:
            _issue_tile(v_ptr, v_s.index((i + STAGES - 1) % STAGES), pages_v, t + STAGES - 2,
                        kv_end, kv_head64, stride_vb, stride_vs, stride_vh, LD, BLOCK_N,
                        HEAD_D, PAGE)
        async_copy.commit_group()
        _issue_tile(k_ptr, k_s.index(stage), pages_ahead, t + STAGES - 1, kv_end, kv_head64,
                    stride_kb, stride_ks, stride_kh, LD, BLOCK_N, HEAD_D, PAGE)
        async_copy.commit_group()
        pages_v = pages_ahead
        pages_ahead = _tile_pages(bt_row, t + STAGES, kv_end, stride_btb, LD, BLOCK_N, PAGE)
        s = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[s])
        p_next, alpha, m_i, l_i = _masked_softmax(s, t, full_lo, full_hi, q_pos, kv_end,
                                                  sliding_window, m_i, l_i, qk_scale, CAUSAL,
                                                  USE_WINDOW, BLOCK_N)
        acc, p = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        p = gl.convert_layout(p_next.to(DTYPE), P_L)
    _copies_landed(2 * STAGES - 3)  # V of the last tile
    acc = hopper.warpgroup_mma(p, v_s.index((n - 1) % STAGES), acc, is_async=True)
    acc, p = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
    async_copy.wait_group(0)  # the zero-filled copies past the last tile
    _store_rows(out_ptr, acc, l_i, token, head, dims, row_ok, stride_ot, stride_oh, stride_od,
                q_s, O_L, LD, False)


def gluon_prefill_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, scale: float, causal: bool, sliding_window: int | None,
    block_q: int, g_pad: int, block_n: int, num_stages: int, warp_specialize: bool = False,
    pingpong: bool = False,
) -> None:
    """Prefill attention into ``out`` with the Gluon kernel; arguments as
    :func:`kvcore.ops.triton_attention.paged_attention` takes them, already validated there
    (its ``gluon_prefill_unmet`` check included), with the tile of its config: ``block_q``
    tokens x ``g_pad`` heads = :data:`BLOCK_M` rows, ``block_n`` keys a step, ``num_stages``
    shared-memory stages; ``warp_specialize`` runs :func:`_gluon_prefill_ws_kernel`, whose
    consumers take turns issuing their wgmmas with ``pingpong``."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    kernel = _gluon_prefill_ws_kernel if warp_specialize else _gluon_prefill_kernel
    # The warp-specialised kernel launches its default partition (the first consumer
    # warpgroup); its other two warpgroups come with gl.warp_specialize.
    kernel[grid](
        query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
        float(scale) * _LOG2E, num_seqs, num_heads // num_kv_heads,
        sliding_window or 0, *query.stride(), *key_cache.stride()[:3],
        *value_cache.stride()[:3], *out.stride(), *block_table.stride(),
        CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None, BLOCK_Q=block_q,
        G_PAD=g_pad, BLOCK_N=block_n, HEAD_D=head_size, PAGE=key_cache.shape[1],
        STAGES=num_stages, num_warps=4 if warp_specialize else NUM_WARPS,
        **({"PINGPONG": pingpong,
            "KV_SAME": key_cache.stride()[:3] == value_cache.stride()[:3]}
           if warp_specialize else {}),
    )


# --- Warp-specialised variant ------------------------------------------------------------
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
def _take_turn(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: before its ``k``-th issue of wgmmas, consumer ``WG`` waits until the other
    consumer has issued its previous ones (consumer 0's first turn is given at launch)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), k & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this consumer's wgmmas are issued; the other consumer's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _ws_consumer(q_ptr, out_ptr, q_s, k_s, v_s, full, empty, turn, q_start, q_len, q_tile,
                 first_q,
                 kv_head, num_queries_per_kv, qk_scale, sliding_window, lo, n, full_lo,
                 full_hi, kv_end, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
                 stride_od, WG: gl.constexpr, CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr,
                 BLOCK_Q: gl.constexpr, G_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup: rows ``64 * WG`` to ``64 * WG + 63`` of the program's tile, the
    same schedule as :func:`_gluon_prefill_kernel`'s (the next tile's scores and this tile's
    P x V on the tensor cores while the softmax runs), with the stages' readiness and release
    signalled through mbarriers instead of CTA barriers, so the two consumers never wait on
    each other. With ``PINGPONG`` they take turns issuing their wgmmas (``turn``, as
    FlashAttention-3 schedules its warpgroups), so that one's softmax runs while the other's
    products do."""
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

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=O_L)
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_L)
    mbarrier.wait(full.index(0), 0)
    hopper.fence_async_shared()  # the copies (generic proxy) before the wgmma reads (async)
    _take_turn(turn, 0, WG, PINGPONG)
    s = hopper.warpgroup_mma(q_my, k_s.index(0).permute((1, 0)), zeros, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
    p, alpha, m_i, l_i = _masked_softmax(s, lo, full_lo, full_hi, q_pos, kv_end, sliding_window,
                                         m_i, l_i, qk_scale, CAUSAL, USE_WINDOW, BLOCK_N)
    p = gl.convert_layout(p.to(DTYPE), P_L)
    for i in range(0, n - 1):
        t = lo + i + 1
        nxt = (i + 1) % STAGES
        mbarrier.wait(full.index(nxt), ((i + 1) // STAGES) & 1)
        hopper.fence_async_shared()
        _take_turn(turn, i + 1, WG, PINGPONG)
        s = hopper.warpgroup_mma(q_my, k_s.index(nxt).permute((1, 0)), zeros, is_async=True)
        acc = hopper.warpgroup_mma(p, v_s.index(i % STAGES), acc, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        s = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[s])
        p_next, alpha, m_i, l_i = _masked_softmax(s, t, full_lo, full_hi, q_pos, kv_end,
                                                  sliding_window, m_i, l_i, qk_scale, CAUSAL,
                                                  USE_WINDOW, BLOCK_N)
        acc, p = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
        _cta_barrier()  # all four warps are done with tile i's stage
        mbarrier.arrive(empty.index(i % STAGES), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        p = gl.convert_layout(p_next.to(DTYPE), P_L)
    _take_turn(turn, n, WG, PINGPONG)
    acc = hopper.warpgroup_mma(p, v_s.index((n - 1) % STAGES), acc, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    acc, p = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
    _store_rows(out_ptr, acc, l_i, token, head, dims, row_ok, stride_ot, stride_oh, stride_od,
                q_my, O_L, LD, True)


@gluon.jit
def _gluon_prefill_ws_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, num_seqs, num_queries_per_kv, sliding_window,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_od, stride_bts, stride_btb,
    CAUSAL: gl.constexpr, USE_WINDOW: gl.constexpr, BLOCK_Q: gl.constexpr,
    G_PAD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, PAGE: gl.constexpr,
    STAGES: gl.constexpr, PINGPONG: gl.constexpr, KV_SAME: gl.constexpr,
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
    # turn (ping-pong only): consumer w issues its wgmmas after turn[w] completes a phase;
    # the first phase of consumer 0's is completed here.
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if PINGPONG:
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        mbarrier.arrive(turn.index(0), count=1)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bts
    gl.warp_specialize(
        [(_ws_consumer, (q_ptr, out_ptr, q_s, k_s, v_s, full, empty, turn, q_start, q_len, q_tile,
                         first_q, kv_head, num_queries_per_kv, qk_scale, sliding_window, lo, n,
                         full_lo, full_hi, kv_end, stride_qt, stride_qh, stride_qd, stride_ot,
                         stride_oh, stride_od, 0, CAUSAL, USE_WINDOW, BLOCK_Q, G_PAD, BLOCK_N,
                         HEAD_D, STAGES, PINGPONG)),
         (_ws_consumer, (q_ptr, out_ptr, q_s, k_s, v_s, full, empty, turn, q_start, q_len, q_tile,
                         first_q, kv_head, num_queries_per_kv, qk_scale, sliding_window, lo, n,
                         full_lo, full_hi, kv_end, stride_qt, stride_qh, stride_qd, stride_ot,
                         stride_oh, stride_od, 1, CAUSAL, USE_WINDOW, BLOCK_Q, G_PAD, BLOCK_N,
                         HEAD_D, STAGES, PINGPONG)),
         (_ws_loader, (k_ptr, v_ptr, k_s, v_s, full, empty, bt_row, lo, n, kv_end,
                       kv_head.to(gl.int64), stride_kb, stride_ks, stride_kh, stride_vb,
                       stride_vs, stride_vh, stride_btb, BLOCK_N, HEAD_D, PAGE, STAGES,
                       KV_SAME))],
        [4, 4], [WS_CONSUMER_REGS, WS_LOADER_REGS])
