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
def rocm(monkeypatch: pytest.MonkeyPatch):
    """``rocm("gfx942")``: simulate a ROCm device of that capability with only the kvcore-rocm
    plugin allowed (so the test stand-ins under tests/plugins never collide with it)."""
    import kvcore

    def reset() -> None:
        kvcore.reset_plugins()
        kvcore.clear_platform_cache()
        kvcore.clear_selection_cache()

    def simulate(capability: str) -> None:
        monkeypatch.delenv("KVCORE_ATTENTION_BACKEND", raising=False)
        monkeypatch.delenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        monkeypatch.setenv("KVCORE_PLUGINS", "rocm")
        monkeypatch.setenv("KVCORE_PLATFORM", "rocm")
        monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", capability)
        reset()

    yield simulate
    monkeypatch.undo()
    reset()
