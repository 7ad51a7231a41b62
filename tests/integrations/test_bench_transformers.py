"""benchmarks/bench_transformers.py --small: the GPU benchmark's code path, on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test extra")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_transformers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_transformers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.engine
def test_small_run_agrees_with_sdpa_and_writes_json(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--small", "--workload", "decode", "--paths", "sdpa", "kvcore",
                       "kvcore:TRITON_ATTN", "--json", str(out)]) == 0
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kvcore"]["backend"] == "CPU_ATTN"
    assert (rows["kvcore"]["identical"], rows["kvcore"]["non_tie"]) == (4, 0)
    assert rows["kvcore"]["agreement"] == "4 same, 0 tie, 0 non-tie"
    assert rows["kvcore"]["cache_gib"] > 0
    assert "platform=cpu" in rows["kvcore:TRITON_ATTN"]["skipped"]
    assert capsys.readouterr().out.splitlines()[0].startswith("workload")  # the table is last


def test_the_referee_tells_a_near_tie_from_a_wrong_token(bench):
    # Streams are built from the referee's own logits: request 0 keeps the argmax tokens,
    # request 1 takes the second-best token at position 3 (a near-tie when the bound covers
    # that gap), request 2 the worst token there (never a tie).
    model = bench.build_model(True, "cpu")
    batch = bench.prompts(3, 24, model.config.vocab_size)
    with torch.no_grad():
        reference = {}
        for i, prompt in enumerate(batch):
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                 pad_token_id=None)
            reference[f"req_{i}"] = out[0, len(prompt):].tolist()
        logits = model(torch.tensor([batch[1] + reference["req_1"][:3]])).logits[0, -1]
        second = logits.topk(2).indices[1].item()
        logits = model(torch.tensor([batch[2] + reference["req_2"][:3]])).logits[0, -1]
        worst = logits.argmin().item()
    path = {"req_0": reference["req_0"], "req_1": reference["req_1"][:3] + [second] * 3,
            "req_2": reference["req_2"][:3] + [worst] * 3}

    own = bench.referee(model, batch, reference, reference)
    assert all("divergence" not in f for f in own.values())
    noise = max(float(f["margins"].max()) for f in own.values())
    facts = bench.referee(model, batch, path, reference)
    gap = facts["req_1"]["divergence"]["logit_diff_ulps"]
    assert facts["req_1"]["divergence"]["token_is_top2"]
    assert facts["req_1"]["divergence"]["position"] == 3
    assert facts["req_2"]["divergence"]["logit_diff_ulps"] > gap > noise

    row = bench.Row("decode", "kvcore")
    bench.judge(row, facts, gap)
    assert (row.identical, row.near_tie, row.non_tie) == (1, 1, 1)
    assert [d["tie"] for d in row.divergences] == [True, False]
    assert row.max_margin_ulps >= facts["req_2"]["divergence"]["logit_diff_ulps"]
