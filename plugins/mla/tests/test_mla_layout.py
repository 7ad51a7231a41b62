"""MLA cache layout: the common base is opted out of cross-layer, verified backends opt in."""

from __future__ import annotations

import pytest
import torch
from kvcore_mla import DeepseekV32IndexerBackend, TritonMLABackend
from kvcore_mla.ops import indexer_cache_head_size

import kvcore
from kvcore import MLACommonBackend, MLACommonImpl

#: MLA backends whose kernels pass the cross-layer tests (test_mla_cross_layer.py).
VERIFIED_CROSS_LAYER = [TritonMLABackend]
#: Backends that keep the safe default (layers outermost).
OPTED_OUT = [MLACommonBackend, DeepseekV32IndexerBackend]


class _NewMLABackend(MLACommonBackend):
    """An MLA backend that overrides nothing about its layout (a new, unverified one)."""

    PLATFORMS = ("cuda",)

    @staticmethod
    def get_name() -> str:
        return "NEW_MLA"

    @staticmethod
    def get_impl_cls() -> type[kvcore.AttentionImpl]:
        return MLACommonImpl


@pytest.mark.parametrize("backend", [*OPTED_OUT, _NewMLABackend], ids=lambda b: b.__name__)
def test_opted_out_backends_return_identity_with_layers(backend: type) -> None:
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (0, 1, 2, 3)
    assert backend.get_kv_cache_stride_order() == (0, 1, 2)
    assert not backend.supports_cross_layer()


@pytest.mark.parametrize("backend", VERIFIED_CROSS_LAYER, ids=lambda b: b.__name__)
def test_verified_mla_backends_put_blocks_outermost(backend: type) -> None:
    assert backend.get_kv_cache_stride_order(include_num_layers_dimension=True) == (1, 0, 2, 3)
    assert backend.get_kv_cache_stride_order() == (0, 1, 2)
    assert backend.IS_MLA and backend.supports_cross_layer()


def test_auto_allocation_is_cross_layer_only_for_verified_backends() -> None:
    sizes = dict(num_layers=3, num_blocks=5, block_size=16, num_kv_heads=1, head_size=576,
                 dtype=torch.bfloat16, device="cpu")
    triton = kvcore.allocate_kv_caches(TritonMLABackend, **sizes)
    assert str(triton.layout) == "B,L,N,D" and triton.is_cross_layer
    layer = triton.layers[1]
    assert layer.shape == (5, 16, 576)
    assert layer.stride() == (3 * 16 * 576, 576, 1)
    assert triton.block_view().shape == (5, 3 * 16 * 576 * 2)

    new = kvcore.allocate_kv_caches(_NewMLABackend, **sizes)
    assert str(new.layout) == "L,B,N,D" and not new.is_cross_layer
    assert new.layers[1].stride() == (16 * 576, 576, 1)
    with pytest.raises(ValueError, match="NEW_MLA does not opt in"):
        kvcore.allocate_kv_caches(_NewMLABackend, cross_layer=True, **sizes)


def test_mla_cache_has_one_latent_per_token() -> None:
    assert TritonMLABackend.get_kv_cache_shape(7, 64, 1, 576) == (7, 64, 576)
    with pytest.raises(ValueError, match="num_kv_heads=8"):
        TritonMLABackend.get_kv_cache_shape(7, 64, 8, 576)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_spec_page_size_matches_the_layout(kv_cache_dtype: str) -> None:
    spec = kvcore.MLAAttentionSpec(block_size=64, dtype=torch.bfloat16,
                                   kv_cache_dtype=kv_cache_dtype, kv_lora_rank=512,
                                   qk_rope_head_dim=64)
    caches = kvcore.allocate_kv_caches(
        TritonMLABackend, num_layers=2, num_blocks=3, block_size=64, num_kv_heads=1,
        head_size=spec.head_size, dtype=torch.bfloat16, device="cpu",
        kv_cache_dtype=kv_cache_dtype)
    assert caches.page_size_bytes == spec.page_size_bytes
    assert caches.layers[0].dtype == spec.cache_dtype


def test_indexer_cache_allocates_as_bytes_and_refuses_cross_layer() -> None:
    head_size = indexer_cache_head_size(128, 128)
    assert head_size == 132
    caches = kvcore.allocate_kv_caches(
        DeepseekV32IndexerBackend, num_layers=2, num_blocks=4, block_size=64, num_kv_heads=1,
        head_size=head_size, dtype=torch.uint8, device="cpu")
    assert caches.layers[0].shape == (4, 64, 132) and caches.layers[0].dtype == torch.uint8
    assert str(caches.layout) == "L,B,N,D"
    with pytest.raises(ValueError, match="DEEPSEEK_V32_INDEXER does not opt in"):
        kvcore.KVCacheLayout.from_backend(
            DeepseekV32IndexerBackend, num_blocks=4, block_size=64, num_kv_heads=1,
            head_size=head_size, dtype=torch.uint8, num_layers=2, cross_layer=True)
    with pytest.raises(NotImplementedError, match="indexer_k_quant_and_cache"):
        DeepseekV32IndexerBackend.get_impl_cls()
