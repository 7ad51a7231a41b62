"""kvcore-mla test setup: without a GPU, Triton kernels run on the CPU through the interpreter
and the ``gpu`` tests are skipped (:class:`kvcore.testing.GpuTestSetup`)."""

from __future__ import annotations

from pathlib import Path

from kvcore.testing import GpuTestSetup

# Made at conftest import: TRITON_INTERPRET must be set before triton is imported.
_setup = GpuTestSetup(under=Path(__file__).parent)
pytest_configure = _setup.pytest_configure
pytest_collection_modifyitems = _setup.pytest_collection_modifyitems
