"""``kvcore warmup``: builds what the selected backend needs for a demo model's shapes and
lists where the results are cached."""

from __future__ import annotations

import json

import pytest
import torch

from kvcore.cli import main as kvcore_cli


def test_warmup_runs_the_first_steps_and_lists_the_caches(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVCORE_COMPILE_CACHE", str(tmp_path / "compile"))
    assert kvcore_cli(["warmup", "--model", "tiny", "--platform", "cpu", "--format",
                       "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["platform"], data["backend"], data["dtype"]) == ("cpu", "CPU_ATTN", "float32")
    assert data["seconds"]["steps"] > 0
    caches = data["caches"]
    assert caches["kvcore_compile_check"] == str(tmp_path / "compile")
    assert "triton" in caches
    # kvcore-nvidia reports where FlashInfer's JIT and its own extension are kept.
    assert {"nvidia.flashinfer_jit_cache", "nvidia.cuda_extension_cache"} <= set(caches)
    assert kvcore_cli(["warmup", "--model", "mla-small", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "backend   CPU_MLA" in out and "caches    " in out
    assert f"kvcore_compile_check         {tmp_path / 'compile'}" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for an absent GPU")
def test_warmup_refuses_a_platform_that_is_not_present(capsys):
    assert kvcore_cli(["warmup", "--platform", "cuda"]) == 2
    assert "--platform cuda: not present on this machine" in capsys.readouterr().err


def test_the_first_step_of_each_kind_says_it_may_compile(monkeypatch):
    """The demo engine (under `kvcore demo` and `kvcore warmup`) wraps the first prefill, mixed
    and decode step in kvcore.long_step, which prints only when the step is long (a compile);
    later steps of a kind are not wrapped."""
    import contextlib

    from kvcore.demo import engine

    announced = []

    @contextlib.contextmanager
    def recording(what, **kwargs):
        announced.append((what, kwargs))
        yield

    monkeypatch.setattr(engine, "long_step", recording)
    assert kvcore_cli(["warmup", "--model", "tiny", "--platform", "cpu"]) == 0
    kinds = [what.rsplit(" for the first ", 1)[1] for what, _ in announced]
    assert sorted(kinds) == ["decode step", "mixed step", "prefill step"], kinds
    what, kwargs = announced[0]
    assert what.startswith("compiling CPU_ATTN's kernels (float32, ")
    assert kwargs["cache"] == engine.triton_cache_dir() and kwargs["estimate"]
