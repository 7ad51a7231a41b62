"""vLLM's own engine serving a random-weight Llama (float32, greedy, token-id prompts) through
kvcore's CPU_ATTN, and TRITON_ATTN under the Triton interpreter, compared token for token with
vLLM's own CPU backend; in bfloat16, tokens may part only at near-ties of vLLM's own logits.

Each process (``vllm_run.py``) serves a list of configurations, one fresh ``LLM`` each:
vLLM's import and start-up, most of a configuration's time, is paid once per process, and a
process holds what must be equal for all of its configurations: ``VLLM_PLUGINS=`` (empty)
gives vLLM's own backend, ``VLLM_PLUGINS=kvcore`` the plugin, the Triton runs their
environment, the multiprocessing engine its own. Every comparison prints its token-equality
count; the negative control (no causal mask) must change the tokens, so the comparison has
teeth, and the in-process runs report the attention impl and layout vLLM used, so a plugin that
silently failed to load, or a layout left over from the configuration before, cannot pass.
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
#: Prefix caching with chunked prefill: 24-token chunks, the shared 40-token prefix read from
#: cached blocks by the later requests.
PREFIX_CACHING = {"enable_prefix_caching": True, "max_num_batched_tokens": 24}
BF16 = {"block_size": 32, "dtype": "bfloat16", "gaps": True}
OPTIONS = [
    {"block_size": 32},
    {"block_size": 16},  # vLLM's own CPU backend refuses 16; kvcore's reads any size
    {"block_size": 16, **PREFIX_CACHING},
    {"block_size": 32, **PREFIX_CACHING},
]
#: vLLM allocates in the layout (VLLM_KV_CACHE_LAYOUT; LBHNC is its default here).
LAYOUTS = ["LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
NEGATIVE_CONTROL = {"block_size": 32, "break_mask": True}
#: TRITON_ATTN's kernels on a CPU: the Triton interpreter runs them on CPU tensors, and kvcore
#: is told it runs on an sm90 GPU, so that its selector accepts TRITON_ATTN, which vLLM's
#: CPU platform never asks for (it hard-codes CPU_ATTN, which kvcore-vllm stands in for).
TRITON_ON_CPU = {"TRITON_INTERPRET": "1", "KVCORE_PLATFORM": "cuda",
                 "KVCORE_DEVICE_CAPABILITY": "9.0", "KVCORE_ATTENTION_BACKEND": "TRITON_ATTN"}
TRITON_OPTIONS = [{"block_size": 16}, {"block_size": 16, **PREFIX_CACHING}]


def _name(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from make_model import make_model

    path = tmp_path_factory.mktemp("llama")
    make_model(str(path))
    return str(path)


class Runs:
    """One ``vllm_run.py`` process serving ``configurations`` in turn; ``runs[options]`` is the
    result of one of them. The process must exit cleanly and print every result, else each
    test that asks for one of its results fails with the process's output."""

    def __init__(self, model_dir: str, configurations: list[dict], *, plugin: bool,
                 env: dict | None = None) -> None:
        env = {**os.environ, "VLLM_PLUGINS": "kvcore" if plugin else "",
               "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        proc = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), model_dir,
                               json.dumps(configurations)], capture_output=True, text=True,
                              env=env, timeout=240 + 60 * len(configurations))
        results = [json.loads(line.removeprefix("RESULT "))
                   for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        self.results = {_name(o): r for o, r in zip(configurations, results, strict=False)}
        self.failure = None
        if proc.returncode != 0 or len(results) != len(configurations):
            self.failure = (f"vLLM runs {configurations} (plugin={plugin}) failed after "
                            f"{len(results)} results:\n{proc.stdout[-3000:]}"
                            f"\n{proc.stderr[-6000:]}")

    def __getitem__(self, options: dict) -> dict:
        assert self.failure is None, self.failure
        return self.results[_name(options)]


@pytest.fixture(scope="module")
def vllm_runs(model_dir) -> Runs:
    """vLLM's own CPU backend: the float32 baseline, its prefix-caching run, bfloat16."""
    return Runs(model_dir, [BASELINE, {"block_size": 32, **PREFIX_CACHING}, BF16],
                plugin=False)


@pytest.fixture(scope="module")
def kvcore_runs(model_dir) -> Runs:
    """kvcore's CPU_ATTN through the plugin: every configuration of the tests below (a test
    selected alone still waits for all of them)."""
    return Runs(model_dir, [*OPTIONS, *({"block_size": 16, "layout": layout}
                                        for layout in LAYOUTS), NEGATIVE_CONTROL, BF16],
                plugin=True)


@pytest.fixture(scope="module")
def vllm_tokens(vllm_runs) -> list[list[int]]:
    result = vllm_runs[BASELINE]
    assert result["impl"] == "CPUAttentionBackendImpl", result["impl"]
    return result["tokens"]


def _equal(name: str, got: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    total = sum(len(w) for w in want)
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=False))
    print(f"\n{name}: tokens equal to vLLM's own CPU_ATTN: {same}/{total}")
    return same, total


@pytest.mark.parametrize("options", OPTIONS, ids=_name)
def test_tokens_equal_vllm_cpu_backend(kvcore_runs, vllm_tokens, options):
    result = kvcore_runs[options]
    assert result["impl"] == KVCORE_IMPL, f"vLLM ran {result['impl']}, not kvcore"
    same, total = _equal(f"kvcore CPU_ATTN {options}", result["tokens"], vllm_tokens)
    assert same == total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tokens_equal_on_every_declared_vllm_layout(kvcore_runs, vllm_tokens, layout):
    """vLLM allocates in the layout and kvcore reads its memory in place, cross-layer layouts
    included."""
    result = kvcore_runs[{"block_size": 16, "layout": layout}]
    assert result["impl"] == KVCORE_IMPL
    assert result["layout"] == layout, f"vLLM allocated {result['layout']}, not {layout}"
    same, total = _equal(f"kvcore CPU_ATTN, layout {layout}", result["tokens"], vllm_tokens)
    assert same == total


def test_prefix_caching_baseline_is_vllms_plain_tokens(vllm_runs, vllm_tokens):
    """vLLM's own backend with prefix caching and chunked prefill gives its plain tokens: the
    baseline above stands for those runs too."""
    result = vllm_runs[{"block_size": 32, **PREFIX_CACHING}]
    same, total = _equal("vLLM's own, prefix caching + chunked prefill", result["tokens"],
                         vllm_tokens)
    assert same == total


def test_multiprocessing_engine(model_dir, vllm_tokens):
    """vLLM's engine core in its own process loads the plugin there too."""
    options = {"block_size": 16, "multiprocessing": True}
    result = Runs(model_dir, [options], plugin=True)[options]
    same, total = _equal("kvcore CPU_ATTN, multiprocessing engine", result["tokens"],
                         vllm_tokens)
    assert same == total


def test_negative_control_broken_mask_changes_tokens(kvcore_runs, vllm_tokens):
    """No causal mask (every query sees its whole request): the comparison must catch it."""
    result = kvcore_runs[NEGATIVE_CONTROL]
    assert result["impl"] == KVCORE_IMPL
    same, total = _equal("NEGATIVE CONTROL (no causal mask)", result["tokens"], vllm_tokens)
    assert same < total // 2, "a broken mask left the tokens equal: the comparison is blind"


@pytest.fixture(scope="module")
def triton_runs(model_dir) -> Runs:
    return Runs(model_dir, TRITON_OPTIONS, plugin=True, env=TRITON_ON_CPU)


@pytest.mark.slow
@pytest.mark.parametrize("options", TRITON_OPTIONS, ids=_name)
def test_triton_attn_under_the_interpreter_equals_vllm_cpu_backend(triton_runs, vllm_tokens,
                                                                   options):
    """TRITON_ATTN's Triton kernels (split-KV decode, prefill, cache write) in vLLM's engine,
    interpreted on the CPU (about 20 s a configuration)."""
    result = triton_runs[options]
    assert (result["impl"], result["kvcore_backend"]) == (KVCORE_IMPL, "TRITON_ATTN"), result
    same, total = _equal(f"kvcore TRITON_ATTN (interpreted) {options}", result["tokens"],
                         vllm_tokens)
    assert same == total


#: Largest top-two log-probability gap of vLLM's own bfloat16 run at which kvcore's tokens
#: may part from it: 2 units in the last place of bfloat16 logits in [4, 8) (8 significant
#: bits). Another summation order flips such near-ties; anything wider is a wrong result.
BF16_TIE = 2 * 2.0 ** -5


def test_bfloat16_tokens_part_only_at_near_ties(vllm_runs, kvcore_runs):
    """bfloat16: kvcore's CPU_ATTN sums in another order than vLLM's, so a greedy choice
    between two logits within bfloat16's rounding may flip; each request must equal vLLM's
    tokens up to such a near-tie of vLLM's own logits, and most must equal them throughout."""
    want, got = vllm_runs[BF16], kvcore_runs[BF16]
    assert got["kvcore_backend"] == "CPU_ATTN"
    identical = 0
    for i, (g, w, gaps) in enumerate(zip(got["tokens"], want["tokens"], want["gaps"],
                                         strict=True)):
        split = next((j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        if split is None:
            identical += 1
            continue
        print(f"\nbf16 request {i}: equal for {split}/{len(w)} tokens, then parts where "
              f"vLLM's own top-two gap is {gaps[split]:.4g} (near-tie limit {BF16_TIE:g}; "
              f"its smallest gap before: {min(gaps[:split], default=float('inf')):.4g})")
        assert gaps[split] <= BF16_TIE, (
            f"request {i} parts from vLLM's tokens at {split} where vLLM's own top-two gap "
            f"is {gaps[split]:.4g} > {BF16_TIE:g}: not a near-tie")
    print(f"\nbf16: {identical}/{len(want['tokens'])} requests identical to vLLM's own "
          "CPU_ATTN throughout")
    assert identical >= len(want["tokens"]) // 2
