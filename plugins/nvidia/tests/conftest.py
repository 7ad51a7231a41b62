"""kvcore-nvidia test setup.

Without a GPU, the Triton kernels run on the CPU through the interpreter and tests marked
``gpu`` are skipped (:mod:`kvcore.testing.gpu`, called at conftest import, before triton is
imported).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.testing import (
    GPU_MARKER,
    skip_gpu_tests_without_gpu,
    use_triton_interpreter_without_gpu,
)

use_triton_interpreter_without_gpu()


def pytest_configure(config: pytest.Config) -> None:
    # Declared here too so the plugin's tests run on their own (``pytest plugins/nvidia/tests``).
    config.addinivalue_line("markers", GPU_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu_tests_without_gpu(items, under=Path(__file__).parent,
                               reason="needs an NVIDIA GPU; this machine has none")


@pytest.fixture
def cuda(kvcore_simulate):
    """``cuda("9.0")``: simulate a CUDA device of that capability with only the
    kvcore-nvidia plugin allowed (third-party plugins installed beside it, such as the example
    plugin's SDPA_GATHER, would otherwise join the candidates)."""
    return lambda capability: kvcore_simulate("cuda", capability, plugins=("nvidia",))
