"""Entry point of kvcore-nvidia (group ``kvcore.plugins``): registers the NVIDIA backends, the
``cuda_batch`` block copier and the plugin's status report by ``module:name`` path, so
registering imports no kernel library."""

from __future__ import annotations

from collections.abc import Callable

import kvcore

_BACKENDS = "kvcore_nvidia.backends"
_OPS = "kvcore_nvidia.ops"


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[[str, str], None]) -> None:
    register("FLASHINFER", f"{_BACKENDS}.flashinfer:FlashInferBackend")
    register("FLASH_ATTN", f"{_BACKENDS}.flash_attn:FlashAttentionBackend")
    register("FLEX_ATTENTION", f"{_BACKENDS}.flex_attention:FlexAttentionBackend")
    register("FLASHINFER_MLA", f"{_BACKENDS}.flashinfer_mla:FlashInferMLABackend")


@kvcore.hookimpl
def kvcore_register_block_copiers(register: Callable[[str, str], None]) -> None:
    register("cuda_batch", f"{_OPS}.copier:CudaBatchCopier")


@kvcore.hookimpl
def kvcore_register_status_reports(register: Callable[[str, str], None]) -> None:
    register("nvidia", f"{_OPS}.cache_write:status_report")
