"""The example plugin's one kernel: read requests' pages out of a paged cache (pure torch)."""

from __future__ import annotations

import torch

__all__ = ["gather_pages"]


def gather_pages(cache: torch.Tensor, table: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """``(num_seqs, pages * block_size, num_kv_heads, head_size)`` in ``dtype``.

    ``cache`` is a K or V view ``(num_blocks, block_size, num_kv_heads, head_size)`` of any
    strides; ``table`` is ``(num_seqs, pages)`` block ids. fp8 pages are dequantised.
    """
    pages = cache[table]  # advanced indexing reads through the view's strides
    tokens = pages.reshape(table.shape[0], -1, *cache.shape[2:]).to(dtype)
    return tokens * scale if scale != 1.0 else tokens
