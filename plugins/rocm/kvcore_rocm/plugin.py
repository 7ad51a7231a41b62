"""Entry point of kvcore-rocm (group ``kvcore.plugins``): registers the ROCm backends by
``module:Class`` path, so registering imports no kernel library."""

from __future__ import annotations

from collections.abc import Callable

import kvcore

_BACKENDS = "kvcore_rocm.backends"


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    # platforms= repeats each class's PLATFORMS: selection elsewhere imports nothing.
    register("ROCM_ATTN", f"{_BACKENDS}.rocm_attn:RocmAttentionBackend", platforms=("rocm",))
    register("ROCM_AITER_UNIFIED_ATTN",
             f"{_BACKENDS}.aiter_unified_attn:AiterUnifiedAttentionBackend", platforms=("rocm",))
    register("ROCM_AITER_FA", f"{_BACKENDS}.aiter_fa:AiterFlashAttentionBackend",
             platforms=("rocm",))


@kvcore.hookimpl
def kvcore_register_kernel_compile_cases(register: Callable[[str, str], None]) -> None:
    register("kvcore_rocm", "kvcore_rocm.ops.compile_cases:compile_cases")
