"""``examples/transformers_llama.py``: a Hugging Face Llama whose attention runs through
kvcore's paged cache generates exactly the tokens of transformers' own attention."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import kvcore

pytest.importorskip("transformers", reason="transformers is a test extra (pip install "
                    "-e '.[test]')")

EXAMPLE = Path(__file__).parents[1] / "examples" / "transformers_llama.py"
NEW_TOKENS = 12


def load_example():
    spec = importlib.util.spec_from_file_location("transformers_llama_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


example = load_example()
#: The tiny model's attention configuration (see ``tiny_llama``).
CONFIG = kvcore.AttentionSelectorConfig(head_size=32, dtype=torch.float32, block_size=16)


def valid_backends(platform: str) -> list[str]:
    """Every backend ``kvcore.explain_selection`` finds valid for the tiny model on
    ``platform``: what a user may pass to ``--backend`` on this machine."""
    report = kvcore.explain_selection(CONFIG, platform=platform)
    return [c.name for c in report.candidates if not c.reasons]


CPU_BACKENDS = valid_backends("cpu")
# Without a GPU the gpu test below is skipped; TRITON_ATTN stands in for its id.
CUDA_BACKENDS = valid_backends("cuda") if torch.cuda.is_available() else ["TRITON_ATTN"]


@pytest.fixture(scope="module")
def cpu_model():
    return example.tiny_llama(device="cpu")


@pytest.fixture(scope="module")
def prompts(cpu_model):
    return example.random_prompts(4, cpu_model.config.vocab_size)


@pytest.fixture(scope="module")
def reference(cpu_model, prompts):
    return example.generate_reference(cpu_model, prompts, NEW_TOKENS)


def test_paged_generation_equals_transformers_attention_on_cpu(cpu_model, prompts, reference):
    paged, backend = example.generate_paged(cpu_model, prompts, NEW_TOKENS)
    assert backend.get_name() == "CPU_ATTN"
    assert paged == reference
    assert cpu_model.config._attn_implementation == "sdpa"  # restored afterwards


def test_several_backends_are_valid_on_cpu():
    # The parametrisation below must not shrink to the default backend alone.
    assert {"CPU_ATTN", "FLEX_ATTENTION", "SDPA_GATHER"} <= set(CPU_BACKENDS)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_every_valid_cpu_backend_generates_transformers_tokens(cpu_model, prompts, reference,
                                                               name):
    paged, backend = example.generate_paged(cpu_model, prompts, NEW_TOKENS, backend=name)
    assert backend.get_name() == name
    assert paged == reference


def test_the_example_script_runs_a_forced_backend(capsys):
    assert example.main(["--requests", "2", "--new-tokens", "6",
                         "--backend", "FLEX_ATTENTION"]) == 0
    assert "backend FLEX_ATTENTION on cpu: 12/12 tokens equal" in capsys.readouterr().out


def test_cuda_without_cuda_is_one_line_saying_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert example.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "CUDA is not available in this torch build" in err
    assert "install a CUDA build of torch" in err and "--device cpu" in err


def test_cuda_build_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert example.main(["--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "torch.cuda.is_available() is False" in err and "--device cpu" in err


def test_unknown_device_is_one_line(capsys):
    assert example.main(["--device", "tpu9"]) == 2
    assert capsys.readouterr().err == (
        "error: --device tpu9 is not a torch device (use cpu, cuda or cuda:N)\n")


def test_layers_sharing_one_cache_change_the_tokens(cpu_model, prompts, reference,
                                                    monkeypatch):
    # The classic layout bug: every layer's view aliases the same memory. The comparison
    # must see it, or equality above would prove nothing about the cache.
    allocate = kvcore.allocate_kv_caches

    def aliased(*args, **kwargs):
        caches = allocate(*args, **kwargs)
        caches.layers = [caches.layers[0]] * len(caches.layers)
        return caches

    monkeypatch.setattr(kvcore, "allocate_kv_caches", aliased)
    paged, _ = example.generate_paged(cpu_model, prompts, NEW_TOKENS)
    assert paged != reference


def test_the_example_script_reports_equal_tokens(capsys):
    assert example.main(["--requests", "2", "--new-tokens", "6"]) == 0
    assert "backend CPU_ATTN on cpu: 12/12 tokens equal" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_every_valid_cuda_backend_generates_transformers_tokens(name):
    model = example.tiny_llama(device="cuda")
    prompts = example.random_prompts(6, model.config.vocab_size)
    paged, backend = example.generate_paged(model, prompts, 24, backend=name)
    assert backend.get_name() == name
    assert paged == example.generate_reference(model, prompts, 24)
