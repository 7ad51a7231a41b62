"""benchmarks/bench_nvidia.py runs end to end on tiny shapes (``--smoke``): on a machine
without a GPU the CUDA sections are skipped with their reasons, never failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_nvidia.py"


def test_bench_smoke(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "bench_nvidia.json").read_text())
    assert results["errors"] == []
    assert (tmp_path / "bench_nvidia_log.txt").read_text().strip()
    lines = result.stdout.splitlines()  # the table comes last: header, rule, one row each
    assert lines[-len(results["timings"]) - 2].startswith("op ")
    if not torch.cuda.is_available():
        assert {s["section"] for s in results["skipped"]} == {
            "build the CUDA C++ extension", "correctness: CUDA C++ cache write",
            "correctness: FLASHINFER", "block copy timings", "FLASHINFER decode timings"}
        assert {(t["impl"], t["layout"]) for t in results["timings"]} == {
            ("triton", "standard"), ("torch", "standard"), ("triton", "cross_layer")}


def test_bench_backends_smoke(tmp_path):
    """benchmarks/bench_backends.py --smoke: TRITON_ATTN on tiny decode and prefill shapes on
    the CPU; every row checked against the reference, the JSON at --json, the table last."""
    script = SCRIPT.parent / "bench_backends.py"
    result = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path),
                             "--json", str(tmp_path / "rows.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "rows.json").read_text())
    assert results["errors"] == [] and results["checks"]
    assert all(c["ok"] for c in results["checks"])
    assert [(r["kind"], r["shape"]) for r in results["rows"]] == [
        ("decode", "3x40"), ("decode", "2x70"), ("prefill", "2x24"), ("prefill", "1x8+40")]
    assert result.stdout.splitlines()[-1] == "checks: 4 passed, 0 failed"


def test_cache_write_bench_smoke(tmp_path):
    """benchmarks/bench_cache_write.py: the Triton write checked bit for bit on every stride
    order, then timed, the table last; without a GPU the CUDA write is skipped with its
    reason."""
    script = SCRIPT.with_name("bench_cache_write.py")
    result = subprocess.run([sys.executable, str(script), "--smoke", "--json", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "bench_cache_write.json").read_text())
    assert results["errors"] == []
    checks = {c["check"] for c in results["checks"]}
    assert {"triton.interleaved.fp8_e4m3.bit_exact",
            "triton.cross_layer_interleaved.auto.neighbours_untouched"} <= checks
    assert all(c["ok"] for c in results["checks"])
    assert "checks: " in result.stdout and '"timings"' in result.stdout
    if not torch.cuda.is_available():
        assert {s["section"] for s in results["skipped"]} == {
            "build the CUDA C++ extension", "correctness: a layer beyond 2**31 elements"}
        assert {t["impl"] for t in results["timings"]} == {"triton", "torch"}
