"""The benchmark harness that ``kvcore bench`` and every ``benchmarks/*.py`` script share: one
way to time a call, one set of ceiling measurements, one run log with its JSON.

- **Timing.** :func:`time_call` gives the median seconds of one call: on a GPU, replays of a
  CUDA graph holding back-to-back calls (no launch gaps, no host work), or CUDA events around
  back-to-back calls when the call cannot be captured; on the CPU, wall time. :class:`Clock`
  times a single call on the device (CUDA events) or the host, for code that must arrange its
  own streams (overlapping transfers).
- **Ceilings**, the physical limits the results are held to, measured in the same run: device
  copy (:func:`copy_gbps`, bytes read plus written), device read (:func:`read_gbps`), Triton
  streaming read and copy kernels (:func:`triton_read_gbps`, :func:`triton_copy_gbps`),
  the pinned host<->device copies (:func:`pinned_copy_gbps`) and, for compute-bound work, a
  square matmul (:func:`matmul_tflops`).
- **Scripts.** :func:`script_timer` (the device and timer, ``--smoke`` on the CPU) and
  :func:`script_parser` (``--out``) set a ``benchmarks/*.py`` script up; :func:`errors_line`
  ends its summary.
- **Run log.** :class:`Run` writes a timestamped log to the terminal and a file, keeps the
  results as a dict saved as JSON after every section, and isolates sections: one that fails
  (or raises :class:`Skip`) is recorded and the run goes on; :func:`run_meta` is what its
  ``meta`` records about the machine.
- **Tables.** :func:`format_table` prints the results as a tabulate table, or as plain
  ``a | b`` lines where tabulate (the ``cli`` extra) is not installed; :func:`format_value`
  formats one cell, blank where the row has no value.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["Clock", "Run", "Skip", "Timer", "copy_gbps", "device_name", "format_table",
           "format_value", "matmul_tflops", "median_of", "pinned_copy_gbps", "read_gbps",
           "rel_err", "run_meta", "time_alternating", "time_call", "triton_copy_gbps",
           "triton_read_gbps", "warm_up"]

#: Aim each timed GPU sample (a graph replay or an event-timed loop) at this many seconds.
_SAMPLE_SECONDS = 4e-3
_MAX_INNER = 100
_SAMPLES = 15

#: ``timer(fn) -> (seconds, how)``, e.g. ``functools.partial(time_call, device="cuda")``.
Timer = Callable[[Callable[[], object]], tuple[float, str]]


# -- timing ------------------------------------------------------------------------------------


def _events_median(fn: Callable[[], object], inner: int, samples: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def time_call(fn: Callable[[], object], device: str | torch.device, graph: bool = True, *,
              warmup: int = 0, samples: int | None = None) -> tuple[float, str]:
    """Median seconds of one call of ``fn`` and how it was timed.

    On a GPU: replays of a CUDA graph holding several calls (no launch gaps, no host work);
    CUDA events around back-to-back calls when ``graph`` is false (functions that synchronise
    with the host cannot be captured) or when capture fails. On the CPU: wall time of single
    calls after ``warmup`` calls. ``samples`` is the number of timed samples (default 3 on the
    CPU, 15 on a GPU).

    ``fn`` must not draw random numbers: a random call inside a capture poisons torch's CUDA
    generator for the rest of the process. Make inputs before timing.
    """
    if torch.device(device).type == "cpu":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(samples or 3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "cpu-wall"
    samples = samples or _SAMPLES
    for _ in range(max(1, warmup)):  # compilation, autotuning, allocations
        fn()
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
        return _events_median(fn, inner, samples), f"events x{inner}"
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
        for _ in range(samples):
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
        return _events_median(fn, inner, samples), f"events x{inner} (capture failed)"


def script_timer(smoke: bool) -> tuple[str, Callable[..., tuple[float, str]]]:
    """A benchmark script's device and :func:`time_call`: with ``smoke`` (``--smoke`` checks
    the script, not the speed) the CPU and one timed sample a call, else CUDA and the
    default samples."""
    device = "cpu" if smoke else "cuda"
    return device, functools.partial(time_call, device=device, samples=1 if smoke else None)


def script_parser(doc: str | None, results_dir: Path) -> argparse.ArgumentParser:
    """A benchmark script's argument parser: its docstring's first line as the description,
    and ``--out``, the folder of its log and JSON (``$OUT`` if set, else ``results_dir``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or results_dir))
    return parser


def errors_line(results: dict[str, Any]) -> str:
    """``"errors: <section>: <error>; ..."`` for the sections of a :class:`Run`'s ``results``
    that failed, ``""`` when none did (a summary's last line)."""
    errors = results["errors"]
    if not errors:
        return ""
    return "errors: " + "; ".join(f"{e['section']}: {e['error']}" for e in errors)


class Clock:
    """Time of one call: CUDA events on the current stream on a GPU, else ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], *, idle: bool = True) -> float:
        """Seconds ``fn``'s work takes; ``idle`` waits for the device to be idle first."""
        if idle:
            self.sync()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    def hold(self, seconds: float) -> None:
        """Keep the current stream (the engine) busy for about ``seconds``: transfers issued
        meanwhile wait for it, so they all start on the device at the same moment."""
        if not self.cuda:
            return
        if not hasattr(self, "_cycles_per_s"):
            probe = 20_000_000
            self._cycles_per_s = probe / self.time(lambda: torch.cuda._sleep(probe))
        torch.cuda._sleep(int(seconds * self._cycles_per_s))


def time_alternating(fns: dict[str, Callable[[], object]], device: str | torch.device,
                     rounds: int = 3) -> dict[str, tuple[float, list[float], str]]:
    """:func:`time_call` of each variant, the variants taking turns for ``rounds`` rounds, so
    a drift of the device (clocks, temperature, a neighbour's load) touches all of them
    alike and shows as rounds that differ.

    Returns per variant: the fastest round's seconds, every round's seconds, how it was
    timed.
    """
    found: dict[str, tuple[float, list[float], str]] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            t, how = time_call(fn, device)
            best, samples, _ = found.get(name, (t, [], how))
            found[name] = (min(best, t), [*samples, t], how)
    return found


def median_of(trials: int, fn: Callable[[], float]) -> float:
    """Median of ``trials`` results of ``fn`` (e.g. :meth:`Clock.time` calls) after a warm-up."""
    fn()
    return statistics.median(fn() for _ in range(trials))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def device_name(device: str | torch.device) -> str:
    """The GPU's name, or the CPU's with the thread count torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform as py_platform

    return f"CPU ({py_platform.processor() or py_platform.machine()}, " \
           f"{torch.get_num_threads()} threads)"


def run_meta(device: str | torch.device) -> dict[str, Any]:
    """What a run's JSON records about where it ran: the date, Python's and torch's versions
    and, on a GPU, its name, SM count and CUDA version."""
    import platform as py_platform

    meta: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                            "python": py_platform.python_version(), "torch": torch.__version__}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(device=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda)
    return meta


def triton_version() -> str:
    """The installed Triton's version for a run's JSON, or ``"missing: <why>"``."""
    try:
        import triton
    except ImportError as exc:
        return f"missing: {exc}"
    return triton.__version__


# -- ceilings ----------------------------------------------------------------------------------


def run_children(commands: Sequence[Sequence[str]], workers: int,
                 deadline_s: float) -> list[tuple[int | None, str, bool]]:
    """Run each command in a process of its own, ``workers`` at a time, for at most
    ``deadline_s`` seconds (a benchmark's parallel precompile: the launches a run will time,
    compiled into the caches first). At the deadline, running processes are killed and
    commands not yet started are skipped. Returns, per command in order: its exit code
    (``None`` if it did not finish), the last line it printed, and whether it was cut off by
    the deadline."""
    import concurrent.futures
    import subprocess
    import threading

    lock, procs, stopped = threading.Lock(), [], threading.Event()

    def one(cmd: Sequence[str]) -> tuple[int | None, str]:
        with lock:
            if stopped.is_set():
                return None, "not started"
            proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            procs.append(proc)
        said, _ = proc.communicate()
        return proc.returncode, (said.strip().splitlines() or [""])[-1]

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(one, cmd) for cmd in commands]
        _, pending = concurrent.futures.wait(futures, timeout=deadline_s)
        with lock:
            stopped.set()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()  # this run's own child
    return [(*future.result(), future in pending) for future in futures]


def read_ceiling(run: Run, device: str, timer: Timer, smoke: bool) -> float:
    """The device's read bandwidth in GB/s, the faster of ``torch.sum`` and a Triton
    streaming read over 2 GiB (64 KiB with ``smoke``) after a one-second warm-up; recorded as
    ``run.results["ceilings"]`` and logged."""
    nbytes = (1 << 16) if smoke else (2 << 30)
    x = torch.empty(nbytes // 4, device=device).normal_()
    warm_up(torch.empty_like(x), x, 0.0 if smoke else 1.0)
    torch_sum, how = read_gbps(x, timer)
    triton_read, _ = triton_read_gbps(x, timer)
    best = max(torch_sum, triton_read)
    run.results["ceilings"] = {"read_GBps": best, "read_torch_sum_GBps": torch_sum,
                               "read_triton_GBps": triton_read, "method": how}
    run.log(f"read ceiling {best:.0f} GB/s (torch.sum {torch_sum:.0f}, "
            f"triton {triton_read:.0f})")
    return best


def warm_up(dst: torch.Tensor, src: torch.Tensor, seconds: float) -> None:
    """Copy ``src`` into ``dst`` for about ``seconds``: an idle GPU needs a moment to raise its
    clocks before a ceiling is measured."""
    until = time.time() + seconds
    while time.time() < until:
        for _ in range(20):
            dst.copy_(src)
        if dst.device.type == "cuda":
            torch.cuda.synchronize()


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, timer: Timer, *,
              non_blocking: bool = False) -> tuple[float, str]:
    """Device copy (``Tensor.copy_``: cudaMemcpy on a GPU, memcpy on a CPU): GB/s counting the
    bytes read plus the bytes written, and how it was timed."""
    seconds, how = timer(lambda: dst.copy_(src, non_blocking=non_blocking))
    return 2 * src.numel() * src.element_size() / seconds / 1e9, how


def read_gbps(x: torch.Tensor, timer: Timer, reduce: Callable[[torch.Tensor], object] = torch.sum
              ) -> tuple[float, str]:
    """Device read: a reduction over ``x`` (``torch.sum`` unless ``reduce``), bytes read."""
    seconds, how = timer(lambda: reduce(x))
    return x.numel() * x.element_size() / seconds / 1e9, how


def pinned_copy_gbps(device_buf: torch.Tensor, timer: Timer) -> dict[str, float]:
    """One ``cudaMemcpyAsync`` each way between ``device_buf`` (uint8) and a pinned host buffer
    of its size: ``{"d2h": GB/s, "h2d": GB/s}``."""
    host = torch.empty(device_buf.numel(), dtype=torch.uint8, pin_memory=True)
    n = device_buf.numel()
    d2h, _ = timer(lambda: host.copy_(device_buf, non_blocking=True))
    h2d, _ = timer(lambda: device_buf.copy_(host, non_blocking=True))
    return {"d2h": n / d2h / 1e9, "h2d": n / h2d / 1e9}


def matmul_tflops(n: int, dtype: torch.dtype, device: str | torch.device, timer: Timer
                  ) -> tuple[float, str]:
    """Compute: an ``n x n`` by ``n x n`` matmul of random ``dtype`` operands into a
    preallocated result: TFLOP/s (``2 n**3`` FLOPs) and how it was timed."""
    a = torch.empty(n, n, dtype=dtype, device=device).normal_()
    b = torch.empty(n, n, dtype=dtype, device=device).normal_()
    c = torch.empty_like(a)
    seconds, how = timer(lambda: torch.matmul(a, b, out=c))
    return 2.0 * n**3 / seconds / 1e12, how


_STREAM_BLOCK, _STREAM_ITERS = 4096, 16


@functools.cache
def _stream_kernels() -> tuple[Any, Any]:
    """Triton kernels that stream a float32 tensor: a read (per-program partial sums) and a
    copy; built on first use so that importing this module needs no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))

    @triton.jit
    def stream_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    return stream_read, stream_copy


def _stream_grid(x: torch.Tensor) -> tuple[int]:
    return (-(-x.numel() // (_STREAM_BLOCK * _STREAM_ITERS)),)


def triton_read_gbps(x: torch.Tensor, timer: Timer) -> tuple[float, str]:
    """Device read by a Triton streaming kernel over the float32 tensor ``x``, checked to sum
    correctly first: GB/s (bytes read) and how it was timed."""
    read, _ = _stream_kernels()
    grid = _stream_grid(x)
    partial = torch.empty(grid[0], dtype=torch.float32, device=x.device)

    def call() -> None:
        read[grid](x, partial, x.numel(), BLOCK=_STREAM_BLOCK, ITERS=_STREAM_ITERS, num_warps=8)

    call()
    if not math.isclose(partial.double().sum().item(), x.double().sum().item(),
                        rel_tol=1e-3, abs_tol=1.0):
        raise RuntimeError("the streaming-read kernel computed a wrong sum")
    seconds, how = timer(call)
    return x.numel() * 4 / seconds / 1e9, how


def triton_copy_gbps(x: torch.Tensor, y: torch.Tensor, timer: Timer) -> tuple[float, str]:
    """Device copy of the float32 tensor ``x`` into ``y`` by a Triton streaming kernel,
    checked to copy exactly first: GB/s (bytes read plus written) and how it was timed."""
    _, copy = _stream_kernels()
    grid = _stream_grid(x)

    def call() -> None:
        copy[grid](x, y, x.numel(), BLOCK=_STREAM_BLOCK, ITERS=_STREAM_ITERS, num_warps=8)

    y.zero_()
    call()
    if not torch.equal(x, y):
        raise RuntimeError("the streaming-copy kernel copied wrongly")
    seconds, how = timer(call)
    return 2 * x.numel() * 4 / seconds / 1e9, how


# -- tables ------------------------------------------------------------------------------------


def format_table(rows: Sequence[Sequence[object]], headers: Sequence[str],
                 tablefmt: str = "github") -> str:
    """``rows`` under ``headers`` as text: tabulate's ``tablefmt`` table, or one
    ``a | b | c`` line per row (headers first) where tabulate is not installed, so a
    benchmark still prints its results on a machine without the ``cli`` extra."""
    try:
        from tabulate import tabulate
    except ImportError:
        return "\n".join(" | ".join(map(str, row)) for row in [headers, *rows])
    return tabulate(rows, headers=headers, tablefmt=tablefmt)


def format_value(row: dict[str, Any], key: str, spec: str, scale: float = 1.0) -> str:
    """A table cell: ``row[key] * scale`` formatted with ``spec``, or ``""`` where the row has
    no value for ``key`` (missing or ``None``: its variant does not measure it)."""
    value = row.get(key)
    return "" if value is None else format(value * scale, spec)


# -- run log -----------------------------------------------------------------------------------


class Skip(Exception):
    """A section that cannot run on this machine; the message says why."""


class Run:
    """The log (on the terminal and in ``<out_dir>/<name>_log.txt``) and the JSON results
    (``<out_dir>/<name>.json``, saved after every section) of one benchmark run.

    ``results`` starts as ``{"meta": {}, "ceilings": {}, <lists>..., "errors": []}`` with one
    empty list per name in ``lists``; :meth:`check` appends to ``results[checks]``.
    """

    def __init__(self, out_dir: Path, name: str, lists: tuple[str, ...], *,
                 checks: str = "checks", device: str = "cpu", budget_s: float = 0.0) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.name, self.device, self.budget_s = out_dir, name, device, budget_s
        self.log_file = open(out_dir / f"{name}_log.txt", "w")
        self.start = time.time()
        self.checks = checks
        self.results: dict = {"meta": {}, "ceilings": {}, **{key: [] for key in lists},
                              "errors": []}

    def log(self, *parts: object) -> None:
        line = f"[{time.time() - self.start:7.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def elapsed(self) -> float:
        """Seconds since the run started (for sections time-boxed by ``budget_s``)."""
        return time.time() - self.start

    def save(self) -> None:
        with open(self.out_dir / f"{self.name}.json", "w") as fh:
            json.dump(self.results, fh, indent=1, default=str)

    def write_summary(self, lines: Sequence[str]) -> str:
        """Log the summary ``lines`` and write them to ``<out_dir>/<name>_table.txt``; returns
        the text."""
        text = "\n".join(lines)
        self.log("\n" + text)
        (self.out_dir / f"{self.name}_table.txt").write_text(text + "\n")
        return text

    def finish_checked(self, before: Sequence[str] = (), after: Sequence[str] = ()) -> int:
        """End a run that records correctness checks: the failed checks and the count of
        section errors go into ``results["summary"]``, the JSON is saved, and the summary is
        written (:meth:`write_summary`): ``before``, the correctness line, ``after``, the
        errors line if a section failed. Returns the exit status: 1 when a check failed."""
        failed = [c["check"] for c in self.results[self.checks] if not c["ok"]]
        errors = len(self.results["errors"])
        self.results["summary"] = {"failed_checks": failed, "errors": errors}
        self.save()
        correctness = (f"correctness: {'all passed' if not failed else f'FAILED {failed}'}; "
                       f"section errors: {errors}")
        why = errors_line(self.results)
        self.write_summary([*before, correctness, *after, *([why] if why else [])])
        return 1 if failed else 0

    def check(self, name: str, ok: bool, **info: object) -> None:
        """Record a correctness check and log PASS or FAIL."""
        self.results[self.checks].append({"check": name, "ok": bool(ok), **info})
        self.log(f"{'PASS' if ok else 'FAIL'} {name} {info if info else ''}")

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a section: a :class:`Skip` is recorded in ``results["skipped"]``, any other
        exception in ``results["errors"]`` with its traceback, and the run goes on. The GPU is
        synchronised before and after, so no section's work leaks into the next one's."""
        self.log(f"=== {name}")
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        try:
            yield
        except Skip as why:
            self.results.setdefault("skipped", []).append({"section": name,
                                                           "reason": str(why)})
            self.log(f"SKIPPED {name}: {why}")
        except Exception as exc:  # one failed section must not lose the others
            self.log(f"!!! {name} failed: {type(exc).__name__}: {exc}")
            self.log_file.write(traceback.format_exc())
            self.results["errors"].append({"section": name,
                                           "error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()})
        finally:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            self.save()
