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

Bytes move as they are (as the widest integer words the strides allow), or, with ``scales``,
are converted: wider -> fp8 (``x * scale`` clamped to the fp8 range, ``scale`` being the
destination's inverse scale, :func:`kvcore.ops.fp8_inverse_scale`) or fp8 -> wider
(``x * scale``, the source's scale). The pure-torch reference is
:meth:`kvcore.connectors.ConversionPlan.apply` on the CPU (the plan calls this kernel for
caches on a GPU). This module imports triton; :mod:`kvcore.ops` imports it lazily
(:func:`kvcore.ops.triton_convert_blocks`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_utils import (
    fp8_format,
    interpreting,
    next_power_of_2,
    round_to_fp8_grid,
    to_output,
)

__all__ = ["Strides", "convert_blocks"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: Elements (words) one program moves: a [tokens, head_size] tile of about this many.
_TILE_ELEMENTS = 2048


#: Element strides of one side's allocation, by logical dim: ``(block, layer, kv, token,
#: head, dim)``; 0 for a dim the side lacks (layer for one layer, kv and head for MLA).
Strides = tuple[int, int, int, int, int, int]


@triton.jit
def _convert_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, heads_ptr, scales_ptr,
    num_tokens, src_bs, dst_bs, num_kv, num_pairs, head_units,
    s_block, s_layer, s_kv, s_token, s_head, s_dim,
    d_block, d_layer, d_kv, d_token, d_head, d_dim,
    SCALE: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    EXACT_FP8_ROUNDING: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Axis 1 enumerates (layer, kv, head pair); axis 0 tiles the tokens.
    lane = tl.program_id(1).to(tl.int64)
    pair = lane % num_pairs
    layer_kv = lane // num_pairs
    kv = layer_kv % num_kv
    layer = layer_kv // num_kv
    dst_head = tl.load(heads_ptr + 2 * pair)
    src_head = tl.load(heads_ptr + 2 * pair + 1)

    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_ok = t < num_tokens
    s_blk = tl.load(src_ids_ptr + t // src_bs, mask=t_ok, other=0)
    d_blk = tl.load(dst_ids_ptr + t // dst_bs, mask=t_ok, other=0)
    s_row = (s_blk * s_block + layer * s_layer + kv * s_kv + (t % src_bs) * s_token
             + src_head * s_head)
    d_row = (d_blk * d_block + layer * d_layer + kv * d_kv + (t % dst_bs) * d_token
             + dst_head * d_head)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = t_ok[:, None] & (d < head_units)[None, :]
    x = tl.load(src_ptr + s_row[:, None] + d[None, :] * s_dim, mask=mask)
    if SCALE:
        y = x.to(tl.float32) * tl.load(scales_ptr + layer_kv)
        if QUANTIZE:
            y = tl.clamp(y, -FP8_MAX, FP8_MAX)
            if EXACT_FP8_ROUNDING:
                y = round_to_fp8_grid(y, MANTISSA_BITS, MIN_EXPONENT)
            x = y.to(dst_ptr.dtype.element_ty)
        else:
            x = to_output(y, dst_ptr.dtype.element_ty, INTERPRET)
    tl.store(dst_ptr + d_row[:, None] + d[None, :] * d_dim, x, mask=mask)


def _word_size(tensors: tuple[torch.Tensor, ...], itemsize: int, counts: tuple[int, ...]
               ) -> int:
    """The widest word (bytes) that every byte count and tensor address is a multiple of."""
    for size in _WORDS:
        if all(t.data_ptr() % size == 0 for t in tensors) \
                and all((c * itemsize) % size == 0 for c in counts):
            return size
    return 1


def _as_ids(ids: torch.Tensor | list[int], name: str) -> torch.Tensor:
    """Ids as an int64 CPU tensor (bounds are checked on the host)."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.int64)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor or a list of ints, got "
                        f"{ids.dtype} shape {tuple(ids.shape)}")
    return ids.to(device="cpu", dtype=torch.int64)


def convert_blocks(
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
    head_pairs: torch.Tensor | list[tuple[int, int]],
    head_size: int,
    scales: torch.Tensor | None = None,
) -> int:
    """Rearrange ``num_tokens`` tokens from blocks ``src_ids`` of ``src`` into blocks
    ``dst_ids`` of ``dst`` with one kernel launch; returns the bytes written.

    Args:
        src, dst: flat 1-D contiguous tensors on one device, each a whole allocation of its
            side's layout, in that side's storage dtype (``dst`` is written in place).
        src_ids, dst_ids: the blocks in token order, ``ceil(num_tokens / block_size)`` of
            each side (distinct on the destination; checked by the caller, e.g.
            :meth:`kvcore.connectors.ConversionPlan.apply`).
        src_strides, dst_strides: element strides of each side, ``(block, layer, kv, token,
            head, dim)``.
        num_layers, num_kv: layers, and 2 (K and V) or 1 (MLA latents).
        head_pairs: ``(dst_head, src_head)`` local head pairs to move (``[(0, 0)]`` for MLA).
        head_size: elements per head (the ``D`` dim).
        scales: ``None`` (bytes as they are; both sides one dtype) or a float32 tensor of
            ``num_layers * num_kv`` multipliers, layer-major: the destination's inverse
            scales for wider -> fp8, the source's scales for fp8 -> wider.

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
    device = dst.device
    s_ids = _as_ids(src_ids, "src_ids")
    d_ids = _as_ids(dst_ids, "dst_ids")
    pairs = torch.as_tensor(head_pairs, dtype=torch.int64).reshape(-1, 2).cpu()
    if num_tokens <= 0 or pairs.numel() == 0:
        return 0
    need_s, need_d = -(-num_tokens // src_block_size), -(-num_tokens // dst_block_size)
    if s_ids.numel() < need_s or d_ids.numel() < need_d:
        raise ValueError(f"{num_tokens} tokens need {need_s} source and {need_d} destination "
                         f"block ids; got {s_ids.numel()} and {d_ids.numel()}")
    src_w, dst_w = src, dst
    units = head_size
    if scales is None:
        # Same bytes: move integer words (exact bits), as wide as the head's bytes, every
        # stride and both addresses allow when the head is contiguous on both sides.
        elem = src.dtype.itemsize
        word = elem
        src_strides, dst_strides = tuple(src_strides), tuple(dst_strides)
        if src_strides[5] == 1 and dst_strides[5] == 1:
            word = _word_size((src, dst), elem, (head_size, *src_strides[:5], *dst_strides[:5]))
            ratio = word // elem
            src_strides = (*(s // ratio for s in src_strides[:5]), 1)
            dst_strides = (*(s // ratio for s in dst_strides[:5]), 1)
            units = head_size // ratio
        src_w, dst_w = src.view(_WORDS[word]), dst.view(_WORDS[word])
    sides = (("src", src_w, s_ids[:need_s], src_strides, src_block_size, pairs[:, 1]),
             ("dst", dst_w, d_ids[:need_d], dst_strides, dst_block_size, pairs[:, 0]))
    for name, t, ids, st, bs, heads in sides:
        b, lay, kv, tok, h, d = st
        last = (int(ids.max()) * b + (num_layers - 1) * lay + (num_kv - 1) * kv
                + (bs - 1) * tok + int(heads.max()) * h + (units - 1) * d)
        if int(ids.min()) < 0 or int(heads.min()) < 0 or last >= t.numel():
            raise ValueError(f"{name}_ids address past {name}: the largest offset they reach is "
                             f"{last}, and {name} holds {t.numel()} elements; is {name} too "
                             "small, or an id out of range?")
    s_ids, d_ids = s_ids.to(device), d_ids.to(device)
    pairs = pairs.reshape(-1).to(device)

    fp8_max, mantissa, min_exp = fp8_format(dst.dtype)
    quantize = scales is not None and dst.dtype in _FP8
    block_d = max(16, next_power_of_2(units))
    block_t = max(1, min(64, _TILE_ELEMENTS // block_d))
    num_pairs = pairs.numel() // 2
    grid = (triton.cdiv(num_tokens, block_t), num_layers * num_kv * num_pairs)
    scale_arg = (scales.to(device=device, dtype=torch.float32).contiguous()
                 if scales is not None else s_ids)
    _convert_blocks_kernel[grid](
        src_w, dst_w, s_ids, d_ids, pairs, scale_arg,
        num_tokens, src_block_size, dst_block_size, num_kv, num_pairs, units,
        *src_strides, *dst_strides,
        SCALE=scales is not None, QUANTIZE=quantize, FP8_MAX=fp8_max,
        EXACT_FP8_ROUNDING=quantize and interpreting(), MANTISSA_BITS=mantissa,
        MIN_EXPONENT=min_exp, INTERPRET=interpreting(),
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return num_tokens * num_layers * num_kv * num_pairs * head_size * dst.dtype.itemsize
