"""``kvcore layout``: a backend's KV-cache layout as shapes, strides and a memory map.

:func:`describe_layout` computes, without allocating, what :func:`kvcore.allocate_kv_caches`
would lay out: the logical and physical shapes, the strides of the logical view, the
named-dims string (``B,L,2,N,H,D``), and for the first blocks of every layer the byte ranges
their K and V occupy. :func:`plot_layout` draws those ranges as a memory map, one row per
page (one block of one layer), which shows at a glance

- *blocks-first*: a block of a layer is one contiguous page (connectors copy it as a unit);
- *cross-layer*: the pages of all layers of a block follow each other (one copy per block);
- the legacy ``(2, num_blocks, ...)`` shape: K and V of a block are far apart;
- NHD vs HND: within a K or V half, heads interleave per token or follow each other.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcore import (
    AttentionBackend,
    KVCacheLayout,
    parse_dtype,
    resolve_backend,
    vllm_layout_name,
    vllm_layout_order,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LayoutView", "Region", "describe_layout", "format_layout", "layout_figure",
           "plot_layout"]

_DIM_MEANING = {"L": "layer", "B": "block", "2": "K/V", "N": "token in block",
                "H": "KV head", "D": "head dim"}


@dataclass(frozen=True)
class Region:
    """Where one part of one block of one layer lies: ``runs`` of ``(byte offset, bytes)``
    from the start of the allocation, ascending and merged where adjacent.

    ``part`` is ``"K"`` or ``"V"`` (``"KV"`` for MLA, whose latent has no K/V split);
    ``head`` is the KV head, or ``None`` for all heads together.
    """

    layer: int
    block: int
    part: str
    head: int | None
    runs: tuple[tuple[int, int], ...]

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]

    @property
    def num_bytes(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def contiguous(self) -> bool:
        return len(self.runs) == 1


@dataclass(frozen=True)
class LayoutView:
    """A backend's layout for given sizes, and where its first blocks lie."""

    backend: str
    layout: KVCacheLayout
    per_layer_stride_order: tuple[int, ...]
    cross_layer_stride_order: tuple[int, ...]
    supports_cross_layer: bool
    supports_kv_connector: bool
    #: K/V parts of the first blocks of the first layers, all heads together.
    regions: tuple[Region, ...]
    #: The same, one region per KV head (what the picture draws).
    head_regions: tuple[Region, ...]

    @property
    def itemsize(self) -> int:
        return self.layout.itemsize

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "backend": self.backend,
            "layout": str(lay),
            "description": lay.describe(),
            "dtype": str(lay.dtype).removeprefix("torch."),
            "dim_names": list(lay.dim_names),
            "logical_shape": list(lay.logical_shape),
            "physical_dim_names": list(lay.physical_dim_names),
            "physical_shape": list(lay.physical_shape),
            "stride_order": list(lay.stride_order),
            "vllm_layout": vllm_layout_name(lay.stride_order),
            "logical_strides": list(lay.logical_strides()),
            "layer_shape": list(lay.layer_shape),
            "layer_strides": list(lay.logical_strides()[1:]),
            "per_layer_stride_order": list(self.per_layer_stride_order),
            "cross_layer_stride_order": list(self.cross_layer_stride_order),
            "is_blocks_first": lay.is_blocks_first,
            "is_cross_layer": lay.is_cross_layer,
            "supports_cross_layer": self.supports_cross_layer,
            "supports_kv_connector": self.supports_kv_connector,
            "page_size_bytes": lay.page_size_bytes,
            "total_bytes": lay.total_bytes,
            "regions": [{**asdict(r), "runs": [list(run) for run in r.runs]}
                        for r in self.regions],
        }


def _runs(base: int, free: list[tuple[int, int]], itemsize: int) -> tuple[tuple[int, int], ...]:
    """Byte runs covered by ``base + sum(i_k * stride_k)`` over free dims ``(size, stride)``
    (strides in elements), merged where adjacent."""
    dims = sorted((stride, size) for size, stride in free if size > 1)
    run = 1  # elements: the innermost dims that are dense form one run
    inner = 0
    while inner < len(dims) and dims[inner][0] == run:
        run *= dims[inner][1]
        inner += 1
    outer = dims[inner:]
    starts = sorted(base + sum(i * stride for i, (stride, _) in zip(idx, outer, strict=True))
                    for idx in itertools.product(*(range(size) for _, size in outer)))
    merged: list[list[int]] = []
    for start in starts:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += run
        else:
            merged.append([start, run])
    return tuple((s * itemsize, n * itemsize) for s, n in merged)


def _regions(layout: KVCacheLayout, layers: int, blocks: int, per_head: bool
             ) -> tuple[Region, ...]:
    names = layout.dim_names
    sizes = dict(zip(names, layout.logical_shape, strict=True))
    strides = dict(zip(names, layout.logical_strides(), strict=True))
    parts = ("K", "V") if "2" in names else ("KV",)
    heads = range(sizes["H"]) if per_head and "H" in names else (None,)
    regions = []
    for layer, block, (p, part), head in itertools.product(
            range(layers), range(blocks), enumerate(parts), heads):
        fixed = {"L": layer, "B": block, "2": p, "H": head}
        base = sum(strides[n] * fixed[n] for n in names if fixed.get(n) is not None)
        free = [(sizes[n], strides[n]) for n in names if fixed.get(n) is None]
        regions.append(Region(layer, block, part, head, _runs(base, free, layout.itemsize)))
    return tuple(regions)


def describe_layout(
    backend: type[AttentionBackend] | str,
    *,
    num_layers: int = 4,
    num_blocks: int = 8,
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_size: int = 128,
    dtype: torch.dtype | str = torch.bfloat16,
    cross_layer: bool = False,
    show_layers: int = 4,
    show_blocks: int = 3,
    vllm_layout: str | None = None,
) -> LayoutView:
    """The layout :func:`kvcore.allocate_kv_caches` would give ``backend`` for these sizes
    (with ``vllm_layout``, vLLM's named layout, as :func:`kvcore.adopt_kv_caches` adopts it).

    ``cross_layer=True`` asks for the backend's cross-layer order (``ValueError`` naming the
    backend if it does not opt in). Regions are computed for the first ``show_blocks`` blocks
    of the first ``show_layers`` layers. MLA backends take ``num_kv_heads=1`` and the latent
    size as ``head_size``. Nothing is allocated.
    """
    if isinstance(backend, str):
        backend = resolve_backend(backend)
    for name, value in (("show_layers", show_layers), ("show_blocks", show_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    layout = KVCacheLayout.from_backend(
        backend, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=parse_dtype(dtype), num_layers=num_layers,
        cross_layer=cross_layer)
    if vllm_layout is not None:
        layout = KVCacheLayout(layout.logical_shape, vllm_layout_order(vllm_layout),
                               layout.dim_names, layout.dtype)
    layers, blocks = min(show_layers, num_layers), min(show_blocks, num_blocks)
    return LayoutView(
        backend=backend.get_name(),
        layout=layout,
        per_layer_stride_order=tuple(backend.get_kv_cache_stride_order(False)),
        cross_layer_stride_order=tuple(backend.get_kv_cache_stride_order(True)),
        supports_cross_layer=backend.supports_cross_layer(),
        supports_kv_connector=backend.supports_kv_connector(),
        regions=_regions(layout, layers, blocks, per_head=False),
        head_regions=_regions(layout, layers, blocks, per_head=True),
    )


def _shape(names: tuple[str, ...], shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True)) + ")"


def format_layout(view: LayoutView) -> str:
    """The text ``kvcore layout`` prints: flat ``key: value`` lines, then the block table."""
    from tabulate import tabulate

    lay = view.layout
    strides = lay.logical_strides()
    # describe() names the kind (cross-layer, blocks-first, ...); a per-layer one adds where
    # the layers are.
    lines = [
        f"backend: {view.backend}",
        f"layout: {lay} = {lay.describe()}"
        + ("" if lay.is_cross_layer else "; per-layer: layers outermost"),
        "dims: " + ", ".join(f"{n}={_DIM_MEANING.get(n, n)}" for n in dict.fromkeys(
            lay.dim_names)),
        f"logical shape: {_shape(lay.dim_names, lay.logical_shape)}",
        f"physical shape: {_shape(lay.physical_dim_names, lay.physical_shape)}",
        f"stride order: {lay.stride_order} (backend: per layer "
        f"{view.per_layer_stride_order}, with layers {view.cross_layer_stride_order})",
        f"vLLM name: {vllm_layout_name(lay.stride_order) or 'none (K and V halves apart)'}",
        f"logical strides (elements): {_shape(lay.dim_names, strides)}",
        f"layer view: kv_caches.layers[i] shape {tuple(lay.layer_shape)} "
        f"strides {tuple(strides[1:])}",
        f"blocks-first: {'yes' if lay.is_blocks_first else 'no'}; cross-layer capable: "
        f"{'yes' if view.supports_cross_layer else 'no'}; KV connectors: "
        f"{'yes' if view.supports_kv_connector else 'no'}",
        f"page: {lay.page_size_bytes} B (one block of one layer); block of all layers: "
        f"{lay.num_layers * lay.page_size_bytes} B; total {lay.total_bytes} B",
        "",
        "where the first blocks lie (byte offsets from the start of the allocation, in memory "
        "order):",
    ]
    rows = [[r.block, r.layer, r.part, r.start, r.end, r.num_bytes,
             "yes" if r.contiguous else f"no ({len(r.runs)} runs)"]
            for r in sorted(view.regions, key=lambda r: r.start)]
    lines.append(tabulate(rows, headers=["block", "layer", "part", "start", "end", "bytes",
                                         "contiguous"]))
    return "\n".join(lines)


def _kib(num_bytes: float) -> str:
    if num_bytes >= 1 << 20:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    if num_bytes >= 1 << 10:
        return f"{num_bytes / (1 << 10):g} KiB"
    return f"{num_bytes:g} B"


def _block_sentence(lay: KVCacheLayout) -> str:
    """What moving one block costs in this layout (the point of the picture)."""
    page = _kib(lay.page_size_bytes)
    if lay.is_cross_layer:
        return (f"a block of every layer ({lay.num_layers} pages) is one contiguous run of "
                f"{_kib(lay.num_layers * lay.page_size_bytes)}: one copy per block")
    if lay.is_blocks_first:
        return (f"a block is {lay.num_layers} pages of {page}, one per layer, "
                f"{_kib(lay.num_blocks * lay.page_size_bytes)} apart: one copy per layer")
    return ("not blocks-first: the K and V of a block lie apart, so a block is no "
            "contiguous page and KV connectors cannot move it")


def plot_layout(view: LayoutView, path: str | Path) -> Path:
    """Draw :func:`layout_figure` into the PNG ``path``."""
    from kvcore.cli.plotting import save_figure

    return save_figure(layout_figure(view), path)


def layout_figure(view: LayoutView) -> Figure:
    """The memory map of :attr:`LayoutView.head_regions`.

    Rows are consecutive pages of the allocation (page = one block of one layer); pages
    holding none of the shown blocks are elided and marked with the number skipped. Colour
    is the layer, K is solid and V a lighter tint, hatched; odd KV heads are darker than even
    ones, in K and V alike.
    """
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle

    from kvcore.cli.plotting import new_figure

    lay = view.layout
    page = lay.page_size_bytes
    # Each run split at page boundaries, as (row, x0, width, region).
    pieces = []
    for region in view.head_regions:
        for start, length in region.runs:
            pos, end = start, start + length
            while pos < end:
                row, x0 = divmod(pos, page)
                width = min(end, (row + 1) * page) - pos
                pieces.append((row, x0, width, region))
                pos += width
    rows = sorted({p[0] for p in pieces})
    # Display position of each page, with one spacer line where pages are skipped.
    y_of: dict[int, float] = {}
    gaps: list[tuple[float, int]] = []
    y = 0.0
    for i, row in enumerate(rows):
        if i and row != rows[i - 1] + 1:
            gaps.append((y, row - rows[i - 1] - 1))
            y += 1
        y_of[row] = y
        y += 1
    height = y
    fig = new_figure(12, 1.9 + 0.38 * height)
    ax = fig.add_subplot()
    colors = [to_rgb(c) for c in ("tab:blue", "tab:orange", "tab:green", "tab:red",
                                  "tab:purple", "tab:brown", "tab:pink", "tab:olive")]

    def color(layer: int, part: str, head: int | None) -> tuple[float, ...]:
        # V is a lighter tint of the layer's colour (opaque, so that the head shading stays
        # visible under the hatching); odd KV heads are darker.
        base = colors[layer % len(colors)]
        if part == "V":
            base = tuple(0.45 + 0.55 * c for c in base)
        shade = 0.72 if (head or 0) % 2 else 1.0
        return tuple(c * shade for c in base)

    for row, x0, width, r in pieces:
        ax.add_patch(Rectangle((x0, y_of[row] + 0.08), width, 0.84,
                               facecolor=color(r.layer, r.part, r.head), edgecolor="none",
                               hatch="///" if r.part == "V" else None))
    # One label per (layer, block, part) and row, where its pieces in the row are contiguous.
    spans: dict[tuple[int, int, int, str], list[tuple[float, float]]] = {}
    for row, x0, width, r in pieces:
        spans.setdefault((row, r.layer, r.block, r.part), []).append((x0, x0 + width))
    for (row, layer, block, part), segs in spans.items():
        lo, hi = min(s for s, _ in segs), max(e for _, e in segs)
        if sum(e - s for s, e in segs) == hi - lo and hi - lo >= 0.08 * page:
            ax.text((lo + hi) / 2, y_of[row] + 0.5, f"L{layer} B{block} {part}",
                    ha="center", va="center", fontsize=9, color="black",
                    bbox={"facecolor": "white", "alpha": 0.75, "pad": 1.5,
                          "edgecolor": "none"})
    for gap_y, skipped in gaps:
        ax.text(page / 2, gap_y + 0.5, f"... {skipped} page{'s' if skipped > 1 else ''} "
                "not shown ...", ha="center", va="center", fontsize=9, style="italic",
                color="0.35")
    ax.set_xlim(0, page)
    ax.set_ylim(height, 0)
    ax.set_yticks([y_of[r] + 0.5 for r in rows],
                  [f"page {r}  (+{_kib(r * page)})" for r in rows], fontsize=8)
    ticks = [page * f for f in (0, 0.25, 0.5, 0.75, 1)]
    ax.set_xticks(ticks, [_kib(t) for t in ticks])
    ax.set_xlabel(f"byte offset within the page (page = one block of one layer = "
                  f"{_kib(page)})")
    shown_layers = sorted({r.layer for r in view.head_regions})
    shown_blocks = sorted({r.block for r in view.head_regions})
    kind = "cross-layer" if lay.is_cross_layer else "per-layer"
    ax.set_title(
        f"{view.backend}, {kind} KV cache: physical order {lay}, "
        f"{str(lay.dtype).removeprefix('torch.')}\n"
        f"logical {_shape(lay.dim_names, lay.logical_shape)}; blocks "
        f"{shown_blocks[0]}-{shown_blocks[-1]} of layers {shown_layers[0]}-{shown_layers[-1]}"
        f" in memory order, top to bottom\n{_block_sentence(lay)}", fontsize=10)
    handles = [Patch(facecolor=colors[i % len(colors)], label=f"layer {i}")
               for i in shown_layers]
    first = shown_layers[0]
    if any(r.part == "K" for r in view.head_regions):
        handles += [Patch(facecolor=color(first, "K", 0), label="K"),
                    Patch(facecolor=color(first, "V", 0), hatch="///", label="V (lighter)")]
    if any(r.head for r in view.head_regions):
        handles += [Patch(facecolor=color(first, "K", 0), label="even KV head"),
                    Patch(facecolor=color(first, "K", 1), label="odd KV head (darker)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              frameon=False)
    return fig
