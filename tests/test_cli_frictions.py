"""Small frictions of the command line a newcomer met: each answer says what is supported."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli


def test_layout_refuses_a_head_size_the_backend_does_not_support(fresh_kvcore, capsys):
    status, out, err = run_cli(capsys, "layout", "TRITON_ATTN", "--head-size", "1000")
    assert (status, out) == (2, "")
    assert ("--head-size 1000: TRITON_ATTN supports head sizes multiples of 8 up to 256; pass "
            "one of those") in err
    assert run_cli(capsys, "layout", "TRITON_ATTN", "--head-size", "256")[0] == 0


def test_list_is_narrow_by_default_and_wide_on_request(fresh_kvcore, capsys):
    status, out, _ = run_cli(capsys, "list")
    assert status == 0
    header = out.splitlines()[0].split()
    assert header[:3] == ["backend", "platforms", "mla"]
    assert "kv-cache" in header and header[-2:] == ["block", "sizes"]
    assert "plugin" not in header and max(len(line) for line in out.splitlines()) <= 120
    assert "--wide adds the plugin" in out
    status, out, _ = run_cli(capsys, "list", "--wide")
    header = out.splitlines()[0]
    assert status == 0 and all(word in header for word in (
        "plugin", "kv-cache dtypes", "block sizes", "cross-layer", "kv-connector", "cuda graphs"))
    triton = next(line for line in out.splitlines() if line.startswith("TRITON_ATTN "))
    assert "auto, fp8, fp8_e4m3, fp8_e5m2" in triton


def test_kernels_summary_has_a_legend(fresh_kvcore, capsys, monkeypatch):
    from kvcore.testing import compile_check

    result = compile_check.CompileResult(owner="kvcore", case="c", kernel="k", target="sm90",
                                         key="x", registers=255, spills=856, shared=225 << 10,
                                         shared_limit=227 << 10, cached=True)
    monkeypatch.setattr(compile_check, "run_check", lambda *a, **k: [result])
    status, out, _ = run_cli(capsys, "kernels", "--target", "sm90")
    assert status == 0 and "255 / 856 / 225" in out
    assert ("cells: registers per thread / spilled bytes per thread / shared memory KiB, the "
            "largest over the kernel's cases for that target") in out


def test_list_json_keeps_every_capability(fresh_kvcore, capsys):
    _, out, _ = run_cli(capsys, "list", "--format", "json")
    row = next(r for r in json.loads(out) if r["name"] == "CPU_ATTN")
    assert {"kv_cache_dtypes", "block_sizes", "plugin", "cuda_graphs"} <= set(row)


def test_readme_demo_sample_has_every_line_the_demo_prints(fresh_kvcore, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    sample = readme.split("## See it work: `kvcore demo`", 1)[1].split("```text\n", 1)[1]
    sample = sample.split("```", 1)[0]
    status, out, _ = run_cli(capsys, "demo", "--model", "tiny", "--batch", "2", "--new-tokens",
                          "2", "--no-progress")
    label = re.compile(r"^([a-z]+) {2,}\S", re.MULTILINE)
    assert status == 0 and "graphs" in label.findall(out)
    assert set(label.findall(out)) <= set(label.findall(sample))


def test_readme_setup_names_everything_it_installs():
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    setup = readme.split("## Set up\n", 1)[1].split("<!-- ci:setup -->", 1)[0]
    extras = re.search(r"^-e \.\[([\w,]+)\]", (root / "requirements-dev.txt").read_text(),
                       re.MULTILINE).group(1).split(",")
    words = " ".join(setup.split())
    assert all(f"`{extra}`" in words for extra in extras if extra != "test"), words
    assert "`transformers`" in words


@pytest.mark.slow
def test_transformers_example_help_has_no_rst_marks():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[1] / "examples" / "transformers_llama.py"
    out = subprocess.run([sys.executable, str(example), "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    assert "A Hugging Face transformers Llama served through kvcore" in out
    assert "``" not in out and "tokens generated per prompt" in out
