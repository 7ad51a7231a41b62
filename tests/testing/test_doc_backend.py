"""The whole backend of docs/backend-plugin.md, taken from the page as an author copies it:
its hook registers it, the selector picks it, and it passes the conformance suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from test_conformance_features import is_feature_case

import kvcore

pytest_plugins = ["pytester"]

DOC = Path(__file__).parents[2] / "docs" / "backend-plugin.md"


def doc_backend() -> str:
    """The code block after the page's ``<!-- ci:minimal-backend -->`` marker, found as
    ``benchmarks/doc_commands.py`` finds it for the page's commands."""
    module = sys.modules.get("doc_commands")
    if module is None:
        spec = importlib.util.spec_from_file_location(
            "doc_commands", DOC.parents[1] / "benchmarks" / "doc_commands.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["doc_commands"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module.page_backend(DOC.parents[1])


@pytest.fixture
def acme_dir(tmp_path: Path) -> Path:
    (tmp_path / "acme_kvcore.py").write_text(doc_backend())
    return tmp_path


def test_its_hook_registers_it_and_the_selector_picks_it(fresh_kvcore, acme_dir, monkeypatch,
                                                        capsys):
    from kvcore.cli import main

    monkeypatch.syspath_prepend(str(acme_dir))
    spec = importlib.util.spec_from_file_location("acme_kvcore", acme_dir / "acme_kvcore.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kvcore.register_plugin(module, "acme")
    assert kvcore.backend_registry().get("ACME_ATTN").plugin == "acme"
    assert main(["select", "--backend", "ACME_ATTN", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == "ACME_ATTN\n"


@pytest.mark.slow
def test_it_passes_the_conformance_suite(pytester, acme_dir):
    pytester.syspathinsert(acme_dir)
    recorder = pytester.inline_run("--kvcore-backend", "acme_kvcore:AcmeBackend",
                                   "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
    passed, skipped, failed = recorder.listoutcomes()
    assert not failed, "\n\n".join(r.longreprtext for r in failed)
    ran = " ".join(r.nodeid for r in passed)
    for kind in ("-cache-write-", "-forward-bf16-", "-forward-fp32-", "-stale-bytes-",
                 "-cross-layer-", "-builder-"):
        assert kind in ran, kind
    # Skipped: a GPU's cache size, and the sinks / soft-cap cases of a backend that declares
    # neither feature.
    assert all("-int64-offsets-" in r.nodeid or is_feature_case(r.nodeid) for r in skipped)
