"""Model presets: their shapes, their selector configs (valid, and runnable on a simulated
H100 by at least one backend except where no kvcore backend has the feature yet), and
``kvcore bench --model --small`` on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

import kvcore
from kvcore.cli import main as kvcore_cli
from kvcore.cli.main import BENCH_MODEL_CHOICES
from kvcore.models import MODELS, ModelPreset, get_model


def test_the_cli_offers_every_preset():
    assert BENCH_MODEL_CHOICES == tuple(MODELS)


@pytest.mark.parametrize(("name", "layers", "shapes"), [
    ("llama-3.1-8b", 32, {("full", 32, 8, 128, None)}),
    ("llama-3.1-70b-tp8", 80, {("full", 8, 1, 128, None)}),
    ("qwen2.5-7b", 28, {("full", 28, 4, 128, None)}),
    ("mistral-7b", 32, {("sliding", 32, 8, 128, 4096)}),
    ("gemma-2-9b", 42, {("sliding", 16, 8, 256, 4096), ("full", 16, 8, 256, None)}),
    ("gpt-oss-20b", 24, {("sliding", 64, 8, 64, 128), ("full", 64, 8, 64, None)}),
    ("qwen3-30b-a3b", 48, {("full", 32, 4, 128, None)}),
    ("deepseek-v3-tp8", 61, {("mla", 16, 1, 576, None)}),
    ("deepseek-v3-tp1", 61, {("mla", 128, 1, 576, None)}),
])
def test_preset_shapes_per_rank(name, layers, shapes):
    preset = get_model(name)
    assert preset.num_layers == layers
    assert {(x.kind, x.num_heads, x.num_kv_heads, x.head_size, x.sliding_window)
            for x in preset.layers} == shapes
    assert preset.source.startswith("huggingface.co/")


def test_features_beyond_the_shapes():
    gemma, oss = get_model("gemma-2-9b"), get_model("gpt-oss-20b")
    assert {x.logits_soft_cap for x in gemma.layers} == {50.0}
    assert all(x.has_sink for x in oss.layers)
    mla = get_model("deepseek-v3-tp8").layer("mla")
    assert (mla.mla.kv_lora_rank, mla.mla.qk_rope_head_dim, mla.head_size_v) == (512, 64, 128)
    assert mla.softmax_scale == pytest.approx(192 ** -0.5)
    with pytest.raises(ValueError, match="not a preset; choose from: llama-3.1-8b"):
        get_model("llama-2")


@pytest.mark.parametrize("name", list(MODELS))
def test_selector_configs_are_valid_and_some_backend_runs_them(name, monkeypatch):
    monkeypatch.setenv("KVCORE_RANKING_FILE", "none")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    preset = get_model(name)
    for kv in ModelPreset.KV_CACHE_DTYPES:
        for block in ModelPreset.BLOCK_SIZES:
            configs = preset.selector_configs(kv, block)
            assert set(configs) == {x.kind for x in preset.layers}
            for kind, config in configs.items():
                layer = preset.layer(kind)
                assert (config.head_size, config.block_size, config.kv_cache_dtype,
                        config.use_mla, config.has_sink, config.has_logits_soft_cap) == (
                    layer.head_size, block, kv, layer.mla is not None, layer.has_sink,
                    layer.logits_soft_cap is not None)
                report = kvcore.explain_selection(config, "cuda")
                assert report.selected is not None, report.format()


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gemma-2-9b"])
def test_sink_and_soft_cap_presets_have_two_valid_backends(name, monkeypatch):
    """gpt-oss (sinks) and Gemma 2 (soft-cap) run on CPU_ATTN on a CPU and TRITON_ATTN on
    CUDA, both checked against the float64 reference by the conformance suite."""
    configs = [layer.selector_config(torch.bfloat16) for layer in get_model(name).layers]
    for config in configs:
        assert kvcore.explain_selection(config, "cpu").selected.name == "CPU_ATTN"
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    for config in configs:
        cuda = kvcore.explain_selection(config, "cuda")
        assert "TRITON_ATTN" in {c.name for c in cuda.candidates if c.valid}, cuda.format()


def test_scaled_down_keeps_what_decides_the_backend():
    for preset in MODELS.values():
        for big, small in zip(preset.layers, preset.scaled_down().layers, strict=True):
            assert small.num_heads <= 4 and small.num_heads % small.num_kv_heads == 0
            assert (small.head_size, small.has_sink, small.mla) == (
                big.head_size, big.has_sink, big.mla)
            assert (small.sliding_window is None) == (big.sliding_window is None)
    for case in ModelPreset.cases(get_model("llama-3.1-8b"), small=False):
        assert case.phase in ("decode", "prefill", "mixed")


def test_bench_model_small_runs_on_the_cpu(capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_RANKING_FILE", "none")
    status = kvcore_cli(["bench", "--model", "mistral-7b", "--model", "deepseek-v3-tp8",
                         "--small", "--platform", "cpu", "--kv-cache-dtype", "auto",
                         "--block-size", "16", "--phase", "decode", "--phase", "mixed",
                         "--no-progress", "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert status in (0, 1)  # 1: a backend failed a step; its row says why
    rows = data["rows"]
    assert {(r["model"], r["phase"]) for r in rows} == {
        (m, p) for m in ("mistral-7b", "deepseek-v3-tp8") for p in ("decode", "mixed")}
    timed = [r for r in rows if r["error"] is None and r["skipped"] is None]
    assert {r["model"] for r in timed} == {"mistral-7b", "deepseek-v3-tp8"}
    for r in timed:
        assert r["us"] > 0 and 0 < r["fraction_of_roofline"] and r["num_bytes"] > 0
    assert any(r["selected"] for r in timed)
    assert all(r["layer_shape"].endswith("window=32") for r in rows
               if r["model"] == "mistral-7b")


def test_bench_model_table_and_flag_checks(capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_RANKING_FILE", "none")
    kvcore_cli(["bench", "--model", "gpt-oss-20b", "--small", "--platform", "cpu",
                "--kv-cache-dtype", "auto", "--block-size", "16", "--phase", "decode",
                "--no-progress"])
    out = capsys.readouterr().out
    assert "CPU_ATTN*" in out and "skipped" not in out  # its sinks run on CPU_ATTN
    assert kvcore_cli(["bench", "--small"]) == 2
    assert "add --model NAME" in capsys.readouterr().err


@pytest.mark.engine
def test_bench_matrix_script_runs_small_on_the_cpu(tmp_path):
    """``benchmarks/bench_matrix.py --small``: the run log, the JSON with a row per backend and
    step, and the gaps list come out (peers need a GPU); ``--ranking`` writes the kvcore rows
    as this device's ranking."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_matrix.py"
    env = {**os.environ, "KVCORE_RANKING_FILE": "none"}
    result = subprocess.run([sys.executable, str(script), "--small", "--model", "llama-3.1-8b",
                             "--kv-cache-dtype", "auto", "--block-size", "16", "--phase",
                             "decode", "--out", str(tmp_path), "--ranking",
                             str(tmp_path / "ranking.json")], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "bench_matrix.json").read_text())
    assert {r["case"] for r in data["rows"]} == {"decode 4x256", "decode 2x1024"}
    assert data["gaps"] == [] and data["ceilings"]["read_GBps"] > 0
    assert "selected backend below 0.95x the best peer" in (tmp_path / "bench_matrix_log.txt"
                                                            ).read_text()
    (ranking,) = kvcore.load_rankings(tmp_path / "ranking.json")
    assert ranking.device.platform == "cpu" and len(ranking.cases) == 2
    assert {c.phase for c in ranking.cases} == {"decode"}
    assert all(set(c.times_us) <= {r["impl"] for r in data["rows"]} for c in ranking.cases)


def test_bench_matrix_checks_a_sink_peer_against_the_float64_reference():
    """The check bench_matrix.py runs before timing a peer on a layer with sinks: the step's
    attention with the sinks passes; the same attention without them (what FlashInfer's
    plain wrappers give on fa2/fa3) or with the sinks scaled like the scores fails."""
    import importlib.util
    from pathlib import Path

    from kvcore.cli.model_bench import ModelBenchOptions, run_model_bench
    from kvcore.ops import paged_attention_ref

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_matrix.py"
    spec = importlib.util.spec_from_file_location("bench_matrix", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    steps = []
    run_model_bench(ModelBenchOptions(models=["gpt-oss-20b"], small=True, platform="cpu",
                                      kv_cache_dtypes=("auto",), block_sizes=(16,),
                                      phases=("mixed",), backends=()),
                    peers=lambda inputs: steps.append(inputs) or [])
    assert {s.layer.sliding_window is None for s in steps} == {True, False}
    for inputs in steps:
        sinks = bench.sink_logits(inputs.layer.num_heads, inputs.device)
        c, layer = inputs.common, inputs.layer

        def attention(sinks, c=c, layer=layer, inputs=inputs):
            return paged_attention_ref(
                inputs.query, *inputs.kv_cache.unbind(1), query_start_loc=c.query_start_loc,
                seq_lens=c.seq_lens, block_table=c.block_table, scale=layer.softmax_scale,
                sliding_window=layer.sliding_window, sinks=sinks)

        assert bench.check_against_reference(inputs, attention(sinks), sinks) < 1e-5
        for wrong in (None, sinks * layer.softmax_scale):
            with pytest.raises(RuntimeError, match="relative error .* above 0.02"):
                bench.check_against_reference(inputs, attention(wrong), sinks)
