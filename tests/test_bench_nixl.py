"""benchmarks/bench_nixl.py on the CPU with tiny sizes: the p2p connector over gloo, scattered
block ids, the grid of cases, and the block-by-block bit-exactness check it relies on."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.connectors.nixl import nixl_unavailable_reason

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_nixl.py"
TINY = ["--device", "cpu", "--mib", "1", "--layers", "2", "--block-kib", "16", "--trials", "2"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_nixl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_args(**overrides) -> argparse.Namespace:
    args = dict(device="cpu", mib=1, layers=2, block_kib=16, per_layer=False, scattered=False,
                convert=False, gather_only=False)
    return argparse.Namespace(**{**args, **overrides})


def run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out


def test_scattered_ids_are_a_permutation_of_their_own_per_side(bench):
    args = tiny_args(scattered=True)
    producer, consumer = (bench.block_ids(args, 64, role) for role in ("producer", "consumer"))
    assert sorted(producer) == sorted(consumer) == list(range(64))
    assert producer != consumer
    assert bench.count_runs(consumer) > 32  # many short runs, not one
    assert bench.block_ids(tiny_args(), 64, "consumer") == list(range(64))
    assert bench.count_runs(list(range(64))) == 1


@pytest.mark.parametrize("per_layer", [False, True], ids=["cross-layer", "per-layer"])
def test_mismatched_blocks_finds_one_wrong_byte_in_one_layer(bench, per_layer):
    args = tiny_args(per_layer=per_layer, scattered=True)
    expected = bench.make_cache(args, fill=True)
    kv = bench.make_cache(args, fill=False)
    producer, consumer = (bench.block_ids(args, kv.num_blocks, r)
                          for r in ("producer", "consumer"))
    for layer in range(kv.num_layers):  # what a correct transfer leaves
        kv.block_view(layer)[consumer] = expected.block_view(layer)[producer]
    assert bench.mismatched_blocks(kv, consumer, expected, producer) == 0
    assert bench.mismatched_blocks(kv, producer, expected, producer) == kv.num_blocks
    kv.block_view(kv.num_layers - 1)[consumer[5], 7] ^= 1
    assert bench.mismatched_blocks(kv, consumer, expected, producer) == 1


def test_p2p_scattered_per_layer_moves_every_block_bit_exact(tmp_path):
    done, out = run(tmp_path, "--connector", "p2p", "--scattered", "--per-layer",
                    "--serve-device", "cpu")
    record = json.loads((out / "bench_nixl.json").read_text())
    assert record["connector"] == "p2p" and record["scattered"] is True
    assert record["bit_exact"] is True and record["mismatched_blocks"] == 0
    assert record["producer"] == "served True"
    assert record["consumer_runs"] > record["blocks"] // 2
    assert record["producer_device"] == record["consumer_device"] == "cpu"
    assert record["copy"] == "same device"
    assert record["p2p_gbps"] == record["gbps"] > 0 and record["copy_gbps"] > 0
    assert "p2p send/receive (gloo)" in done.stdout and "scattered" in done.stdout


def test_grid_runs_every_case_and_prints_a_table(tmp_path):
    # One connector: the grid's cases do not depend on it (nixl's scattered and contiguous
    # reads have tests of their own), and each case costs two processes.
    connectors = "p2p"
    done, out = run(tmp_path, "--grid", "--grid-connectors", connectors)
    records = json.loads((out / "bench_nixl_grid.json").read_text())
    assert len(records) == 4 * len(connectors.split(","))
    assert all(r["rc"] == 0 and r["bit_exact"] is True for r in records), records
    assert {(r["connector"], r["per_layer"], r["scattered"]) for r in records} == {
        (c, p, s) for c in connectors.split(",") for p in (False, True) for s in (False, True)}
    table = done.stdout[done.stdout.index("KV transfer"):]
    assert "p2p per-layer scattered" in table and "p2p cross-layer contiguous" in table


@pytest.mark.skipif(nixl_unavailable_reason() is not None,
                    reason=str(nixl_unavailable_reason()))
def test_nixl_scattered_reads_every_block_bit_exact(tmp_path):
    _, out = run(tmp_path, "--scattered")
    record = json.loads((out / "bench_nixl.json").read_text())
    assert record["connector"] == "nixl" and record["bit_exact"] is True
    assert record["nixl_gbps"] == record["gbps"] > 0
    assert record["consumer_runs"] > 1


def test_grid_lists_the_cases_its_budget_left_out_and_fails(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--grid", "--grid-connectors",
                           "p2p", "--budget-s", "0.001", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    records = json.loads((out / "bench_nixl_grid.json").read_text())
    assert len(records) == 4 and all("--budget-s" in r["skipped"] for r in records)
    assert "p2p per-layer scattered        skipped: --budget-s" in done.stdout
