"""kvcore-nvidia's kernels: CUDA C++ ops and their Python bindings.

- :func:`reshape_and_cache_flash`: a stride-aware cache write (optional fp8), bit-exact against
  :func:`kvcore.ops.reshape_and_cache_ref`.
- :func:`copy_blocks`: whole KV blocks between GPU memory and pinned host memory, adjacent
  blocks merged into runs (:func:`block_runs`), one ``cudaMemcpyBatchAsync`` by default.
- :func:`write_kv_cache`: the backends' cache write, the CUDA C++ kernel where the extension
  builds and kvcore's Triton kernel otherwise (:func:`cache_write_kernel`,
  :func:`cache_write_status`, :data:`DEFAULT_CACHE_WRITE`).
- :class:`~kvcore_nvidia.ops.copier.CudaBatchCopier`: the offload connector's ``cuda_batch``
  block copier on :func:`copy_blocks`.

The sources are the repository's ``csrc/nvidia`` (``kvcore_nvidia/csrc`` in an installed
package), built with ``torch.utils.cpp_extension`` on first use or by :func:`build_extension`
(:mod:`kvcore_nvidia.ops._build`). Importing this package imports no kernel library and builds
nothing.
"""

from kvcore_nvidia.ops.bindings import (
    COPY_METHODS,
    DEFAULT_COPY_STREAMS,
    build_extension,
    copy_blocks,
    extension_status,
    extension_unavailable_reason,
    reshape_and_cache_flash,
)
from kvcore_nvidia.ops.cache_write import (
    CACHE_WRITE_KERNELS,
    DEFAULT_CACHE_WRITE,
    cache_write_kernel,
    cache_write_status,
    write_kv_cache,
)

__all__ = [
    "CACHE_WRITE_KERNELS",
    "COPY_METHODS",
    "DEFAULT_CACHE_WRITE",
    "DEFAULT_COPY_STREAMS",
    "build_extension",
    "cache_write_kernel",
    "cache_write_status",
    "copy_blocks",
    "extension_status",
    "extension_unavailable_reason",
    "reshape_and_cache_flash",
    "write_kv_cache",
]
