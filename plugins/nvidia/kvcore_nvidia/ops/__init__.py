"""kvcore-nvidia's kernels: CUDA C++ ops and their Python bindings.

- :func:`reshape_and_cache_flash`: a stride-aware cache write (optional fp8), bit-exact against
  :func:`kvcore.ops.reshape_and_cache_ref`.
- :func:`copy_blocks`: whole KV blocks between GPU memory and pinned host memory, adjacent
  blocks merged into runs (:func:`block_runs`), one ``cudaMemcpyBatchAsync`` by default.
- :class:`~kvcore_nvidia.ops.copier.CudaBatchCopier`: the offload connector's ``cuda_batch``
  block copier on :func:`copy_blocks`.

The sources are ``kvcore_nvidia/csrc``, built with ``torch.utils.cpp_extension`` on first use
(:mod:`kvcore_nvidia.ops._build`). Importing this package imports no kernel library and builds
nothing; the attention backends' cache write is kvcore's portable Triton kernel.
"""

from kvcore_nvidia.ops.bindings import (
    COPY_METHODS,
    DEFAULT_COPY_STREAMS,
    build_extension,
    copy_blocks,
    extension_unavailable_reason,
    reshape_and_cache_flash,
)

__all__ = [
    "COPY_METHODS",
    "DEFAULT_COPY_STREAMS",
    "build_extension",
    "copy_blocks",
    "extension_unavailable_reason",
    "reshape_and_cache_flash",
]
