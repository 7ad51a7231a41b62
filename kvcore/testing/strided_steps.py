"""Rule ``strided-step-tensors``: a step's index tensors as views of larger engine buffers.

Engines keep persistent input buffers and hand kvcore views of them (vLLM's slot mapping and
block table are slices of buffers sized for the largest step). A view need not be dense: a
column of a ``(tokens, 2)`` buffer has stride 2. A kernel that indexes such a tensor as if it
were dense reads the neighbouring values instead, writes K/V into other requests' slots and
attends over the wrong lengths, with no error. This check hands every step tensor to the
backend as a view with stride 2 whose gaps hold other plausible values (the padding slot -1,
zero lengths, the id of a block no request owns), so a dense read shows as a wrong cache or
a wrong output, never as an out-of-bounds access.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcore.metadata import AttentionMetadata
from kvcore.testing.batch import CaseConfig, MixedBatch
from kvcore.testing.builder_checks import make_builder
from kvcore.testing.runs import bits, case_run

__all__ = ["check_strided_step_tensors", "strided_view", "unowned_block"]

RULE = "strided-step-tensors"


def strided_view(values: torch.Tensor, gap: int | float) -> torch.Tensor:
    """``values`` as a view with its last dim at stride 2 of a buffer twice as wide whose
    other elements are ``gap``: equal values, other memory layout (``values`` 1-D or 2-D)."""
    wide = values.new_full((*values.shape[:-1], 2 * values.shape[-1]), gap)
    view = wide[..., ::2]
    view.copy_(values)
    return view


def unowned_block(batch: MixedBatch) -> int:
    """A block id in the cache that no request of ``batch`` uses (the largest such)."""
    used = {int(b) for table in batch.block_tables for b in table}
    free = [b for b in range(batch.num_blocks) if b not in used]
    if not free:
        raise ValueError(f"the batch uses all {batch.num_blocks} blocks; the check needs one "
                         "it does not own to point the gaps at")
    return free[-1]


def _strided_metadata(meta: AttentionMetadata, free_block: int) -> AttentionMetadata:
    """``meta`` with its device step tensors replaced by stride-2 views of equal values.

    The gaps hold values that stay inside the cache and the batch if a kernel reads them:
    the padding slot -1 (a dense read writes tokens into their neighbours' slots and skips
    others), zero lengths, and the id of a block no request owns.
    """
    return dataclasses.replace(
        meta,
        slot_mapping=strided_view(meta.slot_mapping, -1),
        query_start_loc=strided_view(meta.query_start_loc, 0),
        seq_lens=strided_view(meta.seq_lens, 0),
        block_table=strided_view(meta.block_table, free_block),
    )


def _first_difference(got: torch.Tensor, dense: torch.Tensor) -> str | None:
    """Where ``got`` differs bit for bit from ``dense`` (None where it does not)."""
    same = bits(got) == bits(dense)
    if bool(same.all()):
        return None
    where = tuple(int(i) for i in (~same).nonzero()[0])
    return (f"{int((~same).sum())} of {same.numel()} elements differ from the dense tensors' "
            f"result; first at index {where}: {got[where].item():.6g} instead of "
            f"{dense[where].item():.6g}")


def check_strided_step_tensors(backend: type, config: CaseConfig, device: torch.device,
                               seed: int) -> None:
    """Rule ``strided-step-tensors``: the mixed batch written and attended with every step
    tensor a stride-2 view gives bit for bit the cache and output of the same calls on the
    dense tensors, with the plain metadata and through the backend's builder. The comparison
    is with the backend itself, not the reference: this rule is about reading the step, and
    ``cache-write-reference`` / ``forward-reference`` hold the numbers to the reference."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    _, layer, scales, impl = run.setup_layer(batch.num_blocks)
    strided = dataclasses.replace(
        batch, metadata=_strided_metadata(batch.metadata, unowned_block(batch)))
    before = layer.clone()
    run.write(impl, scales, batch, layer)
    dense_layer = layer.clone()
    layer.copy_(before)
    run.write(impl, scales, strided, layer)
    diff = _first_difference(layer, dense_layer)
    if diff:
        raise run.fail(RULE, "do_kv_cache_update with slot_mapping a view at stride 2 (the "
                             f"padding slot -1 between its values), in the cache: {diff}")
    n = batch.num_tokens
    dense = run.forward(impl, scales, batch, layer, None)[:n]
    diff = _first_difference(run.forward(impl, scales, strided, layer, None)[:n], dense)
    if diff:
        raise run.fail(RULE, "forward with query_start_loc, seq_lens and block_table views at "
                             f"stride 2 (other values between theirs): {diff}")
    builder = make_builder(run, max_model_len=8 * config.block_size)

    def built_forward(step: MixedBatch) -> torch.Tensor:
        meta = builder.build(step.metadata)
        return impl.forward(scales, step.query, step.key, step.value, layer, meta)[:n]

    try:
        dense = built_forward(batch)
    except Exception:  # a builder failing on dense tensors is builder-reference's finding
        return
    try:
        got = built_forward(strided)
    except Exception as exc:
        raise run.fail(RULE, "builder.build() and forward with step tensors that are views at "
                             f"stride 2 raised {type(exc).__name__}: {exc} (with the dense "
                             "tensors they ran)") from exc
    diff = _first_difference(got, dense)
    if diff:
        raise run.fail(RULE, "forward with builder.build()'s metadata for step tensors that "
                             f"are views at stride 2: {diff}")
