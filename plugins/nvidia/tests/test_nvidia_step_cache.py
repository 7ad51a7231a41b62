"""``StepCache``: one per-step preparation shared by the layers of a step, rebuilt when the
metadata changes, with ordinary tensors and with inference tensors (no version counter)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from kvcore_nvidia.backends.common import StepCache

import kvcore


def metadata() -> kvcore.AttentionMetadata:
    """Under ``inference_mode`` its tensors are inference tensors, as an engine's would be."""
    meta = kvcore.build_attention_metadata([3, 1], [0, 5], [[2, 0], [1, 3]], block_size=4)
    return dataclasses.replace(meta, **{name: getattr(meta, name).clone() for name in (
        "query_start_loc", "seq_lens", "block_table", "slot_mapping")})


@pytest.mark.parametrize("mode", ["grad", "inference_mode"])
def test_same_metadata_hits_and_an_in_place_refill_misses(mode):
    context = torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
    cache, builds = StepCache(), []

    def build():
        builds.append(1)
        return len(builds)

    with context:
        meta = metadata()
        assert meta.block_table.is_inference() == (mode == "inference_mode")
        assert [cache.get(meta, ("layer",), build) for _ in range(3)] == [1, 1, 1]
        meta.block_table[1, 0] = 2  # the engine refills the same object for the next step
        assert cache.get(meta, ("layer",), build) == 2
        assert cache.get(meta, ("layer",), build) == 2
        assert cache.get(meta, ("other window",), build) == 3
        assert cache.get(metadata(), ("other window",), build) == 4
