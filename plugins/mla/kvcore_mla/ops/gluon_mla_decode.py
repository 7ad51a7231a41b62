"""The Gluon kernel ``"gluon_mla_ws"``: MLA decode for Hopper in Gluon
(``triton.experimental.gluon``), Triton's lower-level language where the program places
layouts, shared memory, barriers and wgmma waits itself. TRITON_MLA runs it for 64+ heads on
sm90 (the first sm90 row of :data:`~kvcore_mla.ops.mla_configs.MLA_DECODE_CONFIGS`); it needs
Triton 3.6 or newer and imports nothing at ``import kvcore_mla``.

One program per (64-head group, KV split, request), warp-specialised (``gl.warp_specialize``)
into the roles FlashMLA and FlashInfer's Hopper MLA kernels give their warpgroups:

- the scores warpgroup (the default partition) stages the query in shared memory, computes
  each 64-key tile's scores whole (``[64 heads, 64 keys]`` wgmmas over the 576 channels), runs
  the online softmax, and publishes P and the rows' rescale factors for both warpgroups
  (``pready``); it also does P x V of the upper half of the latent columns;
- the values warpgroup does P x V of the lower half once P is published;
- a copy warpgroup (one warp's worth of work) issues each tile's TMA copies (two 3-d boxes of
  64-channel chunks) into one of two stages as soon as both warpgroups have released the tile
  before it there (``empty``).

P lives in the tile's first rope chunk: once its scores are done the rope part is never read
again (FlashInfer's union), which leaves room for the query (72 KiB) and two 72 KiB stages.
Splits write their partial rows (:func:`~kvcore_mla.ops.triton_mla_attention.decode_partials`)
and :func:`kvcore.ops.merge_kv_splits` reduces them.

Why this split of roles: splitting each tile's scores by keys between two symmetric
warpgroups (as the Triton kernel's key-split variant does) makes each issue ``64 x 32``
wgmmas that read the whole query from shared memory, twice a tile in all; shared-memory
bandwidth, not the tensor cores, then bounds the scores (``MEASUREMENTS.md`` has the
numbers). Why Gluon and not Triton: Triton waits every wgmma at once, hoists every wgmma
descriptor out of the loop (they spill) and puts a CTA-wide barrier before each TMA copy; here
the waits, descriptors, copies and roles are placed by hand.

Triton API differences handled here: 3.6 has ``gl.thread_barrier``,
``tma.async_copy_global_to_shared`` and ``_reinterpret``; 3.9 ``gl.barrier``,
``tma.async_load`` and ``reinterpret``.
"""

from __future__ import annotations

import weakref

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvcore.ops import LOG2E, merge_kv_splits
from kvcore.ops.triton_launch import KernelLaunch
from kvcore.ops.triton_utils import recording_launches
from kvcore_mla.ops.descriptors import gluon_unmet
from kvcore_mla.ops.triton_utils import pointer_classes

_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# Shared-memory views change type with ``reinterpret`` (Triton 3.9), ``_reinterpret`` (3.6).
_NEW_REINTERPRET = hasattr(gl.shared_memory_descriptor, "reinterpret")


@gluon.jit
def _issue_tile(nope_desc, pe_desc, nope_s, pe_s, bars, stage, row, BLOCK_N: gl.constexpr):
    """Two TMA copies of the tile of ``BLOCK_N`` cache rows from ``row`` into ``stage``: the
    descriptors see the latent and the rope part as ``(chunk of 64 channels, row, 64)``, so
    one 3-d box lands as swizzled ``[BLOCK_N, 64]`` chunks, the layout of a ``[BLOCK_N, 64 *
    chunks]`` tile. (Triton's lowering puts a barrier before every TMA and mbarrier
    operation, so a copy per chunk would cost a barrier per chunk.)"""
    bar = bars.index(stage)
    mbarrier.expect(bar, BLOCK_N * (nope_s.shape[1] + pe_s.shape[1]) * 64 * 2)
    _tma_load(nope_desc, [0, row, 0], bar, nope_s.index(stage))
    _tma_load(pe_desc, [0, row, 0], bar, pe_s.index(stage))


@gluon.jit
def _view_2d(chunks, shape: gl.constexpr, layout: gl.constexpr, NEW_API: gl.constexpr):
    """``chunks`` (``[n, rows, 64]`` swizzled chunks) as the ``[rows, 64 * n]`` tile they form."""
    if NEW_API:
        return chunks.reinterpret(chunks.dtype, shape, layout)
    else:
        return chunks._reinterpret(chunks.dtype, shape, layout)


@gluon.jit
def _tile_page(bt_row, t, num_tiles, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The page that holds tile ``t`` of a request (``t`` clamped into the request's tiles, so
    the read stays inside its block-table row even past its end)."""
    t = gl.maximum(gl.minimum(t, num_tiles - 1), 0)
    return gl.load(bt_row + (t * BLOCK_N) // PAGE_SIZE).to(gl.int32)


@gluon.jit
def _scores(q_nope_all, q_pe_all, nope_s, pe_s, stage, t, S_L: gl.constexpr,
            SH: gl.constexpr, NEW_API: gl.constexpr):
    """Issue (asynchronously) the scores of tile ``t``, in ``stage``, against the query group:
    ``[BLOCK_H, BLOCK_N]`` in ``S_L`` (one warpgroup's accumulator). The query parts
    are ``[1, rows, width]`` buffers indexed by a zero the compiler cannot prove (``t < 0``,
    never true): their wgmma descriptors (one a 16-column step, 36 of them) are then computed
    where they are used instead of being hoisted out of the loop, where they stayed live and
    spilled."""
    never = (t < 0).to(gl.int32)
    q_nope_s = q_nope_all.index(never)
    q_pe_s = q_pe_all.index(never)
    BLOCK_H: gl.constexpr = q_nope_s.shape[0]
    D_NOPE: gl.constexpr = q_nope_s.shape[1]
    D_PE: gl.constexpr = q_pe_s.shape[1]
    BLOCK_N: gl.constexpr = nope_s.shape[2]
    k_nope = _view_2d(nope_s.index(stage), [BLOCK_N, D_NOPE], SH, NEW_API)
    k_pe = _view_2d(pe_s.index(stage), [BLOCK_N, D_PE], SH, NEW_API)
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    s = hopper.warpgroup_mma(q_nope_s, k_nope.permute((1, 0)), s, is_async=True)
    return hopper.warpgroup_mma(q_pe_s, k_pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _p_view(pe_s, stage, SH: gl.constexpr, NEW_API: gl.constexpr):
    """Tile ``stage``'s P (``[64 heads, 64 keys]``) lives in its first rope chunk: once the
    scores are done the rope part of a tile is never read again (FlashInfer's union)."""
    ROWS: gl.constexpr = pe_s.shape[2]
    return _view_2d(pe_s.index(stage).slice(0, 1), [ROWS, 64], SH, NEW_API)


@gluon.jit
def _v_half(nope_s, stage, half: gl.constexpr, SH: gl.constexpr, NEW_API: gl.constexpr):
    """Latent columns ``[256 * half, 256 * half + 256)`` of tile ``stage`` as P x V's
    ``[64 keys, 256]`` operand (for kv_lora_rank 512; half the chunks in general)."""
    CH: gl.constexpr = nope_s.shape[1] // 2
    ROWS: gl.constexpr = nope_s.shape[2]
    return _view_2d(nope_s.index(stage).slice(half * CH, CH), [ROWS, CH * 64], SH, NEW_API)


@gluon.jit
def _copy_tiles(nope_desc, pe_desc, nope_s, pe_s, full, empty, bt_row, t_lo, n, num_tiles,
                page_rows, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The copy warpgroup: tile ``j`` by TMA into stage ``j % 2`` once both warpgroups have
    released the tile before it there (``empty``); its page id is read before that wait."""
    for j in range(0, n):
        st = j % 2
        page = _tile_page(bt_row, t_lo + j, num_tiles, PAGE_SIZE, BLOCK_N)
        if j >= 2:
            mbarrier.wait(empty.index(st), (j // 2 - 1) & 1)
        _issue_tile(nope_desc, pe_desc, nope_s, pe_s, full, st,
                    page * page_rows + ((t_lo + j) * BLOCK_N) % PAGE_SIZE, BLOCK_N)


@gluon.jit
def _store_half(acc, half: gl.constexpr, scratch, seq, split, head_block, num_heads,
                out_ptr, part_ptr, stride_ob, stride_oh, stride_od, stride_pb, stride_ph,
                stride_ps, SPLIT: gl.constexpr):
    """Write a warpgroup's normalised ``[64, D/2]`` output (latent columns of ``half``) to
    ``out`` or, with splits, to its partial row. 16-bit rows go through ``scratch`` (a
    ``[64, D/2]`` shared buffer of the query's, free once the scores are done) so that each
    thread stores 16 bytes along a row; float32 rows are stored from the accumulator's layout
    (a layout conversion would need its own 64 KB of shared memory, which the stages hold)."""
    BLOCK_H: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    DST: gl.constexpr = part_ptr.dtype.element_ty if SPLIT else out_ptr.dtype.element_ty
    if DST.primitive_bitwidth == 16:
        L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                           warps_per_cta=[4, 1], order=[1, 0])
        scratch.store(acc.to(DST))
        _cta_barrier()
        vals = scratch.load(L)
    else:
        L: gl.constexpr = acc.type.layout
        vals = acc
    rows = (head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L))).to(
        gl.int64)
    cols = half * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L)).to(gl.int64)
    ok = (rows < num_heads)[:, None]
    if SPLIT:
        part = part_ptr + seq * stride_pb + split * stride_ps
        gl.store(part + rows[:, None] * stride_ph + cols[None, :], vals.to(DST), mask=ok)
    else:
        gl.store(out_ptr + seq * stride_ob + rows[:, None] * stride_oh + cols[None, :] * stride_od,
                 vals.to(DST), mask=ok)


@gluon.jit
def _publish_p(p, alpha, nope_s, pe_s, alpha_s, pready, stage, t, seq_len, SH: gl.constexpr,
               NEW_API: gl.constexpr):
    """Tile ``t``'s P and rescale factors into shared memory for both warpgroups' P x V,
    after zeroing the tile's latent rows past ``seq_len`` when it is the last one (stale
    cache bytes, NaN included, that P x V would read with P = 0): a 64-channel chunk at a
    time, 16 registers a thread beside the live accumulator."""
    BLOCK_N: gl.constexpr = nope_s.shape[2]
    CHUNKS: gl.constexpr = nope_s.shape[1]
    if (t + 1) * BLOCK_N > seq_len:
        LD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[4, 1], order=[1, 0])
        rows = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
        for c in gl.static_range(CHUNKS):
            chunk = _view_2d(nope_s.index(stage).slice(c, 1), [BLOCK_N, 64], SH, NEW_API)
            chunk.store(gl.where((rows < seq_len)[:, None], chunk.load(LD), 0.0))
    _p_view(pe_s, stage, SH, NEW_API).store(p.to(pe_s.dtype))
    alpha_s.index(stage).store(alpha)
    hopper.fence_async_shared()  # the stores (generic proxy) before the wgmma reads (async)
    mbarrier.arrive(pready.index(stage), count=1)


@gluon.jit
def _softmax(s, t, seq_len, m_i, l_i, qk_scale, BLOCK_N: gl.constexpr):
    """Online softmax of tile ``t``'s whole ``[64, BLOCK_N]`` scores (keys past ``seq_len``
    masked): ``(p, alpha, m_new, l_new)`` with base-2 running max and row sums."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    s = gl.where(((t * BLOCK_N + cols) < seq_len)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _scores_warpgroup(q_ptr, q_nope_s, q_pe_s, nope_s, pe_s, full, empty, pready, done,
                      alpha_s, l_s, out_ptr, lse_ptr, part_ptr, part_lse_ptr, seq, split,
                      head_block, num_heads, seq_len, t_lo, n, qk_scale, stride_qb, stride_qh,
                      stride_qd, stride_ob, stride_oh, stride_od, stride_lb, stride_lh,
                      stride_pb, stride_ph, stride_ps, stride_sb, stride_sh, stride_ss,
                      BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
                      NEW_API: gl.constexpr):
    """The scores warpgroup (the default partition): stages the query, then for each tile
    the whole scores, the softmax, P and the rescale factors for both warpgroups, and P x V
    of the upper latent half; the row sums for the other warpgroup (``done``) and the LSE."""
    BLOCK_H: gl.constexpr = q_nope_s.shape[1]
    D_NOPE: gl.constexpr = q_nope_s.shape[2]
    D_PE: gl.constexpr = q_pe_s.shape[2]
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D_NOPE // 2, 16])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)
    # The query, 16 rows at a time (32 registers a thread).
    QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                        warps_per_cta=[4, 1], order=[1, 0])
    ROWS: gl.constexpr = 16
    c_nope = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, QL)).to(gl.int64)
    c_pe = D_NOPE + gl.arange(0, D_PE, layout=gl.SliceLayout(0, QL)).to(gl.int64)
    for r in gl.static_range(BLOCK_H // ROWS):
        heads = head_block * BLOCK_H + r * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, QL))
        h_ok = (heads < num_heads)[:, None]
        q_row = (q_ptr + seq * stride_qb + heads.to(gl.int64) * stride_qh)[:, None]
        q_nope_s.index(0).slice(r * ROWS, ROWS).store(
            gl.load(q_row + c_nope[None, :] * stride_qd, mask=h_ok, other=0.0))
        q_pe_s.index(0).slice(r * ROWS, ROWS).store(
            gl.load(q_row + c_pe[None, :] * stride_qd, mask=h_ok, other=0.0))
    hopper.fence_async_shared()
    _cta_barrier()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    alpha = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, layout=O_L)
    if n > 0:
        mbarrier.wait(full.index(0), 0)
        s = _scores(q_nope_s, q_pe_s, nope_s, pe_s, 0, t_lo, S_L, SH, NEW_API)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
        p, alpha, m_i, l_i = _softmax(s, t_lo, seq_len, m_i, l_i, qk_scale, BLOCK_N)
        _publish_p(p, alpha, nope_s, pe_s, alpha_s, pready, 0, t_lo, seq_len, SH, NEW_API)
    # Step i: P x V of tile i (upper half), the scores of tile i + 1 behind it on the tensor
    # cores; tile i's stage is released as soon as its P x V is done, before the softmax.
    for i in range(0, n - 1):
        st = i % 2
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = hopper.warpgroup_mma(_p_view(pe_s, st, SH, NEW_API),
                                   _v_half(nope_s, st, 1, SH, NEW_API), acc, is_async=True)
        mbarrier.wait(full.index(1 - st), ((i + 1) // 2) & 1)
        s = _scores(q_nope_s, q_pe_s, nope_s, pe_s, 1 - st, t_lo + i + 1, S_L, SH, NEW_API)
        acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        mbarrier.arrive(empty.index(st), count=1)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
        p, alpha, m_i, l_i = _softmax(s, t_lo + i + 1, seq_len, m_i, l_i, qk_scale, BLOCK_N)
        _publish_p(p, alpha, nope_s, pe_s, alpha_s, pready, 1 - st, t_lo + i + 1, seq_len, SH,
                   NEW_API)
    if n > 0:
        last = (n - 1) % 2
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = hopper.warpgroup_mma(_p_view(pe_s, last, SH, NEW_API),
                                   _v_half(nope_s, last, 1, SH, NEW_API), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    has_keys = l_i > 0
    l_safe = gl.where(has_keys, l_i, 1.0)
    l_s.store(l_safe)
    mbarrier.arrive(done.index(0), count=1)
    lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, O_L)), 1)
    _store_half(out, 1, q_nope_s.index(0).slice(D_NOPE // 2, D_NOPE // 2, dim=1), seq, split,
                head_block, num_heads, out_ptr, part_ptr, stride_ob, stride_oh, stride_od,
                stride_pb, stride_ph, stride_ps, SPLIT)
    l_rows = (head_block * BLOCK_H
              + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))).to(gl.int64)
    if SPLIT:
        gl.store(part_lse_ptr + seq * stride_sb + split * stride_ss + l_rows * stride_sh, lse2,
                 mask=l_rows < num_heads)
    elif WRITE_LSE:
        gl.store(lse_ptr + seq * stride_lb + l_rows * stride_lh, lse2 * 0.6931471805599453,
                 mask=l_rows < num_heads)


@gluon.jit
def _values_warpgroup(q_nope_s, nope_s, pe_s, full, empty, pready, done, alpha_s, l_s,
                      out_ptr, part_ptr, seq, split, head_block, num_heads, n, stride_ob,
                      stride_oh, stride_od, stride_pb, stride_ph, stride_ps,
                      SPLIT: gl.constexpr, NEW_API: gl.constexpr):
    """The values warpgroup: P x V of the lower latent half of each tile once the scores
    warpgroup has published its P, then that half of the output."""
    BLOCK_H: gl.constexpr = pe_s.shape[2]
    D_NOPE: gl.constexpr = nope_s.shape[1] * 64
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D_NOPE // 2, 16])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)
    acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, layout=O_L)
    for i in range(0, n):
        st = i % 2
        # Already complete when P is (the scores warpgroup waited for it), but it is this
        # warpgroup's own acquire of the TMA's writes before its wgmma reads them.
        mbarrier.wait(full.index(st), (i // 2) & 1)
        mbarrier.wait(pready.index(st), (i // 2) & 1)
        alpha = alpha_s.index(st).load(gl.SliceLayout(1, O_L))
        acc = acc * gl.expand_dims(alpha, 1)
        acc = hopper.warpgroup_mma(_p_view(pe_s, st, SH, NEW_API),
                                   _v_half(nope_s, st, 0, SH, NEW_API), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index(st), count=1)
    mbarrier.wait(done.index(0), 0)
    l_safe = l_s.load(gl.SliceLayout(1, O_L))
    _store_half(acc / gl.expand_dims(l_safe, 1), 0,
                q_nope_s.index(0).slice(0, D_NOPE // 2, dim=1), seq, split, head_block,
                num_heads, out_ptr, part_ptr, stride_ob, stride_oh, stride_od, stride_pb,
                stride_ph, stride_ps, SPLIT)


#: Registers a thread of the values warpgroup and of the copy warpgroup may hold (setmaxnreg);
#: the scores warpgroup gets the rest of the SM's 64K (512 a thread-slot over the three).
VALUES_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _gluon_mla_decode_kernel(
    q_ptr, nope_desc, pe_desc, out_ptr, lse_ptr, part_ptr, part_lse_ptr, seq_lens_ptr,
    block_table_ptr, qk_scale, num_heads, num_head_blocks, num_splits, page_rows,
    stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od, stride_lb, stride_lh,
    stride_pb, stride_ph, stride_ps, stride_sb, stride_sh, stride_ss, stride_btb,
    D_NOPE: gl.constexpr, D_PE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr,
    WRITE_LSE: gl.constexpr, NEW_API: gl.constexpr,
):
    """One (head group, KV split, request) of MLA decode, warp-specialised: a scores
    warpgroup, a values warpgroup and a copy warpgroup; see :func:`gluon_mla_decode`."""
    pid = gl.program_id(0)
    head_block = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % num_splits
    seq = (rest // num_splits).to(gl.int64)
    seq_len = gl.load(seq_lens_ptr + seq)
    num_tiles = gl.cdiv(seq_len, BLOCK_N)
    per_split = gl.cdiv(num_tiles, num_splits)
    t_lo = split * per_split
    n = gl.minimum(t_lo + per_split, num_tiles) - t_lo  # this split's tiles (may be <= 0)
    bt_row = block_table_ptr + seq * stride_btb

    DTYPE: gl.constexpr = q_ptr.dtype.element_ty
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)
    SH3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                             rank=3)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    nope_s = gl.allocate_shared_memory(DTYPE, [2, D_NOPE // 64, BLOCK_N, 64], SH3)
    pe_s = gl.allocate_shared_memory(DTYPE, [2, D_PE // 64, BLOCK_N, 64], SH3)
    q_nope_s = gl.allocate_shared_memory(DTYPE, [1, BLOCK_H, D_NOPE], SH)
    q_pe_s = gl.allocate_shared_memory(DTYPE, [1, BLOCK_H, D_PE], SH)
    alpha_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], FLAT)
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], FLAT)
    # full: the tile's TMA bytes; pready: the scores warpgroup published P; empty: an arrive
    # from each warpgroup once its P x V of the stage is done; done: the row sums are out.
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(pready.index(j), count=1)
        mbarrier.init(empty.index(j), count=2)
    mbarrier.init(done.index(0), count=1)
    gl.warp_specialize(
        [(_scores_warpgroup, (q_ptr, q_nope_s, q_pe_s, nope_s, pe_s, full, empty, pready, done,
                              alpha_s, l_s, out_ptr, lse_ptr, part_ptr, part_lse_ptr, seq,
                              split, head_block, num_heads, seq_len, t_lo, n, qk_scale,
                              stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od,
                              stride_lb, stride_lh, stride_pb, stride_ph, stride_ps, stride_sb,
                              stride_sh, stride_ss, BLOCK_N, SPLIT, WRITE_LSE, NEW_API)),
         (_values_warpgroup, (q_nope_s, nope_s, pe_s, full, empty, pready, done, alpha_s, l_s,
                              out_ptr, part_ptr, seq, split, head_block, num_heads, n,
                              stride_ob, stride_oh, stride_od, stride_pb, stride_ph, stride_ps,
                              SPLIT, NEW_API)),
         (_copy_tiles, (nope_desc, pe_desc, nope_s, pe_s, full, empty, bt_row, t_lo, n,
                        num_tiles, page_rows, PAGE_SIZE, BLOCK_N))],
        [4, 4], [VALUES_REGS, LOADER_REGS])


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``kv_cache`` ``(num_pages, page_size, width)`` seen as rows of its token stride:
    ``(rows, page_rows)``, page ``p``'s token ``j`` at row ``p * page_rows + j`` (any page
    stride that is a multiple of the token stride, the cross-layer layout's included)."""
    num_pages, page_size, width = kv_cache.shape
    stride_page, stride_token = kv_cache.stride(0), kv_cache.stride(1)
    page_rows = stride_page // stride_token
    rows = (num_pages - 1) * page_rows + page_size
    return kv_cache.as_strided((rows, width), (stride_token, 1)), page_rows


def gluon_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                     out: torch.Tensor, lse: torch.Tensor | None = None, num_splits: int = 1,
                     partials: torch.Tensor | None = None,
                     partial_lse: torch.Tensor | None = None) -> None:
    """MLA decode (one query per request) on Hopper into ``out`` ``(batch, heads,
    kv_lora_rank)`` and the natural-log ``lse`` ``(batch, heads)`` when given.

    ``q`` ``(batch, heads, kv_lora_rank + rope)`` and ``kv_cache`` ``(num_pages, page_size,
    kv_lora_rank + rope)`` bf16 or fp16, as :func:`~kvcore_mla.ops.descriptors.gluon_unmet`
    requires (which this checks first, raising ValueError with its reason);
    ``block_table`` ``(batch, max_pages)`` and ``seq_lens`` ``(batch,)`` int32, already
    validated by the caller (TRITON_MLA's decode entry points). With ``num_splits`` > 1 each
    request's tiles are cut into that many parts, each part's normalised output written to
    ``partials`` (``(batch, heads, num_splits, kv_lora_rank)``, float32 or ``q``'s dtype, last
    stride 1) and its base-2 log-sum-exp to ``partial_lse`` (``(batch, heads, num_splits)``,
    float32), then merged by :func:`kvcore.ops.merge_kv_splits`
    (:func:`~kvcore_mla.ops.triton_mla_attention.decode_partials` carves both from a
    workspace)."""
    batch, num_heads, width = q.shape
    nope_desc, pe_desc, page_rows = _descriptors(q, kv_cache, kv_lora_rank)
    if batch == 0:
        return
    block_h = 64
    split = num_splits > 1
    if split:
        want = (batch, num_heads, num_splits, kv_lora_rank)
        if (partials is None or partials.dtype not in (torch.float32, q.dtype)
                or tuple(partials.shape) != want or partials.stride(3) != 1):
            got = "None" if partials is None else f"{partials.dtype} {tuple(partials.shape)}"
            raise ValueError(f"partials is {got}; num_splits={num_splits} needs a float32 or "
                             f"{q.dtype} tensor of shape {want} with last stride 1")
        if (partial_lse is None or partial_lse.dtype != torch.float32
                or tuple(partial_lse.shape) != want[:3]):
            got = ("None" if partial_lse is None
                   else f"{partial_lse.dtype} {tuple(partial_lse.shape)}")
            raise ValueError(f"partial_lse is {got}; num_splits={num_splits} needs a float32 "
                             f"tensor of shape {want[:3]}")
    part = partials if split else out
    part_lse = partial_lse if split else out
    part_strides = partials.stride()[:3] if split else (0, 0, 0)
    part_lse_strides = partial_lse.stride() if split else (0, 0, 0)
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0)
    num_head_blocks = -(-num_heads // block_h)
    if block_table.stride(1) != 1:  # the kernel steps along a row by 1 (rows by their stride)
        block_table = block_table.contiguous()
    found = (kv_lora_rank, width - kv_lora_rank, kv_cache.shape[1], kv_cache.dtype, split,
             lse is not None)
    kernel = _LAUNCHES.get(found)
    if kernel is None:
        kernel = _LAUNCHES[found] = KernelLaunch(
            _gluon_mla_decode_kernel, found,
            dict(D_NOPE=kv_lora_rank, D_PE=width - kv_lora_rank, PAGE_SIZE=kv_cache.shape[1],
                 BLOCK_H=block_h, BLOCK_N=_BLOCK_N, SPLIT=split, WRITE_LSE=lse is not None,
                 NEW_API=_NEW_REINTERPRET),
            dict(num_warps=4))
    args = (q, nope_desc, pe_desc, out, lse_arg, part, part_lse, seq_lens, block_table,
            float(scale) * LOG2E, num_heads, num_head_blocks, num_splits, page_rows,
            *q.stride(), *out.stride(), *lse_strides, *part_strides, *part_lse_strides,
            block_table.stride(0))
    # Triton specialises the pointers (dtype, alignment) and the ints; the descriptors on
    # their dtype, box and layout, which ``found`` fixes.
    kernel((num_head_blocks * num_splits * batch, 1, 1), args,
           (pointer_classes(q, out, lse_arg, part, part_lse, seq_lens, block_table),
            args[10:]))
    if split:
        merge_kv_splits(partials, partial_lse, out, lse)


#: Keys of a tile (the descriptors' box rows).
_BLOCK_N = 64
#: The kernel's launches by what fixes their compile (sizes, dtype, flags).
_LAUNCHES: dict[tuple, KernelLaunch] = {}
#: Per cache tensor (by ``id``, dropped when the tensor is collected): its weak reference,
#: what the entry holds for, and the entry (descriptors, ``page_rows``).
_DESCRIPTORS: dict[int, tuple] = {}


def _descriptors(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int
                 ) -> tuple[TensorDescriptor, TensorDescriptor, int]:
    """The latent and rope parts of ``kv_cache`` as TMA descriptors of ``(chunk of 64
    channels, row, channel)`` (one box a tile), and ``page_rows``, after
    :func:`~kvcore_mla.ops.descriptors.gluon_unmet`'s checks (raising ValueError with its
    reason). Kept per cache tensor while it lives and its address, shape, strides and the
    query's dtype and width stay those the checks saw: a layer's calls build nothing. The
    descriptors view the cache's storage through a tensor of their own, so the entry never
    keeps the cache tensor alive (its weak reference drops the entry)."""
    held = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype,
            kv_lora_rank, q.dtype, q.shape[2], recording_launches())
    entry = _DESCRIPTORS.get(id(kv_cache))
    if entry is not None and entry[0]() is kv_cache and entry[1] == held:
        return entry[2]
    reason = gluon_unmet(q, kv_cache, kv_lora_rank)
    if reason is not None:
        raise ValueError(reason)
    alias = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device).set_(
        kv_cache.untyped_storage(), kv_cache.storage_offset(), kv_cache.shape, kv_cache.stride())
    rows, page_rows = cache_rows(alias)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)

    def chunked(part: torch.Tensor) -> TensorDescriptor:
        """``part`` (rows, channels) as (chunk of 64 channels, row, channel): one box a tile."""
        view = part.as_strided((part.shape[1] // 64, part.shape[0], 64), (64, part.stride(0), 1))
        return TensorDescriptor.from_tensor(view, [part.shape[1] // 64, _BLOCK_N, 64], layout)

    found = (chunked(rows[:, :kv_lora_rank]), chunked(rows[:, kv_lora_rank:]), page_rows)
    key = id(kv_cache)
    _DESCRIPTORS[key] = (weakref.ref(kv_cache, lambda _, key=key: _DESCRIPTORS.pop(key, None)),
                         held, found)
    return found
