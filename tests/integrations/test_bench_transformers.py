"""benchmarks/bench_transformers.py --small: the GPU benchmark's code path, on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is a test extra")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_transformers.py"


@pytest.mark.engine
def test_small_run_agrees_with_sdpa_and_writes_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_transformers", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--small", "--workload", "decode", "--paths", "sdpa", "kvcore",
                       "kvcore:TRITON_ATTN", "--json", str(out)]) == 0
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kvcore"]["backend"] == "CPU_ATTN"
    assert rows["kvcore"]["agreement"] == "32/32"
    assert "platform=cpu" in rows["kvcore:TRITON_ATTN"]["skipped"]
    assert capsys.readouterr().out.splitlines()[0].startswith("workload")  # the table is last
