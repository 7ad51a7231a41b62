"""Entry point of kvcore-mla (group ``kvcore.plugins``): registers the MLA backends by
``module:Class`` path, so registering imports no kernel library."""

from __future__ import annotations

from collections.abc import Callable

import kvcore

_BACKENDS = "kvcore_mla.backends"


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register("TRITON_MLA", f"{_BACKENDS}.triton_mla:TritonMLABackend",
             platforms=("cuda", "rocm"))


@kvcore.hookimpl
def kvcore_register_kernel_compile_cases(register: Callable[[str, str], None]) -> None:
    register("kvcore_mla", "kvcore_mla.ops.compile_cases:compile_cases")
