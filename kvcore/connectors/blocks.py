"""Block-level helpers on the blocks-first view: extract, inject, split K from V.

Every layer's KV cache is blocks-first (dim 0 is the block, see :class:`kvcore.KVCacheLayout`),
so moving block ``b`` never depends on which backend wrote the cache: it is ``layer[b]``. These
helpers work on any blocks-first tensor: a layer's logical view ``(num_blocks, 2, block_size,
num_kv_heads, head_size)``, an MLA view ``(num_blocks, block_size, head_size)`` or a raw byte
view ``(num_blocks, page_bytes)`` from :meth:`kvcore.KVCaches.block_view`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvcore import KVCaches

__all__ = ["extract_kv_from_layer", "inject_kv_into_layer", "virtually_split_kv_in_blocks"]


def _block_index(
    layer: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, name: str = "block_ids"
) -> torch.Tensor:
    """``block_ids`` as an int64 tensor on ``layer``'s device, checked against ``layer``."""
    if not isinstance(layer, torch.Tensor):
        raise TypeError(f"layer must be a torch.Tensor, got {type(layer).__name__}")
    if layer.dim() == 0:
        raise ValueError("layer must have a leading block dim, got a 0-dim tensor")
    num_blocks = layer.shape[0]
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got {block_ids.dtype} "
                            f"shape {tuple(block_ids.shape)}")
        ids = block_ids.to(device=layer.device, dtype=torch.int64)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())  # one sync: a bad id must not reach a kernel
            if lo < 0 or hi >= num_blocks:
                raise ValueError(f"{name} contains {lo if lo < 0 else hi}, outside the layer's "
                                 f"{num_blocks} blocks (valid: 0..{num_blocks - 1})")
        return ids
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got "
                        f"{type(block_ids).__name__}")
    for i, b in enumerate(block_ids):
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"{name}[{i}]={b!r} must be an int")
        if not 0 <= b < num_blocks:
            raise ValueError(f"{name}[{i}]={b} is outside the layer's {num_blocks} blocks "
                             f"(valid: 0..{num_blocks - 1})")
    return torch.tensor(list(block_ids), dtype=torch.int64, device=layer.device)


def extract_kv_from_layer(
    layer: torch.Tensor, block_ids: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """Copy blocks out of a blocks-first cache: ``layer[block_ids]``.

    Args:
        layer: a blocks-first cache ``(num_blocks, *block_shape)``, any strides.
        block_ids: which blocks, in the order wanted.

    Returns:
        A new contiguous tensor ``(len(block_ids), *block_shape)`` on ``layer``'s device.
    """
    ids = _block_index(layer, block_ids)
    return layer.index_select(0, ids)


def inject_kv_into_layer(
    layer: torch.Tensor,
    kv: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    request_id: str,
) -> None:
    """Write ``kv[i]`` into block ``block_ids[i]`` of a blocks-first cache, in place.

    Args:
        layer: a blocks-first cache ``(num_blocks, *block_shape)``, any strides.
        kv: ``(len(block_ids), *block_shape)``, same dtype (any device: copied over).
        block_ids: distinct destination blocks.
        request_id: the request the blocks belong to, named in every error.

    A count mismatch is an error, not a partial write: a block left half-written would look
    valid to the engine. ``kv`` may be a view of ``layer`` itself (moving blocks within a
    cache, e.g. ``inject_kv_into_layer(layer, layer[2:5], [3, 4, 5], ...)``): when the two
    share memory it is copied first, so every block receives the source as it was before the
    call, not a block already overwritten by it.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    ids = _block_index(layer, block_ids)
    if kv.dim() != layer.dim() or kv.shape[1:] != layer.shape[1:]:
        raise ValueError(
            f"request {request_id!r}: kv has shape {tuple(kv.shape)} but the layer's blocks have "
            f"shape {tuple(layer.shape[1:])}; expected ({ids.numel()}, "
            f"{', '.join(map(str, layer.shape[1:]))})"
        )
    if kv.shape[0] != ids.numel():
        raise ValueError(f"request {request_id!r}: kv holds {kv.shape[0]} blocks but block_ids "
                         f"names {ids.numel()}")
    if kv.dtype != layer.dtype:
        raise TypeError(f"request {request_id!r}: kv is {kv.dtype} but the layer is {layer.dtype}")
    if ids.numel() and ids.unique().numel() != ids.numel():
        raise ValueError(f"request {request_id!r}: block_ids has duplicates: "
                         f"{sorted(ids.tolist())}")
    if _may_overlap(kv, layer):
        kv = kv.clone()  # index_copy_ reads the source while it writes the destination
    # non_blocking only towards a GPU: a GPU -> CPU copy that returned early could be read by
    # index_copy_ on the host before it landed.
    layer.index_copy_(0, ids, kv.to(layer.device, non_blocking=layer.device.type != "cpu"))


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share bytes: the same storage and overlapping address
    ranges (from shapes and strides, no device read). Views of one cross-layer allocation
    interleave, so two layers' views count as overlapping: copying then is only wasteful."""
    if a.device != b.device or a.device.type == "meta" or not a.numel() or not b.numel():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def virtually_split_kv_in_blocks(kv_caches: KVCaches) -> list[torch.Tensor]:
    """Byte regions of every block, with K and V apart where the layout allows it.

    For transfer engines that register memory regions and move K and V separately. Returns
    uint8 views sharing memory with the cache, each ``(num_blocks, num_parts, part_bytes)``:

    - per-layer caches whose block is K then V (physical order ``B,2,...``, NHD or HND): one
      view per layer with ``num_parts=2``; ``[:, 0]`` is the K half, ``[:, 1]`` the V half;
    - per-layer caches where K and V are not two halves of the block (MLA ``B,N,D`` has no
      K/V split; ``B,N,2,...`` interleaves them per token): one view per layer with
      ``num_parts=1``, the whole block;
    - cross-layer caches: a single view ``(num_blocks, 1, num_layers * page_bytes)``, the whole
      block of every layer, because a half of it would cut through layers, not K from V.

    The address of block ``b`` part ``p`` is ``v.data_ptr() + b * v.stride(0) + p *
    v.stride(1)``; each part is ``v.shape[2]`` contiguous bytes.
    """
    if not isinstance(kv_caches, KVCaches):
        raise TypeError(f"kv_caches must be a kvcore.KVCaches, got {type(kv_caches).__name__}")
    if kv_caches.is_cross_layer:
        return [kv_caches.block_view().unsqueeze(1)]
    per_block = [n for n in kv_caches.layout.physical_dim_names if n not in ("L", "B")]
    parts = 2 if per_block[:1] == ["2"] else 1
    return [view.unflatten(1, (parts, -1)) for view in kv_caches.layer_block_views()]


def _host_buffer(t: torch.Tensor) -> memoryview:
    """A zero-copy byte buffer over a contiguous CPU tensor (for hashlib and bytes()).

    Avoids ``Tensor.numpy()``, which needs numpy, a package kvcore does not depend on. The
    tensor must stay alive while the buffer is used.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"expected a contiguous CPU tensor, got device {t.device}, "
                         f"contiguous={t.is_contiguous()}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")
