"""Block copiers: vendor ways to move many whole blocks between a device and pinned memory.

By default the ``offload`` connector moves scattered blocks through device staging: a gather
kernel packs them, then one bus copy moves each chunk. That reaches the bus limit, but the
gather and scatter kernels share the GPU's SMs and memory bandwidth with the engine. A block
copier moves each block (or run of adjacent blocks) straight over the bus with the copy
engines, no kernel at all; e.g. ``cuda_batch`` from kvcore-nvidia, one
``cudaMemcpyBatchAsync`` per call. Whether that is the better trade depends on the block size
and the engine's load: ``benchmarks/bench_offload.py`` measures both.

Plugins register copiers with the ``kvcore_register_block_copiers`` hook; an engine picks one
with ``get_connector("offload", ..., block_copier=NAME)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvcore.registry import ResolveError, block_copier_registry

__all__ = ["BlockCopier", "block_copier_names", "get_block_copier"]


class BlockCopier(ABC):
    """Copies whole blocks between two blocks-first tensors, one of them in pinned memory.

    Subclasses set :attr:`name` and implement :meth:`copy_blocks`; they are created without
    arguments by :func:`get_block_copier`.
    """

    #: The name the copier is registered under (lower case).
    name: ClassVar[str]

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this copier cannot move the blocks of a cache on ``device``, as a sentence
        that says what to use instead; ``None`` when it can."""
        return None

    @abstractmethod
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor,
                    block_mapping: torch.Tensor) -> int:
        """Queue ``dst[block_mapping[i, 1]] = src[block_mapping[i, 0]]`` for every row.

        Args:
            src, dst: ``(num_blocks, row)`` tensors of one dtype and row shape, each row one
                contiguous run of memory (rows may be strided); one on the cache's device, the
                other in pinned host memory.
            block_mapping: ``(n, 2)`` int64 CPU tensor ``(src_block, dst_block)``; the
                destination blocks are distinct and in range (callers check).

        The copies run on the current CUDA stream, after the work already queued on it and
        before the work queued next; the call returns once they are queued and must never
        wait for the device (connectors issue transfers while the engine's stream is busy).
        On a CPU ``src``/``dst`` pair the copy is done when the call returns.

        Returns:
            The number of copies queued (adjacent blocks may merge into one).
        """


def block_copier_names() -> list[str]:
    """Names of the registered block copiers."""
    return block_copier_registry().names()


def get_block_copier(name: str) -> BlockCopier:
    """A new instance of the copier registered as ``name`` (``UnknownNameError`` lists the
    valid names)."""
    registry = block_copier_registry()
    cls = registry.resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, BlockCopier)):
        reg = registry.get(name)
        raise ResolveError(f"block copier {reg.name!r} (plugin {reg.plugin!r}) resolves to "
                           f"{cls!r}, which is not a kvcore.connectors.BlockCopier subclass")
    if getattr(cls, "name", None) != registry.normalize(name):
        raise ResolveError(f"block copier registered as {registry.normalize(name)!r} has "
                           f"name {getattr(cls, 'name', None)!r}; the two must match")
    return cls()
