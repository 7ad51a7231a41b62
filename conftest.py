"""The test groups: which tests the README's test command leaves to a named group.

``python -m pytest`` runs the fast suite, the one to run before every commit. The long tests
are in groups, one marker each: pyproject.toml deselects them by default (``addopts``:
``-m "not (triton or compile or engine or slow)"``), and ``-m`` given on the command line
replaces that default, so ``python -m pytest -m triton`` runs one group and ``-m ""`` runs
everything. The README lists the groups with their times, and ``.ci/run`` runs each of them.

A command line that names test files or node ids (``pytest tests/ops/test_triton_attention.py``)
and no ``-m`` runs them whatever their group: the default leaves out groups, not tests asked
for by name. A directory keeps the default.

A test's group is its own group marker (``@pytest.mark.slow``, say) if it has one, else the
first rule of :data:`GROUP_RULES` that its node id matches, else none: a new test joins the
group of its module's rule, and a new module joins the fast suite. Tests marked ``gpu`` stay
in no group by rule, so on a GPU machine the README's command runs them (``-m gpu`` runs only
them). This conftest sits at the repository root so that the rules apply however the tests
are reached (``pytest``, ``pytest plugins/mla/tests``, ``pytest -m triton``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

# The tests choose their backends by the platform's static order: a developer's own measured
# ranking (`kvcore tune`, ~/.cache/kvcore/ranking.json) must not change what they select. A
# test of rankings names its file itself.
os.environ.setdefault("KVCORE_RANKING_FILE", "none")

#: The groups, in the order the README lists them and ``.ci/run`` runs them.
GROUPS = ("triton", "compile", "engine", "slow")

#: ``(group, node id pattern)``, first match wins; ``*`` matches any characters (``[`` is
#: literal, so a pattern can name a parametrisation). Node ids are relative to the repository.
GROUP_RULES: tuple[tuple[str, str], ...] = (
    # Ahead-of-time compiles for GPU targets without a GPU (kvcore.testing.compile_check,
    # `kvcore kernels`, PTX checks of the Gluon kernels), each in a subprocess.
    ("compile", "tests/testing/test_compile_check.py::*"),
    ("compile", "tests/ops/test_gluon_prefill.py::test_sm90_compile_*"),
    ("compile", "plugins/mla/tests/test_mla_decode_score_split.py::test_compiled_for_*"),
    ("compile", "plugins/mla/tests/test_mla_gluon_decode.py::test_compiles_for_*"),
    # Whole programs in subprocesses: the demos, the benchmark scripts, the transformers example.
    ("engine", "tests/test_demo.py::*"),
    ("engine", "tests/test_disagg_demo.py::*"),
    ("engine", "tests/test_bench.py::*"),
    ("engine", "tests/test_bench_nixl.py::*"),
    ("engine", "tests/test_builder.py::test_bench_step_smoke_*"),
    ("engine", "tests/test_transformers_example.py::*"),
    ("engine", "plugins/*/tests/test_*_bench_smoke.py::*"),
    # Triton kernels on every layout, dtype and tile variant: under TRITON_INTERPRET=1 without
    # a GPU (compiled, and fast, on one). A few Triton smoke tests stay in the fast suite.
    ("triton", "tests/ops/test_triton_*.py::*"),
    ("triton", "tests/ops/test_gluon_*.py::*"),
    ("triton", "tests/ops/test_stale_bytes.py::*"),
    ("triton", "tests/ops/*::*[*triton*]"),  # an op test's Triton parametrisations
    ("triton", "tests/testing/test_conformance_builtin.py::*[TRITON_*]"),
    ("triton", "plugins/mla/tests/test_mla_attention.py::*"),
    ("triton", "plugins/mla/tests/test_mla_cache_ops.py::*"),
    ("triton", "plugins/mla/tests/test_mla_cross_layer.py::*"),
    ("triton", "plugins/mla/tests/test_mla_decode_*.py::*"),
    ("triton", "plugins/mla/tests/test_mla_gluon_*.py::*"),
    ("triton", "plugins/nvidia/tests/test_nvidia_cache_write.py::*"),
    # The slowest connector cases (3-5 s each, two processes): mooncake's parametrisations of
    # cases the fast suite runs for nixl too.
    ("slow", "tests/connectors/test_convert_connectors.py::"
             "test_pull_consumer_refuses_what_cannot_convert_before_any_byte[mooncake]"),
    ("slow", "tests/connectors/test_convert_connectors.py::"
             "test_double_buffered_staging_moves_the_same_bytes_as_one_buffer[mooncake]"),
    ("slow", "tests/connectors/test_pull_connectors.py::"
             "test_a_block_waits_for_its_readers_each_reading_it_once[mooncake]"),
    ("slow", "tests/connectors/test_pull_connectors.py::"
             "test_round_trip_between_two_processes_is_bit_exact[*-mooncake]"),
)

_RULES = [(group, re.compile(".*".join(map(re.escape, pattern.split("*"))) + r"\Z"))
          for group, pattern in GROUP_RULES]


def group_of(nodeid: str, own_markers: set[str]) -> str | None:
    """The group of the test ``nodeid`` (relative to the repository) with these markers."""
    own = sorted(own_markers & set(GROUPS), key=GROUPS.index)
    if len(own) > 1:
        raise pytest.UsageError(f"{nodeid} is marked {' and '.join(own)}: a test belongs to "
                                "one group; keep one marker")
    if own or "gpu" in own_markers:
        return own[0] if own else None
    return next((group for group, rule in _RULES if rule.match(nodeid)), None)


def names_tests_without_m(args: list[str], paths: list[str], cwd: Path) -> bool:
    """Whether a command line (``args``, its test ``paths``) names only test files or node ids
    and gives no ``-m``: then the default deselection of the groups does not apply."""
    if not paths or any(a.startswith("-m") for a in args):
        return False
    return all((cwd / path.partition("::")[0]).is_file() for path in paths)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    args = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    if config.args_source == pytest.Config.ArgsSource.ARGS and names_tests_without_m(
            args, config.args, config.invocation_params.dir):
        config.option.markexpr = ""


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        if ROOT not in path.parents:
            continue  # the conformance suite run from site-packages, say
        _, sep, name = item.nodeid.partition("::")
        nodeid = path.relative_to(ROOT).as_posix() + sep + name
        group = group_of(nodeid, {mark.name for mark in item.iter_markers()})
        if group is not None:
            item.add_marker(group)
