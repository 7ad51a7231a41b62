"""``kvcore tune``: time the valid backends on this machine for model presets (or an engine's
own layer shape) within a time budget, and write the ranking file the selector follows
(:mod:`kvcore.ranking`; the format is in docs/tune.md).

Every step of :mod:`kvcore.cli.model_bench` becomes one case of the ranking: its phase, the
shape class of its selector config, the step's shape and each backend's median time. The
ranking replaces this device's previous one in the file and keeps other devices' rankings;
this device's earlier cases that the run did not measure again stay in it while they still
apply (same library versions: :func:`kvcore.merged_ranking`), unless ``replace`` is set, so
``kvcore tune --model A`` then ``--model B`` ranks both.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvcore
from kvcore import (
    MODELS,
    AttentionSelectorConfig,
    LayerAttention,
    MeasuredCase,
    MeasuredOrder,
    ModelPreset,
    Ranking,
    current_identity,
    library_versions,
    load_rankings,
    merged_ranking,
    ranking_config_key,
    ranking_path,
    ranking_shape_class,
    write_ranking,
)
from kvcore.cli.model_bench import (
    ModelBenchOptions,
    ModelBenchReport,
    format_model_report,
    run_model_bench,
)

__all__ = ["TuneOptions", "TuneResult", "custom_preset", "format_tune", "run_tune"]


@dataclass
class TuneOptions:
    """What ``kvcore tune`` times. ``models`` defaults to every preset on a GPU and to
    ``llama-3.1-8b`` with ``small`` shapes on a CPU; ``output`` to :func:`kvcore.ranking
    .ranking_path` (``KVCORE_RANKING_FILE``); ``budget_s`` bounds the timing (the steps not
    reached are left out of the ranking)."""

    models: Sequence[str | ModelPreset] = ()
    small: bool | None = None
    #: Drop this device's earlier cases instead of keeping those not measured again.
    replace: bool = False
    kv_cache_dtypes: Sequence[str] = ModelPreset.KV_CACHE_DTYPES
    block_sizes: Sequence[int] = ModelPreset.BLOCK_SIZES
    phases: Sequence[str] = ("decode", "prefill", "mixed")
    budget_s: float = 300.0
    output: str | Path | None = None
    platform: str | None = None
    dtype: str | None = None
    reps: int | None = None
    progress: bool = True


@dataclass
class TuneResult:
    ranking: Ranking
    path: Path
    report: ModelBenchReport
    orders: dict[str, MeasuredOrder] = field(default_factory=dict)
    #: Cases of this device's earlier ranking kept beside the new ones, and its date.
    kept: int = 0
    kept_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "ranking": self.ranking.to_dict(),
                "kept_cases": self.kept, "kept_from": self.kept_from,
                "orders": {k: v.to_dict() for k, v in self.orders.items()},
                "bench": self.report.to_dict()}


def custom_preset(num_heads: int, num_kv_heads: int, head_size: int,
                  sliding_window: int | None = None, dtype: str = "bfloat16") -> ModelPreset:
    """A one-layer-kind preset named ``custom`` from an engine's own attention shape per
    rank."""
    layer = LayerAttention("sliding" if sliding_window else "full", 1, num_heads, num_kv_heads,
                           head_size, sliding_window=sliding_window)
    return ModelPreset("custom", "custom", 1, (layer,), "one layer kind",
                       "the engine's own config", kvcore.parse_dtype(dtype))


def ranking_from_report(report: ModelBenchReport, platform: kvcore.Platform, budget_s: float
                        ) -> Ranking:
    """The ranking of ``report``'s kvcore rows (peers left out) on ``platform``'s device here,
    dated today: what ``kvcore tune`` writes, and ``benchmarks/bench_matrix.py --ranking``."""
    groups: dict[tuple, dict[str, Any]] = {}
    for row in report.rows:
        if not row.kvcore or row.impl == "(kvcore)":
            continue
        config = AttentionSelectorConfig(**row.config)
        entry = groups.setdefault(row.group, {
            "phase": row.phase, "config": config, "shape": f"{row.case}, {row.layer_shape}",
            "preset": row.model, "layer": row.layer, "times": {}, "errors": {}})
        if row.ok:
            entry["times"][row.impl] = row.seconds * 1e6
        elif row.error:
            entry["errors"][row.impl] = row.error
    cases = tuple(MeasuredCase(phase=e["phase"], shape_class=ranking_shape_class(e["config"]),
                               shape=e["shape"], config=ranking_config_key(e["config"]),
                               times_us=e["times"], preset=e["preset"], layer=e["layer"],
                               errors=e["errors"])
                  for e in groups.values() if e["times"] or e["errors"])
    identity = current_identity(platform, platform.get_device_capability())
    if identity is None:
        raise ValueError(f"platform={platform.name}: no device name to keep the ranking under "
                         "(the platform reports none); kvcore tune needs a present device")
    return Ranking(datetime.date.today().isoformat(), identity, dict(library_versions()),
                   cases, _driver(platform), budget_s)


def _driver(platform: kvcore.Platform) -> str | None:
    """The GPU driver version where torch tells it (recorded, not compared)."""
    if platform.device_type != "cuda":
        return None
    import torch

    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        return str(get()) if get is not None else None
    except Exception:
        return None


def _orders(ranking: Ranking, path: Path) -> dict[str, MeasuredOrder]:
    """The measured order per shape class (what the selector follows for a config of it)."""
    by_class: dict[str, list[MeasuredCase]] = {}
    for case in ranking.cases:
        if case.times_us:
            by_class.setdefault(case.shape_class, []).append(case)
    return {name: MeasuredOrder.from_cases(cases, ranking.date, str(path), ranking.device)
            for name, cases in by_class.items()}


def run_tune(options: TuneOptions) -> TuneResult:
    """Time, build the ranking, write it (see the module docstring)."""
    platform = kvcore.require_present_platform(options.platform)
    on_gpu = platform.device().type != "cpu"
    small = (not on_gpu) if options.small is None else options.small
    models = list(options.models) or (list(MODELS) if on_gpu else ["llama-3.1-8b"])
    path = Path(options.output) if options.output else ranking_path()
    if path is None:
        raise ValueError("KVCORE_RANKING_FILE=none turns measured selection off and names no "
                         "file; pass --output PATH or set KVCORE_RANKING_FILE to a path")

    def log(line: str) -> None:
        if options.progress:
            print(line, file=sys.stderr, flush=True)

    report = run_model_bench(ModelBenchOptions(
        models=models, kv_cache_dtypes=options.kv_cache_dtypes, block_sizes=options.block_sizes,
        phases=options.phases, small=small, dtype=options.dtype, platform=platform.name,
        budget_s=options.budget_s, reps=options.reps, log=log))
    ranking = ranking_from_report(report, platform, options.budget_s)
    earlier = None if options.replace else next(
        (r for r in load_rankings(path) if r.device == ranking.device), None)
    ranking, kept = merged_ranking(ranking, earlier)
    written = write_ranking(ranking, path)
    kvcore.clear_selection_cache()
    return TuneResult(ranking, written, report, _orders(ranking, written), kept,
                      earlier.date if kept else None)


def format_tune(result: TuneResult, verbose: bool = False) -> str:
    """Where the ranking went, what it holds, and the order per shape class."""
    r = result.ranking
    lines = [f"kvcore tune: {r.device.describe()}, {r.date}; {len(r.cases) - result.kept} "
             f"cases in {result.report.seconds:.1f} s"
             + (" (time budget spent: later steps left out)"
                if result.report.stopped_by_budget else ""),
             f"wrote {result.path}"
             + (f" (with {result.kept} earlier case(s) of this device measured on "
                f"{result.kept_from} with the same library versions; --replace drops them)"
                if result.kept else ""), ""]
    if verbose:
        lines += [format_model_report(result.report), ""]
    for shape, order in result.orders.items():
        lines.append(f"{shape}: order {', '.join(order.order)}")
        lines.extend(f"  {line}" for line in order.phase_lines())
    errors = sorted({f"{b}: {e}" for c in r.cases for b, e in c.errors.items()})
    if errors:
        lines.append("")
        lines += [f"failed: {e}" for e in errors]
    lines.append("")
    lines.append("kvcore select --explain (with the config's flags) now quotes this ranking")
    return "\n".join(lines)
