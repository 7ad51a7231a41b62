"""benchmarks/doc_commands.py, which runs the README's and docs/' kvcore commands as written on a
GPU machine: what it finds, and the page plugin its docs/backend-plugin.md commands run with."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "doc_commands.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("doc_commands", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_commands"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_it_finds_the_commands_of_shell_blocks_once_without_comments(script, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\nkvcore demo   # the demo\n$ kvcore list\npip install x\n```\n"
        "```text\nkvcore demo: output, not a command\n```\n")
    (tmp_path / "docs" / "a.md").write_text("```sh\nkvcore demo\nkvcore plugins\n```\n")
    found = [(c.where, c.command) for c in script.doc_commands(tmp_path)]
    assert found == [("README.md:2", "kvcore demo"), ("README.md:3", "kvcore list"),
                     ("docs/a.md:3", "kvcore plugins")]


def test_the_real_pages_show_the_readme_demo_and_the_plugin_page_commands(script):
    commands = {c.command: c.where for c in script.doc_commands()}
    assert commands["kvcore demo"].startswith("README.md:")
    assert any(where.startswith(script.PLUGIN_PAGE) for where in commands.values())


@pytest.mark.slow
def test_the_plugin_page_commands_run_with_its_backend_installed(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--skip",
                           "^kvcore (demo|warmup|bench|tune|layout|select --explain --(head|pl"
                           "atform rocm))"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["command"]: row for row in json.loads((tmp_path / "doc_commands.json").read_text())}
    ran = {command: row for command, row in rows.items() if row["runs"]}
    assert ran and all(row["where"].startswith("docs/backend-plugin.md") for row in ran.values())
    assert "acme" in "\n".join(rows["kvcore plugins"]["runs"][0]["tail"])


def test_a_listing_runs_nothing_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--list"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kvcore demo" in done.stdout and "listed" in done.stdout
    assert not list(tmp_path.iterdir())
