"""Argument checks shared by every implementation of kvcore's ops.

Each check raises ``ValueError`` or ``TypeError`` naming the argument, the value it got and
what is expected, *before* any kernel is launched. The reference ops and every fast path
(Triton, CUDA C++, vendor libraries) call the same functions, so a bad argument produces the
same message whichever implementation runs.

Checks that need to read tensor *values* (slot and block ids within range, lengths consistent)
are on by default. Read from the device they synchronise with it, so an engine step does them
once instead: :func:`kvcore.build_attention_metadata` derives the step's :class:`StepFacts`
from its host-side lists (or an :class:`kvcore.AttentionMetadataBuilder` reads the tensors
once) and *marks* the step's tensors with them (:func:`mark_step_checked`). An op given marked
tensors compares the facts with the cache it was given (no device read) and skips only those
value checks; shape, dtype and device checks always run. A mark is tied to the tensor object
and to its version counter: a view, a copy, or an in-place write through torch carries no
valid mark, so such a tensor is checked by reading it. Writes that bypass torch's version
counter (a kernel or numpy writing through a raw pointer, ``tensor.data``) are not seen: make
the step's tensors anew (e.g. :func:`kvcore.build_attention_metadata`) rather than refilling
marked ones that way. Marks are plain attributes holding immutable
records, so marking and checking from several threads is safe. A serving engine whose
scheduler is validated can still turn all value checks off with :func:`set_value_checks` or
``KVCORE_CHECK_INDICES=0``.
"""

from __future__ import annotations

import math
import os

import torch

from kvcore.dtypes import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES, cache_torch_dtype
from kvcore.step_facts import (
    StepFacts,
    checked_step_facts,
    context_overwrite_error,
    context_overwrites,
    mark_step_checked,
)

# The dtype tables live in kvcore.dtypes (the contract uses them too); they stay importable
# from here and from kvcore.ops.
__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "KVScale",
    "StepFacts",
    "cache_torch_dtype",
    "checked_step_facts",
    "mark_step_checked",
    "set_value_checks",
    "step_facts_from_tensors",
    "value_checks_enabled",
    "validate_reshape_and_cache",
    "validate_paged_attention",
    "check_paged_attention_args",
    "check_paged_attention_values",
    "check_reshape_and_cache_args",
    "check_reshape_and_cache_values",
    "check_block_indices",
    "check_kv_cache_dtype",
    "check_distinct_pages",
    "check_distinct_slots",
    "check_scale",
    "check_softmax_scale",
    "check_step_tensor_layout",
    "check_slots_in_range",
    "check_step_block_size",
    "require_float_dtype",
    "require_int_dtype",
    "require_ndim",
    "require_same_device",
    "require_tensor",
]

_CACHE_DIMS = "(num_blocks, block_size, num_kv_heads, head_size)"

#: A per-tensor fp8 scale argument (``k_scale``, ``v_scale``, MLA's ``scale``): a 1-element
#: tensor (kernels read it on the device: no host sync), a float, or ``None`` (1.0). Ignored
#: unless the cache dtype is fp8.
KVScale = torch.Tensor | float | None

_value_checks = os.environ.get("KVCORE_CHECK_INDICES", "1").lower() not in ("0", "false", "no")


def set_value_checks(enabled: bool) -> None:
    """Turn the value-range checks (which synchronise with the device) on or off."""
    global _value_checks
    _value_checks = bool(enabled)


def value_checks_enabled() -> bool:
    return _value_checks


def require_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` if it is a tensor; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_ndim(name: str, t: torch.Tensor, ndim: int | tuple[int, ...], layout: str) -> None:
    """``ValueError`` unless ``t`` has ``ndim`` dims (or one of them); ``layout`` names them,
    e.g. ``"(num_tokens, num_kv_heads, head_size)"``."""
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} dims {layout}, got shape {tuple(t.shape)}")


def require_int_dtype(name: str, t: torch.Tensor) -> None:
    """``TypeError`` unless ``t`` is int32 or int64 (ids, lengths, offsets)."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def require_float_dtype(name: str, t: torch.Tensor) -> None:
    """``TypeError`` unless ``t`` holds model values: a floating dtype that is not fp8."""
    if not t.dtype.is_floating_point or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a float16/bfloat16/float32/float64 tensor, got {t.dtype}")


def check_step_tensor_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             block_table: torch.Tensor) -> None:
    """The dims and dtypes of a step's tensors (given as tensors): ``query_start_loc``
    ``(num_seqs + 1,)``, ``seq_lens`` ``(num_seqs,)``, ``block_table`` ``(num_seqs,
    max_blocks_per_seq)``, all int32/int64."""
    require_ndim("query_start_loc", query_start_loc, 1, "(num_seqs + 1,)")
    require_ndim("seq_lens", seq_lens, 1, "(num_seqs,)")
    require_ndim("block_table", block_table, 2, "(num_seqs, max_blocks_per_seq)")
    for n, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                 ("block_table", block_table)):
        require_int_dtype(n, t)


def require_same_device(names_and_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """``ValueError`` naming the first tensor that is not on the first one's device."""
    first_name, first = names_and_tensors[0]
    for name, t in names_and_tensors[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors of one call must be on the same device"
            )


#: float32's smallest normal and largest finite values: an fp8 scale outside them has no
#: finite, exact float32 reciprocal (what the cache write multiplies by).
_F32_TINY = torch.finfo(torch.float32).tiny
_F32_MAX = torch.finfo(torch.float32).max


def check_scale(name: str, scale: object, *, used: bool = False) -> None:
    """A per-tensor fp8 scale: ``None``, a number or a 1-element tensor.

    With ``used=True`` (the cache is fp8, so the scale is applied) it must also be finite and
    positive, and a normal float32 (the kernels multiply by ``float32(1 / scale)``): a 0, NaN,
    inf or subnormal scale stores garbage. A number is checked always; a tensor's
    value only when value checks are on (reading it synchronises with the device).
    """
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{name} must be a per-tensor scale (1 element), got shape {tuple(scale.shape)}"
            )
        if not used or not _value_checks:
            return
        value = float(scale.reshape(()).item())
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or a 1-element tensor, got {type(scale).__name__}")
    else:
        value = float(scale)
    if used and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value} must be a finite, positive fp8 scale (the cache stores "
                         "x / scale); check the checkpoint's KV scales")
    if used and not _F32_TINY <= value <= _F32_MAX:
        raise ValueError(
            f"{name}={value} is outside float32's normal range ({_F32_TINY:.4g} to "
            f"{_F32_MAX:.4g}): the kernels compute float32(1 / scale), which is not finite or "
            "loses its precision for such a scale; check the checkpoint's KV scales")


def check_softmax_scale(scale: object) -> None:
    """The softmax scale: a finite, positive number (usually ``head_size ** -0.5``)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a finite, positive float "
                         "(usually head_size ** -0.5)")


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(stride, size)`` of the dims of ``t`` that have more than one element."""
    return [(st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1]


def check_distinct_pages(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """``ValueError`` if two blocks (or a block's K and V) of the caches share memory.

    Decided from shapes and strides alone (no device sync): the K/V pair is seen as one
    tensor with an extra dim of size 2 (the distance between the two views) when they share
    a storage, and no dim of size > 1 may start inside the span of the smaller ones. Every
    layout kvcore allocates passes (per-layer views of cross-layer caches, HND, legacy
    halves); an ``expand``-ed or overlapping view is refused, since a write to one block
    would change another.
    """
    if key_cache.device.type == "meta":
        return  # no memory to share
    views = [_dims(key_cache), _dims(value_cache)]
    same_storage = (key_cache.untyped_storage().data_ptr()
                    == value_cache.untyped_storage().data_ptr())
    if (same_storage and key_cache.numel() and key_cache.stride() == value_cache.stride()
            and key_cache.shape == value_cache.shape):
        distance = value_cache.data_ptr() - key_cache.data_ptr()
        if distance % key_cache.element_size() == 0:
            views.append([*views[0], (abs(distance) // key_cache.element_size(), 2)])
    for dims in views:
        span = 1
        for stride, size in sorted(dims):
            if stride < span:
                raise ValueError(
                    f"key_cache/value_cache views overlap (shape {tuple(key_cache.shape)}, "
                    f"strides {key_cache.stride()} / {value_cache.stride()}): two blocks, or a "
                    "block's K and V, share memory, so a write to one would change the other; "
                    "allocate the caches with kvcore.allocate_kv_caches"
                )
            span = stride * (size - 1) + span


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """``ValueError`` unless ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} (supported: {', '.join(KV_CACHE_DTYPES)})"
        )


def _check_cache_dtype(
    name: str, cache: torch.Tensor, kv_cache_dtype: str, model_dtype: torch.dtype
) -> None:
    expected = cache_torch_dtype(kv_cache_dtype, model_dtype)
    if cache.dtype != expected:
        raise TypeError(
            f"{name} has dtype {cache.dtype} but kv_cache_dtype={kv_cache_dtype!r} with model "
            f"dtype {model_dtype} needs {expected}"
        )


def check_step_block_size(block_size: int, *tensors: torch.Tensor) -> None:
    """``ValueError`` if ``tensors`` carry step facts (:func:`mark_step_checked`) established
    for a block size other than the cache's ``block_size``: their slots and block-table
    columns count tokens of that other size, so every address would be wrong. A host compare
    (no device read), done whether or not value checks are on."""
    _check_facts_block_size(checked_step_facts(*tensors), block_size)


def _check_facts_block_size(facts: StepFacts | None, block_size: int) -> None:
    if facts is not None and facts.block_size != block_size:
        raise ValueError(
            f"the step's metadata was built for block_size={facts.block_size} but the cache "
            f"has block_size={block_size}: its slots and block-table columns would address "
            "other tokens. Build the step with the block size of the cache it runs on (one "
            "metadata per KV cache group)")


def check_slots_in_range(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot of ``slot_mapping`` below ``num_blocks * block_size`` (a value check: see
    :func:`set_value_checks`). A ``slot_mapping`` marked with its step's facts
    (:func:`mark_step_checked`) is not read: its largest slot is in the facts."""
    if not _value_checks or slot_mapping.numel() == 0:
        return
    facts = checked_step_facts(slot_mapping)
    hi = facts.max_slot if facts is not None else int(slot_mapping.max())
    if hi >= num_blocks * block_size:
        raise _slot_range_error(hi, num_blocks, block_size)


def _repeated_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """How many entries repeat an earlier non-negative slot, as a 0-dim device tensor (no
    sync): padding slots are made distinct, the rest sorted and neighbours compared."""
    slots = slot_mapping.to(torch.int64)
    pad = -1 - torch.arange(slots.numel(), device=slots.device)
    ordered = torch.where(slots >= 0, slots, pad).sort().values
    return (ordered[1:] == ordered[:-1]).sum()


def check_distinct_slots(slot_mapping: torch.Tensor) -> None:
    """No slot written twice in one call (a value check: see :func:`set_value_checks`): which
    of two tokens for one slot lands depends on the kernel's schedule. A ``slot_mapping``
    marked with its step's facts was checked once for the step (:func:`step_facts_from_tensors`,
    :func:`kvcore.build_attention_metadata`) and is not read again."""
    if not _value_checks or slot_mapping.numel() < 2 or checked_step_facts(slot_mapping):
        return
    slots = slot_mapping[slot_mapping >= 0]
    unique = torch.unique(slots)
    if unique.numel() != slots.numel():
        values, counts = torch.unique(slots, return_counts=True)
        repeated = values[counts > 1][:8].tolist()
        raise ValueError(
            f"slot_mapping writes slots {repeated} more than once in one call; every new "
            "token needs its own slot (padding uses negative slots)"
        )


def check_block_indices(name: str, indices: torch.Tensor, num_blocks: int) -> None:
    """Check that every (non-negative) entry of ``indices`` is a block id below ``num_blocks``."""
    if not _value_checks or indices.numel() == 0:
        return
    hi = int(indices.max())
    if hi >= num_blocks:
        raise ValueError(
            f"{name} contains block id {hi}, but the cache has only {num_blocks} blocks "
            f"(valid ids: 0..{num_blocks - 1})"
        )


def _check_lengths(qsl: list[int], lens: list[int], num_tokens: int, block_size: int,
                   max_blocks: int) -> None:
    """The host-side length rules of :func:`validate_paged_attention` (lists of the tensors)."""
    if qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens={num_tokens}, got "
            f"{qsl[0]}..{qsl[-1]}"
        )
    for i in range(len(lens)):
        q_len = qsl[i + 1] - qsl[i]
        if q_len < 0:
            raise ValueError(f"query_start_loc decreases at sequence {i}: {qsl[i]} -> {qsl[i + 1]}")
        if lens[i] < q_len:
            raise ValueError(
                f"seq_lens[{i}]={lens[i]} is shorter than its {q_len} query tokens "
                "(seq_lens counts cached plus new tokens)"
            )
        if -(-lens[i] // block_size) > max_blocks:
            raise ValueError(
                f"seq_lens[{i}]={lens[i]} needs {-(-lens[i] // block_size)} blocks of "
                f"{block_size} but block_table has only {max_blocks} columns"
            )


def _block_range_error(bad: int, num_blocks: int) -> ValueError:
    return ValueError(
        f"block_table refers to block id {bad}, but the cache has {num_blocks} blocks "
        f"(valid ids: 0..{num_blocks - 1})"
    )


def _slot_range_error(hi: int, num_blocks: int, block_size: int) -> ValueError:
    return ValueError(
        f"slot_mapping contains slot {hi}, but the cache holds only "
        f"{num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} slots"
    )


def _check_window(sliding_window: object) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be None (full attention) or "
                         "an int >= 1 (how many positions each query sees, itself included)")


def step_facts_from_tensors(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    *,
    mark: bool = True,
    sliding_window: int | None = None,
) -> StepFacts:
    """Check one step's metadata tensors with one device read and return their facts.

    The reductions run on the tensors' device and come back in one transfer (one sync per
    step, instead of one per op and layer); only a failing step is read again, for the
    detailed message. With ``mark`` the tensors are then marked (:func:`mark_step_checked`).

    ``sliding_window`` is the window of the layers the step serves (``None``: full
    attention): context outside every query's window may then be overwritten (a ring
    buffer's decode), and the facts record the window (:attr:`StepFacts.sliding_window`).
    Layers of different windows need the check once per distinct window (one builder per
    window, each with its spec's ``sliding_window``) or once with the widest (``None`` if one
    is full attention).

    Raises:
        ValueError: a length rule of :class:`StepFacts` is broken (naming the request), a
            used block id is negative, two new tokens share a slot, a new token is written
            to a slot a request of the step reads as context that one of its queries can see
            (:func:`context_overwrites`), or ``sliding_window`` is not None or an int >= 1.
    """
    _check_window(sliding_window)
    for n, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                 ("block_table", block_table), ("slot_mapping", slot_mapping)):
        require_tensor(n, t)
        require_int_dtype(n, t)
    require_ndim("query_start_loc", query_start_loc, 1, "(num_seqs + 1,)")
    require_ndim("seq_lens", seq_lens, 1, "(num_seqs,)")
    require_ndim("block_table", block_table, 2, "(num_seqs, max_blocks_per_seq)")
    require_ndim("slot_mapping", slot_mapping, 1, "(num_tokens,)")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries and block_table "
            f"{block_table.shape[0]} rows for {num_seqs} sequences (expected {num_seqs + 1} "
            f"and {num_seqs})"
        )
    width = block_table.shape[1]
    qsl = query_start_loc.to(torch.int64)
    minus_one = torch.full((1,), -1, dtype=torch.int64, device=slot_mapping.device)
    slot_max = torch.cat([minus_one, slot_mapping.to(torch.int64)]).max().reshape(1)
    repeats = _repeated_slots(slot_mapping)
    if num_seqs and width:
        q_lens = qsl[1:] - qsl[:-1]
        lens = seq_lens.to(torch.int64)
        needed = (lens + block_size - 1) // block_size
        used = torch.arange(width, device=block_table.device)[None, :] < needed[:, None]
        ids = block_table.to(torch.int64)
        big = torch.iinfo(torch.int64).max
        ctx_lens = lens - q_lens
        overwrites = context_overwrites(slot_mapping, ctx_lens, block_table, block_size,
                                        sliding_window=sliding_window)
        stats = torch.stack([
            qsl[0], qsl[-1], q_lens.min(), ctx_lens.min(), needed.max(),
            torch.where(used, ids, big).min(), torch.where(used, ids, -1).max(), slot_max[0],
            repeats, overwrites.sum(),
        ]).tolist()
        first, last, min_q, min_ctx, most, lo, hi, top_slot, repeated, overwritten = stats
    else:  # no requests, or no block-table columns (only empty requests fit): read them
        qsl_list = query_start_loc.tolist()
        first, last = qsl_list[0], qsl_list[-1]
        _check_lengths(qsl_list, seq_lens.tolist(), last, block_size, width)
        min_q = min_ctx = most = lo = overwritten = 0
        hi, top_slot, repeated = -1, int(slot_max), int(repeats)
    if first != 0 or min_q < 0 or min_ctx < 0 or most > width:  # read again, name the request
        _check_lengths(query_start_loc.tolist(), seq_lens.tolist(), last, block_size, width)
    if most > 0 and lo < 0:
        raise ValueError(f"block_table refers to block id {lo}; the block ids a request uses "
                         "must be >= 0")
    if repeated:
        check_distinct_slots(slot_mapping)  # read again for the message
    if overwritten:
        raise context_overwrite_error(slot_mapping, query_start_loc, ctx_lens, block_table,
                                      block_size, overwrites, sliding_window=sliding_window)
    facts = StepFacts(num_tokens=last, num_seqs=num_seqs, block_size=block_size,
                      max_blocks_per_seq=most, max_block_id=hi, max_slot=top_slot,
                      sliding_window=sliding_window)
    if mark:
        mark_step_checked(facts, query_start_loc=query_start_loc, seq_lens=seq_lens,
                          block_table=block_table, slot_mapping=slot_mapping)
    return facts


def validate_reshape_and_cache(key: torch.Tensor, value: torch.Tensor,
                               key_cache: torch.Tensor, value_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                               k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """Validate the arguments of :func:`kvcore.ops.reshape_and_cache` (every cache write that
    takes its arguments calls this, so a bad one gets the same message everywhere):
    :func:`check_reshape_and_cache_args`, then :func:`check_reshape_and_cache_values`."""
    check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping,
                                 kv_cache_dtype, k_scale, v_scale)
    check_reshape_and_cache_values(key_cache, slot_mapping)


def check_reshape_and_cache_args(key: torch.Tensor, value: torch.Tensor,
                                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                                 k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """The checks of :func:`validate_reshape_and_cache` that the tensors' types, shapes,
    strides, dtypes, devices and addresses decide, with the scales' (see :func:`check_scale`):
    a fast path that has passed them for one such signature repeats only
    :func:`check_scale` on tensor scales and :func:`check_reshape_and_cache_values`."""
    for n, t in (("key", key), ("value", value), ("key_cache", key_cache),
                 ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        require_tensor(n, t)
    require_ndim("key", key, 3, "(num_tokens, num_kv_heads, head_size)")
    require_ndim("value", value, 3, "(num_tokens, num_kv_heads, head_size)")
    require_ndim("key_cache", key_cache, 4, _CACHE_DIMS)
    require_ndim("value_cache", value_cache, 4, _CACHE_DIMS)
    require_ndim("slot_mapping", slot_mapping, 1, "(num_tokens,)")
    require_int_dtype("slot_mapping", slot_mapping)
    require_same_device([("key", key), ("value", value), ("key_cache", key_cache),
                          ("value_cache", value_cache), ("slot_mapping", slot_mapping)])
    if value.shape != key.shape:
        raise ValueError(f"value has shape {tuple(value.shape)} but key has {tuple(key.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
            f"{tuple(key_cache.shape)}"
        )
    if key.dtype != value.dtype:
        raise TypeError(f"value has dtype {value.dtype} but key has {key.dtype}")
    check_kv_cache_dtype(kv_cache_dtype)
    _check_cache_dtype("key_cache", key_cache, kv_cache_dtype, key.dtype)
    _check_cache_dtype("value_cache", value_cache, kv_cache_dtype, key.dtype)
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    check_scale("k_scale", k_scale, used=fp8)
    check_scale("v_scale", v_scale, used=fp8)
    check_distinct_pages(key_cache, value_cache)
    num_kv_heads, head_size = key_cache.shape[2:]
    if key.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(
            f"key has (num_kv_heads, head_size)={tuple(key.shape[1:])} but the cache holds "
            f"{(num_kv_heads, head_size)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens"
        )


def check_reshape_and_cache_values(key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The checks of :func:`validate_reshape_and_cache` on ``slot_mapping``'s values: the
    step's block size, slots in range, no slot twice (from the step's facts when it carries
    them, else read; see :func:`set_value_checks`)."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    facts = checked_step_facts(slot_mapping)
    if facts is None:
        check_slots_in_range(slot_mapping, num_blocks, block_size)
        check_distinct_slots(slot_mapping)
        return
    # The marked step (one look-up instead of one per check): its block size, its largest
    # slot; its slots were checked distinct when it was marked.
    _check_facts_block_size(facts, block_size)
    if _value_checks and slot_mapping.numel() and facts.max_slot >= num_blocks * block_size:
        raise _slot_range_error(facts.max_slot, num_blocks, block_size)


def validate_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    sliding_window: int | None = None,
    output: torch.Tensor | None = None,
    scale: float | None = None,
    k_scale: KVScale = None,
    v_scale: KVScale = None,
) -> None:
    """Validate the arguments of :func:`kvcore.ops.paged_attention` (``scale``, the softmax
    scale, is checked when given; every kvcore path gives it):
    :func:`check_paged_attention_args`, then :func:`check_paged_attention_values`."""
    check_paged_attention_args(query, key_cache, value_cache, query_start_loc, seq_lens,
                               block_table, kv_cache_dtype=kv_cache_dtype,
                               sliding_window=sliding_window, output=output, scale=scale,
                               k_scale=k_scale, v_scale=v_scale)
    check_paged_attention_values(query, key_cache, query_start_loc, seq_lens, block_table)


def check_paged_attention_args(query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, query_start_loc: torch.Tensor,
                               seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                               kv_cache_dtype: str = "auto", sliding_window: int | None = None,
                               output: torch.Tensor | None = None, scale: float | None = None,
                               k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """The checks of :func:`validate_paged_attention` that the tensors' types, shapes,
    strides, dtypes, devices and addresses decide, with the scalar arguments' and the
    scales' (see :func:`check_scale`): a fast path that has passed them for one such
    signature repeats only :func:`check_scale` on tensor scales and
    :func:`check_paged_attention_values`."""
    for n, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                 ("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                 ("block_table", block_table)):
        require_tensor(n, t)
    require_ndim("query", query, 3, "(num_tokens, num_heads, head_size)")
    require_ndim("key_cache", key_cache, 4, _CACHE_DIMS)
    require_ndim("value_cache", value_cache, 4, _CACHE_DIMS)
    check_step_tensor_layout(query_start_loc, seq_lens, block_table)
    require_same_device([("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                          ("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                          ("block_table", block_table)])
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
            f"{tuple(key_cache.shape)}"
        )
    check_kv_cache_dtype(kv_cache_dtype)
    _check_cache_dtype("key_cache", key_cache, kv_cache_dtype, query.dtype)
    _check_cache_dtype("value_cache", value_cache, kv_cache_dtype, query.dtype)
    if scale is not None:
        check_softmax_scale(scale)
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    check_scale("k_scale", k_scale, used=fp8)
    check_scale("v_scale", v_scale, used=fp8)
    check_distinct_pages(key_cache, value_cache)
    num_kv_heads, head_size = key_cache.shape[2:]
    num_heads, q_head_size = query.shape[1:]
    if q_head_size != head_size:
        raise ValueError(f"query has head_size {q_head_size} but the cache has {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads, which is not a multiple of the cache's "
            f"{num_kv_heads} KV heads (GQA needs num_heads % num_kv_heads == 0)"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries but seq_lens has "
            f"{num_seqs} sequences (expected num_seqs + 1 = {num_seqs + 1})"
        )
    if block_table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows but seq_lens has {num_seqs} sequences"
        )
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1 "
                         "(how many positions each query sees, itself included)")
    if output is not None:
        require_tensor("output", output)
        if output.shape != query.shape:
            raise ValueError(
                f"output has shape {tuple(output.shape)} but query has {tuple(query.shape)}"
            )
        if output.device != query.device:
            raise ValueError(f"output is on {output.device} but query is on {query.device}")
        require_float_dtype("output", output)


def check_paged_attention_values(query: torch.Tensor, key_cache: torch.Tensor,
                                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                 block_table: torch.Tensor) -> None:
    """The checks of :func:`validate_paged_attention` on the metadata's values: the step's
    block size, lengths consistent and block ids in the cache (from the step's facts when the
    tensors carry them, else read; see :func:`set_value_checks`)."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    facts = checked_step_facts(query_start_loc, seq_lens, block_table)
    _check_facts_block_size(facts, block_size)
    num_seqs = seq_lens.shape[0]
    if not _value_checks or num_seqs == 0:
        return
    num_tokens = query.shape[0]
    max_blocks = block_table.shape[1]
    if facts is not None and (facts.num_tokens, facts.num_seqs, facts.block_size) == (
            num_tokens, num_seqs, block_size):
        # Checked once for the step (see the module docstring); compare with this cache.
        if facts.max_blocks_per_seq > max_blocks:
            raise ValueError(f"a request of the step uses {facts.max_blocks_per_seq} blocks "
                             f"but block_table has only {max_blocks} columns")
        if facts.max_block_id >= num_blocks:
            raise _block_range_error(facts.max_block_id, num_blocks)
        return
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check_lengths(qsl, lens, num_tokens, block_size, max_blocks)
    used = [block_table[i, : -(-lens[i] // block_size)] for i in range(num_seqs)]
    ids = torch.cat(used) if used else block_table.new_empty(0)
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise _block_range_error(lo if lo < 0 else hi, num_blocks)
