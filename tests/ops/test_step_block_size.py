"""Metadata built for one block size must not run on a cache of another: its slots and
block-table columns count tokens of the other size, so every address is wrong. The step facts
record the block size; each op compares it with the cache's (a host compare, per layer)."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.ops import (
    concat_and_cache_mla_ref,
    mla_attention_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    set_value_checks,
)

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
triton_cache = pytest.importorskip("kvcore.ops.triton_cache")

MESSAGE = (r"the step's metadata was built for block_size=8 but the cache has block_size=4: "
           "its slots and block-table columns would address other tokens")


@pytest.fixture(params=[True, False], ids=["value-checks-on", "value-checks-off"])
def checks(request):
    set_value_checks(request.param)
    yield request.param
    set_value_checks(True)


def _step():
    """Block-size-8 metadata: one request, 6 cached + 2 new tokens in blocks 2 and 9."""
    return kvcore.build_attention_metadata([2], [6], [[2, 9]], 8, num_blocks=16)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_kv_ops_refuse_metadata_of_another_block_size(path, checks):
    meta = _step()
    gen = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(16, 4, 2, 16, generator=gen), torch.randn(16, 4, 2, 16, generator=gen)
    before = kc.clone()
    key = torch.randn(2, 2, 16, generator=gen)
    write = reshape_and_cache_ref if path == "reference" else triton_cache.reshape_and_cache
    attend = paged_attention_ref if path == "reference" else triton_attention.paged_attention
    with pytest.raises(ValueError, match=MESSAGE):
        write(key, key, kc, vc, meta.slot_mapping)
    assert torch.equal(kc, before)
    with pytest.raises(ValueError, match=MESSAGE):
        attend(torch.randn(2, 4, 16, generator=gen), kc, vc,
               query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
               block_table=meta.block_table, scale=0.25)


def test_backend_forward_refuses_metadata_of_another_block_size(checks):
    backend = kvcore.resolve_backend("CPU_ATTN")
    impl = backend.get_impl_cls()(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2)
    caches = kvcore.allocate_kv_caches(backend, num_layers=1, num_blocks=16, block_size=4,
                                       num_kv_heads=2, head_size=16, dtype=torch.float32,
                                       device="cpu")
    meta = _step()
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match=MESSAGE):
        impl.do_kv_cache_update(kvcore.LayerScales(), k, k, caches.layers[0], meta.slot_mapping)
    with pytest.raises(ValueError, match=MESSAGE):
        impl.forward(kvcore.LayerScales(), q, k, k, caches.layers[0], meta)


def test_mla_ops_refuse_metadata_of_another_block_size(checks):
    meta = _step()
    cache = torch.randn(16, 4, 24)
    with pytest.raises(ValueError, match=MESSAGE):
        concat_and_cache_mla_ref(torch.randn(2, 16), torch.randn(2, 8), cache,
                                 meta.slot_mapping)
    with pytest.raises(ValueError, match=MESSAGE):
        mla_attention_ref(torch.randn(2, 4, 24), cache, kv_lora_rank=16,
                          query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                          block_table=meta.block_table, scale=0.25)


def test_metadata_of_the_cache_block_size_runs():
    meta = kvcore.build_attention_metadata([2], [6], [[2, 9]], 4, num_blocks=16)
    kc, vc = torch.randn(16, 4, 2, 16), torch.randn(16, 4, 2, 16)
    reshape_and_cache_ref(torch.randn(2, 2, 16), torch.randn(2, 2, 16), kc, vc,
                          meta.slot_mapping)
    paged_attention_ref(torch.randn(2, 4, 16), kc, vc, query_start_loc=meta.query_start_loc,
                        seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.25)
