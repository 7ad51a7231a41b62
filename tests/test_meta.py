"""Keeping the plugin surface honest: every hook has a test and a documentation entry, every
registered backend is listed by ``kvcore list``, every conformance rule and every backend
capability is documented."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import kvcore
from kvcore import hookspecs
from kvcore.cli import main as kvcore_cli
from kvcore.testing import RULES

REPO = Path(__file__).parents[1]
DOCS = REPO / "docs"


def hook_names() -> set[str]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(fn, marker)}


def headings(path: Path, level: str) -> list[str]:
    return re.findall(rf"^{level} (.+)$", path.read_text(), re.MULTILINE)


def test_the_hookspecs_are_found():
    assert {"kvcore_register_backends", "kvcore_register_platforms",
            "kvcore_register_connectors"} <= hook_names()


def test_every_hook_has_a_test():
    tests = {node.name for path in (REPO / "tests").rglob("test_*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef)}
    missing = {h for h in hook_names() if not any(t.startswith(f"test_hook_{h}") for t in tests)}
    assert not missing, f"hooks without a test_hook_<name> test: {sorted(missing)}"


def test_every_hook_has_a_documentation_entry_and_only_those():
    documented = {h.strip("`") for h in headings(DOCS / "hooks.md", "##")
                  if h.startswith("`kvcore_")}
    assert documented == hook_names()


def test_every_registered_backend_appears_in_kvcore_list(fresh_kvcore, capsys):
    registered = kvcore.backend_registry().names()
    assert kvcore_cli(["list", "--format", "json"]) == 0
    assert [row["name"] for row in json.loads(capsys.readouterr().out)] == registered
    assert kvcore_cli(["list"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]  # rows, then notes
    listed = [line.split()[0] for line in table.splitlines()[2:] if line[:1].strip()]
    assert listed == registered  # (a line starting blank continues a wrapped row)


def test_every_conformance_rule_is_documented_and_only_those():
    text = (DOCS / "conformance.md").read_text()
    rules_section = text.split("## The rules", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^### (\S+)$", rules_section, re.MULTILINE) == list(RULES)


def test_every_backend_capability_is_documented():
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", (DOCS / "backend-plugin.md").read_text(),
                          re.MULTILINE))
    declared = {name for name in vars(kvcore.AttentionBackend) if name.isupper()}
    assert declared | {"CONFORMANCE_TOLERANCES"} == rows
