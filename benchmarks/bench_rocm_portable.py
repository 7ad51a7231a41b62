#!/usr/bin/env python3
"""Real-size correctness of kvcore-rocm's portable (Triton) paths on a CUDA (or ROCm) GPU.

The aiter paths cannot run here; this checks what runs without aiter, at serving sizes:

1. ``ROCM_ATTN`` on the legacy ``(2, num_blocks, N, H, D)`` cache: a mixed batch (decodes,
   a prefill on a cached prefix, a fresh prefill) against the pure-torch reference
   (``kvcore.ops.paged_attention_ref`` in float32 on float32 copies of the cache halves);
2. ``ROCM_AITER_UNIFIED_ATTN`` (Triton fallback) on layer ``L // 2`` of a cross-layer cache:
   bit-exact against the same calls on a contiguous single-layer copy, other layers untouched;
3. ``reshape_and_cache_shuffle`` (ROCM_AITER_FA's cache write) on a cross-layer ``unbind(1)``
   view: bit-exact against the pure-torch reference, other layers untouched.

Each check prints one row (what, shape, max error or "bit-exact", milliseconds of the timed call
after a warm-up); the process exits 1 if any fails. ``--smoke`` runs tiny shapes on the CPU
under ``TRITON_INTERPRET=1``, to check the script itself.

Usage: ``python benchmarks/bench_rocm_portable.py [--smoke]``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]


REAL = Sizes(num_layers=8, num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
             context_lens=(4000, 1500, 700, 2048, 0), query_lens=(1, 1, 1, 256, 512))
SMOKE = Sizes(num_layers=3, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
              context_lens=(20, 9, 0), query_lens=(1, 5, 7))


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Milliseconds of one call after one warm-up call."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    from kvcore_rocm.ops.shuffle import reshape_and_cache_shuffle, reshape_and_cache_shuffle_ref
    from tabulate import tabulate

    import kvcore
    from kvcore.ops import paged_attention_ref

    if not args.smoke and not torch.cuda.is_available():
        print("no GPU visible; run with --smoke on a CPU machine", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    sizes = SMOKE if args.smoke else REAL
    dtype = torch.bfloat16

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    gen = torch.Generator(device="cpu").manual_seed(0)
    rng = random.Random(0)
    seq_lens = [c + q for c, q in zip(sizes.context_lens, sizes.query_lens, strict=True)]
    needed = [-(-s // sizes.block_size) for s in seq_lens]
    ids = list(range(sum(needed) + 8))
    rng.shuffle(ids)  # non-contiguous, unordered block tables
    tables, pos = [], 0
    for n in needed:
        tables.append(ids[pos:pos + n])
        pos += n
    num_blocks = len(ids)
    n_new = sum(sizes.query_lens)
    hk, d = sizes.num_kv_heads, sizes.head_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    all_k, all_v = rand(sum(seq_lens), hk, d), rand(sum(seq_lens), hk, d)
    fill = kvcore.build_attention_metadata(seq_lens, [0] * len(seq_lens), tables,
                                           sizes.block_size, device=device)
    meta = kvcore.build_attention_metadata(list(sizes.query_lens), list(sizes.context_lens),
                                           tables, sizes.block_size, device=device)
    query = rand(n_new, sizes.num_heads, d)
    layer = kvcore.LayerScales()
    scale = d ** -0.5
    rows: list[list[object]] = []
    failed = False

    def run_backend(name: str, kv_cache: torch.Tensor) -> tuple[torch.Tensor, float]:
        impl = kvcore.resolve_backend(name).get_impl_cls()(sizes.num_heads, d, scale, hk)
        impl.do_kv_cache_update(layer, all_k, all_v, kv_cache, fill.slot_mapping)
        ms = _timed(lambda: impl.forward(layer, query, query, query, kv_cache, meta), sync)
        return impl.forward(layer, query, query, query, kv_cache, meta), ms

    # 1. ROCM_ATTN, legacy layout, against the float32 reference on the same halves.
    legacy = kvcore.allocate_kv_caches("ROCM_ATTN", num_layers=1, num_blocks=num_blocks,
                                       block_size=sizes.block_size, num_kv_heads=hk,
                                       head_size=d, dtype=dtype, device=device)
    out, ms = run_backend("ROCM_ATTN", legacy.layers[0])
    k_half, v_half = legacy.layers[0].unbind(0)
    ref = paged_attention_ref(query.float(), k_half.float(), v_half.float(),
                              query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                              block_table=meta.block_table, scale=scale)
    err = (out.float() - ref).abs().max().item()
    ok = err < 3e-2
    failed |= not ok
    rows.append(["ROCM_ATTN legacy 2,B,N,H,D vs reference", f"{n_new} tok, {num_blocks} blk",
                 f"max err {err:.2e}", f"{ms:.3f}", "ok" if ok else "FAIL"])

    # 2. UNIFIED (Triton fallback) on a cross-layer layer view vs a contiguous single layer.
    cross = kvcore.allocate_kv_caches("ROCM_AITER_UNIFIED_ATTN", num_layers=sizes.num_layers,
                                      num_blocks=num_blocks, block_size=sizes.block_size,
                                      num_kv_heads=hk, head_size=d, dtype=dtype, device=device,
                                      cross_layer=True)
    cross.storage.copy_(torch.randn(cross.storage.shape, generator=gen).to(dtype))
    before = cross.storage.clone()
    mid = sizes.num_layers // 2
    single = kvcore.allocate_kv_caches("ROCM_AITER_UNIFIED_ATTN", num_layers=1,
                                       num_blocks=num_blocks, block_size=sizes.block_size,
                                       num_kv_heads=hk, head_size=d, dtype=dtype, device=device,
                                       cross_layer=False)
    out_cross, ms = run_backend("ROCM_AITER_UNIFIED_ATTN", cross.layers[mid])
    out_single, _ = run_backend("ROCM_AITER_UNIFIED_ATTN", single.layers[0])
    others = [i for i in range(sizes.num_layers) if i != mid]
    inverse = cross.layout.inverse_stride_order()
    untouched = all(torch.equal(cross.layers[i], before.permute(inverse)[i]) for i in others)
    ok = torch.equal(out_cross, out_single) and untouched and cross.is_cross_layer
    failed |= not ok
    rows.append([f"UNIFIED (Triton) cross-layer {cross.layout}", f"layer {mid}/{sizes.num_layers}",
                 "bit-exact" if ok else "MISMATCH", f"{ms:.3f}", "ok" if ok else "FAIL"])

    # 3. Shuffle cache write on a cross-layer unbind(1) view vs the pure-torch reference.
    store = torch.randn(num_blocks, sizes.num_layers, 2, sizes.block_size, hk, d,
                        generator=gen).to(dtype).to(device)
    expected = store.clone()
    halves = store[:, mid].unbind(1)
    ms = _timed(lambda: reshape_and_cache_shuffle(all_k, all_v, *halves, fill.slot_mapping), sync)
    reshape_and_cache_shuffle_ref(all_k, all_v, *expected[:, mid].unbind(1), fill.slot_mapping)
    ok = torch.equal(store.view(torch.uint8), expected.view(torch.uint8))
    failed |= not ok
    rows.append(["reshape_and_cache_shuffle cross-layer", f"{all_k.shape[0]} tok",
                 "bit-exact" if ok else "MISMATCH", f"{ms:.3f}", "ok" if ok else "FAIL"])

    name = "CPU (TRITON_INTERPRET=1)" if device == "cpu" else torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}; dtype {str(dtype).removeprefix('torch.')}")
    print(tabulate(rows, headers=["check", "size", "result", "ms", "status"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
