"""``kvcore demo``: it passes on the CPU, it reports what it did, and its checks can fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kvcore.cli import main as kvcore_cli
from kvcore.demo.config import MODEL_PRESETS
from kvcore.demo.engine import BlockPool, Request
from kvcore.demo.model import DemoModel
from kvcore.demo.scenario import (
    DemoOptions,
    check_against_reference,
    compare_runs,
    format_summary,
    reference_logits,
    run_demo,
)

# On the CPU even on a GPU machine: the tests check CPU_ATTN's run.
FAST = ["--model", "tiny", "--batch", "4", "--new-tokens", "8", "--max-num-seqs", "2",
        "--no-progress", "--platform", "cpu"]


def fast_options(**overrides) -> DemoOptions:
    return DemoOptions(**{"model": "tiny", "batch": 4, "max_new_tokens": 8, "max_num_seqs": 2,
                          "progress": False, "platform": "cpu", **overrides})


@pytest.fixture(scope="module")
def result():
    return run_demo(fast_options())


def test_demo_passes_on_cpu_with_cpu_attn_cross_layer(result):
    assert result.ok, result.mismatches
    assert (result.platform, result.backend) == ("cpu", "CPU_ATTN")
    assert result.layout == "B,L,2,N,H,D" and result.cross_layer
    assert "priority list" in result.selection["why"]


def test_demo_batches_continuously_and_reuses_offloaded_prefixes(result):
    first, second = result.batches
    assert first["max_running"] == 2 and first["mixed_steps"] > 0  # prefill joins decodes
    assert second["prefix_blocks_hit"] > 0
    assert second["computed_prompt_tokens"] < second["prompt_tokens"]
    assert result.evicted_blocks > 0  # the prefixes really were gone from the device
    hits = first["prefix_blocks_hit"] + second["prefix_blocks_hit"]
    assert result.offload["loaded_blocks"] == hits
    assert result.offload["loaded_bytes"] == hits * result.block_bytes


def test_demo_checks_every_generated_token(result):
    generated = sum(b["generated_tokens"] for b in result.batches)
    assert result.checks["generated_tokens"] == generated
    for key in ("without_offload", "reference"):
        check = result.checks[key]
        assert check["checked"] == generated and check["problems"] == []
        assert check["agreed"] + check["ties"] == generated


def test_a_corrupted_loaded_block_fails_both_checks():
    bad = run_demo(fast_options(corrupt_loaded_block=True))
    assert not bad.ok
    assert any("in the run without offload" in m for m in bad.mismatches)
    assert any("float64 reference picks" in m for m in bad.mismatches)


def test_checks_flag_a_wrong_token_but_accept_a_near_tie():
    model = DemoModel(MODEL_PRESETS["tiny"], seed=3)
    req = Request("r", [5, 6, 7, 8], max_new_tokens=3)
    req.output = [0, 0, 0]
    (logits,) = reference_logits(model, [req])
    ranked = logits[0].argsort(descending=True).tolist()
    req.output = [ranked[0], ranked[-1], 0]  # right, then the least likely token
    check = check_against_reference([req], [logits], torch.float32)
    # Checking stops at the first real mismatch: later tokens follow from a wrong one.
    assert (check.agreed, check.ties, check.checked) == (1, 0, 2)
    assert check.problems[0].startswith(f"MISMATCH r: token 1 is {ranked[-1]} but the float64")
    other = Request("r", req.prompt, 3)
    other.output = [ranked[1], 0, 0]
    logits = logits.clone()  # an inference-mode tensor is read-only outside inference mode
    logits[0, ranked[1]] = logits[0, ranked[0]]  # make the runner-up an exact tie
    check = compare_runs([req], [other], [logits], torch.float32)
    assert (check.agreed, check.ties, check.problems) == (0, 1, [])
    other.output = [ranked[-1], 0, 0]
    assert compare_runs([req], [other], [logits], torch.float32).problems == [
        f"MISMATCH r: token 0 is {ranked[0]} with offload but {ranked[-1]} in the run "
        "without offload"]


def test_kvcore_demo_command_prints_the_summary_and_exits_0():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    run = subprocess.run([sys.executable, "-m", "kvcore.cli", "demo", *FAST],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    for expected in ("dtype     float32 (no --dtype given: the first of float32, bfloat16, "
                     "float16 that a backend on cpu runs this model in (CPU_ATTN: ",
                     "backend   CPU_ATTN: first valid backend in cpu's priority list",
                     "layout    B,L,2,N,H,D", "prefix hits", "GB/s",
                     "check     tokens equal to a run without offload",
                     "check     tokens equal to the non-paged float64 reference",
                     "result    PASS"):
        assert expected in out


def test_kvcore_demo_json_and_exit_status_on_mismatch(capsys):
    assert kvcore_cli(["demo", *FAST, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["backend"] == "CPU_ATTN" and data["mismatches"] == []
    assert kvcore_cli(["demo", *FAST, "--corrupt-loaded-block"]) == 1
    assert "result    FAIL" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for an absent GPU")
def test_demo_refuses_a_platform_that_is_not_present(capsys):
    assert kvcore_cli(["demo", *FAST[:-2], "--platform", "cuda"]) == 2
    assert "--platform cuda: not present on this machine" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value", "message"), [
    ("model", "huge", "model='huge' (choose from: tiny, small, medium, large, mla-small)"),
    ("batch", 0, "batch=0 must be a positive integer"),
    ("dtype", "float64", "dtype='float64' (supported: float32, bfloat16, float16)"),
])
def test_bad_options_name_the_option(option, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run_demo(fast_options(**{option: value}))


def test_block_pool_refuses_to_overcommit():
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    with pytest.raises(RuntimeError, match="2 blocks wanted, 1 of 3 free"):
        pool.allocate(2)
    pool.release([0])
    assert pool.allocate(2) == [0, 2]


@pytest.mark.gpu
def test_demo_on_the_gpu_with_its_best_backend():
    gpu = run_demo(fast_options(model="small", batch=8, max_new_tokens=16, max_num_seqs=4,
                                platform=None))
    assert gpu.ok, gpu.mismatches
    assert gpu.platform in ("cuda", "rocm") and gpu.backend != "CPU_ATTN"


def test_demo_reports_its_cuda_graph_steps(result):
    assert result.cuda_graphs == {"support": "never", "replayed_steps": 0,
                                  "steps": sum(b["steps"] for b in result.batches)}
    assert "graphs    0 of" in format_summary(result)


@pytest.mark.gpu
def test_demo_replays_decode_steps_from_cuda_graphs_with_identical_tokens():
    gpu = run_demo(fast_options(model="small", batch=8, max_new_tokens=16, max_num_seqs=4,
                                platform=None, backend="TRITON_ATTN", dtype="bfloat16"))
    assert gpu.ok, gpu.mismatches
    graphs = gpu.cuda_graphs
    assert graphs["support"] == "uniform_decode"
    # Decode-only steps are among the steps that are not mixed; only they replay.
    decode_only = sum(b["steps"] - b["mixed_steps"] for b in gpu.batches)
    assert 0 < graphs["replayed_steps"] <= decode_only


@pytest.fixture(scope="module")
def mla_result():
    return run_demo(fast_options(model="mla-small", batch=6, max_num_seqs=3))


def test_mla_demo_serves_an_mla_model_on_cpu_mla(mla_result):
    """Continuous batching, offload and prefix reuse with MLA latents; every token equal to
    the unabsorbed float64 reference (or a near tie) and to the run without offload."""
    assert mla_result.ok, mla_result.mismatches
    assert mla_result.backend == "CPU_MLA"
    assert mla_result.layout == "B,L,N,D" and mla_result.cross_layer
    first, second = mla_result.batches
    assert first["mixed_steps"] > 0 and second["prefix_blocks_hit"] > 0
    assert mla_result.offload["loaded_blocks"] == (first["prefix_blocks_hit"]
                                                   + second["prefix_blocks_hit"])
    generated = sum(b["generated_tokens"] for b in mla_result.batches)
    assert mla_result.checks["reference"]["checked"] == generated
    assert mla_result.checks["without_offload"]["agreed"] == generated


def test_a_corrupted_loaded_latent_block_fails_the_mla_demo():
    bad = run_demo(fast_options(model="mla-small", batch=6, max_num_seqs=3,
                                corrupt_loaded_block=True))
    assert not bad.ok
    assert any("float64 reference picks" in m for m in bad.mismatches)


@pytest.mark.gpu
def test_mla_demo_on_the_gpu_with_its_best_mla_backend():
    gpu = run_demo(fast_options(model="mla-small", batch=8, max_new_tokens=16, max_num_seqs=4,
                                platform=None, dtype="bfloat16"))
    assert gpu.ok, gpu.mismatches
    assert gpu.platform in ("cuda", "rocm") and gpu.backend != "CPU_MLA"
