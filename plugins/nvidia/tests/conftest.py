"""kvcore-nvidia test setup: without a GPU, Triton kernels run on the CPU through the interpreter
and the ``gpu`` tests are skipped (:class:`kvcore.testing.GpuTestSetup`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.testing import GpuTestSetup

# Made at conftest import: TRITON_INTERPRET must be set before triton is imported.
_setup = GpuTestSetup(under=Path(__file__).parent,
                      reason="needs an NVIDIA GPU; this machine has none")
pytest_configure = _setup.pytest_configure
pytest_collection_modifyitems = _setup.pytest_collection_modifyitems


@pytest.fixture
def cuda(kvcore_simulate):
    """``cuda("9.0")``: simulate a CUDA device of that capability with only the
    kvcore-nvidia plugin allowed (third-party plugins installed beside it, such as the example
    plugin's SDPA_GATHER, would otherwise join the candidates)."""
    return lambda capability: kvcore_simulate("cuda", capability, plugins=("nvidia",))
