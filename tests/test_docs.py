"""The documentation states what the code does: worked examples run, tables match the source,
links resolve."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest
import torch

from kvcore.testing import DEFAULT_TOLERANCES

REPO = Path(__file__).parents[1]
DOCS = REPO / "docs"
MARKDOWN = sorted([*DOCS.glob("*.md"), *(REPO / "examples").glob("*/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("path", [p for p in MARKDOWN if ">>> " in p.read_text()],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_worked_examples_run(path):
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    assert not broken, "\n".join(broken)


def test_environment_table_lists_every_variable_the_source_reads():
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", (DOCS / "environment.md").read_text(),
                          re.MULTILINE))
    sources = "\n".join(p.read_text() for top in ("kvcore", "platforms")
                        for p in (REPO / top).rglob("*.py"))
    read = set(re.findall(r"\bKVCORE_[A-Z_]+\b", sources))
    assert read | {"TRITON_INTERPRET"} == rows
    assert "TRITON_INTERPRET" in sources


def test_tolerance_table_is_the_default_table():
    text = (DOCS / "conformance.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([\d.e+-]+) \| ([\d.e+-]+) \|", text, re.MULTILINE)
    documented = {key if key.startswith("fp8") else getattr(torch, key):
                  (float(atol), float(rtol)) for key, atol, rtol in rows}
    assert documented == DEFAULT_TOLERANCES
