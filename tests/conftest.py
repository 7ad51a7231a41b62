"""Test-wide setup.

Without a GPU, the Triton kernels run on the CPU through the interpreter (small shapes only)
and tests marked ``gpu`` are skipped (:class:`kvcore.testing.GpuTestSetup`, made at conftest
import, before any ``@triton.jit`` runs).
"""

from __future__ import annotations

import os

import pytest

from kvcore.testing import GpuTestSetup

_setup = GpuTestSetup()

# The nixl wheel's UCX carries its own libnl; where the system's libibverbs is installed (the
# mooncake tests need it), UCX's InfiniBand modules load it beside a second libnl, and every
# process that used nixl crashes at exit (SIGSEGV in libnl-route's destructor), pytest
# included. The tests move DRAM over TCP and need no InfiniBand: keep those modules out, in
# this process and the peers it starts. docs/connector.md tells users the same.
os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
pytest_collection_modifyitems = _setup.pytest_collection_modifyitems


FIXTURE_PLUGINS = ("standin_rocm", "broken_import", "broken_register", "duplicate_cpu",
                   "bad_backends", "exits_on_import")


@pytest.fixture(scope="session")
def fixture_plugins_dir(tmp_path_factory: pytest.TempPathFactory):
    """The test-fixture plugin distributions, really installed (pip) into a temp directory.

    Put the returned path on ``sys.path`` (or ``PYTHONPATH``) and entry-point discovery finds
    them, as it finds any third-party plugin.
    """
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path_factory.mktemp("plugins")
    root = Path(__file__).parent / "plugins"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), *(str(root / d) for d in FIXTURE_PLUGINS)],
        check=True,
    )
    return target


@pytest.fixture
def fresh_kvcore(monkeypatch: pytest.MonkeyPatch):
    """Clear kvcore's plugin, platform and selection state before and after a test."""
    import kvcore

    for var in ("KVCORE_PLATFORM", "KVCORE_DEVICE_CAPABILITY", "KVCORE_ATTENTION_BACKEND",
                "KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(var, raising=False)
    kvcore.reset_plugins()
    kvcore.clear_platform_cache()
    yield kvcore
    kvcore.reset_plugins()
    kvcore.clear_platform_cache()


@pytest.fixture
def with_plugins(fixture_plugins_dir, fresh_kvcore, monkeypatch: pytest.MonkeyPatch):
    """Make the fixture plugins discoverable; ``with_plugins("standin_rocm")`` allows a subset."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(fixture_plugins_dir))
    importlib.invalidate_caches()
    imported_before = set(sys.modules)

    def enable(*names: str) -> None:
        monkeypatch.setenv("KVCORE_PLUGINS", ",".join(f"testfixture_{n}" for n in names))
        fresh_kvcore.reset_plugins()
        fresh_kvcore.clear_platform_cache()

    yield enable
    # Forget the plugin modules this test imported (the fixtures' are on a path that goes
    # away), but not the installed plugins imported earlier: tests that already hold their
    # classes must keep patching the same modules.
    for name in list(sys.modules):
        if name.startswith("kvcore_") and name not in imported_before:
            sys.modules.pop(name)
