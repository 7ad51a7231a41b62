"""kvcore-mla's registration hook, loaded through the ``kvcore.plugins`` entry point.

Registers by lazy ``"module:Class"`` path: loading the plugin imports no kernel code.
"""

from __future__ import annotations

from kvcore import hookimpl


@hookimpl
def kvcore_register_backends(register) -> None:
    register("TRITON_MLA", "kvcore_mla.triton_mla:TritonMLABackend")


@hookimpl
def kvcore_register_kernel_compile_cases(register) -> None:
    register("kvcore_mla", "kvcore_mla.compile_cases:compile_cases")
