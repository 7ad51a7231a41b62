"""EXPERIMENTAL (branch wt/gluon-mla): the Gluon MLA decode kernels (step 0: loads through
registers; step 1: TMA into two stages) against TRITON_MLA's decode kernel with one KV split
(the shapes here fill the GPU with one split) and FlashInfer's MLA wrapper when it imports, on
one H200. Each output is checked against the Triton one before it is timed.

Usage (device run, carry .whl for FlashInfer): python3 benchmarks/bench_gluon_mla.py
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcore.cli import harness

RANK, ROPE, PAGE = 512, 64, 64
SHAPES = [(64, 128, 4096), (128, 128, 2048), (64, 128, 4000)]  # (batch, heads, tokens)


def time_shape(batch: int, heads: int, tokens: int) -> list[str]:
    """One row: each kernel's time on the same cache, relative error against Triton's."""
    from kvcore_mla.ops import gluon_mla_decode as gmd
    from kvcore_mla.ops.triton_mla_attention import decode_attention_fwd

    pages = batch * (-(-tokens // PAGE))
    cache = torch.randn(pages + 8, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
    lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    scale = (128 + ROPE) ** -0.5
    ref = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device="cuda")
    ref_lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
    logits = torch.empty(batch, heads, 1, RANK + 1, dtype=torch.float32, device="cuda")

    def triton_call() -> None:
        decode_attention_fwd(q, cache, cache[..., :RANK], ref, ref_lse, table, lens, logits, 1,
                             scale, PAGE, True)

    calls = {"triton": triton_call}
    outs = {}
    for name, fn, kw in (("gluon0", gmd.gluon_mla_decode, {}),
                         ("gluon1", gmd.gluon_mla_decode_tma, {})):
        out = torch.empty_like(ref)
        lse = torch.empty_like(ref_lse)
        outs[name] = out
        calls[name] = (lambda fn=fn, out=out, lse=lse, kw=kw:
                       fn(q, cache, RANK, lens, table, scale, out, lse, **kw))
    try:
        import flashinfer.mla  # noqa: F401
        from bench_flashinfer_mla import flashinfer_mla_direct
        common = types.SimpleNamespace(
            seq_lens=lens, block_table=table,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"))
        fi = flashinfer_mla_direct(q, cache, common, scale)
        calls["flashinfer"] = fi
    except ImportError:
        pass
    for fn in calls.values():
        fn()
    if "flashinfer" in calls:
        outs["flashinfer"] = calls["flashinfer"]()
    torch.cuda.synchronize()
    row = [f"B{batch} H{heads} L{tokens}"]
    times = {}
    for name, fn in calls.items():
        times[name], _ = harness.time_call(fn, "cuda")
    for name in ("triton", "gluon0", "gluon1", "flashinfer"):
        if name not in times:
            row += ["-", "-"]
            continue
        err = 0.0 if name == "triton" else \
            ((outs[name].float() - ref.float()).norm() / ref.float().norm()).item()
        row += [f"{times[name] * 1e6:.1f}", f"{err:.1e}"]
    if "flashinfer" in times:
        row.append(f"{times['flashinfer'] / times['gluon1']:.3f}")
    return row


def main() -> None:
    torch.manual_seed(0)
    rows = [time_shape(*shape) for shape in SHAPES]
    print(harness.format_table(rows, ["shape", "triton us", "err", "gluon0 us", "err",
                                      "gluon1 us", "err", "flashinfer us", "err",
                                      "fi/gluon1 (time ratio)"]))


if __name__ == "__main__":
    main()
