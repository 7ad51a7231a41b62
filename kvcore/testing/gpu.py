"""The GPU / Triton-interpreter test setup every kvcore test folder needs, in one place.

Triton must see ``TRITON_INTERPRET=1`` before any ``@triton.jit`` runs, so a ``conftest.py``
calls :func:`use_triton_interpreter_without_gpu` at import: on a machine without a GPU the
Triton kernels then run on the CPU through the interpreter (small shapes only). Tests marked
``gpu`` are skipped there by :func:`skip_gpu_tests_without_gpu`::

    # conftest.py
    from kvcore.testing import (GPU_MARKER, skip_gpu_tests_without_gpu,
                                use_triton_interpreter_without_gpu)

    use_triton_interpreter_without_gpu()

    def pytest_configure(config):
        config.addinivalue_line("markers", GPU_MARKER)

    def pytest_collection_modifyitems(config, items):
        skip_gpu_tests_without_gpu(items)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["GPU_MARKER", "skip_gpu_tests_without_gpu", "use_triton_interpreter_without_gpu"]

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
