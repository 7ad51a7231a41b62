"""An understated ``max_seq_len`` must not let a builder cut the step's block table: the
persistent builders copy at most ``ceil(max_model_len / block_size)`` columns, and with value
checks off nothing read the lengths. Refused where it is cheap to see (host lengths, the
table's width, the step facts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcore
from kvcore.ops import set_value_checks

BS = 4


@pytest.fixture(params=[False, True], ids=["value-checks-off", "value-checks-on"])
def checks(request):
    set_value_checks(request.param)
    yield request.param
    set_value_checks(True)


def _builder(name: str):
    spec = kvcore.FullAttentionSpec(block_size=BS, dtype=torch.float32, num_kv_heads=2,
                                    head_size=16)
    return kvcore.resolve_backend(name).get_builder_cls()(
        spec, num_heads=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16,
        device="cpu")


def _long_step(host_lengths: bool) -> kvcore.AttentionMetadata:
    """A request of 40 tokens (10 blocks) that claims max_seq_len=16 (the builder's
    max_model_len, 4 columns)."""
    meta = kvcore.build_attention_metadata([1, 1], [39, 3], [list(range(10)), [10]], BS)
    meta = dataclasses.replace(meta, max_seq_len=16)
    if not host_lengths:
        meta = dataclasses.replace(meta, query_start_loc_cpu=None, seq_lens_cpu=None)
    return meta


@pytest.mark.parametrize("name", ["TRITON_ATTN", "CPU_ATTN"])
@pytest.mark.parametrize("host_lengths", [True, False], ids=["host-lengths", "device-only"])
def test_an_understated_max_seq_len_is_refused(name, host_lengths, checks):
    builder = _builder(name)
    meta = _long_step(host_lengths)
    if not checks and not host_lengths and name == "CPU_ATTN":
        builder.build(meta)  # the default builder copies nothing: no column is cut
        return
    with pytest.raises(ValueError, match="max_seq_len=16 understates the step|block_table has "
                                         "10 columns but the builder's buffer holds 4"):
        builder.build(meta)


def test_a_truthful_step_within_the_buffers_still_builds(checks):
    builder = _builder("TRITON_ATTN")
    meta = kvcore.build_attention_metadata([1, 1], [12, 3], [[0, 1, 2, 3], [10]], BS)
    built = builder.build(dataclasses.replace(meta, seq_lens_cpu=None))
    assert built.block_table[0].tolist() == [0, 1, 2, 3]
