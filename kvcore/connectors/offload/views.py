"""Views of the cache's blocks that let one indexed copy move many bytes at once."""

from __future__ import annotations

import torch

__all__ = ["WORD_DTYPES", "stacked_layers", "word_size"]

#: The integer dtype of each word size: rows are viewed as words of this dtype.
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(row_bytes: int, views: list[torch.Tensor]) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every row, stride and address, so the
    indexed copies move words, not bytes."""
    for size in (8, 4, 2):
        if row_bytes % size == 0 and all(
            v.data_ptr() % size == 0 and all(s % size == 0 for s in v.stride()[:-1])
            for v in views
        ):
            return size
    return 1


def stacked_layers(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The views ``(num_blocks, W)`` as one ``(num_blocks, len(views), W)`` view when they are
    equally spaced in one storage (then one indexed copy moves every layer), else None."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(1)
    step = views[1].data_ptr() - first.data_ptr()
    size = first.element_size()
    if step <= 0 or step % size:
        return None
    for i, v in enumerate(views):
        if (v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype
                or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or v.data_ptr() - first.data_ptr() != i * step):
            return None
    n, w = first.shape
    return first.as_strided((n, len(views), w), (first.stride(0), step // size, first.stride(1)),
                            first.storage_offset())
