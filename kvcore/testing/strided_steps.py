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

from kvcore.backend import AttentionMetadata
from kvcore.testing.batch import CaseConfig, MixedBatch
from kvcore.testing.checks import (
    _cache_diff,
    _make_builder,
    _run,
    _step_through,
    tolerance_for,
)

__all__ = ["check_strided_step_tensors", "strided_view"]

RULE = "strided-step-tensors"


def strided_view(values: torch.Tensor, gap: int | float) -> torch.Tensor:
    """``values`` as a view with its last dim at stride 2 of a buffer twice as wide whose
    other elements are ``gap``: equal values, other memory layout (``values`` 1-D or 2-D)."""
    wide = values.new_full((*values.shape[:-1], 2 * values.shape[-1]), gap)
    view = wide[..., ::2]
    view.copy_(values)
    return view


def _unowned_block(batch: MixedBatch) -> int:
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


def check_strided_step_tensors(backend: type, config: CaseConfig, device: torch.device,
                               seed: int) -> None:
    """Rule ``strided-step-tensors``: write and attend the mixed batch with every step tensor
    a stride-2 view; the cache must equal the reference write bit for bit, and the output the
    float64 reference, with the plain metadata and through the backend's builder."""
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    bs = config.block_size
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    meta = _strided_metadata(batch.metadata, _unowned_block(batch))
    expected = layer.clone()
    run.reference_write(batch, expected, caches.layout, scales, batch.metadata.slot_mapping)
    run.call("do_kv_cache_update", impl.do_kv_cache_update, scales, batch.key, batch.value,
             layer, meta.slot_mapping)
    tol = tolerance_for(backend, config.kv_cache_dtype)[0] if config.is_fp8 else None
    diff = _cache_diff(layer, expected, caches.layout, batch, bs, tol)
    if diff:
        raise run.fail(RULE, "do_kv_cache_update with slot_mapping a view at stride 2 (other "
                             f"slots between its values): {diff}")
    strided = dataclasses.replace(batch, metadata=meta)
    n = batch.num_tokens
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    out = run.forward(impl, scales, strided, layer, None)
    diff = run.output_diff(out[:n], ref, batch)
    if diff:
        raise run.fail(RULE, "forward with query_start_loc, seq_lens and block_table views at "
                             f"stride 2 (other values between theirs): {diff}")
    builder = _make_builder(run, max_model_len=8 * bs)
    built = run.call("builder.build", builder.build, meta)
    _step_through(run, impl, scales, strided, layer, caches, built,
                  "step tensors that are views at stride 2", RULE)
