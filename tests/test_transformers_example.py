"""``examples/transformers_llama.py``: a Hugging Face Llama whose attention runs through
kvcore's paged cache generates exactly the tokens of transformers' own attention."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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
def test_paged_generation_equals_transformers_attention_with_triton_attn():
    model = example.tiny_llama(device="cuda")
    prompts = example.random_prompts(6, model.config.vocab_size)
    paged, backend = example.generate_paged(model, prompts, 24, backend="TRITON_ATTN")
    assert backend.get_name() == "TRITON_ATTN"
    assert paged == example.generate_reference(model, prompts, 24)
