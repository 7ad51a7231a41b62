"""Importing kvcore must stay light: no triton, no plugin, no kernel module."""

from __future__ import annotations

import subprocess
import sys


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter (nothing imported yet), its output captured."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)


def test_import_kvcore_loads_no_triton_and_no_plugin():
    code = (
        "import sys, kvcore, kvcore.ops\n"
        "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.')\n"
        "       or m.startswith('kvcore_') or m.startswith('kvcore.ops.triton')\n"
        "       or m.startswith(('flash_attn', 'flashinfer', 'aiter'))]\n"
        "print(bad)\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "[]"


def test_registering_plugins_imports_no_backend_module():
    code = (
        "import sys, kvcore\n"
        "kvcore.backend_registry(); kvcore.platform_registry()\n"
        "print([m for m in sys.modules if m.startswith('kvcore.backends.')])\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "[]"


def test_public_names_load_on_first_use_and_wire_the_whole_api():
    """``import kvcore`` imports no torch (the ``kvcore`` command's ``--help``); the first
    public name imports the whole API, as an eager import would: a backend name works in
    ``allocate_kv_caches`` right away, with no registry call before it."""
    code = (
        "import sys, kvcore\n"
        "print('torch' in sys.modules, kvcore.__version__)\n"
        "kvcore.AttentionType\n"
        "print('torch' in sys.modules)\n"
        "kv = kvcore.allocate_kv_caches('CPU_ATTN', num_layers=1, num_blocks=2, block_size=4,\n"
        "                               num_kv_heads=1, head_size=8, dtype='float32',\n"
        "                               device='cpu')\n"
        "print(kv.layout, [n for n in kvcore.__all__ if n not in vars(kvcore)])\n"
        "kvcore.TritonAttentionMetadataBuilder\n"
        "print([n for n in kvcore.__all__ if n not in vars(kvcore)])\n"
    )
    result = _python(code)
    # A backend module's names (the Triton builder, for plugins) load when used.
    assert result.stdout.splitlines() == [
        "False 0.1.0", "False",
        "B,L,2,N,H,D ['TritonAttentionImpl', 'TritonAttentionMetadata', "
        "'TritonAttentionMetadataBuilder']", "[]"]
