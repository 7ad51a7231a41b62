"""Layout conversion on transfer: move KV between caches whose layouts differ.

Two engines that share KV may disagree on the layout: block size, stride order (NHD, HND,
the interleaved ``B,N,2,H,D``), per-layer or cross-layer allocation, the tensor-parallel slice
of the KV heads each rank holds, or the storage dtype. :func:`plan_conversion` compares a
source and a destination :class:`~kvcore.KVCacheLayout` (plus each side's
:class:`TPRank`) once and returns a :class:`ConversionPlan`, a pure-Python object that says
which bytes of which source blocks go where in the destination blocks, prints as a readable
summary and refuses, before any byte moves, what cannot be converted
(:class:`LayoutConversionError` names both layouts and the field).

A transfer is a sequence of ``num_tokens`` tokens: token ``t`` lies in source block
``src_ids[t // src_block_size]`` and goes to destination block ``dst_ids[t //
dst_block_size]``, so a partial last block is exact (tokens past ``num_tokens`` are not
touched on either side). :meth:`ConversionPlan.apply` moves them with one vectorised gather
and one scatter (index tensors built once per plan and pool size, combined with the block ids
by tensor arithmetic: no Python loop per token or head); when the layouts match it copies
whole blocks, one copy per run of consecutive blocks, as connectors do without a plan. It is
also the pure-torch reference of a device gather kernel.

Tensor parallelism follows the usual head split: with ``K`` KV heads over ``tp`` ranks, rank
``r`` holds heads ``r*K/tp .. (r+1)*K/tp - 1`` when ``K >= tp`` (``K % tp == 0``), else the one
head ``r // (tp / K)`` (heads replicated, ``tp % K == 0``). A plan is for one source rank and
one destination rank: it moves the destination's heads that the source rank holds, and
:attr:`ConversionPlan.source_ranks` lists the source ranks a destination rank reads to get all
of its heads (TP 4 -> 2: two; TP 1 -> 8: one). MLA latents are the same on every rank. The
rank arithmetic is :mod:`kvcore.connectors.tp`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvcore import KVCacheLayout, KVCaches, LayoutMismatchError
from kvcore.blocks import block_runs
from kvcore.connectors.convert_args import (
    checked_ids,
    dtype_name,
    id_tensor,
    overlap,
    storage_bytes,
)
from kvcore.connectors.tp import TPRank, as_tp_rank, heads_of_rank, source_ranks
from kvcore.ops import fp8_inverse_scale

__all__ = [
    "ConversionPlan",
    "LayoutConversionError",
    "TPRank",
    "as_tp_rank",
    "block_rows_layout",
    "heads_of_rank",
    "plan_conversion",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_WIDE = (torch.bfloat16, torch.float16, torch.float32)
#: Integer dtypes by byte width: rows of a same-dtype conversion move as words of these.
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class LayoutConversionError(LayoutMismatchError):
    """Two layouts that kvcore cannot convert between (the message names both and the field)."""


def block_rows_layout(layout: KVCacheLayout, num_blocks: int | None = None) -> KVCacheLayout:
    """The layout of blocks packed as connectors move them: one row per block, every layer,
    layer-major (``KVConnector._read_blocks``, the ``storage`` files, the ``offload`` pool).

    That is the cross-layer form of ``layout``'s per-layer order, ``B,L,<per-layer dims>``,
    whether ``layout`` itself is per-layer or cross-layer (a cross-layer layout is returned as
    it is). ``num_blocks`` sets the block count (default: ``layout``'s).
    """
    if layout.has_layer_dim and layout.is_cross_layer:
        return layout if num_blocks is None else _with_blocks(layout, num_blocks)
    if layout.has_layer_dim:
        per_layer = tuple(d - 1 for d in layout.stride_order[1:])
        shape, names = layout.layer_shape, layout.layer_dim_names
    else:
        per_layer, shape, names = layout.stride_order, layout.logical_shape, layout.dim_names
    shape = list(shape)
    if num_blocks is not None:
        shape[0] = num_blocks
    order = (1, 0, *(d + 1 for d in per_layer if d != 0))
    return KVCacheLayout((layout.num_layers, *shape), order, ("L", *names), layout.dtype)


def _with_blocks(layout: KVCacheLayout, num_blocks: int) -> KVCacheLayout:
    shape = list(layout.logical_shape)
    shape[layout.block_dim] = num_blocks
    return KVCacheLayout(tuple(shape), layout.stride_order, layout.dim_names, layout.dtype)


def _size(layout: KVCacheLayout, name: str) -> int:
    names = layout.layer_dim_names
    return layout.layer_shape[names.index(name)] if name in names else 1


def _kind(layout: KVCacheLayout) -> str:
    if layout.has_layer_dim:
        return "cross-layer" if layout.is_cross_layer else "per-layer"
    return "one layer"


@dataclass(frozen=True)
class ConversionPlan:
    """What moves from a source cache to a destination cache of another layout.

    Built by :func:`plan_conversion`; read it, print it (``str(plan)``), then
    :meth:`apply` it to any number of transfers. Block counts of the two layouts are not
    part of the plan: each :meth:`apply` takes them from its tensors.

    Attributes:
        src, dst: the two layouts.
        src_tp, dst_tp: each side's tensor-parallel degree and rank.
        num_kv_heads: KV heads over all ranks (1 for MLA).
        head_map: ``(dst_head, src_head)`` local head pairs this source rank supplies
            (``((0, 0),)`` for MLA).
        source_ranks: the source ranks the destination rank reads all of its heads from.
        dtype_op: ``"copy"`` (bytes as they are), ``"quantize"`` (wider -> fp8 with the
            destination's per-layer K/V scales) or ``"dequantize"`` (fp8 -> wider with the
            source's).
    """

    src: KVCacheLayout
    dst: KVCacheLayout
    src_tp: TPRank
    dst_tp: TPRank
    num_kv_heads: int
    head_map: tuple[tuple[int, int], ...]
    source_ranks: tuple[int, ...]
    dtype_op: Literal["copy", "quantize", "dequantize"]
    _templates: dict = field(default_factory=dict, repr=False, compare=False)

    # -- facts --------------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        return "2" not in self.src.layer_dim_names

    @property
    def num_layers(self) -> int:
        return self.src.num_layers

    @property
    def src_block_size(self) -> int:
        return _size(self.src, "N")

    @property
    def dst_block_size(self) -> int:
        return _size(self.dst, "N")

    @property
    def group_tokens(self) -> int:
        """Tokens of the smallest whole number of blocks on both sides (their lcm)."""
        return math.lcm(self.src_block_size, self.dst_block_size)

    @property
    def head_size(self) -> int:
        return _size(self.src, "D")

    @property
    def is_identity(self) -> bool:
        """Same layout (block counts aside), same heads, same bytes: whole blocks are copied."""
        same = self._templates.get("identity")  # (asked by every prepare: computed once)
        if same is None:
            same = self._templates["identity"] = (
                not self.src.differences(self.dst, ignore_num_blocks=True)
                and self.dtype_op == "copy"
                and self.head_map == tuple((h, h) for h in range(_size(self.dst, "H"))))
        return same

    def num_blocks_for(self, num_tokens: int) -> tuple[int, int]:
        """``(source blocks, destination blocks)`` that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.src_block_size), -(-num_tokens // self.dst_block_size)

    def changes(self) -> list[str]:
        """What the conversion changes, one phrase each (empty: a plain block copy)."""
        src, dst = self.src, self.dst
        out = []
        if self.src_block_size != self.dst_block_size:
            out.append(f"block size {self.src_block_size} -> {self.dst_block_size} "
                       f"({self.group_tokens // self.src_block_size} source block(s) to "
                       f"{self.group_tokens // self.dst_block_size} destination block(s))")
        src_inner = block_rows_layout(src).physical_dim_names[2:]
        dst_inner = block_rows_layout(dst).physical_dim_names[2:]
        if src_inner != dst_inner:
            out.append(f"order within a block {','.join(src_inner)} -> {','.join(dst_inner)}")
        if _kind(src) != _kind(dst):
            out.append(f"{_kind(src)} -> {_kind(dst)}")
        if not self.is_mla and (self.src_tp != self.dst_tp or len(self.head_map) != _size(
                src, "H") or any(d != s for d, s in self.head_map)):
            out.append(f"KV heads {self._heads_text()}")
        if self.dtype_op != "copy":
            scales = "destination" if self.dtype_op == "quantize" else "source"
            out.append(f"dtype {dtype_name(src.dtype)} -> {dtype_name(dst.dtype)} "
                       f"({self.dtype_op}, with the {scales}'s per-layer K/V scales)")
        return out

    def _heads_text(self) -> str:
        src_heads = heads_of_rank(self.num_kv_heads, self.src_tp)
        dst_heads = heads_of_rank(self.num_kv_heads, self.dst_tp)
        supplied = [dst_heads[d] for d, _ in self.head_map]
        text = (f"{self.src_tp} (heads {_span(src_heads)}) -> {self.dst_tp} (heads "
                f"{_span(dst_heads)}) of {self.num_kv_heads}: this source supplies "
                f"{_span(supplied)}")
        if len(supplied) < len(dst_heads):
            text += (f"; the destination rank needs source ranks {list(self.source_ranks)} "
                     "for all its heads")
        return text

    def __str__(self) -> str:
        lines = [f"source       {self.src}  {self.src.describe()}, {self.src_tp}",
                 f"destination  {self.dst}  {self.dst.describe()}, {self.dst_tp}"]
        if self.is_identity:
            lines.append("conversion   none: the layouts match, whole blocks are copied (one "
                         "copy per run of consecutive blocks)")
            return "\n".join(lines)
        changes = self.changes()
        lines.append(f"conversion   {changes[0]}")
        lines.extend(f"             {c}" for c in changes[1:])
        unit = self.head_size * self.src.itemsize
        per_group = self.num_layers * (1 if self.is_mla else 2) * len(self.head_map)
        lines.append(
            f"moves        per token {per_group} run(s) of {unit} B (one per layer"
            + ("" if self.is_mla else ", K/V and head") + "); "
            f"{self.group_tokens} tokens = {self.group_tokens // self.src_block_size} source "
            f"-> {self.group_tokens // self.dst_block_size} destination block(s); a partial "
            "last block moves only its tokens")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready summary (layouts as :meth:`KVCacheLayout.to_dict`)."""
        return {"src": self.src.to_dict(), "dst": self.dst.to_dict(),
                "src_tp": [self.src_tp.degree, self.src_tp.rank],
                "dst_tp": [self.dst_tp.degree, self.dst_tp.rank],
                "num_kv_heads": self.num_kv_heads, "head_map": [list(p) for p in self.head_map],
                "source_ranks": list(self.source_ranks), "dtype_op": self.dtype_op,
                "identity": self.is_identity, "changes": self.changes()}

    # -- moving bytes -------------------------------------------------------------------------

    def apply(self, src: torch.Tensor | KVCaches, dst: torch.Tensor | KVCaches,
              src_ids: Sequence[int] | torch.Tensor, dst_ids: Sequence[int] | torch.Tensor,
              num_tokens: int | None = None, **options: Any) -> int:
        """Convert ``num_tokens`` tokens from blocks ``src_ids`` of ``src`` into blocks
        ``dst_ids`` of ``dst``; returns the bytes written.

        A conversion runs as one gather on the destination's device: the Triton kernel
        (:func:`kvcore.ops.triton_convert_blocks`) for a destination on a GPU, a vectorised
        torch gather/scatter otherwise (the kernel's reference). A plan whose layouts match
        copies whole blocks, one copy per run. This is :meth:`prepare`'s conversion, made and
        called at once: the arguments (keyword ``options``: ``src_scales``, ``dst_scales``,
        ``kernel``) and the errors are :meth:`prepare`'s.
        """
        return self.prepare(src, dst, src_ids, dst_ids, num_tokens, **options)()

    def prepare(
        self,
        src: torch.Tensor | KVCaches,
        dst: torch.Tensor | KVCaches,
        src_ids: Sequence[int] | torch.Tensor,
        dst_ids: Sequence[int] | torch.Tensor,
        num_tokens: int | None = None,
        *,
        src_scales: torch.Tensor | Sequence[float] | float | None = None,
        dst_scales: torch.Tensor | Sequence[float] | float | None = None,
        kernel: Literal["auto", "torch", "triton"] = "auto",
    ) -> Callable[[], int]:
        """:meth:`apply` in two steps: its checks, ids and index work now, the conversion
        when the returned callable is called (it returns the bytes written, as :meth:`apply`
        does, and may be called again for the same blocks).

        A connector prepares the gather of a chunk while that chunk's bytes are still on the
        wire, then only launches it. On a GPU the call is one kernel launch on the current
        stream (the ids reached the device, without blocking the host, on the stream current
        at :meth:`prepare`: prepare and call on the same stream), and the host never waits
        for the device. ``src`` and ``dst`` must stay allocated until the last call.

        Args:
            src, dst: a :class:`~kvcore.KVCaches` (its storage), or a contiguous tensor
                holding a whole allocation of that side's layout with any number of blocks
                (its dtype, or uint8 bytes), e.g. :func:`block_rows_layout` rows received
                from a peer. They must not share memory.
            src_ids, dst_ids: the blocks, in token order: ``ceil(num_tokens /
                block_size)`` of each side. Destination ids are distinct.
            num_tokens: tokens to move; default ``len(src_ids) * src_block_size``.
            src_scales, dst_scales: per-layer K/V scales, ``(num_layers, 2)`` (MLA:
                ``(num_layers,)``) or one float: the destination's for ``"quantize"``, the
                source's for ``"dequantize"``.
            kernel: ``"auto"`` (Triton for a destination on a GPU, else torch), ``"torch"``
                or ``"triton"`` (any device: CPU tensors run under ``TRITON_INTERPRET=1``).

        Raises:
            ValueError, TypeError: before anything is written: a tensor that is not an
                allocation of its layout, ids out of range or not as many as the tokens
                need, repeated destination ids, missing or bad scales.
        """
        block_bytes = self._templates.get("block_bytes")  # (per side: computed once)
        if block_bytes is None:
            block_bytes = self._templates["block_bytes"] = tuple(
                layout.num_layers * layout.page_size_bytes for layout in (self.src, self.dst))
        src_t, src_n = storage_bytes(src, self.src, "src", block_bytes[0])
        dst_t, dst_n = storage_bytes(dst, self.dst, "dst", block_bytes[1])
        if src_t.device == dst_t.device and overlap(src_t, dst_t):
            raise ValueError("src and dst share memory; convert into a separate allocation")
        s_ids = checked_ids(src_ids, "src_ids", src_n, "source")
        d_ids = checked_ids(dst_ids, "dst_ids", dst_n, "destination")
        if num_tokens is None:
            num_tokens = len(s_ids) * self.src_block_size
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
        want_src, want_dst = self.num_blocks_for(num_tokens)
        if (len(s_ids), len(d_ids)) != (want_src, want_dst):
            raise ValueError(
                f"{num_tokens} tokens occupy {want_src} source block(s) of "
                f"{self.src_block_size} and {want_dst} destination block(s) of "
                f"{self.dst_block_size}, but src_ids has {len(s_ids)} and dst_ids "
                f"{len(d_ids)}; pass the request's blocks on each side")
        if (len(set(d_ids)) if isinstance(d_ids, list)  # (a list: one pass of C code)
                else d_ids.unique().numel()) != len(d_ids):
            raise ValueError(f"dst_ids repeats blocks ({sorted(id_tensor(d_ids).tolist())}); "
                             "each destination block is written once")
        scales = self._scales(src_scales, dst_scales)
        if num_tokens == 0:
            return _nothing
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel={kernel!r} must be 'auto', 'torch' or 'triton'")
        if self.is_identity:
            return self._copy_blocks(src_t, src_n, dst_t, dst_n, id_tensor(s_ids),
                                     id_tensor(d_ids), num_tokens)
        if kernel == "triton" or (kernel == "auto" and dst_t.is_cuda):
            if src_t.device != dst_t.device:
                src_t = src_t.to(dst_t.device)
            return self._launch(src_t, src_n, dst_t, dst_n, s_ids, d_ids, num_tokens, scales)
        return self._gather(src_t, src_n, dst_t, dst_n, id_tensor(s_ids), id_tensor(d_ids),
                            num_tokens, scales)

    def blocks_for_keys(self, num_keys: int) -> int:
        """Destination blocks that ``num_keys`` whole source blocks fill (the last maybe
        partly): what a connector's load of ``num_keys`` keys takes as ``block_ids``."""
        return -(-num_keys * self.src_block_size // self.dst_block_size)

    def key_groups(self, num_keys: int) -> list[tuple[range, slice]]:
        """The groups of :attr:`group_tokens` of a load of ``num_keys`` keys (whole source
        blocks): per group, the indices of its keys and the slice of the load's
        :meth:`blocks_for_keys` destination blocks it writes (the last group maybe partial
        on both sides). A group converts whole or not at all."""
        gs = self.group_tokens // self.src_block_size
        gd = self.group_tokens // self.dst_block_size
        num_dst = self.blocks_for_keys(num_keys)
        return [(range(g * gs, min(num_keys, (g + 1) * gs)),
                 slice(g * gd, min(num_dst, (g + 1) * gd))) for g in range(-(-num_keys // gs))]

    def apply_keys(
        self,
        src: torch.Tensor | KVCaches,
        dst: torch.Tensor | KVCaches,
        src_slots: Sequence[int],
        dst_ids: Sequence[int],
        arrived: Sequence[bool],
        *,
        dst_scales: torch.Tensor | Sequence[float] | float | None = None,
        kernel: Literal["auto", "torch", "triton"] = "auto",
    ) -> tuple[list[int], dict[int, int], int]:
        """A connector's converting load: key ``i`` names source block ``i`` of a request
        (its tokens ``i * src_block_size ..``), held in block ``src_slots[i]`` of ``src``
        when ``arrived[i]``; ``dst_ids`` are the :meth:`blocks_for_keys` destination blocks.

        Tokens convert by groups of :attr:`group_tokens` (whole blocks on both sides): a
        group whose keys all arrived is written, one :meth:`apply` per run of such groups
        (one launch when everything arrived); the destination blocks of the other groups
        are not touched. Returns ``(written destination blocks, {destination block: the
        first key index of its group that did not arrive}, bytes written)``.

        Raises:
            ValueError: before anything is written, ``src_slots`` and ``arrived`` of
                different lengths, or ``dst_ids`` not :meth:`blocks_for_keys` long.
        """
        n = len(src_slots)
        if len(arrived) != n:
            raise ValueError(f"arrived has {len(arrived)} entries for {n} src_slots")
        if len(dst_ids) != self.blocks_for_keys(n):
            raise ValueError(f"{n} keys of {self.src_block_size} tokens fill "
                             f"{self.blocks_for_keys(n)} destination block(s) of "
                             f"{self.dst_block_size}, but dst_ids has {len(dst_ids)}")
        groups = self.key_groups(n)
        written: list[int] = []
        missing: dict[int, int] = {}
        nbytes = 0
        run: list[int] = []  # groups of the current run

        def flush() -> None:
            nonlocal nbytes
            if not run:
                return
            (first, lo), (last, hi) = groups[run[0]], groups[run[-1]]
            k0, k1, d0, d1 = first.start, last.stop, lo.start, hi.stop
            nbytes += self.apply(src, dst, list(src_slots[k0:k1]), list(dst_ids[d0:d1]),
                                 (k1 - k0) * self.src_block_size, dst_scales=dst_scales,
                                 kernel=kernel)
            written.extend(dst_ids[d0:d1])
            run.clear()

        for g, (keys, blocks) in enumerate(groups):
            lost = next((i for i in keys if not arrived[i]), None)
            if lost is None:
                run.append(g)
                continue
            flush()
            for b in dst_ids[blocks]:
                missing[b] = lost
        flush()
        return written, missing, nbytes

    def index(self, src_num_blocks: int, dst_num_blocks: int,
              src_ids: torch.Tensor, dst_ids: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The gather/scatter of a transfer: ``(src_rows, dst_rows, scale_rows, unit)``.

        Row ``src_rows[i]`` of the source, viewed as rows of ``unit`` elements, goes to row
        ``dst_rows[i]`` of the destination (same view); ``scale_rows[i]`` is ``layer * 2 +
        kv`` (MLA: ``layer``), the scale a dtype conversion uses. Ids must be int64 CPU
        tensors already checked (:meth:`apply` does that); what a device gather kernel takes.
        """
        t = self._template(src_num_blocks, dst_num_blocks)
        g_tokens, gs, gd = self.group_tokens, t["gs"], t["gd"]
        groups = -(-num_tokens // g_tokens)
        pad_src = torch.zeros(groups * gs, dtype=torch.int64)
        pad_src[:src_ids.numel()] = src_ids
        pad_dst = torch.zeros(groups * gd, dtype=torch.int64)
        pad_dst[:dst_ids.numel()] = dst_ids
        g = torch.arange(groups, dtype=torch.int64)[:, None]
        keep = (g * g_tokens + t["token"][None, :] < num_tokens).reshape(-1)
        src_rows = pad_src[g * gs + t["src_block"]] * t["src_stride"] + t["src_off"]
        dst_rows = pad_dst[g * gd + t["dst_block"]] * t["dst_stride"] + t["dst_off"]
        scale_rows = t["scale"].expand(groups, -1)
        return (src_rows.reshape(-1)[keep], dst_rows.reshape(-1)[keep],
                scale_rows.reshape(-1)[keep], t["unit"])

    # -- internals ----------------------------------------------------------------------------

    def _template(self, src_n: int, dst_n: int) -> dict:
        """Offsets of one group of blocks, in rows of ``unit`` elements (cached per pool size)."""
        key = (src_n, dst_n)
        cached = self._templates.get(key)
        if cached is not None:
            return cached
        src_l, dst_l = _with_blocks(self.src, src_n), _with_blocks(self.dst, dst_n)
        sst, dstr = _strides(src_l), _strides(dst_l)
        unit = self.head_size if sst["D"] == 1 and dstr["D"] == 1 else 1
        lay = torch.arange(self.num_layers)
        kv = torch.arange(1 if self.is_mla else 2)
        tok = torch.arange(self.group_tokens)
        pairs = torch.tensor(self.head_map, dtype=torch.int64).view(-1, 2)
        d = torch.arange(self.head_size if unit == 1 else 1)
        grid = torch.meshgrid(lay, kv, tok, torch.arange(pairs.shape[0]), d, indexing="ij")
        lg, kg, tg, hg, dg = (x.reshape(-1) for x in grid)
        dh, sh = pairs[hg, 0], pairs[hg, 1]
        bs_s, bs_d = self.src_block_size, self.dst_block_size
        src_off = lg * sst["L"] + kg * sst["2"] + (tg % bs_s) * sst["N"] + sh * sst["H"] \
            + dg * sst["D"]
        dst_off = lg * dstr["L"] + kg * dstr["2"] + (tg % bs_d) * dstr["N"] + dh * dstr["H"] \
            + dg * dstr["D"]
        t = {"unit": unit, "gs": self.group_tokens // bs_s, "gd": self.group_tokens // bs_d,
             "token": tg, "src_block": tg // bs_s, "dst_block": tg // bs_d,
             "src_off": src_off // unit, "dst_off": dst_off // unit,
             "src_stride": sst["B"] // unit, "dst_stride": dstr["B"] // unit,
             "scale": (lg * kv.numel() + kg)[None, :]}
        self._templates[key] = t
        return t

    def _scales(self, src_scales: object, dst_scales: object) -> torch.Tensor | None:
        """The scales the dtype op uses, as a float32 ``(num_layers * kv,)`` tensor."""
        given = {"quantize": ("dst_scales", dst_scales), "dequantize": ("src_scales",
                                                                        src_scales)}
        if self.dtype_op == "copy":
            return None
        name, value = given[self.dtype_op]
        shape = (self.num_layers,) if self.is_mla else (self.num_layers, 2)
        if value is None:
            raise ValueError(f"this plan {self.dtype_op}s ({dtype_name(self.src.dtype)} -> "
                             f"{dtype_name(self.dst.dtype)}): pass {name}, the per-layer "
                             f"K/V scales, shape {shape} or one float")
        try:
            scales = torch.as_tensor(value, dtype=torch.float32).cpu()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be a float or a {shape} tensor of floats: {exc}"
                            ) from None
        if scales.dim() == 0:
            scales = scales.expand(shape)
        if tuple(scales.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(scales.shape)}; expected {shape} "
                             "(per layer" + ("" if self.is_mla else ", K then V") + ") or "
                             "one float")
        if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
            raise ValueError(f"{name} must be finite and > 0, got {scales.tolist()}")
        flat = scales.reshape(-1)
        if self.dtype_op == "quantize":
            return torch.tensor([fp8_inverse_scale(float(s)) for s in flat],
                                dtype=torch.float32)
        return flat.clone()

    def _launch(self, src_t: torch.Tensor, src_n: int, dst_t: torch.Tensor, dst_n: int,
                s_ids: list[int] | torch.Tensor, d_ids: list[int] | torch.Tensor,
                num_tokens: int, scales: torch.Tensor | None) -> Callable[[], int]:
        """The conversion as one launch of the gather kernel on the destination's device."""
        from kvcore.ops.triton_convert import prepare_convert

        key = ("strides", src_n, dst_n)
        strides = self._templates.get(key)
        if strides is None:  # (a layout per pool size: computed once)
            strides = self._templates[key] = tuple(
                tuple(_strides(_with_blocks(layout, n))[d] for d in ("B", "L", "2", "N", "H",
                                                                      "D"))
                for layout, n in ((self.src, src_n), (self.dst, dst_n)))
        launch = prepare_convert(
            src_t.view(self.src.dtype), dst_t.view(self.dst.dtype), s_ids, d_ids,
            num_tokens=num_tokens, src_block_size=self.src_block_size,
            dst_block_size=self.dst_block_size, src_strides=strides[0],
            dst_strides=strides[1], num_layers=self.num_layers,
            num_kv=1 if self.is_mla else 2, head_pairs=self.head_map,
            head_size=self.head_size, scales=scales)
        return _nothing if launch is None else launch

    def _gather(self, src_t: torch.Tensor, src_n: int, dst_t: torch.Tensor, dst_n: int,
                s_ids: torch.Tensor, d_ids: torch.Tensor, num_tokens: int,
                scales: torch.Tensor | None) -> Callable[[], int]:
        """The conversion as a torch gather/scatter (the kernel's reference), its rows
        indexed now."""
        src_rows, dst_rows, scale_rows, unit = self.index(src_n, dst_n, s_ids, d_ids,
                                                          num_tokens)
        src_bytes, dst_bytes = unit * self.src.itemsize, unit * self.dst.itemsize
        if self.dtype_op == "copy":
            src_word = dst_word = _word(src_bytes, src_t, dst_t)
        else:
            src_word, dst_word = _word(src_bytes, src_t), _word(dst_bytes, dst_t)
        # Rows move as integer words: exact bits, and index_copy_ has no fp8 kernel on CPU.
        src_v = src_t.view(src_word).view(-1, src_bytes // src_word.itemsize)
        dst_v = dst_t.view(dst_word).view(-1, dst_bytes // dst_word.itemsize)
        src_rows, dst_rows = src_rows.to(src_t.device), dst_rows.to(dst_t.device)
        row_scales = (None if scales is None
                      else scales.to(src_t.device)[scale_rows.to(src_t.device)][:, None])
        nbytes = dst_rows.numel() * unit * self.dst.itemsize
        limit = torch.finfo(self.dst.dtype).max if self.dtype_op == "quantize" else None

        def gather() -> int:
            moved = src_v.index_select(0, src_rows)
            if row_scales is not None:
                values = moved.view(self.src.dtype).float() * row_scales
                if limit is not None:
                    values = values.clamp(-limit, limit)
                moved = values.to(self.dst.dtype).view(dst_word)
            dst_v.index_copy_(0, dst_rows, moved.to(dst_t.device))
            return nbytes

        return gather

    def _copy_blocks(self, src_t: torch.Tensor, src_n: int, dst_t: torch.Tensor, dst_n: int,
                     s_ids: torch.Tensor, d_ids: torch.Tensor, num_tokens: int
                     ) -> Callable[[], int]:
        """Whole blocks, one copy per run; a partial last block through the gather."""
        full = num_tokens // self.src_block_size
        src_rows = _block_rows(src_t, self.src, src_n)
        dst_rows = _block_rows(dst_t, self.dst, dst_n)
        runs = block_runs(s_ids[:full], d_ids[:full]).tolist()
        rest = (self._gather(src_t, src_n, dst_t, dst_n, s_ids[full:], d_ids[full:],
                             num_tokens - full * self.src_block_size, None)
                if full < s_ids.numel() else _nothing)
        nbytes = sum(n for _, _, n in runs) * dst_rows.shape[1] * dst_rows.shape[2]

        def copy() -> int:
            for s, d, n in runs:
                dst_rows[d:d + n].copy_(src_rows[s:s + n])
            return nbytes + rest()

        return copy


def _nothing() -> int:
    """A prepared conversion that moves nothing."""
    return 0


def _span(heads: Sequence[int]) -> str:
    heads = list(heads)
    if not heads:
        return "none"
    if heads == list(range(heads[0], heads[-1] + 1)):
        return str(heads[0]) if len(heads) == 1 else f"{heads[0]}-{heads[-1]}"
    return ",".join(map(str, heads))


def _strides(layout: KVCacheLayout) -> dict[str, int]:
    """Element strides by dim name (0 for a dim the layout lacks)."""
    return {**dict.fromkeys(("L", "2", "H"), 0),
            **dict(zip(layout.dim_names, layout.logical_strides(), strict=True))}


def _word(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype whose size divides ``row_bytes`` and every tensor's address,
    so rows move as words, not bytes."""
    for size, dtype in _WORDS.items():
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _block_rows(raw: torch.Tensor, layout: KVCacheLayout, num_blocks: int) -> torch.Tensor:
    """``(num_blocks, num_layers, page_bytes)`` uint8 view of a blocks-first allocation."""
    page = layout.page_size_bytes
    num_layers = layout.num_layers
    if not layout.is_blocks_first:
        raise ValueError(f"layout {layout} is not blocks-first: its blocks are not runs of "
                         "bytes to copy")
    if layout.is_cross_layer or not layout.has_layer_dim:
        return raw.view(num_blocks, num_layers, page)
    return raw.view(num_layers, num_blocks, page).transpose(0, 1)


# -- planning ---------------------------------------------------------------------------------


def plan_conversion(
    src: KVCacheLayout,
    dst: KVCacheLayout,
    *,
    src_tp: TPRank | None = None,
    dst_tp: TPRank | None = None,
    num_kv_heads: int | None = None,
    quantize: bool = False,
    dequantize: bool = False,
) -> ConversionPlan:
    """The plan that moves KV from caches of layout ``src`` into caches of layout ``dst``.

    Args:
        src, dst: the two layouts (block counts may differ: each transfer brings its own).
        src_tp, dst_tp: each side's tensor-parallel degree and rank (default: TP 1). The
            ``H`` dim of each layout is that rank's slice of the heads.
        num_kv_heads: KV heads over all ranks. Derived from the layouts when one side has
            TP 1 or more than one head per rank; needed when both hold one head of several
            ranks (heads replicated or not cannot be told apart then).
        quantize: allow bf16/fp16/fp32 -> fp8 (with the destination's scales at apply).
        dequantize: allow fp8 -> bf16/fp16/fp32 (with the source's scales at apply).

    Raises:
        LayoutConversionError: the layouts cannot be converted (MLA against K/V, legacy or
            not blocks-first, different layer counts or head sizes, block sizes of which
            neither divides the other, a dtype change not allowed, head counts no TP split
            explains, a source rank that holds none of the destination's heads): the message
            names both layouts and the field.
        TypeError, ValueError: an argument of the wrong type, a rank outside its degree.
    """
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, KVCacheLayout):
            raise TypeError(f"{name} must be a kvcore.KVCacheLayout, got {type(layout).__name__}")
    src_tp = TPRank() if src_tp is None else src_tp
    dst_tp = TPRank() if dst_tp is None else dst_tp
    for name, tp in (("src_tp", src_tp), ("dst_tp", dst_tp)):
        if not isinstance(tp, TPRank):
            raise TypeError(f"{name} must be a TPRank(degree, rank), got {tp!r}")

    def refuse(what: str) -> LayoutConversionError:
        return LayoutConversionError(
            f"cannot convert KV cache layout {src} ({src.describe()}) to {dst} "
            f"({dst.describe()}): {what}")

    names_s, names_d = src.layer_dim_names, dst.layer_dim_names
    if names_s != names_d:
        mla = "2" not in names_s or "2" not in names_d
        raise refuse(f"dims {','.join(names_s)} vs {','.join(names_d)}"
                     + (": an MLA latent cache and a K/V cache hold different things"
                        if mla else ""))
    for name, layout in (("source", src), ("destination", dst)):
        if names_s[0] != "B" or not layout.is_blocks_first:
            raise refuse(f"the {name} layout {layout} is not blocks-first (a legacy "
                         "(2, num_blocks, ...) cache); allocate it with a blocks-first backend")
    if src.num_layers != dst.num_layers:
        raise refuse(f"layer count {src.num_layers} vs {dst.num_layers}: both engines must "
                     "run the same model")
    if _size(src, "D") != _size(dst, "D"):
        raise refuse(f"head size (D) {_size(src, 'D')} vs {_size(dst, 'D')}")
    bs_s, bs_d = _size(src, "N"), _size(dst, "N")
    if bs_s % bs_d and bs_d % bs_s:
        raise refuse(f"block size (N) {bs_s} vs {bs_d}: one must divide the other")
    dtype_op = _dtype_op(src.dtype, dst.dtype, quantize, dequantize, refuse)

    is_mla = "2" not in names_s
    if is_mla:
        head_map, total, ranks = ((0, 0),), 1, (0,)
    else:
        head_map, total, ranks = _plan_heads(_size(src, "H"), _size(dst, "H"), src_tp, dst_tp,
                                             num_kv_heads, refuse)
    return ConversionPlan(src, dst, src_tp, dst_tp, total, head_map, ranks, dtype_op)


def _dtype_op(s: torch.dtype, d: torch.dtype, quantize: bool, dequantize: bool, refuse
              ) -> str:
    if s == d:
        return "copy"
    text = f"dtype {dtype_name(s)} vs {dtype_name(d)}"
    if s in _WIDE and d in _FP8:
        if not quantize:
            raise refuse(f"{text}: quantizing to fp8 loses precision; pass quantize=True "
                         "(the destination's per-layer K/V scales are then applied)")
        return "quantize"
    if s in _FP8 and d in _WIDE:
        if not dequantize:
            raise refuse(f"{text}: fp8 -> wider cannot restore what quantizing lost; pass "
                         "dequantize=True to accept it (with the source's scales)")
        return "dequantize"
    raise refuse(f"{text}: only bf16/fp16/fp32 -> fp8 (quantize=True) and fp8 -> wider "
                 "(dequantize=True) convert")


def _plan_heads(hs: int, hd: int, src_tp: TPRank, dst_tp: TPRank, num_kv_heads: int | None,
                refuse) -> tuple[tuple[tuple[int, int], ...], int, tuple[int, ...]]:
    if num_kv_heads is None:
        if src_tp.degree == 1 or hs > 1:
            num_kv_heads = hs * src_tp.degree if hs > 1 else hs
        elif dst_tp.degree == 1 or hd > 1:
            num_kv_heads = hd * dst_tp.degree if hd > 1 else hd
        elif src_tp == dst_tp:
            return ((0, 0),), src_tp.degree, (src_tp.rank,)  # the same single head
        else:
            raise refuse(f"KV heads: both sides hold one head per rank ({src_tp}, {dst_tp}), "
                         "which fits several head counts (replicated or not); pass "
                         "num_kv_heads, the model's KV head count")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive int")
    sides = []
    for side, h, tp in (("source", hs, src_tp), ("destination", hd, dst_tp)):
        try:
            heads = heads_of_rank(num_kv_heads, tp)
        except ValueError as exc:
            raise refuse(f"KV heads (H) on the {side}: {exc}") from None
        if len(heads) != h:
            raise refuse(f"KV heads (H) {hs} vs {hd}: {num_kv_heads} heads over the "
                         f"{side}'s {tp} give {len(heads)} per rank, but its layout holds {h}; "
                         "pass each side's tensor-parallel degree and rank (src_tp, dst_tp) "
                         "and the model's num_kv_heads")
        sides.append(heads)
    src_heads, dst_heads = sides
    head_map = tuple((j, src_heads.index(g)) for j, g in enumerate(dst_heads) if g in src_heads)
    ranks = source_ranks(num_kv_heads, dst_tp, src_tp.degree)
    if not head_map:
        raise refuse(f"KV heads: source {src_tp} holds heads {_span(src_heads)} of "
                     f"{num_kv_heads}, none of the heads {_span(dst_heads)} destination "
                     f"{dst_tp} holds; read from source rank(s) {list(ranks)}")
    return head_map, num_kv_heads, ranks

