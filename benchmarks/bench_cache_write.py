#!/usr/bin/env python3
"""The NVIDIA backends' cache write: kvcore-nvidia's CUDA C++ kernel vs kvcore's Triton kernel.

One run, in order (each section isolated: a failure is logged and the run goes on):

1. **build** the CUDA C++ extension (timed; a cached build only loads);
2. **correctness**, bit for bit against kvcore's torch reference, for the CUDA and the Triton
   write: every stride order the NVIDIA backends declare or are about to (per layer
   ``(0, 1, 2, 3, 4)`` NHD, ``(0, 1, 3, 2, 4)`` HND, ``(0, 2, 1, 3, 4)`` K/V interleaved per
   token; cross-layer ``(1, 0, 2, 3, 4, 5)``, ``(1, 0, 3, 2, 4, 5)``, on a middle layer whose
   neighbours must stay untouched), bf16 and fp8 e4m3 with a scale that is not a power of two,
   and one layer spanning more than 2**31 elements;
3. **ceiling**: the device copy (``Tensor.copy_``, cudaMemcpy) of 2 GiB in this run;
4. **timings**: 4096, 32768 and 131072 tokens (Hk 8, D 128, block 16), bf16 and fp8 e4m3,
   standard and interleaved layouts, CUDA vs Triton vs torch ``index_put``, each in a CUDA
   graph, as % of the copy ceiling (bytes read + written).

The table is printed last with the suggested ``kvcore_nvidia.ops.cache_write.
DEFAULT_CACHE_WRITE`` (the kernel with the lower total time over the bf16 standard cases). The
log and ``bench_cache_write.json`` go to ``--out`` (default ``$OUT``); ``--json`` also prints
the JSON. ``--smoke`` runs tiny shapes on any machine (CPU: Triton under
``TRITON_INTERPRET=1``; the CUDA write reports why it is skipped).

Usage: ``python benchmarks/bench_cache_write.py [--smoke] [--json] [--out DIR]``
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from kvcore.cli import harness
from kvcore.cli.harness import Skip, time_call
from kvcore.ops import (
    reshape_and_cache_ref,
    set_value_checks,
    triton_reshape_and_cache,
)

HK, D, BS = 8, 128, 16
GiB = 1 << 30
SIZES = (4096, 32768, 131072)
#: Stride orders checked bit for bit: (name, order, number of layers; 0 = per-layer cache).
ORDERS = (("NHD", (0, 1, 2, 3, 4), 0), ("HND", (0, 1, 3, 2, 4), 0),
          ("interleaved", (0, 2, 1, 3, 4), 0),
          ("cross_layer_NHD", (1, 0, 2, 3, 4, 5), 3),
          ("cross_layer_interleaved", (1, 0, 3, 2, 4, 5), 3))
FP8_SCALES = (0.37, 1.7)  # k, v: not powers of two, so x / s and x * (1 / s) can differ


def strided_cache(order: tuple[int, ...], logical: tuple[int, ...], dtype: torch.dtype,
                  device: str) -> torch.Tensor:
    """A cache with ``logical`` shape laid out in memory in ``order`` (outermost first), filled
    with random bytes (never zeros)."""
    physical = torch.empty([logical[i] for i in order], dtype=torch.uint8 if dtype.itemsize == 1
                           else dtype, device=device)
    if physical.dtype == torch.uint8:
        physical.random_(0, 120)  # finite fp8 values of both signs' magnitudes
        physical = physical.view(dtype)
    else:
        physical.normal_()
    inverse = [order.index(i) for i in range(len(order))]
    return physical.permute(inverse)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Run(harness.Run):
    def __init__(self, out_dir: Path, smoke: bool) -> None:
        super().__init__(out_dir, "bench_cache_write", ("checks", "timings", "skipped"),
                         device="cuda" if torch.cuda.is_available() else "cpu")
        self.smoke = smoke


def writers(device: str) -> dict[str, Callable[..., None]]:
    """The writes compared: the CUDA C++ one only on a GPU."""
    impls: dict[str, Callable[..., None]] = {"triton": triton_reshape_and_cache}
    if device == "cuda":
        from kvcore_nvidia.ops import reshape_and_cache_flash

        impls["cuda"] = reshape_and_cache_flash
    return impls


# -- correctness -------------------------------------------------------------------------------


def check_orders(run: Run) -> None:
    dev = run.device
    n, num_blocks = (40, 8) if run.smoke else (3000, 512)
    gen = torch.Generator(device=dev).manual_seed(0)
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        cache_dtype = torch.float8_e4m3fn if kv_cache_dtype != "auto" else torch.bfloat16
        scales = (torch.tensor([FP8_SCALES[0]], device=dev), FP8_SCALES[1])  # both arg forms
        key = torch.randn(n, HK, D, device=dev, generator=gen).to(torch.bfloat16) * 4
        value = torch.randn(n, HK, D, device=dev, generator=gen).to(torch.bfloat16) * 4
        slots = torch.randperm(num_blocks * BS, device=dev, generator=gen)[:n]
        slots[::37] = -1  # padding rows are skipped
        for name, order, layers in ORDERS:
            logical = ((layers,) if layers else ()) + (num_blocks, 2, BS, HK, D)
            base = strided_cache(order, logical, cache_dtype, dev)
            expected = None
            for impl_name, write in writers(dev).items():
                kv = strided_cache(order, logical, cache_dtype, dev)  # same physical order
                kv.copy_(base)
                layer = kv[layers // 2] if layers else kv
                if expected is None:
                    expected = layer.clone()
                    reshape_and_cache_ref(key, value, *expected.unbind(1), slots,
                                          kv_cache_dtype, *scales)
                write(key, value, *layer.unbind(1), slots, kv_cache_dtype, *scales)
                if dev == "cuda":
                    torch.cuda.synchronize()
                case = f"{impl_name}.{name}.{kv_cache_dtype}"
                run.check(f"{case}.bit_exact", torch.equal(bits(layer), bits(expected)))
                if layers:
                    others = [i for i in range(layers) if i != layers // 2]
                    run.check(f"{case}.neighbours_untouched",
                              all(torch.equal(bits(kv[i]), bits(base[i])) for i in others))


def check_int64_span(run: Run) -> None:
    """One layer of a 2-layer cross-layer pool: the second layer's last blocks sit more than
    2**31 elements from the storage's start (4.3 GB of bf16)."""
    if run.smoke:
        raise Skip("needs 4.3 GB of GPU memory (not in --smoke)")
    page = 2 * BS * HK * D
    num_blocks = 2**31 // (2 * page) + 8  # two layers' blocks together pass 2**31 elements
    pool = torch.empty(num_blocks, 2, 2, BS, HK, D, dtype=torch.bfloat16, device=run.device)
    layer = pool[:, 1]
    n = 64
    key = torch.randn(n, HK, D, device=run.device).to(torch.bfloat16)
    value = torch.randn(n, HK, D, device=run.device).to(torch.bfloat16)
    slots = torch.arange((num_blocks - 4) * BS, num_blocks * BS, device=run.device)[:n]
    far = (slots[-1] // BS) * pool.stride(0) + pool.stride(1)
    run.log(f"int64 span: last written block starts {int(far)} elements in (> 2**31)")
    tail = pool[-4:]
    for impl_name, write in writers(run.device).items():
        tail.normal_()
        before = tail.clone()
        expected = tail[:, 1].clone()
        reshape_and_cache_ref(key, value, *expected.unbind(1), slots - (num_blocks - 4) * BS)
        write(key, value, *layer.unbind(1), slots)
        torch.cuda.synchronize()
        run.check(f"{impl_name}.int64_span.bit_exact",
                  torch.equal(bits(tail[:, 1]), bits(expected)))
        run.check(f"{impl_name}.int64_span.neighbour_untouched",
                  torch.equal(bits(tail[:, 0]), bits(before[:, 0])))


# -- timings -----------------------------------------------------------------------------------


def measure_ceiling(run: Run) -> float:
    n_bytes = (64 << 20) if run.smoke else 2 * GiB
    src = torch.empty(n_bytes, dtype=torch.uint8, device=run.device).random_()
    dst = torch.empty_like(src)
    harness.warm_up(dst, src, 0 if run.smoke else 1.0)
    gbps, how = harness.copy_gbps(dst, src, functools.partial(time_call, device=run.device,
                                                              graph=False))
    run.results["ceilings"]["device_copy_GBps"] = gbps
    run.log(f"device copy ceiling: {gbps:.0f} GB/s [{how}]")
    return gbps


def torch_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Plain torch (``index_put``), block and offset precomputed: the baseline."""
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


def time_writes(run: Run, ceiling_gbps: float) -> None:
    dev = run.device
    set_value_checks(False)  # no host sync inside the timed (graph-captured) calls
    try:
        for n in ((256,) if run.smoke else SIZES):
            num_blocks = 2 * n // BS
            key = torch.randn(n, HK, D, device=dev).to(torch.bfloat16)
            value = torch.randn(n, HK, D, device=dev).to(torch.bfloat16)
            slots = torch.randperm(num_blocks * BS, device=dev)[:n]
            blocks, offsets = slots // BS, slots % BS
            for kv_cache_dtype in ("auto", "fp8_e4m3"):
                fp8 = kv_cache_dtype != "auto"
                cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
                scales = (torch.tensor([FP8_SCALES[0]], device=dev),
                          torch.tensor([FP8_SCALES[1]], device=dev)) if fp8 else (None, None)
                # K and V read (bf16) and written (cache dtype), the slots read.
                nbytes = 2 * n * HK * D * (2 + cache_dtype.itemsize) + 8 * n
                for layout, order in (("standard", (0, 1, 2, 3, 4)),
                                      ("interleaved", (0, 2, 1, 3, 4))):
                    kv = strided_cache(order, (num_blocks, 2, BS, HK, D), cache_dtype, dev)
                    kc, vc = kv.unbind(1)
                    impls = {name: functools.partial(write, key, value, kc, vc, slots,
                                                     kv_cache_dtype, *scales)
                             for name, write in writers(dev).items()}
                    if not fp8 and layout == "standard":
                        impls["torch"] = functools.partial(torch_write, key, value, kc, vc,
                                                           blocks, offsets)
                    for name, fn in impls.items():
                        t, how = time_call(fn, dev)
                        gbps = nbytes / t / 1e9
                        row = {"tokens": n, "kv_cache_dtype": kv_cache_dtype,
                               "layout": layout, "impl": name, "us": t * 1e6, "GB/s": gbps,
                               "pct_of_copy": 100 * gbps / ceiling_gbps, "how": how}
                        run.results["timings"].append(row)
                        run.log(f"N={n} {kv_cache_dtype} {layout} {name}: {t * 1e6:.1f} us, "
                                f"{gbps:.0f} GB/s ({row['pct_of_copy']:.1f}% of copy) [{how}]")
    finally:
        set_value_checks(True)


def suggestion(rows: list[dict]) -> tuple[str, str] | None:
    """The kernel with the lower total time over the bf16 standard cases, and the evidence."""
    standard = [r for r in rows if r["kv_cache_dtype"] == "auto" and r["layout"] == "standard"]
    totals = {impl: sum(r["us"] for r in standard if r["impl"] == impl)
              for impl in ("cuda", "triton")}
    if not all(totals.values()) or len(totals) < 2:
        return None
    ratios = [next(r["us"] for r in standard if r["impl"] == "triton" and r["tokens"] == n)
              / next(r["us"] for r in standard if r["impl"] == "cuda" and r["tokens"] == n)
              for n in sorted({r["tokens"] for r in standard})]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    best = min(totals, key=totals.get)
    return best, (f"triton time / cuda time per size: {', '.join(f'{x:.2f}' for x in ratios)} "
                  f"(geomean {geo:.2f})")


def table(run: Run) -> str:
    rows = run.results["timings"]
    lines = [f"{'tokens':>7} {'cache':>8} {'layout':>11} {'impl':>6} {'us':>9} {'GB/s':>7} "
             f"{'% copy':>7}"]
    for r in rows:
        lines.append(f"{r['tokens']:>7} {r['kv_cache_dtype']:>8} {r['layout']:>11} "
                     f"{r['impl']:>6} {r['us']:>9.1f} {r['GB/s']:>7.0f} "
                     f"{r['pct_of_copy']:>6.1f}%")
    checks = run.results["checks"]
    failed = [c["check"] for c in checks if not c["ok"]]
    lines.append(f"checks: {len(checks) - len(failed)}/{len(checks)} passed"
                 + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    lines.append(f"device copy ceiling: "
                 f"{run.results['ceilings'].get('device_copy_GBps', float('nan')):.0f} GB/s")
    pick = suggestion(rows)
    if pick:
        lines.append(f"suggested DEFAULT_CACHE_WRITE = {pick[0]!r} ({pick[1]})")
        run.results["suggested_default"] = pick[0]
    for e in run.results["errors"]:
        lines.append(f"error in {e['section']}: {e['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")),
                        help="directory for the log and the JSON (default $OUT)")
    args = parser.parse_args(argv)
    run = Run(args.out, args.smoke)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "device": harness.device_name(run.device), "smoke": args.smoke,
            "shapes": {"hk": HK, "d": D, "bs": BS, "dtype": "bfloat16"}}
    from kvcore_nvidia import ops

    no_cuda_write = ops.extension_unavailable_reason()
    meta["cuda_extension"] = ops.extension_status()
    meta["default_cache_write"] = ops.DEFAULT_CACHE_WRITE
    run.results["meta"] = meta
    run.log(json.dumps(meta))
    with run.section("build the CUDA C++ extension"):
        if no_cuda_write:
            raise Skip(no_cuda_write)
        t0 = time.time()
        ops.build_extension()
        run.log(f"extension ready in {time.time() - t0:.1f}s (a cached build only loads)")
    with run.section("correctness: stride orders, bf16 and fp8"):
        check_orders(run)
    with run.section("correctness: a layer beyond 2**31 elements"):
        if run.device != "cuda":
            raise Skip("needs a GPU")
        check_int64_span(run)
    ceiling = float("nan")
    with run.section("device copy ceiling"):
        ceiling = measure_ceiling(run)
    with run.section("cache write timings"):
        time_writes(run, ceiling)
    summary = table(run)
    run.log("\n" + summary)
    run.save()
    if args.json:
        print(json.dumps(run.results, indent=1, default=str))
    failed = any(not c["ok"] for c in run.results["checks"]) or run.results["errors"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
