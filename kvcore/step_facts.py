"""A step's value facts, checked once and carried by its metadata tensors.

The value checks of the ops' arguments (slot and block ids within the cache, lengths
consistent) need tensor values; read from a GPU they synchronise with it, once per op and
layer. A step establishes them once instead: :func:`kvcore.build_attention_metadata` from its
host lists, a builder with one device read (:func:`kvcore.ops.step_facts_from_tensors`). The
result, a :class:`StepFacts`, is attached to the step's tensors (:func:`mark_step_checked`);
the ops' validators (:mod:`kvcore.ops.validation`) find it (:func:`checked_step_facts`) and
compare its maxima with the cache they are given instead of reading the tensors.

A mark is tied to the tensor object and to its version counter: a view, a copy, or an in-place
write through torch carries no valid mark, so such a tensor is checked by reading it. Writes
that bypass torch's version counter (a kernel or numpy writing through a raw pointer,
``tensor.data``) are not seen: make the step's tensors anew rather than refilling marked ones
that way. Marks are plain attributes holding immutable records, so marking and checking from
several threads is safe.

This module sits at the bottom of kvcore's layers (the contract's
:func:`~kvcore.build_attention_metadata` and the ops both use it) and imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepFacts", "checked_step_facts", "context_overwrite_error", "context_overwrites",
           "mark_step_checked", "overwrites_context", "window_covers"]


def _require_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


_MARK = "_kvcore_step_facts"


@dataclass(frozen=True)
class StepFacts:
    """What the value checks established about one step's metadata tensors.

    Made by :func:`kvcore.build_attention_metadata` (from its host-side lists) or
    :func:`step_facts_from_tensors` (one device read), which check everything that does not
    depend on the cache: ``query_start_loc`` starts at 0 and never decreases, every
    ``seq_len`` covers its query tokens and fits the block table's columns, the block ids a
    request uses are not negative. What depends on the cache (ids below its size) each op
    compares with the maxima here, against the cache it is given.

    Attributes:
        num_tokens: ``query_start_loc[-1]``, the query rows the step attends for.
        num_seqs: requests.
        block_size: tokens per block the lengths were checked with; the ops refuse the
            step on a cache of another block size (``check_step_block_size``).
        max_blocks_per_seq: most block-table entries one request uses
            (``ceil(seq_len / block_size)``).
        max_block_id: largest block id a request uses (-1: none).
        max_slot: largest entry of ``slot_mapping`` (-1: none, or only padding).
        sliding_window: the window the same-step overwrite check allowed for
            (:func:`context_overwrites`): ``None``, checked for full attention (the facts
            hold for every layer); ``W``, a new token may replace context that no query of
            its request sees within ``W`` positions, so the facts hold only for layers whose
            window is at most ``W`` (:func:`window_covers`).
    """

    num_tokens: int
    num_seqs: int
    block_size: int
    max_blocks_per_seq: int
    max_block_id: int
    max_slot: int
    sliding_window: int | None = None


def window_covers(checked: int | None, layer: int | None) -> bool:
    """Whether a step whose overwrite check allowed for the sliding window ``checked`` is
    safe for layers of window ``layer`` (``None``: full attention): a narrower window sees
    a subset of the context a wider one sees, full attention sees all of it."""
    return checked is None or (layer is not None and layer <= checked)


def _version(t: torch.Tensor) -> int | None:
    # Inference tensors have no version counter: an in-place write would go unseen, so they
    # are never marked (and always checked by reading them).
    return None if t.is_inference() else t._version


def mark_step_checked(
    facts: StepFacts,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
) -> bool:
    """Mark one step's metadata tensors as checked, with the facts the checks established.

    Ops given these very tensors (not views or copies), unmodified since (torch's version
    counter), take the value facts from the mark instead of reading the tensors. Call it only
    with facts established for exactly these tensors' values (:func:`step_facts_from_tensors`
    does both). The shapes are compared with the facts here.

    Returns:
        ``False`` if a tensor is an inference tensor (created under ``torch.inference_mode``,
        which keeps no version counter): nothing is marked and the ops keep reading the
        values. Make metadata tensors outside inference mode to get the fast path.
    """
    tensors = {"query_start_loc": query_start_loc, "seq_lens": seq_lens,
               "block_table": block_table}
    if slot_mapping is not None:
        tensors["slot_mapping"] = slot_mapping
    for name, t in tensors.items():
        _require_tensor(name, t)
    expected = {"query_start_loc": facts.num_seqs + 1, "seq_lens": facts.num_seqs,
                "block_table": facts.num_seqs}
    for name, rows in expected.items():
        if tensors[name].dim() < 1 or tensors[name].shape[0] != rows:
            raise ValueError(f"{name} has shape {tuple(tensors[name].shape)} but the step's "
                             f"facts describe {facts.num_seqs} sequences ({rows} rows)")
    if block_table.dim() != 2 or block_table.shape[1] < facts.max_blocks_per_seq:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)} but a request of "
                         f"the step uses {facts.max_blocks_per_seq} blocks")
    versions = {name: _version(t) for name, t in tensors.items()}
    if any(v is None for v in versions.values()):
        return False
    for name, t in tensors.items():
        setattr(t, _MARK, (facts, versions[name], t.data_ptr()))
    return True


def mark_views_checked(facts: StepFacts, tensors: tuple[torch.Tensor, ...]) -> bool:
    """:func:`mark_step_checked` for a builder's own views ``(query_start_loc, seq_lens,
    block_table, slot_mapping)``, whose shapes fit ``facts`` by construction: marked with no
    shape check (a builder marks its buffers every step)."""
    versions = [None if t.is_inference() else t._version for t in tensors]
    if None in versions:
        return False
    for t, version in zip(tensors, versions, strict=True):
        setattr(t, _MARK, (facts, version, t.data_ptr()))
    return True


def checked_step_facts(*tensors: torch.Tensor) -> StepFacts | None:
    """The facts every one of ``tensors`` is validly marked with (one and the same record), or
    ``None``: unmarked, marked for different steps, or written since they were marked."""
    found = None
    for t in tensors:
        mark = getattr(t, _MARK, None)
        if mark is None:
            return None
        facts, version, ptr = mark
        if (found is not None and facts is not found) or t._version != version \
                or t.data_ptr() != ptr:
            return None
        found = facts
    return found


def _visible_start(context_lens: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Per request, the first context position a query of the step can see: 0 for full
    attention; with a window ``W`` the first new token (position ``context_lens[i]``) sees
    back to ``context_lens[i] - W + 1`` and the later ones see less far back."""
    if sliding_window is None:
        return torch.zeros_like(context_lens)
    return (context_lens - (sliding_window - 1)).clamp(min=0)


def context_overwrites(slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor, block_size: int, *,
                       sliding_window: int | None = None) -> torch.Tensor:
    """Which block-table entries a new token of the step overwrites while they are context
    that a query of the step can see.

    A request reads its first ``context_lens[i]`` tokens from the cache through
    ``block_table[i]``; a new token written to one of those slots in the same step changes
    what it reads (the write lands before attention, so the request sees the new token in
    place of its own). With a ``sliding_window`` ``W`` (kvcore's convention: the query at
    position ``q`` sees the keys ``k`` with ``q - k < W``), context at positions
    ``k <= context_lens[i] - W`` is outside every query's window (the first new token, at
    position ``context_lens[i]``, sees the furthest back) and may be overwritten: a ring
    buffer's decode writes exactly there. The slots are sorted once and each entry's visible
    context slots ``[block * block_size + start, block * block_size + covered)`` are looked up
    in them: vectorised, no host read, on the tensors' device.

    Args:
        slot_mapping: ``(num_tokens,)`` the new tokens' slots (negative: padding).
        context_lens: ``(num_seqs,)`` cached tokens per request (``seq_lens - query lens``).
        block_table: ``(num_seqs, max_blocks_per_seq)`` block ids.
        sliding_window: the layers' window (``None``: full attention, all context counts).

    Returns:
        ``(num_seqs, max_blocks_per_seq)`` bool, ``True`` where the entry's visible context
        slots receive a new token (see :func:`context_overwrite_error` for the message).
    """
    ordered = slot_mapping.to(torch.int64).sort().values
    cols = torch.arange(block_table.shape[1], device=block_table.device, dtype=torch.int64)
    ctx = context_lens.to(torch.int64)
    starts = cols[None, :] * block_size
    covered = (ctx[:, None] - starts).clamp(0, block_size)
    start = torch.minimum((_visible_start(ctx, sliding_window)[:, None] - starts).clamp(
        0, block_size), covered)
    ids = block_table.to(torch.int64)
    lo = ids * block_size
    written = (torch.searchsorted(ordered, lo + covered)
               - torch.searchsorted(ordered, lo + start))
    return (written > 0) & (ids >= 0)


def overwrites_context(slots: list[int], context_lens: list[int], rows: list[list[int]],
                       block_size: int, *, sliding_window: int | None = None) -> bool:
    """:func:`context_overwrites` on host lists, set-based: whether any new token's slot
    (``slots``, negative: padding) is one a request reads as context that a query of the
    step can see (its first ``context_lens[i]`` tokens through the block ids ``rows[i]``,
    from position ``context_lens[i] - sliding_window + 1`` on when a window is given). The
    blocks new tokens write go into a dict (block -> lowest offset written); each request's
    wholly visible blocks are tested against it in one C-level pass, its partly cached last
    block by offset and a window's partly visible first block slot by slot."""
    lowest: dict[int, int] = {}
    for s in slots:
        if s >= 0:
            block, offset = divmod(s, block_size)
            if offset < lowest.get(block, block_size):
                lowest[block] = offset
    written = lowest.keys()
    slot_set = set(slots) if sliding_window is not None else None
    for ctx_len, blocks in zip(context_lens, rows, strict=True):
        first = 0 if sliding_window is None else max(0, ctx_len - sliding_window + 1)
        if first >= ctx_len:
            continue
        col, skip = divmod(first, block_size)
        whole, part = divmod(ctx_len, block_size)
        if skip:  # the window starts inside block `col`: only its offsets skip.. are seen
            base = blocks[col] * block_size
            end = block_size if col < whole else part
            if blocks[col] in lowest and any(base + o in slot_set for o in range(skip, end)):
                return True
            col += 1
        if not written.isdisjoint(blocks[col:whole]):
            return True
        if part and col <= whole and lowest.get(blocks[whole], block_size) < part:
            return True
    return False


def context_overwrite_error(slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, block_table: torch.Tensor,
                            block_size: int, hits: torch.Tensor, *,
                            sliding_window: int | None = None) -> ValueError:
    """The message for the first entry of ``hits`` (:func:`context_overwrites`, with the same
    ``sliding_window``), naming the new token, its request, the slot and the request that
    reads it. Reads the tensors back: for a failing step only."""
    i, col = (int(x) for x in hits.nonzero()[0].tolist())
    block = int(block_table[i, col])
    ctx = int(context_lens[i])
    covered = min(ctx - col * block_size, block_size)
    first = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
    start = min(max(first - col * block_size, 0), covered)
    slots = slot_mapping.tolist()
    token, slot = next((t, s) for t, s in enumerate(slots)
                       if block * block_size + start <= s < block * block_size + covered)
    starts = query_start_loc.tolist()
    writer = next((r for r in range(len(starts) - 1) if starts[r] <= token < starts[r + 1]),
                  None)
    what = (f"padding row {token}" if writer is None else
            f"request {writer}'s new token {token - starts[writer]} (row {token})")
    reader = "the same request" if writer == i else f"request {i}"
    seen = ("" if sliding_window is None else
            f", inside the sliding window of {sliding_window} of its first new token")
    if sliding_window is None:
        fix = ("; for sliding-window layers only context inside the window counts: give "
               "the check the window (FullAttentionSpec(sliding_window=...), "
               "build_attention_metadata(..., sliding_window=...))")
    else:
        fix = ("; a ring buffer of the window's size can take a step only if no new token "
               "replaces a token an earlier query of the step still sees (decode steps, or "
               "steps that do not wrap the ring)")
    return ValueError(
        f"{what} is written to slot {slot} (block {block}, offset "
        f"{slot - block * block_size}), which {reader} reads as context (its token "
        f"{col * block_size + slot - block * block_size}{seen}) in the same step: the write "
        "would replace what it attends to. A step's new tokens need slots no request of the "
        "step reads as context; give them blocks of their own (a block shared as a cached "
        f"prefix is read-only){fix}")
