"""``kvcore layout --convert SRC DST``: the layout conversion plan between two backends' caches.

A side is ``BACKEND[:key=value,...]`` with keys ``block_size``, ``cross_layer`` (``yes`` or
``no``), ``tp`` (``DEGREE/RANK``) and ``dtype``; sizes not given come from the command's
options (``--block-size``, ``--num-kv-heads`` over all ranks, ``--head-size``, ``--dtype``,
``--num-layers``, ``--num-blocks``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import kvcore
from kvcore.connectors import ConversionPlan, TPRank, heads_of_rank, plan_conversion

__all__ = ["Side", "conversion_plan", "parse_side"]

_KEYS = ("block_size", "cross_layer", "tp", "dtype")
_FP8_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class Side:
    """One side of ``--convert``, as typed."""

    backend: str
    block_size: int | None = None
    cross_layer: bool = False
    tp: TPRank = field(default_factory=TPRank)
    dtype: str | None = None


def parse_side(text: str, flag: str) -> Side:
    """``BACKEND[:key=value,...]``; a ``ValueError`` naming ``flag`` and the valid keys."""
    name, _, options = text.partition(":")
    values: dict = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in _KEYS:
            raise ValueError(f"{flag} {text!r}: {item!r} is not key=value with a key of "
                             f"{', '.join(_KEYS)} (e.g. FLASHINFER:block_size=64,tp=2/1)")
        try:
            if key == "block_size":
                values[key] = int(value)
                if values[key] < 1:
                    raise ValueError
            elif key == "cross_layer":
                values[key] = {"yes": True, "no": False}[value]
            elif key == "tp":
                degree, _, rank = value.partition("/")
                values[key] = TPRank(int(degree), int(rank or 0))
            else:
                values[key] = value
        except (KeyError, ValueError, TypeError) as exc:
            why = f": {exc}" if str(exc) else ""
            raise ValueError(f"{flag} {text!r}: {key}={value!r} is not valid (block_size a "
                             "positive int, cross_layer yes or no, tp DEGREE/RANK with RANK "
                             f"below DEGREE){why}") from None
    return Side(name, **values)


def _layout(side: Side, args: argparse.Namespace, num_kv_heads: int) -> kvcore.KVCacheLayout:
    backend = kvcore.resolve_backend(side.backend)
    dtype = side.dtype or args.dtype
    heads = 1 if backend.IS_MLA else len(heads_of_rank(num_kv_heads, side.tp))
    return kvcore.KVCacheLayout.from_backend(
        backend, num_blocks=args.num_blocks, block_size=side.block_size or args.block_size,
        num_kv_heads=heads, head_size=args.head_size or (576 if backend.IS_MLA else 128),
        dtype=kvcore.parse_dtype(_FP8_ALIASES.get(dtype, dtype)), num_layers=args.num_layers,
        cross_layer=side.cross_layer)


def conversion_plan(args: argparse.Namespace) -> ConversionPlan:
    """The plan ``--convert SRC DST`` asks for (any fp8 change opted in: it is printed)."""
    src, dst = (parse_side(text, "--convert") for text in args.convert)
    num_kv_heads = args.num_kv_heads or 2
    return plan_conversion(_layout(src, args, num_kv_heads), _layout(dst, args, num_kv_heads),
                           src_tp=src.tp, dst_tp=dst.tp, num_kv_heads=num_kv_heads,
                           quantize=True, dequantize=True)
