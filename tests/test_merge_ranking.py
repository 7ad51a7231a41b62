"""``benchmarks/merge_ranking.py``: a GPU run's ranking merged into a platform's shipped file,
cut to the backends the platform offers, replacing the same steps and keeping the others."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvcore
from kvcore.ranking import (
    DeviceIdentity,
    MeasuredCase,
    Ranking,
    load_rankings,
    ranking_config_key,
    ranking_shape_class,
    write_ranking,
)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_ranking.py"
H100 = DeviceIdentity("cuda", "NVIDIA H100 80GB HBM3", "9.0")
LLAMA = kvcore.AttentionSelectorConfig(head_size=128, block_size=16)
MLA = kvcore.AttentionSelectorConfig(head_size=576, block_size=64, use_mla=True)


def case(config, shape: str, times: dict[str, float]) -> MeasuredCase:
    return MeasuredCase("decode", ranking_shape_class(config), shape, ranking_config_key(config),
                        times, preset="model", layer="full")


def ranking(*cases: MeasuredCase) -> Ranking:
    return Ranking("2026-12-07", H100, {"torch": "2.11"}, cases)


def test_a_run_replaces_its_steps_keeps_the_others_and_drops_what_cuda_never_selects(tmp_path):
    shipped, run = tmp_path / "shipped.json", tmp_path / "run.json"
    write_ranking(ranking(case(LLAMA, "decode 8x32768", {"FLASHINFER": 40.0, "TRITON_ATTN": 70.0}),
                          case(LLAMA, "decode 64x4096", {"FLASHINFER": 44.0, "TRITON_ATTN": 53.0}),
                          case(MLA, "decode 64x4096", {"TRITON_MLA": 120.0})), shipped)
    write_ranking(ranking(case(LLAMA, "decode 8x32768", {"TRITON_ATTN": 40.2,
                                                         "TRITON_ATTN_HND": 40.1}),
                          case(MLA, "decode 8x32768", {"TRITON_MLA": 90.0,
                                                       "FLASHINFER_MLA": 95.0})), run)
    out = subprocess.run([sys.executable, str(SCRIPT), str(run), "--into", str(shipped)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 cases" in out.stdout and "2 earlier cases kept" in out.stdout
    assert "dropped: TRITON_ATTN_HND" in out.stdout
    (merged,) = load_rankings(shipped)
    times = {(c.config["use_mla"], c.shape): c.times_us for c in merged.cases}
    assert times == {
        (False, "decode 8x32768"): {"TRITON_ATTN": 40.2},  # the run's, HND dropped
        (False, "decode 64x4096"): {"FLASHINFER": 44.0, "TRITON_ATTN": 53.0},  # kept
        (True, "decode 64x4096"): {"TRITON_MLA": 120.0},
        (True, "decode 8x32768"): {"TRITON_MLA": 90.0, "FLASHINFER_MLA": 95.0},
    }
