"""KVCacheLayout: construction, derived shapes, serialisation, compatibility."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcore
from kvcore import KVCacheLayout
from kvcore.layout import KV_DIM_NAMES

pytestmark = pytest.mark.platform_matrix

CPU = kvcore.resolve_backend("CPU_ATTN")


@st.composite
def layouts(draw):
    with_layers = draw(st.booleans())
    shape = [draw(st.integers(1, 6)) for _ in KV_DIM_NAMES]
    names = list(KV_DIM_NAMES)
    if with_layers:
        shape.insert(0, draw(st.integers(1, 4)))
        names.insert(0, "L")
    order = draw(st.permutations(range(len(shape))))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32,
                                  torch.float8_e4m3fn]))
    return KVCacheLayout(tuple(shape), tuple(order), tuple(names), dtype)


@given(layouts())
def test_round_trips_through_dict(layout):
    again = KVCacheLayout.from_dict(layout.to_dict())
    assert again == layout and not layout.differences(again)


@given(layouts())
def test_physical_and_logical_views_agree(layout):
    physical = torch.arange(math.prod(layout.physical_shape)).reshape(layout.physical_shape)
    logical = physical.permute(layout.inverse_stride_order())
    assert tuple(logical.shape) == layout.logical_shape
    assert logical.stride() == layout.logical_strides()
    assert tuple(logical.permute(layout.stride_order).shape) == layout.physical_shape
    assert str(layout) == ",".join(layout.dim_names[d] for d in layout.stride_order)


@given(layouts())
def test_blocks_first_means_each_block_is_one_run(layout):
    if not layout.is_blocks_first:
        return
    physical = torch.arange(math.prod(layout.physical_shape)).reshape(layout.physical_shape)
    logical = physical.permute(layout.inverse_stride_order())
    layer = logical[0] if layout.has_layer_dim else logical
    block = layer[0].reshape(-1)
    page_elems = layout.page_size_bytes // layout.itemsize
    # the elements of block 0 of layer 0 are exactly one contiguous range
    assert sorted(block.tolist()) == list(range(int(block.min()), int(block.min()) + page_elems))


@pytest.mark.parametrize(
    ("order", "message"),
    [((0, 1, 2, 3), "stride_order=(0, 1, 2, 3) is not a permutation of range(5)"),
     ((0, 1, 1, 3, 4), "stride_order=(0, 1, 1, 3, 4) is not a permutation of range(5)")],
    ids=["too-short", "repeated-dim"],
)
def test_stride_order_must_be_a_permutation(order, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KVCacheLayout((4, 2, 16, 8, 64), order, KV_DIM_NAMES, torch.bfloat16)


def test_shape_whose_dim0_is_not_the_block_is_rejected():
    with pytest.raises(ValueError, match="not blocks-first: dim 0 of a layer's cache"):
        KVCacheLayout((16, 4, 2, 8, 64), (0, 1, 2, 3, 4), ("N", "B", "2", "H", "D"),
                      torch.bfloat16)


def test_cpu_backend_layout_standard_and_cross_layer():
    per_layer = KVCacheLayout.from_backend(CPU, num_blocks=10, block_size=16, num_kv_heads=8,
                                           head_size=64, dtype=torch.bfloat16)
    assert per_layer.logical_shape == (10, 2, 16, 8, 64) and str(per_layer) == "B,2,N,H,D"
    assert per_layer.page_size_bytes == 2 * 16 * 8 * 64 * 2
    assert per_layer.is_blocks_first and not per_layer.is_cross_layer
    cross = KVCacheLayout.from_backend(CPU, num_blocks=10, block_size=16, num_kv_heads=8,
                                       head_size=64, dtype=torch.bfloat16, num_layers=3,
                                       cross_layer=True)
    assert str(cross) == "B,L,2,N,H,D" and cross.physical_shape == (10, 3, 2, 16, 8, 64)
    assert cross.is_cross_layer and cross.layer_shape == per_layer.logical_shape
    stacked = KVCacheLayout.from_backend(CPU, num_blocks=10, block_size=16, num_kv_heads=8,
                                         head_size=64, dtype=torch.bfloat16, num_layers=3)
    assert str(stacked) == "L,B,2,N,H,D" and not stacked.is_cross_layer


def test_hnd_stride_order_is_blocks_first_but_not_nhd():
    hnd = KVCacheLayout((10, 2, 16, 8, 64), (0, 1, 3, 2, 4), KV_DIM_NAMES, torch.float16)
    assert str(hnd) == "B,2,H,N,D" and hnd.is_blocks_first
    assert hnd.describe() == ("B=10 x 2=2 x H=8 x N=16 x D=64 (float16, blocks-first, "
                              "page 32768 B)")


def test_kv_first_physical_order_is_not_blocks_first():
    kv_first = KVCacheLayout((10, 2, 16, 8, 64), (1, 0, 2, 3, 4), KV_DIM_NAMES, torch.float16)
    assert str(kv_first) == "2,B,N,H,D" and not kv_first.is_blocks_first


def test_differences_name_what_differs():
    nhd = KVCacheLayout((10, 2, 16, 8, 64), (0, 1, 2, 3, 4), KV_DIM_NAMES, torch.float16)
    hnd = KVCacheLayout((12, 2, 16, 8, 64), (0, 1, 3, 2, 4), KV_DIM_NAMES, torch.bfloat16)
    assert nhd.differences(hnd) == [
        "B size 10 vs 12", "physical order B,2,N,H,D vs B,2,H,N,D",
        "dtype torch.float16 vs torch.bfloat16"]
    assert nhd.differences(hnd, ignore_num_blocks=True)[0] == (
        "physical order B,2,N,H,D vs B,2,H,N,D")
    with pytest.raises(kvcore.LayoutMismatchError, match="local B=10 .* remote B=12"):
        nhd.check_compatible(hnd)


def test_from_dict_rejects_other_versions_and_missing_fields():
    data = KVCacheLayout((1, 2, 16, 1, 8), (0, 1, 2, 3, 4), KV_DIM_NAMES, torch.float32).to_dict()
    with pytest.raises(ValueError, match="layout version 99 is not supported"):
        KVCacheLayout.from_dict({**data, "version": 99})
    with pytest.raises(ValueError, match=r"lacks \['dtype'\]"):
        KVCacheLayout.from_dict({k: v for k, v in data.items() if k != "dtype"})


def _deep(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("field, value", [
    ("logical_shape", [float("inf"), 2, 16, 1, 8]),  # JSON Infinity
    ("logical_shape", [float("nan"), 2, 16, 1, 8]),
    ("logical_shape", [1.0, 2, 16, 1, 8]),
    ("logical_shape", [True, 2, 16, 1, 8]),
    ("logical_shape", [-1, 2, 16, 1, 8]),
    ("logical_shape", [2**70, 2, 16, 1, 8]),
    ("logical_shape", [2**40, 2, 2**20, 1, 8]),  # each fits, the product does not
    ("logical_shape", [1, 2]),
    ("logical_shape", _deep(50_000)),
    ("logical_shape", "1,2,16,1,8"),
    ("stride_order", [0, 1, 2, 3, float("inf")]),
    ("stride_order", [0, 1, 2, 3, 9]),
    ("stride_order", _deep(50_000)),
    ("dim_names", _deep(50_000)),
    ("dim_names", ["B", "2", "N", "H", 4]),
    ("dim_names", ["B", "2", "N", "H", "D" * 10_000]),
    ("dtype", _deep(50_000)),
    ("dtype", float("inf")),
    ("dtype", "f" * 10_000),
    ("version", float("inf")),
    ("version", True),
    ("version", _deep(50_000)),
], ids=lambda v: str(v)[:20] if not isinstance(v, list) or len(v) > 1 else "deep")
def test_from_dict_refuses_malformed_data_with_a_value_error_naming_the_field(field, value):
    data = KVCacheLayout((1, 2, 16, 1, 8), (0, 1, 2, 3, 4), KV_DIM_NAMES, torch.float32).to_dict()
    with pytest.raises(ValueError, match=field.replace("_", ".")) as info:
        KVCacheLayout.from_dict({**data, field: value})
    assert len(str(info.value)) < 500


@pytest.mark.parametrize("data", [None, [1, 2], "layout", _deep(50_000)],
                         ids=["none", "list", "str", "deep"])
def test_from_dict_refuses_what_is_not_a_dict(data):
    with pytest.raises(ValueError, match="must be a dict from KVCacheLayout.to_dict"):
        KVCacheLayout.from_dict(data)


def test_cross_layer_requires_the_backend_to_opt_in():
    class NoCross(CPU):  # type: ignore[misc,valid-type]
        @staticmethod
        def get_name():
            return "NO_CROSS"

        # The base class's order: the layer dim outermost, no cross-layer.
        get_kv_cache_stride_order = staticmethod(kvcore.AttentionBackend.get_kv_cache_stride_order)

    with pytest.raises(ValueError, match="backend NO_CROSS does not opt in to cross-layer"):
        KVCacheLayout.from_backend(NoCross, num_blocks=4, block_size=16, num_kv_heads=1,
                                   head_size=8, dtype=torch.float32, num_layers=2,
                                   cross_layer=True)


def test_backend_returning_bad_stride_order_is_named():
    class Bad(CPU):  # type: ignore[misc,valid-type]
        @staticmethod
        def get_name():
            return "BAD_ORDER"

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            return (0, 1, 2)

    with pytest.raises(ValueError, match="backend BAD_ORDER: get_kv_cache_stride_order returned"):
        KVCacheLayout.from_backend(Bad, num_blocks=4, block_size=16, num_kv_heads=1,
                                   head_size=8, dtype=torch.float32)


def test_legacy_shape_must_opt_out_of_connectors():
    class Legacy(CPU):  # type: ignore[misc,valid-type]
        @staticmethod
        def get_name():
            return "LEGACY"

        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                               cache_dtype_str="auto"):
            return (2, num_blocks, block_size, num_kv_heads, head_size)

    with pytest.raises(ValueError, match="dim 0 is not the block dim, but "
                                         r"supports_kv_connector\(\) is True"):
        KVCacheLayout.from_backend(Legacy, num_blocks=4, block_size=16, num_kv_heads=1,
                                   head_size=8, dtype=torch.float32)


def test_kv_cache_specs_page_sizes():
    full = kvcore.FullAttentionSpec(block_size=16, dtype=torch.bfloat16, num_kv_heads=8,
                                    head_size=128)
    assert full.page_size_bytes == 2 * 16 * 8 * 128 * 2
    fp8 = kvcore.FullAttentionSpec(block_size=16, dtype=torch.bfloat16, kv_cache_dtype="fp8",
                                   num_kv_heads=8, head_size=128)
    assert fp8.page_size_bytes == full.page_size_bytes // 2
    mla = kvcore.MLAAttentionSpec(block_size=64, dtype=torch.bfloat16)
    assert mla.head_size == 576 and mla.page_size_bytes == 64 * 576 * 2
    with pytest.raises(ValueError, match="num_kv_heads=0 must be a positive integer"):
        kvcore.FullAttentionSpec(block_size=16, dtype=torch.bfloat16, num_kv_heads=0)
