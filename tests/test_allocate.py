"""allocate_kv_caches: physical order, shared storage, isolation between layers, block views."""

from __future__ import annotations

import pytest
import torch

import kvcore

pytestmark = pytest.mark.platform_matrix

SIZES = dict(num_layers=3, num_blocks=7, block_size=16, num_kv_heads=2, head_size=8)


def _alloc(cross_layer, dtype=torch.bfloat16, kv_cache_dtype="auto"):
    return kvcore.allocate_kv_caches("CPU_ATTN", **SIZES, dtype=dtype, device="cpu",
                                     cross_layer=cross_layer, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross-layer", "stacked"])
def test_layers_are_views_of_one_storage(cross_layer):
    caches = _alloc(cross_layer)
    assert caches.is_cross_layer is cross_layer
    assert caches.storage.is_contiguous()
    assert tuple(caches.storage.shape) == caches.layout.physical_shape
    for layer in caches.layers:
        assert tuple(layer.shape) == (7, 2, 16, 2, 8)
        assert layer.untyped_storage().data_ptr() == caches.storage.untyped_storage().data_ptr()


def test_auto_follows_the_backend_opt_in():
    assert _alloc("auto").is_cross_layer  # CPU_ATTN opts in


@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross-layer", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_writing_one_layers_block_changes_no_other_byte(cross_layer, dtype):
    caches = _alloc(cross_layer, dtype)
    caches.storage.copy_(torch.randn(caches.storage.shape).to(dtype))
    before = caches.storage.clone()
    caches.layers[1][4] = torch.randn(caches.layers[1][4].shape).to(dtype)
    as_int = torch.int32 if dtype == torch.float32 else torch.int16  # bitwise comparison
    changed = caches.storage.view(as_int) != before.view(as_int)
    logical_changed = changed.permute(caches.layout.inverse_stride_order())
    # only layer 1, block 4 differs
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 4] = True
    flat = logical_changed.reshape(3, 7, -1).any(-1)
    assert torch.equal(flat, mask)


def test_block_view_cross_layer_rows_are_whole_blocks():
    caches = _alloc(True)
    rows = caches.block_view()
    page = caches.page_size_bytes
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (7, 3 * page)
    caches.layers[2][5].copy_(torch.randn(2, 16, 2, 8).to(torch.bfloat16))
    expected = caches.layers[2][5].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(rows[5, 2 * page:], expected)
    assert torch.equal(caches.block_view(2)[5], expected)


def test_block_view_per_layer_on_stacked_cache():
    caches = _alloc(False)
    view = caches.block_view(1)
    assert tuple(view.shape) == (7, caches.page_size_bytes)
    view[3] = torch.randint(0, 255, (caches.page_size_bytes,), dtype=torch.uint8)
    assert torch.equal(caches.layers[1][3].contiguous().view(torch.uint8).reshape(-1), view[3])
    with pytest.raises(ValueError, match="this cache is not cross-layer .* pass layer=0..2"):
        caches.block_view()
    with pytest.raises(ValueError, match=r"layer=3 is out of range \(0..2\)"):
        caches.block_view(3)


def test_fp8_cache_storage_dtype_and_page_size():
    caches = _alloc(True, torch.bfloat16, "fp8")
    assert caches.storage.dtype == torch.float8_e4m3fn
    assert caches.page_size_bytes == 2 * 16 * 2 * 8


def test_cross_layer_true_with_backend_that_does_not_opt_in():
    class NoCross(kvcore.resolve_backend("CPU_ATTN")):  # type: ignore[misc]
        @staticmethod
        def get_name():
            return "NO_CROSS"

        # The base class's order: the layer dim outermost, no cross-layer.
        get_kv_cache_stride_order = staticmethod(kvcore.AttentionBackend.get_kv_cache_stride_order)

    with pytest.raises(ValueError, match="backend NO_CROSS does not opt in to cross-layer"):
        kvcore.allocate_kv_caches(NoCross, **SIZES, dtype=torch.float32, device="cpu",
                                  cross_layer=True)
    assert not kvcore.allocate_kv_caches(NoCross, **SIZES, dtype=torch.float32,
                                         device="cpu").is_cross_layer


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [({"num_blocks": 0}, ValueError, "num_blocks=0 must be a positive integer"),
     ({"head_size": 8.0}, ValueError, "head_size=8.0 must be a positive integer"),
     ({"cross_layer": "yes"}, ValueError, "cross_layer='yes' must be True, False or 'auto'"),
     ({"dtype": "float13"}, ValueError, "dtype='float13' is not a known dtype"),
     ({"backend": "NOPE"}, ValueError, "unknown attention backend 'NOPE'"),
     ({"backend": 42}, TypeError, "backend must be an AttentionBackend subclass")],
    ids=["num_blocks", "head_size", "cross_layer", "dtype", "unknown-backend", "not-a-backend"],
)
def test_bad_arguments_are_named(override, error, message):
    kwargs = dict(backend="CPU_ATTN", **SIZES, dtype=torch.float32, device="cpu")
    kwargs.update(override)
    backend = kwargs.pop("backend")
    with pytest.raises(error, match=message):
        kvcore.allocate_kv_caches(backend, **kwargs)


def test_auto_honours_a_connector_that_prefers_per_layer_blocks():
    kwargs = dict(**SIZES, dtype=torch.float32, device="cpu")
    assert not kvcore.allocate_kv_caches("CPU_ATTN", **kwargs,
                                         prefer_cross_layer=False).is_cross_layer
    assert kvcore.allocate_kv_caches("CPU_ATTN", **kwargs, prefer_cross_layer=True).is_cross_layer
    # an explicit choice wins over the preference
    assert kvcore.allocate_kv_caches("CPU_ATTN", **kwargs, cross_layer=True,
                                     prefer_cross_layer=False).is_cross_layer


def test_declared_span_limit_refuses_a_larger_cache_before_allocating():
    class Int32Offsets(kvcore.resolve_backend("CPU_ATTN")):  # type: ignore[misc]
        MAX_KV_CACHE_SPAN = 2 * 16 * 2 * 8 * 5  # five blocks of one layer

        @staticmethod
        def get_name():
            return "INT32_OFFSETS"

    kwargs = dict(num_layers=3, block_size=16, num_kv_heads=2, head_size=8,
                  dtype=torch.float32, device="meta")
    stacked = kvcore.allocate_kv_caches(Int32Offsets, num_blocks=5, cross_layer=False, **kwargs)
    assert stacked.layout.layer_span() == Int32Offsets.MAX_KV_CACHE_SPAN
    with pytest.raises(ValueError, match=r"num_blocks=6: one layer's view of this L,B,2,N,H,D "
                                         r"cache would span 3072 elements, over INT32_OFFSETS's "
                                         r"MAX_KV_CACHE_SPAN of 2560; allocate at most 5 blocks "
                                         r"or use another backend"):
        kvcore.allocate_kv_caches(Int32Offsets, num_blocks=6, cross_layer=False, **kwargs)
    # cross-layer: a layer's view strides over every layer, so far fewer blocks fit
    with pytest.raises(ValueError, match=r"allocate at most 2 blocks \(or cross_layer=False\)"):
        kvcore.allocate_kv_caches(Int32Offsets, num_blocks=5, cross_layer=True, **kwargs)


def test_cross_layer_order_that_splits_pages_moves_whole_blocks_only():
    class KVOuter(kvcore.resolve_backend("CPU_ATTN")):  # type: ignore[misc]
        @staticmethod
        def get_name():
            return "KV_OUTER"

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            # B,2,L,N,H,D: all layers of a block are one run, but a layer's K and V are apart
            return (1, 2, 0, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

    caches = kvcore.allocate_kv_caches(KVOuter, **SIZES, dtype=torch.float32, device="cpu")
    assert str(caches.layout) == "B,2,L,N,H,D" and caches.is_cross_layer
    assert tuple(caches.block_view().shape) == (7, 3 * caches.page_size_bytes)
    with pytest.raises(ValueError, match="one layer's block is not one contiguous byte run; "
                                         "move whole blocks with layer=None"):
        caches.block_view(0)
