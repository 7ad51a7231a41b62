"""``kvcore layout``: the byte ranges it reports are where an allocation really puts each
block's K and V, and its text, JSON and picture are produced."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kvcore
from kvcore.cli import main as kvcore_cli
from kvcore.cli.layout_view import describe_layout

SIZES = {"num_layers": 3, "num_blocks": 5, "block_size": 4, "num_kv_heads": 2, "head_size": 8}


class _TestBackend(kvcore.AttentionBackend):
    PLATFORMS = ("cpu",)
    SUPPORTED_DTYPES = (torch.float32,)

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("layout-only test backend")


def _backend(name: str, doc: str, *, orders: tuple[tuple[int, ...], ...] | None = None,
             legacy: bool = False) -> type[kvcore.AttentionBackend]:
    """A layout-only test backend named ``name``: ``orders`` its (per-layer, cross-layer)
    stride orders; ``legacy`` the ``(2, num_blocks, ...)`` shape, which opts out of
    connectors."""
    attrs: dict = {"__doc__": doc, "get_name": staticmethod(lambda: name)}
    if orders is not None:
        attrs["get_kv_cache_stride_order"] = staticmethod(
            lambda include_num_layers_dimension=False: orders[include_num_layers_dimension])
    if legacy:
        attrs["get_kv_cache_shape"] = staticmethod(
            lambda num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto":
            (2, num_blocks, block_size, num_kv_heads, head_size))
        attrs["supports_kv_connector"] = classmethod(lambda cls: False)
    return type(name, (_TestBackend,), attrs)


HndBackend = _backend("TEST_HND", "Pages HND (``B,2,H,N,D``), cross-layer capable.",
                      orders=((0, 1, 3, 2, 4), (1, 0, 2, 4, 3, 5)))
TokenInterleavedBackend = _backend(
    "TEST_INTERLEAVED", "K and V interleaved per token (``B,N,2,H,D``): blocks-first, but "
    "halves not contiguous.", orders=((0, 2, 1, 3, 4), (0, 1, 3, 2, 4, 5)))
LegacyBackend = _backend("TEST_LEGACY", "The legacy ``(2, num_blocks, ...)`` shape: not "
                         "blocks-first, so no connectors.", legacy=True)


CASES = [("CPU_ATTN", False), ("CPU_ATTN", True), (HndBackend, False), (HndBackend, True),
         (TokenInterleavedBackend, False), (LegacyBackend, False)]


def _id(case) -> str:
    backend, cross = case
    name = backend if isinstance(backend, str) else backend.get_name()
    return f"{name}-{'cross' if cross else 'per_layer'}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_regions_are_the_bytes_the_allocation_gives_each_part(case):
    backend, cross = case
    view = describe_layout(backend, dtype=torch.float32, cross_layer=cross, show_layers=3,
                           show_blocks=5, **SIZES)
    kv = kvcore.allocate_kv_caches(backend, dtype=torch.float32, device="cpu",
                                   cross_layer=cross, **SIZES)
    assert kv.layout == view.layout
    # Label every element of the storage with its own byte offset, then read the labels
    # back through the logical per-layer views the kernels get.
    offsets = torch.arange(kv.storage.numel(), dtype=torch.int64).view(kv.storage.shape) * 4
    labelled = offsets.permute(kv.layout.inverse_stride_order())
    names = view.layout.layer_dim_names
    assert view.regions and view.head_regions
    for region in (*view.regions, *view.head_regions):
        index = [slice(None)] * len(names)
        index[names.index("B")] = region.block
        index[names.index("2")] = "KV".index(region.part)
        if region.head is not None:
            index[names.index("H")] = region.head
        expected = sorted(labelled[region.layer][tuple(index)].flatten().tolist())
        covered = [start + i for start, n in region.runs for i in range(0, n, 4)]
        assert covered == expected, region


def test_cross_layer_puts_all_layers_of_a_block_in_one_run():
    view = describe_layout("CPU_ATTN", dtype=torch.float32, cross_layer=True, **SIZES)
    page = view.layout.page_size_bytes
    block0 = sorted((r for r in view.regions if r.block == 0), key=lambda r: r.start)
    assert block0[0].start == 0 and block0[-1].end == SIZES["num_layers"] * page
    assert all(r.contiguous for r in view.regions)


def test_interleaved_and_legacy_layouts_are_reported_as_they_are():
    interleaved = describe_layout(TokenInterleavedBackend, dtype=torch.float32, **SIZES)
    assert str(interleaved.layout) == "L,B,N,2,H,D" and interleaved.layout.is_blocks_first
    assert all(len(r.runs) == SIZES["block_size"] for r in interleaved.regions)
    legacy = describe_layout(LegacyBackend, dtype=torch.float32, **SIZES)
    assert str(legacy.layout) == "L,2,B,N,H,D" and not legacy.layout.is_blocks_first
    k0, v0 = (r for r in legacy.regions if r.layer == 0 and r.block == 0)
    assert v0.start - k0.start == SIZES["num_blocks"] * legacy.layout.page_size_bytes // 2


def test_cross_layer_needs_a_backend_that_opts_in():
    with pytest.raises(ValueError, match="TEST_LEGACY does not opt in to cross-layer"):
        describe_layout(LegacyBackend, dtype=torch.float32, cross_layer=True, **SIZES)


def test_layout_command_prints_shapes_strides_and_the_named_dims(capsys):
    assert kvcore_cli(["layout", "CPU_ATTN", "--cross-layer"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "layout: B,L,2,N,H,D = B=8 x L=4 x 2=2 x N=16 x H=2 x D=128 (bfloat16, cross-layer, "
        "page 16384 B)\n",
        "logical shape: (L=4, B=8, 2=2, N=16, H=2, D=128)",
        "physical shape: (B=8, L=4, 2=2, N=16, H=2, D=128)",
        "logical strides (elements): (L=8192, B=32768, 2=4096, N=256, H=128, D=1)",
        "layer view: kv_caches.layers[i] shape (8, 2, 16, 2, 128) strides "
        "(32768, 4096, 256, 128, 1)",
    ):
        assert expected in out
    assert out.count("cross-layer") == 2  # the layout line and "cross-layer capable"


def test_layout_json_has_the_layout_fields(capsys):
    assert kvcore_cli(["layout", "CPU_ATTN", "--format", "json", "--num-layers", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"] == "L,B,2,N,H,D" and not data["is_cross_layer"]
    assert data["logical_shape"] == [2, 8, 2, 16, 2, 128]
    assert data["page_size_bytes"] == 2 * 16 * 2 * 128 * 2  # bfloat16
    assert data["total_bytes"] == math.prod(data["logical_shape"]) * 2
    assert {"block", "layer", "part", "runs"} <= set(data["regions"][0])


def test_layout_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    assert kvcore_cli(["layout", "CPU_ATTN", "--cross-layer", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    assert f"wrote {path}" in capsys.readouterr().err


def test_layout_plot_shades_odd_kv_heads_in_k_and_v_as_its_legend_says():
    pytest.importorskip("matplotlib")
    from kvcore.cli.layout_view import layout_figure

    view = describe_layout("CPU_ATTN", num_layers=1, num_blocks=1, num_kv_heads=2,
                           show_blocks=1)
    fig = layout_figure(view)
    ax = fig.axes[0]
    # Patches in drawing order: one per piece of view.head_regions (in that order here, one
    # page per row, since a page holds the block of the single layer).
    colours: dict[tuple[str, int], set[tuple[float, ...]]] = {}
    pieces = [(r.part, r.head) for r in view.head_regions for _ in r.runs]
    for (part, head), patch in zip(pieces, ax.patches, strict=True):
        *rgb, alpha = patch.get_facecolor()  # as seen over the white background
        colours.setdefault((part, head), set()).add(
            tuple(round(alpha * c + 1 - alpha, 6) for c in rgb))
    assert all(len(c) == 1 for c in colours.values())
    for part in ("K", "V"):  # the striping shows in both halves, clearly
        (even,), (odd,) = colours[(part, 0)], colours[(part, 1)]
        assert max(abs(a - b) for a, b in zip(even, odd, strict=True)) > 0.15, part
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "odd KV head (darker)" in labels and "even KV head" in labels


def test_layout_plot_refuses_a_file_that_is_not_png(tmp_path, capsys):
    assert kvcore_cli(["layout", "CPU_ATTN", "--plot", str(tmp_path / "x.jpg")]) == 2
    assert "must end in .png" in capsys.readouterr().err


def test_unknown_backend_lists_the_valid_names(capsys):
    assert kvcore_cli(["layout", "NOPE_ATTN"]) == 2
    assert "CPU_ATTN" in capsys.readouterr().err
