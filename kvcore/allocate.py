"""Allocate a model's KV caches in a backend's physical layout.

One storage holds every layer. It is allocated in *physical* order (``layout.physical_shape``)
and permuted back to the logical, blocks-first view that kernels see, so a backend's stride
order decides what is contiguous. With a cross-layer layout all layers of one block are one
contiguous run, and a connector moves a block of the whole model with one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvcore.backend import AttentionBackend, format_supported, is_supported
from kvcore.dtypes import cache_torch_dtype, parse_dtype
from kvcore.layout import KVCacheLayout
from kvcore.registry import resolve_backend

__all__ = ["KVCaches", "allocate_kv_caches"]


@dataclass
class KVCaches:
    """A model's KV caches: per-layer logical views over one physical storage.

    Attributes:
        layers: one logical view per layer, shape ``layout.layer_shape`` (blocks-first,
            e.g. ``(num_blocks, 2, block_size, num_kv_heads, head_size)``), strides from the
            physical layout. Pass ``layers[i]`` to the backend's ``forward``.
        storage: the physical tensor, shape ``layout.physical_shape``, contiguous.
        layout: the layout of ``storage``, with a leading ``L`` (layer) dim.
        backend_name: the backend whose layout this is.
    """

    layers: list[torch.Tensor]
    storage: torch.Tensor
    layout: KVCacheLayout
    backend_name: str
    _kv_connector_note: str = field(default="", repr=False)

    @property
    def is_cross_layer(self) -> bool:
        return self.layout.is_cross_layer

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.layout.page_size_bytes

    def block_view(self, layer: int | None = None) -> torch.Tensor:
        """The blocks as raw bytes: what connectors copy.

        Returns a uint8 ``(num_blocks, page_bytes)`` view sharing memory with the cache:
        ``page_bytes = page_size_bytes`` for one ``layer``, or ``num_layers *
        page_size_bytes`` for all layers at once (``layer=None``, cross-layer caches only:
        each row is then one contiguous run).
        """
        raw = self.storage.view(torch.uint8)
        page = self.page_size_bytes
        if layer is None:
            if not self.is_cross_layer:
                raise ValueError(
                    f"layer=None asks for all layers per block, but this cache is not "
                    f"cross-layer (layout {self.layout}); pass layer=0..{self.num_layers - 1}"
                )
            return raw.view(self.num_blocks, self.num_layers * page)
        if not self.layout.is_blocks_first:
            raise ValueError(
                f"the KV cache of {self.backend_name} has layout {self.layout}, in which one "
                f"layer's block is not one contiguous byte run; "
                + ("move whole blocks with layer=None" if self.is_cross_layer else
                   self._kv_connector_note or "use a blocks-first backend")
            )
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int or None, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range (0..{self.num_layers - 1})")
        if self.is_cross_layer:
            return raw.view(self.num_blocks, self.num_layers, page)[:, layer]
        return raw.view(self.num_layers, self.num_blocks, page)[layer]

    def layer_block_views(self) -> list[torch.Tensor]:
        """:meth:`block_view` of every layer."""
        return [self.block_view(i) for i in range(self.num_layers)]


def allocate_kv_caches(
    backend: type[AttentionBackend] | str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype | str,
    device: torch.device | str,
    cross_layer: bool | Literal["auto"] = "auto",
    kv_cache_dtype: str = "auto",
    prefer_cross_layer: bool | None = None,
    platform: str | None = None,
) -> KVCaches:
    """Allocate ``num_layers`` KV caches in ``backend``'s layout, zero-filled.

    Args:
        backend: a backend class or its registry name.
        num_layers, num_blocks, block_size, num_kv_heads, head_size: sizes (MLA backends
            take ``num_kv_heads=1`` and the latent size as ``head_size``).
        dtype: the model dtype; the storage dtype follows ``kv_cache_dtype``.
        device: where to allocate.
        cross_layer: ``True`` for a cross-layer allocation (the backend must opt in through
            ``get_kv_cache_stride_order(True)``), ``False`` for layers outermost, ``"auto"`` for
            cross-layer when the backend opts in and ``prefer_cross_layer`` is not ``False``.
        kv_cache_dtype: ``"auto"`` (model dtype) or an fp8 name.
        prefer_cross_layer: the KV connector's preference
            (``connector_cls.prefer_cross_layer_blocks``); only consulted by ``"auto"``.
        platform: the platform name the cache is for (default: from ``device``: ``cpu``,
            or ``cuda``/``rocm`` by the torch build). On a platform the backend runs on but
            did not verify cross-layer on (:attr:`AttentionBackend.CROSS_LAYER_PLATFORMS`),
            ``"auto"`` allocates per layer and ``True`` is refused.

    Raises:
        ValueError, TypeError: a size, dtype, head size or block size the backend does not
            declare, or a cross-layer request the backend cannot honour here.
    """
    backend = _backend_class(backend)
    for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if cross_layer not in (True, False, "auto"):
        raise ValueError(f"cross_layer={cross_layer!r} must be True, False or 'auto'")
    model_dtype = parse_dtype(dtype)
    storage_dtype = cache_torch_dtype(kv_cache_dtype, model_dtype)
    _check_declared(backend, model_dtype, kv_cache_dtype, block_size, head_size)
    device = torch.device(device)
    if platform is None:
        platform = _platform_of(device)
    # Cross-layer where the backend opts in, except on one of its platforms where the opt-in
    # was not verified (a platform it does not run on, e.g. CPU under TRITON_INTERPRET, keeps
    # the backend's declared order).
    cross_ok = backend.supports_cross_layer() and (
        platform not in backend.PLATFORMS or backend.supports_cross_layer(platform))
    if cross_layer == "auto":
        use_cross_layer = cross_ok and prefer_cross_layer is not False
    else:
        if cross_layer and backend.supports_cross_layer() and not cross_ok:
            raise ValueError(f"cross_layer=True: {backend.cross_layer_note(platform)}; use "
                             "cross_layer=False or 'auto'")
        use_cross_layer = cross_layer
    layout = KVCacheLayout.from_backend(
        backend, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=storage_dtype, num_layers=num_layers,
        cross_layer=use_cross_layer, cache_dtype_str=kv_cache_dtype,
    )
    _check_span(backend, layout)
    storage = torch.zeros(layout.physical_shape, dtype=storage_dtype, device=device)
    logical = storage.permute(layout.inverse_stride_order())
    note = "" if backend.supports_kv_connector() else backend.kv_connector_unsupported_reason()
    return KVCaches(
        layers=list(logical.unbind(0)),
        storage=storage,
        layout=layout,
        backend_name=backend.get_name(),
        _kv_connector_note=note,
    )


def _backend_class(backend: type[AttentionBackend] | str) -> type[AttentionBackend]:
    """A backend class, or the class a registered name resolves to."""
    if isinstance(backend, str):
        backend = resolve_backend(backend)
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(
            f"backend must be an AttentionBackend subclass or a registered name, got {backend!r}"
        )
    return backend


def _check_span(backend: type[AttentionBackend], layout: KVCacheLayout) -> None:
    """Refuse a layout one layer's view of which spans more than ``MAX_KV_CACHE_SPAN``."""
    limit = backend.MAX_KV_CACHE_SPAN
    if limit is not None and layout.layer_span() > limit:
        # The span grows by a fixed step per block, so the largest fit is one division.
        one_block = _span_for(layout, 1)
        fits = max(0, (limit - one_block) // (_span_for(layout, 2) - one_block) + 1)
        raise ValueError(
            f"num_blocks={layout.num_blocks}: one layer's view of this {layout} cache would "
            f"span {layout.layer_span()} elements, over {backend.get_name()}'s "
            f"MAX_KV_CACHE_SPAN of {limit}; allocate at most {fits} blocks"
            + (" (or cross_layer=False)" if layout.is_cross_layer else "")
            + " or use another backend"
        )


def _platform_of(device: torch.device) -> str:
    """The platform name of a torch device (``cuda`` devices are ROCm's on a HIP build)."""
    if device.type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device.type


def _check_declared(backend: type[AttentionBackend], dtype: torch.dtype, kv_cache_dtype: str,
                    block_size: int, head_size: int) -> None:
    """The backend's declared dtypes, head sizes and block sizes (what selection checks)."""
    name = backend.get_name()
    if dtype not in backend.SUPPORTED_DTYPES:
        raise TypeError(f"dtype={str(dtype).removeprefix('torch.')}: {name} supports "
                        f"{format_supported(backend.SUPPORTED_DTYPES)}")
    if kv_cache_dtype not in backend.SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: {name} supports "
                         f"{format_supported(backend.SUPPORTED_KV_CACHE_DTYPES)}")
    if not is_supported(head_size, backend.SUPPORTED_HEAD_SIZES):
        raise ValueError(f"head_size={head_size}: {name} supports "
                         f"{format_supported(backend.SUPPORTED_HEAD_SIZES)}")
    if not is_supported(block_size, backend.SUPPORTED_BLOCK_SIZES):
        raise ValueError(f"block_size={block_size}: {name} supports "
                         f"{format_supported(backend.SUPPORTED_BLOCK_SIZES)}")


def _span_for(layout: KVCacheLayout, num_blocks: int) -> int:
    """:meth:`KVCacheLayout.layer_span` of the same layout with ``num_blocks`` blocks."""
    shape = list(layout.logical_shape)
    shape[layout.block_dim] = num_blocks
    return KVCacheLayout(tuple(shape), layout.stride_order, layout.dim_names,
                         layout.dtype).layer_span()
