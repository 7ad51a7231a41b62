"""One transformers cache group's step as kvcore metadata: the group record, and the
metadata of a full-attention group, of a sliding group read in place on its ring, and of a
sliding group gathered into a scratch cache (:mod:`kvcore.integrations.transformers` says
when each applies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    FullAttentionSpec,
    allocate_kv_caches,
    attention_metadata_from_engine,
)

__all__ = ["CacheGroup", "Staging", "full_metadata", "group_scratch", "grown", "ring_metadata",
           "sliding_metadata"]


@dataclass
class CacheGroup:
    """One transformers cache group (allocator), viewed: its layers' kvcore caches and impls,
    its geometry and its step builder.

    A full-attention group's layers are read in place through block tables. A sliding group
    (``window`` set) keeps each request's last ``window`` tokens in a ring (the token at
    position ``p`` in ring slot ``p % window``). Its steps are read in place too when
    ``in_place`` (the ring is whole pages) and no new token replaces a key an earlier query
    of the step sees (:func:`ring_metadata`); otherwise the window is
    gathered into ``scratch`` (a kvcore cache of one layer, reused by every layer of the
    group in turn), attention runs there, and the new tokens are written to the ring after.
    """

    name: str  # transformers' layer type: the key of cu_seq_lens_k and max_length_k
    allocator_index: int
    layers: dict[int, torch.Tensor]  # layer index -> (num_blocks, 2, N, H, D) view
    impls: dict[int, AttentionImpl]
    spec: FullAttentionSpec
    row_stride: int  # transformers' block_physical_stride
    num_blocks: int
    window: int | None = None
    sentinel: int = -1  # read-index row marking a new token (sliding groups)
    write_trash: int = -1  # write-index row of a token not stored (sliding groups)
    # A sliding group's ring is whole pages (window % page size == 0): a position's page
    # offset is its ring slot's, so block tables can map positions onto the ring.
    in_place: bool = False
    scratch: torch.Tensor | None = None  # (blocks, 2, N, H, D), sliding groups
    builder: Any = None


@dataclass
class Staging:
    """A sliding group's per-step copies: rows of the ring gathered into the scratch cache
    before attention (``src_*`` from the layer's view, ``dst_*`` into ``scratch``), and the
    ring slots the new tokens go to after it (``-1``: not stored)."""

    scratch: torch.Tensor
    src_blocks: torch.Tensor | None
    src_offsets: torch.Tensor | None
    dst_blocks: torch.Tensor | None
    dst_offsets: torch.Tensor | None
    ring_slots: torch.Tensor


def grown(need: int, have: int, cap: int) -> int:
    """A builder bound that holds ``need``: ``have`` if it does, else the next power of two
    (at least twice ``have``), at most ``cap``."""
    if need <= have:
        return have
    return min(cap, max(2 * have, 1 << (max(need, 1) - 1).bit_length()))


def _step_inputs(group: CacheGroup, kwargs: dict, starts_cpu: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """transformers' step inputs of ``group``: ``cu_seq_lens_k`` (int32), the write and read
    indices, the request count, the longest query and ``max_length_k`` (host values; the
    last an upper bound once padded)."""
    q_lens = starts_cpu[1:] - starts_cpu[:-1]
    return (kwargs["cu_seq_lens_k"][group.name].to(torch.int32),
            kwargs["write_index"][group.allocator_index],
            kwargs["read_index"][group.allocator_index], starts_cpu.numel() - 1,
            int(q_lens.max()) if q_lens.numel() else 0, int(kwargs["max_length_k"][group.name]))


def full_metadata(group: CacheGroup, page_size: int, kwargs: dict, cu_q: torch.Tensor,
                  starts_cpu: torch.Tensor) -> AttentionMetadata:
    """kvcore's metadata of one step for a full-attention group (module docstring)."""
    n, stride = page_size, group.row_stride
    cu_k, write, read, _, max_query_len, max_seq_len = _step_inputs(group, kwargs, starts_cpu)
    device = cu_q.device
    seq_lens = cu_k[1:] - cu_k[:-1]
    # A request's rows in the read index cover all its tokens (past and new); a step that
    # reads no past (only first prefills) has an empty read index and its write index then
    # covers every token, at the same offsets (cu_seq_lens_k equals cu_seq_lens_q).
    rows = read if read.numel() else write
    width = max(1, -(-max_seq_len // n))
    page_starts = torch.arange(width, device=device, dtype=torch.int64) * n
    pos = cu_k[:-1, None].long() + page_starts
    used = page_starts < seq_lens[:, None]
    pos = pos.clamp_(max=max(rows.numel() - 1, 0))
    block_table = torch.where(used, rows[pos] // stride, 0).to(torch.int32)
    slots = (write // stride) * n + write % stride
    real = torch.arange(write.numel(), device=device) < cu_q[-1]
    slot_mapping = torch.where(real, slots, -1)
    return attention_metadata_from_engine(
        query_start_loc=cu_q, seq_lens=seq_lens, block_table=block_table,
        slot_mapping=slot_mapping, query_start_loc_cpu=starts_cpu,
        max_query_len=max_query_len, max_seq_len=max_seq_len, block_size=n,
        num_blocks=group.num_blocks)


def ring_metadata(group: CacheGroup, page_size: int, kwargs: dict, cu_q: torch.Tensor,
                  starts_cpu: torch.Tensor) -> AttentionMetadata:
    """kvcore's metadata of one step for a sliding group, read in place on its ring.

    For a step whose requests each read at most ``window`` keys (``KVCoreAttention`` checks
    ``max_length_k``): a decode past the window, or a prefill chunk that does not wrap the
    ring. transformers' keys of request ``i`` (its ``cu_seq_lens_k`` span) are its cached
    tokens (read-index rows, oldest first) then its new tokens (the write index's rows, in
    place of the read index's sentinels). kvcore numbers them from ``o``, the page offset
    of the oldest one, so a key's kvcore position has its ring slot's page offset and
    logical block ``j`` holds keys of one ring page: the block table takes, per column, the
    page of the key that starts it (column 0: of the oldest key). Positions ``0 .. o - 1``
    of column 0 are ring slots of no key the step's queries see (at least ``window`` back
    from the first new token): one of them is where a decode writes, which the group's
    builder allows for (its spec's ``sliding_window``). The new tokens go to their ring
    slots (the write index) before attention, as a full-attention group's do.
    """
    n, stride = page_size, group.row_stride
    cu_k, write, read, num_seqs, max_query_len, longest = _step_inputs(group, kwargs, starts_cpu)
    device = cu_q.device
    keys = cu_k[1:] - cu_k[:-1]
    first = cu_k[:-1].long()
    if read.numel():
        # Each read-index entry's key: its own row while cached, else the write index's row
        # of the same request's new token.
        entries = torch.arange(read.numel(), device=device)
        owner = torch.searchsorted(cu_k[1:], entries.to(torch.int32), right=True)
        owner = owner.clamp_(max=max(num_seqs - 1, 0))
        cached = (keys - (cu_q[1:] - cu_q[:-1])).long()
        new = entries - first[owner] - cached[owner]
        from_write = write[(cu_q[owner].long() + new).clamp_(0, max(write.numel() - 1, 0))]
        rows = torch.where(new >= 0, from_write, read)
    else:  # no request has cached tokens: its keys are its new tokens
        rows = write
    last = max(rows.numel() - 1, 0)
    offset = rows[first.clamp(max=last)] % stride  # the oldest key's page offset
    seq_lens = (offset + keys).to(torch.int32)
    # Only a request that read a full window can start mid-page.
    max_seq_len = longest + (n - 1 if longest >= group.window else 0)
    width = max(1, -(-max_seq_len // n))
    block_starts = torch.arange(width, device=device, dtype=torch.int64) * n
    key = (block_starts[None, :] - offset[:, None]).clamp_(min=0) + first[:, None]
    used = block_starts[None, :] < seq_lens[:, None]
    block_table = torch.where(used, rows[key.clamp_(max=last)] // stride, 0)
    ring = (write // stride) * n + write % stride
    real = torch.arange(write.numel(), device=device) < cu_q[-1]
    slot_mapping = torch.where(real & (write != group.write_trash), ring, -1)
    return attention_metadata_from_engine(
        query_start_loc=cu_q, seq_lens=seq_lens, block_table=block_table.to(torch.int32),
        slot_mapping=slot_mapping, query_start_loc_cpu=starts_cpu,
        max_query_len=max_query_len, max_seq_len=max_seq_len, block_size=n,
        num_blocks=group.num_blocks)


def sliding_metadata(group: CacheGroup, backend: type[AttentionBackend], page_size: int,
                     kwargs: dict, cu_q: torch.Tensor, starts_cpu: torch.Tensor
                     ) -> tuple[AttentionMetadata, Staging]:
    """kvcore's metadata of one step for a sliding group, on its scratch cache.

    transformers' keys of request ``i`` are its last ``min(past, window - 1)`` cached
    tokens (read-index rows, oldest first) then its new tokens (sentinel rows): its
    ``cu_seq_lens_k`` span. kvcore numbers them ``0 .. seq_len - 1`` (positions shifted by
    the dropped prefix: relative distances, and so the window and causality, are
    unchanged) in scratch blocks ``i * width ..`` of the group's scratch cache. Every
    read-index row is copied to its key's scratch slot (a sentinel's copy is then
    overwritten by the new token's write); new tokens go to the scratch before attention
    and to transformers' ring (its write index; rows it does not store: slot -1) after.
    """
    n, stride = page_size, group.row_stride
    cu_k, write, read, num_seqs, max_query_len, max_seq_len = _step_inputs(group, kwargs,
                                                                          starts_cpu)
    device = cu_q.device
    seq_lens = cu_k[1:] - cu_k[:-1]
    width = max(1, -(-max_seq_len // n))
    scratch = group_scratch(group, backend, page_size, num_seqs * width)
    base = torch.arange(num_seqs, device=device, dtype=torch.int64) * width
    block_table = (base[:, None] + torch.arange(width, device=device)).to(torch.int32)
    past = (seq_lens - (cu_q[1:] - cu_q[:-1])).long()
    rows = torch.arange(write.numel(), device=device)
    real = rows < cu_q[-1]
    req = torch.searchsorted(cu_q[1:], rows.to(torch.int32), right=True)
    req = req.clamp_(max=max(num_seqs - 1, 0))
    key = past[req] + rows - cu_q[req].long()
    slot_mapping = torch.where(real, base[req] * n + key, -1)
    ring = (write // stride) * n + write % stride
    ring_slots = torch.where(real & (write != group.write_trash), ring, -1)
    src_blocks = src_offsets = dst_blocks = dst_offsets = None
    if read.numel():
        entries = torch.arange(read.numel(), device=device)
        owner = torch.searchsorted(cu_k[1:], entries.to(torch.int32), right=True)
        owner = owner.clamp_(max=max(num_seqs - 1, 0))
        dst = base[owner] * n + entries - cu_k[owner].long()
        src_blocks, src_offsets = read // stride, read % stride
        dst_blocks, dst_offsets = dst // n, dst % n
    common = attention_metadata_from_engine(
        query_start_loc=cu_q, seq_lens=seq_lens, block_table=block_table,
        slot_mapping=slot_mapping, query_start_loc_cpu=starts_cpu,
        max_query_len=max_query_len, max_seq_len=max_seq_len, block_size=n,
        num_blocks=scratch.shape[0])
    return common, Staging(scratch, src_blocks, src_offsets, dst_blocks, dst_offsets,
                            ring_slots)


def group_scratch(group: CacheGroup, backend: type[AttentionBackend], page_size: int,
                  blocks: int) -> torch.Tensor:
    """``group``'s scratch cache, of at least ``blocks`` blocks (grown by powers of two).
    Zeroed when made: a block's slots beyond a request's keys are never attended to but
    may be loaded, and must hold finite values."""
    have = 0 if group.scratch is None else group.scratch.shape[0]
    if blocks > have:
        view = next(iter(group.layers.values()))
        made = allocate_kv_caches(
            backend, num_layers=1, num_blocks=grown(blocks, have, blocks * 2),
            block_size=page_size, num_kv_heads=group.spec.num_kv_heads,
            head_size=group.spec.head_size, dtype=view.dtype, device=view.device,
            cross_layer=False)
        group.scratch = made.layers[0]
        group.scratch.zero_()
    return group.scratch
