#!/usr/bin/env python3
"""kvcore-nvidia on an NVIDIA GPU (the H200): correctness at real sizes, then timings.

One run, in order (each section isolated: a failure is logged and the run goes on):

1. **ceilings** measured in this run: device copy (``torch.Tensor.copy_``, i.e. cudaMemcpy,
   and kvcore-nvidia's SM copy kernel), read-only (``torch.sum``), and pinned host <-> device
   (one 1 GiB ``cudaMemcpyAsync`` each way), at the start and again at the end;
2. **correctness**: the CUDA C++ ``reshape_and_cache_flash`` bit-exact against kvcore's
   reference on a standard cache, on a layer of a cross-layer pool (neighbours untouched) and
   with fp8 e4m3; ``copy_blocks`` round trips; the FLASHINFER backend against the float64
   reference on a mixed batch, and bit-exact on a cross-layer view;
3. **cache write** (Hk 8, D 128, bf16, block 16): CUDA C++ vs kvcore's Triton kernel vs torch
   ``index_put``, against the copy ceiling;
4. **block copy** between the GPU and pinned host memory, runs of 2 MiB (a 32-layer
   cross-layer block) and 64 KiB (one layer's block, scattered), each way, with
   ``cudaMemcpyBatchAsync`` / one ``cudaMemcpyAsync`` per run / the SM copy kernel, against the
   pinned ceiling;
5. **FLASHINFER decode** (Hq 32, Hk 8, D 128, bf16, block 16): the backend's ``forward``
   (plan + run, as an engine calls it per layer), FlashInfer's run alone, and TRITON_ATTN's
   ``forward``, against the read ceiling.

The summary table is printed last; the log and the JSON go to ``--out`` (default ``$OUT``).
``--prebuild`` only builds the CUDA C++ extension and FlashInfer's JIT modules (in parallel
processes) and exits. ``--smoke`` runs tiny shapes on any machine (CPU: Triton under
``TRITON_INTERPRET=1``; the CUDA-only sections report why they are skipped).

Usage: ``python benchmarks/bench_nvidia.py [--smoke] [--prebuild] [--out DIR]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import kvcore  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Skip, time_call  # noqa: E402
from kvcore.ops import reshape_and_cache_ref, set_value_checks  # noqa: E402

HQ, HK, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
GiB = 1 << 30


class Run(harness.Run):
    """The log (also written to a file) and the JSON results of one run."""

    def __init__(self, out_dir: Path, smoke: bool) -> None:
        super().__init__(out_dir, "bench_nvidia", ("checks", "timings", "skipped"),
                         device="cuda" if torch.cuda.is_available() else "cpu")
        self.smoke = smoke

    def timing(self, op: str, case: str, impl: str, seconds: float, how: str,
               nbytes: float, **info: object) -> None:
        gbps = nbytes / seconds / 1e9
        self.results["timings"].append({"op": op, "case": case, "impl": impl,
                                        "us": seconds * 1e6, "GB/s": gbps, "how": how, **info})
        self.log(f"{op} {case} {impl}: {seconds * 1e6:.1f} us, {gbps:.0f} GB/s [{how}]"
                 + (f" {info}" if info else ""))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def randn(*shape: int, device: str, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


# -- 1. ceilings -------------------------------------------------------------------------------


def measure_ceilings(run: Run, label: str) -> None:
    dev = run.device
    n_bytes = (64 << 20) if run.smoke else 2 * GiB
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    ceilings = run.results["ceilings"].setdefault(label, {})
    timer = functools.partial(time_call, device=dev, graph=False)
    ceilings["device_copy_memcpy_GBps"], _ = harness.copy_gbps(dst, src, timer)
    ceilings["read_torch_sum_GBps"], _ = harness.read_gbps(
        src.view(torch.bfloat16), timer, lambda x: x.sum(dtype=torch.float32))
    if dev == "cuda":
        from kvcore_nvidia import ops

        blocks_src, blocks_dst = src.view(-1, 1 << 20), dst.view(-1, 1 << 20)
        whole = torch.arange(blocks_src.shape[0])
        pairs = torch.stack([whole, whole], 1)
        t, _ = timer(lambda: ops.copy_blocks(blocks_src, blocks_dst, pairs, "kernel"))
        ceilings["device_copy_sm_kernel_GBps"] = 2 * n_bytes / t / 1e9
        pinned = harness.pinned_copy_gbps(src[:(64 << 20) if run.smoke else GiB], timer)
        ceilings["pinned_d2h_GBps"], ceilings["pinned_h2d_GBps"] = pinned["d2h"], pinned["h2d"]
    run.log(f"ceilings ({label}): " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()))


def ceiling(run: Run, key: str) -> float:
    """The larger of the start and end measurements (both are lower bounds of the truth)."""
    values = [c[key] for c in run.results["ceilings"].values() if key in c]
    return max(values) if values else float("nan")


# -- 2. correctness ----------------------------------------------------------------------------


def check_cache_write(run: Run) -> None:
    from kvcore_nvidia import ops

    dev = run.device
    n = 256 if run.smoke else 32768
    num_blocks = 2 * n // BS
    key, value = randn(n, HK, D, device=dev), randn(n, HK, D, device=dev)
    slots = torch.randperm(num_blocks * BS, device=dev)[:n]
    slots[::97] = -1
    kv = randn(num_blocks, 2, BS, HK, D, device=dev)
    ref = kv.clone()
    ops.reshape_and_cache_flash(key, value, *kv.unbind(1), slots)
    reshape_and_cache_ref(key, value, *ref.unbind(1), slots)
    run.check("csrc_write.standard.bit_exact", torch.equal(kv.view(torch.int16),
                                                           ref.view(torch.int16)), tokens=n)
    kv8 = randn(num_blocks, 2, BS, HK, D, device=dev, dtype=torch.float8_e4m3fn)
    ref8 = kv8.clone()
    ks, vs = torch.tensor([0.021], device=dev), torch.tensor([0.013], device=dev)
    ops.reshape_and_cache_flash(key, value, *kv8.unbind(1), slots, "fp8", ks, vs)
    reshape_and_cache_ref(key, value, *ref8.unbind(1), slots, "fp8", ks, vs)
    diff = int((kv8.view(torch.uint8) != ref8.view(torch.uint8)).sum())
    run.check("csrc_write.fp8_e4m3.bit_exact", diff == 0, differing_bytes=diff)
    layers = 8
    pool = randn(num_blocks, layers, 2, BS, HK, D, device=dev)
    before = pool.clone()
    view = pool[:, 4]
    expected = view.clone()
    ops.reshape_and_cache_flash(key, value, *view.unbind(1), slots)
    reshape_and_cache_ref(key, value, *expected.unbind(1), slots)
    others = [i for i in range(layers) if i != 4]
    run.check("csrc_write.cross_layer.bit_exact",
              torch.equal(view.view(torch.int16), expected.view(torch.int16)), layers=layers)
    run.check("csrc_write.cross_layer.neighbours_untouched",
              torch.equal(pool[:, others].view(torch.int16), before[:, others].view(torch.int16)))


def flashinfer_impl(sliding_window: int | None = None) -> kvcore.AttentionImpl:
    from kvcore_nvidia.backends.flashinfer import FlashInferBackend

    return FlashInferBackend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D**-0.5,
                                            num_kv_heads=HK, sliding_window=sliding_window)


def mixed_metadata(num_blocks: int, device: str, smoke: bool) -> kvcore.AttentionMetadata:
    q_lens, ctx = ([1, 3, 5], [20, 0, 9]) if smoke else ([1, 1, 300, 257, 1],
                                                          [1000, 15, 64, 0, 4095])
    perm = torch.randperm(num_blocks).tolist()
    tables = []
    for q, c in zip(q_lens, ctx, strict=True):
        need = -(-(q + c) // BS)
        tables.append(perm[:need])
        perm = perm[need:]
    return kvcore.build_attention_metadata(q_lens, ctx, tables, BS, device=device)


def check_flashinfer(run: Run) -> None:
    dev = run.device
    impl = flashinfer_impl()
    num_blocks = 2048
    pool = randn(num_blocks, 3, 2, BS, HK, D, device=dev)  # cross-layer: blocks outermost
    view = pool[:, 1]
    meta = mixed_metadata(num_blocks, dev, run.smoke)
    n = meta.num_actual_tokens
    q, k, v = randn(n, HQ, D, device=dev), randn(n, HK, D, device=dev), randn(n, HK, D,
                                                                              device=dev)
    impl.do_kv_cache_update(kvcore.LayerScales(), k, v, view, meta.slot_mapping)
    out = impl.forward(kvcore.LayerScales(), q, k, v, view, meta)
    plain = impl.forward(kvcore.LayerScales(), q, k, v, view.contiguous(), meta)
    kc, vc = view.unbind(1)
    ref = kvcore.ops.paged_attention_ref(
        q.double(), kc.double(), vc.double(), query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens, block_table=meta.block_table, scale=impl.scale)
    err = float((out.double() - ref).norm() / ref.norm())
    run.check("flashinfer.mixed_batch_vs_float64", err < 1e-2, rel_err=err)
    run.check("flashinfer.cross_layer_vs_contiguous.bit_exact", torch.equal(out, plain))


# -- 3. cache write ----------------------------------------------------------------------------


def torch_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                offsets: torch.Tensor) -> None:
    """The plain-torch cache write (``index_put``), block and offset precomputed."""
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


def time_cache_write(run: Run) -> None:
    from kvcore_nvidia import ops

    from kvcore.ops.triton_cache import reshape_and_cache as triton_write

    dev = run.device
    set_value_checks(False)  # no host sync inside the timed (graph-captured) calls
    try:
        for n in ((256,) if run.smoke else (4096, 32768, 131072)):
            num_blocks = 2 * n // BS
            key, value = randn(n, HK, D, device=dev), randn(n, HK, D, device=dev)
            slots = torch.randperm(num_blocks * BS, device=dev)[:n]
            blocks, offsets = slots // BS, slots % BS
            nbytes = 2 * (2 * n * HK * D * 2) + 8 * n  # K and V read and written, slots read
            layouts = {"standard": randn(num_blocks, 2, BS, HK, D, device=dev)}
            if n >= 32768 or run.smoke:
                layouts["cross_layer"] = randn(num_blocks, 4, 2, BS, HK, D, device=dev)[:, 2]
            for layout, kv in layouts.items():
                kc, vc = kv.unbind(1)
                args = (key, value, kc, vc, slots)
                impls = {"csrc": functools.partial(ops.reshape_and_cache_flash, *args),
                         "triton": functools.partial(triton_write, *args)}
                if layout == "standard":
                    impls["torch"] = functools.partial(torch_write, *args, blocks, offsets)
                for name, fn in impls.items():
                    if name == "csrc" and dev != "cuda":
                        continue
                    t, how = time_call(fn, dev)
                    run.timing("cache_write", f"N={n}", name, t, how, nbytes, layout=layout,
                               ceiling="copy")
    finally:
        set_value_checks(True)


# -- 4. block copy -----------------------------------------------------------------------------


#: (method, streams) of kvcore_nvidia.ops.copy_blocks timed by the block-copy section.
COPY_VARIANTS = (("batch", 1), ("batch", 2), ("batch", 4), ("per_run", 1), ("per_run", 4),
                 ("kernel", 1))


def time_block_copy(run: Run) -> None:
    from kvcore_nvidia import ops

    dev = run.device
    page = 2 * BS * HK * D * 2  # one layer's block: 64 KiB
    total = (16 << 20) if run.smoke else (512 << 20)
    for run_bytes, label in ((32 * page, "2MiB"), (page, "64KiB")):
        count = total // run_bytes
        # Device blocks every other id: no two are adjacent, so each block is its own run.
        device_blocks = torch.empty(2 * count, run_bytes, dtype=torch.uint8, device=dev)
        host_blocks = torch.empty(count, run_bytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.arange(0, 2 * count, 2)
        on_host = torch.randperm(count)
        for direction in ("d2h", "h2d"):
            if direction == "d2h":
                src, dst, pairs = device_blocks, host_blocks, torch.stack([on_device, on_host], 1)
            else:
                src, dst, pairs = host_blocks, device_blocks, torch.stack([on_host, on_device], 1)
            src.random_()
            for method, streams in COPY_VARIANTS:
                name = method if streams == 1 else f"{method} x{streams} streams"
                dst.zero_()  # the check below then proves this variant's copy
                copies = ops.copy_blocks(src, dst, pairs, method, streams)
                torch.cuda.synchronize()
                same = torch.equal(host_blocks[on_host].cuda(), device_blocks[on_device.cuda()])
                run.check(f"copy_blocks.{label}.{direction}.{name}.exact", same, copies=copies)
                t, how = time_call(
                    functools.partial(ops.copy_blocks, src, dst, pairs, method, streams), dev,
                    graph=False)
                run.timing("block_copy", f"{label} {direction}", name, t, how,
                           count * run_bytes, copies=copies, ceiling=f"pinned_{direction}_GBps")


# -- 5. FLASHINFER decode ----------------------------------------------------------------------


def new_step_forward(impl: kvcore.AttentionImpl, layer: kvcore.LayerScales, q: torch.Tensor,
                     kv: torch.Tensor, meta: kvcore.AttentionMetadata,
                     out: torch.Tensor) -> None:
    """``forward`` given a fresh copy of ``meta``: what the first layer of a step costs."""
    impl.forward(layer, q, q, q, kv, dataclasses.replace(meta), output=out)


def time_flashinfer_decode(run: Run) -> None:
    dev = run.device
    set_value_checks(False)
    try:
        impl = flashinfer_impl()
        triton_impl = kvcore.resolve_backend("TRITON_ATTN").get_impl_cls()(
            num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK)
        for batch, length in ((64, 4096), (8, 32768), (16, 4096)):
            pages = length // BS
            num_blocks = batch * pages
            kv = randn(num_blocks, 2, BS, HK, D, device=dev)
            tables = torch.randperm(num_blocks).view(batch, pages).tolist()
            meta = kvcore.build_attention_metadata([1] * batch, [length - 1] * batch, tables,
                                                   BS, device=dev)
            q = randn(batch, HQ, D, device=dev)
            out = torch.empty_like(q)
            nbytes = 2 * batch * length * HK * D * 2 + 2 * q.numel() * 2
            case = f"{batch}x{length}"

            layer = kvcore.LayerScales()

            # A new step's metadata object each call: plan, then run (the first layer).
            first_layer = functools.partial(new_step_forward, impl, layer, q, kv, meta, out)
            t, how = time_call(first_layer, dev, graph=False)
            run.timing("decode", case, "FLASHINFER forward, new step (plan+run)", t, how,
                       nbytes, ceiling="read_torch_sum_GBps")
            # Later layers of the step get the same metadata: the plan is reused.
            forward = functools.partial(impl.forward, layer, q, q, q, kv, meta, output=out)
            t, how = time_call(forward, dev, graph=False)
            run.timing("decode", case, "FLASHINFER forward, same step (plan reused)", t, how,
                       nbytes, ceiling="read_torch_sum_GBps")
            wrapper = impl.plan(q, kv.unbind(1)[0], meta)
            t, how = time_call(functools.partial(wrapper.run, q, kv.unbind(1), out=out), dev)
            run.timing("decode", case, "FlashInfer run only", t, how, nbytes,
                       ceiling="read_torch_sum_GBps")
            fi_out = out.clone()
            triton_forward = functools.partial(triton_impl.forward, layer, q, q, q, kv, meta,
                                               output=out)
            t, how = time_call(triton_forward, dev)
            run.timing("decode", case, "TRITON_ATTN forward", t, how, nbytes,
                       ceiling="read_torch_sum_GBps")
            err = float((fi_out.double() - out.double()).norm() / out.double().norm())
            run.check(f"decode.{case}.flashinfer_vs_triton", err < 1e-2, rel_err=err)
    finally:
        set_value_checks(True)


# -- prebuild ----------------------------------------------------------------------------------


PREBUILDS = ("csrc", "flashinfer", "flashinfer-window", "flashinfer-d64")


def prebuild_one(what: str) -> None:
    """Build one thing (a child process of --prebuild)."""
    if what == "csrc":
        from kvcore_nvidia import ops

        ops.build_extension()
        return
    from kvcore_nvidia.backends.flashinfer import FlashInferBackend

    head_size = 64 if what == "flashinfer-d64" else D
    impl = FlashInferBackend.get_impl_cls()(
        num_heads=HQ, head_size=head_size, scale=head_size**-0.5, num_kv_heads=HK,
        sliding_window=256 if what == "flashinfer-window" else None)
    meta = mixed_metadata(64, "cuda", smoke=True)
    n = meta.num_actual_tokens
    kv = randn(64, 2, BS, HK, head_size, device="cuda")
    q = randn(n, HQ, head_size, device="cuda")
    impl.forward(kvcore.LayerScales(), q, q, q, kv, meta)
    decode = kvcore.build_attention_metadata([1, 1], [20, 40], [[0, 1], [2, 3, 4]], BS,
                                             device="cuda")
    impl.forward(kvcore.LayerScales(), q[:2], q, q, kv, decode)  # the decode wrapper
    torch.cuda.synchronize()


def prebuild() -> int:
    """Build the extension and the FlashInfer JIT modules the GPU tests use (bf16: head size
    128 with and without a sliding window, head size 64 for the conformance suite) in
    parallel processes: each is a separate nvcc/ninja job list."""
    start = time.time()
    jobs = {what: subprocess.Popen([sys.executable, __file__, "--prebuild-one", what])
            for what in PREBUILDS}
    failed = 0
    for what, proc in jobs.items():
        rc = proc.wait()
        failed += rc != 0
        print(f"prebuild {what}: rc={rc} at {time.time() - start:.1f}s", flush=True)
    return 1 if failed else 0


# -- summary -----------------------------------------------------------------------------------


def summary(run: Run) -> str:
    copy = max(ceiling(run, "device_copy_memcpy_GBps"), ceiling(run, "device_copy_sm_kernel_GBps"))
    names = {"copy": "copy", "read_torch_sum_GBps": "read", "pinned_d2h_GBps": "pinned",
             "pinned_h2d_GBps": "pinned"}
    rows = []
    for t in run.results["timings"]:
        key = t.get("ceiling")
        limit = copy if key == "copy" else ceiling(run, key) if key else float("nan")
        pct = f"{100 * t['GB/s'] / limit:.1f}% of {names[key]}" if key else ""
        rows.append([t["op"], t["case"], t.get("layout", ""), t["impl"], f"{t['us']:.1f}",
                     f"{t['GB/s']:.0f}", pct, t.get("copies", "")])
    checks = run.results["checks"]
    failed = [c["check"] for c in checks if not c["ok"]]
    lines = [
        "ceilings (GB/s, max of start/end): " + ", ".join(
            f"{k} {ceiling(run, k):.0f}" for k in sorted(
                {k for c in run.results["ceilings"].values() for k in c})),
        f"copy ceiling used for cache writes: {copy:.0f} GB/s (read + write)",
        f"checks: {len(checks) - len(failed)}/{len(checks)} passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        f"sections skipped: {len(run.results['skipped'])}"
        + "".join(f"\n  {e['section']}: {e['reason']}" for e in run.results["skipped"]),
        f"section errors: {len(run.results['errors'])}"
        + "".join(f"\n  {e['section']}: {e['error']}" for e in run.results["errors"]),
        "",
        harness.format_table(rows, ["op", "case", "layout", "impl", "us", "GB/s", "vs ceiling",
                                    "copies"], tablefmt="simple"),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    parser.add_argument("--prebuild", action="store_true",
                        help="only build the CUDA C++ extension and FlashInfer's JIT modules")
    parser.add_argument("--prebuild-one", choices=PREBUILDS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = parser.parse_args()
    if args.prebuild_one:
        prebuild_one(args.prebuild_one)
        return 0
    if args.prebuild:
        return prebuild()

    run = Run(args.out, args.smoke)
    meta = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
            "torch": torch.__version__, "smoke": args.smoke, "device": run.device,
            "shapes": {"hq": HQ, "hk": HK, "d": D, "bs": BS, "dtype": str(DTYPE)}}
    if run.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                    memory_GiB=props.total_memory / GiB)
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except Exception as exc:  # reported, and its sections fail with the same reason
        meta["flashinfer"] = f"unavailable: {type(exc).__name__}: {exc}"
    from kvcore_nvidia import ops
    from kvcore_nvidia.backends.flashinfer import FlashInferBackend

    no_csrc = ops.extension_unavailable_reason()
    no_flashinfer = "; ".join(FlashInferBackend.unavailable_reasons()) or (
        None if run.device == "cuda" else "needs an NVIDIA GPU")
    meta["csrc"] = no_csrc or "available"
    run.results["meta"] = meta
    run.log(json.dumps(meta))

    def need(reason: str | None) -> None:
        if reason:
            raise Skip(reason)

    with run.section("ceilings at start"):
        measure_ceilings(run, "start")
    with run.section("build the CUDA C++ extension"):
        need(no_csrc)
        t0 = time.time()
        ops.build_extension()
        run.log(f"extension ready in {time.time() - t0:.1f}s (cached builds load in ~1s)")
    with run.section("correctness: CUDA C++ cache write"):
        need(no_csrc)
        check_cache_write(run)
    with run.section("correctness: FLASHINFER"):
        need(no_flashinfer)
        check_flashinfer(run)
    with run.section("cache write timings"):
        time_cache_write(run)
    with run.section("block copy timings"):
        need(no_csrc)
        time_block_copy(run)
    with run.section("FLASHINFER decode timings"):
        need(no_flashinfer)
        time_flashinfer_decode(run)
    with run.section("ceilings at end"):
        measure_ceilings(run, "end")
    table = summary(run)
    run.log("\n" + table)
    run.save()
    failed = any(not c["ok"] for c in run.results["checks"]) or run.results["errors"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
