"""What a layout conversion is given, checked before anything is written: each side's memory
(a whole allocation of its layout, as flat bytes) and its block ids. Used by
:meth:`kvcore.connectors.ConversionPlan.prepare`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore import KVCacheLayout, KVCaches

__all__ = ["checked_ids", "dtype_name", "id_tensor", "overlap", "storage_bytes"]


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: a dtype as messages name it."""
    return str(dtype).removeprefix("torch.")


def storage_bytes(value: torch.Tensor | KVCaches, layout: KVCacheLayout, name: str,
             block_bytes: int) -> tuple[torch.Tensor, int]:
    """A side's memory as a flat uint8 tensor, and how many blocks of ``layout`` (of
    ``block_bytes``, every layer) it holds."""
    if isinstance(value, KVCaches):
        value = value.storage
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a KVCaches or a torch.Tensor, got "
                        f"{type(value).__name__}")
    if value.dtype not in (layout.dtype, torch.uint8):
        raise TypeError(f"{name} is {dtype_name(value.dtype)}, but its layout stores "
                        f"{dtype_name(layout.dtype)} (pass that dtype or uint8 bytes)")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous: a whole allocation of layout {layout} "
                         "(KVCaches.storage, or packed block rows)")
    raw = value.reshape(-1).view(torch.uint8)
    if block_bytes == 0 or raw.numel() % block_bytes:
        raise ValueError(f"{name} holds {raw.numel()} bytes, not a whole number of blocks of "
                         f"{block_bytes} bytes (layout {layout.describe()}, every layer)")
    return raw, raw.numel() // block_bytes


def checked_ids(value: Sequence[int] | torch.Tensor, name: str, num_blocks: int, side: str
         ) -> list[int] | torch.Tensor:
    """Checked block ids: an int64 CPU tensor for a tensor, a list of ints for a sequence
    (checked in passes of C code; the gather kernel's launch packs lists in one tensor)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got {value.dtype} "
                            f"shape {tuple(value.shape)}")
        ids: list[int] | torch.Tensor = value.to("cpu", torch.int64)
        bounds = tuple(int(v) for v in torch.aminmax(ids)) if ids.numel() else None
    else:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got "
                            f"{type(value).__name__}")
        if set(map(type, value)) - {int}:  # (one pass of C code when they are all ints)
            for i, b in enumerate(value):
                if isinstance(b, bool) or not isinstance(b, int):
                    raise TypeError(f"{name}[{i}]={b!r} must be an int")
        ids = value if type(value) is list else list(value)
        bounds = (min(ids), max(ids)) if ids else None
    if bounds is not None and (bounds[0] < 0 or bounds[1] >= num_blocks):
        bad = bounds[0] if bounds[0] < 0 else bounds[1]
        raise ValueError(f"{name} contains {bad}, outside the {side}'s {num_blocks} blocks "
                         f"(valid: 0..{num_blocks - 1}); is the {side} too small?")
    return ids


def id_tensor(ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Checked ids (:func:`checked_ids`) as an int64 CPU tensor."""
    return ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat byte tensors share memory."""
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() and b_lo < a_lo + a.numel()
