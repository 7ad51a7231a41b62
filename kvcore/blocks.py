"""Block movement helpers shared by every place that copies KV blocks by id.

A *block mapping* says that block ``src_ids[i]`` of a source cache goes to block
``dst_ids[i]`` of a destination cache; both caches are blocks-first (dim 0 is the block).
:func:`check_block_mapping` validates one before anything moves, and :func:`block_runs` merges
it into runs of consecutive blocks so that each run is one copy. The platforms' block
movement, the ``offload`` connector and plugins' block copiers use them (plugins through
:mod:`kvcore.ops`).

This module imports torch only, so the platform layer can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["block_runs", "check_block_mapping"]


def check_block_mapping(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    names: tuple[str, str, str, str] = ("src", "dst", "src_ids", "dst_ids"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a mapping of blocks ``src[src_ids[i]] -> dst[dst_ids[i]]``.

    Checks, in this order: all four are tensors; both caches have a leading block dim, the
    same block shape and the same dtype; each id tensor is 1-D, int32 or int64, with every id
    in range of its cache; both id tensors have the same length; no destination block is
    written twice. Reading a source block twice is allowed.

    Args:
        src, dst: blocks-first caches (or block views) ``(num_blocks, ...)``.
        src_ids, dst_ids: ``(n,)`` int32 or int64 block ids, on any device (reading them
            synchronises with that device).
        names: the names of ``(src, dst, src_ids, dst_ids)`` as the caller's user knows them;
            every message names the argument at fault with these.

    Returns:
        ``(src_ids, dst_ids)`` as int64 CPU tensors.

    Raises:
        TypeError: an argument is not a tensor, an id tensor is not int32/int64, or the two
            caches' dtypes differ.
        ValueError: any other check fails; the message names the argument and what is valid.
    """
    src_name, dst_name, src_ids_name, dst_ids_name = names
    for name, value in ((src_name, src), (dst_name, dst), (src_ids_name, src_ids),
                        (dst_ids_name, dst_ids)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if src.dim() == 0 or dst.dim() == 0:
        raise ValueError(f"{src_name} and {dst_name} must have a leading block dim")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"{src_name} blocks have shape {tuple(src.shape[1:])} but {dst_name} blocks have "
            f"{tuple(dst.shape[1:])}; both caches must hold the same page layout"
        )
    if src.dtype != dst.dtype:
        raise TypeError(f"{src_name} is {src.dtype} but {dst_name} is {dst.dtype}")
    checked = []
    for name, ids, cache in ((src_ids_name, src_ids, src), (dst_ids_name, dst_ids, dst)):
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {ids.dtype}")
        ids = ids.detach().to("cpu", torch.int64)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= cache.shape[0]:
                raise ValueError(
                    f"{name} contains block id {lo if lo < 0 else hi}, outside the cache's "
                    f"{cache.shape[0]} blocks (valid ids: 0..{cache.shape[0] - 1})"
                )
        checked.append(ids)
    src_out, dst_out = checked
    if src_out.numel() != dst_out.numel():
        raise ValueError(
            f"{src_ids_name} has {src_out.numel()} entries but {dst_ids_name} has "
            f"{dst_out.numel()}"
        )
    unique, counts = dst_out.unique(return_counts=True)
    if unique.numel() != dst_out.numel():
        raise ValueError(
            f"{dst_ids_name} repeats block ids {unique[counts > 1].tolist()}: each destination "
            "block is written once (which source would win is undefined)"
        )
    return src_out, dst_out


# Mappings up to this many pairs are merged by a Python loop: there, the fixed cost of a dozen
# torch ops outweighs sorting in Python (the offload connector's usual transfers are this small).
_PYTHON_MAX_PAIRS = 128


def block_runs(
    src_ids: torch.Tensor | Sequence[int],
    dst_ids: torch.Tensor | Sequence[int],
    src_adjacent: bool = True,
    dst_adjacent: bool = True,
) -> torch.Tensor:
    """Merge a block mapping into runs where both ids advance by one: one copy per run.

    Args:
        src_ids, dst_ids: ``(n,)`` integer block ids (tensors on any device, or sequences);
            block ``src_ids[i]`` goes to block ``dst_ids[i]``. Not validated: check them with
            :func:`check_block_mapping` first where they come from a caller.
        src_adjacent, dst_adjacent: whether block ``b + 1`` starts where block ``b`` ends in
            the source / destination memory (a blocks-first tensor whose ``stride(0)`` is one
            block's size); only then can a run span several blocks.

    Returns:
        ``(num_runs, 3)`` int64 CPU tensor of ``(first_src, first_dst, count)`` rows, sorted
        by ``first_src`` then ``first_dst``; run ``r`` moves source blocks
        ``first_src .. first_src + count - 1`` to destination blocks
        ``first_dst .. first_dst + count - 1``.
    """
    src = (src_ids.detach().to("cpu", torch.int64).reshape(-1)
           if isinstance(src_ids, torch.Tensor) else src_ids)
    dst = (dst_ids.detach().to("cpu", torch.int64).reshape(-1)
           if isinstance(dst_ids, torch.Tensor) else dst_ids)
    if len(src) != len(dst):
        raise ValueError(f"src_ids has {len(src)} entries but dst_ids has {len(dst)}")
    merge = src_adjacent and dst_adjacent
    if len(src) <= _PYTHON_MAX_PAIRS:
        if isinstance(src, torch.Tensor):
            src, dst = src.tolist(), dst.tolist()
        runs: list[list[int]] = []
        for s, d in sorted(zip(src, dst, strict=True)):
            last = runs[-1] if runs else None
            if merge and last and s == last[0] + last[2] and d == last[1] + last[2]:
                last[2] += 1
            else:
                runs.append([s, d, 1])
        return torch.tensor(runs, dtype=torch.int64).view(-1, 3)
    src = torch.as_tensor(src, dtype=torch.int64)
    dst = torch.as_tensor(dst, dtype=torch.int64)
    # Sort by source, ties (a source block read twice) by destination: a stable sort by the
    # secondary key, then by the primary one.
    order = torch.argsort(dst, stable=True)
    order = order[torch.argsort(src[order], stable=True)]
    src, dst = src[order], dst[order]
    starts = torch.ones_like(src, dtype=torch.bool)
    if merge:
        starts[1:] = (src[1:] != src[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
    first = starts.nonzero().squeeze(1)
    counts = torch.diff(first, append=torch.tensor([src.numel()]))
    return torch.stack([src[first], dst[first], counts], dim=1)
