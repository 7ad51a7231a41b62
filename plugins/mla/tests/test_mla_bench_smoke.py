"""benchmarks/bench_mla_fp8_decode.py runs end to end on tiny shapes (``--smoke``, the CPU under
``TRITON_INTERPRET=1``), its precompile workers included: every call checked against the
reference, the table printed last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_mla_fp8_decode.py"


def test_bench_mla_fp8_decode_smoke(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--compile-workers", "1",
                             "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "bench_mla_fp8_decode.json").read_text())
    assert data["errors"] == [] and data["meta"]["precompile"]["failed"] == 0
    assert data["correctness"] and all(c["ok"] for c in data["correctness"])
    timings = data["timings"]
    # Per shape: the row on both caches and with fp8_fp16, each option on both caches.
    assert {(t["cache"], t["option"], t["config"].endswith(" fp16")) for t in timings} == {
        ("bf16", "row", False), ("fp8", "row", False), ("fp8", "row", True),
        ("bf16", "n32 halves", False), ("fp8", "n32 halves", True)}
    assert len(timings) == 10
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("2x700 H16: fastest fp8 TRITON_MLA option")
