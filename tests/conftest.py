"""Test-wide setup.

Triton must see ``TRITON_INTERPRET=1`` before any ``@triton.jit`` runs, so it is set here, at
conftest import, whenever this machine has no GPU: CI then runs the Triton kernels on the CPU
through the interpreter (small shapes only).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
