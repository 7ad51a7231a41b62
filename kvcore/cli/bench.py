"""``kvcore bench``: how fast kvcore's memory-bound paths run here, against ceilings measured
in the same run.

Cases, for the current platform:

- **decode attention** of the selected backend and of every other valid one (one new token
  per request over a long paged context), on a per-layer cache, plus the selected backend on a
  layer of a cross-layer cache when it opts in;
- **prefill attention** of the same backends (fresh causal prompts whose K/V are in the
  cache);
- **cache write** (``do_kv_cache_update``) of the same backends;
- **offload connector** save and load of whole blocks, per-layer and cross-layer.

Every case counts the bytes it must move at least once and reports GB/s (10**9 B/s) next to
a ceiling measured in the same run. Kernels are held to the faster of the device read (a
``sum`` over a large tensor, bytes read) and the device copy (``Tensor.copy_`` of a large
tensor, bytes read plus written; on a CPU a large memcpy); prefill, bound by compute, also
counts its attention FLOPs (QK^T and PV over the keys each query sees) and is held to a
square matmul in the bench's dtype (TFLOP/s). The connector is held to the
pinned host<->device copy on a GPU, and to the same memory ceiling on a CPU. Timings and
ceilings come from :mod:`kvcore.cli.harness`, as in ``benchmarks/``: medians over repetitions
after warm-up (CUDA events around back-to-back calls on a GPU).
The ``small`` size runs in seconds on a CPU; ``full`` uses serving-sized shapes for a GPU.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

import kvcore
from kvcore import (
    AttentionBackend,
    AttentionSelectorConfig,
    KVCaches,
    LayerScales,
    Platform,
    allocate_kv_caches,
    build_attention_metadata,
    parse_dtype,
)
from kvcore.cli import harness
from kvcore.connectors import get_connector

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["SIZES", "BenchCase", "BenchOptions", "BenchReport", "BenchSize", "Ceiling",
           "bench_figure", "format_report", "plot_report", "run_bench", "run_bench_cli"]


@dataclass(frozen=True)
class BenchSize:
    """Shapes of one bench size."""

    batch: int  #: decode requests
    context: int  #: tokens per decode request
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    write_tokens: int  #: tokens per cache write
    prefill_batch: int  #: prefill requests
    prefill_tokens: int  #: new tokens per prefill request
    matmul_size: int  #: n of the n x n x n matmul ceiling
    offload_layers: int
    offload_blocks: int  #: blocks per save / load
    copy_bytes: int  #: size of the device-copy ceiling's tensor
    reps: int


SIZES = {
    # Transfers and the copy ceiling exceed a server CPU's last-level cache (32 MiB here),
    # so both measure memory, not cache, bandwidth.
    "small": BenchSize(batch=4, context=512, num_heads=8, num_kv_heads=2, head_size=128,
                       block_size=16, write_tokens=8192, prefill_batch=2, prefill_tokens=128,
                       matmul_size=512, offload_layers=8, offload_blocks=192,
                       copy_bytes=128 << 20, reps=11),
    "full": BenchSize(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_size=128,
                      block_size=16, write_tokens=32768, prefill_batch=4, prefill_tokens=2048,
                      matmul_size=8192, offload_layers=32, offload_blocks=256,
                      copy_bytes=2 << 30, reps=20),
}


@dataclass
class BenchOptions:
    """Options of :func:`run_bench` (the ``kvcore bench`` flags). ``platform`` defaults to
    the detected one (it must be present); ``size`` and ``dtype`` default to
    ``small``/float32 on a CPU and ``full``/bfloat16 on a GPU."""

    size: str | None = None
    dtype: str | None = None
    platform: str | None = None
    progress: bool = True


@dataclass
class Ceiling:
    """A bound measured in the run: ``num_bytes`` moved (and ``flops`` done, for the compute
    ceiling) in ``seconds``."""

    name: str
    num_bytes: int
    seconds: float
    flops: float = 0.0

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12

    @classmethod
    def from_gbps(cls, name: str, num_bytes: int, gbps: float) -> Ceiling:
        return cls(name, num_bytes, num_bytes / (gbps * 1e9))


@dataclass
class BenchCase:
    """One timed case: ``num_bytes`` moved per call in ``seconds`` (median). A compute-bound
    case also counts its ``flops`` and is held to ``ceiling_tflops`` instead of
    ``ceiling_gbps``."""

    name: str
    backend: str
    shape: str
    num_bytes: int
    seconds: float
    ceiling: str
    ceiling_gbps: float
    error: str | None = None
    flops: float = 0.0
    ceiling_tflops: float = 0.0

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12 if self.seconds > 0 else 0.0

    @property
    def fraction_of_ceiling(self) -> float:
        if self.flops:
            return self.tflops / self.ceiling_tflops if self.ceiling_tflops > 0 else 0.0
        return self.gbps / self.ceiling_gbps if self.ceiling_gbps > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps, "tflops": self.tflops,
                "fraction_of_ceiling": self.fraction_of_ceiling}


@dataclass
class BenchReport:
    """Everything ``kvcore bench`` prints (``--format json`` is :meth:`to_dict`)."""

    date: str
    device: str
    platform: str
    selected_backend: str
    dtype: str
    size: str
    torch_version: str
    kvcore_version: str
    ceilings: list[Ceiling] = field(default_factory=list)
    cases: list[BenchCase] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "date": self.date, "device": self.device, "platform": self.platform,
            "selected_backend": self.selected_backend, "dtype": self.dtype, "size": self.size,
            "torch": self.torch_version, "kvcore": self.kvcore_version,
            "seconds": self.seconds,
            "ceilings": [{**asdict(c), "gbps": c.gbps, "tflops": c.tflops}
                         for c in self.ceilings],
            "cases": [c.to_dict() for c in self.cases],
        }


def _ceilings(device: torch.device, size: BenchSize, dtype: torch.dtype,
              measure: harness.Timer) -> list[Ceiling]:
    """Device read (a sum: bytes read), device copy (bytes read + written) and a square
    matmul in ``dtype`` (FLOPs; bytes of its operands and result); on a GPU also the pinned
    host<->device copies the connector is bound by."""
    n = size.copy_bytes
    ones = torch.ones(n // 4, dtype=torch.float32, device=device)
    src = ones.view(torch.uint8)
    ceilings = [
        Ceiling.from_gbps("device read", n, harness.read_gbps(ones, measure)[0]),
        Ceiling.from_gbps("device copy", 2 * n, harness.copy_gbps(
            torch.empty_like(src), src, measure, non_blocking=True)[0]),
    ]
    m = size.matmul_size
    tflops, _ = harness.matmul_tflops(m, dtype, device, measure)
    ceilings.append(Ceiling("matmul", 3 * m * m * dtype.itemsize, 2.0 * m**3 / (tflops * 1e12),
                            2.0 * m**3))
    if device.type == "cuda":
        m = min(n, 512 << 20)
        pinned = harness.pinned_copy_gbps(src[:m], measure)
        ceilings.append(Ceiling.from_gbps("device->host (pinned)", m, pinned["d2h"]))
        ceilings.append(Ceiling.from_gbps("host->device (pinned)", m, pinned["h2d"]))
    return ceilings


def _kv_caches(backend: type[AttentionBackend], size: BenchSize, num_blocks: int,
               dtype: torch.dtype, device: torch.device, *, num_layers: int = 1,
               cross_layer: bool = False) -> KVCaches:
    kv = allocate_kv_caches(backend, num_layers=num_layers, num_blocks=num_blocks,
                            block_size=size.block_size, num_kv_heads=size.num_kv_heads,
                            head_size=size.head_size, dtype=dtype, device=device,
                            cross_layer=cross_layer)
    kv.storage.normal_()
    return kv


def _decode_case(backend: type[AttentionBackend], size: BenchSize, dtype: torch.dtype,
                 device: torch.device, cross_layer: bool, measure: harness.Timer,
                 ceiling: Ceiling) -> BenchCase:
    """Decode: ``batch`` requests, one new token each, over ``context`` cached tokens."""
    bs, ctx = size.block_size, size.context
    per_seq = math.ceil(ctx / bs)
    num_blocks = size.batch * per_seq
    kv = _kv_caches(backend, size, num_blocks, dtype, device, num_layers=2 if cross_layer
                    else 1, cross_layer=cross_layer)
    # Shuffled block tables: a request's pages are scattered, as in a long-running engine.
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen).view(size.batch, per_seq).tolist()
    meta = build_attention_metadata([1] * size.batch, [ctx - 1] * size.batch, tables, bs,
                                    device=device)
    impl = backend.get_impl_cls()(num_heads=size.num_heads, head_size=size.head_size,
                                  scale=size.head_size ** -0.5, num_kv_heads=size.num_kv_heads)
    q = torch.randn(size.batch, size.num_heads, size.head_size, dtype=dtype, device=device)
    k = torch.randn(size.batch, size.num_kv_heads, size.head_size, dtype=dtype, device=device)
    out = torch.empty_like(q)
    layer = kv.layers[-1]  # of a cross-layer cache: a strided view between other layers
    scales = LayerScales()
    item = dtype.itemsize
    num_bytes = (2 * size.batch * ctx * size.num_kv_heads * size.head_size * item
                 + 2 * q.numel() * item)
    # forward reads K/V from the cache only; the key/value arguments are not used again.
    seconds, _ = measure(lambda: impl.forward(scales, q, k, k, layer, meta, output=out))
    shape = (f"B={size.batch} ctx={ctx} Hq={size.num_heads} Hk={size.num_kv_heads} "
             f"D={size.head_size}" + (" cross-layer" if cross_layer else ""))
    return BenchCase("decode attention", backend.get_name(), shape, num_bytes, seconds,
                     ceiling.name, ceiling.gbps)


def _prefill_case(backend: type[AttentionBackend], size: BenchSize, dtype: torch.dtype,
                  device: torch.device, measure: harness.Timer, ceiling: Ceiling) -> BenchCase:
    """Prefill: ``prefill_batch`` fresh requests of ``prefill_tokens`` tokens, causal, their
    K/V already in the cache (attention only, as ``forward`` runs after the write)."""
    b, n, bs = size.prefill_batch, size.prefill_tokens, size.block_size
    per_seq = math.ceil(n / bs)
    num_blocks = b * per_seq
    kv = _kv_caches(backend, size, num_blocks, dtype, device)
    gen = torch.Generator().manual_seed(2)
    tables = torch.randperm(num_blocks, generator=gen).view(b, per_seq).tolist()
    meta = build_attention_metadata([n] * b, [0] * b, tables, bs, device=device)
    impl = backend.get_impl_cls()(num_heads=size.num_heads, head_size=size.head_size,
                                  scale=size.head_size ** -0.5, num_kv_heads=size.num_kv_heads)
    q = torch.randn(b * n, size.num_heads, size.head_size, dtype=dtype, device=device)
    k = torch.randn(b * n, size.num_kv_heads, size.head_size, dtype=dtype, device=device)
    out = torch.empty_like(q)
    layer, scales = kv.layers[0], LayerScales()
    item = dtype.itemsize
    num_bytes = 2 * b * n * size.num_kv_heads * size.head_size * item + 2 * q.numel() * item
    flops = 4.0 * b * size.num_heads * size.head_size * n * (n + 1) / 2
    seconds, _ = measure(lambda: impl.forward(scales, q, k, k, layer, meta, output=out))
    shape = (f"B={b} new={n} causal Hq={size.num_heads} Hk={size.num_kv_heads} "
             f"D={size.head_size}")
    return BenchCase("prefill attention", backend.get_name(), shape, num_bytes, seconds,
                     ceiling.name, ceiling.gbps, flops=flops, ceiling_tflops=ceiling.tflops)


def _write_case(backend: type[AttentionBackend], size: BenchSize, dtype: torch.dtype,
                device: torch.device, measure: harness.Timer, ceiling: Ceiling) -> BenchCase:
    """Cache write of ``write_tokens`` new tokens to distinct, shuffled slots."""
    n, bs = size.write_tokens, size.block_size
    num_blocks = math.ceil(n / bs) * 2
    kv = _kv_caches(backend, size, num_blocks, dtype, device)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n].to(device)
    k = torch.randn(n, size.num_kv_heads, size.head_size, dtype=dtype, device=device)
    v = torch.randn_like(k)
    impl = backend.get_impl_cls()(num_heads=size.num_heads, head_size=size.head_size,
                                  scale=size.head_size ** -0.5, num_kv_heads=size.num_kv_heads)
    scales = LayerScales()
    # K and V read from the inputs and written to the cache, plus the slot ids.
    num_bytes = 2 * 2 * k.numel() * dtype.itemsize + slots.numel() * 8
    seconds, _ = measure(lambda: impl.do_kv_cache_update(scales, k, v, kv.layers[0], slots))
    shape = f"tokens={n} Hk={size.num_kv_heads} D={size.head_size}"
    return BenchCase("cache write", backend.get_name(), shape, num_bytes, seconds,
                     ceiling.name, ceiling.gbps)


def _offload_cases(backend: type[AttentionBackend], size: BenchSize, dtype: torch.dtype,
                   device: torch.device, cross_layer: bool, measure: harness.Timer,
                   save_ceiling: Ceiling, load_ceiling: Ceiling) -> list[BenchCase]:
    """Save then load ``offload_blocks`` whole blocks (every layer) through ``offload``."""
    m = size.offload_blocks
    kv = _kv_caches(backend, size, 2 * m, dtype, device, num_layers=size.offload_layers,
                    cross_layer=cross_layer)
    block_bytes = kv.num_layers * kv.page_size_bytes
    src = list(range(0, 2 * m, 2))  # every other block: no two neighbours merge into a run
    dst = list(range(1, 2 * m, 2))
    kind = "cross-layer" if cross_layer else "per-layer"
    shape = f"{m} blocks x {kv.num_layers} layers ({block_bytes // 1024} KiB/block) {kind}"
    with get_connector("offload", capacity_bytes=m * block_bytes) as conn:
        conn.register_kv_caches(kv)
        keys: list[str] = []

        def save() -> None:
            # Fresh keys every time: a key the pool already holds is not copied again.
            keys[:] = [secrets.token_hex(32) for _ in range(m)]
            conn.save(keys, src).wait()

        save_s, _ = measure(save)
        load_s, _ = measure(lambda: conn.load(keys, dst).wait())
    return [
        BenchCase("offload save", backend.get_name(), shape, m * block_bytes, save_s,
                  save_ceiling.name, save_ceiling.gbps),
        BenchCase("offload load", backend.get_name(), shape, m * block_bytes, load_s,
                  load_ceiling.name, load_ceiling.gbps),
    ]


def _valid_backends(config: AttentionSelectorConfig, platform: Platform
                    ) -> tuple[type[AttentionBackend], list[type[AttentionBackend]]]:
    """The selected backend and every valid one (selected first)."""
    selected = kvcore.get_attn_backend(config, platform=platform)
    report = kvcore.explain_selection(config, platform)
    others = [kvcore.resolve_backend(c.name) for c in report.candidates
              if c.valid and c.name != selected.get_name()]
    return selected, [selected, *others]


def run_bench(options: BenchOptions) -> BenchReport:
    """Measure the ceilings, then every case (see the module docstring)."""
    started = time.perf_counter()
    platform = kvcore.require_present_platform(options.platform)
    device = platform.device()
    on_gpu = device.type != "cpu"
    size_name = options.size or ("full" if on_gpu else "small")
    if size_name not in SIZES:
        raise ValueError(f"size={size_name!r} (choose from: {', '.join(SIZES)})")
    size = SIZES[size_name]
    dtype = parse_dtype(options.dtype or ("bfloat16" if on_gpu else "float32"))
    config = AttentionSelectorConfig(head_size=size.head_size, dtype=dtype,
                                     block_size=size.block_size)
    selected, backends = _valid_backends(config, platform)
    # Two warm-up calls (the first compiles Triton kernels); calls that wait for the host
    # (the connector's) cannot be captured in a CUDA graph, so every case is timed with events.
    measure = functools.partial(harness.time_call, device=device, graph=False, warmup=2,
                                samples=size.reps)
    report = BenchReport(
        date=datetime.date.today().isoformat(), device=harness.device_name(device),
        platform=platform.name, selected_backend=selected.get_name(),
        dtype=str(dtype).removeprefix("torch."), size=size_name,
        torch_version=torch.__version__, kvcore_version=kvcore.__version__)

    # Cases are closures so the progress bar knows the total before anything runs.
    jobs: list[tuple[str, Callable[[dict[str, Ceiling]], list[BenchCase]]]] = []
    for backend in backends:
        name = backend.get_name()
        jobs.append((f"decode {name}", lambda c, b=backend: [
            _decode_case(b, size, dtype, device, False, measure, c["memory"])]))
        if backend is selected and backend.supports_cross_layer(platform.name):
            jobs.append((f"decode {name} cross-layer", lambda c, b=backend: [
                _decode_case(b, size, dtype, device, True, measure, c["memory"])]))
        jobs.append((f"prefill {name}", lambda c, b=backend: [
            _prefill_case(b, size, dtype, device, measure, c["matmul"])]))
        jobs.append((f"cache write {name}", lambda c, b=backend: [
            _write_case(b, size, dtype, device, measure, c["memory"])]))
    if selected.supports_kv_connector():
        for cross in ((False, True) if selected.supports_cross_layer(platform.name) else (False,)):
            jobs.append((f"offload {'cross-layer' if cross else 'per-layer'}",
                         lambda c, x=cross: _offload_cases(
                             selected, size, dtype, device, x, measure,
                             c.get("device->host (pinned)", c["memory"]),
                             c.get("host->device (pinned)", c["memory"]))))

    with tqdm(total=1 + len(jobs), desc="kvcore bench", unit="case", file=sys.stderr,
              disable=None if options.progress else True, leave=False) as bar:
        bar.set_postfix_str("ceilings")
        report.ceilings = _ceilings(device, size, dtype, measure)
        ceilings = {c.name: c for c in report.ceilings}
        # Kernels are held to the fastest the device memory moved in this run: on an H200 a
        # tuned write kernel outruns cudaMemcpy, so the copy alone is no ceiling for it.
        ceilings["memory"] = max(ceilings["device read"], ceilings["device copy"],
                                 key=lambda c: c.gbps)
        bar.update()
        for label, job in jobs:
            bar.set_postfix_str(label)
            try:
                report.cases.extend(job(ceilings))
            except Exception as exc:  # one broken backend must not hide the other numbers
                report.cases.append(BenchCase(label, "", "", 0, 0.0, "", 0.0,
                                              error=f"{type(exc).__name__}: {exc}"))
            bar.update()
    report.seconds = time.perf_counter() - started
    return report


def format_report(report: BenchReport) -> str:
    """Header, the ceilings, then one table row per case."""
    from tabulate import tabulate

    lines = [f"kvcore bench: {report.device}, platform {report.platform}, {report.dtype}, "
             f"size {report.size}, {report.date} (torch {report.torch_version})",
             f"selected backend: {report.selected_backend}", ""]
    lines.append(tabulate([[c.name, f"{c.gbps:.1f}", f"{c.tflops:.3g}" if c.flops else ""]
                           for c in report.ceilings], headers=["ceiling", "GB/s", "TFLOP/s"]))
    lines.append("")
    rows = [[c.name, c.backend, c.shape, f"{c.seconds * 1e6:.1f}", f"{c.gbps:.1f}",
             f"{c.tflops:.3g}" if c.flops else "", c.ceiling,
             f"{100 * c.fraction_of_ceiling:.0f}%"] if c.error is None else
            [c.name, c.backend, "", "", "", "", "", f"error: {c.error}"]
            for c in report.cases]
    lines.append(tabulate(rows, headers=["case", "backend", "shape", "time (us)", "GB/s",
                                         "TFLOP/s", "ceiling", "of ceiling"]))
    lines.append(f"\n{len(report.cases)} cases in {report.seconds:.1f} s")
    return "\n".join(lines)


def plot_report(report: BenchReport, path: str | Path) -> Path:
    """Bar chart into the PNG ``path``: achieved GB/s per memory-bound case over its ceiling
    (compute-bound cases, prefill, are in the table)."""
    from kvcore.cli.plotting import save_figure

    return save_figure(bench_figure(report, path), path)


def bench_figure(report: BenchReport, path: str | Path = "") -> Figure:
    """The figure of :func:`plot_report` (``path`` only names the plot in errors)."""
    from matplotlib.patches import Patch

    from kvcore.cli.plotting import new_figure

    cases = [c for c in report.cases if c.error is None and not c.flops]
    if not cases:
        raise ValueError(f"--plot {path}: no case ran without an error, nothing to plot")
    fig = new_figure(11, 1.6 + 0.45 * len(cases))
    ax = fig.add_subplot()
    ys = range(len(cases))
    ax.barh(ys, [c.ceiling_gbps for c in cases], color="0.88", edgecolor="0.6",
            label="ceiling (measured in this run)")
    colors = {"decode attention": "tab:blue", "cache write": "tab:green",
              "offload save": "tab:orange", "offload load": "tab:red"}
    ax.barh(ys, [c.gbps for c in cases], height=0.5,
            color=[colors.get(c.name, "tab:gray") for c in cases])
    top = max(max(c.ceiling_gbps, c.gbps) for c in cases)
    for y, c in zip(ys, cases, strict=True):
        ax.text(max(c.gbps, c.ceiling_gbps) + 0.01 * top, y,
                f"{c.gbps:.1f} GB/s = {100 * c.fraction_of_ceiling:.0f}% of {c.ceiling}",
                va="center", fontsize=8)
    ax.set_yticks(list(ys), [f"{c.name} · {c.backend}\n{c.shape}" for c in cases], fontsize=8)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("GB/s (10^9 bytes per second; bytes each case must move at least once)")
    ax.set_title(f"kvcore bench on {report.device}, {report.dtype}, {report.date}\n"
                 f"selected backend {report.selected_backend}; grey bars: the ceiling each "
                 "case is measured against; prefill (TFLOP/s) is in the table", fontsize=10)
    # One legend entry per bar colour: the ceiling, then what was achieved per kind of case.
    handles, _ = ax.get_legend_handles_labels()
    kinds = dict.fromkeys(c.name for c in cases)
    handles += [Patch(facecolor=colors.get(kind, "tab:gray"), label=f"achieved: {kind}")
                for kind in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(5, len(handles)),
               fontsize=8, frameon=False)
    return fig


def run_bench_cli(options: BenchOptions, output_format: str = "table",
                  plot: str | None = None) -> int:
    """Run the bench and print the table (or JSON); write the plot if asked. Returns 0, or 1
    when a case failed."""
    if plot:
        from kvcore.cli.plotting import check_plot_path

        check_plot_path(plot)
    report = run_bench(options)
    if output_format == "json":
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    if plot:
        print(f"wrote {plot_report(report, plot)}", file=sys.stderr)
    return 1 if any(c.error for c in report.cases) else 0
