"""Split-KV: one attention's key range cut into parts that run as separate programs, then
merged. Shared by every kernel that writes partial outputs and their log-sum-exps (TRITON_ATTN's
decode kernel here, plugin kernels such as TRITON_MLA's).

A split kernel writes, for each (token, query head, split), the split's *normalised* partial
output (``acc / l`` over its keys) and its log-sum-exp **in base 2** (``m + log2(l)``, with
scores already scaled by ``softmax_scale * LOG2E``; ``-inf`` for a split that saw no key).
:func:`merge_kv_splits` reduces them into the output, weighting each split by
``2 ** (lse - max lse)``, and can also write the natural-log log-sum-exp of the whole row.

The split count: :func:`kv_split_count` is the rule (split a launch of too few programs until
it has about ``target_programs``, never below ``min_split_tokens`` keys a split), which
:func:`default_num_kv_splits` applies to TRITON_ATTN with the GPU's decode row
(:data:`kvcore.ops.attention_config.DECODE_TILES`; on an fp8 cache a row that says how many
programs an SM holds uses :func:`round_filling_split_count`: whole rounds of them).
Both depend only on their arguments, so a builder that passes a fixed length bound
(``max_model_len``) and its cache dtype gets a choice that is stable for a batch size
(CUDA-graph replays).

This module imports no kernel library; :func:`merge_kv_splits` imports triton on first call.
"""

from __future__ import annotations

import functools

import torch

from kvcore.dtypes import FP8_KV_CACHE_DTYPES
from kvcore.ops.attention_config import (
    WIDE_GROUP,
    decode_tile,
    device_arch,
    is_rocm,
    next_power_of_2,
)

__all__ = ["LN2", "LOG2E", "MAX_KV_SPLITS", "default_num_kv_splits", "kv_split_count",
           "merge_kv_splits", "num_sms", "round_filling_split_count", "workspace_numel"]

#: ``log2(e)``: kernels score with ``exp2``, so the softmax scale is multiplied by it.
LOG2E = 1.4426950408889634
#: ``ln(2)``: a base-2 log-sum-exp times it is the natural-log one.
LN2 = 0.6931471805599453
#: Most KV splits one launch may use.
MAX_KV_SPLITS = 64


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of ``device``; 1 for a non-GPU device."""
    return _num_sms(device.type, device.index)


@functools.cache
def _num_sms(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 1
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()).multi_processor_count


def kv_split_count(programs: int, max_seq_len: int, *, target_programs: int,
                   min_split_tokens: int, round_up: bool = False,
                   max_splits: int = MAX_KV_SPLITS) -> int:
    """Splits for a launch of ``programs`` programs (1 split each) over requests of at most
    ``max_seq_len`` keys: 1 when ``programs`` is 0 or already ``>= target_programs``, else
    ``target_programs / programs`` (rounded down, or up with ``round_up``), at most one split
    per ``min_split_tokens`` keys of ``max_seq_len`` and at most ``max_splits``."""
    if programs <= 0 or programs >= target_programs:
        return 1
    per = -(-target_programs // programs) if round_up else target_programs // programs
    by_length = max(1, max_seq_len // min_split_tokens)
    return max(1, min(per, by_length, max_splits))


def round_filling_split_count(programs: int, max_seq_len: int, *, capacity: int,
                              min_split_tokens: int, max_splits: int = MAX_KV_SPLITS) -> int:
    """Splits for a launch of ``programs`` programs (1 split each) when ``capacity`` programs
    run at once and each is paced by its own latency (an fp8 decode program: half the bytes
    of a bf16 one, the dequantisation on its path), so a launch takes about ``rounds / s``
    of the unsplit time, ``rounds = ceil(programs * s / capacity)``: the ``s`` that
    minimises it (the fewest splits on a tie), up to two rounds, at most one split per
    ``min_split_tokens`` keys of ``max_seq_len`` and at most ``max_splits``.

    One round is the aim (what :func:`kv_split_count` gives), but where it is far from full
    two full rounds beat it: 256 programs of 396 run at 65% in one round, and 3 splits (768
    programs, two rounds of 396 and 372) take two thirds of the time; 2 splits (512 programs)
    would run a second, nearly empty round for nothing. 1 when ``programs`` is 0 or at least
    ``capacity``."""
    if programs <= 0 or programs >= capacity:
        return 1
    limit = min(max(1, max_seq_len // min_split_tokens), max_splits, 2 * capacity // programs)
    return min(range(1, limit + 1),
               key=lambda s: (-(-programs * s // capacity) / s, s))


def default_num_kv_splits(num_tokens: int, num_seqs: int, num_kv_heads: int,
                          max_seq_len_bound: int, device: torch.device, *,
                          num_sms: int | None = None, arch: str | None = None,
                          rocm: bool | None = None, kv_cache_dtype: str = "auto",
                          head_size: int = 0, group_size: int = 1) -> int:
    """TRITON_ATTN's split count: 1 unless the batch is decode-only (``num_tokens ==
    num_seqs``) and its ``num_seqs * num_kv_heads`` programs are fewer than ``split_waves``
    per SM; then :func:`kv_split_count` with ``split_waves * num_sms`` programs as the target
    and the row's ``min_split_tokens``; for an fp8 ``kv_cache_dtype`` whose tile sets
    ``fp8_split_waves`` (the ``fp8_wide`` or ``fp8_narrow`` tile's for ``head_size``, else the
    row's), :func:`round_filling_split_count` with ``fp8_split_waves * num_sms`` programs at
    once; on a 16-bit cache with ``group_size`` (query heads per KV head, padded to a power
    of two as the kernel's tile holds them) of at least
    :data:`~kvcore.ops.attention_config.WIDE_GROUP`, the row's ``wide_group_split_waves``
    where it sets it. The waves and tokens per split come from the
    :func:`~kvcore.ops.attention_config.decode_tile` of ``arch`` (default:
    :func:`~kvcore.ops.attention_config.device_arch`); ``num_sms`` defaults to ``device``'s
    SM count; ``max_seq_len_bound`` bounds every request's length; ``kv_cache_dtype`` is the
    cache's (``"auto"``: the model's dtype)."""
    rule = decode_tile(arch or device_arch(device), is_rocm(rocm))
    if num_tokens != num_seqs:
        return 1
    sms = num_sms if num_sms is not None else _num_sms(device.type, device.index)
    programs = num_seqs * num_kv_heads
    if programs >= rule.split_waves * sms:
        return 1
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        # The programs an SM holds at once depend on the tile: a head-size tile may say.
        tile = decode_tile(arch or device_arch(device), is_rocm(rocm), head_size=head_size,
                           kv_cache_dtype=kv_cache_dtype)
        waves = tile.fp8_split_waves or rule.fp8_split_waves
        if waves:
            return round_filling_split_count(programs, max_seq_len_bound, capacity=waves * sms,
                                             min_split_tokens=rule.min_split_tokens)
    waves = rule.split_waves
    # The kernel's tile holds the group padded to a power of two (Qwen2.5's 7 as 8).
    if next_power_of_2(group_size) >= WIDE_GROUP and rule.wide_group_split_waves:
        waves = rule.wide_group_split_waves
    return kv_split_count(programs, max_seq_len_bound, target_programs=waves * sms,
                          min_split_tokens=rule.min_split_tokens)


def workspace_numel(num_tokens: int, num_heads: int, head_size: int,
                    num_kv_splits: int) -> tuple[int, int]:
    """Elements of the two float32 split-KV workspaces TRITON_ATTN's split launch needs:
    partial outputs ``(num_tokens, num_heads, num_kv_splits, head_size)`` and their
    log-sum-exps ``(num_tokens, num_heads, num_kv_splits)`` (0 without splits)."""
    if num_kv_splits <= 1:
        return 0, 0
    lse = num_tokens * num_heads * num_kv_splits
    return lse * head_size, lse


def merge_kv_splits(partials: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Merge split-KV partial results into ``out``, in place (Triton; CPU tensors need
    ``TRITON_INTERPRET=1``).

    Args:
        partials: ``(num_tokens, num_heads, num_splits, v_dim)``, any strides; float32 or the
            output's 16-bit dtype: each split's normalised output.
        partial_lse: ``(num_tokens, num_heads, num_splits)`` float32, any strides: each
            split's base-2 log-sum-exp (``-inf``: the split saw no key).
        out: ``(num_tokens, num_heads, v_dim)``, any strides: the merged output (0 for a row
            no split saw a key of).
        lse: optional ``(num_tokens, num_heads)``, any strides: the row's natural-log
            log-sum-exp (``-inf`` for a row without keys).
        sinks: optional ``(num_heads,)`` contiguous floating tensor: each head's sink logit
            (natural log) joins every row's denominator once (attention sinks; the splits
            must not have applied it); ``lse`` then includes it.

    One program per (token, head); the sums run in float32. ``num_splits`` is a compile-time
    constant of the kernel (at most :data:`MAX_KV_SPLITS`). Returns ``out``.
    """
    num_tokens, num_heads, num_splits, v_dim = partials.shape
    if (tuple(partial_lse.shape) != (num_tokens, num_heads, num_splits)
            or tuple(out.shape) != (num_tokens, num_heads, v_dim)
            or (lse is not None and tuple(lse.shape) != (num_tokens, num_heads))):
        raise ValueError(
            f"merge_kv_splits got partials {tuple(partials.shape)}, partial_lse "
            f"{tuple(partial_lse.shape)}, out {tuple(out.shape)} and lse "
            f"{None if lse is None else tuple(lse.shape)}; expected (T, H, S, D), (T, H, S), "
            "(T, H, D) and (T, H) or None")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_heads
                              or not sinks.is_floating_point() or sinks.stride(0) != 1):
        raise ValueError(f"merge_kv_splits got sinks of shape {tuple(sinks.shape)}, dtype "
                         f"{sinks.dtype} and strides {sinks.stride()}; expected a contiguous "
                         f"floating ({num_heads},) tensor (one sink logit per head) or None")
    if not 1 <= num_splits <= MAX_KV_SPLITS:
        raise ValueError(f"partials has {num_splits} splits; merge_kv_splits takes 1 to "
                         f"{MAX_KV_SPLITS}")
    from kvcore.ops.triton_merge import launch_merge

    launch_merge(partials, partial_lse, out, lse, sinks)
    return out
