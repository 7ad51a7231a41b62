"""kvcore-nvidia test setup.

``TRITON_INTERPRET=1`` must be set before triton is imported, so it is set here, at conftest
import, when torch sees no GPU: kvcore's Triton cache write (used by these backends on GPU
tensors) then also runs on CPU tensors through the interpreter. Tests marked ``gpu`` are
skipped without a GPU.
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
    # Declared here too so the plugin's tests run on their own (``pytest plugins/nvidia/tests``).
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU and _HERE in item.path.parents:
            item.add_marker(skip_gpu)


@pytest.fixture
def cuda(kvcore_simulate):
    """``cuda("9.0")``: simulate a CUDA device of that capability with only the
    kvcore-nvidia plugin allowed (third-party plugins installed beside it, such as the example
    plugin's SDPA_GATHER, would otherwise join the candidates)."""
    return lambda capability: kvcore_simulate("cuda", capability, plugins=("nvidia",))
