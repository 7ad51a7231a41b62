#!/usr/bin/env python3
"""An engine's decode step through kvcore: builder, CUDA-graph replay, value checks (one GPU).

One run does, in order, each section isolated (an error is logged and the run goes on):

1. correctness: a 32-layer decode step (write + attention per layer, Hq 32, Hk 8, D 128,
   bf16, block 16) of 5 requests padded to a captured batch of 8, for each backend (TRITON_ATTN,
   FLASHINFER when it imports): replayed from a CUDA graph (if the backend declares graph
   support) against the same step run eagerly on the same metadata (bit for bit), the step
   run eagerly on its own metadata, and the float64 reference (first and last layer);
2. the 32-layer step at B16 x 4096 and B64 x 4096 through kvcore's engine path: per step
   ``CudaGraphRunner.run`` (the builder copies the step into its buffers, then one replay)
   when the backend supports graphs, else ``builder.build`` and the 32 layers eagerly; 100
   steps back to back, wall time per step, beside the kernels' own time: the same 32 layers on
   metadata built once, replayed from a graph of repeated steps (no builder, no runner, no
   host work). The difference is the host overhead. The table also gives 32 times one
   layer's write and attention, each timed alone (layer 0 over and over, so part of its
   cache can stay in L2: a lower bound the step does not reach), and a profile of the
   host's work per step (cProfile of ``CudaGraphRunner.run``, top functions in the log);
3. one-layer decode at 64 x 4096, 8 x 32768, 256 x 1024, 16 x 4096: each backend through its
   builder (``graph_batch_size`` when it supports graphs) timed from a captured graph; beside
   it TRITON_ATTN's op called directly on the step's own metadata (no builder), FLASHINFER
   built for an eager step (FlashInfer's plain wrappers), and FlashInfer called directly
   (planned once, captured) when installed, plain and in FlashInfer's CUDA-graph mode (which
   a step replayed for later lengths needs: its launch is sized for any step); all of a
   shape's variants take turns for three rounds (each row: the fastest round; the JSON has
   all), and each kvcore row is compared with the direct call of the same mode;
4. the eager 32-layer step (TRITON_ATTN, B16 x 4096) with the default value checks (the step's
   facts, checked once), without value checks, and with the per-op reads of metadata an engine
   made itself (no builder, no marks: the behaviour before step facts);
5. the per-layer host table: one layer's calls, eager, on a step so small (one request of 64
   tokens) that the GPU waits for the host: ``do_kv_cache_update``, ``forward``, both, and
   ``update_and_forward``, host microseconds per call (launches back to back, no sync inside
   the timed loop), for each backend through its builder, and FlashInfer called directly
   (``append_paged_kv_cache`` + the decode wrapper's ``run``, planned once) when installed;
   beside them ``update_and_forward`` per layer of an engine's step (each layer its own impl
   and cache, the step built anew each time, the build not counted), and the GPU time of one
   attention call (CUDA events, its launches queued behind a device sleep so the host's
   launch time is not in it): a host time at or under it means the loop was paced by the
   device, not the host;
6. the MLA pipeline comparison of ``benchmarks/bench_mla_pipeline.py`` at B64 x 4096, 16 and
   128 heads (its ``bench_step_section`` appends rows to ``run.results["mla_pipeline"]``;
   the table prints them).

Section 2 also times the *synchronous* step: the same ``CudaGraphRunner.run`` (or eager step)
followed by a device sync every step, as an engine that samples every step runs; its time over
the kernels' is the builder's and the runner's host work the GPU cannot hide. A second table
splits it: the same 32 layers captured alone and replayed with a sync every step (the floor an
engine cannot go under: the graph's launch latency and the sync's return), the host time of
that replay call (and of one layer's graph: what a layer's nodes add to the launch), and the
builder's ``build`` alone. A third places ``CudaGraphRunner.run``'s host time stage by stage
in its own context (after the sync), with the CUDA API calls torch's profiler sees, and again
with the host waiting by a busy poll instead of ``torch.cuda.synchronize``; a fourth times
the same host work (pure Python, ``build``) right after waits on 0-11 ms of device work, by
both ways of waiting: whether a longer wait makes the same work slower.

The table printed last has the step times and ratios. Logs and JSON go to ``--out`` (default
``$OUT``, else ``benchmarks/results``). ``--cpu`` runs section 4 on the CPU with CPU_ATTN
(small shapes); ``--smoke`` runs tiny shapes on the CPU (Triton under ``TRITON_INTERPRET=1``)
to check the script.

``--host`` runs section 5 alone.

Usage: ``python benchmarks/bench_step.py [--out DIR] [--cpu | --smoke] [--host]``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
CPU = SMOKE or "--cpu" in sys.argv
if SMOKE:
    # CPU tensors: the kernels must run in the interpreter even on a machine with a GPU.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore  # noqa: E402
from kvcore import ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, rel_err  # noqa: E402
from kvcore.ops.reference import paged_attention_ref  # noqa: E402

DEVICE = "cpu" if CPU else "cuda"
# --smoke checks the script, not the speed: one timed sample a call.
time_call = functools.partial(harness.time_call, device=DEVICE, samples=1 if SMOKE else None)
DTYPE = torch.bfloat16
HQ, HK, D, BS, LAYERS = 32, 8, 128, 16, 32
STEP_SHAPES = [(16, 4096), (64, 4096)]
LAYER_SHAPES = [(64, 4096), (8, 32768), (256, 1024), (16, 4096)]
CHECK_SHAPE = (5, 1024, 8)  # requests, tokens each, captured batch size
CHECKS_SHAPE = (16, 4096)
STEPS = 20
#: The per-layer host table's step (one request: the kernels are shorter than the host's
#: work) and calls per timed loop.
HOST_SHAPE = (1, 64)
HOST_CALLS = 200
#: Steps per timed run of the 32-layer step: enough that filling the pipeline (the host
#: builds and launches the first step while the device is idle, about 0.5 ms) is under 0.3%.
TIMED_STEPS = 100
if CPU:
    DTYPE = torch.float32
    HQ, HK, D, LAYERS = 8, 2, 64, 32
    STEP_SHAPES, LAYER_SHAPES = [], []
    CHECK_SHAPE = (3, 64, 4)
    CHECKS_SHAPE = (4, 64)
    STEPS = TIMED_STEPS = 5
if SMOKE:
    LAYERS = 2
    CHECKS_SHAPE = (2, 64)
    STEPS = TIMED_STEPS = 2
    HOST_CALLS = 2
# --smoke runs only what runs on the CPU (FlashInfer needs a GPU even where it is installed).
BACKENDS = (["CPU_ATTN"] if not SMOKE else ["TRITON_ATTN"]) if CPU else ["TRITON_ATTN",
                                                                       "FLASHINFER"]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def spin_sync() -> None:
    """Wait for the device by polling an event in a busy loop: the thread never blocks in
    the driver, so the host stays awake (unlike ``torch.cuda.synchronize``)."""
    if DEVICE == "cuda":
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            pass


def available(name: str) -> str | None:
    """Why ``name`` cannot run here, or ``None``."""
    try:
        backend = kvcore.resolve_backend(name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    reasons = backend.unavailable_reasons()
    return "; ".join(reasons) if reasons else None


class Model:
    """``LAYERS`` attention layers of one backend over a shared random paged cache: the
    engine's side of a decode step (the same query, key and value feed every layer)."""

    def __init__(self, backend_name: str, b: int, length: int, max_num_seqs: int | None = None,
                 layers: int = LAYERS) -> None:
        self.backend = kvcore.resolve_backend(backend_name)
        self.b, self.length = b, length
        pages = -(-length // BS)
        self.num_blocks = b * pages + 8
        self.caches = kvcore.allocate_kv_caches(
            self.backend, num_layers=layers, num_blocks=self.num_blocks, block_size=BS,
            num_kv_heads=HK, head_size=D, dtype=DTYPE, device=DEVICE)
        self.caches.storage.normal_()
        gen = torch.Generator().manual_seed(b * 7919 + length)
        ids = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.tables = [ids[i * pages:(i + 1) * pages] for i in range(b)]
        # Decode: the step's token is the last of each request (the write lands in it).
        self.common = kvcore.build_attention_metadata([1] * b, [length - 1] * b, self.tables,
                                                      BS, device=DEVICE)
        self.spec = kvcore.FullAttentionSpec(block_size=BS, dtype=DTYPE, num_kv_heads=HK,
                                             head_size=D)
        seqs = max_num_seqs or b
        self.max_num_seqs = seqs
        self.builder = self.make_builder()
        self.impl = self.backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D**-0.5,
                                                num_kv_heads=HK)
        self.scales = kvcore.LayerScales()
        self.inputs = {"query": torch.randn(b, HQ, D, generator=gen).to(DEVICE, DTYPE),
                       "key": torch.randn(b, HK, D, generator=gen).to(DEVICE, DTYPE),
                       "value": torch.randn(b, HK, D, generator=gen).to(DEVICE, DTYPE)}
        self.outputs = [torch.empty(seqs, HQ, D, dtype=DTYPE, device=DEVICE) for _ in
                        self.caches.layers]
        self.graphs = self.backend.CUDA_GRAPH_SUPPORT is not kvcore.CudaGraphSupport.NEVER

    def make_builder(self) -> kvcore.AttentionMetadataBuilder:
        return self.backend.get_builder_cls()(
            self.spec, num_heads=HQ, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_seqs, max_model_len=self.length,
            device=DEVICE)

    def step(self, inputs: dict[str, torch.Tensor], meta: kvcore.AttentionMetadata
             ) -> torch.Tensor:
        """Every layer's write and attention; the outputs side by side ``(rows, LAYERS, HQ,
        D)`` (a fresh tensor, so a captured graph owns it)."""
        rows = inputs["query"].shape[0]
        for layer, out in zip(self.caches.layers, self.outputs, strict=True):
            self.impl.do_kv_cache_update(self.scales, inputs["key"], inputs["value"], layer,
                                         meta.slot_mapping)
            self.impl.forward(self.scales, inputs["query"], inputs["key"], inputs["value"],
                              layer, meta, output=out[:rows])
        return torch.stack([out[:rows] for out in self.outputs], dim=1)

    def runner(self, sizes: list[int]) -> kvcore.CudaGraphRunner:
        runner = kvcore.CudaGraphRunner(self.builder, self.step, num_blocks=self.num_blocks,
                                        batch_sizes=sizes)
        runner.capture({k: v[:1] for k, v in self.inputs.items()})
        return runner

    def reference(self, layer: int) -> torch.Tensor:
        k, v = self.caches.layers[layer].unbind(1)
        m = self.common
        return paged_attention_ref(self.inputs["query"].double(), k.double(), v.double(),
                                   query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                                   block_table=m.block_table, scale=D**-0.5)


def padded(inputs: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    return {k: torch.cat([v, v.new_zeros((size - v.shape[0], *v.shape[1:]))])
            for k, v in inputs.items()}


def wall_per_step(fn: Callable[[], object], steps: int = STEPS) -> float:
    """Seconds per call of ``fn`` run back to back (host and device overlap, as in an
    engine), after up to three warm-up calls."""
    for _ in range(min(3, steps)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps


def sync_step_us(fn: Callable[[], object], steps: int = STEPS, *,
                 count_sync: bool = True, wait: Callable[[], None] = sync) -> float:
    """Median microseconds of ``fn`` followed by a device sync (nothing overlaps the next
    call's host work), after three warm-up calls; ``count_sync=False`` times the call alone
    (its host time: the sync after it is not counted). ``wait``: how the host waits for the
    device (default ``torch.cuda.synchronize``; :func:`spin_sync` polls)."""
    for _ in range(min(3, steps)):
        fn()
    wait()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        if count_sync:
            wait()
        times.append(time.perf_counter() - t0)
        wait()
    return sorted(times)[len(times) // 2] * 1e6


def wake_probe(build: Callable[[], object], steps: int = 21) -> list[dict[str, float]]:
    """Host microseconds of a fixed piece of host work right after the host waited for the
    device to finish ``busy_ms`` of work, by how it waited: ``torch.cuda.synchronize`` or a
    busy poll (:func:`spin_sync`). Two pieces: pure Python (no CUDA call) and ``build`` (the
    builder's step: Python and four small copies). If the same work takes longer after a
    longer wait, the host, not kvcore's code, is what a synchronous step exposes."""
    def python_work() -> int:
        return sum(len(str(i)) for i in range(300))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    rows = []
    for busy_ms in (0.0, 1.0, 3.0, 11.0):
        for name, wait in (("synchronize", sync), ("spin", spin_sync)):
            for work_name, work in (("python", python_work), ("build", build)):
                times = []
                for i in range(steps + 2):
                    if busy_ms:
                        torch.cuda._sleep(int(busy_ms * cycles_per_ms))
                    wait()
                    t0 = time.perf_counter()
                    work()
                    t = time.perf_counter() - t0
                    if i >= 2:
                        times.append(t * 1e6)
                sync()
                rows.append({"busy_ms": busy_ms, "wait": name, "work": work_name,
                             "host_us": sorted(times)[len(times) // 2]})
    return rows


def device_us(fn: Callable[[], object], calls: int = 21, *,
              hold_s: float = 200e-6) -> float | None:
    """GPU microseconds of one call of ``fn``: its kernels and the gaps between them, with the
    launches queued behind a short device sleep so that the host's launch time is not counted
    (CUDA events; median of ``calls``); ``None`` off CUDA. Beside :func:`host_us` it tells
    whether a loop of calls was paced by the host or by the device (host time per call at or
    under this: the device's)."""
    if DEVICE != "cuda":
        return None
    clock = harness.Clock(torch.device(DEVICE))
    times = []
    for _ in range(calls):
        sync()
        clock.hold(hold_s)  # longer than the host takes to launch one call
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def host_us(fn: Callable[[], object], calls: int = HOST_CALLS, rounds: int = 5) -> float:
    """Host microseconds per call of ``fn``: the fastest of ``rounds`` loops of ``calls``
    calls back to back with no sync inside the timed loop (launches are asynchronous, so this
    is the host's time while the device keeps up), a sync after each loop."""
    for _ in range(min(10, calls)):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        sync()
    return best * 1e6


def host_profile(fn: Callable[[], object], steps: int = STEPS, top: int = 18) -> str:
    """cProfile of ``steps`` calls of ``fn`` (a sync after each, outside the profile): the
    functions with the most time of their own, where a step's host time goes."""
    profile = cProfile.Profile()
    for _ in range(steps):
        profile.enable()
        fn()
        profile.disable()
        sync()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def profile_step(run: Run, name: str, b: int, length: int, steps: int = 30) -> None:
    """``steps`` replayed steps back to back under ``torch.profiler``: the CUDA runtime calls
    that took the host longest (a synchronising call shows here), and the device's idle time
    between its kernels and copies (what the host left exposed)."""
    from torch.profiler import ProfilerActivity, profile

    model = Model(name, b, length)
    runner = model.runner([b])
    for _ in range(3):
        runner.run(model.inputs, model.common)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.run(model.inputs, model.common)
        sync()
    run.log(f"profile of {steps} steps of {name} {b}x{length}, host side (self time):\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    gaps, end, last = [], None, ""
    for e in events:  # idle = no kernel or copy running (they may overlap)
        if end is not None and e.time_range.start - end > 3:
            gaps.append((e.time_range.start - end, last, e.name[:60]))
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e.name[:60]
    span = events[-1].time_range.end - events[0].time_range.start if events else 0
    idle = sum(g for g, _, _ in gaps)
    run.log(f"device: {len(events)} kernels/copies over {span:.0f} us, idle {idle:.0f} us in "
            f"{len(gaps)} gaps > 3 us; the largest:\n" + "\n".join(
                f"  {g:8.1f} us after {p} before {n}" for g, p, n in sorted(gaps)[::-1][:15]))


def interleaved(fns: dict[str, Callable[[], object]], rounds: int = 5,
                steps: int = STEPS) -> dict[str, float]:
    """Median over ``rounds`` of :func:`wall_per_step` for each variant, the variants taking
    turns within a round (load from other processes then drifts into all of them alike)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(wall_per_step(fn, steps))
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


# ----------------------------------------------------------------------------- sections


def check_step(run: Run, name: str) -> None:
    b, length, size = CHECK_SHAPE
    model = Model(name, b, length, max_num_seqs=size)
    eager = model.step(model.inputs, model.builder.build(model.common)).clone()
    row: dict = {"backend": name, "shape": f"{b}x{length}", "layers": LAYERS}
    for layer in (0, LAYERS - 1):
        row[f"rel_err_eager_vs_ref_layer{layer}"] = rel_err(eager[:, layer], model.reference(layer))
    if model.graphs and DEVICE == "cuda":
        runner = model.runner([size])
        replayed = runner.run(model.inputs, model.common).clone()
        same_meta = model.step(padded(model.inputs, size),
                               model.builder.build(model.common, graph_batch_size=size))[:b]
        row["replay_equals_eager_same_metadata"] = bool(torch.equal(replayed, same_meta))
        row["rel_err_replay_vs_eager"] = rel_err(replayed, eager)
        for layer in (0, LAYERS - 1):
            row[f"rel_err_replay_vs_ref_layer{layer}"] = rel_err(replayed[:, layer],
                                                                 model.reference(layer))
        row["replayed_steps"] = runner.replayed_steps
    errs = [v for k, v in row.items() if k.startswith("rel_err")]
    row["ok"] = max(errs) < 2e-2 and row.get("replay_equals_eager_same_metadata", True)
    run.results["correctness"].append(row)
    run.log(json.dumps(row))


def time_step(run: Run, name: str, b: int, length: int) -> None:
    model = Model(name, b, length)
    row: dict = {"backend": name, "shape": f"{b}x{length}", "layers": LAYERS,
                 "cuda_graphs": model.backend.CUDA_GRAPH_SUPPORT.value}
    if model.graphs:
        runner = model.runner([b])
        row["path"] = "builder + graph replay"
        row["step_us"] = wall_per_step(lambda: runner.run(model.inputs, model.common),
                                       TIMED_STEPS) * 1e6
        host = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            runner.run(model.inputs, model.common)
            host.append(time.perf_counter() - t0)
            sync()
        row["host_us_per_step"] = sorted(host)[len(host) // 2] * 1e6
        row["replayed_steps"] = runner.replayed_steps
        run.log(f"host profile, {STEPS} steps of {name} {b}x{length}:\n"
                + host_profile(lambda: runner.run(model.inputs, model.common)))
    else:
        row["path"] = "builder + eager layers"
        row["step_us"] = wall_per_step(
            lambda: model.step(model.inputs, model.builder.build(model.common)),
            TIMED_STEPS) * 1e6
    # The kernels' own times: the step's 32 layers on metadata built once (what a replay
    # runs, with no builder and no runner around it), and one layer's write and attention,
    # each alone (layer 0 again and again: part of its cache may stay in L2 between calls,
    # which the step, reading 32 different caches, never gets).
    meta = (model.builder.build(model.common, graph_batch_size=b) if model.graphs
            else model.builder.build(model.common))
    layer, out = model.caches.layers[0], model.outputs[0]
    q, k, v = (model.inputs[n] for n in ("query", "key", "value"))
    checks = ops.value_checks_enabled()
    ops.set_value_checks(False)  # kernels only: what the graph replays
    try:
        t_kernels, how_k = time_call(lambda: model.step(model.inputs, meta))
        t_write, how_w = time_call(lambda: model.impl.do_kv_cache_update(
            model.scales, k, v, layer, meta.slot_mapping))
        t_attn, how_a = time_call(lambda: model.impl.forward(model.scales, q, k, v, layer, meta,
                                                             output=out))
    finally:
        ops.set_value_checks(checks)
    row.update(kernels_us=t_kernels * 1e6, write_us=t_write * 1e6, attention_us=t_attn * 1e6,
               timing=f"{how_k}; {how_w}, {how_a}",
               isolated_kernels_us=LAYERS * (t_write + t_attn) * 1e6)
    row["host_overhead_pct"] = 100 * (row["step_us"] - row["kernels_us"]) / row["step_us"]
    # The synchronous step: an engine that samples every step waits for the device, so the
    # next step's builder and runner work is exposed (the kernels cannot hide it).
    step = ((lambda: runner.run(model.inputs, model.common)) if model.graphs
            else (lambda: model.step(model.inputs, model.builder.build(model.common))))
    row["sync_step_us"] = sync_step_us(step)
    row["sync_overhead_pct"] = 100 * (row["sync_step_us"] - row["kernels_us"]) / row["kernels_us"]
    row["host_overhead_vs_isolated_pct"] = (
        100 * (row["step_us"] - row["isolated_kernels_us"]) / row["step_us"])
    run.results["steps"].append(row)
    if model.graphs:  # after the row is kept: a failure here loses only the breakdown
        row.update(sync_breakdown(model, meta, runner))
    run.log(json.dumps(row))


def sync_breakdown(model: Model, meta: kvcore.AttentionMetadata,
                   runner: kvcore.CudaGraphRunner) -> dict[str, float | None]:
    """Where a synchronous replayed step's time over its kernels goes: the same 32 layers
    captured alone in one graph (metadata built once, no builder, no runner), replayed and
    synchronised every step (the floor: the graph's launch latency and the sync's return);
    the host time of that replay call alone, of the builder's ``build`` alone and of the
    runner's whole step (build, copies, replay) without the sync; and the GPU time of the
    runner's step and of the bare replay (launches queued behind a device sleep, so no host
    time is in them). The synchronous step minus the bare replay is what the builder and the
    runner add: host time where the runner's host time accounts for it, else device time (the
    runner's step running longer on the GPU than the bare replay). To place the runner's host
    time: its own graph's replay call alone, and the bare replay right behind ``build`` (its
    copies pending on the stream). Last, the synchronous step of an engine that wrote the step
    into the builder's buffers itself (no copies in build), and of one that also wrote its
    inputs into the runner's (``input_buffers``: no input copy either)."""
    def captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # allocations outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fn()
        return graph

    graph = captured(lambda: model.step(model.inputs, meta))
    q, k, v = (model.inputs[n] for n in ("query", "key", "value"))
    layer, out = model.caches.layers[0], model.outputs[0]
    # One layer's write and attention alone: with the 32-layer replay, the launch's cost per
    # layer's nodes.
    one = captured(lambda: model.impl.update_and_forward(model.scales, q, k, v, layer, meta,
                                                         output=out))
    b = model.b
    # The step an engine wrote straight into the builder's buffers: its tensors are the views
    # build returns (the builder copies nothing).
    views = model.builder.build(model.common, graph_batch_size=b)
    in_place = dataclasses.replace(
        model.common, query_start_loc=views.query_start_loc, seq_lens=views.seq_lens,
        block_table=views.block_table, slot_mapping=views.slot_mapping)
    own_inputs = runner.input_buffers(model.common.num_seqs)
    for name, view in own_inputs.items():
        view.copy_(model.inputs[name])
    return {"bare_replay_sync_us": sync_step_us(graph.replay),
            "sync_step_in_place_us": sync_step_us(lambda: runner.run(model.inputs, in_place)),
            "sync_step_all_in_place_us": sync_step_us(lambda: runner.run(own_inputs, in_place)),
            "bare_replay_host_us": sync_step_us(graph.replay, count_sync=False),
            "one_layer_replay_host_us": sync_step_us(one.replay, count_sync=False),
            "build_host_us": sync_step_us(
                lambda: model.builder.build(model.common, graph_batch_size=b),
                count_sync=False),
            "runner_host_us": sync_step_us(lambda: runner.run(model.inputs, model.common),
                                           count_sync=False),
            # Where runner.run's host time goes beyond build: its own graph's replay call
            # alone (the runner's private graph for this size), and the bare graph's replay
            # right behind build's copies (a launch on a stream with work pending).
            "runner_graph_replay_host_us": sync_step_us(runner._graphs[b].graph.replay,
                                                        count_sync=False),
            "build_then_bare_replay_host_us": sync_step_us(
                lambda: (model.builder.build(model.common, graph_batch_size=b),
                         graph.replay()), count_sync=False),
            "runner_device_us": device_us(lambda: runner.run(model.inputs, model.common),
                                          hold_s=2e-3),
            "bare_replay_device_us": device_us(graph.replay),
            "runner_stages_host_us": runner_stages_us(runner, model.inputs, model.common),
            "runner_stages_spin_host_us": runner_stages_us(runner, model.inputs, model.common,
                                                           wait=spin_sync),
            "sync_step_spin_us": sync_step_us(lambda: runner.run(model.inputs, model.common),
                                              wait=spin_sync),
            "bare_replay_spin_us": sync_step_us(graph.replay, wait=spin_sync),
            "wake": wake_probe(lambda: model.builder.build(model.common, graph_batch_size=b)),
            "runner_runtime_api": runtime_api_us(
                lambda: runner.run(model.inputs, model.common)),
            "bare_replay_runtime_api": runtime_api_us(graph.replay)}


def runner_stages_us(runner: kvcore.CudaGraphRunner, inputs: dict[str, torch.Tensor],
                     common: kvcore.AttentionMetadata, steps: int = STEPS,
                     wait: Callable[[], None] = sync) -> dict[str, float]:
    """Host microseconds (median) of each stage of ``CudaGraphRunner.run``'s replayed step, in
    its order and context (each step after a device sync, as in a synchronous engine):
    ``build``, the checked-facts lookup, the capture-signature check, the inputs' foreach copy
    and the graph's replay call. The stages are the runner's own (its private members: this
    script places its time, it is no API)."""
    from kvcore.step_facts import checked_step_facts

    size, n = runner.graph_size(common), common.num_seqs
    assert size is not None, "the step must replay"
    entry = runner._graphs[size]
    names = ("build", "facts", "signature", "copy inputs", "replay")
    samples: dict[str, list[float]] = {k: [] for k in names}
    for i in range(steps + 3):
        wait()
        marks = [time.perf_counter()]
        meta = runner.builder.build(common, graph_batch_size=size)
        marks.append(time.perf_counter())
        checked_step_facts(meta.query_start_loc, meta.seq_lens, meta.block_table,
                           meta.slot_mapping)
        marks.append(time.perf_counter())
        runner._signature(meta)
        marks.append(time.perf_counter())
        torch._foreach_copy_([runner._inputs[k][:n] for k in inputs], list(inputs.values()))
        marks.append(time.perf_counter())
        entry.graph.replay()
        marks.append(time.perf_counter())
        if i >= 3:  # warm-up
            for k, a, b in zip(names, marks[:-1], marks[1:], strict=True):
                samples[k].append((b - a) * 1e6)
    sync()
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


def runtime_api_us(fn: Callable[[], object], steps: int = 20, top: int = 8
                   ) -> list[tuple[str, int, float]]:
    """The CUDA runtime and driver calls of ``fn`` under torch's profiler, a device sync after
    each call: ``(name, calls per step, host microseconds per step)``, the costliest first (a
    call that blocks on the device, or a launch that stalls, shows here)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
            sync()
    rows = [(e.key, e.count / steps, e.self_cpu_time_total / steps)
            for e in prof.key_averages() if e.key.startswith("cu")]
    return sorted(rows, key=lambda r: -r[2])[:top]


def flashinfer_direct(model: Model, graph_mode: bool = False) -> Callable[[], torch.Tensor]:
    """FlashInfer's decode wrapper called directly on the layer-0 cache, planned once;
    ``graph_mode``: in FlashInfer's CUDA-graph mode (its page lists in buffers given at
    construction)."""
    import flashinfer

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    b, pages = model.b, len(model.tables[0])
    indptr = (torch.arange(b + 1, device=DEVICE) * pages).to(torch.int32)
    indices = torch.tensor(model.tables, dtype=torch.int32, device=DEVICE).flatten()
    last = torch.full((b,), model.length - (pages - 1) * BS, dtype=torch.int32, device=DEVICE)
    graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.clone(),
                 paged_kv_indices_buffer=indices.clone(),
                 paged_kv_last_page_len_buffer=last.clone()) if graph_mode else {}
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=True, backend="fa2", **graph)
    wrapper.plan(indptr, indices, last, HQ, HK, D, BS, q_data_type=DTYPE, kv_data_type=DTYPE,
                 sm_scale=D**-0.5)
    out = torch.empty_like(model.inputs["query"])
    kv = model.caches.layers[0]
    return lambda: wrapper.run(model.inputs["query"], kv, out=out)


def op_direct(model: Model) -> Callable[[], torch.Tensor]:
    """TRITON_ATTN's op called directly on the layer-0 cache with the step's own (eager)
    metadata and the op's default launch choices: no builder, no persistent buffers."""
    kc, vc = model.caches.layers[0].unbind(1)
    m, q, out = model.common, model.inputs["query"], model.outputs[0]
    return lambda: ops.triton_paged_attention(
        q, kc, vc, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
        block_table=m.block_table, scale=D**-0.5, output=out)


def op_splits(model: Model) -> int:
    """The split count TRITON_ATTN's op chooses by itself for the model's step."""
    m = model.common
    return ops.default_num_kv_splits(m.num_actual_tokens, m.num_seqs, HK,
                                 m.block_table.shape[1] * BS, torch.device(DEVICE))


def time_layer(run: Run, b: int, length: int, names: list[str], flashinfer: bool) -> None:
    """Every variant of one shape timed in the same rounds, taking turns (a drift of the
    device's clocks then touches all of them alike)."""
    shape = f"{b}x{length}"
    nbytes = 2 * b * length * HK * D * DTYPE.itemsize
    # name -> (call, mode, model it reads, splits or None)
    variants: dict[str, tuple[Callable[[], torch.Tensor], str, Model, int | None]] = {}
    models = []
    for name in names:
        with run.section(f"one-layer decode {shape} {name}: setup"):
            model = Model(name, b, length, layers=1)
            models.append(model)
            q, k, v = (model.inputs[n] for n in ("query", "key", "value"))
            layer, out = model.caches.layers[0], model.outputs[0]

            def forward(meta, model=model, q=q, k=k, v=v, layer=layer, out=out):
                return lambda: model.impl.forward(model.scales, q, k, v, layer, meta,
                                                  output=out)

            meta = (model.builder.build(model.common, graph_batch_size=b) if model.graphs
                    else model.builder.build(model.common))
            plan = getattr(meta, "plan", None)
            variants[f"kvcore {name}"] = (forward(meta), "graph" if name == "FLASHINFER"
                                          else "plain", model,
                                          getattr(plan, "num_kv_splits", None))
            if name.startswith("TRITON_ATTN"):
                # The same kernel without the builder: what a difference between the two
                # rows owes to the builder's metadata (splits, buffers) and not to the kernel.
                variants[f"{name} op, eager metadata"] = (op_direct(model), "plain", model,
                                                          op_splits(model))
            if name == "FLASHINFER":
                # The step built for eager layers (FlashInfer's plain wrappers), by a second
                # builder: a build overwrites the step the previous build returned.
                eager = model.make_builder().build(model.common)
                variants[f"kvcore {name}, eager plan"] = (forward(eager), "plain", model, None)
    if flashinfer and models:
        with run.section(f"one-layer decode {shape} flashinfer direct: setup"):
            model = models[0]
            variants["flashinfer direct"] = (flashinfer_direct(model), "plain", model, None)
            variants["flashinfer direct, graph mode"] = (
                flashinfer_direct(model, graph_mode=True), "graph", model, None)
    with run.section(f"one-layer decode {shape}"):
        # One float64 reference per model (several variants read the same one).
        refs = {id(m): m.reference(0) for m in models}
        errs = {impl: rel_err(call().clone(), refs[id(model)])
                for impl, (call, _, model, _) in variants.items()}
        timed = harness.time_alternating({impl: v[0] for impl, v in variants.items()},
                                         DEVICE, rounds=3)
        for impl, (t, samples, how) in timed.items():
            _, mode, _, splits = variants[impl]
            row = {"impl": impl, "shape": shape, "time_us": t * 1e6,
                   "GBps": nbytes / t / 1e9, "timing": how, "mode": mode,
                   "rounds_us": [x * 1e6 for x in samples], "num_kv_splits": splits,
                   "rel_err_vs_ref": errs[impl]}
            run.results["layers"].append(row)
            run.log(json.dumps(row))


def time_checks(run: Run, name: str) -> None:
    b, length = CHECKS_SHAPE
    model = Model(name, b, length)
    own = kvcore.AttentionMetadata(  # tensors an engine made itself: not marked
        *(t.clone() for t in (model.common.query_start_loc, model.common.seq_lens,
                              model.common.block_table, model.common.slot_mapping)),
        model.common.max_query_len, model.common.max_seq_len, model.common.num_actual_tokens)
    variants = {
        "value checks on (step facts, default)":
            lambda: model.step(model.inputs, model.builder.build(model.common)),
        "value checks on, engine-made metadata (one read per step)":
            lambda: model.step(model.inputs, model.builder.build(
                kvcore.AttentionMetadata(*(t.clone() for t in (
                    own.query_start_loc, own.seq_lens, own.block_table, own.slot_mapping)),
                    own.max_query_len, own.max_seq_len, own.num_actual_tokens))),
        "value checks on, read by every op (no builder, no marks)":
            lambda: model.step(model.inputs, own),
    }
    checks = ops.value_checks_enabled()

    def checks_off() -> None:
        ops.set_value_checks(False)
        try:
            model.step(model.inputs, model.builder.build(model.common))
        finally:
            ops.set_value_checks(checks)

    times = interleaved({**variants, "value checks off": checks_off},
                        rounds=1 if SMOKE else 5)
    off = times["value checks off"]
    for what, t in times.items():
        row = {"backend": name, "shape": f"{b}x{length}", "layers": LAYERS, "variant": what,
               "step_us": t * 1e6, "vs_checks_off": t / off}
        run.results["checks"].append(row)
        run.log(json.dumps(row))
    # The validators alone (what the checks add to a step's host time on any device).
    q, k, v = (model.inputs[n] for n in ("query", "key", "value"))
    layer = model.caches.layers[0]
    kc, vc = layer.unbind(1)

    def validators(meta: kvcore.AttentionMetadata) -> Callable[[], None]:
        def fn() -> None:
            for _ in range(LAYERS):
                ops.validate_reshape_and_cache(k, v, kc, vc, meta.slot_mapping)
                ops.validate_paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens,
                                             meta.block_table, output=model.outputs[0][:b])
        return fn

    def validators_off() -> None:
        ops.set_value_checks(False)
        try:
            validators(model.common)()
        finally:
            ops.set_value_checks(checks)

    times = interleaved({"validators: step facts (default)": validators(model.common),
                         "validators: read by every op": validators(own),
                         "validators: value checks off": validators_off},
                        rounds=1 if SMOKE else 5, steps=20)
    off = times["validators: value checks off"]
    for what, t in times.items():
        row = {"backend": name, "shape": f"{b}x{length}", "layers": LAYERS, "variant": what,
               "step_us": t * 1e6, "vs_checks_off": t / off}
        run.results["checks"].append(row)
        run.log(json.dumps(row))


def flashinfer_direct_layer(model: Model) -> dict[str, Callable[[], object]]:
    """FlashInfer called directly on the model's layer-0 cache (NHD): the decode step's
    ``append_paged_kv_cache`` and the decode wrapper's ``run`` (planned once), as an engine
    on FlashInfer alone makes them per layer."""
    import flashinfer

    b, pages = model.b, len(model.tables[0])
    kv = model.caches.layers[0]
    indices = torch.tensor(model.tables, dtype=torch.int32, device=DEVICE).flatten()
    indptr = (torch.arange(b + 1, device=DEVICE) * pages).to(torch.int32)
    last = torch.full((b,), model.length - (pages - 1) * BS, dtype=torch.int32, device=DEVICE)
    batch = torch.arange(b, dtype=torch.int32, device=DEVICE)
    positions = torch.full((b,), model.length - 1, dtype=torch.int32, device=DEVICE)
    k, v = model.inputs["key"], model.inputs["value"]
    attend = flashinfer_direct(model)

    def write() -> None:
        flashinfer.append_paged_kv_cache(k, v, batch, positions, kv, indices, indptr, last,
                                         kv_layout="NHD")

    def both() -> None:
        write()
        attend()

    return {"write": write, "attend": attend, "write + attend": both}


def time_host(run: Run, names: list[str], flashinfer: bool) -> None:
    """Section 5: host microseconds per call of one layer's calls (see the module)."""
    b, length = HOST_SHAPE
    for name in names:
        with run.section(f"per-layer host time {name}"):
            model = Model(name, b, length, layers=1)
            meta = model.builder.build(model.common)
            impl, sc, layer, out = model.impl, model.scales, model.caches.layers[0], \
                model.outputs[0]
            q, k, v = (model.inputs[n] for n in ("query", "key", "value"))

            def write(impl=impl, sc=sc, k=k, v=v, layer=layer, meta=meta) -> None:
                impl.do_kv_cache_update(sc, k, v, layer, meta.slot_mapping)

            def attend(impl=impl, sc=sc, q=q, k=k, v=v, layer=layer, meta=meta, out=out):
                impl.forward(sc, q, k, v, layer, meta, output=out)

            def both(write=write, attend=attend) -> None:
                write()
                attend()

            row = {"impl": f"kvcore {name}", "shape": f"{b}x{length}",
                   "write_us": host_us(write), "attend_us": host_us(attend),
                   "write_attend_us": host_us(both), "attend_gpu_us": device_us(attend)}
            row["update_and_forward_us"] = host_us(
                lambda impl=impl, sc=sc, q=q, k=k, v=v, layer=layer, meta=meta, out=out:
                impl.update_and_forward(sc, q, k, v, layer, meta, output=out))
            row["step_update_and_forward_us"] = step_host_us(name, b, length)
            run.results["host"].append(row)
            run.log(json.dumps(row))
            # Where the host time goes (self time): explains the row beside it.
            run.log(f"cProfile of kvcore {name} write + attention:\n"
                    + host_profile(both, steps=HOST_CALLS, top=14))
            if name == "FLASHINFER" and flashinfer:
                calls = flashinfer_direct_layer(model)
                row = {"impl": "flashinfer direct", "shape": f"{b}x{length}",
                       "write_us": host_us(calls["write"]), "attend_us": host_us(calls["attend"]),
                       "write_attend_us": host_us(calls["write + attend"]),
                       "attend_gpu_us": device_us(calls["attend"])}
                run.results["host"].append(row)
                run.log(json.dumps(row))
                run.log("cProfile of flashinfer direct write + attention:\n"
                        + host_profile(calls["write + attend"], steps=HOST_CALLS, top=14))


def step_host_us(name: str, b: int, length: int) -> float:
    """Host microseconds per layer of an engine's eager step: ``LAYERS`` layers, each with its
    own impl and cache, ``update_and_forward`` on metadata the builder builds anew every step
    (what a layer's call keeps per step is found by the step's first layer, what it keeps per
    layer is found again each step); the build's own time is taken out."""
    model = Model(name, b, length)
    layers = [(model.backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D**-0.5,
                                            num_kv_heads=HK), cache, out[:b])
              for cache, out in zip(model.caches.layers, model.outputs, strict=True)]
    q, k, v = (model.inputs[n] for n in ("query", "key", "value"))

    def build() -> kvcore.AttentionMetadata:
        return model.builder.build(model.common)

    def step() -> None:
        meta = build()
        for impl, cache, out in layers:
            impl.update_and_forward(model.scales, q, k, v, cache, meta, output=out)

    calls = max(1, HOST_CALLS // LAYERS)
    return (host_us(step, calls) - host_us(build, calls)) / LAYERS


def mla_pipeline(run: Run) -> None:
    """Section 6: ``benchmarks/bench_mla_pipeline.py``'s comparison at B64 x 4096."""
    import bench_mla_pipeline

    bench_mla_pipeline.bench_step_section(run, device=DEVICE, smoke=SMOKE)


# ----------------------------------------------------------------------------- summary


def summary_table(run: Run) -> str:
    table = functools.partial(harness.format_table, tablefmt="simple")
    r = run.results
    parts = []
    # The step checks (the MLA section's checks are in its own rows).
    steps_checked = [c for c in r["correctness"] if "backend" in c]
    if steps_checked:
        parts.append(table(
            [[c["backend"], c["shape"], c.get("replay_equals_eager_same_metadata", "-"),
              f"{c.get('rel_err_replay_vs_ref_layer0', float('nan')):.2e}",
              f"{c['rel_err_eager_vs_ref_layer0']:.2e}", "ok" if c["ok"] else "FAIL"]
             for c in steps_checked],
            headers=["correctness", "shape", "replay == eager", "replay vs ref",
                     "eager vs ref", ""]))
    if r["steps"]:
        parts.append(table(
            [[s["backend"], s["shape"], s["path"], f"{s['step_us'] / 1e3:.3f}",
              f"{s['kernels_us'] / 1e3:.3f}", f"{s['host_overhead_pct']:.1f}%",
              f"{s['isolated_kernels_us'] / 1e3:.3f}",
              f"{s.get('host_us_per_step', float('nan')):.0f}",
              f"{s['sync_step_us'] / 1e3:.3f}", f"{s['sync_overhead_pct']:.1f}%"]
             for s in r["steps"]],
            headers=[f"{LAYERS}-layer decode step", "shape", "path", "step ms",
                     "kernels ms (in the step)", "host overhead",
                     "32 x one layer alone, ms", "host us/step", "synchronous step ms",
                     "synchronous over kernels"]))
        bare = [s for s in r["steps"] if "bare_replay_sync_us" in s]

        def gpu_over(s: dict) -> str:
            runner, alone = s.get("runner_device_us"), s.get("bare_replay_device_us")
            return f"{runner - alone:.0f}" if runner is not None and alone is not None else "-"

        if bare:
            parts.append(table(
                [[s["backend"], s["shape"], f"{s['sync_step_us'] - s['kernels_us']:.0f}",
                  f"{s['bare_replay_sync_us'] - s['kernels_us']:.0f}",
                  f"{s['sync_step_us'] - s['bare_replay_sync_us']:.0f}",
                  f"{s['bare_replay_host_us']:.0f}", f"{s['one_layer_replay_host_us']:.0f}",
                  f"{s['build_host_us']:.0f}", f"{s['runner_host_us']:.0f}",
                  f"{s['runner_graph_replay_host_us']:.0f}",
                  f"{s['build_then_bare_replay_host_us']:.0f}",
                  gpu_over(s), f"{s['sync_step_in_place_us'] - s['kernels_us']:.0f}",
                  f"{s.get('sync_step_all_in_place_us', float('nan')) - s['kernels_us']:.0f}"]
                 for s in bare],
                headers=["synchronous step over kernels", "shape", "total us",
                         "bare replay + sync us", "builder + runner us",
                         f"bare replay call ({LAYERS} layers), host us",
                         "same, one layer", "build, host us", "runner.run, host us",
                         "its graph's replay call, host us", "build + bare replay, host us",
                         "runner's step over the bare replay, GPU us",
                         "total, step written in place, us",
                         "same, inputs too (input_buffers), us"]))
            staged = [s for s in bare if "runner_stages_host_us" in s]
            if staged:
                stages = list(staged[0]["runner_stages_host_us"])
                parts.append(table(
                    [[s["backend"], s["shape"], wait,
                      *(f"{s[key][k]:.1f}" for k in stages),
                      "; ".join(f"{name} x{calls:g} {us:.0f}"
                                for name, calls, us in s["runner_runtime_api"][:4])
                      if wait == "synchronize" else
                      f"{s['sync_step_spin_us'] - s['kernels_us']:.0f} "
                      f"(bare replay {s['bare_replay_spin_us'] - s['kernels_us']:.0f})"]
                     for s in staged
                     for wait, key in (("synchronize", "runner_stages_host_us"),
                                       ("spin", "runner_stages_spin_host_us"))],
                    headers=["runner.run's stages, host us", "shape", "wait", *stages,
                             "CUDA API per step (calls, host us); spin: synchronous step "
                             "over kernels, us"]))
                parts.append(table(
                    [[s["backend"], s["shape"], f"{w['busy_ms']:g}", w["wait"], w["work"],
                      f"{w['host_us']:.1f}"] for s in staged for w in s["wake"]],
                    headers=["host work after a wait", "shape", "device busy ms", "wait",
                             "work", "host us"]))
    if r["layers"]:
        direct = {(x["shape"], x["mode"]): x for x in r["layers"]
                  if x["impl"].startswith("flashinfer direct")}

        def ratio(x: dict) -> str:
            same = direct.get((x["shape"], x.get("mode")))
            return f"{same['time_us'] / x['time_us']:.3f}x" if same else "-"

        parts.append(table(
            [[x["impl"], x["shape"], f"{x['time_us']:.1f}", f"{x['GBps']:.0f}",
              x.get("num_kv_splits") or "-", x.get("mode", "-"), ratio(x)]
             for x in r["layers"]],
            headers=["one-layer decode", "shape", "us", "GB/s", "splits", "mode",
                     "FlashInfer direct (same mode) / this"]))
    if r["checks"]:
        parts.append(table(
            [[c["backend"], c["shape"], c["variant"], f"{c['step_us'] / 1e3:.3f}",
              f"{c['vs_checks_off']:.2f}x"] for c in r["checks"]],
            headers=[f"eager {LAYERS}-layer step", "shape", "variant", "ms", "vs checks off"]))
    if r["host"]:
        parts.append(table(
            [[h["impl"], h["shape"], f"{h['write_us']:.1f}", f"{h['attend_us']:.1f}",
              f"{h['write_attend_us']:.1f}",
              f"{h['update_and_forward_us']:.1f}" if "update_and_forward_us" in h else "-",
              f"{h['step_update_and_forward_us']:.1f}"
              if "step_update_and_forward_us" in h else "-",
              f"{h['attend_gpu_us']:.1f}" if h.get("attend_gpu_us") is not None else "-"]
             for h in r["host"]],
            headers=["per-layer host time (eager)", "shape", "write us", "attend us",
                     "write + attend us", "update_and_forward us",
                     f"same, a {LAYERS}-layer step, us/layer", "attend GPU us"]))
    if r["mla_pipeline"]:
        headers = ["shape", "path", "graph_us", "eager_us", "direct_over_kvcore"]
        parts.append(table([[row.get(h, "-") for h in headers] for row in r["mla_pipeline"]],
                           headers=["MLA pipeline", "path", "graph us", "eager us",
                                    "direct / kvcore"]))
    if r["errors"]:
        parts.append("errors: " + "; ".join(f"{e['section']}: {e['error']}"
                                            for e in r["errors"]))
    return "\n\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or
                        str(Path(__file__).parent / "results"))
    parser.add_argument("--cpu", action="store_true",
                        help="section 4 only, on the CPU with CPU_ATTN (small shapes)")
    parser.add_argument("--profile", metavar="BACKEND:BxL",
                        help="only profile that backend's replayed step (e.g. FLASHINFER:16x4096)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU, Triton under TRITON_INTERPRET=1")
    parser.add_argument("--host", action="store_true",
                        help="only the per-layer host table (section 5)")
    parser.add_argument("--steps-only", action="store_true",
                        help="only sections 1 and 2 (correctness, the 32-layer steps and where "
                             "a synchronous step's time goes)")
    args = parser.parse_args()
    if DEVICE == "cpu":
        # Tiny ops: intra-op threads cost more than they save on a shared machine.
        torch.set_num_threads(1)
    run = Run(Path(args.out), "bench_step",
              ("correctness", "steps", "layers", "checks", "host", "mla_pipeline"),
              checks="correctness", device=DEVICE)
    meta = run.results["meta"]
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE, cpu=CPU,
                shapes=dict(hq=HQ, hk=HK, d=D, bs=BS, layers=LAYERS, dtype=str(DTYPE)))
    names = []
    for name in BACKENDS:
        why = available(name)
        meta[f"{name}_unavailable"] = why
        if why is None:
            names.append(name)
        else:
            run.log(f"{name} skipped: {why}")
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
        has_flashinfer = DEVICE == "cuda"
    except Exception as exc:
        meta["flashinfer"] = f"unavailable: {type(exc).__name__}: {exc}"
        has_flashinfer = False
    run.log(json.dumps(meta))
    torch.manual_seed(0)

    if args.profile:
        name, shape = args.profile.split(":")
        b, length = (int(x) for x in shape.split("x"))
        with run.section(f"profile {args.profile}"):
            profile_step(run, name, b, length)
        run.save()
        return 1 if run.results["errors"] else 0
    if args.host:
        time_host(run, names, has_flashinfer)
        run.log("\n" + summary_table(run))
        run.save()
        return 1 if run.results["errors"] else 0
    for name in names:
        with run.section(f"correctness {name}"):
            check_step(run, name)
    for name in names:
        for b, length in STEP_SHAPES:
            with run.section(f"{LAYERS}-layer step {name} {b}x{length}"):
                time_step(run, name, b, length)
    if args.steps_only:
        run.log("\n" + summary_table(run))
        run.save()
        return 1 if run.results["errors"] else 0
    for b, length in LAYER_SHAPES:
        time_layer(run, b, length, names, has_flashinfer)
    with run.section("eager step: value checks"):
        time_checks(run, names[0])
    time_host(run, names, has_flashinfer)
    with run.section("MLA pipeline"):
        mla_pipeline(run)
    run.log("\n" + summary_table(run))
    run.save()
    return 1 if run.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
