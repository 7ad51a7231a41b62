"""EXPERIMENTAL (branch wt/gluon-mla, not wired into TRITON_MLA): MLA decode for Hopper in
Gluon (``triton.experimental.gluon``), where the program sets layouts, shared memory and wgmma
waits itself instead of Triton's compiler choosing them.

Why: ``triton_mla_attention``'s kernel reaches 0.62-0.67x of FlashInfer's time at 128 heads on
the H200; what bounds it (benchmarks/RESULTS.md, seventh session) is that Triton waits every
wgmma at once, so the softmax never overlaps the tensor cores. Gluon exposes
``warpgroup_mma(..., is_async=True)`` and ``warpgroup_mma_wait(num_outstanding=N)``.

Step 0 (this file): the same algorithm as the Triton kernel's sm90 row, written in Gluon, for
correctness and to pin the API on both Triton versions we run (3.6 on the H200, 3.9 in CI):
one program per (64-head group, request), one KV split, 8 warps; the two warpgroups share each
64-key score tile by keys (``warps_per_cta=[4, 2]``) and the ``[64, 512]`` float32 accumulator
by latent columns; the query in shared memory; the latent tile loaded through registers into
shared memory (synchronous: step 1 is asynchronous copies into two stages, step 2 the FA3
order: issue the next scores and this tile's P x V, wait for the scores only, run the softmax
while P x V runs).

API differences handled here: Triton 3.6 has ``gl.thread_barrier``, 3.9 ``gl.barrier``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# Shared-memory views change type with ``reinterpret`` (Triton 3.9), ``_reinterpret`` (3.6).
_NEW_REINTERPRET = hasattr(gl.shared_memory_descriptor, "reinterpret")
_LOG2E = 1.4426950408889634


@gluon.jit
def _gluon_mla_decode_kernel(
    q_ptr, kv_ptr, out_ptr, lse_ptr, seq_lens_ptr, block_table_ptr, qk_scale,
    num_heads, num_head_blocks,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_ob, stride_oh, stride_lb, stride_lh,
    stride_btb,
    D_NOPE: gl.constexpr, D_PE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):
    pid = gl.program_id(0)
    head_block = pid % num_head_blocks
    seq = (pid // num_head_blocks).to(gl.int64)

    # Scores: warpgroup w computes keys [w * BLOCK_N / 2, (w + 1) * BLOCK_N / 2) for all rows.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    # Output: warpgroup w owns latent columns [w * D_NOPE / 2, (w + 1) * D_NOPE / 2).
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, D_NOPE // 2, 16])
    LD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[8, 1], order=[1, 0])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)

    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    heads = head_block * BLOCK_H + rows
    h_ok = heads < num_heads
    c_nope = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, LD)).to(gl.int64)
    c_pe = D_NOPE + gl.arange(0, D_PE, layout=gl.SliceLayout(0, LD)).to(gl.int64)
    q_row = q_ptr + seq * stride_qb + heads.to(gl.int64) * stride_qh
    q_nope = gl.load(q_row[:, None] + c_nope[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = gl.load(q_row[:, None] + c_pe[None, :], mask=h_ok[:, None], other=0.0)
    q_nope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_NOPE], SH, q_nope)
    q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_PE], SH, q_pe)
    k_nope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D_NOPE], SH)
    k_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D_PE], SH)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], SH)

    seq_len = gl.load(seq_lens_ptr + seq)
    num_tiles = gl.cdiv(seq_len, BLOCK_N)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    # Running sums per key column, added up after the loop (no per-tile cross-warpgroup sum).
    l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    acc = gl.zeros([BLOCK_H, D_NOPE], gl.float32, layout=O_L)
    k_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    bt_row = block_table_ptr + seq * stride_btb
    for t in range(0, num_tiles):
        pos = t * BLOCK_N + k_rows
        ok = pos < seq_len
        page = gl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
        base = kv_ptr + page * stride_kb + (pos % PAGE_SIZE).to(gl.int64) * stride_ks
        # Rows past seq_len read 0 (stale cache bytes, NaN included, never reach P x V).
        k_nope = gl.load(base[:, None] + c_nope[None, :], mask=ok[:, None], other=0.0)
        k_pe = gl.load(base[:, None] + c_pe[None, :], mask=ok[:, None], other=0.0)
        _cta_barrier()  # the previous tile's wgmmas have read k_*_s and p_s (waited below)
        k_nope_s.store(k_nope)
        k_pe_s.store(k_pe)
        hopper.fence_async_shared()
        _cta_barrier()
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
        s = hopper.warpgroup_mma(q_nope_s, k_nope_s.permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma(q_pe_s, k_pe_s.permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
        valid = (t * BLOCK_N + s_cols) < seq_len
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * gl.expand_dims(alpha, 1) + p
        m_i = m_new
        p_s.store(p.to(gl.bfloat16))
        hopper.fence_async_shared()
        _cta_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = hopper.warpgroup_mma(p_s, k_nope_s, acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    l_sum = gl.sum(l_i, axis=1)
    has_keys = l_sum > 0
    l_safe = gl.where(has_keys, l_sum, 1.0)
    lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, O_L)), 1)
    o_rows = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    o_cols = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, O_L)).to(gl.int64)
    o_ptrs = (out_ptr + seq * stride_ob + o_rows.to(gl.int64)[:, None] * stride_oh
              + o_cols[None, :])
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(o_rows < num_heads)[:, None])
    l_rows = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
    gl.store(lse_ptr + seq * stride_lb + l_rows.to(gl.int64) * stride_lh,
             lse2 * 0.6931471805599453, mask=l_rows < num_heads)


def gluon_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                     out: torch.Tensor, lse: torch.Tensor) -> None:
    """MLA decode (one query per request, one KV split) into ``out`` ``(batch, heads,
    kv_lora_rank)`` and the natural-log ``lse`` ``(batch, heads)``. ``q`` ``(batch, heads,
    kv_lora_rank + rope)`` bf16, contiguous channels; ``kv_cache`` ``(num_pages, page_size,
    kv_lora_rank + rope)`` bf16 with contiguous channels, any page and token strides;
    ``block_table`` ``(batch, max_pages)`` int32; ``seq_lens`` ``(batch,)`` int32. Step 0:
    no validation beyond asserts (see the module docstring)."""
    batch, num_heads, width = q.shape
    assert q.dtype == kv_cache.dtype == torch.bfloat16 and q.stride(2) == 1
    assert kv_cache.stride(2) == 1 and width == kv_cache.shape[2]
    block_h = 64
    num_head_blocks = -(-num_heads // block_h)
    _gluon_mla_decode_kernel[(num_head_blocks * batch,)](
        q, kv_cache, out, lse, seq_lens, block_table, float(scale) * _LOG2E,
        num_heads, num_head_blocks,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), block_table.stride(0),
        D_NOPE=kv_lora_rank, D_PE=width - kv_lora_rank, PAGE_SIZE=kv_cache.shape[1],
        BLOCK_H=block_h, BLOCK_N=64, num_warps=8,
    )


# ---- step 1: TMA loads into two stages, one mbarrier per 64-column chunk ----------------------


@gluon.jit
def _issue_tile(nope_desc, pe_desc, nope_s, pe_s, bars, stage, row, pred,
                BLOCK_N: gl.constexpr):
    """Two TMA copies of the tile of ``BLOCK_N`` cache rows from ``row`` into ``stage``: the
    descriptors see the latent and the rope part as ``(chunk of 64 channels, row, 64)``, so
    one 3-d box lands as swizzled ``[BLOCK_N, 64]`` chunks, the layout of a ``[BLOCK_N, 64 *
    chunks]`` tile. (Triton's lowering puts a CTA-wide bar.sync before every TMA and barrier
    operation: a copy per chunk cost 10 of them a tile, and a barrier per chunk, so that the
    scores could start on chunk 0, 19; both measured slower on the H200.)"""
    bar = bars.index(stage)
    mbarrier.expect(bar, BLOCK_N * (nope_s.shape[1] + pe_s.shape[1]) * 64 * 2, pred)
    _tma_load(nope_desc, [0, row, 0], bar, nope_s.index(stage), pred)
    _tma_load(pe_desc, [0, row, 0], bar, pe_s.index(stage), pred)


@gluon.jit
def _view_2d(chunks, shape: gl.constexpr, layout: gl.constexpr, NEW_API: gl.constexpr):
    """``chunks`` (``[n, rows, 64]`` swizzled chunks) as the ``[rows, 64 * n]`` tile they form."""
    if NEW_API:
        return chunks.reinterpret(gl.bfloat16, shape, layout)
    else:
        return chunks._reinterpret(gl.bfloat16, shape, layout)


@gluon.jit
def _tile_page(bt_row, t, num_tiles, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The page that holds tile ``t`` of a request (``t`` clamped into the request's tiles, so
    the read stays inside its block-table row even past its end)."""
    t = gl.maximum(gl.minimum(t, num_tiles - 1), 0)
    return gl.load(bt_row + (t * BLOCK_N) // PAGE_SIZE).to(gl.int32)


@gluon.jit
def _gluon_mla_decode_tma_kernel(
    q_ptr, nope_desc, pe_desc, out_ptr, lse_ptr, seq_lens_ptr, block_table_ptr, qk_scale,
    num_heads, num_head_blocks, page_rows,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lb, stride_lh, stride_btb,
    D_NOPE: gl.constexpr, D_PE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NEW_API: gl.constexpr,
):
    pid = gl.program_id(0)
    head_block = pid % num_head_blocks
    seq = (pid // num_head_blocks).to(gl.int64)

    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, D_NOPE // 2, 16])
    LD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[8, 1], order=[1, 0])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)

    seq_len = gl.load(seq_lens_ptr + seq)
    num_tiles = gl.cdiv(seq_len, BLOCK_N)
    bt_row = block_table_ptr + seq * stride_btb

    SH3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                             rank=3)
    nope_s = gl.allocate_shared_memory(gl.bfloat16, [2, D_NOPE // 64, BLOCK_N, 64], SH3)
    pe_s = gl.allocate_shared_memory(gl.bfloat16, [2, D_PE // 64, BLOCK_N, 64], SH3)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    # The first two tiles' copies go out before the query is read.
    page0 = _tile_page(bt_row, 0, num_tiles, PAGE_SIZE, BLOCK_N)
    page1 = _tile_page(bt_row, 1, num_tiles, PAGE_SIZE, BLOCK_N)
    # The page of the tile two ahead is read one iteration before its copy is issued, so the
    # block-table read's latency never stalls the loop.
    page_ahead = _tile_page(bt_row, 2, num_tiles, PAGE_SIZE, BLOCK_N)
    _issue_tile(nope_desc, pe_desc, nope_s, pe_s, bars, 0, page0 * page_rows, num_tiles > 0,
                BLOCK_N)
    _issue_tile(nope_desc, pe_desc, nope_s, pe_s, bars, 1,
                page1 * page_rows + BLOCK_N % PAGE_SIZE, num_tiles > 1, BLOCK_N)

    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    heads = head_block * BLOCK_H + rows
    h_ok = heads < num_heads
    c_nope = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, LD)).to(gl.int64)
    c_pe = D_NOPE + gl.arange(0, D_PE, layout=gl.SliceLayout(0, LD)).to(gl.int64)
    q_row = q_ptr + seq * stride_qb + heads.to(gl.int64) * stride_qh
    q_nope = gl.load(q_row[:, None] + c_nope[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = gl.load(q_row[:, None] + c_pe[None, :], mask=h_ok[:, None], other=0.0)
    q_nope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_NOPE], SH, q_nope)
    q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_PE], SH, q_pe)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], SH)
    hopper.fence_async_shared()
    _cta_barrier()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    acc = gl.zeros([BLOCK_H, D_NOPE], gl.float32, layout=O_L)
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    k_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    for t in range(0, num_tiles):
        st = t % 2
        phase = (t // 2) & 1
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
        mbarrier.wait(bars.index(st), phase)
        k_nope = _view_2d(nope_s.index(st), [BLOCK_N, D_NOPE], SH, NEW_API)
        k_pe = _view_2d(pe_s.index(st), [BLOCK_N, D_PE], SH, NEW_API)
        # One wgmma call over the whole latent: its instructions address the chunks by
        # immediate offsets from one descriptor (a call per chunk kept a descriptor per chunk
        # live across the loop, and they spilled).
        s = hopper.warpgroup_mma(q_nope_s, k_nope.permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma(q_pe_s, k_pe.permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[s])
        valid = (t * BLOCK_N + s_cols) < seq_len
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * gl.expand_dims(alpha, 1) + p
        m_i = m_new
        if (t + 1) * BLOCK_N > seq_len:
            # The last tile ends inside its page: rows past seq_len hold stale cache bytes
            # (NaN included) that P x V would read with P = 0; zero them.
            v = k_nope.load(LD)
            k_nope.store(gl.where(((t * BLOCK_N + k_rows) < seq_len)[:, None], v, 0.0))
        p_s.store(p.to(gl.bfloat16))
        hopper.fence_async_shared()
        _cta_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        acc = hopper.warpgroup_mma(p_s, k_nope, acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        _cta_barrier()  # both warpgroups are done with this stage and with p_s
        nxt = t + 2
        row = page_ahead * page_rows + (nxt * BLOCK_N) % PAGE_SIZE
        page_ahead = _tile_page(bt_row, t + 3, num_tiles, PAGE_SIZE, BLOCK_N)
        _issue_tile(nope_desc, pe_desc, nope_s, pe_s, bars, st, row, nxt < num_tiles, BLOCK_N)

    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))
    l_sum = gl.sum(l_i, axis=1)
    has_keys = l_sum > 0
    l_safe = gl.where(has_keys, l_sum, 1.0)
    lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, O_L)), 1)
    o_rows = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    o_cols = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, O_L)).to(gl.int64)
    o_ptrs = (out_ptr + seq * stride_ob + o_rows.to(gl.int64)[:, None] * stride_oh
              + o_cols[None, :])
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(o_rows < num_heads)[:, None])
    l_rows = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
    gl.store(lse_ptr + seq * stride_lb + l_rows.to(gl.int64) * stride_lh,
             lse2 * 0.6931471805599453, mask=l_rows < num_heads)


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``kv_cache`` ``(num_pages, page_size, width)`` seen as rows of its token stride:
    ``(rows, page_rows)``, page ``p``'s token ``j`` at row ``p * page_rows + j`` (any page
    stride that is a multiple of the token stride, the cross-layer layout's included)."""
    num_pages, page_size, width = kv_cache.shape
    stride_page, stride_token = kv_cache.stride(0), kv_cache.stride(1)
    assert stride_page % stride_token == 0
    page_rows = stride_page // stride_token
    rows = (num_pages - 1) * page_rows + page_size
    return kv_cache.as_strided((rows, width), (stride_token, 1)), page_rows


def gluon_mla_decode_tma(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                         seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                         out: torch.Tensor, lse: torch.Tensor) -> None:
    """As :func:`gluon_mla_decode`, the cache read by TMA into two stages (page size a
    multiple of 64, 16-byte aligned rows)."""
    batch, num_heads, width = q.shape
    assert q.dtype == kv_cache.dtype == torch.bfloat16 and q.stride(2) == 1
    assert kv_cache.stride(2) == 1 and width == kv_cache.shape[2]
    assert kv_cache.shape[1] % 64 == 0
    block_h, block_n = 64, 64
    rope = width - kv_lora_rank
    # TMA boxes have power-of-two sides.
    assert all(n % 64 == 0 and (n // 64) & (n // 64 - 1) == 0 for n in (kv_lora_rank, rope))
    rows, page_rows = cache_rows(kv_cache)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)

    def chunked(part: torch.Tensor) -> TensorDescriptor:
        """``part`` (rows, channels) as (chunk of 64 channels, row, channel): one box a tile."""
        view = part.as_strided((part.shape[1] // 64, part.shape[0], 64), (64, part.stride(0), 1))
        return TensorDescriptor.from_tensor(view, [part.shape[1] // 64, block_n, 64], layout)

    nope_desc, pe_desc = chunked(rows[:, :kv_lora_rank]), chunked(rows[:, kv_lora_rank:])
    num_head_blocks = -(-num_heads // block_h)
    _gluon_mla_decode_tma_kernel[(num_head_blocks * batch,)](
        q, nope_desc, pe_desc, out, lse, seq_lens, block_table, float(scale) * _LOG2E,
        num_heads, num_head_blocks, page_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        block_table.stride(0),
        D_NOPE=kv_lora_rank, D_PE=width - kv_lora_rank, PAGE_SIZE=kv_cache.shape[1],
        BLOCK_H=block_h, BLOCK_N=block_n, NEW_API=_NEW_REINTERPRET, num_warps=8,
    )
