"""The gather kernel of a layout conversion: KV received in one cache layout, rearranged into
another in one launch.

A transfer is ``num_tokens`` tokens: token ``t`` lies at offset ``t % src_block_size`` of
source block ``src_ids[t // src_block_size]`` and goes to offset ``t % dst_block_size`` of
destination block ``dst_ids[t // dst_block_size]``, for every layer, K/V half and head pair
``(dst_head, src_head)``. Each side is one flat allocation addressed by element strides per
dim (:data:`Strides`), so any stride order, per-layer or cross-layer pool, block size
and head slice is one set of numbers; offsets are int64 (caches past 2**31 elements).
Tokens past ``num_tokens`` (a partial last block) and everything outside the destination
blocks are not written.

Each program moves a ``[tokens, heads, head_size]`` tile of one layer and K/V half
(:class:`GatherConfig`): the head's elements innermost and contiguous, so loads and stores
are 16-byte vectors, and, when the tile height divides both block sizes, the tile's tokens
lie in one source and one destination block, looked up once per program instead of per
token.

Bytes move as they are (as the widest integer words the strides allow), or, with ``scales``,
are converted: wider -> fp8 (``x * scale`` clamped to the fp8 range, ``scale`` being the
destination's inverse scale, :func:`kvcore.ops.fp8_inverse_scale`) or fp8 -> wider
(``x * scale``, the source's scale). The pure-torch reference is
:meth:`kvcore.connectors.ConversionPlan.apply` on the CPU (the plan calls this kernel for
caches on a GPU). This module imports triton; :mod:`kvcore.ops` imports it lazily
(:func:`kvcore.ops.triton_convert_blocks`).
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_utils import (
    fp8_format,
    is_interpreted,
    next_power_of_2,
    round_to_fp8_grid,
    to_output,
)

__all__ = ["DEFAULT_GATHER_CONFIG", "GatherConfig", "GatherLaunch", "Strides", "convert_blocks",
           "prepare_convert"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: A block-aligned tile is kept only this many tokens high or more (or the whole tile
#: height); lower ones look their blocks up per token instead.
_MIN_ALIGNED_TOKENS = 8


#: Element strides of one side's allocation, by logical dim: ``(block, layer, kv, token,
#: head, dim)``; 0 for a dim the side lacks (layer for one layer, kv and head for MLA).
Strides = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class GatherConfig:
    """How the gather kernel tiles a conversion.

    Attributes:
        tile_bytes: bytes (of the source) one program moves, about: ``[tokens, heads,
            head_size]`` with every power-of-two size rounded down to fit.
        max_heads: head pairs per program at most (1: one head per program).
        num_warps: warps per program.
        block_aligned: tiles whose height divides both block sizes look up one source and
            one destination block per program; ``False`` looks blocks up per token.
        evict_first: loads and stores hint the caches to evict these lines first (every
            byte is touched once).
    """

    tile_bytes: int = 32768
    max_heads: int = 64
    num_warps: int = 4
    block_aligned: bool = True
    evict_first: bool = False

    def __post_init__(self) -> None:
        for name in ("tile_bytes", "max_heads", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GatherConfig.{name}={value!r} must be an int >= 1")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GatherConfig.num_warps={self.num_warps} must be a power of two "
                             "(1, 2, 4, 8, 16)")


#: The tiling :func:`convert_blocks` uses unless given another.
DEFAULT_GATHER_CONFIG = GatherConfig()


@triton.jit
def _convert_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, heads_ptr, scales_ptr,
    num_tokens, src_bs, dst_bs, num_kv, num_pairs, head_units,
    s_block, s_layer, s_kv, s_token, s_head, s_dim,
    d_block, d_layer, d_kv, d_token, d_head, d_dim,
    SCALE: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    EXACT_FP8_ROUNDING: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ALIGNED: tl.constexpr, CONTIGUOUS: tl.constexpr, EVEN_H: tl.constexpr,
    EVEN_D: tl.constexpr, EVICTION: tl.constexpr,
):
    # Axis 0 tiles the tokens (neighbouring programs, neighbouring tokens); axis 1
    # enumerates (layer, kv, head tile). Token and tile indices fit int32 (num_tokens is
    # below 2**31); every memory offset is int64.
    head_tiles = tl.cdiv(num_pairs, BLOCK_H)
    lane = tl.program_id(1)
    h_tile = lane % head_tiles
    layer_kv = lane // head_tiles
    kv = (layer_kv % num_kv).to(tl.int64)
    layer = (layer_kv // num_kv).to(tl.int64)

    p = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    if EVEN_H:
        dst_head = tl.load(heads_ptr + 2 * p)
        src_head = tl.load(heads_ptr + 2 * p + 1)
    else:
        dst_head = tl.load(heads_ptr + 2 * p, mask=p < num_pairs, other=0)
        src_head = tl.load(heads_ptr + 2 * p + 1, mask=p < num_pairs, other=0)

    t0 = tl.program_id(0) * BLOCK_T
    i = tl.arange(0, BLOCK_T)
    t_ok = t0 + i < num_tokens
    if ALIGNED:
        # BLOCK_T divides both block sizes: the tile is rows of one block on each side.
        s_blk = tl.load(src_ids_ptr + t0 // src_bs)
        d_blk = tl.load(dst_ids_ptr + t0 // dst_bs)
        s_row = (s_blk * s_block + (t0 % src_bs).to(tl.int64) * s_token
                 + i.to(tl.int64) * s_token)
        d_row = (d_blk * d_block + (t0 % dst_bs).to(tl.int64) * d_token
                 + i.to(tl.int64) * d_token)
    else:
        t = t0 + i
        s_blk = tl.load(src_ids_ptr + t // src_bs, mask=t_ok, other=0)
        d_blk = tl.load(dst_ids_ptr + t // dst_bs, mask=t_ok, other=0)
        s_row = s_blk * s_block + (t % src_bs).to(tl.int64) * s_token
        d_row = d_blk * d_block + (t % dst_bs).to(tl.int64) * d_token
    s_row += layer * s_layer + kv * s_kv
    d_row += layer * d_layer + kv * d_kv

    d = tl.arange(0, BLOCK_D)
    if CONTIGUOUS:  # unit stride known at compile time: 16-byte vectors
        s_col = d
        d_col = d
    else:
        s_col = d.to(tl.int64) * s_dim
        d_col = d.to(tl.int64) * d_dim
    s_off = (s_row[:, None, None] + (src_head.to(tl.int64) * s_head)[None, :, None]
             + s_col[None, None, :])
    d_off = (d_row[:, None, None] + (dst_head.to(tl.int64) * d_head)[None, :, None]
             + d_col[None, None, :])
    mask = t_ok[:, None, None]
    if not EVEN_H:
        mask = mask & (p < num_pairs)[None, :, None]
    if not EVEN_D:
        mask = mask & (d < head_units)[None, None, :]
    x = tl.load(src_ptr + s_off, mask=mask, eviction_policy=EVICTION)
    if SCALE:
        y = x.to(tl.float32) * tl.load(scales_ptr + layer_kv)
        if QUANTIZE:
            y = tl.clamp(y, -FP8_MAX, FP8_MAX)
            if EXACT_FP8_ROUNDING:
                y = round_to_fp8_grid(y, MANTISSA_BITS, MIN_EXPONENT)
            x = y.to(dst_ptr.dtype.element_ty)
        else:
            x = to_output(y, dst_ptr.dtype.element_ty, INTERPRET)
    tl.store(dst_ptr + d_off, x, mask=mask, eviction_policy=EVICTION)


def _as_ids(ids: torch.Tensor | list[int], name: str) -> torch.Tensor:
    """Ids as an int64 CPU tensor (bounds are checked on the host)."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.int64)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor or a list of ints, got "
                        f"{ids.dtype} shape {tuple(ids.shape)}")
    return ids.to(device="cpu", dtype=torch.int64)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a small CPU tensor) on ``device``: on a GPU copied from pinned memory without
    blocking the host (the caching host allocator keeps the buffer until the copy is done)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _floor_power_of_2(n: int) -> int:
    """The largest power of two ``<= n`` (``n >= 1``)."""
    return 1 << (n.bit_length() - 1)


def _tile(config: GatherConfig, word_bytes: int, units: int, num_pairs: int, num_tokens: int,
          src_bs: int, dst_bs: int) -> tuple[int, int, int, bool]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D, ALIGNED)`` for ``config``: the whole head innermost,
    then as many head pairs, then tokens, as ``tile_bytes`` holds."""
    block_d = next_power_of_2(units)
    room = max(1, config.tile_bytes // word_bytes // block_d)
    block_h = min(next_power_of_2(num_pairs), _floor_power_of_2(config.max_heads),
                  _floor_power_of_2(room))
    block_t = min(_floor_power_of_2(max(1, room // block_h)), next_power_of_2(num_tokens))
    common = math.gcd(src_bs, dst_bs)
    align = common & -common  # the largest power of two dividing both block sizes
    aligned = config.block_aligned and align >= min(block_t, _MIN_ALIGNED_TOKENS)
    if aligned:
        block_t = min(block_t, align)
    return block_t, block_h, block_d, aligned


class GatherLaunch:
    """One prepared gather (:func:`prepare_convert`): the checked arguments on the device;
    calling it launches the kernel (no host work but the launch, so it can be captured in
    a CUDA graph) and returns the bytes written."""

    def __init__(self, grid: tuple[int, int], args: tuple, constants: dict, nbytes: int
                 ) -> None:
        self.grid, self.args, self.constants, self.nbytes = grid, args, constants, nbytes

    def __call__(self) -> int:
        _convert_blocks_kernel[self.grid](*self.args, **self.constants)
        return self.nbytes

    def __repr__(self) -> str:
        c = self.constants
        return (f"GatherLaunch(grid={self.grid}, tile=[{c['BLOCK_T']}, {c['BLOCK_H']}, "
                f"{c['BLOCK_D']}], aligned={c['ALIGNED']}, contiguous={c['CONTIGUOUS']}, "
                f"num_warps={c['num_warps']})")


def prepare_convert(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | list[int],
    dst_ids: torch.Tensor | list[int],
    *,
    num_tokens: int,
    src_block_size: int,
    dst_block_size: int,
    src_strides: Strides,
    dst_strides: Strides,
    num_layers: int,
    num_kv: int,
    head_pairs: torch.Tensor | Sequence[tuple[int, int]],
    head_size: int,
    scales: torch.Tensor | None = None,
    config: GatherConfig | None = None,
) -> GatherLaunch | None:
    """Check the arguments of a gather that rearranges ``num_tokens`` tokens from blocks
    ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst``, and put them on the device:
    the :class:`GatherLaunch` whose call is the one kernel launch (``None`` when there is
    nothing to move). :func:`convert_blocks` calls it at once.

    Args:
        src, dst: flat 1-D contiguous tensors on one device, each a whole allocation of its
            side's layout, in that side's storage dtype (``dst`` is written in place).
        src_ids, dst_ids: the blocks in token order, ``ceil(num_tokens / block_size)`` of
            each side (distinct on the destination; checked by the caller, e.g.
            :meth:`kvcore.connectors.ConversionPlan.prepare`).
        src_strides, dst_strides: element strides of each side, ``(block, layer, kv, token,
            head, dim)``.
        num_layers, num_kv: layers, and 2 (K and V) or 1 (MLA latents).
        head_pairs: ``(dst_head, src_head)`` local head pairs to move (``[(0, 0)]`` for MLA).
        head_size: elements per head (the ``D`` dim).
        scales: ``None`` (bytes as they are; both sides one dtype) or a float32 tensor of
            ``num_layers * num_kv`` multipliers, layer-major: the destination's inverse
            scales for wider -> fp8, the source's scales for fp8 -> wider.
        config: the kernel's tiling (default :data:`DEFAULT_GATHER_CONFIG`); every config
            writes the same bytes.

    Raises:
        TypeError, ValueError: tensors on different devices, not flat or contiguous, dtypes
            that do not fit ``scales``, ids that address past either tensor.
    """
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a flat contiguous tensor (the whole allocation), "
                             f"got {type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
    if src.device != dst.device:
        raise ValueError(f"src is on {src.device} and dst on {dst.device}: the gather runs on "
                         "the destination's device; move the received bytes there first")
    if scales is None and src.dtype.itemsize != dst.dtype.itemsize:
        raise TypeError(f"src ({src.dtype}) and dst ({dst.dtype}) differ in element size: pass "
                        "scales to convert the dtype, or views of one dtype")
    if scales is not None:
        if (src.dtype in _FP8) == (dst.dtype in _FP8):
            raise TypeError(f"scales convert wider <-> fp8; src is {src.dtype} and dst "
                            f"{dst.dtype}")
        if scales.numel() != num_layers * num_kv:
            raise ValueError(f"scales has {scales.numel()} values; expected num_layers * "
                             f"num_kv = {num_layers * num_kv}")
    if isinstance(head_pairs, torch.Tensor):
        head_pairs = head_pairs.reshape(-1, 2).tolist()
    pairs = tuple((int(d), int(s)) for d, s in head_pairs)
    if num_tokens <= 0 or not pairs:
        return None
    # What depends only on the shapes and the two allocations' addresses: worked out once
    # per combination (a connector's loads repeat it).
    setup = _setup(src.dtype, dst.dtype, _alignment(src), _alignment(dst), num_tokens,
                   src_block_size, dst_block_size, tuple(src_strides), tuple(dst_strides),
                   num_layers, num_kv, pairs, head_size, scales is not None,
                   config or DEFAULT_GATHER_CONFIG)
    need_s, need_d = setup.need
    host, bounds = _ids_on_host(src_ids, dst_ids, need_s, need_d, setup.pairs_flat,
                                num_tokens)
    src_w = src if setup.word is None else src.view(setup.word)
    dst_w = dst if setup.word is None else dst.view(setup.word)
    for name, t, (lo, hi), st, bs, (head_lo, head_hi) in (
            ("src", src_w, bounds[0], setup.strides[0], src_block_size, setup.heads[0]),
            ("dst", dst_w, bounds[1], setup.strides[1], dst_block_size, setup.heads[1])):
        b, lay, kv, tok, h, d = st
        last = (hi * b + (num_layers - 1) * lay + (num_kv - 1) * kv
                + (bs - 1) * tok + head_hi * h + (setup.units - 1) * d)
        if lo < 0 or head_lo < 0 or last >= t.numel():
            raise ValueError(f"{name}_ids address past {name}: the largest offset they reach is "
                             f"{last}, and {name} holds {t.numel()} elements; is {name} too "
                             "small, or an id out of range?")
    # One host -> device copy for the ids and head pairs, asynchronous from pinned memory:
    # the launch does not wait for the device to finish earlier work.
    device = dst.device
    s_dev, d_dev, pairs_dev = _to_device(host, device).split(
        [need_s, need_d, len(setup.pairs_flat)])
    scale_arg = (_to_device(scales.to(dtype=torch.float32, device="cpu").contiguous(), device)
                 if scales is not None else s_dev)
    args = (src_w, dst_w, s_dev, d_dev, pairs_dev, scale_arg,
            num_tokens, src_block_size, dst_block_size, num_kv, len(pairs), setup.units,
            *setup.strides[0], *setup.strides[1])
    return GatherLaunch(setup.grid, args, setup.constants, setup.nbytes)


@dataclass(frozen=True)
class _Setup:
    """The shape-only part of a prepared gather (:func:`_setup`)."""

    word: torch.dtype | None  # both sides viewed as this integer dtype (None: as they are)
    strides: tuple[Strides, Strides]  # in those words
    units: int  # words (or elements) per head
    need: tuple[int, int]  # source and destination blocks the tokens occupy
    heads: tuple[tuple[int, int], tuple[int, int]]  # (lowest, highest) head, src then dst
    pairs_flat: tuple[int, ...]  # (dst, src) head pairs, flat
    grid: tuple[int, int]
    constants: dict[str, Any]  # the kernel's constexprs (shared by launches: not mutated)
    nbytes: int


def _alignment(t: torch.Tensor) -> int:
    """The largest word size (up to 8 bytes) that ``t``'s address is a multiple of."""
    address = t.data_ptr()
    return 8 if address % 8 == 0 else address & -address


@functools.lru_cache(maxsize=256)
def _setup(src_dtype: torch.dtype, dst_dtype: torch.dtype, src_align: int, dst_align: int,
           num_tokens: int, src_block_size: int, dst_block_size: int, src_strides: Strides,
           dst_strides: Strides, num_layers: int, num_kv: int,
           pairs: tuple[tuple[int, int], ...], head_size: int, scaled: bool,
           config: GatherConfig) -> _Setup:
    """:func:`prepare_convert`'s work that depends on no id and no address beyond its
    alignment: the integer word, strides in words, tiling, grid and constants (cached: a
    connector's loads repeat one shape)."""
    units, word = head_size, None
    if not scaled:
        # Same bytes: move integer words (exact bits), as wide as the head's bytes, every
        # stride and both addresses allow when the head is contiguous on both sides.
        elem = src_dtype.itemsize
        size = elem
        if src_strides[5] == 1 and dst_strides[5] == 1:
            counts = (head_size, *src_strides[:5], *dst_strides[:5])
            size = next(w for w in _WORDS if src_align % w == 0 and dst_align % w == 0
                        and all((c * elem) % w == 0 for c in counts))
            ratio = size // elem
            src_strides = (*(s // ratio for s in src_strides[:5]), 1)
            dst_strides = (*(s // ratio for s in dst_strides[:5]), 1)
            units = head_size // ratio
        word = _WORDS[size]
    word_bytes = word.itemsize if word is not None else src_dtype.itemsize
    num_pairs = len(pairs)
    block_t, block_h, block_d, aligned = _tile(config, word_bytes, units, num_pairs,
                                               num_tokens, src_block_size, dst_block_size)
    fp8_max, mantissa, min_exp = fp8_format(dst_dtype)
    quantize = scaled and dst_dtype in _FP8
    interpreted = is_interpreted(_convert_blocks_kernel)
    constants = dict(
        SCALE=scaled, QUANTIZE=quantize, FP8_MAX=fp8_max,
        EXACT_FP8_ROUNDING=quantize and interpreted,
        MANTISSA_BITS=mantissa, MIN_EXPONENT=min_exp, INTERPRET=interpreted,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, ALIGNED=aligned,
        CONTIGUOUS=src_strides[5] == 1 and dst_strides[5] == 1,
        EVEN_H=num_pairs % block_h == 0, EVEN_D=units == block_d,
        EVICTION="evict_first" if config.evict_first else "",
        num_warps=config.num_warps)
    # Host-side ceil divisions: recent Triton's triton.cdiv is a constexpr function whose
    # call costs microseconds.
    grid = (-(-num_tokens // block_t), num_layers * num_kv * -(-num_pairs // block_h))
    dst_heads, src_heads = [d for d, _ in pairs], [s for _, s in pairs]
    return _Setup(
        word=word, strides=(src_strides, dst_strides), units=units,
        need=(-(-num_tokens // src_block_size), -(-num_tokens // dst_block_size)),
        heads=((min(src_heads), max(src_heads)), (min(dst_heads), max(dst_heads))),
        pairs_flat=tuple(h for pair in pairs for h in pair), grid=grid, constants=constants,
        nbytes=num_tokens * num_layers * num_kv * num_pairs * head_size * dst_dtype.itemsize)


def _ids_on_host(src_ids: torch.Tensor | Sequence[int], dst_ids: torch.Tensor | Sequence[int],
                 need_s: int, need_d: int, pairs_flat: tuple[int, ...], num_tokens: int
                 ) -> tuple[torch.Tensor, tuple[tuple[int, int], tuple[int, int]]]:
    """The first ``need_s`` source and ``need_d`` destination ids and the head pairs as one
    int64 CPU tensor, and each side's ``(lowest, highest)`` id. Sequences of ints are packed
    and bounded in passes of C code (no tensor op per side)."""
    tensors = isinstance(src_ids, torch.Tensor) or isinstance(dst_ids, torch.Tensor)
    if tensors:
        s_ids, d_ids = _as_ids(src_ids, "src_ids"), _as_ids(dst_ids, "dst_ids")
    else:
        s_ids, d_ids = list(src_ids), list(dst_ids)
    if len(s_ids) < need_s or len(d_ids) < need_d:
        raise ValueError(f"{num_tokens} tokens need {need_s} source and {need_d} destination "
                         f"block ids; got {len(s_ids)} and {len(d_ids)}")
    s_ids, d_ids = s_ids[:need_s], d_ids[:need_d]
    if tensors:
        host = torch.cat([s_ids, d_ids, torch.tensor(pairs_flat, dtype=torch.int64)])
        return host, tuple((int(lo), int(hi)) for lo, hi in (torch.aminmax(s_ids),
                                                              torch.aminmax(d_ids)))
    packed = array("q")
    for name, ids in (("src_ids", s_ids), ("dst_ids", d_ids)):
        try:
            packed.extend(ids)  # (refuses what is not an int, or past int64)
        except (TypeError, OverflowError):
            bad = next(i for i, v in enumerate(ids)
                       if not isinstance(v, int) or not -2**63 <= v < 2**63)
            raise TypeError(f"{name}[{bad}]={ids[bad]!r} must be an int64") from None
    packed.extend(pairs_flat)
    return (torch.frombuffer(packed, dtype=torch.int64),
            ((min(s_ids), max(s_ids)), (min(d_ids), max(d_ids))))


def convert_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | list[int],
    dst_ids: torch.Tensor | list[int],
    **arguments: Any,
) -> int:
    """Rearrange ``num_tokens`` tokens from blocks ``src_ids`` of ``src`` into blocks
    ``dst_ids`` of ``dst`` with one kernel launch; returns the bytes written.

    :func:`prepare_convert`'s launch, made and called at once: the keyword arguments
    (``num_tokens``, ``src_block_size``, ``dst_block_size``, ``src_strides``,
    ``dst_strides``, ``num_layers``, ``num_kv``, ``head_pairs``, ``head_size``, ``scales``,
    ``config``) and the errors are :func:`prepare_convert`'s.
    """
    launch = prepare_convert(src, dst, src_ids, dst_ids, **arguments)
    return 0 if launch is None else launch()
