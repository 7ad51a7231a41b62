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


def shell_commands(path: Path) -> list[str]:
    """The command lines of the ``bash`` blocks of ``path``, comments and env prefixes gone."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", path.read_text(),
                            re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            for part in filter(None, (p.strip() for p in line.split("&&"))):
                commands.append(re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", part))
    return commands


DOC_COMMANDS = [(p, c) for p in [REPO / "README.md", *MARKDOWN] for c in shell_commands(p)]


@pytest.mark.parametrize(("path", "command"), DOC_COMMANDS,
                         ids=[f"{p.relative_to(REPO)}: {c[:50]}" for p, c in DOC_COMMANDS])
def test_doc_commands_run_as_written_in_the_activated_environment(path, command):
    """Each program is one the README's setup puts in ``.venv/bin`` (or the system's python3),
    and every ``kvcore`` / ``pytest --kvcore-...`` command parses with kvcore's parser and
    pytest plugin options, so that following the docs gives no "command not found" and no
    "unrecognized arguments"."""
    import shlex
    import sys

    from kvcore.cli.main import build_parser

    words = shlex.split(command)
    program = words[0].removeprefix(".venv/bin/")
    bin_dir = Path(sys.executable).parent
    assert program in ("python3", "source", "cd", "git") or (bin_dir / program).exists(), \
        f"{program!r} is not installed by the README's setup"
    if program == "kvcore":
        try:
            build_parser(with_kernels_options=True).parse_args(words[1:])
        except SystemExit as exc:
            assert exc.code == 0, f"kvcore rejects: {command}"
    if program == "pytest" or words[:3] == ["python", "-m", "pytest"]:
        known = set(re.findall(r'"(--kvcore-[a-z-]+)"', (REPO / "kvcore_pytest.py").read_text()))
        used = {w.split("=")[0] for w in words if w.startswith("--kvcore-")}
        assert used <= known, f"unknown pytest options {used - known}"


def test_backend_plugin_doc_lists_every_attribute_an_impl_gets():
    import kvcore

    class Impl(kvcore.AttentionImpl):
        write_kv_cache = attend = None

    documented = set(re.findall(r"^\| `self\.([a-z_]+)` \|", (DOCS / "backend-plugin.md")
                                .read_text(), re.MULTILINE))
    assert documented == set(vars(Impl(8, 64, 0.125, 2)))
