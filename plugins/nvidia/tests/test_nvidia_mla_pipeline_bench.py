"""benchmarks/bench_mla_pipeline.py runs end to end on the CPU (``--smoke``): CPU_MLA's forward
against the same math around the reference op, every row checked, the table last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_mla_pipeline.py"


def test_bench_mla_pipeline_smoke(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "bench_mla_pipeline.json").read_text())
    assert results["errors"] == []
    assert results["checks"] and all(c["ok"] for c in results["checks"])
    rows = results["timings"]
    assert {(r["shape"], r["path"]) for r in rows} == {
        (shape, path) for shape in ("B2x80 H16", "B3x40 H128") for path in ("direct", "CPU_MLA")}
    lines = result.stdout.splitlines()  # the table comes last: header, rule, one row each
    assert lines[-len(rows) - 2].startswith("shape ")
