"""``kvcore bench``: every case runs on the CPU against a ceiling measured in the same run,
and the table, the JSON and the plot are produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.cli import main as kvcore_cli
from kvcore.cli.bench import BenchOptions, bench_figure, format_report, plot_report, run_bench

CASE_FIELDS = {"name", "backend", "shape", "num_bytes", "seconds", "gbps", "ceiling",
               "ceiling_gbps", "fraction_of_ceiling", "error", "flops", "tflops",
               "ceiling_tflops"}


@pytest.fixture(scope="module")
def report():
    return run_bench(BenchOptions(platform="cpu", progress=False))  # CPU even on a GPU machine


def test_bench_json_has_the_expected_fields(report):
    data = json.loads(json.dumps(report.to_dict()))
    assert {"date", "device", "platform", "selected_backend", "dtype", "size", "torch",
            "kvcore", "seconds", "ceilings", "cases"} <= set(data)
    assert (data["platform"], data["selected_backend"], data["size"]) == ("cpu", "CPU_ATTN",
                                                                          "small")
    assert [c["name"] for c in data["ceilings"]] == ["device read", "device copy", "matmul"]
    assert all(c["gbps"] > 0 for c in data["ceilings"])
    assert [c["tflops"] > 0 for c in data["ceilings"]] == [False, False, True]
    for case in data["cases"]:
        assert set(case) == CASE_FIELDS
        assert case["error"] is None, case
        assert case["gbps"] > 0
        if case["name"] == "prefill attention":  # compute-bound: held to the matmul
            assert case["ceiling"] == "matmul" and case["tflops"] > 0
            assert case["fraction_of_ceiling"] == pytest.approx(
                case["tflops"] / case["ceiling_tflops"])
        else:
            assert case["ceiling"] in ("device read", "device copy") and case["flops"] == 0
            assert case["fraction_of_ceiling"] == pytest.approx(
                case["gbps"] / case["ceiling_gbps"])


def test_bench_covers_kernels_cache_writes_and_the_connector(report):
    cases = {(c.name, c.backend, "cross-layer" in c.shape) for c in report.cases}
    assert {("decode attention", "CPU_ATTN", False), ("decode attention", "CPU_ATTN", True),
            ("prefill attention", "CPU_ATTN", False), ("cache write", "CPU_ATTN", False),
            ("offload save", "CPU_ATTN", False),
            ("offload load", "CPU_ATTN", True)} <= cases


def test_bench_table_and_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    table = format_report(report)
    assert "selected backend: CPU_ATTN" in table and "of ceiling" in table
    for ceiling in {c.ceiling for c in report.cases}:  # its row and every case held to it
        assert len([line for line in table.splitlines() if f" {ceiling} " in f" {line} "]) == \
            1 + len([c for c in report.cases if c.ceiling == ceiling])
    path = plot_report(report, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_bench_plot_has_a_legend_entry_per_bar_colour(report):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    fig = bench_figure(report)
    (legend,) = fig.legends
    entries = {t.get_text(): to_hex(h.get_facecolor()) for t, h in
               zip(legend.get_texts(), legend.legend_handles, strict=True)}
    bars = {to_hex(p.get_facecolor()) for p in fig.axes[0].patches}
    kinds = {c.name for c in report.cases if not c.flops}  # prefill (TFLOP/s): in the table
    assert "prefill attention" not in kinds and "prefill attention" in {
        c.name for c in report.cases}
    assert set(entries) == {"ceiling (measured in this run)",
                            *(f"achieved: {kind}" for kind in kinds)}
    assert bars == set(entries.values()) and len(bars) == 1 + len(kinds)


def test_bench_checks_the_plot_path_before_running(tmp_path, capsys):
    assert kvcore_cli(["bench", "--platform", "cpu", "--plot",
                       str(tmp_path / "missing" / "b.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_on_the_gpu_runs_every_case_of_its_backends():
    gpu = run_bench(BenchOptions(size="small", progress=False))
    assert gpu.platform in ("cuda", "rocm") and gpu.selected_backend != "CPU_ATTN"
    assert [c.error for c in gpu.cases if c.error] == []
    assert {"device->host (pinned)", "host->device (pinned)"} <= {c.name for c in gpu.ceilings}
    assert {c.ceiling for c in gpu.cases if c.name.startswith("offload")} == {
        "device->host (pinned)", "host->device (pinned)"}


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize(("script", "args", "lists"), [
    ("bench_triton", ["--budget-s", "0"], {"correctness", "timings", "sweeps"}),
    ("bench_mla", ["--budget-s", "0", "--no-flashinfer"], {"correctness", "timings", "sweeps"}),
    ("bench_offload", ["--no-sweep"], set()),
    ("bench_triton_prefill", [], {"correctness", "sweeps", "decode"}),
    ("bench_convert", [], {"correctness", "timings"}),
    ("bench_fp8_decode", [], {"correctness", "timings"}),
    ("bench_fp8_prefill", [], {"correctness", "timings"}),
], ids=["triton", "mla", "offload", "triton-prefill", "convert", "fp8-decode", "fp8-prefill"])
def test_benchmark_scripts_run_through_the_shared_harness(script, args, lists, tmp_path):
    """The GPU benchmarks on tiny shapes (``--smoke``, CPU): the run log, the JSON and the
    table come out, every correctness check passes (kvcore-nvidia's and kvcore-rocm's have
    their own smoke tests)."""
    env = {**os.environ, "OUT": str(tmp_path)}
    result = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke",
                             "--out", str(tmp_path), *args], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / f"{script}.json").read_text())
    if lists:  # a harness.Run: meta, ceilings, the script's lists, errors; a log beside it
        assert {"meta", "ceilings", "errors"} | lists <= set(data)
        assert data["ceilings"] and data["correctness"]
        assert all(c["ok"] for c in data["correctness"]), data["correctness"]
        assert all("flashinfer" in e["error"] for e in data["errors"]), data["errors"]
        assert (tmp_path / f"{script}_log.txt").read_text().strip()
    else:
        assert data["errors"] == {} and data["check_failures"] == []


def test_harness_table_falls_back_to_plain_lines_without_tabulate(monkeypatch):
    from tabulate import tabulate

    from kvcore.cli.harness import format_table

    rows, headers = [["decode", 12.5], ["prefill", None]], ["op", "us"]
    assert format_table(rows, headers) == tabulate(rows, headers=headers, tablefmt="github")
    assert format_table(rows, headers, "simple") == tabulate(rows, headers=headers)
    monkeypatch.setitem(sys.modules, "tabulate", None)  # import tabulate -> ImportError
    assert format_table(rows, headers) == "op | us\ndecode | 12.5\nprefill | None"


def test_harness_cell_is_blank_where_the_row_has_no_value():
    from kvcore.cli.harness import format_value

    row = {"time_us": 12.345, "ceiling_frac": 0.8, "splits": None}
    assert format_value(row, "time_us", ".1f") == "12.3"
    assert format_value(row, "ceiling_frac", ".1f", 100) == "80.0"
    assert format_value(row, "splits", "d") == ""
    assert format_value(row, "GBps", ".0f") == ""


def test_harness_run_meta_names_the_machine_only_on_a_gpu():
    import datetime
    import platform

    import torch

    from kvcore.cli.harness import run_meta

    meta = run_meta("cpu")
    assert meta == {"date": datetime.date.today().isoformat(),
                    "python": platform.python_version(), "torch": torch.__version__}


def test_harness_alternating_timing_takes_turns_and_keeps_the_fastest_round(monkeypatch):
    from kvcore.cli import harness

    calls: list[str] = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def fake_time_call(fn, device):
        name = fn()
        calls.append(name)
        return next(times[name]), "fake"

    monkeypatch.setattr(harness, "time_call", fake_time_call)
    found = harness.time_alternating({"a": lambda: "a", "b": lambda: "b"}, "cpu", rounds=3)
    assert calls == ["a", "b"] * 3  # turns, not one variant's rounds in a row
    assert found == {"a": (1.0, [3.0, 1.0, 2.0], "fake"), "b": (4.0, [5.0, 6.0, 4.0], "fake")}


def test_harness_run_children_reports_each_command_and_stops_at_the_deadline():
    """Exit codes and last lines in order; at the deadline the running child is killed and
    the one not yet started is skipped, both marked as cut off."""
    from kvcore.cli import harness

    py = sys.executable
    commands = [[py, "-c", "print('first'); print('done')"],
                [py, "-c", "import sys; print('bad'); sys.exit(3)"],
                [py, "-c", "import time; time.sleep(60)"],
                [py, "-c", "print('never')"]]
    results = harness.run_children(commands, workers=1, deadline_s=5.0)
    assert results[0] == (0, "done", False)
    assert results[1] == (3, "bad", False)
    assert results[2][2] and results[2][0] != 0  # killed at the deadline
    assert results[3] == (None, "not started", True)
