"""The ``kvcore`` pytest plugin (``pytest11`` entry point): the conformance suite on demand.

pytest loads it in every run of an environment where kvcore is installed, so it stays inert
unless asked: without ``--kvcore-backend`` it adds only its options and marker and collects
nothing. With it:

- ``pytest --kvcore-backend NAME`` runs the conformance suite (:mod:`kvcore.testing.suite`) on
  each named backend, and only that; give paths as well to run those tests too.
- Any test taking a ``kvcore_backend`` argument runs once per named backend (the class), and
  one taking ``kvcore_conformance_case`` once per conformance case, so a plugin author can
  build on the suite. Without the option they are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# A top-level module, not part of the kvcore package: pytest imports it in every run, and
# importing anything under kvcore would import torch. The suite sits beside it in kvcore/.
SUITE = Path(__file__).parent / "kvcore" / "testing" / "suite.py"
#: Node id prefix of the suite's tests, the same wherever kvcore is installed.
SUITE_NODEID = "kvcore/testing/suite.py"
_NO_BACKEND = "no backend given: pass --kvcore-backend NAME (or module:Class) to run this"
_backends_key = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore", "kvcore backend conformance")
    group.addoption(
        "--kvcore-backend", action="append", default=[], metavar="NAME",
        dest="kvcore_backends",
        help="run kvcore's conformance suite on this attention backend: a registered name "
             "or a 'module:Class' path (repeatable)")
    group.addoption(
        "--kvcore-device", action="append", default=[], metavar="DEVICE",
        dest="kvcore_devices",
        help="torch device type for the numerical checks, e.g. cpu (repeatable; default: "
             "the devices of the backend's platforms present here)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kvcore_conformance: a case of kvcore's backend conformance suite")
    specs = config.getoption("kvcore_backends")
    if not specs:
        return
    from kvcore.testing.cases import resolve_backend_spec

    backends = []
    for spec in specs:
        try:
            backends.append(resolve_backend_spec(spec))
        except Exception as exc:
            raise pytest.UsageError(f"--kvcore-backend {spec}: {exc}") from exc
    config.stash[_backends_key] = backends
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(str(SUITE))
    else:  # no paths given: the suite replaces testpaths / the current directory
        config.args[:] = [str(SUITE)]


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    # Outside the rootdir (kvcore in site-packages) pytest would give the suite an empty node
    # id; a fixed one keeps `-k`, reports and --lf readable everywhere.
    if Path(module_path).resolve() == SUITE.resolve():
        return pytest.Module.from_parent(parent, path=Path(module_path), nodeid=SUITE_NODEID)
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    backends = metafunc.config.stash.get(_backends_key, [])
    skip = pytest.mark.skip(reason=_NO_BACKEND)
    if "kvcore_conformance_case" in metafunc.fixturenames:
        from kvcore.testing.cases import conformance_cases

        devices = metafunc.config.getoption("kvcore_devices") or None
        params = [
            pytest.param(case, id=case.id, marks=[pytest.mark.skip(reason=case.skip_reason)]
                         if case.skip_reason else [])
            for backend in backends for case in conformance_cases(backend, devices)
        ]
        metafunc.parametrize("kvcore_conformance_case",
                             params or [pytest.param(None, id="none", marks=skip)])
    if "kvcore_backend" in metafunc.fixturenames:
        from kvcore.testing.checks import backend_label

        metafunc.parametrize(
            "kvcore_backend",
            [pytest.param(b, id=backend_label(b)) for b in backends]
            or [pytest.param(None, id="none", marks=skip)])


@pytest.fixture
def kvcore_simulate(monkeypatch: pytest.MonkeyPatch):
    """Select backends as on another device, for tests of selection and validation.

    ``kvcore_simulate("rocm", "gfx942", plugins=("rocm",))`` forces the platform and device
    capability (``KVCORE_PLATFORM`` / ``KVCORE_DEVICE_CAPABILITY``), allows only the named
    third-party plugins (``KVCORE_PLUGINS``; ``None`` leaves the allowlist alone) and resets
    kvcore's plugin, platform and selection state. Everything is restored after the test.
    """
    import kvcore

    def reset() -> None:
        kvcore.reset_plugins()
        kvcore.clear_platform_cache()
        kvcore.clear_selection_cache()

    def simulate(platform: str, capability: str | None = None,
                 plugins: tuple[str, ...] | None = None) -> None:
        monkeypatch.delenv("KVCORE_ATTENTION_BACKEND", raising=False)
        monkeypatch.delenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        if plugins is not None:
            monkeypatch.setenv("KVCORE_PLUGINS", ",".join(plugins))
        monkeypatch.setenv("KVCORE_PLATFORM", platform)
        if capability is None:
            monkeypatch.delenv("KVCORE_DEVICE_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", capability)
        reset()

    yield simulate
    monkeypatch.undo()
    reset()


@pytest.fixture
def kvcore_gluon(monkeypatch: pytest.MonkeyPatch):
    """Set the operator's Gluon switch for one test: ``kvcore_gluon("0")`` sets
    ``KVCORE_GLUON`` and makes kvcore read it again (it reads it once per process:
    ``kvcore.ops.triton_utils.gluon_defaults_enabled``). Restored after the test."""
    from kvcore.ops.triton_utils import gluon_defaults_enabled

    def switch(value: str) -> None:
        monkeypatch.setenv("KVCORE_GLUON", value)
        gluon_defaults_enabled.cache_clear()

    yield switch
    monkeypatch.undo()
    gluon_defaults_enabled.cache_clear()


@pytest.fixture
def kvcore_shipped_ranking(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Ship rankings with a platform for one test, for tests of its shipped order.

    ``kvcore_shipped_ranking("cuda", ranking, ...)`` writes the :class:`kvcore.Ranking` objects
    into a ranking file in a package on a temporary path and points the platform's
    ``SHIPPED_RANKING`` there (no ranking: the platform ships none). Restored after the test.
    """
    import json
    import sys

    import kvcore
    from kvcore import ranking as rankings_module

    package = tmp_path / "kvcore_shipped_ranking_under_test"

    def ship(platform: str, *rankings: object) -> None:
        cls = type(kvcore.get_platform(platform))
        if not rankings:
            monkeypatch.setattr(cls, "SHIPPED_RANKING", None)
        else:
            package.mkdir(exist_ok=True)
            (package / "__init__.py").write_text("")
            data = {"format": rankings_module.FORMAT, "version": rankings_module.FORMAT_VERSION,
                    "rankings": [r.to_dict() for r in rankings]}
            (package / f"{platform}.json").write_text(json.dumps(data))
            monkeypatch.syspath_prepend(str(tmp_path))
            # Another test's package of this name (another temporary path) must not answer.
            monkeypatch.delitem(sys.modules, package.name, raising=False)
            monkeypatch.setattr(cls, "SHIPPED_RANKING", (package.name, f"{platform}.json"))
        rankings_module.load_shipped_rankings.cache_clear()
        kvcore.clear_selection_cache()

    yield ship
    monkeypatch.undo()
    rankings_module.load_shipped_rankings.cache_clear()
    kvcore.clear_selection_cache()
