"""Test setup for kvcore-rocm.

``TRITON_INTERPRET=1`` must be set before triton is imported, so it is set here, at conftest
import, when torch sees no GPU: the Triton kernels then run on CPU through the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rocm(kvcore_simulate):
    """``rocm("gfx942")``: simulate a ROCm device of that capability with only the
    kvcore-rocm plugin allowed (so the test stand-ins under tests/plugins never collide with it)."""
    return lambda capability: kvcore_simulate("rocm", capability, plugins=("rocm",))
