"""The Gluon MLA decode kernel (TRITON_MLA's sm90 row at 64+ heads) against the Triton kernel's
best row (TMA loads, key-split scores) and FlashInfer's MLA wrapper when it imports, on one
H200, each with the split count TRITON_MLA's heuristic picks for the shape, plus the Gluon
kernel at half and twice that count. Each output is checked against the Triton one before it
is timed. With ``--rounds N`` every call is timed N times, the calls of a shape interleaved
round by round: the table shows medians, and the last column the spread of the per-round
FlashInfer / Gluon ratio (one sample of each can move the B8 and B128 times by up to 10%
between calls).

Usage (device run, carry .whl for FlashInfer): python3 benchmarks/bench_gluon_mla.py
[--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcore.cli import harness

RANK, ROPE, PAGE = 512, 64, 64
SHAPES = [(64, 128, 4096), (8, 128, 32768), (128, 128, 2048), (64, 128, 4000)]


def time_shape(batch: int, heads: int, tokens: int, rounds: int = 1) -> list[str]:
    """One row: each kernel's time on the same cache, relative error against Triton's."""
    from kvcore_mla.ops import mla_configs
    from kvcore_mla.ops import triton_mla_attention as tma
    from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode
    from kvcore_mla.ops.triton_mla_decode import launch_triton_mla_decode

    import kvcore.ops

    pages = batch * (-(-tokens // PAGE))
    cache = torch.randn(pages + 8, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
    lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    scale = (128 + ROPE) ** -0.5
    config = mla_configs.mla_decode_config(heads, mla_configs.gpu_family(torch.device("cuda")),
                                           page_size=PAGE, gluon=False)
    sms = kvcore.ops.num_sms(torch.device("cuda"))
    splits = mla_configs.mla_decode_num_splits(batch, heads, tokens, config, sms)
    ref = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device="cuda")
    ref_lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
    def workspace(n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Split partials as TRITON_MLA's decode steps carve them (decode_partials: bf16
        outputs, float32 log-sum-exps); ``None`` for one split."""
        if n <= 1:
            return None
        flat = torch.empty(tma.mla_workspace_numel(batch, heads, RANK, n), device="cuda")
        return tma.decode_partials(flat, batch, heads, RANK, n, q.dtype)

    ws = workspace(splits)
    out = torch.empty_like(ref)
    lse = torch.empty_like(ref_lse)
    ws2 = workspace(splits)

    def triton_call() -> None:
        # The launch itself, as TRITON_MLA's step makes it (decode_attention_fwd validates its
        # inputs on the host first, which a CUDA graph cannot capture).
        launch_triton_mla_decode(q, cache, RANK, ref, ref_lse, ws, lens, table, scale, None,
                                 splits, config)

    def gluon_call() -> None:
        gluon_mla_decode(q, cache, RANK, lens, table, scale, out, lse, splits,
                         *(ws2 or ()))

    calls = {"triton": triton_call, "gluon": gluon_call}
    outs = {"gluon": out}
    others = {max(1, splits // 2), min(kvcore.ops.MAX_KV_SPLITS, 2 * splits)} - {splits}
    for other in sorted(others):
        ws_other = workspace(other)
        out_other = torch.empty_like(ref)
        outs[f"gluon x{other}"] = out_other
        calls[f"gluon x{other}"] = (
            lambda other=other, ws_other=ws_other, out_other=out_other: gluon_mla_decode(
                q, cache, RANK, lens, table, scale, out_other, None, other,
                *(ws_other or ())))
    try:
        import flashinfer.mla  # noqa: F401
        from bench_flashinfer_mla import flashinfer_mla_direct
        common = types.SimpleNamespace(
            seq_lens=lens, block_table=table,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"))
        calls["flashinfer"] = flashinfer_mla_direct(q, cache, common, scale)
    except ImportError:
        pass
    for fn in calls.values():
        fn()
    if "flashinfer" in calls:
        outs["flashinfer"] = calls["flashinfer"]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            samples[name].append(harness.time_call(fn, "cuda")[0])
    times = {name: statistics.median(values) for name, values in samples.items()}
    row = [f"B{batch} H{heads} L{tokens}", str(splits)]
    for name in ("triton", "gluon", "flashinfer"):
        if name not in times:
            row += ["-", "-"]
            continue
        err = 0.0 if name == "triton" else \
            ((outs[name].float() - ref.float()).norm() / ref.float().norm()).item()
        row += [f"{times[name] * 1e6:.1f}", f"{err:.1e}"]
    row.append(f"{times['triton'] / times['gluon']:.3f}")
    row.append(f"{times['flashinfer'] / times['gluon']:.3f}" if "flashinfer" in times else "-")
    row.append(", ".join(
        f"{name[7:]}: {times[name] * 1e6:.1f} us (err "
        f"{((outs[name].float() - ref.float()).norm() / ref.float().norm()).item():.1e})"
        for name in times if name.startswith("gluon x")))
    if "flashinfer" in samples:
        ratios = [f / g for f, g in zip(samples["flashinfer"], samples["gluon"], strict=True)]
        row.append(f"{min(ratios):.3f}-{max(ratios):.3f}")
    else:
        row.append("-")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every call this many times, interleaved (medians shown)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [time_shape(*shape, rounds=args.rounds) for shape in SHAPES]
    print(harness.format_table(rows, ["shape", "splits", "triton us", "err", "gluon us", "err",
                                      "flashinfer us", "err", "triton/gluon", "fi/gluon",
                                      "gluon, other splits", "fi/gluon per round"]))


if __name__ == "__main__":
    main()
