"""The KV-cache layout contract: logical shape, stride order, physical shape, cross-layer.

Dim names used throughout (and in :meth:`KVCacheLayout.__str__`):

====  ================================================
``L``  layer (only in multi-layer allocations)
``B``  block
``2``  K/V split (K/V backends)
``N``  token within a block (``block_size``)
``H``  KV head
``D``  head dim (MLA: the latent ``kv_lora_rank + rope_dim``)
====  ================================================

A layout is *blocks-first* when, inside one layer, the block dim is outermost in memory: one
block of one layer is then one contiguous run of ``page_size_bytes`` bytes, which is what
connectors move. It is *cross-layer* when the block dim is outermost across layers too: all
layers of one block form one contiguous run.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.backend import AttentionBackend
from kvcore.dtypes import parse_dtype

__all__ = ["KVCacheLayout", "LayoutMismatchError", "KV_DIM_NAMES", "MLA_DIM_NAMES"]

KV_DIM_NAMES = ("B", "2", "N", "H", "D")
LEGACY_KV_DIM_NAMES = ("2", "B", "N", "H", "D")
MLA_DIM_NAMES = ("B", "N", "D")
_LAYOUT_VERSION = 1
# Bounds from_dict checks untrusted layouts against: a layer's cache has 3 (MLA) or 5 dims,
# plus the layer dim.
_MIN_DIMS, _MAX_DIMS = 3, 6
_MAX_DIM_SIZE = 2**48
_MAX_ELEMENTS = 2**62


class LayoutMismatchError(ValueError):
    """Two KV-cache layouts that must agree (e.g. two peers of a transfer) differ."""


def _check_permutation(order: tuple[int, ...], ndim: int) -> None:
    if len(order) != ndim or sorted(order) != list(range(ndim)):
        raise ValueError(
            f"stride_order={order} is not a permutation of range({ndim}) "
            f"(one entry per logical dim, each dim once)"
        )


@dataclass(frozen=True)
class KVCacheLayout:
    """How one allocation of KV cache is shaped and laid out in memory.

    Attributes:
        logical_shape: the shape kernels see, blocks-first (``(B, 2, N, H, D)``; MLA
            ``(B, N, D)``); with a leading ``L`` dim for a multi-layer allocation.
        stride_order: permutation of the logical dims giving the physical order, outermost
            first.
        dim_names: one name per logical dim (see the module docstring).
        dtype: storage dtype (fp8 for an fp8 cache).
    """

    logical_shape: tuple[int, ...]
    stride_order: tuple[int, ...]
    dim_names: tuple[str, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "logical_shape", tuple(int(s) for s in self.logical_shape))
        object.__setattr__(self, "stride_order", tuple(int(s) for s in self.stride_order))
        object.__setattr__(self, "dim_names", tuple(str(n) for n in self.dim_names))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        ndim = len(self.logical_shape)
        if len(self.dim_names) != ndim:
            raise ValueError(
                f"dim_names={self.dim_names} has {len(self.dim_names)} names for a "
                f"{ndim}-dim logical_shape {self.logical_shape}"
            )
        if len(set(self.dim_names)) != ndim or "B" not in self.dim_names:
            raise ValueError(f"dim_names={self.dim_names} must be distinct and include 'B'")
        if any(s < 0 for s in self.logical_shape):
            raise ValueError(f"logical_shape={self.logical_shape} has a negative size")
        _check_permutation(self.stride_order, ndim)
        layer_names = self.layer_dim_names
        if "L" in layer_names:
            raise ValueError(f"dim_names={self.dim_names}: 'L' may only be the leading dim")
        if layer_names[0] != "B" and layer_names != LEGACY_KV_DIM_NAMES:
            raise ValueError(
                f"logical shape {self.logical_shape} with dims {','.join(self.dim_names)} is "
                "not blocks-first: dim 0 of a layer's cache must be the block dim "
                "(the only exception is the legacy (2, num_blocks, ...) K/V-split shape)"
            )

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_backend(
        cls,
        backend: type[AttentionBackend],
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        num_layers: int | None = None,
        cross_layer: bool = False,
        cache_dtype_str: str = "auto",
    ) -> KVCacheLayout:
        """The layout a backend declares for these sizes.

        ``num_layers=None`` describes one layer. With ``num_layers`` the layout gains a
        leading ``L`` dim; ``cross_layer=True`` uses the backend's cross-layer stride order
        (a ``ValueError`` naming the backend if it does not opt in), ``False`` keeps layers
        outermost.
        """
        name = backend.get_name()
        shape = tuple(
            backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                       cache_dtype_str)
        )
        names = _infer_dim_names(name, shape, num_blocks, block_size, num_kv_heads, head_size)
        if names[0] != "B" and backend.supports_kv_connector():
            raise ValueError(
                f"{name}.get_kv_cache_shape returned {shape}, whose dim 0 is not the block dim, "
                "but supports_kv_connector() is True; a backend on a legacy layout must "
                "return False there (connectors index dim 0)"
            )
        if num_layers is None:
            if cross_layer:
                raise ValueError("cross_layer=True needs num_layers")
            order = tuple(backend.get_kv_cache_stride_order(False))
            _check_backend_order(name, order, len(shape))
            return cls(shape, order, names, dtype)
        if num_layers <= 0:
            raise ValueError(f"num_layers={num_layers} must be >= 1")
        if cross_layer:
            order = tuple(backend.get_kv_cache_stride_order(True))
            _check_backend_order(name, order, len(shape) + 1)
            if order[0] != 1:
                raise ValueError(
                    f"cross_layer=True but backend {name} does not opt in to cross-layer KV "
                    f"caches (its get_kv_cache_stride_order(True) = {order} keeps layers "
                    "outermost); use cross_layer=False or 'auto'"
                )
        else:
            per_layer = tuple(backend.get_kv_cache_stride_order(False))
            _check_backend_order(name, per_layer, len(shape))
            order = (0, *(d + 1 for d in per_layer))
        return cls((num_layers, *shape), order, ("L", *names), dtype)

    # -- derived properties -----------------------------------------------------------------

    @property
    def has_layer_dim(self) -> bool:
        return self.dim_names[0] == "L"

    @property
    def num_layers(self) -> int:
        return self.logical_shape[0] if self.has_layer_dim else 1

    @property
    def layer_dim_names(self) -> tuple[str, ...]:
        """Dim names of one layer's logical cache."""
        return self.dim_names[1:] if self.has_layer_dim else self.dim_names

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Logical shape of one layer's cache (what ``KVCaches.layers[i]`` has)."""
        return self.logical_shape[1:] if self.has_layer_dim else self.logical_shape

    @property
    def block_dim(self) -> int:
        """Index of the block dim in :attr:`logical_shape`."""
        return self.dim_names.index("B")

    @property
    def num_blocks(self) -> int:
        return self.logical_shape[self.block_dim]

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """The shape as it lies in memory: ``logical_shape`` permuted by ``stride_order``."""
        return tuple(self.logical_shape[d] for d in self.stride_order)

    @property
    def physical_dim_names(self) -> tuple[str, ...]:
        return tuple(self.dim_names[d] for d in self.stride_order)

    @property
    def is_cross_layer(self) -> bool:
        """All layers of a block are one contiguous run (block dim outermost, layer dim next)."""
        return self.has_layer_dim and self.physical_dim_names[0] == "B"

    @property
    def is_blocks_first(self) -> bool:
        """Within a layer, each block is one contiguous run of :attr:`page_size_bytes`."""
        names = self.physical_dim_names
        b = names.index("B")
        if names[:b] not in ((), ("L",)):
            return False
        # A layer dim after the block dim must follow it directly, or it splits each page.
        return "L" not in names[b + 1:] or names[b + 1] == "L"

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        per_block = math.prod(
            s for s, n in zip(self.layer_shape, self.layer_dim_names, strict=True) if n != "B"
        )
        return per_block * self.itemsize

    @property
    def total_bytes(self) -> int:
        return math.prod(self.logical_shape) * self.itemsize

    def logical_strides(self) -> tuple[int, ...]:
        """Element strides of the logical view of a contiguous physical allocation."""
        physical_strides = [0] * len(self.physical_shape)
        step = 1
        for i in range(len(self.physical_shape) - 1, -1, -1):
            physical_strides[i] = step
            step *= self.physical_shape[i]
        strides = [0] * len(self.logical_shape)
        for phys_pos, logical_dim in enumerate(self.stride_order):
            strides[logical_dim] = physical_strides[phys_pos]
        return tuple(strides)

    def layer_span(self) -> int:
        """Elements from the first to the last element of one layer's view, inclusive.

        What a kernel with 32-bit offsets must be able to address: with a cross-layer layout
        a layer's view spans (almost) every layer.
        """
        strides = self.logical_strides()
        shape, strides = ((self.logical_shape[1:], strides[1:]) if self.has_layer_dim
                          else (self.logical_shape, strides))
        return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))

    def inverse_stride_order(self) -> tuple[int, ...]:
        """Permutation that turns the physical tensor back into the logical view."""
        inverse = [0] * len(self.stride_order)
        for phys_pos, logical_dim in enumerate(self.stride_order):
            inverse[logical_dim] = phys_pos
        return tuple(inverse)

    # -- presentation and exchange ------------------------------------------------------------

    def __str__(self) -> str:
        """Physical dim names, outermost first, e.g. ``B,L,2,N,H,D`` for a cross-layer cache."""
        return ",".join(self.physical_dim_names)

    def describe(self) -> str:
        """One line with names and sizes in physical order, dtype and page size."""
        dims = " x ".join(
            f"{n}={s}" for n, s in zip(self.physical_dim_names, self.physical_shape, strict=True)
        )
        kind = "cross-layer" if self.is_cross_layer else (
            "blocks-first" if self.is_blocks_first else "not blocks-first"
        )
        return (
            f"{dims} ({str(self.dtype).removeprefix('torch.')}, {kind}, "
            f"page {self.page_size_bytes} B)"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for two processes to compare layouts before exchanging bytes."""
        return {
            "version": _LAYOUT_VERSION,
            "logical_shape": list(self.logical_shape),
            "stride_order": list(self.stride_order),
            "dim_names": list(self.dim_names),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def from_dict(cls, data: Any) -> KVCacheLayout:
        """The layout that :meth:`to_dict` wrote, read defensively: ``data`` may come from
        another process or a shared file. Every field is type- and range-checked (``version``
        this kvcore's; ``logical_shape`` 3 to 6 ints in ``[0, 2**48]`` whose product stays
        below ``2**62``; ``stride_order`` as many ints; ``dim_names`` as many short strings;
        ``dtype`` a dtype name) before anything is computed from it.

        Raises:
            ValueError: for anything that is not such a layout (a non-dict, a missing or
                mistyped field, a value out of range, JSON ``Infinity`` or deep nesting where an
                int belongs), naming the field. No other exception type escapes.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a layout must be a dict from KVCacheLayout.to_dict(), got "
                             f"{type(data).__name__}")
        version = data.get("version")
        if type(version) is not int or version != _LAYOUT_VERSION:
            raise ValueError(
                f"layout version {_brief(version)} is not supported (this kvcore reads version "
                f"{_LAYOUT_VERSION}); upgrade kvcore on both sides"
            )
        missing = {"logical_shape", "stride_order", "dim_names", "dtype"} - set(data)
        if missing:
            raise ValueError(f"layout dict lacks {sorted(missing)}")
        shape = _int_list(data["logical_shape"], "logical_shape", 0, _MAX_DIM_SIZE)
        if not _MIN_DIMS <= len(shape) <= _MAX_DIMS:
            raise ValueError(f"layout logical_shape has {len(shape)} dims, expected "
                             f"{_MIN_DIMS} to {_MAX_DIMS}")
        if math.prod(shape) >= _MAX_ELEMENTS:
            raise ValueError(f"layout logical_shape {tuple(shape)} holds 2**62 elements or more")
        order = _int_list(data["stride_order"], "stride_order", 0, len(shape) - 1)
        names = data["dim_names"]
        if (not isinstance(names, list) or len(names) != len(shape)
                or not all(type(n) is str and 0 < len(n) <= 8 for n in names)):
            raise ValueError(f"layout dim_names must be a list of {len(shape)} short strings, "
                             f"got {_brief(names)}")
        dtype = data["dtype"]
        if type(dtype) is not str or len(dtype) > 32:
            raise ValueError(f"layout dtype must be a dtype name, got {_brief(dtype)}")
        return cls(tuple(shape), tuple(order), tuple(names), parse_dtype(dtype))

    def differences(self, other: KVCacheLayout, *, ignore_num_blocks: bool = False) -> list[str]:
        """What differs from ``other``, one sentence each; empty when the layouts agree.

        ``ignore_num_blocks`` compares everything but the number of blocks, as two peers of a
        transfer may hold pools of different sizes but must agree on the page layout.
        """
        diffs = []
        if self.dim_names != other.dim_names:
            diffs.append(f"dims {','.join(self.dim_names)} vs {','.join(other.dim_names)}")
        elif self.logical_shape != other.logical_shape:
            for name, a, b in zip(self.dim_names, self.logical_shape, other.logical_shape,
                                  strict=True):
                if a != b and not (ignore_num_blocks and name == "B"):
                    diffs.append(f"{name} size {a} vs {b}")
        if str(self) != str(other):
            diffs.append(f"physical order {self} vs {other}")
        if self.dtype != other.dtype:
            diffs.append(f"dtype {self.dtype} vs {other.dtype}")
        return diffs

    def check_compatible(
        self, other: KVCacheLayout, *, ignore_num_blocks: bool = False,
        names: tuple[str, str] = ("local", "remote"),
    ) -> None:
        """Raise :class:`LayoutMismatchError` listing every difference from ``other``."""
        diffs = self.differences(other, ignore_num_blocks=ignore_num_blocks)
        if diffs:
            raise LayoutMismatchError(
                f"KV cache layouts differ ({names[0]} {self.describe()}; {names[1]} "
                f"{other.describe()}): " + "; ".join(diffs)
            )


def _brief(value: Any) -> str:
    """A short repr of untrusted data: bounded in length and depth (never recurses far)."""
    return reprlib.repr(value)


def _int_list(value: Any, field: str, low: int, high: int) -> list[int]:
    """``value`` as a list of ints in ``[low, high]`` (bools, floats and nesting refused)."""
    if (not isinstance(value, list) or len(value) > _MAX_DIMS
            or not all(type(v) is int and low <= v <= high for v in value)):
        raise ValueError(f"layout {field} must be a list of at most {_MAX_DIMS} ints in "
                         f"[{low}, {high}], got {_brief(value)}")
    return value


def _check_backend_order(name: str, order: tuple[int, ...], ndim: int) -> None:
    try:
        _check_permutation(order, ndim)
    except ValueError as exc:
        raise ValueError(f"backend {name}: get_kv_cache_stride_order returned {exc}") from None


def _infer_dim_names(
    name: str, shape: tuple[int, ...], num_blocks: int, block_size: int, num_kv_heads: int,
    head_size: int,
) -> tuple[str, ...]:
    candidates = (
        (KV_DIM_NAMES, (num_blocks, 2, block_size, num_kv_heads, head_size)),
        (MLA_DIM_NAMES, (num_blocks, block_size, head_size)),
        (LEGACY_KV_DIM_NAMES, (2, num_blocks, block_size, num_kv_heads, head_size)),
    )
    for names, expected in candidates:
        if shape == expected:
            return names
    raise ValueError(
        f"{name}.get_kv_cache_shape returned {shape}, which is none of the known layouts for "
        f"num_blocks={num_blocks}, block_size={block_size}, num_kv_heads={num_kv_heads}, "
        f"head_size={head_size}: (num_blocks, 2, block_size, num_kv_heads, head_size) or, for "
        "MLA, (num_blocks, block_size, head_size)"
    )
