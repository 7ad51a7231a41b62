"""Entry point of kvcore-rocm (group ``kvcore.plugins``): registers the ROCm backends lazily."""

from __future__ import annotations

from collections.abc import Callable

import kvcore

_MODULE = "kvcore_rocm.backends"


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[[str, str], None]) -> None:
    register("ROCM_ATTN", f"{_MODULE}:RocmAttentionBackend")
    register("ROCM_AITER_UNIFIED_ATTN", f"{_MODULE}:AiterUnifiedAttentionBackend")
    register("ROCM_AITER_FA", f"{_MODULE}:AiterFlashAttentionBackend")


@kvcore.hookimpl
def kvcore_register_kernel_compile_cases(register: Callable[[str, str], None]) -> None:
    register("kvcore_rocm", "kvcore_rocm.compile_cases:compile_cases")
