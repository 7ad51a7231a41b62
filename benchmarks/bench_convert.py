#!/usr/bin/env python3
"""The layout conversion's gather kernel alone, against a device copy of the same bytes.

One run, in order (each section isolated: a failure is logged and the run goes on):

1. **correctness**: for every case and every candidate tiling (:data:`CONFIGS`), the kernel's
   destination equals the pure-torch gather's (``ConversionPlan.apply(kernel="torch")``) bit
   for bit, the destination block past the transfer included (left untouched);
2. **timings**: each case moves 1 GiB (32 layers, 8 KV heads of 128, bf16, 8192 tokens):
   16 -> 64 NHD -> HND cross-layer (what ``benchmarks/nixl_diagnose.py``'s "gather kernel
   alone" converts) and per-layer, 16 -> 64 in one order, 64 -> 16 HND -> NHD. Each tiling's
   launch is timed alone (CUDA graph of back-to-back launches) beside ``dst.copy_(src)`` of
   the same bytes measured before it; ``ConversionPlan.apply`` with the default tiling is
   timed too, back to back (events: its host work hides behind the previous launch) and one
   call between two synchronisations (wall clock, as ``bench_nixl.py --gather-only``: the
   host's work, the ids' copy to the device, adds to the kernel's time).

GB/s count the bytes moved once (as ``bench_nixl.py --gather-only`` does). The table is
printed last, with the best tiling per case and the suggested
``kvcore.ops.triton_convert.DEFAULT_GATHER_CONFIG`` (the tiling whose lowest fraction of the
copy over the cases is highest). The log and ``bench_convert.json`` go to ``--out`` (default
``$OUT``). ``--small`` (alias ``--smoke``) runs tiny shapes on the CPU under
``TRITON_INTERPRET=1``: it checks the script and the kernel, not the speed.

Usage: ``python benchmarks/bench_convert.py [--small] [--scattered] [--out DIR]``
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available() or "--small" in sys.argv or "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import kvcore
from kvcore.cli import harness
from kvcore.connectors import plan_conversion
from kvcore.ops import triton_convert
from kvcore.ops.triton_convert import GatherConfig, prepare_convert

NHD, HND = (0, 1, 2, 3, 4), (0, 1, 3, 2, 4)
#: (name, (source order, block size, cross-layer), (destination order, block size,
#: cross-layer)); orders per layer, blocks-first.
CASES = (
    ("16->64 NHD->HND cross-layer", (NHD, 16, True), (HND, 64, True)),
    ("16->64 NHD->HND per-layer", (NHD, 16, False), (HND, 64, False)),
    ("16->64 NHD->NHD cross-layer", (NHD, 16, True), (NHD, 64, True)),
    ("64->16 HND->NHD cross-layer", (HND, 64, True), (NHD, 16, True)),
)
#: Candidate tilings, by label; "former" is the tiling the kernel had before tiles spanned
#: heads (64 tokens of one head, blocks looked up per token).
CONFIGS = {
    "former: 16K 1h w4 per-token": GatherConfig(16384, 1, 4, False),
    "8K w4": GatherConfig(8192, 64, 4),
    "16K w4": GatherConfig(16384, 64, 4),
    "32K w2": GatherConfig(32768, 64, 2),
    "32K w4": GatherConfig(32768, 64, 4),
    "32K w8": GatherConfig(32768, 64, 8),
    "32K w4 per-token": GatherConfig(32768, 64, 4, False),
    "64K w8 per-token": GatherConfig(65536, 64, 8, False),
    "64K w16 per-token": GatherConfig(65536, 64, 16, False),
    "32K w4 evict-first": GatherConfig(32768, 64, 4, evict_first=True),
    "32K w8 evict-first": GatherConfig(32768, 64, 8, evict_first=True),
}
#: (layers, KV heads, head size, tokens): 1 GiB of bf16 K/V, and the --small shape.
FULL, SMALL = (32, 8, 128, 8192), (2, 4, 64, 128)


def layout(order: tuple[int, ...], block_size: int, cross: bool, num_blocks: int,
           shape: tuple[int, int, int, int]) -> kvcore.KVCacheLayout:
    """A bf16 K/V layout with a layer dim: per-layer ``order`` (blocks-first), cross-layer
    (block outermost) or per-layer (layer outermost)."""
    layers, heads, head_size, _ = shape
    full = (1, 0, *(d + 1 for d in order if d)) if cross else (0, *(d + 1 for d in order))
    return kvcore.KVCacheLayout((layers, num_blocks, 2, block_size, heads, head_size), full,
                                ("L", "B", "2", "N", "H", "D"), torch.bfloat16)


def strides(lay: kvcore.KVCacheLayout) -> tuple[int, ...]:
    """The kernel's ``(block, layer, kv, token, head, dim)`` element strides of ``lay``."""
    by_name = dict(zip(lay.dim_names, lay.logical_strides(), strict=True))
    return tuple(by_name[d] for d in ("B", "L", "2", "N", "H", "D"))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def tile(launch: triton_convert.GatherLaunch) -> str:
    """``tokens x heads x words`` of a launch's tile, ``a`` when block-aligned, and its warps."""
    c = launch.constants
    return (f"{c['BLOCK_T']}x{c['BLOCK_H']}x{c['BLOCK_D']}{' a' if c['ALIGNED'] else ''} "
            f"w{c['num_warps']}")


def run_case(run: harness.Run, name: str, src_side: tuple, dst_side: tuple,
             shape: tuple[int, int, int, int], scattered: bool, timer: harness.Timer) -> None:
    """Check and time every tiling of :data:`CONFIGS` on one case (see the module doc)."""
    dev = run.device
    layers, heads, head_size, tokens = shape
    (s_order, s_bs, s_cross), (d_order, d_bs, d_cross) = src_side, dst_side
    n_src, n_dst = tokens // s_bs, tokens // d_bs
    src_l = layout(s_order, s_bs, s_cross, n_src, shape)
    dst_l = layout(d_order, d_bs, d_cross, n_dst + 1, shape)  # the last block: untouched
    plan = plan_conversion(src_l, dst_l)
    gen = torch.Generator(device=dev).manual_seed(len(name))
    src = torch.randint(0, 256, (src_l.total_bytes,), dtype=torch.uint8, device=dev,
                        generator=gen).view(torch.bfloat16)
    start = torch.randint(0, 256, (dst_l.total_bytes,), dtype=torch.uint8, device=dev,
                          generator=gen).view(torch.bfloat16)
    if scattered:
        cpu = torch.Generator().manual_seed(1)
        s_ids = torch.randperm(n_src, generator=cpu).tolist()
        d_ids = torch.randperm(n_dst, generator=cpu).tolist()
    else:
        s_ids, d_ids = list(range(n_src)), list(range(n_dst))
    expected = start.clone()
    plan.apply(src, expected, s_ids, d_ids, tokens, kernel="torch")
    dst = torch.empty_like(start)
    nbytes = tokens * layers * 2 * heads * head_size * src.element_size()
    copy_src, copy_dst = bits(src)[:nbytes], torch.empty(nbytes, dtype=torch.uint8, device=dev)
    copy_s, how = timer(lambda: copy_dst.copy_(copy_src))
    run.results["ceilings"][name] = {"copy_gbps": gbps(nbytes, copy_s), "bytes": nbytes,
                                     "how": how}
    run.log(f"{name}: {nbytes / 2**20:.0f} MiB, copy {gbps(nbytes, copy_s):.1f} GB/s ({how})")
    for label, config in CONFIGS.items():
        dst.copy_(start)
        launch = prepare_convert(
            src, dst, s_ids, d_ids, num_tokens=tokens, src_block_size=s_bs,
            dst_block_size=d_bs, src_strides=strides(src_l), dst_strides=strides(dst_l),
            num_layers=layers, num_kv=2, head_pairs=[(h, h) for h in range(heads)],
            head_size=head_size, config=config)
        assert launch is not None and launch() == nbytes
        ok = torch.equal(bits(dst), bits(expected))
        run.check(f"{name} | {label}", ok, launch=repr(launch))
        if not ok:
            continue
        seconds, how = timer(launch)
        run.results["timings"].append({
            "case": name, "config": label, "tile": tile(launch), "seconds": seconds,
            "gbps": gbps(nbytes, seconds), "fraction_of_copy": copy_s / seconds, "how": how})
        run.log(f"  {label:28s} {gbps(nbytes, seconds):8.1f} GB/s  "
                f"{copy_s / seconds:5.2f} of copy  {launch!r}")
    seconds, how = timer(lambda: plan.apply(src, dst, s_ids, d_ids, tokens, kernel="triton"),
                         graph=False)
    run.results["timings"].append({
        "case": name, "config": "ConversionPlan.apply, back to back",
        "tile": repr(triton_convert.DEFAULT_GATHER_CONFIG), "seconds": seconds,
        "gbps": gbps(nbytes, seconds), "fraction_of_copy": copy_s / seconds, "how": how})
    run.check(f"{name} | ConversionPlan.apply", torch.equal(bits(dst), bits(expected)))
    # One call between two synchronisations, as bench_nixl.py --gather-only times it: the
    # host's work before the launch is not hidden behind an earlier launch.
    clock = harness.Clock(torch.device(dev))

    def one_call() -> float:
        clock.sync()
        start = time.perf_counter()
        plan.apply(src, dst, s_ids, d_ids, tokens, kernel="triton")
        clock.sync()
        return time.perf_counter() - start

    seconds = harness.median_of(3 if dev == "cpu" else 10, one_call)
    run.results["timings"].append({
        "case": name, "config": "ConversionPlan.apply, one synchronised call",
        "tile": repr(triton_convert.DEFAULT_GATHER_CONFIG), "seconds": seconds,
        "gbps": gbps(nbytes, seconds), "fraction_of_copy": copy_s / seconds, "how": "wall"})


def summary(run: harness.Run) -> list[str]:
    """The table (every case and tiling), the best tiling per case and the suggested
    default: the tiling whose worst case is the best."""
    timings = run.results["timings"]
    streaming = run.results["ceilings"].get("triton streaming copy")
    rows = [[t["case"], t["config"], t["tile"] if t["config"] in CONFIGS else "",
             f"{t['gbps']:.1f}",
             f"{run.results['ceilings'][t['case']]['copy_gbps']:.1f}",
             f"{t['fraction_of_copy']:.2f}"] for t in timings]
    lines = [harness.format_table(rows, ["case", "tiling", "tile (T x H x D words)", "GB/s",
                                         "copy GB/s", "of copy"])]
    cases = list(dict.fromkeys(t["case"] for t in timings))
    worst: dict[str, float] = {}
    for label in CONFIGS:
        fractions = [t["fraction_of_copy"] for t in timings if t["config"] == label]
        if len(fractions) == len(cases) and cases:
            worst[label] = min(fractions)
    if streaming:
        share = streaming["gbps"] / streaming["copy_gbps"]
        lines.append(f"Triton streaming copy (what a plain Triton kernel reaches): "
                     f"{streaming['gbps']:.1f} GB/s, {share:.2f} of the device copy")
    for case in cases:
        best = max((t for t in timings if t["case"] == case and t["config"] in CONFIGS),
                   key=lambda t: t["fraction_of_copy"], default=None)
        if best:
            lines.append(f"best for {case}: {best['config']} ({best['gbps']:.1f} GB/s, "
                         f"{best['fraction_of_copy']:.2f} of copy)")
    if worst:
        winner = max(worst, key=worst.__getitem__)
        run.results["suggested_default"] = {"label": winner, "config": repr(CONFIGS[winner]),
                                            "worst_fraction_of_copy": worst[winner]}
        lines.append(f"suggested DEFAULT_GATHER_CONFIG = {CONFIGS[winner]!r}  ({winner}; its "
                     f"lowest fraction of the copy over the cases: {worst[winner]:.2f}; "
                     f"target >= 0.80)")
    failed = [c["check"] for c in run.results["correctness"] if not c["ok"]]
    lines.append(f"bit-exact: {'all' if not failed else 'FAILED ' + ', '.join(failed)}")
    errors = harness.errors_line(run.results)
    return lines + ([errors] if errors else [])


def main(argv: list[str] | None = None) -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--small", "--smoke", action="store_true", dest="small",
                        help="tiny shapes on the CPU (Triton interpreter): checks the script")
    parser.add_argument("--scattered", action="store_true",
                        help="random block ids on both sides instead of blocks in order")
    args = parser.parse_args(argv)
    device, timer = harness.script_timer(args.small)
    run = harness.Run(args.out, "bench_convert", ("correctness", "timings"),
                      checks="correctness", device=device)
    shape = SMALL if args.small else FULL
    run.results["meta"] = {**harness.run_meta(device), "device_name": harness.device_name(device),
                           "small": args.small, "scattered": args.scattered,
                           "shape": dict(zip(("layers", "kv_heads", "head_size", "tokens"),
                                             shape, strict=True)), "dtype": "bfloat16"}
    run.log(run.results["meta"])
    if device == "cuda":
        buf = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        harness.warm_up(torch.empty_like(buf), buf, 1.0)
        del buf
    with run.section("Triton streaming copy"):
        layers, heads, head_size, tokens = shape
        x = torch.randn(tokens * layers * 2 * heads * head_size // 2, device=device)
        copy, _ = harness.copy_gbps(torch.empty_like(x), x, timer)
        streaming, how = harness.triton_copy_gbps(x, torch.empty_like(x), timer)
        # Bytes moved once, as the cases count them (the harness counts read + written).
        run.results["ceilings"]["triton streaming copy"] = {
            "gbps": streaming / 2, "copy_gbps": copy / 2, "how": how}
        run.log(f"Triton streaming copy {streaming / 2:.1f} GB/s, device copy {copy / 2:.1f} "
                "GB/s")
        del x
    for name, src_side, dst_side in CASES:
        with run.section(name):
            run_case(run, name, src_side, dst_side, shape, args.scattered, timer)
    run.write_summary(summary(run))
    run.save()
    failed = any(not c["ok"] for c in run.results["correctness"]) or run.results["errors"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
