"""Where kvcore-nvidia's libraries keep what they build, read without importing them (the
status report and the backends' progress notices name these directories)."""

from __future__ import annotations

import os

__all__ = ["flashinfer_jit_cache"]


def flashinfer_jit_cache() -> str:
    """Where FlashInfer keeps its JIT-compiled modules (one folder per version and GPU
    architecture below it): ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``, the base
    defaulting to the home directory. Read without importing FlashInfer."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    return os.path.join(base, ".cache", "flashinfer")
