"""benchmarks/bench_rocm_portable.py runs end to end on tiny shapes (``--smoke``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_rocm_portable.py"


def test_bench_smoke():
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok") == 3
    assert "bit-exact" in result.stdout
