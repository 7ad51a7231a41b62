"""The per-step batch every backend's ``forward`` reads: :class:`AttentionMetadata`, the helper
that builds it from per-request counts (:func:`build_attention_metadata`), the one test of a
decode step (:func:`is_uniform_decode`), what a backend reads from the engine's layer
(:class:`AttentionLayer`, :class:`LayerScales`), and the private cache of an encoder-only layer
(:func:`encoder_only_cache`).

A batch mixes prefill requests (possibly with a cached prefix) and decode requests; their new
tokens are packed along dim 0 of query/key/value, and each request reads its pages through a
row of ``block_table``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from kvcore.step_facts import (
    StepFacts,
    context_overwrite_error,
    context_overwrites,
    mark_step_checked,
    overwrites_context,
)

__all__ = [
    "AttentionLayer",
    "AttentionMetadata",
    "LayerScales",
    "build_attention_metadata",
    "encoder_only_cache",
    "is_uniform_decode",
]


@runtime_checkable
class AttentionLayer(Protocol):
    """What a backend reads from the engine's attention layer: the KV quantisation scales."""

    k_scale: torch.Tensor | float
    v_scale: torch.Tensor | float


@dataclass
class LayerScales:
    """A minimal :class:`AttentionLayer` for engines without their own layer object."""

    k_scale: torch.Tensor | float = 1.0
    v_scale: torch.Tensor | float = 1.0


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by every backend.

    A batch mixes prefill requests (possibly with a cached prefix) and decode requests; their
    new tokens are packed along dim 0 of query/key/value.

    Attributes:
        query_start_loc: ``(num_seqs + 1,)`` int32, cumulative new-token counts.
        seq_lens: ``(num_seqs,)`` int32, cached + new tokens per request.
        block_table: ``(num_seqs, max_blocks_per_seq)`` int32 block ids (padding is 0).
        slot_mapping: ``(num_tokens,)`` int64 cache slot of each new token
            (``block_id * block_size + offset``; negative = padding, not written).
        max_query_len, max_seq_len: maxima of the above, on the host.
        num_actual_tokens: new tokens in the batch (rows of query beyond are padding).
        causal: whether queries are masked to earlier positions.
        query_start_loc_cpu, seq_lens_cpu: optional host (CPU) copies of ``query_start_loc``
            and ``seq_lens`` with the same values, for builders that plan on the host (e.g.
            FlashInfer's ``plan``): with them a builder needs no device read. ``None`` when
            the engine has none; :func:`build_attention_metadata` fills them.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    causal: bool = True
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def extend(self, cls: type[_M], **fields: Any) -> _M:
        """This step as ``cls``, a dataclass subclass of :class:`AttentionMetadata` that adds
        a backend's own fields (a plan, split counts, a workspace), given as ``fields``; every
        field of :class:`AttentionMetadata` is carried over. What a builder's ``build`` returns
        after ``super().build`` has checked the step."""
        return cls(**{name: getattr(self, name) for name in _BASE_FIELDS}, **fields)


def is_uniform_decode(attn_metadata: AttentionMetadata) -> bool:
    """Whether the step is a uniform decode: every request has exactly one new token.

    kvcore's one test of "is this a decode step", for a backend's kernel or plan choice and
    for CUDA graphs; it reads host values only (``num_actual_tokens``, ``num_seqs``,
    ``max_query_len``). A step of no requests is one (no request has other than one token:
    it is the padding-only step :class:`kvcore.CudaGraphRunner` captures on). Rows past
    ``num_actual_tokens`` are padding, no request's, and do not count; a step built for a
    CUDA graph must have none as well (:meth:`kvcore.PersistentMetadataBuilder.build`).
    """
    # num_actual_tokens new tokens over num_seqs requests, none with more than one: exactly
    # one each (max_query_len is 0 for a step of no requests).
    return (attn_metadata.num_actual_tokens == attn_metadata.num_seqs
            and attn_metadata.max_query_len <= 1)


_M = TypeVar("_M", bound=AttentionMetadata)
#: The fields :meth:`AttentionMetadata.extend` carries over (computed once: builders call it
#: every step).
_BASE_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionMetadata))

#: Largest block id an int32 block table holds.
_MAX_BLOCK_ID = 2**31 - 1


def is_index(value: object) -> bool:
    """An integer in any form (int, numpy int, 0-dim integer tensor), not a float."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_block_ids(i: int, blocks: Sequence[int] | torch.Tensor) -> None:
    """Block ids must be integers that fit the int32 block table."""
    if isinstance(blocks, torch.Tensor):
        if blocks.dtype.is_floating_point or blocks.dtype.is_complex:
            raise TypeError(f"block_tables[{i}] has dtype {blocks.dtype}; block ids must be ints")
        lo, hi = (int(blocks.min()), int(blocks.max())) if blocks.numel() else (0, 0)
    else:
        for b in blocks:
            if isinstance(b, bool) or not is_index(b):
                raise TypeError(f"block_tables[{i}] contains {b!r} ({type(b).__name__}); "
                                "block ids must be ints")
        lo = min((int(b) for b in blocks), default=0)
        hi = max((int(b) for b in blocks), default=0)
    if hi > _MAX_BLOCK_ID:
        raise ValueError(
            f"block_tables[{i}] contains block id {hi}, above {_MAX_BLOCK_ID}: the block table "
            "is int32, as the kernels read it (no cache has that many blocks)")
    if lo < -_MAX_BLOCK_ID - 1:
        raise ValueError(
            f"block_tables[{i}] contains {lo}, below {-_MAX_BLOCK_ID - 1}: the block table is "
            "int32, as the kernels read it; block ids are >= 0 (pad unused entries with 0)")


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    causal: bool = True,
    num_blocks: int | None = None,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from per-request counts and block tables.

    The value checks happen here, once per step, on the host lists: lengths and block
    coverage, ids not negative and, with ``num_blocks``, below it, no slot given to two new
    tokens, and no new token written to a slot a request of the step reads as context (the
    write would land before attention reads it). The tensors are marked
    with the step's :class:`kvcore.ops.StepFacts` (:func:`kvcore.ops.mark_step_checked`), so
    the ops of every layer compare those facts with their cache instead of reading the
    tensors back from the device. The tensors are made outside inference mode (inference
    tensors cannot be marked).

    Args:
        query_lens: new tokens per request (1 for decode, the prompt chunk for prefill).
        context_lens: tokens already in the cache per request (the cached prefix).
        block_tables: block ids per request; must cover ``context_len + query_len`` tokens.
        block_size: tokens per block.
        device: where the tensors are placed.
        causal: forwarded to :attr:`AttentionMetadata.causal`.
        num_blocks: blocks of the KV cache, to refuse out-of-range ids here, with the
            request named (otherwise each op refuses them against its cache).
        sliding_window: the window of the layers the step serves (``None``: full
            attention). A new token may then replace context outside every query's window
            (a ring buffer of the window's tokens, on decode); the facts record it, and a
            builder for wider-window layers checks the step again.
    """
    if len(query_lens) != len(context_lens) or len(query_lens) != len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and "
            f"block_tables ({len(block_tables)}) must have one entry per request"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                   or num_blocks <= 0):
        raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer or None")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window <= 0):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer or None "
                         "(full attention)")
    slots: list[int] = []
    seq_lens: list[int] = []
    rows: list[Sequence[int]] = []
    max_needed, max_block = 0, -1
    for i, (q_len, ctx_len, blocks) in enumerate(
        zip(query_lens, context_lens, block_tables, strict=True)
    ):
        for arg, n in (("query_lens", q_len), ("context_lens", ctx_len)):
            if isinstance(n, bool) or not is_index(n):
                raise TypeError(f"{arg}[{i}]={n!r} must be an int (a token count), got "
                                f"{type(n).__name__}")
        _check_block_ids(i, blocks)
        if q_len < 0 or ctx_len < 0:
            raise ValueError(
                f"request {i}: query_lens={q_len} and context_lens={ctx_len} must be >= 0"
            )
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.tolist()
        rows.append(blocks)
        seq_len = ctx_len + q_len
        needed = -(-seq_len // block_size)
        if len(blocks) < needed:
            raise ValueError(
                f"block_tables[{i}] has {len(blocks)} blocks but {seq_len} tokens need "
                f"{needed} blocks of {block_size}"
            )
        if needed:
            used = blocks[:needed]
            if min(used) < 0:
                raise ValueError(f"block_tables[{i}] contains a negative block id: {list(blocks)}")
            top = max(used)
            if num_blocks is not None and top >= num_blocks:
                raise ValueError(
                    f"block_tables[{i}] refers to block id {top}, but the cache has "
                    f"{num_blocks} blocks (valid ids: 0..{num_blocks - 1})"
                )
            max_block = max(max_block, top)
            max_needed = max(max_needed, needed)
        seq_lens.append(seq_len)
        for pos in range(ctx_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    if len(set(slots)) != len(slots):  # two new tokens in one slot: which lands is a race
        seen: set[int] = set()
        repeated = sorted({s for s in slots if s in seen or seen.add(s)})
        raise ValueError(f"the block tables give slots {repeated[:8]} to more than one new "
                         "token of the step; every new token needs its own slot")
    width = max((len(b) for b in rows), default=0)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    with torch.inference_mode(False):
        table = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
        for i, blocks in enumerate(rows):
            if len(blocks):
                table[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
        starts_cpu = torch.tensor(starts, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        slots_cpu = torch.tensor(slots, dtype=torch.int64)
        ctx_lens = [int(c) for c in context_lens]
        if slots and any(ctx_lens) and overwrites_context(slots, ctx_lens, rows, block_size,
                                                          sliding_window=sliding_window):
            ctx = torch.tensor(ctx_lens, dtype=torch.int64)  # the message names the first
            hits = context_overwrites(slots_cpu, ctx, table, block_size,
                                      sliding_window=sliding_window)
            raise context_overwrite_error(slots_cpu, starts_cpu, ctx, table, block_size, hits,
                                          sliding_window=sliding_window)
        metadata = AttentionMetadata(
            query_start_loc=starts_cpu.to(device, copy=True),
            seq_lens=seq_lens_cpu.to(device, copy=True),
            block_table=table.to(device),
            slot_mapping=slots_cpu.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_actual_tokens=starts[-1],
            causal=causal,
            query_start_loc_cpu=starts_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
    facts = StepFacts(num_tokens=starts[-1], num_seqs=len(rows), block_size=block_size,
                      max_blocks_per_seq=max_needed, max_block_id=max_block,
                      max_slot=max(slots, default=-1), sliding_window=sliding_window)
    mark_step_checked(facts, query_start_loc=metadata.query_start_loc,
                      seq_lens=metadata.seq_lens, block_table=metadata.block_table,
                      slot_mapping=metadata.slot_mapping)
    return metadata


def encoder_only_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A private paged cache holding only this step's tokens, for encoder-only layers.

    An encoder-only layer must not write the engine's cache (:meth:`AttentionImpl.
    writes_kv_cache`) but its kernels read K/V through a block table. This returns a fresh
    ``(num_blocks', *kv_cache.shape[1:])`` cache (contiguous, ``kv_cache``'s dtype), filled
    with ``key[:n]`` / ``value[:n]`` by ``write(key, value, cache, slot_mapping)`` (the
    backend's own cache write, so fp8 is quantised as usual), each request in its own run of
    blocks, and a copy of ``attn_metadata`` whose ``block_table`` and ``slot_mapping`` point
    into it. Reads the query lengths on the host (one sync per layer: encoder-only steps
    are not graph-captured).

    Raises:
        ValueError: a request has a cached prefix (``seq_lens`` must equal its query length).
    """
    n = attn_metadata.num_actual_tokens
    block_size = kv_cache.shape[2] if kv_cache.dim() == 5 else kv_cache.shape[1]
    starts = attn_metadata.query_start_loc.tolist()
    q_lens = [hi - lo for lo, hi in itertools.pairwise(starts)]
    seq_lens = attn_metadata.seq_lens.tolist()
    if seq_lens != q_lens:
        raise ValueError(
            f"encoder-only layers attend over the step's own tokens, but seq_lens={seq_lens} "
            f"differ from the query lengths {q_lens}; give every request context length 0"
        )
    counts = [-(-q // block_size) for q in q_lens]
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    table = torch.zeros(len(q_lens), max(max(counts, default=0), 1), dtype=torch.int32)
    slots: list[int] = []
    for i, (q_len, c) in enumerate(zip(q_lens, counts, strict=True)):
        table[i, :c] = torch.arange(first[i], first[i] + c, dtype=torch.int32)
        slots.extend(range(first[i] * block_size, first[i] * block_size + q_len))
    device = kv_cache.device
    cache = torch.zeros((max(first[-1], 1), *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                        device=device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    write(key[:n], value[:n], cache, slot_mapping)
    return cache, dataclasses.replace(attn_metadata, block_table=table.to(device),
                                      slot_mapping=slot_mapping)
