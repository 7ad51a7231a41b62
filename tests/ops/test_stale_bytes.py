"""Stale bytes never leak: NaN/Inf bit patterns in cache slots a request does not own (the tail
of its last block, other blocks) leave its output unchanged, in the reference and in the
Triton kernel (``TRITON_INTERPRET=1`` without a GPU). Inside a prefill, a NaN key after a
query is masked out exactly; what a NaN *value* does there is documented in docs/faults.md.

The backends (CPU_ATTN, TRITON_ATTN, FLEX_ATTENTION, the example plugin) are checked by the
conformance rule ``stale-bytes-masked``.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.ops import TritonAttentionPlan, paged_attention_ref

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, NUM_BLOCKS = 16, 4, 2, 32, 12


def _batch(gen: torch.Generator, q_lens: list[int], seq_lens: list[int]):
    """Random caches and queries; request i owns blocks 3i, 3i+1, 3i+2 (in reverse order)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    table = torch.tensor([[3 * i + 2, 3 * i + 1, 3 * i] for i in range(len(q_lens))],
                         dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_SIZE, generator=gen)
    kwargs = dict(query_start_loc=qsl.to(DEVICE), seq_lens=torch.tensor(
        seq_lens, dtype=torch.int32).to(DEVICE), block_table=table.to(DEVICE),
        scale=HEAD_SIZE**-0.5)
    return query.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kwargs


def _poison_unowned(cache: torch.Tensor, kwargs: dict, value: float) -> torch.Tensor:
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for blocks, n in zip(kwargs["block_table"].tolist(), kwargs["seq_lens"].tolist(),
                         strict=True):
        for pos in range(n):
            owned[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = True
    out = cache.clone()
    out[~owned.to(cache.device)] = value
    return out


def _paths():
    return {
        "reference": paged_attention_ref,
        "triton": lambda *a, **kw: triton_attention.paged_attention(
            *a, plan=TritonAttentionPlan(num_kv_splits=1), **kw),
        "triton-split-kv": lambda *a, **kw: triton_attention.paged_attention(
            *a, plan=TritonAttentionPlan(num_kv_splits=3), **kw),
    }


@pytest.mark.parametrize("path", list(_paths()))
@pytest.mark.parametrize("stale", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_unowned_slots_never_reach_the_output(path, stale, causal):
    # A decode whose last block is 5/16 full, a prefill over a cached prefix, a fresh prefill.
    query, k, v, kw = _batch(torch.Generator().manual_seed(9), [1, 7, 12], [37, 20, 12])
    op = _paths()[path]
    clean = op(query, k, v, causal=causal, **kw)
    dirty = op(query, _poison_unowned(k, kw, stale), _poison_unowned(v, kw, stale),
               causal=causal, **kw)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


@pytest.mark.parametrize("path", list(_paths()))
def test_a_nan_key_after_a_query_is_masked_exactly(path):
    """A fresh prefill of 12 tokens with K[7] = NaN: queries 0..6 cannot see key 7 and get
    exactly their clean outputs; queries 7..11 see it and are NaN (nothing is hidden)."""
    query, k, v, kw = _batch(torch.Generator().manual_seed(10), [12], [12])
    op = _paths()[path]
    clean = op(query, k, v, **kw)
    bad = k.clone()
    bad[2, 7] = float("nan")  # block_table[0] = [2, 1, 0]: position 7 is in block 2
    out = op(query, bad, v, **kw)
    torch.testing.assert_close(out[:7], clean[:7], atol=0, rtol=0)
    assert out[7:].isnan().all()


def test_a_nan_value_after_a_query_is_masked_exactly_in_the_reference():
    """The reference is the specification: a V the query cannot see contributes exactly
    nothing, NaN or not (the Triton kernel's tensor-core product cannot: docs/faults.md)."""
    query, k, v, kw = _batch(torch.Generator().manual_seed(11), [12], [12])
    clean = paged_attention_ref(query, k, v, **kw)
    bad = v.clone()
    bad[2, 7, 1] = float("nan")  # KV head 1 only: heads 0-1 never see it
    bad[2, 9, 0] = float("inf")
    out = paged_attention_ref(query, k, bad, **kw)
    torch.testing.assert_close(out[:7], clean[:7], atol=0, rtol=0)
    assert out[7:, 2:].isnan().all()  # KV head 1 serves query heads 2-3
    # (added back in another order: float32 rounding, not the masked key)
    torch.testing.assert_close(out[7:9, :2], clean[7:9, :2])
    assert out[9:, :2].isinf().all()
