"""The GPU / Triton-interpreter test setup every kvcore test folder needs, in one place.

Triton must see ``TRITON_INTERPRET=1`` before any ``@triton.jit`` runs, so a ``conftest.py``
makes a :class:`GpuTestSetup` at import: on a machine without a GPU the Triton kernels then
run on the CPU through the interpreter (small shapes only), and the tests of that folder marked
``gpu`` are skipped::

    # conftest.py
    from pathlib import Path

    from kvcore.testing import GpuTestSetup

    _setup = GpuTestSetup(under=Path(__file__).parent)
    pytest_configure = _setup.pytest_configure
    pytest_collection_modifyitems = _setup.pytest_collection_modifyitems
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "GPU_MARKER",
    "GpuTestSetup",
    "skip_gpu_tests_without_gpu",
    "use_triton_interpreter_without_gpu",
]

#: The ``gpu`` marker's declaration (``config.addinivalue_line("markers", GPU_MARKER)``).
GPU_MARKER = "gpu: needs a CUDA or ROCm GPU (skipped cleanly without one)"
_NO_GPU = "needs a CUDA or ROCm GPU; this machine has none"


def use_triton_interpreter_without_gpu() -> bool:
    """Set ``TRITON_INTERPRET=1`` (unless already set) when torch sees no GPU.

    Call it before triton is imported (at ``conftest.py`` import). Returns whether a GPU is
    present.
    """
    has_gpu = torch.cuda.is_available()
    if not has_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return has_gpu


def skip_gpu_tests_without_gpu(items: Iterable, *, under: Path | None = None,
                               reason: str = _NO_GPU) -> None:
    """Add a skip marker to every collected test marked ``gpu`` when torch sees no GPU.

    Args:
        items: the ``items`` of ``pytest_collection_modifyitems``.
        under: only the tests in this folder (a plugin's conftest, when the whole repository's
            suite collects several folders); ``None``: all of them.
        reason: the skip reason shown by ``pytest -ra``.
    """
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords and (under is None or under in Path(item.path).parents):
            item.add_marker(skip)


class GpuTestSetup:
    """A folder's GPU / interpreter test setup; its two methods are a ``conftest.py``'s hooks.

    Making one calls :func:`use_triton_interpreter_without_gpu` (so make it at conftest
    import). Args as :func:`skip_gpu_tests_without_gpu`.
    """

    def __init__(self, *, under: Path | None = None, reason: str = _NO_GPU) -> None:
        self.has_gpu = use_triton_interpreter_without_gpu()
        self.under = under
        self.reason = reason

    def pytest_configure(self, config) -> None:
        """Declare the ``gpu`` marker, so the folder's tests also run on their own."""
        config.addinivalue_line("markers", GPU_MARKER)

    def pytest_collection_modifyitems(self, config, items) -> None:
        """Skip this folder's ``gpu`` tests when there is no GPU."""
        skip_gpu_tests_without_gpu(items, under=self.under, reason=self.reason)
