"""benchmarks/replay_vllm.py on the CPU: vLLM's steps recorded through kvcore-vllm replay
through kvcore's public API (the GPU replay's method, checked where CI runs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcore

pytest.importorskip("vllm")

ROOT = Path(__file__).parents[3]
SCRIPT = ROOT / "benchmarks" / "replay_vllm.py"


def _module():
    spec = importlib.util.spec_from_file_location("replay_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "steps.pt"
    env = {**os.environ, "VLLM_PLUGINS": "kvcore", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "record", "--out", str(path)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print("\n" + proc.stdout.strip().splitlines()[-1])
    assert path.stat().st_size < 10 * 2**20  # travels to the GPU machine
    return path


def test_replay_on_cpu_attn_reproduces_the_recorded_outputs_and_tokens(recording):
    replay = _module()
    (row,) = replay.replay(recording, ["CPU_ATTN"], torch.device("cpu"))
    replay.print_table([row])
    # The recording's own backend, the same inputs: the same bits, every write exact; the
    # replayed model's tokens are vLLM's but at near-ties.
    assert (row.status, row.max_abs, row.worst_norm, row.writes_exact) == ("PASS", 0, 0, True)
    equal, total = map(int, row.rows_equal.split("/"))
    assert total >= 30 and equal >= total - 2, row


def test_replay_catches_outputs_that_are_not_the_recorded_ones(recording):
    replay = _module()
    rec = replay.load(recording)
    step = rec["steps"][-1]
    name = rec["layers"][0]
    step["layers"][name]["output"] = step["layers"][name]["output"] * 1.05
    row = replay.Row("CPU_ATTN")
    replay.Replay(rec, kvcore.resolve_backend("CPU_ATTN"),
                  torch.device("cpu")).attention_pass(row)
    assert row.status == "FAIL" and f"step {len(rec['steps']) - 1} {name}" in row.note
    # Teacher forcing with another token's weights: the sampled rows leave vLLM's.
    rec = replay.load(recording)
    weights = rec["model"]["weights"]
    weights["lm_head.weight"] = weights["lm_head.weight"].roll(1, dims=0)
    row = replay.Row("CPU_ATTN")
    replay.Replay(rec, kvcore.resolve_backend("CPU_ATTN"),
                  torch.device("cpu")).model_pass(row)
    assert row.status == "FAIL", row


@pytest.mark.slow
def test_replay_on_triton_attn_under_the_interpreter(recording):
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVCORE_PLATFORM": "cuda",
           "KVCORE_DEVICE_CAPABILITY": "9.0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "replay", "--recording", str(recording),
                           "--backends", "TRITON_ATTN", "--device", "cpu"], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
    print("\n" + proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TRITON_ATTN | PASS" in proc.stdout
