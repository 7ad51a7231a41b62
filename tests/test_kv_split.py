"""kvcore.KVSplit: the same K/V view objects while a layer's cache is the same tensor, new ones
when the cache or its address, shape, strides or dtype change; impls keep one per layer."""

from __future__ import annotations

import pytest
import torch

import kvcore


def _cache(num_blocks: int = 4, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(num_blocks, 2, 16, 2, 8).to(dtype)


def _views_of(halves: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
              dim: int = 1) -> bool:
    """Whether ``halves`` are ``kv_cache.unbind(dim)``: same addresses, shapes, strides."""
    return all(h.data_ptr() == e.data_ptr() and h.shape == e.shape and h.stride() == e.stride()
               and h.dtype == e.dtype for h, e in zip(halves, kv_cache.unbind(dim), strict=True))


def test_same_cache_gives_the_same_view_objects():
    split, kv = kvcore.KVSplit(), _cache()
    first = split.split(kv)
    assert _views_of(first, kv)
    again = split.split(kv)
    assert again is first and again[0] is first[0] and again[1] is first[1]


@pytest.mark.parametrize("change", ["other tensor", "shape", "strides", "address", "dtype"])
def test_a_changed_cache_gets_new_views(change):
    split, kv = kvcore.KVSplit(), _cache()
    first = split.split(kv)
    if change == "other tensor":
        kv = kv.clone()  # same shape, strides and dtype; another object
    elif change == "shape":
        kv.resize_(2, 2, 16, 2, 8)
    elif change == "strides":  # same shape, heads and head dim swapped in memory
        kv.as_strided_(kv.shape, (512, 256, 16, 1, 2))
    elif change == "address":
        kv.data = _cache()
    else:
        kv.data = kv.view(torch.int16)
    new = split.split(kv)
    assert new is not first and new[0] is not first[0] and new[1] is not first[1]
    assert _views_of(new, kv)
    assert split.split(kv) is new


def test_only_the_last_cache_is_kept():
    split, a, b = kvcore.KVSplit(), _cache(), _cache()
    first = split.split(a)
    split.split(b)
    assert split.split(a) is not first


def test_halves_hook_splits_another_layout_once_per_cache():
    calls = []

    class Legacy(kvcore.KVSplit):
        __slots__ = ()

        def halves(self, kv_cache):
            calls.append(kv_cache)
            return kv_cache.unbind(0)

    split, kv = Legacy(), torch.zeros(2, 4, 16, 2, 8)
    first = split.split(kv)
    assert split.split(kv) is first and len(calls) == 1
    assert _views_of(first, kv, dim=0)


def test_impl_keeps_one_split_per_layer():
    impl_cls = kvcore.TritonAttentionImpl
    layer_a, layer_b = impl_cls(4, 8, 0.125, 2), impl_cls(4, 8, 0.125, 2)
    kv_a, kv_b = _cache(), _cache()
    halves_a, halves_b = layer_a.split_kv(kv_a), layer_b.split_kv(kv_b)
    assert layer_a.split_kv(kv_a) is halves_a and layer_b.split_kv(kv_b) is halves_b
    assert _views_of(halves_a, kv_a) and _views_of(halves_b, kv_b)
