"""Rule ``adopted-orders``: the backend on memory an engine allocated in another stride order.

A backend lists in ``EXTRA_STRIDE_ORDERS`` the per-layer orders of ``(B, 2, N, H, D)`` its
kernels read beyond its own ``get_kv_cache_stride_order(False)``: an engine allocates in such
an order (vLLM's layouts put the K and V of a token and head side by side) and hands the memory
over with :func:`kvcore.adopt_kv_caches`. A kernel that reinterprets the cache as its own order
(a raw pointer and the sizes, no strides) reads and writes the wrong elements there, with no
error. This check adopts a random buffer in each declared extra order, with a page of random
guard elements before and after the cache, and runs the mixed batch on it and on a cache in the
backend's own order holding the same logical contents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.adopt import adopt_kv_caches
from kvcore.backend import AttentionBackend
from kvcore.layout import KV_DIM_NAMES
from kvcore.layout_names import vllm_layout_name
from kvcore.testing.batch import CaseConfig, random_like
from kvcore.testing.runs import bits, cache_diff, case_run

__all__ = ["check_adopted_order", "order_label"]

RULE = "adopted-orders"


def order_label(order: Sequence[int]) -> str:
    """A short name for a per-layer order in case ids: its vLLM name (``LBNHC``) or its
    physical dim names (``B2HND``)."""
    order = tuple(order)
    return vllm_layout_name(order) or "".join(KV_DIM_NAMES[d] for d in order)


def _order_text(order: tuple[int, ...]) -> str:
    """e.g. ``(0, 2, 3, 1, 4) (physical B,N,H,2,D; vLLM LBNHC)``."""
    physical = ",".join(KV_DIM_NAMES[d] for d in order)
    name = vllm_layout_name(order)
    return f"{order} (physical {physical}{f'; vLLM {name}' if name else ''})"


def check_adopted_order(backend: type[AttentionBackend], config: CaseConfig,
                        device: torch.device, seed: int, order: Sequence[int]) -> None:
    """Rule ``adopted-orders`` for one per-layer ``order`` the backend declares it reads.

    ``do_kv_cache_update`` and then ``forward`` of the mixed batch on a cache adopted in
    ``order`` must give bit for bit, compared through the logical views, the cache and the
    output of the same calls on a cache in the backend's own order; neither call may touch
    the guard elements around the adopted cache, nor may ``forward`` change the cache. The
    comparison is with the backend itself: the own order is held to the reference by
    ``cache-write-reference`` and ``forward-reference``.
    """
    order = tuple(order)
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    own = run.allocate(batch.num_blocks, fill=False)
    own_order = tuple(backend.get_kv_cache_stride_order(False))
    page = run.page_elements()
    size = batch.num_blocks * page
    dtype = own.storage.dtype
    buffer = random_like((page + size + page,), dtype, device, run.gen)
    try:
        adopted = adopt_kv_caches(
            backend, buffer, layout=order, num_layers=1, num_blocks=batch.num_blocks,
            block_size=config.block_size, num_kv_heads=run.CACHE_KV_HEADS,
            head_size=config.head_size, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype,
            offset_bytes=page * buffer.element_size())
    except (ValueError, TypeError) as exc:
        raise run.fail(RULE, (
            f"{backend.get_name()} declares it reads the per-layer order {_order_text(order)}, "
            f"but kvcore.adopt_kv_caches refused a buffer in it: {exc}")) from exc
    layer, own_layer = adopted.layers[0], own.layers[0]
    own_layer.copy_(layer)
    guards = bits(torch.cat([buffer[:page], buffer[page + size:]])).clone()
    where = (f"on a cache adopted in the per-layer order {_order_text(order)}, strides "
             f"{tuple(layer.stride())}, against a cache in {backend.get_name()}'s own order "
             f"{_order_text(own_order)} holding the same data")

    def check_guards(after: str) -> None:
        changed = int((bits(torch.cat([buffer[:page], buffer[page + size:]])) != guards).sum())
        if changed:
            raise run.fail(RULE, (
                f"{after} {where} changed {changed} of the {2 * page} elements of the "
                f"engine's buffer around the cache (one page before it, one after): the "
                f"kernel addressed memory outside the view\n{batch.describe()}"))

    scales, impl = run.scales(), run.impl()
    run.write(impl, scales, batch, layer)
    run.write(impl, scales, batch, own_layer)
    check_guards("do_kv_cache_update")
    diff = cache_diff(layer, own_layer, own.layout, batch, config.block_size, None)
    if diff:
        raise run.fail(RULE, (
            f"do_kv_cache_update {where}, compared as logical views (the own order's result "
            f"is 'expected'): {diff}"))
    before = bits(layer).clone()
    n = batch.num_tokens
    got = run.forward(impl, scales, batch, layer, None)[:n]
    expected = run.forward(impl, scales, batch, own_layer, None)[:n]
    check_guards("forward")
    bad = bits(got) != bits(expected)
    if bad.any():
        token, head, dim = bad.nonzero()[0].tolist()
        raise run.fail(RULE, (
            f"forward {where}: {int(bad.sum())} of {bad.numel()} output elements differ, first "
            f"at {batch.locate(token)}, head {head}, dim {dim}: got "
            f"{got[token, head, dim].item():.6g}, the own order gives "
            f"{expected[token, head, dim].item():.6g}; read the cache through its strides "
            f"(or drop the order from EXTRA_STRIDE_ORDERS)\n{batch.describe()}"))
    changed = int((bits(layer) != before).sum())
    if changed:
        raise run.fail(RULE, f"forward {where} changed {changed} elements of the adopted "
                              "cache; it must only read it")
