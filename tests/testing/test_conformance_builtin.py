"""``pytest --kvcore-backend NAME`` passes for every backend that ships with kvcore.

The backends are read from the registry (every registration whose class lives in ``kvcore.``),
so a new built-in backend is checked without touching this file, plus the portable Triton
backends of the in-repo plugins (:data:`PORTABLE_PLUGIN_BACKENDS`). One whose platforms are
absent here (the Triton backends on a machine without a GPU) runs on CPU tensors under
``TRITON_INTERPRET=1``, which conftest sets when there is no GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

import pytest
from test_conformance_features import is_feature_case

import kvcore

pytest_plugins = ["pytester"]

#: The device capability simulated for an interpreted run: high enough for every declared
#: configuration of the built-in GPU backends (fp8 needs 8.9 on CUDA).
INTERPRETED_CAPABILITY = "9.0"


#: Backends of the in-repo plugins whose kernels are Triton only, so the interpreter runs them.
PORTABLE_PLUGIN_BACKENDS = ("TRITON_MLA",)


def builtin_backends() -> list[str]:
    registry = kvcore.backend_registry()
    return [name for name in registry.names() if registry.get(name).target.startswith("kvcore.")]


def suite_backends() -> list[str]:
    names = kvcore.backend_registry().names()
    return [*builtin_backends(), *(n for n in PORTABLE_PLUGIN_BACKENDS if n in names)]


def platform_present(backend: type[kvcore.AttentionBackend]) -> bool:
    return any(kvcore.get_platform(p).probe() is None for p in backend.PLATFORMS)


@pytest.fixture(scope="module")
def triton_imported() -> None:
    """Import triton before any pytester fixture exists.

    pytester forgets every module first imported while it is alive, and triton's C extension
    aborts the process when it is imported a second time.
    """
    if importlib.util.find_spec("triton") is not None:
        importlib.import_module("triton")


@pytest.mark.parametrize("name", suite_backends())
def test_builtin_backend_passes_the_conformance_suite(triton_imported, pytester, monkeypatch,
                                                      name):
    backend = kvcore.resolve_backend(name)
    args = ["--kvcore-backend", name]
    if not platform_present(backend):
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(f"{name} needs one of {backend.PLATFORMS}, or TRITON_INTERPRET=1")
        args += ["--kvcore-device", "cpu"]
        monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", INTERPRETED_CAPABILITY)
    recorder = pytester.inline_run(*args, "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
    passed, skipped, failed = recorder.listoutcomes()
    assert not failed, "\n\n".join(r.longreprtext for r in failed)
    # Every numerical case ran: only the >2**31-element cache waits for a GPU, and the sinks /
    # soft-cap cases skip for a backend that does not declare them.
    features = backend.SUPPORTS_SINK and backend.SUPPORTS_LOGITS_SOFT_CAP
    assert all("-int64-offsets-" in r.nodeid or (not features and is_feature_case(r.nodeid))
               for r in skipped), [r.nodeid for r in skipped]
    numeric = [r.nodeid for r in passed if re.search(rf"\[{name}-(cpu|cuda)-", r.nodeid)]
    kinds = ["cache-write", "forward", *(["cross-layer"] if backend.supports_cross_layer() else [])]
    assert all(any(f"-{kind}-" in case for case in numeric) for kind in kinds), numeric


def test_cpu_backends_are_among_the_builtin_backends():
    assert {"CPU_ATTN", "CPU_MLA"} <= set(builtin_backends())
