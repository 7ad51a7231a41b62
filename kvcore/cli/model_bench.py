"""Model-shaped attention timings: every valid kvcore backend (and, through ``peers``, libraries
called directly) on a model preset's layers (:mod:`kvcore.models`), per KV-cache dtype, block
size and step. ``kvcore bench --model``, ``kvcore tune`` and ``benchmarks/bench_matrix.py``
run it.

Each step (:class:`kvcore.models.ModelCase`: decode at two points, a prefill, a mixed
chunked-prefill step) runs as an engine runs it: the backend's builder builds the step's
metadata once, then the layer's ``forward`` is timed (:func:`kvcore.cli.harness.time_call`:
from a CUDA graph where the backend declares graph support for the step, else CUDA events;
wall time on a CPU). Each row counts the bytes the step must read (K/V of every request's
context within the window, the queries and the output) and its attention FLOPs, and is held
to the roofline of the ceilings measured in the same run: ``max(bytes / read bandwidth,
FLOPs / matmul rate)`` over the measured time (1.0: at the ceiling).
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import kvcore
from kvcore import (
    PHASES,
    AttentionSelectorConfig,
    LayerAttention,
    ModelCase,
    ModelPreset,
    build_attention_metadata,
    get_model,
)
from kvcore.cli import harness

__all__ = ["ModelBenchOptions", "ModelBenchReport", "ModelBenchRow", "PeerUnsupported",
           "StepInputs", "format_model_report", "run_model_bench", "valid_backends"]


class PeerUnsupported(Exception):
    """A peer library that cannot run a step (its message says why); recorded, not an error."""


@dataclass
class ModelBenchOptions:
    """What to time. ``platform`` defaults to the detected one (it must be present);
    ``small`` scales every layer down (:meth:`ModelPreset.scaled_down`) and uses the small
    steps, for a CPU; ``dtype`` defaults to the model's (float32 with ``small`` on a CPU);
    ``budget_s`` stops starting new steps once spent (0: no limit)."""

    models: Sequence[str | ModelPreset]
    kv_cache_dtypes: Sequence[str] = ModelPreset.KV_CACHE_DTYPES
    block_sizes: Sequence[int] = ModelPreset.BLOCK_SIZES
    phases: Sequence[str] = PHASES
    small: bool = False
    dtype: str | None = None
    platform: str | None = None
    backends: Sequence[str] | None = None
    budget_s: float = 0.0
    reps: int | None = None
    log: Callable[[str], None] | None = None


@dataclass
class ModelBenchRow:
    """One implementation on one step of one layer kind (``impl``: a kvcore backend, or a
    peer such as ``flashinfer direct``)."""

    model: str
    layer: str
    layer_shape: str
    kv_cache_dtype: str
    block_size: int
    phase: str
    case: str
    impl: str
    kvcore: bool
    selected: bool = False
    seconds: float = 0.0
    num_bytes: int = 0
    flops: float = 0.0
    roofline_s: float = 0.0
    timing: str = ""
    error: str | None = None
    skipped: str | None = None
    caveats: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    vs_best_other: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None and self.seconds > 0

    @property
    def fraction_of_roofline(self) -> float:
        return self.roofline_s / self.seconds if self.ok else 0.0

    @property
    def group(self) -> tuple:
        return (self.model, self.layer, self.kv_cache_dtype, self.block_size, self.case)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "us": self.seconds * 1e6,
                "fraction_of_roofline": self.fraction_of_roofline}


@dataclass
class ModelBenchReport:
    date: str
    device: str
    platform: str
    dtype: str
    small: bool
    read_gbps: float
    matmul_tflops: float
    rows: list[ModelBenchRow] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by_budget: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"date": self.date, "device": self.device, "platform": self.platform,
                "dtype": self.dtype, "small": self.small, "read_gbps": self.read_gbps,
                "matmul_tflops": self.matmul_tflops, "seconds": self.seconds,
                "stopped_by_budget": self.stopped_by_budget,
                "rows": [r.to_dict() for r in self.rows]}


@dataclass
class StepInputs:
    """One step's inputs as a peer library sees them: the metadata, the queries (MLA: the
    layer's ``(tokens, heads, qk_nope + qk_rope)`` query, as kvcore's backends get it), a
    standard blocks-first cache (``(num_blocks, 2, block_size, num_kv_heads, head_size)`` NHD;
    MLA ``(num_blocks, block_size, latent)``) filled with random values, and for MLA the
    layer's ``kv_b_proj`` weight ``(heads * (qk_nope + v_head), kv_lora_rank)`` (``None``
    otherwise), which kvcore's backends absorb."""

    preset: ModelPreset
    layer: LayerAttention
    case: ModelCase
    config: AttentionSelectorConfig
    device: torch.device
    common: kvcore.AttentionMetadata
    tables: list[list[int]]
    num_blocks: int
    query: torch.Tensor
    kv_cache: torch.Tensor
    kv_b_proj_weight: torch.Tensor | None = None


#: ``peers(inputs) -> [(name, fn, graph)]``: library calls timed beside kvcore's backends;
#: raise :class:`PeerUnsupported` for a step a library cannot run.
Peers = Callable[[StepInputs], list[tuple[str, Callable[[], object], bool]]]


def valid_backends(config: AttentionSelectorConfig, platform: kvcore.Platform
                   ) -> tuple[str | None, list[str], kvcore.SelectionReport]:
    """The selected backend (``None``: none valid), every valid one (selected first) and the
    report."""
    report = kvcore.explain_selection(config, platform)
    pick = report.selected.name if report.selected else None
    valid = [c.name for c in report.candidates if c.valid and c.name != pick]
    return pick, ([pick] if pick else []) + valid, report


def _tables(case: ModelCase, block_size: int, seed: int) -> tuple[list[list[int]], int]:
    pages = [-(-(q + c) // block_size) for q, c in zip(case.q_lens, case.ctx_lens, strict=True)]
    num_blocks = sum(pages) + 1
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(ids[start:start + n])
        start += n
    return tables, num_blocks


def _work(layer: LayerAttention, case: ModelCase, dtype: torch.dtype, cache_dtype: torch.dtype
          ) -> tuple[int, float]:
    """Bytes the step must move (K/V in the window once, queries, output) and its FLOPs."""
    window = layer.sliding_window
    kv_tokens = sum(min(q + c, window + q - 1) if window else q + c
                    for q, c in zip(case.q_lens, case.ctx_lens, strict=True))
    pairs = case.attended_pairs(window)
    if layer.mla is not None:
        m = layer.mla
        per_token = m.latent_size * cache_dtype.itemsize
        q_row, out_row = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        flops = 2.0 * layer.num_heads * (m.latent_size + m.kv_lora_rank) * pairs  # absorbed
    else:
        dv = layer.head_size_v or layer.head_size
        per_token = layer.num_kv_heads * (layer.head_size + dv) * cache_dtype.itemsize
        q_row, out_row = layer.head_size, dv
        flops = 2.0 * layer.num_heads * (layer.head_size + dv) * pairs
    rows = case.num_tokens * layer.num_heads * (q_row + out_row) * dtype.itemsize
    return kv_tokens * per_token + rows, flops


def _fill(cache: torch.Tensor, dtype: torch.dtype) -> None:
    """Random values in the cache's logical view, chunk by chunk (fp8 caches by conversion)."""
    gen = torch.Generator(device=cache.device).manual_seed(1234)
    for start in range(0, cache.shape[0], 2048):
        chunk = cache[start:start + 2048]
        chunk.copy_(torch.randn(chunk.shape, generator=gen, device=cache.device, dtype=dtype))


class _Step:
    """A step of one layer kind: metadata, queries and the impl arguments of a backend."""

    def __init__(self, preset: ModelPreset, layer: LayerAttention, case: ModelCase,
                 config: AttentionSelectorConfig, device: torch.device, seed: int) -> None:
        self.preset, self.layer, self.case, self.config = preset, layer, case, config
        self.device, self.dtype = device, config.dtype
        self.tables, self.num_blocks = _tables(case, config.block_size, seed)
        self.common = build_attention_metadata(list(case.q_lens), list(case.ctx_lens),
                                               self.tables, config.block_size, device=device,
                                               num_blocks=self.num_blocks)
        gen = torch.Generator().manual_seed(seed)
        q_width = (layer.mla.qk_nope_head_dim + layer.mla.qk_rope_head_dim if layer.mla
                   else layer.head_size)
        self.query = torch.randn(case.num_tokens, layer.num_heads, q_width,
                                 generator=gen).to(device, self.dtype)
        self.kv_new = torch.randn(case.num_tokens, layer.num_kv_heads, layer.head_size,
                                  generator=gen).to(device, self.dtype)
        self.w_kv_b = (torch.randn(layer.num_heads * (layer.mla.qk_nope_head_dim
                                                      + layer.mla.v_head_dim),
                                   layer.mla.kv_lora_rank, generator=gen).to(device, self.dtype)
                       * layer.mla.kv_lora_rank ** -0.5 if layer.mla else None)

    def spec(self) -> kvcore.KVCacheSpec:
        c = self.config
        if self.layer.mla is not None:
            return kvcore.MLAAttentionSpec(block_size=c.block_size, dtype=c.dtype,
                                           kv_cache_dtype=c.kv_cache_dtype,
                                           kv_lora_rank=self.layer.mla.kv_lora_rank,
                                           qk_rope_head_dim=self.layer.mla.qk_rope_head_dim)
        # A window's layers get their own builder, told the window (as vLLM's KV-cache groups).
        return kvcore.FullAttentionSpec(block_size=c.block_size, dtype=c.dtype,
                                        kv_cache_dtype=c.kv_cache_dtype,
                                        num_kv_heads=self.layer.num_kv_heads,
                                        head_size=self.layer.head_size,
                                        sliding_window=self.layer.sliding_window)

    def impl(self, backend: type[kvcore.AttentionBackend]) -> kvcore.AttentionImpl:
        layer = self.layer
        kwargs: dict[str, Any] = dict(num_heads=layer.num_heads, head_size=layer.head_size,
                                      scale=layer.softmax_scale, num_kv_heads=layer.num_kv_heads,
                                      kv_cache_dtype=self.config.kv_cache_dtype)
        if layer.mla is not None:
            m = layer.mla
            kwargs.update(kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                          qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                          kv_b_proj_weight=self.w_kv_b)
        else:
            kwargs["sliding_window"] = layer.sliding_window
            # The layer's features, as the model runs them (sink values do not change the
            # time; zeros are a valid logit).
            if layer.logits_soft_cap is not None:
                kwargs["logits_soft_cap"] = layer.logits_soft_cap
            if layer.has_sink:
                kwargs["sinks"] = torch.zeros(layer.num_heads, device=self.device)
        return backend.get_impl_cls()(**kwargs)

    def runner(self, name: str) -> tuple[Callable[[], object], bool]:
        """The backend as an engine calls it: builder once, then the layer's forward; and
        whether it may be timed from a CUDA graph."""
        backend = kvcore.resolve_backend(name)
        c = self.config
        caches = kvcore.allocate_kv_caches(
            backend, num_layers=1, num_blocks=self.num_blocks, block_size=c.block_size,
            num_kv_heads=self.layer.num_kv_heads, head_size=self.layer.head_size,
            dtype=c.dtype, device=self.device, kv_cache_dtype=c.kv_cache_dtype,
            cross_layer=False)
        kv_cache = caches.layers[0]
        _fill(kv_cache, self.dtype)
        n = len(self.case.q_lens)
        builder = backend.get_builder_cls()(
            self.spec(), num_heads=self.layer.num_heads, max_num_seqs=n,
            max_num_batched_tokens=max(self.case.num_tokens, n),
            max_model_len=max(q + x for q, x in zip(self.case.q_lens, self.case.ctx_lens,
                                                     strict=True)),
            device=self.device)
        declared = backend.CUDA_GRAPH_SUPPORT
        decode = self.case.phase == "decode"
        graphs = self.device.type == "cuda" and (
            declared is kvcore.CudaGraphSupport.ALWAYS
            or (declared is kvcore.CudaGraphSupport.UNIFORM_DECODE and decode))
        meta = builder.build(self.common, graph_batch_size=n if graphs else None)
        impl = self.impl(backend)
        width = self.layer.mla.v_head_dim if self.layer.mla else self.layer.head_size
        out = torch.empty(self.case.num_tokens, self.layer.num_heads, width, dtype=self.dtype,
                          device=self.device)
        scales, q, kv = kvcore.LayerScales(), self.query, self.kv_new
        return (lambda: impl.forward(scales, q, kv, kv, kv_cache, meta, output=out)), graphs

    def inputs(self) -> StepInputs:
        """A standard NHD (MLA: latent) cache for peers, filled with random values."""
        if self.layer.mla is not None:
            shape: tuple[int, ...] = (self.num_blocks, self.config.block_size,
                                      self.layer.head_size)
        else:
            shape = (self.num_blocks, 2, self.config.block_size, self.layer.num_kv_heads,
                     self.layer.head_size)
        cache = torch.empty(shape, dtype=self.spec().cache_dtype, device=self.device)
        _fill(cache, self.dtype)
        return StepInputs(self.preset, self.layer, self.case, self.config, self.device,
                          self.common, self.tables, self.num_blocks, self.query, cache,
                          self.w_kv_b)


def _presets(options: ModelBenchOptions) -> list[ModelPreset]:
    presets = [m if isinstance(m, ModelPreset) else get_model(m) for m in options.models]
    if not presets:
        raise ValueError("models=[]: name at least one preset (kvcore.models.MODELS)")
    return [p.scaled_down() for p in presets] if options.small else presets


def _check_options(options: ModelBenchOptions) -> None:
    for phase in options.phases:
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} (choose from: {', '.join(PHASES)})")
    for kv in options.kv_cache_dtypes:
        AttentionSelectorConfig(head_size=128, kv_cache_dtype=kv)  # a ValueError naming it
    for bs in options.block_sizes:
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"block_size={bs!r} must be a positive integer")


def _grid(presets: list[ModelPreset], options: ModelBenchOptions
          ) -> Iterable[tuple[ModelPreset, LayerAttention, str, int, ModelCase]]:
    for preset in presets:
        for layer in preset.layers:
            for kv in options.kv_cache_dtypes:
                for bs in options.block_sizes:
                    for case in preset.cases(options.small):
                        if case.phase in options.phases:
                            yield preset, layer, kv, bs, case


def run_model_bench(options: ModelBenchOptions, peers: Peers | None = None) -> ModelBenchReport:
    """Time every valid backend (and ``peers``) on every step of the options' presets."""
    started = time.perf_counter()
    _check_options(options)
    presets = _presets(options)
    platform = kvcore.require_present_platform(options.platform)
    device = platform.device()
    on_gpu = device.type != "cpu"
    log = options.log or (lambda _msg: None)
    measure = functools.partial(harness.time_call, device=device, warmup=2,
                                samples=options.reps or (None if on_gpu else 3))
    read_gbps, _ = harness.read_gbps(
        torch.ones((512 << 20 if on_gpu else 64 << 20) // 4, device=device),
        functools.partial(measure, graph=False))
    dtype_name = options.dtype or ("float32" if options.small and not on_gpu else None)
    first_dtype = kvcore.parse_dtype(dtype_name) if dtype_name else presets[0].dtype
    matmul, _ = harness.matmul_tflops(4096 if on_gpu else 256, first_dtype, device,
                                      functools.partial(measure, graph=False))
    report = ModelBenchReport(datetime.date.today().isoformat(), harness.device_name(device),
                              platform.name, str(first_dtype).removeprefix("torch."),
                              options.small, read_gbps, matmul)
    for seed, (preset, layer, kv, bs, case) in enumerate(_grid(presets, options)):
        if options.budget_s and time.perf_counter() - started > options.budget_s:
            report.stopped_by_budget = True
            log(f"time budget of {options.budget_s:g} s spent: stopping before {preset.name} "
                f"{layer.kind} {case.name}")
            break
        dtype = kvcore.parse_dtype(dtype_name) if dtype_name else preset.dtype
        config = layer.selector_config(dtype, kv, bs)
        base = dict(model=preset.name, layer=layer.kind, layer_shape=layer.describe(),
                    kv_cache_dtype=kv, block_size=bs, phase=case.phase, case=case.name,
                    config={k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype)
                                else getattr(v, "value", v))
                            for k, v in config.as_kwargs().items()})
        pick, names, selection = valid_backends(config, platform)
        if options.backends is not None:
            names = [n for n in names if n in options.backends]
        cache_dtype = kvcore.FullAttentionSpec(block_size=bs, dtype=dtype,
                                               kv_cache_dtype=kv).cache_dtype
        num_bytes, flops = _work(layer, case, dtype, cache_dtype)
        roofline = max(num_bytes / (read_gbps * 1e9), flops / (matmul * 1e12))
        if pick is None:
            reasons = "; ".join(f"{c.name}: {', '.join(c.reasons)}"
                                for c in selection.candidates if c.in_priority_list)
            report.rows.append(ModelBenchRow(**base, impl="(kvcore)", kvcore=True,
                                             skipped=f"no valid kvcore backend ({reasons})"))
        step = _Step(preset, layer, case, config, device, seed)
        for name in names:
            row = ModelBenchRow(**base, impl=name, kvcore=True, selected=name == pick,
                                num_bytes=num_bytes, flops=flops, roofline_s=roofline)
            try:
                fn, graphs = step.runner(name)
                row.seconds, row.timing = measure(fn, graph=graphs)
            except Exception as exc:  # one backend's failure must not hide the others
                row.error = f"{type(exc).__name__}: {exc}"
            report.rows.append(row)
            log(_row_line(row))
        if peers is not None:
            try:
                runners = peers(step.inputs())
            except PeerUnsupported as why:
                runners = []
                log(f"  peers: {why}")
            for name, fn, graphs in runners:
                row = ModelBenchRow(**base, impl=name, kvcore=False, num_bytes=num_bytes,
                                    flops=flops, roofline_s=roofline)
                try:
                    row.seconds, row.timing = measure(fn, graph=graphs)
                except PeerUnsupported as why:
                    row.skipped = str(why)
                except Exception as exc:
                    row.error = f"{type(exc).__name__}: {exc}"
                report.rows.append(row)
                log(_row_line(row))
        del step
        if on_gpu:
            torch.cuda.empty_cache()
    _ratios(report.rows)
    report.seconds = time.perf_counter() - started
    return report


def _ratios(rows: list[ModelBenchRow]) -> None:
    """Each row's speed against the fastest other implementation of its step (>1: faster)."""
    groups: dict[tuple, list[ModelBenchRow]] = {}
    for row in rows:
        if row.ok:
            groups.setdefault(row.group, []).append(row)
    for members in groups.values():
        for row in members:
            others = [r.seconds for r in members if r is not row]
            row.vs_best_other = min(others) / row.seconds if others else None


def _row_line(row: ModelBenchRow) -> str:
    head = (f"{row.model} {row.layer} kv={row.kv_cache_dtype} bs{row.block_size} {row.case} "
            f"{row.impl}")
    if row.error:
        return f"{head}: error: {row.error}"
    if row.skipped:
        return f"{head}: skipped: {row.skipped}"
    return (f"{head}: {row.seconds * 1e6:.1f} us, {100 * row.fraction_of_roofline:.0f}% of "
            f"roofline [{row.timing}]")


def format_model_report(report: ModelBenchReport) -> str:
    """Header, then one row per implementation and step: time, % of the roofline of the
    ceilings measured in the run, speed against the fastest other implementation."""
    lines = [f"kvcore bench --model: {report.device}, platform {report.platform}, "
             f"{report.date}" + (" (small shapes)" if report.small else ""),
             f"ceilings: read {report.read_gbps:.1f} GB/s, {report.dtype} matmul "
             f"{report.matmul_tflops:.3g} TFLOP/s", ""]
    rows = []
    for r in report.rows:
        mark = "*" if r.selected else ""
        if not r.ok:
            rows.append([r.model, r.layer, r.kv_cache_dtype, r.block_size, r.case, r.impl,
                         "", "", "", f"{'error' if r.error else 'skipped'}: "
                         f"{r.error or r.skipped}"])
            continue
        vs = "" if r.vs_best_other is None else f"{r.vs_best_other:.2f}x"
        rows.append([r.model, r.layer, r.kv_cache_dtype, r.block_size, r.case, r.impl + mark,
                     f"{r.seconds * 1e6:.1f}", f"{100 * r.fraction_of_roofline:.0f}%", vs,
                     "; ".join(r.caveats)])
    lines.append(harness.format_table(rows, ["model", "layer", "kv", "block", "step", "impl",
                                             "time (us)", "of roofline", "vs best other",
                                             "note"], tablefmt="simple"))
    lines.append(f"\n*: the backend kvcore selects. {len(report.rows)} rows in "
                 f"{report.seconds:.1f} s" + (" (stopped: time budget spent)"
                                             if report.stopped_by_budget else ""))
    return "\n".join(lines)
