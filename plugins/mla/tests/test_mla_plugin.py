"""kvcore-mla loads like a third-party plugin should: loading, registering, resolving and
validating its backend imports no kernel library. (That it uses only kvcore's public API is
checked for every plugin by ``tests/test_architecture.py``.)"""

from __future__ import annotations

import subprocess
import sys


def test_loading_and_resolving_the_backend_imports_no_kernel_library() -> None:
    code = (
        "import sys, torch, kvcore\n"
        "kvcore.list_plugins()\n"
        "cls = kvcore.resolve_backend('TRITON_MLA')\n"
        "config = kvcore.AttentionSelectorConfig(head_size=576, use_mla=True)\n"
        "cls.validate_configuration(**config.as_kwargs(), device_capability=None)\n"
        "cls.get_impl_cls()\n"
        "print('triton' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False", result.stderr
