"""benchmarks/bench_nvidia.py runs end to end on tiny shapes (``--smoke``): on a machine
without a GPU the CUDA sections are skipped with their reasons, never failed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
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


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_flashinfer_mla_bench_reference_reads_bf16_and_fp8_caches(kv_cache_dtype):
    """benchmarks/bench_flashinfer_mla.py's float64 reference, on a tiny decode on the CPU,
    equals the latent attention computed here request by request from the block table (a bf16
    cache is widened to float64, an fp8 one dequantised)."""
    bench = _load_bench("bench_flashinfer_mla")
    d = bench.Decode(3, 4, 150, kv_cache_dtype, device="cpu")
    ref = bench.reference(d)
    assert ref.dtype == torch.float64 and ref.shape == (3, 4, bench.RANK)
    cache = d.cache.double() * d.k_scale
    tables = d.common.block_table
    for i in range(d.batch):
        latents = cache[tables[i].long()].reshape(-1, bench.ENTRY)[:d.tokens]
        probs = torch.softmax(d.q[i].double() @ latents.T * d.scale, dim=-1)
        torch.testing.assert_close(ref[i], probs @ latents[:, :bench.RANK], rtol=1e-9,
                                   atol=1e-12)


def test_flashinfer_bench_cpu_times_build_against_a_no_op_flashinfer(tmp_path):
    """benchmarks/bench_flashinfer.py --cpu: the builder's ``build()`` per step on the CPU
    (FlashInfer's ``plan`` a no-op stand-in), each shape eager and graph-sized, the table
    last."""
    script = SCRIPT.with_name("bench_flashinfer.py")
    result = subprocess.run([sys.executable, str(script), "--cpu", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "bench_flashinfer.json").read_text())
    assert results["errors"] == []
    rows = results["build_cpu"]
    assert [(r["shape"], r["build"]) for r in rows] == [
        (shape, build) for shape in ("16x4096", "64x4096")
        for build in ("graph decode", "eager decode")]
    assert all(r["us_per_build"] > 0 for r in rows)
    # eager decode-only steps re-plan only when page counts change, as graph-sized ones do
    plans = {(r["shape"], r["build"]): r["plans_per_step"] for r in rows}
    assert all(plans[shape, "eager decode"] == plans[shape, "graph decode"] < 0.2
               for shape in ("16x4096", "64x4096"))
    table = result.stdout.splitlines()[-len(rows) - 2:]  # header, rule, one row each
    assert table[0].startswith("| build() on the CPU") and table[1].startswith("| --- |")
    assert [line.split(" | ")[0] for line in table[2:]] == [
        f"| {r['shape']} {r['build']}" for r in rows]
