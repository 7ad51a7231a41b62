"""Entry point of kvcore-nvidia (group ``kvcore.plugins``): registers the NVIDIA backends, the
``cuda_batch`` block copier and the plugin's status report by ``module:name`` path, so
registering imports no kernel library."""

from __future__ import annotations

from collections.abc import Callable

import kvcore

_BACKENDS = "kvcore_nvidia.backends"
_OPS = "kvcore_nvidia.ops"


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    # platforms= repeats each class's PLATFORMS: selection elsewhere imports nothing.
    register("FLASHINFER", f"{_BACKENDS}.flashinfer:FlashInferBackend", platforms=("cuda",))
    register("FLASH_ATTN", f"{_BACKENDS}.flash_attn:FlashAttentionBackend", platforms=("cuda",))
    register("FLEX_ATTENTION", f"{_BACKENDS}.flex_attention:FlexAttentionBackend",
             platforms=("cuda", "cpu"))
    register("FLASHINFER_MLA", f"{_BACKENDS}.flashinfer_mla:FlashInferMLABackend",
             platforms=("cuda",))


@kvcore.hookimpl
def kvcore_register_block_copiers(register: Callable[[str, str], None]) -> None:
    register("cuda_batch", f"{_OPS}.copier:CudaBatchCopier")


@kvcore.hookimpl
def kvcore_register_status_reports(register: Callable[[str, str], None]) -> None:
    register("nvidia", f"{_OPS}.status:status_report")
