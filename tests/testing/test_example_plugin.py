"""The example third-party plugin (``examples/third_party_plugin``), installed by the README's
setup like any vendor package: discovered through its entry point, shown by the CLI, and its
own tests (the conformance suite among them) pass."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from test_conformance_features import is_feature_case

import kvcore
from kvcore.cli import main as kvcore_cli

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).parents[2] / "examples" / "third_party_plugin"
DISTRIBUTION = "kvcore-example-plugin"


@pytest.fixture
def example_installed(fresh_kvcore):
    try:
        metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{DISTRIBUTION} is not installed; the README's setup installs it "
                    "(requirements-dev.txt: -e examples/third_party_plugin)")
    return fresh_kvcore


def test_discovered_through_its_entry_point(example_installed):
    (info,) = [p for p in kvcore.list_plugins() if p.name == "example"]
    assert (info.distribution, info.source, info.status, info.module) == (
        DISTRIBUTION, "entry point", "loaded", "kvcore_example_plugin.plugin")
    assert kvcore.backend_registry().get("SDPA_GATHER").target == (
        "kvcore_example_plugin.backends.sdpa_gather:SdpaGatherBackend")
    assert kvcore.connector_registry().get("example_memory").plugin == "example"


def test_kvcore_list_shows_its_backend(example_installed, capsys):
    assert kvcore_cli(["list", "--format", "json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    sdpa = rows["SDPA_GATHER"]
    assert (sdpa["plugin"], sdpa["error"], sdpa["cross_layer"], sdpa["stride_order"]) == (
        "example", None, True, [0, 1, 3, 2, 4])
    assert kvcore_cli(["list", "--wide"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("SDPA_GATHER")]
    assert line.split()[1:3] == ["example", "cpu,cuda,rocm"]


def test_kvcore_plugins_shows_it_loaded(example_installed, capsys):
    assert kvcore_cli(["plugins"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("example ")]
    assert line.split()[:2] == ["example", DISTRIBUTION]
    assert "loaded" in line.split()


def test_its_own_test_suite_passes(example_installed, pytester):
    recorder = pytester.inline_run(str(EXAMPLE / "tests"), "-p", "no:cacheprovider",
                                   "-p", "no:hypothesispytest")
    passed, skipped, failed = recorder.listoutcomes()
    assert not failed, "\n\n".join(r.longreprtext for r in failed)
    conformance = [r for r in passed if "test_sdpa_gather_conforms[" in r.nodeid]
    assert len(conformance) >= 30
    # Skipped: a GPU's cache size, and the sinks / soft-cap cases of a backend that declares
    # neither feature.
    assert all("-int64-offsets-" in r.nodeid or is_feature_case(r.nodeid) for r in skipped)
