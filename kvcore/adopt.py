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
- :func:`attention_metadata_from_engine` makes a step's metadata from the engine's device
  tensors plus the host facts it has, and reads nothing back from the device.

Both check, before anything runs, everything the kernels rely on and raise a ``ValueError`` or
``TypeError`` naming the argument, the value, what is supported and the fix: sizes and dtypes
the backend declares, the buffer's device, dtype, size and alignment, and that the physical
order is one the backend reads (:meth:`AttentionBackend.readable_stride_orders`; pages strided
by other layers only for a backend that opts in to cross-layer caches).
"""

from __future__ import annotations

import itertools
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
from kvcore.metadata import AttentionMetadata
from kvcore.step_facts import StepFacts, mark_step_checked

__all__ = ["adopt_kv_caches", "attention_metadata_from_engine", "check_readable_order",
           "from_vllm_layer_view", "physical_order"]

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
    layer's vLLM cache view ``[num_blocks, num_kv_heads, block_size, C]`` (``C = head_size +
    head_size_v``: K then V of each head and token), sharing its memory.

    vLLM cuts that view from its buffer with the strides of the model's layout; the result
    keeps them, so the backend's kernels read vLLM's memory in place. Host facts only (shape,
    strides, dtype): cheap enough to call per layer.

    ``head_size`` is the layer's K head size. vLLM's V head size ``head_size_v`` must equal
    it: kvcore's cache holds K and V of one head size in one tensor (the ``2`` dim of ``(B, 2,
    N, H, D)``), and every backend's kernels read V with K's head size. The last dim says it:
    ``C`` other than ``2 * head_size`` is refused, naming ``head_size_v = C - head_size``
    where that is what differs, so a model whose V heads differ from its K heads is never
    read with the wrong width.

    Raises:
        ValueError: not 4 dims; ``C`` is not ``2 * head_size``; ``C`` not contiguous; an
            order the backend does not read.
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
            f"of one head size side by side (C = 2 * head_size = {2 * head_size}); "
            + (_head_size_v_refusal(head_size, content - head_size)
               if content > head_size else "pass the layer's K head size"))
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


def _head_size_v_refusal(head_size: int, head_size_v: int) -> str:
    """Why a layer whose V head size differs from its K head size cannot be adopted."""
    return (f"head_size_v={head_size_v} differs from head_size={head_size}: kvcore's KV caches "
            "hold K and V of one head size ((num_blocks, 2, block_size, num_kv_heads, "
            "head_size)) and its backends read V with K's head size, so a model with another V "
            "head size is not supported; serve it with the engine's own attention backend")


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



def attention_metadata_from_engine(
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
    num_blocks: int,
    seq_lens_cpu: torch.Tensor | None = None,
    causal: bool = True,
    check_on_device: bool = False,
) -> AttentionMetadata:
    """A step's :class:`~kvcore.AttentionMetadata` from the engine's own device tensors and
    the host facts it already has, without reading the device.

    Engines keep a step's metadata on the device (vLLM's ``CommonAttentionMetadata``) and a
    few facts on the host: ``query_start_loc_cpu``, the maxima, sometimes ``seq_lens_cpu``.
    Rows of ``slot_mapping`` beyond ``query_start_loc_cpu[-1]`` are padding (slot ``-1``,
    never written; their output rows are left alone).

    Value-check policy: what the host facts state is checked here, on the host (shapes,
    dtypes, devices; ``query_start_loc_cpu`` starts at 0, never decreases, covers at most the
    rows; ``max_query_len`` is its largest query; ``seq_lens_cpu``, when given, covers each
    query and stays within ``max_seq_len``). What only the device holds (block ids, slots) is
    the engine's word: the tensors are marked as checked with the bounds the engine vouches
    for (ids below ``num_blocks``, requests within ``max_seq_len``), so a builder's ``build``
    and every layer's ops read nothing back. ``check_on_device=True`` (an engine's debug mode)
    leaves them unmarked: the builder then reads them once per step and checks every value.

    Raises:
        ValueError, TypeError: a host fact that contradicts the tensors' shapes or itself,
            a per-request ``causal`` tensor, a tensor of the wrong dtype or device.
    """
    tensors = {"query_start_loc": (query_start_loc, 1, (torch.int32,)),
               "seq_lens": (seq_lens, 1, (torch.int32,)),
               "block_table": (block_table, 2, (torch.int32,)),
               "slot_mapping": (slot_mapping, 1, (torch.int64, torch.int32))}
    device = query_start_loc.device if isinstance(query_start_loc, torch.Tensor) else None
    for arg, (t, ndim, dtypes) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim or t.dtype not in dtypes:
            raise TypeError(f"{arg} has shape {tuple(t.shape)} and dtype {_name(t.dtype)}; "
                            f"expected {ndim} dims of {' or '.join(map(_name, dtypes))}")
        if t.device != device:
            raise ValueError(f"{arg} is on {t.device} but query_start_loc is on {device}; the "
                             "step's tensors must share a device")
    if isinstance(causal, torch.Tensor):
        raise ValueError("causal is a tensor (per-request causal flags); kvcore's backends "
                         "take one causal flag per step: split the step by causality")
    for arg, value in (("block_size", block_size), ("num_blocks", num_blocks),
                       ("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{arg}={value!r} must be an int >= 0")
    num_seqs = seq_lens.shape[0]
    if not isinstance(query_start_loc_cpu, torch.Tensor) or query_start_loc_cpu.is_cuda:
        raise TypeError("query_start_loc_cpu must be a host (CPU) tensor, the engine's copy of "
                        "query_start_loc")
    starts = query_start_loc_cpu.tolist()
    if len(starts) != num_seqs + 1 or query_start_loc.shape[0] != num_seqs + 1 \
            or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens has {num_seqs} requests but query_start_loc_cpu has {len(starts)} "
            f"entries, query_start_loc {query_start_loc.shape[0]} and block_table "
            f"{block_table.shape[0]} rows; pass the step's requests only (num_reqs + 1 "
            "starts)")
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    rows = slot_mapping.shape[0]
    if starts[0] != 0 or min(q_lens, default=0) < 0 or starts[-1] > rows:
        raise ValueError(f"query_start_loc_cpu={starts[:8]}... must start at 0, never "
                         f"decrease and end at most at the {rows} rows of slot_mapping")
    if max(q_lens, default=0) != max_query_len:
        raise ValueError(f"max_query_len={max_query_len} but query_start_loc_cpu's longest "
                         f"query has {max(q_lens, default=0)} tokens")
    if seq_lens_cpu is not None:
        lens = seq_lens_cpu.tolist()
        short = [i for i, (s, q) in enumerate(zip(lens, q_lens, strict=False)) if s < q]
        if len(lens) != num_seqs or short or max(lens, default=0) > max_seq_len:
            raise ValueError(
                f"seq_lens_cpu={lens[:8]} must have {num_seqs} entries, each at least its "
                f"query length (requests {short[:4]} are shorter) and at most max_seq_len="
                f"{max_seq_len}")
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
        slot_mapping=slot_mapping, max_query_len=max_query_len, max_seq_len=max_seq_len,
        num_actual_tokens=starts[-1], causal=bool(causal),
        query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu)
    if not check_on_device and block_size > 0:
        facts = StepFacts(
            num_tokens=starts[-1], num_seqs=num_seqs, block_size=block_size,
            max_blocks_per_seq=min(-(-max_seq_len // block_size), block_table.shape[1]),
            max_block_id=num_blocks - 1, max_slot=num_blocks * block_size - 1)
        mark_step_checked(facts, query_start_loc=query_start_loc, seq_lens=seq_lens,
                          block_table=block_table, slot_mapping=slot_mapping)
    return metadata
