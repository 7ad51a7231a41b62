"""Adopt an engine's KV-cache memory: wrap what the engine allocated as kvcore caches, no copy.

An engine owns its memory. vLLM, for one, allocates one flat int8 buffer for every layer and
cuts per-layer views out of it in one of its named layouts (``LBNHC``, ``BLHNC``, ...;
:mod:`kvcore.layout_names`). kvcore adopts such memory instead of allocating its own:

- :func:`adopt_kv_caches` wraps one buffer holding every layer, described by a layout (a vLLM
  name or a kvcore stride order) and optional offset and strides, as :class:`KVCaches`: the
  same per-layer logical views, layout and block views that :func:`kvcore.allocate_kv_caches`
  returns, over the engine's bytes (``data_ptr`` equal, nothing copied).
- :func:`from_vllm_layer_view` turns one layer's vLLM view ``[B, H, N, C]`` (any of vLLM's
  strides) into kvcore's logical ``(B, 2, N, H, D)`` view of the same memory.

Both check, before anything runs, everything the kernels rely on and raise a ``ValueError`` or
``TypeError`` naming the argument, the value, what is supported and the fix: sizes and dtypes
the backend declares, the buffer's device, dtype, size and alignment, and that the physical
order is one the backend reads (:meth:`AttentionBackend.readable_stride_orders`; pages strided
by other layers only for a backend that opts in to cross-layer caches).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcore.allocate import (
    KVCaches,
    _backend_class,
    _check_declared,
    _check_span,
    _platform_of,
)
from kvcore.backend import AttentionBackend
from kvcore.dtypes import cache_torch_dtype, parse_dtype
from kvcore.layout import KV_DIM_NAMES, KVCacheLayout
from kvcore.layout_names import VLLM_LAYOUTS, vllm_layout_name, vllm_layout_order

__all__ = ["adopt_kv_caches", "check_readable_order", "from_vllm_layer_view", "physical_order"]

_RAW_DTYPES = (torch.uint8, torch.int8)


def adopt_kv_caches(
    backend: type[AttentionBackend] | str,
    buffer: torch.Tensor,
    *,
    layout: str | Sequence[int],
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype | str,
    kv_cache_dtype: str = "auto",
    offset_bytes: int = 0,
    layer_stride_bytes: int | None = None,
    block_stride_bytes: int | None = None,
    device: torch.device | str | None = None,
    platform: str | None = None,
) -> KVCaches:
    """Wrap an engine-allocated buffer holding ``num_layers`` KV caches as :class:`KVCaches`.

    The caches start ``offset_bytes`` into ``buffer`` and lie densely in the physical order
    ``layout`` gives: layer ``l`` of block ``b`` starts at ``offset_bytes + l *
    layer_stride_bytes + b * block_stride_bytes``, which is how vLLM describes its
    allocation. The result's ``layers[i]`` are views of ``buffer`` (no copy), ``storage`` is
    ``buffer``'s bytes in ``layout.physical_shape``, and ``block_view()`` works as for
    :func:`kvcore.allocate_kv_caches` (per layer for a blocks-first layout, all layers at
    once for a cross-layer one).

    Args:
        backend: a backend class or its registry name.
        buffer: the engine's memory: raw bytes (``uint8``/``int8``) or elements of the cache
            dtype, contiguous, any shape.
        layout: a vLLM layout name (``"LBNHC"``, ``"BLHNC"``, ...: :data:`kvcore.VLLM_LAYOUTS`),
            or a kvcore stride order of ``(L, B, 2, N, H, D)`` (6 ints) or of one layer's
            ``(B, 2, N, H, D)`` (5 ints, layers outermost).
        num_layers, num_blocks, block_size, num_kv_heads, head_size: sizes.
        dtype: the model dtype; the cache's element type follows ``kv_cache_dtype``.
        offset_bytes: where the first layer's first block starts in ``buffer``.
        layer_stride_bytes, block_stride_bytes: the engine's strides, checked against the
            dense layout (padded pages are refused: connectors move pages as dense runs).
        device: where the caches must be (default: ``buffer``'s device).
        platform: the platform the caches are for (default: from the device), for the
            backend's cross-layer verification (:attr:`AttentionBackend.CROSS_LAYER_PLATFORMS`).

    Raises:
        ValueError, TypeError: a size, dtype, head or block size the backend does not declare;
            a buffer on another device, of another dtype, not contiguous, too small or
            misaligned; strides that are not the layout's; an order the backend does not read.
    """
    backend = _backend_class(backend)
    name = backend.get_name()
    for arg, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                       ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                       ("head_size", head_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{arg}={value!r} must be a positive integer")
    if backend.IS_MLA:
        raise ValueError(f"{name} is an MLA backend; adopting MLA caches (one latent per "
                         "token) is not supported yet: allocate them with "
                         "kvcore.allocate_kv_caches")
    model_dtype = parse_dtype(dtype)
    storage_dtype = cache_torch_dtype(kv_cache_dtype, model_dtype)
    _check_declared(backend, model_dtype, kv_cache_dtype, block_size, head_size)
    order = _layout_order(layout)
    kv_layout = KVCacheLayout((num_layers, num_blocks, 2, block_size, num_kv_heads, head_size),
                              order, ("L", *KV_DIM_NAMES), storage_dtype)
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    dev = buffer.device if device is None else torch.device(device)
    if buffer.device != dev:
        raise ValueError(f"buffer is on {buffer.device} but the caches are for {dev}; pass the "
                         "engine's buffer for that device (or device=None)")
    check_readable_order(backend, order, platform or _platform_of(dev), what=f"layout={layout!r}")
    _check_span(backend, kv_layout)
    itemsize = kv_layout.itemsize
    if buffer.dtype not in (*_RAW_DTYPES, storage_dtype):
        raise TypeError(f"buffer has dtype {_name(buffer.dtype)}; adopt raw bytes (uint8, "
                        f"int8) or elements of the cache dtype {_name(storage_dtype)}")
    if not buffer.is_contiguous():
        raise ValueError("buffer is not contiguous; pass the engine's whole allocation (the "
                         "layout's offsets and strides describe where the caches lie in it)")
    if isinstance(offset_bytes, bool) or not isinstance(offset_bytes, int) or offset_bytes < 0:
        raise ValueError(f"offset_bytes={offset_bytes!r} must be an int >= 0")
    start = buffer.data_ptr() + offset_bytes
    if offset_bytes % itemsize or start % itemsize:
        raise ValueError(f"the caches would start at byte address {start} (offset_bytes="
                         f"{offset_bytes}), not a multiple of the {_name(storage_dtype)} "
                         f"element size {itemsize}; align the offset")
    available = buffer.numel() * buffer.element_size()
    if offset_bytes + kv_layout.total_bytes > available:
        raise ValueError(
            f"buffer holds {available} bytes but {num_layers} layers of {num_blocks} blocks in "
            f"{kv_layout.describe()} need {kv_layout.total_bytes} bytes from offset_bytes="
            f"{offset_bytes}; allocate more or adopt fewer blocks")
    strides = kv_layout.logical_strides()
    for arg, given, dim in (("layer_stride_bytes", layer_stride_bytes, 0),
                            ("block_stride_bytes", block_stride_bytes, 1)):
        expected = strides[dim] * itemsize
        if given is not None and given != expected and kv_layout.logical_shape[dim] > 1:
            raise ValueError(
                f"{arg}={given} but layout {_layout_label(order)} with these sizes puts "
                f"consecutive {'layers' if dim == 0 else 'blocks'} {expected} bytes apart; "
                "padded or interleaved pages are not supported (connectors move dense "
                f"pages): give {arg}={expected} or let the engine pack its pages densely")
    raw = buffer.view(-1) if buffer.dtype == storage_dtype else buffer.view(-1).view(torch.uint8)
    if raw.dtype == torch.uint8:
        raw = raw[offset_bytes:offset_bytes + kv_layout.total_bytes].view(storage_dtype)
    else:
        first = offset_bytes // itemsize
        raw = raw[first:first + math.prod(kv_layout.logical_shape)]
    storage = raw.view(kv_layout.physical_shape)
    logical = storage.permute(kv_layout.inverse_stride_order())
    note = "" if backend.supports_kv_connector() else backend.kv_connector_unsupported_reason()
    return KVCaches(layers=list(logical.unbind(0)), storage=storage, layout=kv_layout,
                    backend_name=name, _kv_connector_note=note)


def from_vllm_layer_view(
    backend: type[AttentionBackend] | str,
    kv_cache: torch.Tensor,
    *,
    head_size: int,
    platform: str | None = None,
) -> torch.Tensor:
    """kvcore's logical view ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` of one
    layer's vLLM cache view ``[num_blocks, num_kv_heads, block_size, C]`` (``C = 2 *
    head_size``: K then V of each head and token), sharing its memory.

    vLLM cuts that view from its buffer with the strides of the model's layout; the result
    keeps them, so the backend's kernels read vLLM's memory in place. Host facts only (shape,
    strides, dtype): cheap enough to call per layer.

    Raises:
        ValueError: not 4 dims; ``C`` is not ``2 * head_size`` (a V head size other than K's
            is not supported); ``C`` not contiguous; an order the backend does not read.
    """
    backend = _backend_class(backend)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 4:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}; a vLLM layer view is "
                         "[num_blocks, num_kv_heads, block_size, head_size + head_size_v]")
    content = kv_cache.shape[3]
    if content != 2 * head_size:
        raise ValueError(
            f"kv_cache's last dim is {content} but head_size={head_size}: kvcore reads K and V "
            f"of one head size side by side (C = 2 * head_size = {2 * head_size}); a V head "
            "size other than K's is not supported")
    if kv_cache.stride(3) != 1 and content > 1:
        raise ValueError(f"kv_cache has strides {kv_cache.stride()}; the K and V of a head and "
                         "token (the last dim) must be contiguous")
    view = kv_cache.unflatten(3, (2, head_size)).permute(0, 3, 2, 1, 4)
    order = physical_order(view)
    dev = kv_cache.device
    check_readable_order(backend, order, platform or _platform_of(dev),
                         what=f"the vLLM view of strides {kv_cache.stride()}",
                         strided_pages=_pages_strided(view, order))
    return view


def physical_order(view: torch.Tensor) -> tuple[int, ...]:
    """The stride order of a strided view, outermost first: dims by decreasing stride, size-1
    dims (whose stride means nothing) where the logical order puts them."""
    dims = range(view.dim())
    sized = sorted((d for d in dims if view.shape[d] > 1), key=lambda d: -view.stride(d))
    order = list(sized)
    for d in dims:  # each size-1 dim goes right before the first dim logically after it
        if view.shape[d] <= 1:
            later = [i for i, x in enumerate(order) if x > d]
            order.insert(later[0] if later else len(order), d)
    return tuple(order)


def _pages_strided(view: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether a block's page has gaps (other layers' bytes) or blocks are spaced apart."""
    expected = 1
    for d in reversed(order):
        if view.shape[d] > 1 and view.stride(d) != expected:
            return True
        expected *= view.shape[d]
    return False


def check_readable_order(
    backend: type[AttentionBackend],
    order: Sequence[int],
    platform: str | None,
    *,
    what: str = "the layout",
    strided_pages: bool | None = None,
) -> None:
    """Refuse an order ``backend`` does not read, naming what it reads.

    ``order`` is a stride order of one layer's ``(B, 2, N, H, D)`` (5 ints) or of ``(L, B, 2,
    N, H, D)`` (6 ints). Its order within a layer must be one of
    :meth:`AttentionBackend.readable_stride_orders`; a layout whose pages are strided by other
    layers (the layer dim not outermost, or ``strided_pages``) needs a backend that opts in to
    cross-layer caches on ``platform``.
    """
    order = tuple(int(d) for d in order)
    if len(order) == 6:
        per_layer = tuple(d - 1 for d in order if d != 0)
        strided = order[0] != 0
    else:
        per_layer, strided = order, False
    strided = strided or bool(strided_pages)
    name = backend.get_name()
    readable = backend.readable_stride_orders()
    if per_layer not in readable:
        named = ", ".join(f"{o} ({vllm_layout_name(o) or _kvcore_name(o)})" for o in readable)
        raise ValueError(
            f"{what}: {name} does not read the per-layer order {per_layer} "
            f"({vllm_layout_name(per_layer) or _kvcore_name(per_layer)}); it reads {named}, "
            f"i.e. the vLLM layouts {', '.join(backend.supported_vllm_layouts()) or 'none'}. "
            "Allocate in one of those, or choose a backend that reads this order")
    if strided and not backend.supports_cross_layer(platform):
        raise ValueError(
            f"{what}: a layer's pages are strided by other layers' bytes (a cross-layer "
            f"layout), but {backend.cross_layer_note(platform or '') or name + ' refuses it'}; "
            f"use a layer-outermost layout ({', '.join(backend.supported_vllm_layouts(platform))})")


def _layout_order(layout: str | Sequence[int]) -> tuple[int, ...]:
    if isinstance(layout, str):
        return vllm_layout_order(layout)
    order = tuple(layout)
    if len(order) == 5:
        order = (0, *(int(d) + 1 for d in order))
    if len(order) != 6 or sorted(order) != list(range(6)):
        raise ValueError(f"layout={layout!r} must be a vLLM layout name "
                         f"({', '.join(VLLM_LAYOUTS)}) or a permutation of range(6) (of L, B, "
                         "2, N, H, D) or range(5) (one layer's B, 2, N, H, D)")
    return order


def _layout_label(order: tuple[int, ...]) -> str:
    return vllm_layout_name(order) or str(order)


def _kvcore_name(order: tuple[int, ...]) -> str:
    return ",".join(KV_DIM_NAMES[d] for d in order)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

