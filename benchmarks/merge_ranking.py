#!/usr/bin/env python3
"""Merge rankings measured on a GPU (``kvcore tune --output``, ``bench_matrix.py --ranking``)
into the ranking file a platform ships (``Platform.SHIPPED_RANKING``, e.g.
``kvcore/platforms/cuda_ranking.json``).

Each run's cases keep only the backends the platform offers for the case's config (its
priority list: a backend a run timed that the platform never selects, such as
``TRITON_ATTN_HND``, says nothing about the platform's order), then replace the shipped cases
of the same step (:meth:`kvcore.ranking.MeasuredCase.step_key`) of the same device; the other
shipped cases stay. A run of other library versions than the shipped ranking of its device
replaces that ranking whole (:func:`kvcore.ranking.merged_ranking`). Runs are merged in the
order given: a later one wins a step both measured.

Usage: ``python benchmarks/merge_ranking.py RUN.json [RUN.json ...] [--platform cuda]
[--into PATH]`` (``--into``: default the platform's shipped file in this checkout).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from importlib import resources
from pathlib import Path

import kvcore
from kvcore.ranking import (
    MeasuredCase,
    Ranking,
    load_rankings,
    merged_ranking,
    write_ranking,
)


def offered_only(ranking: Ranking, platform: kvcore.Platform) -> tuple[Ranking, list[str]]:
    """``ranking`` with each case's times and errors cut to the backends ``platform`` offers
    for the case's config on the ranking's device, and the backends dropped."""
    capability = (kvcore.DeviceCapability.parse(ranking.device.capability)
                  if ranking.device.capability else None)
    dropped: set[str] = set()
    cases: list[MeasuredCase] = []
    for case in ranking.cases:
        config = kvcore.AttentionSelectorConfig(**case.config)
        offered = set(platform.get_backend_priorities(config, capability))
        dropped |= (set(case.times_us) | set(case.errors)) - offered
        kept = dataclasses.replace(
            case, times_us={b: t for b, t in case.times_us.items() if b in offered},
            errors={b: e for b, e in case.errors.items() if b in offered})
        if kept.times_us or kept.errors:
            cases.append(kept)
    return dataclasses.replace(ranking, cases=tuple(cases)), sorted(dropped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="ranking files a GPU run wrote")
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--into", type=Path, default=None,
                        help="the shipped ranking file (default: the platform's)")
    args = parser.parse_args()
    platform = kvcore.get_platform(args.platform)
    into = args.into
    if into is None:
        shipped = getattr(type(platform), "SHIPPED_RANKING", None)
        if shipped is None:
            print(f"platform {args.platform} ships no ranking file; pass --into")
            return 2
        into = Path(str(resources.files(shipped[0]) / shipped[1]))
    for run in args.runs:
        for ranking in load_rankings(run):
            if ranking.device.platform != platform.name:
                print(f"{run}: skipped the ranking of {ranking.device.describe()} (not "
                      f"{platform.name})")
                continue
            ranking, dropped = offered_only(ranking, platform)
            earlier = next((r for r in load_rankings(into) if r.device == ranking.device), None)
            merged, kept = merged_ranking(ranking, earlier)
            write_ranking(merged, into)
            print(f"{run}: {len(ranking.cases)} cases of {ranking.device.describe()} merged "
                  f"into {into} ({kept} earlier cases kept"
                  + (f"; not offered by {platform.name}, dropped: {', '.join(dropped)}"
                     if dropped else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
