"""Importing kvcore must stay light: no triton, no plugin, no kernel module."""

from __future__ import annotations

import subprocess
import sys


def test_import_kvcore_loads_no_triton_and_no_plugin():
    code = (
        "import sys, kvcore, kvcore.ops\n"
        "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.')\n"
        "       or m.startswith('kvcore_') or m.startswith('kvcore.ops.triton')\n"
        "       or m.startswith(('flash_attn', 'flashinfer', 'aiter'))]\n"
        "print(bad)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_registering_plugins_imports_no_backend_module():
    code = (
        "import sys, kvcore\n"
        "kvcore.backend_registry(); kvcore.platform_registry()\n"
        "print([m for m in sys.modules if m.startswith('kvcore.backends.')])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
