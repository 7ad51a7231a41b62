#!/usr/bin/env python3
"""Real-size correctness and speed of kvcore-mla's kernels on one GPU (written for the H200).

One run does, in order, each section isolated (an error is logged and the run goes on):

0. precompile: every sweep candidate compiled at once, one process each (``--compile-workers``,
   by default cores - 2, at most 14, with ``--sweep-only``; none otherwise), FlashInfer's JIT
   warmed beside them; a candidate whose compiler crashes is left out of the sweep;
1. ceilings: device-to-device copy (bytes read + written) and read-only streaming (torch
   ``sum`` and a Triton streaming read; the faster is the read ceiling), after a warm-up;
2. correctness at DeepSeek sizes (kv_lora_rank 512, rope 64, 128 heads): ``concat_and_cache_mla``
   bf16 and fp8 against the reference (exact) on a cross-layer view (neighbours untouched);
   MLA decode (block 64) against the float64 reference, cross-layer bit-exact against
   contiguous; TRITON_MLA's forward on a mixed prefill + decode batch against the unabsorbed
   float64 model; the indexer write (exact, cross-layer); a 4-layer cross-layer pool of 2.4e9
   elements written and read past element 2**31, bit-exact against a small contiguous cache;
3. timings (CUDA-graph replays, median): MLA decode (``decode_attention_fwd``) at B64, 4096
   tokens, 128 and 16 heads (16 = 128 heads split over 8 GPUs), block 64, standard (layers
   outermost) and cross-layer (layer 1 of a 4-layer pool), against plain torch (gather +
   matmuls); ``concat_and_cache_mla`` and the indexer write at N in {256, 4096, 32768} tokens
   against plain torch (``index_put``), standard and cross-layer;
4. the production sweep (TRITON_MLA's builder metadata, CUDA-graph replays) at B64 x 4096 with
   16 and 128 heads, B8 x 32768 and B128 x 2048 with 128 heads: the config table's row, then
   the candidates of ``PROD_CANDIDATES`` (16 heads: each at the builder's split count and
   twice it), every point checked against float32 torch before it is timed, and the best
   one at half and twice its split count (time-boxed by ``--budget-s``, counted from the
   start of the run); the split reduction alone; the best one cross-layer against contiguous
   (bit-exact, then timed) at the first shape; and FlashInfer's
   ``BatchMLAPagedAttentionWrapper`` direct on the same cache (``ckv``/``kpe`` views),
   planned once and captured, through ``bench_flashinfer_mla.flashinfer_mla_direct``, if
   flashinfer imports (``--no-flashinfer`` skips it).

The tables printed last give time, achieved GB/s (bytes a perfect kernel moves: each latent read
once), the share of the measured ceiling (read ceiling for decode, copy ceiling for writes),
the speed-up over plain torch and the cross-layer/standard time ratio; then the production
sweep with % of read bandwidth and TFLOP/s, the best config per shape against FlashInfer, and
the winners as rows for ``MLA_DECODE_CONFIGS`` (with ``programs_per_sm`` when the winning
split count needs it). Logs and JSON go to ``--out`` (default ``$OUT``, else
``benchmarks/results``); ``--json`` also prints the JSON. ``--smoke`` runs tiny shapes on the
CPU under ``TRITON_INTERPRET=1`` to check the script itself. ``--sweep-only`` keeps steps 0, 1,
the decode checks of step 2 and step 4; ``--table-only`` cuts step 4 to the table's config.

Usage: ``python benchmarks/bench_mla.py [--out DIR] [--budget-s 150] [--smoke]
[--no-flashinfer] [--json] [--sweep-only] [--compile-workers N]``. The whole run takes about
``budget-s`` and half a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
#: --table-only: the production sweep times only the table's config (and its split variants,
#: the merge, cross-layer and FlashInfer): a short run to re-measure the rows in use.
TABLE_ONLY = "--table-only" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "plugins" / "mla")]
import kvcore_mla.ops as mla_ops  # noqa: E402
from kvcore_mla import TritonMLABackend  # noqa: E402

import kvcore  # noqa: E402
import kvcore.ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, rel_err  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE = torch.bfloat16
RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
ENTRY = RANK + ROPE
BLOCK = 64
POOL_LAYERS, LAYER = 4, 1  # timings use layer 1 of a 4-layer allocation
if SMOKE:
    RANK, ROPE, NOPE, V_DIM, ENTRY, BLOCK = 64, 16, 32, 32, 80, 16
    DECODE_SHAPES = [(2, 16, 64), (4, 16, 40)]  # (batch, heads, tokens)
    CHECK_DECODE = (2, 16, 70)
    WRITE_SIZES = [16, 64]
    CHECK_TOKENS, INT64_BLOCKS = 100, 24
else:
    DECODE_SHAPES = [(64, 128, 4096), (64, 16, 4096)]
    CHECK_DECODE = (8, 128, 4096)
    WRITE_SIZES = [256, 4096, 32768]
    CHECK_TOKENS, INT64_BLOCKS = 4096, 16384
# The production sweep (builder + CUDA graph, beside FlashInfer): (batch, heads, tokens); the
# first shape is also timed on a cross-layer view.
PROD_SHAPES = ([(2, 16, 64), (2, 64, 96)] if SMOKE else
               [(64, 16, 4096), (64, 128, 4096), (8, 128, 32768), (128, 128, 2048)])
# Candidate decode configs (kernel, block_h, block_n, warps, stages) by head count: "plain" is
# triton_mla_decode (pointer loads, whole latent), "halves" triton_mla_decode_halves, "tma"
# triton_mla_decode_tma_keysplit; the table's own row is always timed first. Many heads
# (compute-bound): the 64 x 512 float32 accumulator takes 128 registers a thread with 8 warps,
# so smaller key tiles spill less (``kvcore kernels --target sm90`` reports registers and spills
# per launch; 16 warps spill several hundred bytes and 128-head programs do not compile for lack
# of registers: both left out), and 32-head programs (no spills, the latent read four times per
# 128 heads). Few heads (memory-bound): more bytes in flight (stages, tile size) or more
# programs an SM (smaller tiles). Compiles dominate the sweep's time (a 64-head tile takes ~15 s
# of one CPU core for sm90): one process per candidate compiles it first, many at once
# (``--compile-workers``), filling Triton's disk cache; a candidate whose compiler crashed is
# left out of the sweep. The TMA candidates come first so the budget never skips them; 64-key
# tiles take two stages at most (three need ~295 KiB of shared memory beside the query tile,
# more than an SM has).
PROD_CANDIDATES = {
    "many": [("tma", 64, 32, 8, 3), ("tma", 64, 64, 8, 2), ("tma", 64, 32, 8, 4),
             ("plain", 64, 32, 8, 2), ("plain", 64, 32, 8, 3), ("plain", 64, 16, 8, 4),
             ("plain", 64, 16, 8, 3), ("halves", 64, 64, 8, 2), ("halves", 64, 32, 8, 3),
             ("plain", 32, 64, 8, 3), ("plain", 32, 32, 8, 4)],
    "few": [("plain", 16, 64, 4, 3), ("plain", 16, 64, 8, 2), ("plain", 16, 32, 4, 4),
            ("plain", 16, 32, 4, 3), ("plain", 16, 32, 8, 5), ("halves", 16, 64, 8, 3),
            ("plain", 32, 32, 8, 3), ("plain", 16, 16, 4, 8)],
}
_KERNELS = {"plain": "triton_mla_decode", "halves": "triton_mla_decode_halves",
            "tma": "triton_mla_decode_tma_keysplit"}


def tma():
    from kvcore_mla.ops import triton_mla_attention as mod

    return mod


def configs():
    from kvcore_mla.ops import mla_configs as mod

    return mod


def tcache():
    from kvcore_mla.ops import triton_cache as mod

    return mod


# ----------------------------------------------------------------------------- helpers


_SEED = [0]


def _next_seed() -> int:
    _SEED[0] += 1
    return 1000 + _SEED[0]


def cpu_generator() -> torch.Generator:
    return torch.Generator().manual_seed(_next_seed())


def _fresh_generator(device: torch.device) -> torch.Generator:
    """A new generator per call, never torch's default CUDA generator: even if some capture
    failed and poisoned that one, fresh generators keep working."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_next_seed())
    return gen


def fill_normal_(t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Fill a floating tensor (a big cache pool) with normal data, outside any capture."""
    if t.dtype.itemsize == 1:  # fp8: fill through a wider tensor, in chunks of blocks
        for chunk in t.view(t.shape[0], -1).split(1024):
            chunk.copy_(torch.empty(chunk.shape, dtype=torch.bfloat16, device=t.device)
                        .normal_(0.0, scale, generator=_fresh_generator(t.device)))
        return t
    return t.normal_(0.0, scale, generator=_fresh_generator(t.device))


def fill_bytes_(t: torch.Tensor, low: int, high: int) -> torch.Tensor:
    return t.random_(low, high, generator=_fresh_generator(t.device))


def randperm(n: int) -> torch.Tensor:
    """A permutation drawn on the CPU (``torch.randperm`` on CUDA uses the global RNG)."""
    return torch.randperm(n, generator=cpu_generator()).to(DEVICE)


def randn(*shape: int, dtype: torch.dtype = DTYPE, scale: float = 1.0) -> torch.Tensor:
    """Normal data made before any timing: drawn on the CPU for small tensors, by a fresh
    device generator for large ones; never the global CUDA RNG."""
    numel = math.prod(shape)
    if DEVICE == "cpu" or numel <= (1 << 22):
        t = torch.randn(*shape, generator=cpu_generator()) * scale
        return t.to(dtype).to(DEVICE)
    t = torch.empty(*shape, dtype=torch.float32, device=DEVICE)
    return fill_normal_(t, scale).to(dtype)


def layer_pool(num_blocks: int, cross_layer: bool, dtype: torch.dtype = DTYPE,
               kv_cache_dtype: str = "auto") -> kvcore.KVCaches:
    """A ``POOL_LAYERS``-layer TRITON_MLA allocation, cross-layer or layers outermost."""
    return kvcore.allocate_kv_caches(
        TritonMLABackend, num_layers=POOL_LAYERS, num_blocks=num_blocks, block_size=BLOCK,
        num_kv_heads=1, head_size=ENTRY, dtype=dtype, device=DEVICE, cross_layer=cross_layer,
        kv_cache_dtype=kv_cache_dtype)


def others_bytes(caches: kvcore.KVCaches) -> list[torch.Tensor]:
    return [caches.layers[i].contiguous().view(torch.uint8) for i in range(POOL_LAYERS)
            if i != LAYER]


class DecodeBatch:
    """``batch`` decode requests of ``tokens`` tokens, each over shuffled pages of a latent
    cache; the cache lives in layer ``LAYER`` of a standard and of a cross-layer allocation,
    with random data in every layer."""

    def __init__(self, batch: int, heads: int, tokens: int) -> None:
        self.batch, self.heads, self.tokens = batch, heads, tokens
        pages = -(-tokens // BLOCK)
        num_blocks = batch * pages + 16
        self.pools = {}
        for cross_layer in (False, True):
            caches = layer_pool(num_blocks, cross_layer)
            fill_normal_(caches.storage)
            self.pools[cross_layer] = caches
        self.pools[True].layers[LAYER].copy_(self.pools[False].layers[LAYER])
        perm = randperm(num_blocks)[: batch * pages]
        self.block_table = perm.view(batch, pages).to(torch.int32)
        self.seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device=DEVICE)
        self.q = randn(batch, heads, ENTRY)
        self.scale = (NOPE + ROPE) ** -0.5

    def cache(self, cross_layer: bool) -> torch.Tensor:
        return self.pools[cross_layer].layers[LAYER]

    def kv_bytes(self) -> int:
        """Bytes of latents a perfect kernel reads: each one once."""
        return self.batch * self.tokens * ENTRY * DTYPE.itemsize

    def run(self, cross_layer: bool, num_splits: int, config=None
            ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        cache = self.cache(cross_layer)
        o = torch.empty(self.batch, self.heads, RANK, dtype=DTYPE, device=DEVICE)
        lse = torch.empty(self.batch, self.heads, dtype=torch.float32, device=DEVICE)
        logits = torch.empty(self.batch, self.heads, num_splits, RANK + 1,
                             dtype=torch.float32, device=DEVICE)
        fwd = tma().decode_attention_fwd

        def call() -> tuple[torch.Tensor, torch.Tensor]:
            fwd(self.q, cache, cache[..., :RANK], o, lse, self.block_table, self.seq_lens,
                logits, num_splits, self.scale, BLOCK, True, config=config)
            return o, lse

        return call

    def default_splits(self) -> int:
        """The split count TRITON_MLA's builder picks for this batch on this GPU."""
        cfg = configs().mla_decode_config(self.heads, configs().gpu_family(DEVICE))
        return configs().mla_decode_num_splits(self.batch, self.heads, self.tokens, cfg,
                                               _num_sms())

    def torch_decode(self) -> Callable[[], torch.Tensor]:
        """Plain torch: gather each request's latents, then two batched matmuls."""
        cache = self.cache(False)

        def call() -> torch.Tensor:
            lat = cache[self.block_table.long()].reshape(self.batch, -1, ENTRY)
            scores = torch.bmm(self.q, lat.transpose(1, 2)).float() * self.scale
            probs = torch.softmax(scores, dim=-1).to(DTYPE)
            return torch.bmm(probs, lat[..., :RANK])

        return call


# ----------------------------------------------------------------------------- ceilings


def measure_ceilings(run: Run) -> None:
    """Copy and read bandwidth after a warm-up (an idle GPU needs a moment to raise clocks)."""
    nbytes = (1 << 16) if SMOKE else (2 << 30)
    x = randn(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    harness.warm_up(y, x, 0.0 if SMOKE else 1.0)
    copy, how = harness.copy_gbps(y, x, time_call)
    read_sum, _ = harness.read_gbps(x, time_call)
    read_triton, _ = harness.triton_read_gbps(x, time_call)
    c = run.results["ceilings"]
    c.update(copy_GBps=copy, read_torch_sum_GBps=read_sum, read_triton_GBps=read_triton,
             buffer_bytes=nbytes, method=how)
    c["read_GBps"] = max(c["read_torch_sum_GBps"], c["read_triton_GBps"])
    run.log(f"copy {c['copy_GBps']:.0f} GB/s (read+write), read {c['read_GBps']:.0f} GB/s "
            f"(torch.sum {c['read_torch_sum_GBps']:.0f}, triton {c['read_triton_GBps']:.0f})")


# ----------------------------------------------------------------------------- correctness


def check_concat(run: Run) -> None:
    n = CHECK_TOKENS
    num_blocks = 2 * n // BLOCK + 1
    fused = randn(n, ENTRY)
    kv_c, k_pe = fused[:, :RANK], fused[:, RANK:]
    slots = randperm(num_blocks * BLOCK)[:n]
    slots[::97] = -1
    scale = torch.tensor([0.3], device=DEVICE)
    for kv_cache_dtype in ("auto", "fp8"):
        caches = layer_pool(num_blocks, True, kv_cache_dtype=kv_cache_dtype)
        fill_bytes_(caches.storage.view(torch.uint8), 0, 120)  # finite garbage in every layer
        before = others_bytes(caches)
        view = caches.layers[LAYER]
        ref = view.clone()
        tcache().concat_and_cache_mla(kv_c, k_pe, view, slots, kv_cache_dtype, scale)
        mla_ops.concat_and_cache_mla_ref(kv_c, k_pe, ref, slots, kv_cache_dtype, scale)
        same = torch.equal(view.view(torch.uint8), ref.view(torch.uint8))
        untouched = all(torch.equal(a, b) for a, b in zip(before, others_bytes(caches),
                                                          strict=True))
        run.check(f"concat_and_cache_mla.{kv_cache_dtype}.cross_layer.exact",
                  same and untouched, tokens=n, neighbours_untouched=untouched)


def check_indexer(run: Run) -> None:
    n, head_dim = CHECK_TOKENS, 128
    entry = mla_ops.indexer_cache_head_size(head_dim, 128)
    num_blocks = 2 * n // BLOCK + 1
    k = randn(n, head_dim)
    slots = randperm(num_blocks * BLOCK)[:n]
    pool = fill_bytes_(torch.empty(num_blocks, POOL_LAYERS, BLOCK, entry, dtype=torch.uint8,
                                   device=DEVICE), 0, 256)
    before = pool.clone()
    view = pool[:, LAYER]
    ref = view.clone()
    tcache().indexer_k_quant_and_cache(k, view, slots, 128, "ue8m0")
    mla_ops.indexer_k_quant_and_cache_ref(k, ref, slots, 128, "ue8m0")
    others = [i for i in range(POOL_LAYERS) if i != LAYER]
    run.check("indexer_k_quant_and_cache.cross_layer.exact",
              torch.equal(view, ref) and torch.equal(pool[:, others], before[:, others]), tokens=n)


def check_decode(run: Run) -> None:
    batch, heads, tokens = CHECK_DECODE
    data = DecodeBatch(batch, heads, tokens)
    splits = max(2, data.default_splits())
    o, lse = data.run(False, splits)()
    o, lse = o.clone(), lse.clone()
    o_xl, lse_xl = data.run(True, splits)()
    run.check("mla_decode.cross_layer.bit_exact", torch.equal(o, o_xl) and
              torch.equal(lse, lse_xl), batch=batch, heads=heads, tokens=tokens, splits=splits)
    cache = data.cache(False).double()
    o_ref = torch.empty(batch, heads, RANK, dtype=torch.float64, device=DEVICE)
    lse_ref = torch.empty(batch, heads, dtype=torch.float64, device=DEVICE)
    mla_ops.decode_attention_ref(data.q.double(), cache, cache[..., :RANK], o_ref, lse_ref,
                                 data.block_table, data.seq_lens, None, 1, data.scale, BLOCK,
                                 True)
    err_o, err_lse = rel_err(o, o_ref), rel_err(lse, lse_ref)
    run.check("mla_decode.vs_float64", err_o < 1e-2 and err_lse < 1e-3,
              rel_err_o=err_o, rel_err_lse=err_lse)


def check_backend(run: Run) -> None:
    """TRITON_MLA forward (absorbed) against the unabsorbed float64 model, mixed batch."""
    heads = DECODE_SHAPES[0][1]
    w = randn(heads * (NOPE + V_DIM), RANK, scale=RANK ** -0.5)
    for kv_cache_dtype in ("auto", "fp8"):
        impl = TritonMLABackend.get_impl_cls()(
            heads, ENTRY, (NOPE + ROPE) ** -0.5, kv_cache_dtype=kv_cache_dtype,
            kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
            kv_b_proj_weight=w)
        lens = [CHECK_TOKENS // 2, CHECK_TOKENS, 300 if not SMOKE else 30]
        num_blocks = sum(-(-n // BLOCK) for n in lens) + 4
        caches = layer_pool(num_blocks, True, kv_cache_dtype=kv_cache_dtype)
        cache = caches.layers[LAYER]
        table = torch.randperm(num_blocks, generator=cpu_generator())[: num_blocks - 4].tolist()
        tables, start = [], 0
        for n in lens:
            tables.append(table[start:start + -(-n // BLOCK)])
            start += -(-n // BLOCK)
        layer = kvcore.LayerScales(k_scale=torch.tensor([0.5], device=DEVICE))
        history = kvcore.build_attention_metadata(lens, [0] * 3, tables, BLOCK, device=DEVICE)
        impl.do_kv_cache_update(layer, randn(history.num_actual_tokens, RANK),
                                randn(history.num_actual_tokens, ROPE), cache,
                                history.slot_mapping)
        q_lens = [lens[0] // 4, 1, 1]
        meta = kvcore.build_attention_metadata(
            q_lens, [n - q for n, q in zip(lens, q_lens, strict=True)], tables, BLOCK,
            device=DEVICE)
        query = randn(meta.num_actual_tokens, heads, NOPE + ROPE)
        out = impl.forward(layer, query, None, None, cache, meta)
        ref = mla_ops.mla_forward_ref(
            query.double(), cache, w, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
            v_head_dim=V_DIM, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
            block_table=meta.block_table, scale=impl.scale, kv_cache_dtype=kv_cache_dtype,
            k_scale=layer.k_scale)
        err = rel_err(out, ref)
        run.check(f"triton_mla.forward.mixed_batch.{kv_cache_dtype}.vs_float64", err < 1e-2,
                  rel_err=err, query_lens=q_lens, seq_lens=lens)


def check_int64(run: Run) -> None:
    """Layer 3 of a 4-layer cross-layer pool past element 2**31: exact vs a small cache."""
    caches = kvcore.allocate_kv_caches(
        TritonMLABackend, num_layers=4, num_blocks=INT64_BLOCKS, block_size=BLOCK,
        num_kv_heads=1, head_size=ENTRY, dtype=DTYPE, device=DEVICE)
    view = caches.layers[3]
    used = min(40, INT64_BLOCKS // 2)
    high = torch.arange(INT64_BLOCKS - used, INT64_BLOCKS, device=DEVICE)
    max_offset = (INT64_BLOCKS - 1) * view.stride(0) + 3 * BLOCK * ENTRY
    n = used * BLOCK - 5
    kv_c, k_pe = randn(n, RANK), randn(n, ROPE)
    pos = torch.arange(n, device=DEVICE)
    tcache().concat_and_cache_mla(kv_c, k_pe, view, high[pos // BLOCK] * BLOCK + pos % BLOCK)
    small = torch.zeros(used, BLOCK, ENTRY, dtype=DTYPE, device=DEVICE)
    tcache().concat_and_cache_mla(kv_c, k_pe, small, pos)
    written = torch.equal(view[high], small)
    untouched = caches.layers[2][high].abs().max().item() == 0
    q = randn(1, DECODE_SHAPES[0][1], ENTRY)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    outs = []
    for cache, table in ((view, high[None].int()),
                         (small, torch.arange(used, device=DEVICE)[None].int())):
        o = torch.empty(1, q.shape[1], RANK, dtype=DTYPE, device=DEVICE)
        lse = torch.empty(1, q.shape[1], dtype=torch.float32, device=DEVICE)
        logits = torch.empty(1, q.shape[1], 4, RANK + 1, dtype=torch.float32, device=DEVICE)
        tma().decode_attention_fwd(q, cache, cache[..., :RANK], o, lse, table, lens, logits, 4,
                                   0.1, BLOCK, True)
        outs.append((o, lse))
    read = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    run.check("int64_pool.write_and_decode.exact", written and untouched and read,
              pool_elements=caches.storage.numel(), max_element_offset=max_offset,
              beyond_2pow31=max_offset > 2**31, neighbour_untouched=untouched)


# ----------------------------------------------------------------------------- timings


def add_timing(run: Run, **row: object) -> None:
    run.results["timings"].append(row)
    run.log("TIME", row)


def time_decode(run: Run) -> None:
    read_ceiling = run.results["ceilings"].get("read_GBps")
    for batch, heads, tokens in DECODE_SHAPES:
        data = DecodeBatch(batch, heads, tokens)
        splits = data.default_splits()
        t_torch, _ = time_call(data.torch_decode())
        times = {}
        for cross_layer in (False, True):
            t, how = time_call(data.run(cross_layer, splits))
            times[cross_layer] = t
            gbps = data.kv_bytes() / t / 1e9
            add_timing(run, op="mla_decode", shape=f"B{batch} H{heads} L{tokens} bs{BLOCK}",
                       layout="cross-layer" if cross_layer else "standard", splits=splits,
                       time_us=t * 1e6, GBps=gbps,
                       ceiling_frac=gbps / read_ceiling if read_ceiling else None,
                       vs_torch=t_torch / t, method=how,
                       xl_over_std=t / times[False] if cross_layer else None)
        add_timing(run, op="mla_decode_torch", shape=f"B{batch} H{heads} L{tokens} bs{BLOCK}",
                   layout="standard", time_us=t_torch * 1e6,
                   GBps=data.kv_bytes() / t_torch / 1e9)
        del data


def time_writes(run: Run) -> None:
    copy_ceiling = run.results["ceilings"].get("copy_GBps")
    for n in WRITE_SIZES:
        num_blocks = 2 * n // BLOCK + 1
        fused = randn(n, ENTRY)  # kv_c and k_pe as column slices of one projection output
        slots = randperm(num_blocks * BLOCK)[:n]
        moved = 2 * n * ENTRY * DTYPE.itemsize  # read the latents, write them
        times = {}
        for cross_layer in (False, True):
            cache = layer_pool(num_blocks, cross_layer).layers[LAYER]

            def torch_write(c: torch.Tensor = cache, s: torch.Tensor = slots,
                            latent: torch.Tensor = fused) -> None:
                c[s // BLOCK, s % BLOCK] = latent

            def triton_write(c: torch.Tensor = cache, s: torch.Tensor = slots,
                             latent: torch.Tensor = fused) -> None:
                tcache().concat_and_cache_mla(latent[:, :RANK], latent[:, RANK:], c, s)

            t_torch, _ = time_call(torch_write)
            t, how = time_call(triton_write)
            times[cross_layer] = t
            gbps = moved / t / 1e9
            add_timing(run, op="concat_and_cache_mla", shape=f"N{n}",
                       layout="cross-layer" if cross_layer else "standard", time_us=t * 1e6,
                       GBps=gbps, ceiling_frac=gbps / copy_ceiling if copy_ceiling else None,
                       vs_torch=t_torch / t, method=how,
                       xl_over_std=t / times[False] if cross_layer else None)
        k = randn(n, 128)
        entry = mla_ops.indexer_cache_head_size()
        icache = torch.zeros(num_blocks, BLOCK, entry, dtype=torch.uint8, device=DEVICE)
        args = (k, icache, slots)
        t, how = time_call(lambda a=args: tcache().indexer_k_quant_and_cache(*a))
        # The reference indexes with boolean masks (a host sync): not capturable.
        t_ref, _ = time_call(lambda a=args: mla_ops.indexer_k_quant_and_cache_ref(*a),
                             graph=False)
        moved_idx = n * (128 * DTYPE.itemsize + entry)
        add_timing(run, op="indexer_k_quant_and_cache", shape=f"N{n}", layout="standard",
                   time_us=t * 1e6, GBps=moved_idx / t / 1e9,
                   ceiling_frac=moved_idx / t / 1e9 / copy_ceiling if copy_ceiling else None,
                   vs_torch=t_ref / t, method=how)


# ----------------------------------------------------------------------------- production sweep


def _cfg(kernel: str, *tile: int):
    """A decode config from a candidate tuple (:data:`PROD_CANDIDATES`' or
    :func:`_cfg_tuple`'s): the kernel's short or full name, then its tile."""
    kernel = _KERNELS.get(kernel, kernel)
    cls = configs().DECODE_CONFIG_TYPES[kernel]
    if not tile:
        return cls()
    block_h, block_n, warps, stages = tile
    return cls(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)


def _cfg_tuple(cfg) -> tuple:
    if isinstance(cfg, configs().GluonMLAWSConfig):
        return (cfg.kernel,)
    return (cfg.kernel, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages)


def _cfg_name(cfg) -> str:
    if isinstance(cfg, configs().GluonMLAWSConfig):
        return cfg.kernel
    return f"{cfg.kernel} h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"


#: Candidates whose compile crashed the compiler's process (filled by :func:`precompile`).
_CRASHED: set = set()


class ProdCase:
    """A uniform-decode step of ``batch`` requests of ``tokens`` tokens and ``heads`` heads,
    run as TRITON_MLA runs it: its builder's metadata (config, splits, workspace) for a CUDA
    graph of this batch size, then ``mla_attention`` with exactly the arguments the backend's
    forward passes. The cache is layer ``LAYER`` of a standard allocation (and of a cross-layer
    one when ``cross_layer``), every layer random, pages shuffled."""

    def __init__(self, batch: int, heads: int, tokens: int, cross_layer: bool = False) -> None:
        self.batch, self.heads, self.tokens = batch, heads, tokens
        pages = -(-tokens // BLOCK)
        num_blocks = batch * pages + 8
        self.pools = {False: layer_pool(num_blocks, False)}
        fill_normal_(self.pools[False].storage)
        if cross_layer:
            self.pools[True] = layer_pool(num_blocks, True)
            fill_normal_(self.pools[True].storage)
            self.pools[True].layers[LAYER].copy_(self.pools[False].layers[LAYER])
        table = randperm(num_blocks)[: batch * pages].view(batch, pages).to(torch.int32)
        self.common = kvcore.build_attention_metadata(
            [1] * batch, [tokens - 1] * batch, table.tolist(), BLOCK, device=DEVICE)
        self.q = randn(batch, heads, ENTRY)
        self.scale = (NOPE + ROPE) ** -0.5
        self.spec = kvcore.MLAAttentionSpec(block_size=BLOCK, dtype=DTYPE, kv_lora_rank=RANK,
                                            qk_rope_head_dim=ROPE)

    def cache(self, cross_layer: bool = False) -> torch.Tensor:
        return self.pools[cross_layer].layers[LAYER]

    def shape(self) -> str:
        return f"B{self.batch} H{self.heads} L{self.tokens}"

    def kv_bytes(self) -> int:
        return self.batch * self.tokens * ENTRY * DTYPE.itemsize

    def flops(self) -> float:
        """Scores (576-wide) and the latent-weighted sum (512-wide), multiply-adds x 2."""
        return 2.0 * self.batch * self.heads * self.tokens * (ENTRY + RANK)

    def default_config(self):
        return configs().mla_decode_config(self.heads, configs().gpu_family(DEVICE))

    def call(self, config=None, cross_layer: bool = False, splits: int | None = None):
        """``(fn, out, splits)``: one forward of the step through the builder's metadata;
        ``splits`` overrides the builder's split count (with a workspace of its own)."""
        builder = TritonMLABackend.get_builder_cls()(
            self.spec, num_heads=self.heads, max_num_seqs=self.batch,
            max_num_batched_tokens=self.batch, max_model_len=self.tokens, device=DEVICE,
            decode_config=config)
        meta = builder.build(self.common, graph_batch_size=self.batch)
        plan = meta.plan
        n = plan.num_kv_splits
        if splits is not None and splits != n:
            n = splits
            numel = tma().mla_workspace_numel(self.batch, self.heads, RANK, n)
            plan = configs().TritonMLAPlan(
                plan.config, n,
                torch.empty(numel, dtype=torch.float32, device=DEVICE) if numel else None)
        cache = self.cache(cross_layer)
        out = torch.empty(self.batch, self.heads, RANK, dtype=DTYPE, device=DEVICE)

        def fn() -> torch.Tensor:
            return tma().mla_attention(
                self.q, cache, kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table, scale=self.scale,
                output=out, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                plan=plan)

        return fn, out, n

    def reference(self) -> torch.Tensor:
        """float32 torch on the same bf16 data: gather, scores, softmax, weighted sum."""
        table = self.common.block_table.long()
        lat = self.cache()[table].reshape(self.batch, -1, ENTRY)[:, :self.tokens].float()
        scores = torch.einsum("bhd,bnd->bhn", self.q.float(), lat) * self.scale
        return torch.einsum("bhn,bnd->bhd", torch.softmax(scores, -1), lat[..., :RANK])

    def flashinfer(self):
        """FlashInfer's MLA decode on the same cache (``ckv``/``kpe`` are views of it),
        planned once, as ``bench_flashinfer_mla.py`` calls it; ``None`` when flashinfer does
        not import."""
        try:
            import flashinfer.mla  # noqa: F401
        except Exception:
            return None
        from bench_flashinfer_mla import flashinfer_mla_direct

        return flashinfer_mla_direct(self.q, self.cache(), self.common, self.scale)


def _prod_row(run: Run, case: ProdCase, kind: str, name: str, t: float, *, rates: bool = True,
              **extra: object) -> dict:
    """A sweep row; ``rates=False`` for a part of the step (no bandwidth or TFLOP/s)."""
    read = run.results["ceilings"].get("read_GBps")
    gbps = case.kv_bytes() / t / 1e9 if rates else None
    row = dict(shape=case.shape(), kind=kind, config=name, time_us=t * 1e6, GBps=gbps,
               read_frac=gbps / read if read and rates else None,
               TFLOPs=case.flops() / t / 1e12 if rates else None, **extra)
    run.results["sweeps"].append(row)
    run.log("PROD", row)
    return row


def check_prod(run: Run) -> None:
    """Correctness first: the table's config at every production shape against float32 torch,
    then bit-exact on a cross-layer view at the first shape."""
    for index, (batch, heads, tokens) in enumerate(PROD_SHAPES):
        case = ProdCase(batch, heads, tokens, cross_layer=index == 0)
        fn, out, splits = case.call()
        fn()
        err = rel_err(out, case.reference())
        run.check(f"triton_mla.decode.{case.shape()}.vs_float32", err < 1e-2, rel_err=err,
                  splits=splits, config=_cfg_name(case.default_config()))
        if index == 0:
            contiguous = out.clone()
            fn_xl, out_xl, _ = case.call(cross_layer=True)
            fn_xl()
            run.check(f"triton_mla.decode.{case.shape()}.cross_layer.bit_exact",
                      torch.equal(contiguous, out_xl))
        del case


def _candidates(heads: int) -> list:
    """The table's config for ``heads``, then ``PROD_CANDIDATES``' (no duplicates, none with
    more head rows than the heads need)."""
    default = configs().mla_decode_config(heads, configs().gpu_family(DEVICE))
    found = [default]
    for c in () if TABLE_ONLY else PROD_CANDIDATES["many" if heads >= 64 else "few"]:
        cfg = _cfg(*c)
        if cfg not in found and cfg.block_h <= max(16, heads) and cfg not in _CRASHED:
            found.append(cfg)
    return found


def _split_variants(heads: int, splits: int) -> list[int]:
    """Split counts tried beside the best config's own: half and twice (four times too for
    memory-bound shapes, where two programs an SM may stream better than one)."""
    variants = {max(1, splits // 2), 2 * splits} | ({4 * splits} if heads < 64 else set())
    return sorted({min(kvcore.ops.MAX_KV_SPLITS, v) for v in variants} - {splits})


def _compile_job(job: tuple) -> str:
    """Worker: compile one decode launch (Triton's disk cache keeps it for the main process)
    on a small batch with the same specialisations as the production call (head count, split
    count, strides), or warm FlashInfer's JIT. Returns what it did."""
    kvcore.ops.set_value_checks(False)
    if job[0] == "flashinfer":
        case = ProdCase(2, 16, 2 * BLOCK)
        fn = case.flashinfer()
        if fn is not None:
            fn()
            torch.cuda.synchronize()
        return "flashinfer"
    _, heads, pages, cfg_tuple, splits = job
    cfg = _cfg(*cfg_tuple)
    # One request of one page, its table as wide as the production one (the table stride
    # is specialised), the cache and workspace shaped like the production ones.
    table = torch.zeros(1, pages, dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(2, BLOCK, ENTRY, dtype=DTYPE, device=DEVICE)
    q = torch.zeros(1, heads, ENTRY, dtype=DTYPE, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    try:
        tma().mla_attention(q, cache, kv_lora_rank=RANK, query_start_loc=starts, seq_lens=one,
                            block_table=table, scale=0.1, max_query_len=1, max_seq_len=1,
                            plan=configs().TritonMLAPlan(cfg, splits))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # e.g. out of shared memory: the sweep reports it
        return f"{_cfg_name(cfg)} splits={splits}: {type(exc).__name__}"
    return f"{_cfg_name(cfg)} splits={splits}"


def precompile(run: Run, workers: int, flashinfer: bool) -> None:
    """Compile every candidate of the sweep at the split count the builder gives it, one
    process per launch, ``workers`` at once (and warm FlashInfer's JIT), so the sweep's budget
    goes to timing and a compiler crash (an abort, not an exception) costs one candidate, not
    the run. Triton specialises integers on being 1 or a multiple of 16: splits 1, 2 and 16
    stand for every count. The best config's other split counts compile in the sweep."""
    if workers <= 0:
        return
    import concurrent.futures
    import subprocess

    def compile_one(job: tuple) -> tuple:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-job", json.dumps(job),
               *(["--smoke"] if SMOKE else [])]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired:
            return job, "timeout", ""
        return job, r.returncode, (r.stdout.strip().splitlines() or [""])[-1]

    jobs: list[tuple] = [("flashinfer",)] if flashinfer else []
    seen = set()
    for batch, heads, tokens in PROD_SHAPES:
        pages = -(-tokens // BLOCK)
        for cfg in _candidates(heads):
            splits = configs().mla_decode_num_splits(batch, heads, tokens, cfg, _num_sms())
            splits = 1 if splits == 1 else 16 if splits % 16 == 0 else 2
            key = (heads, pages % 16 == 0, cfg, splits)
            if key not in seen:
                seen.add(key)
                jobs.append(("decode", heads, pages, _cfg_tuple(cfg), splits))
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(compile_one, jobs))
    for job, rc, said in results:
        if rc != 0 and job[0] == "decode":
            _CRASHED.add(_cfg(*job[3]))
            run.log(f"precompile: {_cfg_name(_cfg(*job[3]))} splits={job[4]} crashed the "
                    f"compiler (rc {rc}): left out of the sweep")
        elif ":" in said or rc != 0:
            run.log(f"precompile {job[0]}: rc {rc}: {said}")
    run.results["meta"]["precompile"] = dict(
        seconds=time.time() - t0, launches=len(jobs), workers=workers,
        crashed=sorted(_cfg_name(c) for c in _CRASHED))
    run.log(f"precompiled {len(jobs)} launches in {time.time() - t0:.1f} s with {workers} "
            f"processes; crashed: {sorted(_cfg_name(c) for c in _CRASHED) or 'none'}")


def sweep_prod(run: Run, deadline: float, flashinfer: bool) -> None:
    """At every production shape: every candidate (the table's config first, then
    ``PROD_CANDIDATES``) checked against float32 torch, then timed; the best one at other
    split counts (:func:`_split_variants`), cross-layer against contiguous at the first
    shape, and FlashInfer direct (captured too). New points stop at ``deadline``; the table's
    config and FlashInfer are always timed."""
    for index, (batch, heads, tokens) in enumerate(PROD_SHAPES):
        case = ProdCase(batch, heads, tokens, cross_layer=index == 0)
        reference = case.reference()
        default, *others = _candidates(heads)
        fn, out, splits = case.call()
        fn()
        err = rel_err(out, reference)
        run.check(f"sweep.{case.shape()}.{_cfg_name(default)}.s{splits}.vs_float32",
                  err < 1e-2, rel_err=err)
        t_default, how = time_call(fn)
        expected = out.clone()
        _prod_row(run, case, "triton", _cfg_name(default), t_default, splits=splits,
                  table=True, method=how, rel_err=err)
        best = (t_default, default, splits)
        for cfg in others:
            if time.time() > deadline:
                run.log(f"PROD {case.shape()}: budget spent, candidates skipped")
                break
            best = _prod_point(run, case, cfg, None, reference, best)
            if heads < 64:  # memory-bound: smaller tiles may fit two programs an SM
                builder_splits = configs().mla_decode_num_splits(batch, heads, tokens, cfg,
                                                             _num_sms())
                best = _prod_point(run, case, cfg, 2 * builder_splits, reference, best)
        t, cfg, s = best
        for forced in _split_variants(heads, s):
            if time.time() > deadline:
                break
            best = _prod_point(run, case, cfg, forced, reference, best)
        if index == 0:
            t, cfg, s = best
            fn_xl, out_xl, _ = case.call(cfg, cross_layer=True, splits=s)
            fn_std, out_std, _ = case.call(cfg, splits=s)
            fn_xl()
            fn_std()
            run.check(f"sweep.{case.shape()}.{_cfg_name(cfg)}.s{s}.cross_layer.bit_exact",
                      torch.equal(out_xl, out_std))
            # Three interleaved rounds, the median of each layout's: one pair of samples can
            # move the ratio by a few percent.
            stds, xls = [], []
            for _ in range(3):
                stds.append(time_call(fn_std)[0])
                t_xl, how = time_call(fn_xl)
                xls.append(t_xl)
            t_std, t_xl = sorted(stds)[1], sorted(xls)[1]
            _prod_row(run, case, "triton cross-layer", _cfg_name(cfg), t_xl, splits=s,
                      xl_over_std=t_xl / t_std, method=how,
                      rounds=dict(standard_us=[t * 1e6 for t in stds],
                                  cross_layer_us=[t * 1e6 for t in xls]))
        t, cfg, s = best
        if s > 1:
            _time_merge(run, case, s)
        winner = dict(shape=case.shape(), heads=heads, config=_cfg_name(cfg), splits=s,
                      time_us=t * 1e6, default_time_us=t_default * 1e6,
                      speedup_vs_table=t_default / t,
                      launch={"kernel": cfg.kernel, "class_name": type(cfg).__name__,
                              **dataclasses.asdict(cfg),
                              "programs_per_sm": _programs_per_sm(case, cfg, s)})
        fi = None
        if flashinfer:
            try:
                fi_fn = case.flashinfer()
                if fi_fn is not None:
                    err = rel_err(fi_fn(), expected)
                    t_fi, how = time_call(fi_fn)
                    fi = _prod_row(run, case, "flashinfer", "BatchMLAPagedAttentionWrapper",
                                   t_fi, rel_err_vs_triton=err, method=how)
                    winner["flashinfer_us"] = t_fi * 1e6
                    winner["time_over_flashinfer"] = t / t_fi
            except Exception as exc:
                run.log(f"flashinfer MLA at {case.shape()} failed: {type(exc).__name__}: {exc}")
                run.results["errors"].append({"section": f"flashinfer {case.shape()}",
                                              "error": repr(exc)})
        run.results["sweep_best"].append(winner)
        run.log("PROD BEST", winner, "" if fi else "(no FlashInfer)")
        del case


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 1


def _programs_per_sm(case: ProdCase, cfg, splits: int) -> int | None:
    """The smallest ``programs_per_sm`` (1-4) of a Triton decode config for which the split
    chooser picks ``splits`` at this shape (``None``: none does, or the Gluon kernel's fixed
    tile; the table row then keeps 1)."""
    if isinstance(cfg, configs().GluonMLAWSConfig):
        return None
    for p in range(1, 5):
        trial = dataclasses.replace(cfg, programs_per_sm=p)
        if configs().mla_decode_num_splits(case.batch, case.heads, case.tokens, trial,
                                       _num_sms()) == splits:
            return p
    return None


def _time_merge(run: Run, case: ProdCase, splits: int) -> None:
    """The split reduction alone (its share of the best time) on partials of this shape's
    size: as TRITON_MLA's decode carves them (``decode_partials``: 16-bit outputs) and as
    float32 rows of an ``attn_logits`` workspace."""
    b, h = case.batch, case.heads
    out = torch.empty(b, h, RANK, dtype=DTYPE, device=DEVICE)
    flat = torch.empty(tma().mla_workspace_numel(b, h, RANK, splits), device=DEVICE)
    carved = tma().decode_partials(flat, b, h, RANK, splits, DTYPE)
    carved[0].copy_(randn(b, h, splits, RANK))
    carved[1].copy_(randn(b, h, splits, dtype=torch.float32))
    logits = randn(b, h, splits, RANK + 1, dtype=torch.float32)
    rows = logits[..., :RANK], logits[..., RANK]
    for what, (part, part_lse) in ((f"{str(DTYPE)[6:]} partials", carved),
                                   ("float32 rows", rows)):
        t, how = time_call(lambda part=part, part_lse=part_lse: kvcore.ops.merge_kv_splits(
            part, part_lse, out))
        _prod_row(run, case, "merge only", f"{splits} splits, {what}", t, rates=False,
                  splits=splits, method=how)


def _prod_point(run: Run, case: ProdCase, cfg, forced: int | None, reference: torch.Tensor,
                best: tuple):
    """Check one candidate against the float32 reference, then time it; returns the better
    of it and ``best`` (a wrong or failing candidate never wins)."""
    try:
        fn, out, splits = case.call(cfg, splits=forced)
        fn()
        err = rel_err(out, reference)
        ok = err < 1e-2
        run.check(f"sweep.{case.shape()}.{_cfg_name(cfg)}.s{splits}.vs_float32", ok,
                  rel_err=err)
        if not ok:
            run.log(f"PROD {case.shape()} {_cfg_name(cfg)} splits={splits}: WRONG "
                    f"(rel_err {err:.3g} vs float32 torch)")
            return best
        t, how = time_call(fn)
    except Exception as exc:  # e.g. out of shared memory for this tile
        msg = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ""
        run.log(f"PROD {case.shape()} {_cfg_name(cfg)} failed: {type(exc).__name__}: {msg}")
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return best
    _prod_row(run, case, "triton", _cfg_name(cfg), t, splits=splits, method=how, rel_err=err)
    return (t, cfg, splits) if t < best[0] else best


def prod_table(run: Run) -> list[str]:
    """The production sweep as a table, then the winners as rows of MLA_DECODE_CONFIGS."""
    cell = harness.format_value
    rows = []
    for r in run.results["sweeps"]:
        rows.append([r["shape"], r["kind"] + (" (table)" if r.get("table") else ""),
                     r["config"], str(r.get("splits", "")), cell(r, "time_us", ".1f"),
                     cell(r, "read_frac", ".1f", 100), cell(r, "TFLOPs", ".0f"),
                     cell(r, "xl_over_std", ".3f")])
    headers = ["shape", "kernel", "config", "splits", "time us", "% read", "TFLOP/s", "xl/std"]
    lines = [harness.format_table(rows, headers)]
    for w in run.results["sweep_best"]:
        fi = (f", {w['time_over_flashinfer']:.2f}x FlashInfer's time"
              if "time_over_flashinfer" in w else "")
        lines.append(f"best {w['shape']}: {w['config']} splits={w['splits']} "
                     f"{w['time_us']:.1f} us (table {w['default_time_us']:.1f} us){fi}")
    family = configs().gpu_family(DEVICE) if DEVICE == "cuda" else "default"
    for w in run.results["sweep_best"]:
        c = dict(w["launch"])
        name, per_sm = c.pop("class_name"), c.pop("programs_per_sm")
        c.pop("kernel")
        fields = [f"{k}={v}" for k, v in c.items()]
        if (per_sm or 1) > 1:
            fields.append(f"programs_per_sm={per_sm}")
        lines.append(f"suggested {family!r} row for {w['heads']} heads ({w['shape']}): "
                     f"({w['heads']}, {name}({', '.join(fields)}))"
                     + ("" if per_sm or name == "GluonMLAWSConfig" else
                        f" (its {w['splits']} splits: no programs_per_sm reproduces them)"))
    return lines


# ----------------------------------------------------------------------------- report


def print_table(run: Run) -> None:
    headers = ["op", "shape", "layout", "splits", "time us", "GB/s", "% ceiling", "x torch",
               "xl/std"]
    cell = harness.format_value
    rows = []
    for r in run.results["timings"]:
        rows.append([r["op"], r["shape"], r["layout"], str(r.get("splits", "")),
                     cell(r, "time_us", ".1f"), cell(r, "GBps", ".0f"),
                     cell(r, "ceiling_frac", ".1f", 100), cell(r, "vs_torch", ".2f"),
                     cell(r, "xl_over_std", ".3f")])
    c = run.results["ceilings"]
    checks = run.results["correctness"]
    lines = [f"device: {run.results['meta'].get('device')}; ceilings: copy "
             f"{c.get('copy_GBps', float('nan')):.0f} GB/s, read "
             f"{c.get('read_GBps', float('nan')):.0f} GB/s; correctness: "
             f"{sum(x['ok'] for x in checks)}/{len(checks)} passed; errors: "
             f"{len(run.results['errors'])}"]
    lines.append(harness.format_table(rows, headers))
    lines.extend(prod_table(run))
    lines.extend(f"FAILED check: {c}" for c in checks if not c["ok"])
    run.write_summary(lines)


def main() -> None:
    parser = harness.script_parser(__doc__, _ROOT / "benchmarks" / "results")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop starting new sweep points after this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--no-flashinfer", dest="flashinfer", action="store_false",
                        help="skip FlashInfer's MLA decode (its first call may JIT-compile)")
    parser.add_argument("--json", action="store_true",
                        help="also print the results as one JSON line (before the table)")
    parser.add_argument("--sweep-only", action="store_true",
                        help="only the ceilings, the decode checks and the production sweep "
                             "(no cache-write checks and timings)")
    parser.add_argument("--table-only", action="store_true",
                        help="the production sweep times only the table's config (its split "
                             "variants, the merge, cross-layer and FlashInfer too)")
    parser.add_argument("--heads", type=int, action="append",
                        help="only the production shapes of this head count (repeatable)")
    parser.add_argument("--compile-job", help=argparse.SUPPRESS)  # precompile's child
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="processes that compile the sweep's candidates in parallel "
                             "before it starts (0: the sweep compiles as it goes; default: "
                             "cores - 2, at most 14, with --sweep-only, else 0)")
    args = parser.parse_args()
    if args.compile_job:
        print(_compile_job(tuple(json.loads(args.compile_job))), flush=True)
        return
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no GPU: run with --smoke to check the script on the CPU")
    if args.heads:
        global PROD_SHAPES
        PROD_SHAPES = [shape for shape in PROD_SHAPES if shape[1] in args.heads]
    run = Run(args.out, "bench_mla", ("correctness", "timings", "sweeps", "sweep_best"),
              checks="correctness",
              device=DEVICE, budget_s=args.budget_s)
    import triton

    run.results["meta"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor()
        or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "smoke": SMOKE,
        "dims": {"kv_lora_rank": RANK, "rope": ROPE, "block_size": BLOCK, "dtype": str(DTYPE)},
    }
    run.log("meta", run.results["meta"])
    torch.manual_seed(0)
    # The value checks synchronise with the device; timings and graph capture need them off.
    kvcore.ops.set_value_checks(False)
    sections = [("ceilings", measure_ceilings), ("check concat_and_cache_mla", check_concat),
                ("check indexer", check_indexer), ("check decode", check_decode),
                ("check TRITON_MLA forward", check_backend), ("check int64 pool", check_int64),
                ("check production decode", check_prod),
                ("time decode", time_decode), ("time writes", time_writes)]
    if args.sweep_only:
        sweep_sections = ("ceilings", "check decode", "check production decode")
        sections = [(name, fn) for name, fn in sections if name in sweep_sections]
    with run.section("precompile"):
        workers = args.compile_workers
        if workers is None:
            workers = max(0, min(14, (os.cpu_count() or 1) - 2)) if args.sweep_only else 0
        precompile(run, 0 if SMOKE else workers, args.flashinfer)
    for name, fn in sections:
        with run.section(name):
            fn(run)
    with run.section("production sweep"):
        sweep_prod(run, run.start + args.budget_s, args.flashinfer)
    run.save()
    if args.json:
        print(json.dumps(run.results, default=str), flush=True)
    print_table(run)


if __name__ == "__main__":
    main()
