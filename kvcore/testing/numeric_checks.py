"""The numerical conformance checks: the cache write and ``forward`` against the float64
references, stale bytes, batch invariance, cross-layer views and int64 offsets; each raises
:class:`ConformanceError`. Caches are allocated through :func:`kvcore.allocate_kv_caches` (the
backend's declared layout) and filled with random data first.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcore.backend import AttentionBackend
from kvcore.layout import KVCacheLayout
from kvcore.metadata import build_attention_metadata
from kvcore.ops.validation import FP8_KV_CACHE_DTYPES
from kvcore.testing.batch import (
    CaseConfig,
    MixedBatch,
    random_like,
)
from kvcore.testing.checks import backend_label
from kvcore.testing.runs import (
    bits,
    cache_diff,
    case_run,
    split_kv_views,
    tolerance_for,
)

__all__ = [
    "check_batch_invariant",
    "check_cache_write",
    "check_cross_layer",
    "check_forward",
    "check_int64_offsets",
    "check_stale_bytes",
]


def check_cache_write(backend: type[AttentionBackend], config: CaseConfig,
                      device: torch.device, seed: int) -> None:
    """Rule ``cache-write-reference``, on a per-layer (not cross-layer) allocation."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    expected = layer.clone()
    run.reference_write(batch, expected, caches.layout, scales, batch.metadata.slot_mapping)
    run.write(impl, scales, batch, layer)
    tol = None
    if config.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        tol, _ = tolerance_for(backend, config.kv_cache_dtype)
    diff = cache_diff(layer, expected, caches.layout, batch, config.block_size, tol)
    if diff:
        raise run.fail("cache-write-reference", diff)


def check_forward(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
                  seed: int, without_output: bool = False) -> None:
    """Rule ``forward-reference``, leaving the cache unchanged; ``without_output`` also checks
    the ``output=None`` path (once per backend is enough: it only allocates)."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    run.write(impl, scales, batch, layer)
    before = bits(layer).clone()
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    n = batch.num_tokens
    output = random_like(run.output_shape(batch.query.shape[0]), config.dtype, device, run.gen)
    result = run.forward(impl, scales, batch, layer, output)
    diff = run.output_diff(output[:n], ref, batch)
    if diff:
        raise run.fail("forward-reference", f"forward(..., output=output): {diff}")
    if not torch.equal(bits(result[:n]), bits(output[:n])):
        raise run.fail("forward-reference", (
            "forward(..., output=output) returned a tensor whose rows differ from output; "
            "write the result into output and return it"))
    if without_output:
        diff = run.output_diff(run.forward(impl, scales, batch, layer, None)[:n], ref, batch)
        if diff:
            raise run.fail("forward-reference", f"forward(..., output=None): {diff}")
    if not torch.equal(bits(layer), before):
        changed = int((bits(layer) != before).sum())
        raise run.fail("forward-reference", (
            f"forward changed {changed} elements of the KV cache; it must only read it"))


def _poison_unowned(kv_cache: torch.Tensor, layout: KVCacheLayout, batch: MixedBatch,
                    block_size: int) -> None:
    """NaN in every slot of ``kv_cache`` outside the requests' first ``seq_len`` tokens: the
    tail of each last block and every block no request owns. An MLA cache has no K/V dim."""
    caches = split_kv_views(kv_cache, layout) if "2" in layout.layer_dim_names else (kv_cache,)
    owned = torch.zeros(caches[0].shape[:2], dtype=torch.bool)
    for blocks, q_len, ctx in zip(batch.block_tables, batch.query_lens, batch.context_lens,
                                  strict=True):
        for pos in range(ctx + q_len):
            owned[int(blocks[pos // block_size]), pos % block_size] = True
    stale = ~owned.to(kv_cache.device)
    for cache in caches:
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            cache.view(torch.uint8)[stale] = 0x7F  # NaN in both fp8 formats
        else:
            cache[stale] = float("nan")


def check_stale_bytes(backend: type[AttentionBackend], config: CaseConfig,
                      device: torch.device, seed: int) -> None:
    """Rule ``stale-bytes-masked``: ``forward`` over a cache whose unowned slots hold NaN
    gives the output it gave before they were poisoned (or, for a kernel whose bits vary
    between runs, one that still matches the reference). A plain numeric error is
    ``forward-reference``'s: it gives the same output with and without the poison."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    run.write(impl, scales, batch, layer)
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    n = batch.num_tokens
    clean = run.forward(impl, scales, batch, layer, None)[:n].clone()
    _poison_unowned(layer, caches.layout, batch, config.block_size)
    out = run.forward(impl, scales, batch, layer, None)[:n]
    changed = bits(out) != bits(clean)
    if not changed.any() or run.output_diff(out, ref, batch) is None:
        return
    token, head, dim = changed.nonzero()[0].tolist()
    raise run.fail("stale-bytes-masked", (
        "with NaN in every cache slot the batch does not own (the tail of each request's last "
        f"block, blocks no request owns), {int(changed.sum())} of {changed.numel()} output "
        f"elements changed from this backend's output before the poisoning "
        f"({int((~torch.isfinite(out)).sum())} non-finite): forward read slots it does not "
        f"own. First at {batch.locate(token)}, head {head}, dim {dim}: got "
        f"{out[token, head, dim].item():.6g}, {clean[token, head, dim].item():.6g} before"
        f"\n{batch.describe()}"))


def check_batch_invariant(backend: type[AttentionBackend], config: CaseConfig,
                          device: torch.device, seed: int) -> None:
    """Rule ``batch-invariant``: each request alone gives the bits it gets in the batch."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    _, layer, scales, impl = run.setup_layer(batch.num_blocks)
    run.write(impl, scales, batch, layer)
    together = run.forward(impl, scales, batch, layer, None)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        alone = MixedBatch(
            query=batch.query[start:start + q_len], key=batch.key[start:start + q_len],
            value=batch.value[start:start + q_len],
            metadata=build_attention_metadata([q_len], [ctx], [batch.block_tables[i]],
                                              config.block_size, device=device,
                                              causal=config.causal),
            query_lens=[q_len], context_lens=[ctx], block_tables=[batch.block_tables[i]],
            kinds=[batch.kinds[i]], num_blocks=batch.num_blocks)
        single = run.forward(impl, scales, alone, layer, None)
        if not torch.equal(bits(single), bits(together[start:start + q_len])):
            raise run.fail("batch-invariant", (
                f"request {i} ({batch.kinds[i]}) alone differs from the same request in the "
                f"batch (max difference "
                f"{(single.double() - together[start:start + q_len].double()).abs().max():.3g})"
                f"\n{batch.describe()}"))
        start += q_len


def check_cross_layer(backend: type[AttentionBackend], config: CaseConfig,
                      device: torch.device, seed: int) -> None:
    """Rules ``cross-layer-untouched-neighbours`` and ``cross-layer-bit-exact``.

    The middle layer of a 3-layer cross-layer allocation (its pages strided by three pages,
    non-zero storage offset, random neighbours) against a contiguous single-layer copy.
    """
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    cross = run.allocate(batch.num_blocks, num_layers=3, cross_layer=True)
    plain = run.allocate(batch.num_blocks, fill=False)
    layer, contiguous = cross.layers[1], plain.layers[0]
    contiguous.copy_(layer)
    neighbours = {i: cross.block_view(i).clone() for i in (0, 2)}
    scales, impl = run.scales(), run.impl()

    def check_neighbours(after: str) -> None:
        for i, snapshot in neighbours.items():
            changed = (cross.block_view(i) != snapshot).any(dim=1).nonzero().flatten().tolist()
            if changed:
                raise run.fail("cross-layer-untouched-neighbours", (
                    f"after {after} on layer 1 of a 3-layer cross-layer cache (layout "
                    f"{cross.layout}, per-layer view strides {tuple(layer.stride())}), layer {i} "
                    f"changed in blocks {changed[:10]}{' ...' if len(changed) > 10 else ''}: "
                    "the kernel computed addresses from the sizes instead of the view's strides"
                    f"\n{batch.describe()}"))

    run.write(impl, scales, batch, layer)
    run.write(impl, scales, batch, contiguous)
    check_neighbours("do_kv_cache_update")
    if not torch.equal(bits(layer), bits(contiguous)):
        changed = int((bits(layer) != bits(contiguous)).sum())
        raise run.fail("cross-layer-bit-exact", (
            f"do_kv_cache_update wrote {changed} elements differently on layer 1 of a 3-layer "
            f"cross-layer cache (layout {cross.layout}, strides {tuple(layer.stride())}) than "
            f"on a contiguous cache (strides {tuple(contiguous.stride())})\n{batch.describe()}"))
    n = batch.num_tokens
    out_cross = run.forward(impl, scales, batch, layer, None)[:n]
    out_plain = run.forward(impl, scales, batch, contiguous, None)[:n]
    check_neighbours("forward")
    if not torch.equal(bits(out_cross), bits(out_plain)):
        bad = (bits(out_cross) != bits(out_plain)).nonzero()[0].tolist()
        raise run.fail("cross-layer-bit-exact", (
            f"forward on layer 1 of a 3-layer cross-layer cache (layout {cross.layout}, page "
            f"stride {layer.stride(0)} elements) differs from forward on a contiguous cache "
            f"(page stride {contiguous.stride(0)}), first at {batch.locate(bad[0])}, head "
            f"{bad[1]}: got {out_cross[tuple(bad)].item():.6g}, contiguous gives "
            f"{out_plain[tuple(bad)].item():.6g}; the kernel must take the page stride from "
            f"the tensor\n{batch.describe()}"))


#: Element count the int64 check's cache exceeds.
INT32_LIMIT = 2**31


def check_int64_offsets(backend: type[AttentionBackend], config: CaseConfig,
                        device: torch.device, seed: int) -> str | None:
    """Rule ``int64-offsets`` on a GPU. Returns a reason to skip (too little memory) or ``None``.

    One layer of more than 2**31 elements; one request in the last blocks, one in the first.
    """
    limit = backend.MAX_KV_CACHE_SPAN
    if limit is not None and limit <= INT32_LIMIT:
        return (f"{backend_label(backend)} declares MAX_KV_CACHE_SPAN={limit}: "
                "kvcore.allocate_kv_caches refuses larger caches instead of addressing them")
    run = case_run(backend, config, device, seed)
    bs = config.block_size
    page = run.page_elements()
    num_blocks = INT32_LIMIT // page + 4
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    need = num_blocks * page * (1 if config.is_fp8 else itemsize)
    free, _ = torch.cuda.mem_get_info(device)
    if need * 1.25 > free:
        return f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free"
    high = [num_blocks - 3, num_blocks - 2, num_blocks - 1]
    low = [0, 1]
    q_lens, tables = [2 * bs + 3, bs + 1], [high, low]
    meta = build_attention_metadata(q_lens, [0, 0], tables, bs, device=device)
    query, key, value = run.tokens(meta.num_actual_tokens)
    batch = MixedBatch(
        query=query, key=key, value=value, metadata=meta, query_lens=q_lens,
        context_lens=[0, 0], block_tables=tables,
        kinds=["prefill in the last blocks", "prefill in the first blocks"],
        num_blocks=num_blocks)
    caches, layer, scales, impl = run.setup_layer(num_blocks, fill=False)
    run.write(impl, scales, batch, layer)
    out = run.forward(impl, scales, batch, layer, None)
    # The same requests on a compact cache holding only the five used blocks, renumbered.
    used = torch.tensor(high + low, device=device)
    block_dim = caches.layout.layer_dim_names.index("B")
    compact_meta = build_attention_metadata(q_lens, [0, 0], [[0, 1, 2], [3, 4]], bs,
                                            device=device)
    compact = torch.zeros_like(layer.index_select(block_dim, used))
    run.reference_write(batch, compact, caches.layout, scales, compact_meta.slot_mapping)
    if not torch.equal(bits(layer.index_select(block_dim, used)), bits(compact)):
        raise run.fail("int64-offsets", (
            f"do_kv_cache_update into blocks {high} of a {num_blocks}-block cache "
            f"({num_blocks * page} elements > 2**31) did not store what the reference stores; "
            "some offset was computed in int32"))
    ref_batch = dataclasses.replace(batch, metadata=compact_meta,
                                    block_tables=[[0, 1, 2], [3, 4]], num_blocks=5)
    ref = run.reference_forward(ref_batch, compact, caches.layout, scales)
    diff = run.output_diff(out, ref, batch)
    if diff:
        raise run.fail("int64-offsets", (
            f"forward over blocks {high} of a {num_blocks}-block cache ({num_blocks * page} "
            f"elements > 2**31) is wrong: {diff}"))
    return None


# -- the engine step: builders and CUDA graphs ------------------------------------------------

#: Maxima the conformance builders are made with (the steps below stay within them).
