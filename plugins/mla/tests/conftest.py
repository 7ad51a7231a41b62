"""kvcore-mla test setup.

Triton must see ``TRITON_INTERPRET=1`` before any ``@triton.jit`` runs, so it is set here, at
conftest import, whenever this machine has no GPU: the plugin's Triton kernels then run on the
CPU through the interpreter (small shapes only). Tests marked ``gpu`` are skipped without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    # Declared here too so the plugin's tests run on their own (``pytest plugins/mla/tests``).
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU and _HERE in item.path.parents:
            item.add_marker(skip_gpu)
