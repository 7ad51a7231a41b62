"""``kvcore.is_uniform_decode``, kvcore's one test of a decode step: every request has exactly
one new token. Backends choose a decode kernel or a non-causal plan by it, and CUDA graphs
replay the steps it accepts (that have no padding rows as well); the cases below pin the rule
so that no caller's answer drifts from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcore

BLOCK = 4
SPEC = kvcore.FullAttentionSpec(block_size=BLOCK, dtype=torch.float32, num_kv_heads=1,
                                head_size=8)
LIMITS = dict(num_heads=2, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16,
              device="cpu")


def step(query_lens: list[int]) -> kvcore.AttentionMetadata:
    """A step of requests with 3 cached tokens each and ``query_lens`` new ones."""
    tables = [[4 * i + j for j in range(4)] for i in range(len(query_lens))]
    return kvcore.build_attention_metadata(query_lens, [3] * len(query_lens), tables, BLOCK)


def padded(meta: kvcore.AttentionMetadata, rows: int) -> kvcore.AttentionMetadata:
    """``meta`` with ``rows`` padding rows (slot -1) after its tokens, as engines pad a step."""
    pad = torch.full((rows,), -1, dtype=meta.slot_mapping.dtype)
    return dataclasses.replace(meta, slot_mapping=torch.cat([meta.slot_mapping, pad]))


#: (new tokens per request, whether the step is a uniform decode).
CASES = {
    "decode": ([1, 1, 1], True),
    "one request": ([1], True),
    # No request has other than one token: the padding-only step graphs are captured on.
    "no requests": ([], True),
    "prefill": ([5], False),
    "mixed": ([1, 2], False),
    # As many tokens as requests, but not one each: the token count alone would say decode.
    "a request without new tokens beside one with two": ([0, 2], False),
    "requests without new tokens": ([0, 0], False),
}


@pytest.mark.parametrize(("query_lens", "expected"), CASES.values(), ids=CASES.keys())
def test_a_decode_step_is_one_new_token_per_request(query_lens, expected):
    meta = step(query_lens)
    assert kvcore.is_uniform_decode(meta) is expected
    # Padding rows past num_actual_tokens are no request's: they change nothing.
    assert kvcore.is_uniform_decode(padded(meta, 3)) is expected


def test_graphs_take_uniform_decode_steps_without_padding_rows():
    builder = kvcore.PersistentMetadataBuilder(SPEC, **LIMITS)
    runner = kvcore.CudaGraphRunner(builder, lambda inputs, meta: inputs["x"], num_blocks=16)
    for meta in (step([1, 1]), step([])):
        assert runner.replayable(meta)
        built = builder.build(meta, graph_batch_size=2)
        assert kvcore.is_uniform_decode(built) and built.num_seqs == 2
    for meta in (padded(step([1, 1]), 2), step([1, 2])):
        assert not runner.replayable(meta)
        with pytest.raises(ValueError, match="needs a uniform-decode step"):
            builder.build(meta, graph_batch_size=2)
