"""EXPERIMENTAL (branch wt/gluon-mla): the Gluon MLA decode kernel against TRITON_MLA's sm90
table row (one KV split, the shapes where the builder picks one) and FlashInfer MLA when it
imports, on one H200. Checks each against the Triton output before timing it.

Usage (device run): python3 benchmarks/bench_gluon_mla.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcore.cli import harness

RANK, ROPE, PAGE = 512, 64, 64
SHAPES = [(64, 128, 4096), (128, 128, 2048)]  # (batch, heads, tokens): one split each


def time_shape(batch: int, heads: int, tokens: int) -> list[str]:
    """One row: TRITON_MLA's decode (one split) and the Gluon kernel on the same cache."""
    from kvcore_mla.ops import triton_mla_attention as tma
    from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode

    pages = batch * tokens // PAGE
    cache = torch.randn(pages + 8, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
    lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    scale = (128 + ROPE) ** -0.5
    ref = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(ref)
    lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")

    def triton_call() -> None:
        tma.mla_attention(q, cache, kv_lora_rank=RANK, query_start_loc=starts, seq_lens=lens,
                          block_table=table, scale=scale, output=ref, max_query_len=1,
                          max_seq_len=tokens, num_kv_splits=1)

    def gluon_call() -> None:
        gluon_mla_decode(q, cache, RANK, lens, table, scale, out, lse)

    triton_call()
    gluon_call()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    t_triton, _ = harness.time_call(triton_call, "cuda")
    t_gluon, how = harness.time_call(gluon_call, "cuda")
    return [f"B{batch} H{heads} L{tokens}", f"{t_triton * 1e6:.1f}", f"{t_gluon * 1e6:.1f}",
            f"{t_triton / t_gluon:.3f}", f"{err:.1e}", how]


def main() -> None:
    torch.manual_seed(0)
    rows = [time_shape(*shape) for shape in SHAPES]
    print(harness.format_table(rows, ["shape", "triton us", "gluon us", "triton/gluon",
                                      "rel err vs triton", "method"]))


if __name__ == "__main__":
    main()
