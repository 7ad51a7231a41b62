"""Timing and error helpers shared by the benchmark scripts (one method for every number in
RESULTS.md). Imported as ``timing`` by scripts run from this folder (``python
benchmarks/bench_x.py`` puts the folder on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

#: Aim each timed sample (a graph replay or an event-timed loop) at this many seconds.
_SAMPLE_SECONDS = 4e-3
_MAX_INNER = 100
_SAMPLES = 15


def _events_median(fn: Callable[[], object], inner: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(_SAMPLES):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def time_call(fn: Callable[[], object], device: str, graph: bool = True) -> tuple[float, str]:
    """Median seconds of one call of ``fn`` and how it was timed.

    On a GPU: replays of a CUDA graph holding several calls (no launch gaps, no host work);
    CUDA events around back-to-back calls when ``graph`` is false (functions that synchronise
    with the host cannot be captured) or when capture fails. On the CPU: wall time.

    ``fn`` must not draw random numbers: a random call inside a capture poisons torch's CUDA
    generator for the rest of the process. Make inputs before timing.
    """
    if device == "cpu":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "cpu-wall"
    fn()  # warm-up: compilation, autotuning, allocations
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    single = max(start.elapsed_time(end) / 3e3, 1e-6)
    inner = max(1, min(_MAX_INNER, int(_SAMPLE_SECONDS / single)))
    if not graph:
        return _events_median(fn, inner), f"events x{inner}"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # the first call's allocations on this stream stay out of the graph pool
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(inner):
                fn()
        for _ in range(3):
            cuda_graph.replay()
        times = []
        for _ in range(_SAMPLES):
            start.record()
            cuda_graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        return statistics.median(times), f"cuda-graph x{inner}"
    except Exception as exc:
        torch.cuda.synchronize()
        print(f"    (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing with "
              "events)", flush=True)
        return _events_median(fn, inner), f"events x{inner} (capture failed)"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()
