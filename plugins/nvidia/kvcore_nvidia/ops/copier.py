"""``cuda_batch``: the offload connector's block copier on the CUDA copy engines.

Moves each run of adjacent blocks with one entry of a ``cudaMemcpyBatchAsync`` call (the
plugin's :func:`kvcore_nvidia.ops.copy_blocks`, ``method="batch"``), so offloading needs no
staging buffers and runs no kernel on the SMs the engine uses. Use it with
``get_connector("offload", ..., block_copier="cuda_batch")``.
"""

from __future__ import annotations

import torch

from kvcore.connectors import BlockCopier


class CudaBatchCopier(BlockCopier):
    name = "cuda_batch"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return (f"cuda_batch moves blocks with CUDA's copy engines and the cache is on "
                    f"{device}; leave block_copier unset to use kvcore's own copies")
        from kvcore_nvidia.ops import extension_unavailable_reason

        reason = extension_unavailable_reason()
        if reason is not None:
            return (f"kvcore-nvidia's CUDA C++ kernels are unavailable ({reason}); leave "
                    "block_copier unset to use kvcore's own copies")
        return None

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor,
                    block_mapping: torch.Tensor) -> int:
        from kvcore_nvidia.ops import copy_blocks

        return copy_blocks(src, dst, block_mapping, method="batch")
