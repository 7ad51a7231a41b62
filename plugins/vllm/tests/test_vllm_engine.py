"""vLLM's own engine serving a random-weight Llama (float32, greedy, token-id prompts) through
kvcore's CPU_ATTN, compared token for token with vLLM's own CPU backend.

Each configuration runs in a fresh process (``vllm_run.py``): ``VLLM_PLUGINS=`` (empty) gives
vLLM's own backend, ``VLLM_PLUGINS=kvcore`` the plugin. Every comparison prints its
token-equality count; the negative control (no causal mask) must change the tokens, so the
comparison has teeth, and the in-process runs report the attention impl vLLM used, so a plugin
that silently failed to load cannot pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).parent
KVCORE_IMPL = "KVCOREImpl"
#: vLLM's own CPU_ATTN takes block sizes that are multiples of 32 only.
BASELINE = {"block_size": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from make_model import make_model

    path = tmp_path_factory.mktemp("llama")
    make_model(str(path))
    return str(path)


def _run(model_dir: str, options: dict, *, plugin: bool) -> dict:
    env = {**os.environ, "VLLM_PLUGINS": "kvcore" if plugin else "",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), model_dir,
                           json.dumps(options)], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"vLLM run {options} (plugin={plugin}) failed:\n{proc.stdout[-3000:]}"
        f"\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def vllm_tokens(model_dir) -> list[list[int]]:
    result = _run(model_dir, BASELINE, plugin=False)
    assert result["impl"] == "CPUAttentionBackendImpl", result["impl"]
    return result["tokens"]


def _equal(name: str, got: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    total = sum(len(w) for w in want)
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=False))
    print(f"\n{name}: tokens equal to vLLM's own CPU_ATTN: {same}/{total}")
    return same, total


@pytest.mark.parametrize("options", [
    {"block_size": 32},
    {"block_size": 16},  # vLLM's own CPU backend refuses 16; kvcore's reads any size
    # Prefix caching with chunked prefill: 24-token chunks, the shared 40-token prefix
    # read from cached blocks by the later requests.
    {"block_size": 16, "enable_prefix_caching": True, "max_num_batched_tokens": 24},
    {"block_size": 32, "enable_prefix_caching": True, "max_num_batched_tokens": 24},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_tokens_equal_vllm_cpu_backend(model_dir, vllm_tokens, options):
    result = _run(model_dir, options, plugin=True)
    assert result["impl"] == KVCORE_IMPL, f"vLLM ran {result['impl']}, not kvcore"
    same, total = _equal(f"kvcore CPU_ATTN {options}", result["tokens"], vllm_tokens)
    assert same == total


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_tokens_equal_on_every_declared_vllm_layout(model_dir, vllm_tokens, layout):
    """vLLM allocates in the layout (VLLM_KV_CACHE_LAYOUT; LBHNC is its default here) and
    kvcore reads its memory in place, cross-layer layouts included."""
    result = _run(model_dir, {"block_size": 16, "layout": layout}, plugin=True)
    assert result["impl"] == KVCORE_IMPL
    assert result["layout"] == layout, f"vLLM allocated {result['layout']}, not {layout}"
    same, total = _equal(f"kvcore CPU_ATTN, layout {layout}", result["tokens"], vllm_tokens)
    assert same == total


def test_prefix_caching_baseline_is_vllms_plain_tokens(model_dir, vllm_tokens):
    """vLLM's own backend with prefix caching and chunked prefill gives its plain tokens: the
    baseline above stands for those runs too."""
    result = _run(model_dir, {"block_size": 32, "enable_prefix_caching": True,
                              "max_num_batched_tokens": 24}, plugin=False)
    same, total = _equal("vLLM's own, prefix caching + chunked prefill", result["tokens"],
                         vllm_tokens)
    assert same == total


def test_multiprocessing_engine(model_dir, vllm_tokens):
    """vLLM's engine core in its own process loads the plugin there too."""
    result = _run(model_dir, {"block_size": 16, "multiprocessing": True}, plugin=True)
    same, total = _equal("kvcore CPU_ATTN, multiprocessing engine", result["tokens"],
                         vllm_tokens)
    assert same == total


def test_negative_control_broken_mask_changes_tokens(model_dir, vllm_tokens):
    """No causal mask (every query sees its whole request): the comparison must catch it."""
    result = _run(model_dir, {"block_size": 32, "break_mask": True}, plugin=True)
    assert result["impl"] == KVCORE_IMPL
    same, total = _equal("NEGATIVE CONTROL (no causal mask)", result["tokens"], vllm_tokens)
    assert same < total // 2, "a broken mask left the tokens equal: the comparison is blind"
