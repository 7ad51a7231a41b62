"""The README's engine example runs as printed, the commands it shows exist, and its test
groups are the ones pyproject.toml, conftest.py and CI know."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcore.cli import main as kvcore_cli

REPO = Path(__file__).parents[1]
README = (REPO / "README.md").read_text()


def section(heading: str) -> str:
    return README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def root_conftest():
    """The repository's conftest.py (the test groups), loaded as a plain module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_conftest", REPO / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_engine_example_runs():
    code = re.search(r"```python\n(.*?)```", section("Use it in an engine"), re.DOTALL).group(1)
    exec(compile(code, "README.md (Use it in an engine)", "exec"), {})


@pytest.mark.parametrize("command", sorted(set(re.findall(r"(?:`|bin/)kvcore ([a-z][\w-]*)",
                                                           README))))
def test_every_kvcore_command_in_the_readme_exists(command, capsys):
    with pytest.raises(SystemExit) as exited:
        kvcore_cli([command, "--help"])
    assert exited.value.code == 0, capsys.readouterr().err


def test_the_test_groups_agree_in_the_readme_pyproject_conftest_and_ci(pytestconfig):
    """The README's table of test groups, the markers pyproject.toml declares as groups and
    leaves out of the fast suite, conftest.py's groups and the commands ``.ci/run`` runs name
    the same groups, so none can be added in one place and forgotten in another (a group the
    fast suite leaves out that CI does not run would stop running anywhere)."""
    import subprocess

    table = section("Test").split("<!-- ci:groups -->\n", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| `([^`]+)` \| ([^|]*\S[^|]*) \|$", table,
                      re.MULTILINE)
    readme = [group for group, _, _ in rows]
    commands = [command for _, command, _ in rows]
    assert readme and commands == [f".venv/bin/python -m pytest -m {g}" for g in readme]

    declared = {line.split(":")[0]: line for line in pytestconfig.getini("markers")}
    assert [name for name, line in declared.items() if ": test group:" in line] == readme
    addopts = pytestconfig.getini("addopts")
    default = addopts[addopts.index("-m") + 1]
    assert default == f"not ({' or '.join(readme)})"

    conftest = root_conftest()
    assert list(conftest.GROUPS) == readme
    assert {group for group, _ in conftest.GROUP_RULES} <= set(readme)

    listed = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--list"], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    assert listed[1:] == [section("Test").split("```bash\n", 1)[1].split("\n", 1)[0],
                          *commands]


@pytest.mark.parametrize(("nodeid", "markers", "group"), [
    ("tests/ops/test_triton_attention.py::test_x[a]", set(), "triton"),
    ("tests/ops/test_stale_bytes.py::test_x[causal-nan-reference]", set(), "triton"),
    ("tests/ops/test_torch_attention.py::test_x[triton-split]", set(), "triton"),
    ("tests/ops/test_torch_attention.py::test_x[torch]", set(), None),
    ("tests/testing/test_conformance_builtin.py::test_x[TRITON_ATTN]", set(), "triton"),
    ("tests/testing/test_conformance_builtin.py::test_x[CPU_ATTN]", set(), None),
    ("tests/ops/test_gluon_prefill.py::test_sm90_compile_x[64]", set(), "compile"),
    ("tests/test_demo.py::test_x", set(), "engine"),
    ("tests/test_demo.py::test_x", {"slow"}, "slow"),
    ("tests/ops/test_triton_attention.py::test_x", {"gpu"}, None),
    ("tests/test_selector.py::test_x", {"platform_matrix"}, None),
])
def test_a_test_s_group_is_its_own_marker_else_the_first_rule_it_matches(nodeid, markers,
                                                                          group):
    assert root_conftest().group_of(nodeid, markers) == group


def test_a_test_in_two_groups_is_refused_naming_both():
    with pytest.raises(pytest.UsageError, match="tests/x.py::t is marked compile and slow"):
        root_conftest().group_of("tests/x.py::t", {"slow", "compile"})


@pytest.mark.parametrize(("args", "paths", "default_off"), [
    ([], [], False),  # the README's command: testpaths, the groups left out
    (["tests/test_demo.py"], ["tests/test_demo.py"], True),
    (["tests/test_demo.py::test_x[a]"], ["tests/test_demo.py::test_x[a]"], True),
    (["-q", "tests/test_demo.py", "tests/test_readme.py"],
     ["tests/test_demo.py", "tests/test_readme.py"], True),
    (["tests/ops"], ["tests/ops"], False),  # a directory: the fast suite's part of it
    (["tests/test_demo.py", "tests/ops"], ["tests/test_demo.py", "tests/ops"], False),
    (["-m", "slow", "tests/test_demo.py"], ["tests/test_demo.py"], False),
    (["-mslow", "tests/test_demo.py"], ["tests/test_demo.py"], False),
])
def test_tests_named_by_file_or_node_id_run_whatever_their_group(args, paths, default_off):
    assert root_conftest().names_tests_without_m(args, paths, REPO) == default_off
