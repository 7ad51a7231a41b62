"""Stale bytes never leak into MLA outputs: NaN in every latent-cache slot a request does not
own (the tail of its last page, pages it does not own) leaves the reference and the Triton
kernels (mixed-batch prefill path, decode path with split-KV) unchanged."""

from __future__ import annotations

import pytest
import torch
from kvcore_mla.ops import mla_attention_ref
from mla_helpers import DEVICE, block_tables, generator, randn

import kvcore

tma = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
TritonMLAPlan = pytest.importorskip("kvcore_mla.ops.mla_configs").TritonMLAPlan

RANK, ROPE, PAGE, PAGES, HEADS = 32, 16, 8, 24, 4


def _poisoned(cache: torch.Tensor, meta: kvcore.AttentionMetadata) -> torch.Tensor:
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for blocks, n in zip(meta.block_table.tolist(), meta.seq_lens.tolist(), strict=True):
        for pos in range(n):
            owned[blocks[pos // PAGE], pos % PAGE] = True
    out = cache.clone()
    out[~owned.to(cache.device)] = float("nan")
    return out


@pytest.mark.parametrize(("path", "q_lens", "ctx_lens"), [
    ("reference", [13, 1, 21], [18, 35, 0]),
    ("triton-mixed", [13, 1, 21], [18, 35, 0]),
    ("triton-decode-split", [1, 1, 1], [18, 35, 4]),
], ids=["reference", "triton-mixed", "triton-decode-split"])
def test_unowned_latent_slots_never_reach_the_output(path, q_lens, ctx_lens):
    gen = generator("mla-stale", path)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    table = block_tables(seq_lens, PAGE, PAGES, gen).tolist()
    meta = kvcore.build_attention_metadata(q_lens, ctx_lens, table, PAGE, device=DEVICE)
    q = randn((meta.num_actual_tokens, HEADS, RANK + ROPE), torch.float32, gen)
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen)
    args = dict(kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.1)
    if path == "reference":
        def run(c):
            return mla_attention_ref(q, c, **args)
    else:
        splits = 3 if path.endswith("split") else None

        def run(c):
            return tma.mla_attention(q, c, **args, max_query_len=meta.max_query_len,
                                     plan=TritonMLAPlan(num_kv_splits=splits))
    clean = run(cache)
    dirty = run(_poisoned(cache, meta))
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)
