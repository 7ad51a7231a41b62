#!/usr/bin/env python3
"""Real-size correctness and speed of kvcore's Triton kernels on one GPU (written for the H200).

One run does, in order, each section isolated (an error is logged and the run goes on):

1. ceilings: device-to-device copy (bytes read + written; torch ``copy_`` and a Triton
   streaming copy) and a read-only reduction (torch ``sum`` and a Triton streaming read);
2. correctness at real sizes: cache write (standard, fp8, cross-layer, legacy, a 32-layer
   cross-layer pool with block ids > 2,048, i.e. offsets > 2**31 elements: exact), attention
   (decode, split-KV, mixed prefill + decode, sliding window, fp8 against the references;
   cross-layer and the int64 pool bit-exact against contiguous copies);
3. timings (CUDA-graph replays of one call, median; ``triton.testing.do_bench`` median when
   capture fails) with kvcore's default configuration: decode Hq32 Hk8 D128 bf16 block 16 at
   B x L in {64x4096, 8x32768, 256x1024, 16x4096}, standard and cross-layer; cache write N in
   {256, 4096, 32768, 131072}; one prefill (4 x 2048 new tokens); plain torch beside each
   (gather + SDPA, index_put);
4. sweeps of tile configurations x split counts (time-boxed by ``--budget-s``), then the
   fastest swept configuration per shape timed again, standard and cross-layer;
5. FlashInfer (``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` on the NHD
   ``(num_blocks, 2, block_size, H, D)`` cache, ``append_paged_kv_cache``,
   ``BatchPrefillWithPagedKVCacheWrapper``) on the same shapes, when it imports, checked
   against kvcore's outputs; last, so that its JIT build has time and cannot cost the rest;
6. the ceilings again (the ratios use the higher reading).

The table printed last gives achieved GB/s, the share of the measured ceiling and the time
ratios. Logs and JSON go to ``--out`` (default ``$OUT``, else ``benchmarks/results``).
``--smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1`` to check the script.

Usage: ``python benchmarks/bench_triton.py [--out DIR] [--budget-s 300] [--smoke]``; with
``--flashinfer-warmup`` it only builds FlashInfer's JIT modules (to overlap that compile with
other work).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore.ops as ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, rel_err  # noqa: E402
from kvcore.ops import paged_attention_ref, reshape_and_cache_ref  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE = torch.bfloat16
HQ, HK, D, BS = 32, 8, 128, 16
if SMOKE:
    HQ, HK, D = 8, 2, 64
    DECODE_SHAPES = [(4, 256), (2, 1024)]
    SPLIT_SWEEPS = {(4, 256): [1, 2], (2, 1024): [1, 4]}
    WRITE_SIZES = [64, 256]
    PREFILL = (2, 64)
    INT64_BLOCKS, INT64_LAYERS = 40, 3
else:
    DECODE_SHAPES = [(64, 4096), (8, 32768), (256, 1024), (16, 4096)]
    SPLIT_SWEEPS = {(64, 4096): [1, 2, 3, 4], (8, 32768): [8, 12, 16, 24], (256, 1024): [1, 2],
                    (16, 4096): [4, 8, 12, 16]}
    WRITE_SIZES = [256, 4096, 32768, 131072]
    PREFILL = (4, 2048)
    INT64_BLOCKS, INT64_LAYERS = 2200, 32
CROSS_LAYERS = 8  # layers of the cross-layer pool used for timings (the view is layer 4)
# Sweep candidates, most promising first: decode (block_n, num_warps, num_stages); prefill
# (block_q, block_n, num_warps, num_stages).
DECODE_TILES = [(64, 4, 3), (32, 4, 4), (64, 4, 4), (128, 4, 2), (32, 4, 3), (64, 8, 3),
                (64, 4, 2), (128, 8, 3), (64, 2, 3), (32, 2, 4)]
PREFILL_TILES = [(16, 64, 4, 3), (32, 64, 8, 3), (16, 32, 4, 3), (32, 32, 4, 3), (32, 64, 4, 2),
                 (64, 64, 8, 2)]


# ----------------------------------------------------------------------------- data


def randn(*shape: int, dtype: torch.dtype = DTYPE, scale: float = 1.0) -> torch.Tensor:
    t = torch.empty(*shape, dtype=torch.float32 if dtype.itemsize == 1 else dtype, device=DEVICE)
    t.normal_(0.0, scale)
    return t.to(dtype)


class DecodeBatch:
    """B decode requests of L tokens over a shuffled paged cache, standard NHD layout
    ``(num_blocks, 2, BS, HK, D)``; optionally the same data in layer 4 of a cross-layer pool
    ``(num_blocks, CROSS_LAYERS, 2, BS, HK, D)``."""

    def __init__(self, b: int, length: int, cross_layer: bool = False, q_len: int = 1) -> None:
        self.b, self.length, self.q_len = b, length, q_len
        pages = -(-length // BS)
        num_blocks = b * pages + 64
        self.kv = randn(num_blocks, 2, BS, HK, D)
        perm = torch.randperm(num_blocks, device=DEVICE)[: b * pages]
        self.block_table = perm.view(b, pages).to(torch.int32)
        self.seq_lens = torch.full((b,), length, dtype=torch.int32, device=DEVICE)
        self.qsl = (torch.arange(b + 1, device=DEVICE) * q_len).to(torch.int32)
        self.query = randn(b * q_len, HQ, D)
        self.scale = D ** -0.5
        self.pool = None
        if cross_layer:
            self.pool = randn(num_blocks, CROSS_LAYERS, 2, BS, HK, D)
            self.pool[:, CROSS_LAYERS // 2].copy_(self.kv)

    def caches(self, cross_layer: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.pool[:, CROSS_LAYERS // 2] if cross_layer else self.kv
        return kv.unbind(1)

    def kwargs(self) -> dict:
        return dict(query_start_loc=self.qsl, seq_lens=self.seq_lens,
                    block_table=self.block_table, scale=self.scale)

    def kv_bytes(self) -> int:
        return 2 * self.b * self.length * HK * D * DTYPE.itemsize


def triton_attention():
    from kvcore.ops import triton_attention as mod

    return mod


def default_config(*args, **kwargs):
    """:func:`kvcore.ops.attention_dispatch.default_config` (imports triton)."""
    from kvcore.ops.attention_dispatch import default_config as choose

    return choose(*args, **kwargs)


def config_from_dict(row: dict):
    """The launch config a sweep row's ``config`` dict describes (its ``kernel`` names the
    class)."""
    fields = dict(row)
    return ops.KERNELS[fields.pop("kernel")](**fields)


def triton_cache():
    from kvcore.ops import triton_cache as mod

    return mod


# ----------------------------------------------------------------------------- ceilings


def measure_ceilings(run: Run, tag: str) -> None:
    """Copy and read bandwidth after a one-second warm-up, at the start and at the end of a
    run; the ratios use the higher of the two. Copy is the faster of torch's ``copy_`` and a
    Triton streaming copy: on the H200 ``copy_`` of a contiguous tensor goes
    through ``cudaMemcpyAsync`` and moved only 2.7 TB/s, less than the cache-write kernels, so
    it is no ceiling on its own."""
    nbytes = (1 << 16) if SMOKE else (2 << 30)
    x = randn(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    harness.warm_up(y, x, 0.0 if SMOKE else 1.0)
    copy_torch, how = harness.copy_gbps(y, x, time_call)
    copy_triton, _ = harness.triton_copy_gbps(x, y, time_call)
    read_torch, _ = harness.read_gbps(x, time_call)
    read_triton, _ = harness.triton_read_gbps(x, time_call)
    measured = {"copy_GBps": max(copy_torch, copy_triton), "copy_torch_GBps": copy_torch,
                "copy_triton_GBps": copy_triton, "read_torch_sum_GBps": read_torch,
                "read_triton_GBps": read_triton, "read_GBps": max(read_torch, read_triton),
                "buffer_bytes": nbytes, "method": how}
    ceilings = run.results["ceilings"]
    ceilings[tag] = measured
    for key in ("copy_GBps", "read_GBps"):
        ceilings[key] = max(ceilings.get(key, 0.0), measured[key])
    run.log(f"[{tag}] copy {measured['copy_GBps']:.0f} GB/s (read+write; torch copy_ "
            f"{measured['copy_torch_GBps']:.0f}, triton {measured['copy_triton_GBps']:.0f}), read "
            f"{measured['read_GBps']:.0f} GB/s (torch.sum {measured['read_torch_sum_GBps']:.0f},"
            f" triton {measured['read_triton_GBps']:.0f})")


# ----------------------------------------------------------------------------- correctness


def check_cache_writes(run: Run) -> None:
    tc = triton_cache()
    n = 256 if SMOKE else 32768
    num_blocks = 2 * n // BS
    key, value = randn(n, HK, D), randn(n, HK, D)
    slots = torch.randperm(num_blocks * BS, device=DEVICE)[:n]
    slots[::97] = -1
    # standard
    kv = randn(num_blocks, 2, BS, HK, D)
    ref = kv.clone()
    tc.reshape_and_cache(key, value, *kv.unbind(1), slots)
    reshape_and_cache_ref(key, value, *ref.unbind(1), slots)
    run.check("cache_write.standard.exact", torch.equal(kv, ref), tokens=n)
    # fp8 e4m3, scales as device tensors
    kv8 = randn(num_blocks, 2, BS, HK, D, dtype=torch.float8_e4m3fn)
    ref8 = kv8.clone()
    ks = torch.tensor([0.021], device=DEVICE)
    vs = torch.tensor([0.013], device=DEVICE)
    tc.reshape_and_cache(key, value, *kv8.unbind(1), slots, "fp8", ks, vs)
    reshape_and_cache_ref(key, value, *ref8.unbind(1), slots, "fp8", ks, vs)
    diff = (kv8.view(torch.uint8) != ref8.view(torch.uint8)).sum().item()
    run.check("cache_write.fp8_e4m3.exact", diff == 0, differing_bytes=diff)
    # cross-layer: layer 4 of an 8-layer pool against a contiguous copy; neighbours untouched
    pool = randn(num_blocks, CROSS_LAYERS, 2, BS, HK, D)
    before = pool.clone()
    flat = pool[:, CROSS_LAYERS // 2].contiguous()
    tc.reshape_and_cache(key, value, *pool[:, CROSS_LAYERS // 2].unbind(1), slots)
    tc.reshape_and_cache(key, value, *flat.unbind(1), slots)
    others = [i for i in range(CROSS_LAYERS) if i != CROSS_LAYERS // 2]
    run.check("cache_write.cross_layer.bit_exact",
              torch.equal(pool[:, CROSS_LAYERS // 2], flat)
              and torch.equal(pool[:, others], before[:, others]))
    del pool, before, flat
    # legacy (2, num_blocks, ...) halves
    legacy = randn(2, num_blocks, BS, HK, D)
    flat_k, flat_v = legacy[0].clone(), legacy[1].clone()
    tc.reshape_and_cache(key, value, legacy[0], legacy[1], slots)
    tc.reshape_and_cache(key, value, flat_k, flat_v, slots)
    run.check("cache_write.legacy.bit_exact",
              torch.equal(legacy[0], flat_k) and torch.equal(legacy[1], flat_v))


def check_int64_pool(run: Run) -> None:
    """A 32-layer cross-layer pool with block ids > 2,048: the last layer's pages lie more than
    2**31 elements into the storage."""
    tc, ta = triton_cache(), triton_attention()
    pool = randn(INT64_BLOCKS, INT64_LAYERS, 2, BS, HK, D)
    layer = INT64_LAYERS - 1
    kc, vc = pool[:, layer].unbind(1)
    max_offset = (INT64_BLOCKS - 1) * kc.stride(0) + vc.storage_offset()
    run.log(f"int64 pool: {pool.numel() * 2 / 1e9:.1f} GB, largest offset {max_offset:,} "
            f"elements ({max_offset / 2**31:.2f} x 2**31)")
    high = INT64_BLOCKS - 2048 if not SMOKE else INT64_BLOCKS // 2
    first_high = INT64_BLOCKS - high
    n = high * BS
    key, value = randn(n, HK, D), randn(n, HK, D)
    slots = torch.randperm(n, device=DEVICE) + first_high * BS
    expected = pool.clone()
    reshape_and_cache_ref(key, value, *expected[:, layer].unbind(1), slots)
    tc.reshape_and_cache(key, value, kc, vc, slots)
    run.check("int64_pool.cache_write.exact_incl_neighbours", torch.equal(pool, expected),
              max_offset_elements=max_offset)
    del expected
    # Attention on the top blocks: decode + a prefill with a cached prefix.
    pages = high // 3
    table = (torch.randperm(high, device=DEVICE)[: 3 * pages] + first_high).view(3, pages)
    table = table.to(torch.int32)
    length = pages * BS
    q_lens = [1, 1, 64 if not SMOKE else 8]
    qsl = torch.tensor([0, 1, 2, 2 + q_lens[2]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([length, length - 5, length - 3], dtype=torch.int32, device=DEVICE)
    query = randn(sum(q_lens), HQ, D)
    kwargs = dict(query_start_loc=qsl, seq_lens=seq_lens, block_table=table, scale=D ** -0.5)
    kflat, vflat = kc.contiguous(), vc.contiguous()
    for splits in (1, 4):
        plan = ops.TritonAttentionPlan(num_kv_splits=splits)
        strided = ta.paged_attention(query, kc, vc, **kwargs, plan=plan)
        flat = ta.paged_attention(query, kflat, vflat, **kwargs, plan=plan)
        run.check(f"int64_pool.attention.splits{splits}.bit_exact", torch.equal(strided, flat))
    ref = paged_attention_ref(query, kflat, vflat, **kwargs)
    err = rel_err(strided, ref)
    run.check("int64_pool.attention.vs_reference", err < 1e-2, rel_err=err)


def check_attention(run: Run) -> None:
    ta = triton_attention()
    # decode at a real size against the fp32 and float64 references
    b, length = (2, 512) if SMOKE else (16, 4096)
    batch = DecodeBatch(b, length)
    kc, vc = batch.caches(False)
    out = ta.paged_attention(batch.query, kc, vc, **batch.kwargs())
    ref = paged_attention_ref(batch.query, kc, vc, **batch.kwargs())
    ref64 = paged_attention_ref(batch.query.double(), kc.double(), vc.double(), **batch.kwargs())
    e32, e64 = rel_err(out, ref), rel_err(out, ref64)
    run.check(f"attention.decode.{b}x{length}.vs_reference", e64 < 1e-2,
              rel_err_fp32_ref=e32, rel_err_fp64_ref=e64)
    # split-KV (heuristic) vs unsplit, long sequences at small batch
    b, length = (2, 1024) if SMOKE else (8, 32768)
    batch = DecodeBatch(b, length)
    kc, vc = batch.caches(False)
    cfg = default_config(b, b, HQ, HK, D, batch.block_table.shape[1] * BS,
                         torch.device(DEVICE))
    split = ta.paged_attention(batch.query, kc, vc, **batch.kwargs())
    whole = ta.paged_attention(batch.query, kc, vc, **batch.kwargs(),
                               plan=ops.TritonAttentionPlan(num_kv_splits=1))
    ref = paged_attention_ref(batch.query, kc, vc, **batch.kwargs())
    run.check(f"attention.split_kv.{b}x{length}", rel_err(split, ref) < 1e-2,
              heuristic_splits=getattr(cfg, "num_splits", 1), rel_err_split=rel_err(split, ref),
              rel_err_unsplit=rel_err(whole, ref), split_vs_unsplit=rel_err(split, whole))
    # mixed batch: prefill with a cached prefix + fresh prefill + decodes, sliding window, fp8
    q_lens = [300, 1, 1, 512, 1] if not SMOKE else [20, 1, 1, 33, 1]
    seq_lens = [1000, 2000, 77, 512, 4096] if not SMOKE else [60, 90, 7, 33, 200]
    pages = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(pages) + 16
    perm = torch.randperm(num_blocks, device=DEVICE)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[used:used + p]
        used += p
    kv = randn(num_blocks, 2, BS, HK, D)
    kwargs = dict(query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                               dtype=torch.int32, device=DEVICE),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                  block_table=table, scale=D ** -0.5)
    query = randn(sum(q_lens), HQ, D)
    kc, vc = kv.unbind(1)
    for name, extra in (("mixed", {}), ("mixed.window256", {"sliding_window": 256}),
                        ("mixed.non_causal", {"causal": False})):
        out = ta.paged_attention(query, kc, vc, **kwargs, **extra)
        ref64 = paged_attention_ref(query.double(), kc.double(), vc.double(), **kwargs, **extra)
        err = rel_err(out, ref64)
        run.check(f"attention.{name}.vs_reference", err < 1e-2, rel_err_fp64_ref=err)
    kv8 = randn(num_blocks, 2, BS, HK, D, dtype=torch.float8_e4m3fn)
    k8, v8 = kv8.unbind(1)
    out = ta.paged_attention(query, k8, v8, **kwargs, kv_cache_dtype="fp8",
                             k_scale=torch.tensor([0.3], device=DEVICE), v_scale=0.7)
    ref = paged_attention_ref(query, k8, v8, **kwargs, kv_cache_dtype="fp8", k_scale=0.3,
                              v_scale=0.7)
    err = rel_err(out, ref)
    run.check("attention.mixed.fp8.vs_reference", err < 1e-2, rel_err_fp32_ref=err)


# ----------------------------------------------------------------------------- peers


def flashinfer_module():
    import flashinfer

    return flashinfer


def flashinfer_decode(batch: DecodeBatch, kv: torch.Tensor) -> Callable[[], torch.Tensor]:
    fi = flashinfer_module()
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    # backend="fa2" pins the tensor-core (prefill-kernel) decode; "auto" may pick cuDNN.
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True,
                                                    backend="fa2")
    b, pages = batch.block_table.shape
    indptr = (torch.arange(b + 1, device=DEVICE) * pages).to(torch.int32)
    last = torch.full((b,), batch.length - (pages - 1) * BS, dtype=torch.int32, device=DEVICE)
    wrapper.plan(indptr, batch.block_table.flatten(), last, HQ, HK, D, BS,
                 q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=batch.scale)
    out = torch.empty_like(batch.query)
    return lambda: wrapper.run(batch.query, kv, out=out)


def torch_decode(batch: DecodeBatch, kc: torch.Tensor, vc: torch.Tensor):
    """Plain torch: gather the pages, then SDPA (GQA)."""
    b, length = batch.b, batch.length

    def fn() -> torch.Tensor:
        k = kc[batch.block_table].reshape(b, -1, HK, D)[:, :length].transpose(1, 2)
        v = vc[batch.block_table].reshape(b, -1, HK, D)[:, :length].transpose(1, 2)
        q = batch.query.view(b, 1, HQ, D).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=batch.scale,
                                                                enable_gqa=True)
    return fn


# ----------------------------------------------------------------------------- timings


def add_timing(run: Run, op: str, shape: str, layout: str, impl: str, seconds: float,
               method: str, nbytes: int | None = None, flops: float | None = None,
               **info: object) -> dict:
    row = {"op": op, "shape": shape, "layout": layout, "impl": impl, "time_us": seconds * 1e6,
           "method": method, **info}
    if nbytes is not None:
        row["bytes"] = nbytes
        row["GBps"] = nbytes / seconds / 1e9
    if flops is not None:
        row["TFLOPs"] = flops / seconds / 1e12
    run.results["timings"].append(row)
    extra = f"{row['GBps']:.0f} GB/s" if nbytes else f"{row.get('TFLOPs', 0):.0f} TFLOP/s"
    run.log(f"{op} {shape} {layout} {impl}: {seconds * 1e6:.1f} us, {extra} [{method}] "
            f"{info if info else ''}")
    return row


def time_decode(run: Run, b: int, length: int, config=None) -> None:
    """kvcore on the standard and the cross-layer cache (default config, or ``config``), and
    plain torch once (default pass only)."""
    ta = triton_attention()
    batch = DecodeBatch(b, length, cross_layer=True)
    shape = f"{b}x{length}"
    nbytes = batch.kv_bytes() + 2 * batch.query.numel() * DTYPE.itemsize
    cfg = config or default_config(b, b, HQ, HK, D, batch.block_table.shape[1] * BS,
                                   torch.device(DEVICE))
    impl = "kvcore-triton" if config is None else "kvcore-triton-best"
    outs = {}
    for layout in ("standard", "cross_layer"):
        kc, vc = batch.caches(layout == "cross_layer")
        out = torch.empty_like(batch.query)
        fn = lambda kc=kc, vc=vc, out=out: ta.paged_attention(  # noqa: E731
            batch.query, kc, vc, **batch.kwargs(), output=out,
            plan=ops.TritonAttentionPlan(config=cfg))
        fn()
        outs[layout] = out
        t, how = time_call(fn)
        add_timing(run, "decode", shape, layout, impl, t, how, nbytes,
                   config=dataclass_dict(cfg))
    run.check(f"decode.{shape}.{impl}.cross_layer_vs_standard.bit_exact",
              torch.equal(outs["standard"], outs["cross_layer"]))
    if config is not None:
        return
    with run.section(f"torch decode {shape}"):
        kc, vc = batch.caches(False)
        fn = torch_decode(batch, kc, vc)
        err = rel_err(fn().transpose(1, 2).reshape(b, HQ, D), outs["standard"])
        t, how = time_call(fn)
        add_timing(run, "decode", shape, "standard", "torch-gather-sdpa", t, how, nbytes,
                   rel_err_vs_kvcore=err)


def time_decode_flashinfer(run: Run, b: int, length: int) -> None:
    ta = triton_attention()
    batch = DecodeBatch(b, length, cross_layer=True)
    shape = f"{b}x{length}"
    nbytes = batch.kv_bytes() + 2 * batch.query.numel() * DTYPE.itemsize
    ours = ta.paged_attention(batch.query, *batch.caches(False), **batch.kwargs())
    for layout in ("standard", "cross_layer"):
        with run.section(f"flashinfer decode {shape} {layout}"):
            kv = batch.pool[:, CROSS_LAYERS // 2] if layout == "cross_layer" else batch.kv
            fn = flashinfer_decode(batch, kv)
            err = rel_err(fn(), ours)
            run.check(f"decode.{shape}.{layout}.flashinfer_vs_kvcore", err < 1e-2,
                      rel_err=err)
            t, how = time_call(fn)
            add_timing(run, "decode", shape, layout, "flashinfer", t, how, nbytes,
                       rel_err_vs_kvcore=err)


def dataclass_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


def write_batch(n: int):
    """``n`` new tokens of min(n, 256) fresh requests over shuffled pages, as kvcore slots and
    as FlashInfer's (batch_indices, positions, kv_indices, kv_indptr, last_page_len)."""
    requests = min(n, 256)
    per = n // requests
    pages = -(-per // BS)
    num_blocks = requests * pages * 2
    perm = torch.randperm(num_blocks, device=DEVICE)[: requests * pages].to(torch.int32)
    table = perm.view(requests, pages)
    pos = torch.arange(per, device=DEVICE).repeat(requests)
    req = torch.arange(requests, device=DEVICE).repeat_interleave(per)
    slots = table[req, pos // BS].long() * BS + pos % BS
    fi_args = dict(batch_indices=req.to(torch.int32), positions=pos.to(torch.int32),
                   kv_indices=perm, kv_indptr=(torch.arange(requests + 1, device=DEVICE)
                                               * pages).to(torch.int32),
                   kv_last_page_len=torch.full((requests,), per - (pages - 1) * BS,
                                               dtype=torch.int32, device=DEVICE))
    return num_blocks, slots, fi_args


def time_cache_write(run: Run, n: int, flashinfer: bool = False) -> None:
    """kvcore (standard and cross-layer) and torch index_put, or FlashInfer's append (checked
    to write exactly the bytes kvcore writes)."""
    tc = triton_cache()
    num_blocks, slots, fi_args = write_batch(n)
    key, value = randn(n, HK, D), randn(n, HK, D)
    nbytes = 2 * 2 * n * HK * D * DTYPE.itemsize + slots.numel() * 8  # K,V read + written
    kv = randn(num_blocks, 2, BS, HK, D)
    if flashinfer:
        fi = flashinfer_module()
        ours, theirs = kv.clone(), kv.clone()
        tc.reshape_and_cache(key, value, *ours.unbind(1), slots)
        fi.append_paged_kv_cache(key, value, paged_kv_cache=theirs, kv_layout="NHD", **fi_args)
        run.check(f"cache_write.N={n}.flashinfer_equals_kvcore", torch.equal(ours, theirs))
        t, how = time_call(lambda: fi.append_paged_kv_cache(
            key, value, paged_kv_cache=kv, kv_layout="NHD", **fi_args))
        add_timing(run, "cache_write", f"N={n}", "standard", "flashinfer", t, how, nbytes)
        return
    pool = randn(num_blocks, CROSS_LAYERS, 2, BS, HK, D)
    for layout in ("standard", "cross_layer"):
        target = pool[:, CROSS_LAYERS // 2] if layout == "cross_layer" else kv
        kc, vc = target.unbind(1)
        t, how = time_call(lambda kc=kc, vc=vc: tc.reshape_and_cache(key, value, kc, vc, slots))
        add_timing(run, "cache_write", f"N={n}", layout, "kvcore-triton", t, how, nbytes)
    with run.section(f"torch cache write N={n}"):
        kc, vc = kv.unbind(1)
        blocks, offsets = slots // BS, slots % BS

        def index_put() -> None:
            kc[blocks, offsets] = key
            vc[blocks, offsets] = value
        t, how = time_call(index_put)
        add_timing(run, "cache_write", f"N={n}", "standard", "torch-index_put", t, how, nbytes)


def time_prefill(run: Run, flashinfer: bool = False, config=None) -> None:
    """kvcore (default config or ``config``) and torch SDPA, or FlashInfer's paged prefill."""
    ta = triton_attention()
    b, length = PREFILL
    batch = DecodeBatch(b, length, q_len=length)
    kc, vc = batch.caches(False)
    shape = f"{b}x{length}"
    flops = 4 * b * HQ * D * length * (length + 1) / 2  # QK^T and PV, causal half
    out = torch.empty_like(batch.query)
    fn = lambda: ta.paged_attention(batch.query, kc, vc, **batch.kwargs(), output=out,  # noqa: E731
                                    plan=ops.TritonAttentionPlan(config=config))
    fn()
    if flashinfer:
        fi = flashinfer_module()
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        pages = batch.block_table.shape[1]
        wrapper.plan(batch.qsl, (torch.arange(b + 1, device=DEVICE) * pages).to(torch.int32),
                     batch.block_table.flatten(),
                     torch.full((b,), length - (pages - 1) * BS, dtype=torch.int32,
                                device=DEVICE),
                     HQ, HK, D, BS, causal=True, sm_scale=batch.scale, q_data_type=DTYPE,
                     kv_data_type=DTYPE)
        fi_out = torch.empty_like(batch.query)
        wrapper.run(batch.query, batch.kv, out=fi_out)
        err = rel_err(fi_out, out)
        run.check(f"prefill.{shape}.flashinfer_vs_kvcore", err < 1e-2, rel_err=err)
        t, how = time_call(lambda: wrapper.run(batch.query, batch.kv, out=fi_out))
        add_timing(run, "prefill", shape, "standard", "flashinfer", t, how, flops=flops,
                   rel_err_vs_kvcore=err)
        return
    impl = "kvcore-triton" if config is None else "kvcore-triton-best"
    if config is None:
        ref = paged_attention_ref(batch.query, kc, vc, **batch.kwargs())
        run.check(f"prefill.{shape}.vs_reference", rel_err(out, ref) < 1e-2,
                  rel_err_fp32_ref=rel_err(out, ref))
    t, how = time_call(fn)
    used = config or default_config(b * length, b, HQ, HK, D, batch.block_table.shape[1] * BS,
                                       torch.device(DEVICE))
    add_timing(run, "prefill", shape, "standard", impl, t, how, flops=flops,
               config=dataclass_dict(used))
    if config is not None:
        return
    with run.section(f"torch prefill {shape}"):
        def sdpa() -> torch.Tensor:
            k = kc[batch.block_table].reshape(b, -1, HK, D)[:, :length].transpose(1, 2)
            v = vc[batch.block_table].reshape(b, -1, HK, D)[:, :length].transpose(1, 2)
            q = batch.query.view(b, length, HQ, D).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=batch.scale, enable_gqa=True)
        t, how = time_call(sdpa)
        add_timing(run, "prefill", shape, "standard", "torch-gather-sdpa", t, how, flops=flops)


def sweep(run: Run, tiles: list[tuple], splits: dict, prefill_tiles: list[tuple]) -> None:
    """Time decode tile configs x split counts on every shape (standard layout), tile config
    by tile config so that a cut-off by the time budget still covers all shapes; then prefill
    tile configs. Rows go to ``results["sweeps"]``."""
    ta = triton_attention()
    device = torch.device(DEVICE)
    batches = {shape: DecodeBatch(*shape) for shape in DECODE_SHAPES}
    pre = DecodeBatch(*PREFILL, q_len=PREFILL[1])
    jobs = [("decode", shape, tile, split) for tile in tiles for shape in DECODE_SHAPES
            for split in splits[shape]]
    jobs += [("prefill", PREFILL, tile, 1) for tile in prefill_tiles]
    for op, shape, tile, split in jobs:
        if run.elapsed() > run.budget_s:
            run.log("sweep stopped: time budget reached")
            return
        batch = batches[shape] if op == "decode" else pre
        b, length = shape
        kc, vc = batch.caches(False)
        base = default_config(batch.query.shape[0], b, HQ, HK, D,
                              batch.block_table.shape[1] * BS, device, gluon=False)
        if op == "decode":
            block_n, warps, stages = tile
            cfg = (ops.TritonSplitKVConfig(
                block_q=base.block_q, g_pad=base.g_pad, block_n=block_n, num_splits=split,
                num_warps=warps, num_stages=stages, const_block=base.const_block)
                if split > 1 else ops.TritonDecodeConfig(
                block_q=base.block_q, g_pad=base.g_pad, block_n=block_n, num_warps=warps,
                num_stages=stages, const_block=base.const_block))
        else:
            block_q, block_n, warps, stages = tile
            cfg = dataclasses.replace(base, block_q=block_q, block_n=block_n, num_warps=warps,
                                      num_stages=stages)
        out = torch.empty_like(batch.query)
        try:
            t, how = time_call(lambda cfg=cfg, batch=batch, kc=kc, vc=vc, out=out:
                               ta.paged_attention(batch.query, kc, vc, **batch.kwargs(),
                                                  output=out,
                                                  plan=ops.TritonAttentionPlan(config=cfg)))
        except Exception as exc:
            run.log(f"sweep {op} {shape} {cfg} failed: {type(exc).__name__}: {exc}")
            continue
        row = {"op": op, "shape": f"{b}x{length}", "config": dataclass_dict(cfg),
               "time_us": t * 1e6, "method": how}
        if op == "decode":
            row["GBps"] = batch.kv_bytes() / t / 1e9
        else:
            row["TFLOPs"] = 4 * b * HQ * D * length * (length + 1) / 2 / t / 1e12
        run.results["sweeps"].append(row)
        run.log(f"sweep {op} {b}x{length} {dataclass_dict(cfg)}: {t * 1e6:.1f} us "
                f"{row.get('GBps', row.get('TFLOPs')):.0f} {'GB/s' if op == 'decode' else 'TF'}")


def best_config(run: Run, op: str, shape: tuple[int, int]):
    rows = [r for r in run.results["sweeps"]
            if r["op"] == op and r["shape"] == f"{shape[0]}x{shape[1]}"]
    if not rows:
        return None
    return config_from_dict(min(rows, key=lambda r: r["time_us"])["config"])


# ----------------------------------------------------------------------------- report


def _short(cfg: dict | None) -> str:
    if not cfg:
        return ""
    return (f"q{cfg['block_q']}n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}"
            f"x{cfg.get('num_splits', 1)}")


def summary_table(run: Run) -> str:
    """One row per (op, shape, layout, kvcore variant): kvcore's time and rate, its share of the
    measured ceiling (read for decode, copy for cache writes), and the peers' times."""
    ceil = run.results["ceilings"]
    timings = run.results["timings"]
    keys: list[tuple] = []
    for t in timings:
        if (t["op"], t["shape"], t["layout"]) not in keys:
            keys.append((t["op"], t["shape"], t["layout"]))
    ceiling_of = {"decode": ceil.get("read_GBps"), "cache_write": ceil.get("copy_GBps")}
    rows = []
    for op, shape, layout in keys:
        group = {t["impl"]: t for t in timings
                 if (t["op"], t["shape"], t["layout"]) == (op, shape, layout)}
        torch_row = next((t for t in timings if (t["op"], t["shape"]) == (op, shape)
                          and t["impl"].startswith("torch")), None)
        fi = group.get("flashinfer")
        ceiling = ceiling_of.get(op)
        for impl in ("kvcore-triton", "kvcore-triton-best"):
            ours = group.get(impl)
            if ours is None:
                continue
            rate = (f"{ours['GBps']:.0f} GB/s" if "GBps" in ours
                    else f"{ours.get('TFLOPs', 0):.0f} TFLOP/s")
            rows.append([
                op, shape, layout, "best" if impl.endswith("best") else "default",
                _short(ours.get("config")), f"{ours['time_us']:.1f}", rate,
                f"{100 * ours['GBps'] / ceiling:.1f}%" if ceiling and "GBps" in ours else "-",
                f"{torch_row['time_us'] / ours['time_us']:.2f}x" if torch_row else "-",
                f"{fi['time_us']:.1f}" if fi else "-",
                f"{100 * fi['GBps'] / ceiling:.1f}%" if fi and ceiling and "GBps" in fi else
                (f"{fi['TFLOPs']:.0f} TF" if fi and "TFLOPs" in fi else "-"),
                f"{fi['time_us'] / ours['time_us']:.2f}" if fi else "-",
            ])
    headers = ["op", "shape", "layout", "kvcore", "config", "us", "rate", "% ceiling",
               "torch/kvcore", "FI us", "FI % ceil", "FI/kvcore"]
    return harness.format_table(rows, headers, tablefmt="simple")


def flashinfer_warmup() -> int:
    """Build FlashInfer's JIT modules for this benchmark's paths on tiny inputs (run in the
    background while other work uses the GPU; the modules are cached on disk)."""
    t0 = time.time()
    fi = flashinfer_module()
    print(f"flashinfer {fi.__version__}", flush=True)
    batch = DecodeBatch(2, 64)
    flashinfer_decode(batch, batch.kv)()
    print(f"decode module ready after {time.time() - t0:.0f}s", flush=True)
    n = 32
    _, _, fi_args = write_batch(n)
    kv = randn(64, 2, BS, HK, D)
    fi.append_paged_kv_cache(randn(n, HK, D), randn(n, HK, D), paged_kv_cache=kv,
                             kv_layout="NHD", **fi_args)
    print(f"append module ready after {time.time() - t0:.0f}s", flush=True)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop optional sweeps after this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--flashinfer-warmup", action="store_true",
                        help="only build FlashInfer's JIT modules, then exit")
    args = parser.parse_args()
    if args.flashinfer_warmup:
        return flashinfer_warmup()
    run = Run(Path(args.out), "bench_triton", ("correctness", "timings", "sweeps"),
              checks="correctness", device=DEVICE, budget_s=args.budget_s)
    meta = run.results["meta"]
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE,
                shapes=dict(hq=HQ, hk=HK, d=D, bs=BS, dtype=str(DTYPE)))
    meta["triton"] = harness.triton_version()
    if DEVICE == "cuda":
        meta["memory_GiB"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        meta["flashinfer"] = flashinfer_module().__version__
    except Exception as exc:
        meta["flashinfer"] = f"unavailable: {type(exc).__name__}: {exc}"
    run.log(json.dumps(meta))
    torch.manual_seed(0)

    with run.section("ceilings at start"):
        measure_ceilings(run, "start")
    with run.section("correctness: cache writes"):
        check_cache_writes(run)
    with run.section("correctness: attention"):
        check_attention(run)
    with run.section("correctness: int64 32-layer pool"):
        check_int64_pool(run)
    ops.set_value_checks(False)  # timing: no host syncs inside the calls
    for b, length in DECODE_SHAPES:
        with run.section(f"decode {b}x{length}"):
            time_decode(run, b, length)
    for n in WRITE_SIZES:
        with run.section(f"cache write N={n}"):
            time_cache_write(run, n)
    with run.section("prefill"):
        time_prefill(run)
    with run.section("sweeps"):
        sweep(run, DECODE_TILES, SPLIT_SWEEPS, PREFILL_TILES)
    for shape in DECODE_SHAPES:
        with run.section(f"decode {shape[0]}x{shape[1]} best swept config"):
            best = best_config(run, "decode", shape)
            if best is not None:
                time_decode(run, *shape, config=best)
    with run.section("prefill best swept config"):
        best = best_config(run, "prefill", PREFILL)
        if best is not None:
            time_prefill(run, config=best)
    # FlashInfer last: its JIT build (started in the background by the run command) then has
    # had the most time, and a failure there cannot cost kvcore's numbers.
    for b, length in DECODE_SHAPES:
        with run.section(f"flashinfer decode {b}x{length}"):
            time_decode_flashinfer(run, b, length)
    for n in WRITE_SIZES:
        with run.section(f"flashinfer cache write N={n}"):
            time_cache_write(run, n, flashinfer=True)
    with run.section("flashinfer prefill"):
        time_prefill(run, flashinfer=True)
    ops.set_value_checks(True)
    with run.section("ceilings at end"):
        measure_ceilings(run, "end")

    failed = [c["check"] for c in run.results["correctness"] if not c["ok"]]
    run.results["summary"] = {"failed_checks": failed, "errors": len(run.results["errors"])}
    run.save()
    table = summary_table(run)
    run.log("correctness: " + ("all passed" if not failed else f"FAILED {failed}") +
            f"; section errors: {len(run.results['errors'])}")
    ceil = run.results["ceilings"]
    run.log(f"ceilings (max of start/end): copy {ceil.get('copy_GBps', 0):.0f} GB/s, read "
            f"{ceil.get('read_GBps', 0):.0f} GB/s")
    run.log("\n" + table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
