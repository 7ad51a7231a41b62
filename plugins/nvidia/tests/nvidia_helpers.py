"""Batches and references shared by kvcore-nvidia's CPU and GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvcore
from kvcore.ops import paged_attention_ref
from kvcore.testing import random_block_tables

#: Relative-error bound of a low-precision result against the float64 reference:
#: ||out - ref|| / ||ref|| (bf16 probabilities and output rounding stay well under it).
REL_ERR = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    """One step: the metadata, its new tokens' q/k/v, and the cache they were written into."""

    meta: kvcore.AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


def mixed_batch(impl: kvcore.AttentionImpl, kv_cache: torch.Tensor, gen: torch.Generator,
                q_lens: tuple[int, ...] = (1, 1, 19, 7),
                ctx_lens: tuple[int, ...] = (37, 15, 16, 0), shared_prefix: int = 0,
                causal: bool = True, layer: kvcore.AttentionLayer | None = None,
                dtype: torch.dtype | None = None) -> Batch:
    """A batch of decodes and prefills (with and without a cached prefix) over random block
    tables, its new K/V written into ``kv_cache`` through ``impl.do_kv_cache_update`` with
    ``layer``'s scales (default 1.0). ``dtype``: of the query and new K/V (default the
    cache's; give the model dtype for an fp8 cache).

    The default requests: a decode after 37 cached tokens, a decode that fills its block, a
    prefill of 19 tokens after a 1-block prefix (crossing a block boundary), a fresh prefill.
    """
    num_blocks, _, block_size, num_kv_heads, head_size = kv_cache.shape
    device, dtype = kv_cache.device, dtype or kv_cache.dtype
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen,
                                 shared_prefix=shared_prefix)
    meta = kvcore.build_attention_metadata(list(q_lens), list(ctx_lens), tables, block_size,
                                           device=device, causal=causal)
    n = meta.num_actual_tokens

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    batch = Batch(meta, rand(n, impl.num_heads, head_size), rand(n, num_kv_heads, head_size),
                  rand(n, num_kv_heads, head_size))
    impl.do_kv_cache_update(layer or kvcore.LayerScales(), batch.key, batch.value, kv_cache,
                            meta.slot_mapping)
    return batch


def reference(impl: kvcore.AttentionImpl, batch: Batch, kv_cache: torch.Tensor,
              layer: kvcore.AttentionLayer | None = None) -> torch.Tensor:
    """float64 attention of the batch's queries over ``kv_cache`` (kvcore's reference), with
    the layer's window and logit soft-cap, and an fp8 cache read back with ``layer``'s
    scales."""
    key_cache, value_cache = kv_cache.unbind(1)
    m = batch.meta
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if not fp8:
        key_cache, value_cache = key_cache.double(), value_cache.double()
    layer = layer or kvcore.LayerScales()
    return paged_attention_ref(
        batch.query.double(), key_cache, value_cache,
        query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table,
        scale=impl.scale, causal=impl.is_causal(m), sliding_window=impl.sliding_window,
        logits_soft_cap=impl.logits_soft_cap, kv_cache_dtype=impl.kv_cache_dtype,
        k_scale=layer.k_scale, v_scale=layer.v_scale)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has a NaN)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def fill_layers(caches: kvcore.KVCaches, gen: torch.Generator) -> None:
    """Random values in every layer of ``caches``, drawn layer after layer in each layer's
    logical order: a cross-layer allocation and a layers-outermost one filled from equal
    generators hold the same values layer for layer. (Filling ``caches.storage`` would not:
    its physical order differs between the two, so the same draws land in other layers.)"""
    for view in caches.layers:
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))


def plan_lists(decode: bool, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """The page lists a fake FlashInfer wrapper's ``plan`` is given, for its prefill or decode
    wrapper alike: ``(qo_indptr, kv_indptr, kv_indices, last_page_len, page_size)``. A decode
    plan has one query a request and is not causal (``kwargs`` gets ``causal=False``)."""
    if decode:
        indptr, indices, last, _, _, _, page = args
        kwargs.setdefault("causal", False)
        return torch.arange(indptr.numel(), dtype=torch.int32), indptr, indices, last, page
    qo, indptr, indices, last, _, _, _, page = args
    return qo, indptr, indices, last, page


def random_caches(backend: type[kvcore.AttentionBackend] | str, gen: torch.Generator, *,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                  **allocate: object) -> kvcore.KVCaches:
    """``kvcore.allocate_kv_caches(backend, dtype=, device=, **allocate)`` filled with normal
    random values from ``gen`` (drawn on the host, so a seed gives the same cache on any
    device), in the storage dtype (fp8 for an fp8 ``kv_cache_dtype``)."""
    caches = kvcore.allocate_kv_caches(backend, dtype=dtype, device=device, **allocate)
    caches.storage.copy_(torch.randn(caches.storage.shape, generator=gen).to(
        caches.storage.dtype))
    return caches
