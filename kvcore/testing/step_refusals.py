"""Rule ``overlapping-new-tokens-refused``: a step whose new tokens overwrite what it reads.

A step writes its new tokens' K/V into the cache before attention reads it. A new token given
a slot that a request of the same step reads as context (a block of its cached prefix, its own
or another request's) replaces that context token, and two new tokens given one slot race:
either way attention silently reads the wrong key. kvcore's own checks refuse such a step once
per step (:func:`kvcore.build_attention_metadata` on its lists, a builder's ``check`` on
engine-made tensors); a backend's builder must keep that check, so this hands it engine-made
(unmarked) tensors of such steps and expects a ``ValueError`` from ``build()``.
"""

from __future__ import annotations

import torch

from kvcore.builder import AttentionMetadataBuilder
from kvcore.metadata import AttentionMetadata
from kvcore.ops.validation import set_value_checks, value_checks_enabled
from kvcore.testing.batch import CaseConfig
from kvcore.testing.builder_checks import make_builder
from kvcore.testing.runs import case_run

__all__ = ["check_overlapping_new_tokens_refused"]

RULE = "overlapping-new-tokens-refused"


def _decode_step(block_size: int, slots: list[int], device: torch.device) -> AttentionMetadata:
    """Two decode requests, each with one full block cached: request 0 over blocks 1 and 2,
    request 1 over blocks 3 and 4; their new tokens at ``slots`` (right: the first slots of
    blocks 2 and 4). Fresh tensors, as an engine makes them (not marked as checked)."""
    bs = block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([bs + 1, bs + 1], dtype=torch.int32, device=device),
        block_table=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=1, max_seq_len=bs + 1, num_actual_tokens=2)


def _build(builder: AttentionMetadataBuilder, meta: AttentionMetadata) -> Exception | None:
    try:
        builder.build(meta)
    except Exception as exc:
        return exc
    return None


def check_overlapping_new_tokens_refused(backend: type, config: CaseConfig,
                                         device: torch.device, seed: int) -> None:
    """The builder accepts a well-formed decode step and refuses, with ``ValueError``, the
    same step with request 1's new token in request 0's cached block, and with both new
    tokens in one slot (value checks on, as they are by default)."""
    run = case_run(backend, config, device, seed)
    bs = config.block_size
    builder = make_builder(run, max_model_len=8 * bs)
    was_on = value_checks_enabled()
    set_value_checks(True)
    try:
        error = _build(builder, _decode_step(bs, [2 * bs, 4 * bs], device))
        if error is not None:
            raise run.fail("builder-reference", (
                f"builder.build() refused a well-formed decode step (new tokens in slots "
                f"{2 * bs} and {4 * bs}): {type(error).__name__}: {error}"))
        for what, slots in (
                (f"request 1's new token is written to slot {bs}, the first token of request "
                 "0's cached block 1", [2 * bs, bs]),
                (f"both new tokens are written to slot {2 * bs}", [2 * bs, 2 * bs])):
            error = _build(builder, _decode_step(bs, slots, device))
            if error is None:
                raise run.fail(RULE, (
                    f"builder.build() accepted a step where {what}; the write would replace "
                    "a key attention reads in the same step. Keep the value checks of "
                    "AttentionMetadataBuilder.check (call super().build(common) or "
                    "self.check(common) first)"))
            if not isinstance(error, ValueError):
                raise run.fail(RULE, (
                    f"builder.build() raised {type(error).__name__} for a step where {what}; "
                    f"it must raise ValueError with a sentence saying so: {error}"))
    finally:
        set_value_checks(was_on)
