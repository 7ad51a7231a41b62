#!/usr/bin/env python3
"""CPU offload of KV blocks against the pinned-copy limit measured in the same run (H200).

Sections, each isolated (an error is logged and recorded, the run goes on):

1. ``pinned``: one 1 GiB copy host->device, device->host, and both at once on two streams
   (duplex), between pinned host memory and the GPU: the physical limit of the bus.
2. ``offload``: the ``offload`` connector moving 1 GiB (32 layers x 512 blocks x 64 KiB pages,
   bf16, block 16 x 8 heads x 128) out and back, cross-layer and per-layer caches, with
   contiguous and with scattered block ids: save alone, load alone, save and load at once;
   GB/s and the fraction of section 1 (single directions against their copy, both at once
   against duplex). Loaded blocks are checked bit-exact against the saved ones, and the path
   the connector took is recorded (``direct`` run copies or ``staged`` gather/scatter through
   device staging, with host<->device copies per transfer): scattered and per-layer transfers
   must go through staging with about one copy per chunk, not one per block and layer.
3. ``chunk_sweep``: per-layer scattered blocks with other staging chunk sizes (16, 256 MiB).
   ``copier``: scattered blocks (per-layer and cross-layer) through a plugin's block copier
   (``--block-copier``, default kvcore-nvidia's ``cuda_batch``) instead of device staging,
   when it is installed and usable; the decode section then adds a row for it too.
   ``startup``: how long ``register_kv_caches`` blocks (the time until the first slot is
   usable) for 1, 8 and 32 GiB pools (``--startup-gib``), pinned in the background
   (``pin_in_background=True``) and at once (the default), when the whole pool is pinned,
   and how long a tiny device op on the engine's thread took at worst meanwhile; then the
   first save and first two loads of one cross-layer transfer after registration, against
   the pinned copy (what the registration warm-up leaves), and the same sequence of plain
   copies on a fresh pinned buffer plus one after the GPU idled 2 s (is the first transfers'
   cost kvcore's, the memory's or the idle GPU's?).
4. ``decode``: a decode-like loop (torch SDPA, one query token per sequence over a large
   contiguous KV) timed alone and while a save and a load of 1 GiB each run on the side
   streams: the slowdown. Also timed under plain pinned copies of the same size on two
   streams (the physical floor: what the bus traffic alone costs the loop) and under a
   staged (per-layer, scattered) offload, whose gather/scatter kernels share the GPU.

Timing: CUDA events around the copies (device time, median of trials); connector figures give
both the device time of the copies (the handle's events) and the wall time of the call
including kvcore's Python work. "Save and load at once" is timed on the device with the engine's
stream held busy while both are issued (as in serving, where the engine is always busy), so
both start together like the two copies of the duplex ceiling; its wall figure also counts
the Python time of issuing the save before the load. Targets (issue 4): cross-layer >= 95%
and per-layer >= 85% of the pinned copy each way, save+load >= 85% of duplex, decode slowed
<= 3%.

Usage: ``python benchmarks/bench_offload.py [--out DIR] [--trials N] [--chunk-mib M]
[--smoke]``. JSON goes to
``--out`` (default ``$OUT``, else the temp dir) as ``bench_offload.json``; the table is
printed last. ``--smoke`` runs tiny sizes on the CPU to check the script itself (with
chunks of a few blocks, so the staged path crosses chunk boundaries there too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore
from kvcore.cli.harness import Clock, format_table, median_of
from kvcore.connectors import block_copier_names, get_block_copier, get_connector

log = logging.getLogger("bench_offload")
GB = 1e9


@dataclass(frozen=True)
class Sizes:
    num_layers: int
    num_blocks: int  # blocks per transfer; the cache holds twice as many
    block_size: int
    num_kv_heads: int
    head_size: int
    decode: tuple[int, int, int, int]  # SDPA batch, heads, KV length, head dim

    @property
    def page_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * 2  # K+V, bf16

    @property
    def transfer_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.page_bytes


FULL = Sizes(32, 512, 16, 8, 128, decode=(16, 32, 8192, 128))  # 1 GiB, 64 KiB pages
SMOKE = Sizes(4, 32, 4, 2, 128, decode=(2, 4, 256, 64))  # 128 KiB, 4 KiB pages
#: Staging chunk of the connector (its default) and the sweep's others, in MiB; on smoke sizes
#: chunks are counted in blocks instead (5 blocks: transfers of 32 cross chunk boundaries).
CHUNK_MIB, SWEEP_MIB, SMOKE_CHUNK_BLOCKS = 64, (16, 256), 5
TARGETS = {"cross_layer": 0.95, "per_layer": 0.85, "duplex": 0.85, "decode_slowdown": 0.03}
#: How long the engine's stream is held busy while "both" issues its save and load, so the two
#: start together on the device (issuing both takes a few ms, tens through a block copier).
HOLD_S = 0.25


# -- 1. pinned copies -------------------------------------------------------------------------


def bench_pinned(sizes: Sizes, device: torch.device, trials: int) -> dict[str, float]:
    clock = Clock(device)
    n = sizes.transfer_bytes
    pin = device.type == "cuda"
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    dev = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2)]
    for h, d in zip(host, dev, strict=True):
        d.random_(0, 256)
        h.copy_(d)  # random host bytes without a slow CPU generator
    h2d = median_of(trials, lambda: clock.time(lambda: dev[0].copy_(host[0], non_blocking=pin)))
    d2h = median_of(trials, lambda: clock.time(lambda: host[1].copy_(dev[1], non_blocking=pin)))

    def duplex() -> float:
        if not clock.cuda:  # no copy engines to overlap: sequential
            return clock.time(lambda: (dev[0].copy_(host[0]), host[1].copy_(dev[1])))
        clock.sync()
        streams = [torch.cuda.Stream(device) for _ in range(2)]
        begin = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        begin.record()
        for s in streams:
            s.wait_event(begin)
        with torch.cuda.stream(streams[0]):
            dev[0].copy_(host[0], non_blocking=True)
            ends[0].record(streams[0])
        with torch.cuda.stream(streams[1]):
            host[1].copy_(dev[1], non_blocking=True)
            ends[1].record(streams[1])
        for e in ends:
            e.synchronize()
        return max(begin.elapsed_time(e) for e in ends) / 1e3

    both = median_of(trials, duplex)
    return {"h2d_gbps": n / h2d / GB, "d2h_gbps": n / d2h / GB,
            "duplex_gbps": 2 * n / both / GB, "bytes": n}


# -- 2. offload through the connector ---------------------------------------------------------


def block_rows(kv: kvcore.KVCaches, ids: list[int]) -> torch.Tensor:
    """The bytes of blocks ``ids`` of every layer, ``(len(ids), block_bytes)``."""
    idx = torch.tensor(ids, device=kv.storage.device)
    views = [kv.block_view()] if kv.is_cross_layer else kv.layer_block_views()
    return torch.cat([v.index_select(0, idx) for v in views], dim=1)


def new_keys(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


def make_offload(sizes: Sizes, device: torch.device, cross_layer: bool, chunk_bytes: int,
                 block_copier: str | None = None):
    kv = kvcore.allocate_kv_caches(
        "CPU_ATTN", num_layers=sizes.num_layers, num_blocks=2 * sizes.num_blocks,
        block_size=sizes.block_size, num_kv_heads=sizes.num_kv_heads,
        head_size=sizes.head_size, dtype=torch.bfloat16, device=device,
        cross_layer=cross_layer)
    kv.storage.view(torch.uint8).random_(0, 256)
    # Room for one transfer being saved while another is loaded.
    conn = get_connector("offload", capacity_bytes=2 * sizes.transfer_bytes,
                         chunk_bytes=chunk_bytes, block_copier=block_copier)
    conn.register_kv_caches(kv)
    conn.wait_pinned()
    return kv, conn


def expected_path(cross_layer: bool, ids: str, block_copier: str | None = None) -> str:
    """The path the connector should take: run copies only for contiguous cross-layer
    blocks; per-layer caches and scattered blocks gather through device staging, or go to
    the block copier when one is set."""
    if cross_layer and ids == "contiguous":
        return "direct"
    return "staged" if block_copier is None else "copier"


def bench_offload_mode(sizes: Sizes, device: torch.device, cross_layer: bool, trials: int,
                       pinned: dict[str, float], chunk_bytes: int,
                       id_kinds: tuple[str, ...] = ("contiguous", "scattered"),
                       block_copier: str | None = None) -> dict[str, dict[str, float]]:
    n = sizes.num_blocks
    kv, conn = make_offload(sizes, device, cross_layer, chunk_bytes, block_copier)
    clock = Clock(device)
    results: dict[str, dict[str, float]] = {"config": {
        "chunk_bytes": chunk_bytes, "chunk_blocks": conn.chunk_blocks,
        "block_bytes": conn.block_bytes, "num_slots": conn.num_slots}}
    try:
        for ids in id_kinds:
            if ids == "contiguous":
                src, dst = list(range(n)), list(range(n, 2 * n))
            else:
                perm = torch.randperm(2 * n).tolist()
                src, dst = perm[:n], perm[n:]
            resident = new_keys(n)  # what loads read; saves write fresh keys each trial
            assert conn.save(resident, src).wait().ok

            def timed(call: Callable[[], list], hold: bool = False) -> tuple[float, float]:
                """(wall seconds, device seconds of the longest transfer); with ``hold`` the
                engine's stream is busy while the transfers are issued, so they start
                together on the device and the device span is the longest transfer."""
                clock.sync()
                if hold:
                    clock.hold(HOLD_S)
                start = time.perf_counter()
                handles = call()
                issued = time.perf_counter() - start
                results_ = [h.wait() for h in handles]
                wall = time.perf_counter() - start
                assert all(r.ok for r in results_), [dict(r.failed) for r in results_]
                if hold and clock.cuda and issued > HOLD_S:
                    raise RuntimeError(f"issuing took {issued:.3f} s, longer than the engine "
                                       f"was held ({HOLD_S} s): the device span is not one")
                return wall, max(r.seconds for r in results_)

            calls: dict[str, Callable[[list[str]], list]] = {  # fresh keys -> handles
                "save": lambda keys, s=src: [conn.save(keys, s)],
                "load": lambda _keys, r=resident, d=dst: [conn.load(r, d)],
                "both": lambda keys, s=src, r=resident, d=dst: [conn.save(keys, s),
                                                                conn.load(r, d)],
            }
            rows: dict[str, list[tuple[float, float]]] = {op: [] for op in calls}
            held: list[tuple[float, float]] = []  # "both" issued behind a busy engine
            paths_before = dict(conn.paths)
            for _ in range(trials + 1):  # first is warm-up
                for op, call in calls.items():
                    fresh = new_keys(n)
                    rows[op].append(timed(lambda c=call, k=fresh: c(k)))
                fresh = new_keys(n)
                held.append(timed(lambda b=calls["both"], k=fresh: b(k), hold=True))
            # Which path the transfers took, and host<->device copies per transfer.
            transfers = 6 * (trials + 1)  # save, load, and one of each in both "both"s
            took = {k: conn.paths[k] - paths_before[k] for k in conn.paths}
            path = next((p for p in ("staged", "direct", "copier") if took[p] == transfers),
                        "mixed")
            path_info = {"path": path,
                         "expected_path": expected_path(cross_layer, ids, block_copier),
                         "copies_per_transfer": took["copies"] / transfers,
                         "chunks_per_transfer": took["chunks"] / transfers}
            # Bit-exact: the loads wrote into dst what the saves read from src.
            check = torch.equal(block_rows(kv, dst), block_rows(kv, src))
            byte = sizes.transfer_bytes
            for op, reference in (("save", "d2h_gbps"), ("load", "h2d_gbps"),
                                  ("both", "duplex_gbps")):
                walls = [w for w, _ in rows[op][1:]]
                # "both": device time from the trials issued behind a held engine, where the
                # save and the load start together and the span is the longer of the two.
                devices = [d for _, d in (held if op == "both" else rows[op])[1:]]
                moved = byte * (2 if op == "both" else 1)
                wall_gbps = moved / statistics.median(walls) / GB
                dev_gbps = moved / statistics.median(devices) / GB if clock.cuda else None
                key = f"{ids}/{op}"
                results[key] = {
                    "wall_gbps": wall_gbps,
                    "device_gbps": dev_gbps,
                    "reference_gbps": pinned.get(reference),
                    "fraction_wall": wall_gbps / pinned[reference] if reference in pinned
                    else None,
                    "fraction_device": dev_gbps / pinned[reference]
                    if dev_gbps and reference in pinned else None,
                    "bit_exact": check,
                    **path_info,
                }
                log.info("offload %s %s: wall %.1f GB/s, device %s GB/s (%s, %.1f copies "
                         "per transfer)", "cross-layer" if cross_layer else "per-layer", key,
                         wall_gbps, f"{dev_gbps:.1f}" if dev_gbps else "-", path,
                         path_info["copies_per_transfer"])
        results["stats"] = conn.stats.to_dict()
        results["config"]["paths"] = dict(conn.paths)
    finally:
        conn.close()
        del kv
        if clock.cuda:
            torch.cuda.empty_cache()
    return results


# -- 2b. start-up: registering a pool, and the first transfers after it ----------------------

#: Pool sizes whose registration is timed (GiB); smoke runs use a few MiB.
STARTUP_GIB = (1, 8, 32)


def bench_first_copies(sizes: Sizes, device: torch.device) -> dict[str, float]:
    """Plain copies between a freshly allocated pinned buffer and the device, in the order
    the connector's first transfers run (save, load, load again, save again), then again
    after the GPU idled 2 s: whether the first transfers' cost is the memory's first use or
    the idle GPU's, independently of kvcore. GB/s per copy."""
    n = sizes.transfer_bytes
    pin = device.type == "cuda"
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev.random_(0, 256)
    clock = Clock(device)
    out = {}
    for name, fn in (("d2h_first", lambda: host.copy_(dev, non_blocking=pin)),
                     ("h2d_first", lambda: dev.copy_(host, non_blocking=pin)),
                     ("h2d_second", lambda: dev.copy_(host, non_blocking=pin)),
                     ("d2h_second", lambda: host.copy_(dev, non_blocking=pin))):
        out[name] = n / clock.time(fn) / GB
    time.sleep(0.2 if device.type != "cuda" else 2.0)
    out["h2d_after_idle"] = n / clock.time(lambda: dev.copy_(host, non_blocking=pin)) / GB
    log.info("startup: plain copies on a fresh pinned buffer (GB/s): %s",
             ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
    return out


def _launch_stalls(device: torch.device, until: Callable[[], bool]) -> float:
    """While ``until()`` is False: the longest time one tiny device op took from launch to
    completion on this (the engine's) thread; what background pinning costs the engine."""
    if device.type != "cuda":
        return 0.0
    x = torch.zeros(1, device=device)
    worst = 0.0
    deadline = time.monotonic() + 120
    while not until() and time.monotonic() < deadline:
        start = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.001)
    return worst


def bench_startup(sizes: Sizes, device: torch.device, pinned: dict[str, float],
                  pool_bytes: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Per pool size, pinned in the background (``pin_in_background=True``) and at once (the
    default): how long ``register_kv_caches`` blocks (the time until
    the first slot is usable), how many slots are usable when it returns, how long until the
    whole pool is pinned, and (background) the longest a tiny device op on the engine's
    thread took meanwhile. Then, on a fresh connector, the first save and the first two
    loads of one cross-layer transfer (contiguous blocks, the direct path) after
    registration, against the pinned copy, and the same sequence of plain copies on a fresh
    pinned buffer (:func:`bench_first_copies`)."""
    results: dict[str, dict[str, float]] = {}
    kv = kvcore.allocate_kv_caches(
        "CPU_ATTN", num_layers=sizes.num_layers, num_blocks=2 * sizes.num_blocks,
        block_size=sizes.block_size, num_kv_heads=sizes.num_kv_heads,
        head_size=sizes.head_size, dtype=torch.bfloat16, device=device, cross_layer=True)
    kv.storage.view(torch.uint8).random_(0, 256)
    try:
        for nbytes in pool_bytes:
            label = (f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30
                     else f"{nbytes / 2**20:g} MiB")
            # At once too, up to 8 GiB (the 32 GiB figure at once is known: 17 s).
            for background in (True, False) if nbytes <= 8 << 30 else (True,):
                conn = get_connector("offload", capacity_bytes=nbytes,
                                     pin_in_background=background)
                start = time.perf_counter()
                conn.register_kv_caches(kv)
                registered = time.perf_counter() - start
                ready_at_return = conn.ready_slots
                stall = _launch_stalls(device, lambda c=conn: c.wait_pinned(0))
                conn.wait_pinned()
                mode = "background" if background else "at once"
                results[f"pool {label} {mode}"] = {
                    "pool_bytes": nbytes, "background": background, "register_s": registered,
                    "pinned_s": conn.pinned_seconds, "slots_ready_at_return": ready_at_return,
                    "num_slots": conn.num_slots, "worst_launch_s": stall}
                log.info("startup: %s pool (%s): register %.3f s (%d of %d slots ready), all "
                         "pinned after %.3f s, worst tiny-op latency meanwhile %.1f ms", label,
                         mode, registered, ready_at_return, conn.num_slots,
                         conn.pinned_seconds, stall * 1e3)
                conn.close()
        n = sizes.num_blocks
        conn = get_connector("offload", capacity_bytes=2 * sizes.transfer_bytes)
        conn.register_kv_caches(kv)
        conn.wait_pinned()  # the first transfers' own cost, not the pinning's
        keys = new_keys(n)
        firsts = {}
        for name, call, reference in (
                ("first_save", lambda: conn.save(keys, list(range(n))), "d2h_gbps"),
                ("first_load", lambda: conn.load(keys, list(range(n, 2 * n))), "h2d_gbps"),
                ("second_load", lambda: conn.load(keys, list(range(n, 2 * n))), "h2d_gbps")):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = call().wait()
            wall = time.perf_counter() - start
            assert result.ok, dict(result.failed)
            gbps = result.num_bytes / result.seconds / GB if result.seconds > 0 else None
            firsts[name] = {
                "wall_s": wall, "device_gbps": gbps,
                "fraction_device": gbps / pinned[reference] if gbps and reference in pinned
                else None}
            log.info("startup: %s %.1f GB/s device (%s of the pinned copy), %.4f s wall",
                     name, gbps or float("nan"),
                     f"{firsts[name]['fraction_device']:.0%}"
                     if firsts[name]["fraction_device"] else "-", wall)
        firsts["bit_exact"] = torch.equal(block_rows(kv, list(range(n, 2 * n))),
                                          block_rows(kv, list(range(n))))
        results["first_transfers"] = firsts
        conn.close()
        results["first_plain_copies"] = bench_first_copies(sizes, device)
    finally:
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# -- 3. decode loop under concurrent offload --------------------------------------------------


def bench_decode(sizes: Sizes, device: torch.device, trials: int,
                 pinned: dict[str, float], chunk_bytes: int, block_copier: str | None = None
                 ) -> dict[str, dict[str, float]]:
    """The decode loop alone and under three kinds of concurrent traffic (see the module
    docstring); ``offload`` (cross-layer, contiguous) is the row with the target."""
    b, h, s, d = sizes.decode
    q = torch.randn(b, h, 1, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)
    clock = Clock(device)

    def loop(iters: int) -> None:
        for _ in range(iters):
            F.scaled_dot_product_attention(q, k, v)

    per_iter = median_of(3, lambda: clock.time(lambda: loop(10))) / 10
    # The loop should sit inside the transfers: about 80% of a save+load at duplex speed.
    transfer_s = 2 * sizes.transfer_bytes / (pinned.get("duplex_gbps") or 1.0) / GB
    iters = max(5, min(400, int(0.8 * transfer_s / per_iter)))
    kv_bytes = 2 * b * h * s * d * 2
    n = sizes.num_blocks

    def under(start: Callable[[], tuple[Callable[[], int], Callable[[], None]]]
              ) -> dict[str, float]:
        """Time the loop alone, then right after ``start()`` issues its traffic; ``start``
        returns (how many of its transfers still run, wait for them all)."""
        alone, busy, outlasted = [], [], 0
        for trial in range(trials + 1):
            t_alone = clock.time(lambda: loop(iters))
            clock.sync()
            running, finish = start()
            t_busy = clock.time(lambda: loop(iters), idle=False)  # transfers running
            still = running()
            finish()
            if trial:  # first is warm-up
                alone.append(t_alone)
                busy.append(t_busy)
                outlasted += still == 2
        slowdown = statistics.median(busy) / statistics.median(alone) - 1
        return {
            "iterations": iters,
            "alone_ms": 1e3 * statistics.median(alone),
            "with_offload_ms": 1e3 * statistics.median(busy),
            "slowdown": slowdown,
            "kv_read_gbps_alone": kv_bytes * iters / statistics.median(alone) / GB,
            "trials_fully_overlapped": outlasted,
            "trials": trials,
        }

    results: dict[str, dict[str, float]] = {}

    # Plain pinned copies of the same bytes, one per direction on two streams: the floor.
    pin = clock.cuda
    host = [torch.empty(sizes.transfer_bytes, dtype=torch.uint8, pin_memory=pin)
            for _ in range(2)]
    dev = [torch.empty(sizes.transfer_bytes, dtype=torch.uint8, device=device)
           for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)] if clock.cuda else []

    def raw_copies() -> tuple[Callable[[], int], Callable[[], None]]:
        if not clock.cuda:
            dev[0].copy_(host[0])
            host[1].copy_(dev[1])
            return lambda: 0, lambda: None
        ends = []
        for stream, copy in zip(streams, (lambda: dev[0].copy_(host[0], non_blocking=True),
                                          lambda: host[1].copy_(dev[1], non_blocking=True)),
                                strict=True):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                copy()
                ends.append(torch.cuda.Event())
                ends[-1].record(stream)
        return (lambda: sum(not e.query() for e in ends),
                lambda: [e.synchronize() for e in ends] and None)

    results["pinned_copy"] = under(raw_copies)
    host.clear()  # free the 2 x 2 transfers before the connectors allocate theirs
    dev.clear()

    cases = [("offload", True, "contiguous", None), ("offload_staged", False, "scattered", None)]
    if block_copier is not None:
        cases.append(("offload_copier", False, "scattered", block_copier))
    for name, cross, ids, copier in cases:
        kv, conn = make_offload(sizes, device, cross, chunk_bytes, copier)
        try:
            resident = new_keys(n)
            if ids == "contiguous":
                src, dst = list(range(n)), list(range(n, 2 * n))
            else:
                perm = torch.randperm(2 * n).tolist()
                src, dst = perm[:n], perm[n:]
            assert conn.save(resident, src).wait().ok
            expected = block_rows(kv, src)

            def offload(c=conn, r=resident, s_=src, d_=dst
                        ) -> tuple[Callable[[], int], Callable[[], None]]:
                handles = [c.save(new_keys(n), s_), c.load(r, d_)]

                def finish() -> None:
                    for handle in handles:
                        assert handle.wait().ok

                return lambda: sum(not hd.done() for hd in handles), finish

            before = dict(conn.paths)
            results[name] = under(offload)
            results[name]["bit_exact"] = torch.equal(block_rows(kv, dst), expected)
            results[name]["path"] = next(p for p in ("staged", "copier", "direct")
                                         if conn.paths[p] > before[p] or p == "direct")
            results[name]["layout"] = "cross-layer" if cross else "per-layer"
            results[name]["ids"] = ids
        finally:
            conn.close()
            del kv
            if clock.cuda:
                torch.cuda.empty_cache()
    for name, r in results.items():
        log.info("decode under %s: %d iterations, %.3f ms alone, %.3f ms busy (%+.2f%%)",
                 name, r["iterations"], r["alone_ms"], r["with_offload_ms"],
                 100 * r["slowdown"])
    return results


def bench_chunk_sweep(sizes: Sizes, device: torch.device, trials: int,
                      pinned: dict[str, float], chunks: dict[str, int]
                      ) -> dict[str, dict[str, dict[str, float]]]:
    """Per-layer scattered transfers with other staging chunk sizes."""
    return {label: bench_offload_mode(sizes, device, False, trials, pinned, chunk_bytes,
                                      id_kinds=("scattered",))
            for label, chunk_bytes in chunks.items()}


# -- driver -----------------------------------------------------------------------------------


def section(name: str, results: dict, errors: dict, fn: Callable[[], object]) -> None:
    log.info("== %s", name)
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # keep going: one broken section must not hide the others
        errors[name] = f"{type(exc).__name__}: {exc}"
        log.error("%s failed:\n%s", name, traceback.format_exc())
    log.info("== %s done in %.1f s", name, time.perf_counter() - start)


def verdict(passed: bool, smoke: bool, failed: str) -> str:
    if smoke:  # CPU copies of tiny sizes say nothing about the targets
        return "smoke"
    return "PASS" if passed else failed


def path_ok(r: dict) -> bool:
    """Scattered and per-layer transfers must all be staged; contiguous cross-layer ones are
    direct, or "mixed" when LRU eviction left some saves' slots fragmented."""
    if r["expected_path"] in ("staged", "copier"):
        return r["path"] == r["expected_path"]
    return r["path"] in ("direct", "mixed")


def offload_rows(section_name: str, label: str, mode: str, res: dict, smoke: bool) -> list:
    rows = []
    for key, r in sorted(res.items()):
        if key in ("stats", "config"):
            continue
        op = key.split("/")[1]
        target = TARGETS["duplex"] if op == "both" else TARGETS[mode]
        frac = r["fraction_device"] if r["fraction_device"] is not None else r["fraction_wall"]
        rows.append([
            label, key,
            f"{r['device_gbps']:.1f}" if r["device_gbps"] else "-",
            f"{r['wall_gbps']:.1f}",
            f"{100 * frac:.1f}% (>= {100 * target:.0f}%)" if frac is not None else "-",
            verdict(frac is not None and frac >= target, smoke, "below")
            + ("" if r["bit_exact"] else " NOT BIT-EXACT")
            + ("" if path_ok(r) else f" PATH {r['path']}"),
        ])
    return rows


def table(results: dict, errors: dict, smoke: bool) -> str:
    rows = []
    pinned = results.get("pinned", {})
    for key in ("h2d_gbps", "d2h_gbps", "duplex_gbps"):
        if key in pinned:
            rows.append(["pinned copy", key.removesuffix("_gbps"), f"{pinned[key]:.1f}", "", "",
                         ""])
    for mode in ("cross_layer", "per_layer"):
        rows += offload_rows(f"offload_{mode}", f"offload {mode.replace('_', '-')}", mode,
                             results.get(f"offload_{mode}", {}), smoke)
    for label, res in results.get("chunk_sweep", {}).items():
        rows += offload_rows("chunk_sweep", f"per-layer chunk {label}", "per_layer", res, smoke)
    for mode, res in results.get("copier", {}).items():
        rows += offload_rows("copier", f"{mode.replace('_', '-')} via copier", mode, res, smoke)
    dec = results.get("decode", {})
    for name, what in (("pinned_copy", "pinned copy (floor)"), ("offload", "offload"),
                       ("offload_staged", "offload staged"),
                       ("offload_copier", "offload via copier")):
        r = dec.get(name)
        if not r:
            continue
        if name == "pinned_copy":  # a reference, not a target: what the bus traffic costs
            check = "smoke" if smoke else "reference"
        else:
            check = verdict(r["slowdown"] <= TARGETS["decode_slowdown"], smoke, "above") + (
                "" if r["bit_exact"] else " NOT BIT-EXACT")
        rows.append([f"decode + {what}", f"{r['iterations']} x SDPA",
                     f"{r['alone_ms']:.2f} ms", f"{r['with_offload_ms']:.2f} ms",
                     f"{100 * r['slowdown']:+.2f}% (<= 3%)", check])
    for label, r in results.get("startup", {}).items():
        if label == "first_plain_copies":
            rows.append(["plain copies, fresh pinned", "first use / idle", ", ".join(
                f"{k} {v:.1f}" for k, v in r.items()), "", "", "reference"])
            continue
        if label == "first_transfers":
            for name, f in r.items():
                if name == "bit_exact":
                    continue
                rows.append([f"offload {name.replace('_', ' ')}", "after registration",
                             f"{f['device_gbps']:.1f}" if f["device_gbps"] else "-",
                             f"{f['wall_s'] * 1e3:.1f} ms",
                             f"{f['fraction_device']:.0%}" if f["fraction_device"] else "",
                             "" if r["bit_exact"] else "NOT BIT-EXACT"])
        else:
            rows.append([f"register {label}", "start-up",
                         f"{r['slots_ready_at_return']}/{r['num_slots']} slots at return",
                         f"{r['register_s']:.3f} s to first slot",
                         f"all pinned after {r['pinned_s']:.2f} s",
                         f"worst op {r['worst_launch_s'] * 1e3:.1f} ms"
                         if r["background"] else "reference"])
    for name, err in errors.items():
        rows.append([name, "ERROR", err[:60], "", "", ""])
    return format_table(rows, ["section", "what", "GB/s device", "GB/s wall",
                               "of limit (target)", "verdict"], tablefmt="simple")


def self_check(results: dict) -> list[str]:
    """What is wrong regardless of speed: bytes not bit-exact, a transfer on the wrong path."""
    problems = []
    sections = {f"offload_{m}": results.get(f"offload_{m}", {}) for m in ("cross_layer",
                                                                         "per_layer")}
    for label, res in results.get("chunk_sweep", {}).items():
        sections[f"chunk_sweep/{label}"] = res
    for mode, res in results.get("copier", {}).items():
        sections[f"copier/{mode}"] = res
    for name, res in sections.items():
        for key, r in res.items():
            if key in ("stats", "config"):
                continue
            if not r["bit_exact"]:
                problems.append(f"{name} {key}: loaded blocks differ from the saved ones")
            if not path_ok(r):
                problems.append(f"{name} {key}: took the {r['path']} path, expected "
                                f"{r['expected_path']}")
    if results.get("startup", {}).get("first_transfers", {}).get("bit_exact") is False:
        problems.append("startup first transfers: loaded blocks differ from the saved ones")
    for name, r in results.get("decode", {}).items():
        if r.get("bit_exact") is False:
            problems.append(f"decode {name}: loaded blocks differ from the saved ones")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir())
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_MIB,
                        help="staging chunk of the offload connector (MiB)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the chunk-size sweep")
    parser.add_argument("--block-copier", default="cuda_batch",
                        help="also measure scattered transfers through this block copier when "
                             "it is installed and usable (default: cuda_batch)")
    parser.add_argument("--startup-gib", type=int, nargs="*", default=list(STARTUP_GIB),
                        help="pool sizes (GiB) whose registration time is measured")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if not args.smoke and not torch.cuda.is_available():
        log.error("no CUDA device: run with --smoke to check the script on the CPU")
        return 2
    sizes, device = (SMOKE, torch.device("cpu")) if args.smoke else (FULL, torch.device("cuda"))
    trials = 2 if args.smoke else args.trials
    block = sizes.num_layers * sizes.page_bytes
    if args.smoke:  # chunks of a few blocks: the staged path crosses chunk boundaries
        chunk_bytes = SMOKE_CHUNK_BLOCKS * block
        sweep = {f"{c} blocks": c * block for c in (3, 64)}
    else:
        chunk_bytes = args.chunk_mib << 20
        sweep = {f"{m} MiB": m << 20 for m in SWEEP_MIB if m != args.chunk_mib}
    log.info("sizes %s (%.3f GiB per transfer), %d trials, staging chunk %d bytes, device %s",
             sizes, sizes.transfer_bytes / 2**30, trials, chunk_bytes,
             torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    results: dict = {}
    errors: dict = {}
    section("pinned", results, errors, lambda: bench_pinned(sizes, device, trials))
    pinned = results.get("pinned", {})
    for mode, cross in (("cross_layer", True), ("per_layer", False)):
        section(f"offload_{mode}", results, errors,
                lambda c=cross: bench_offload_mode(sizes, device, c, trials, pinned,
                                                   chunk_bytes))
    startup_pools = ((2 << 20, 8 << 20) if args.smoke
                     else tuple(g << 30 for g in args.startup_gib))
    section("startup", results, errors,
            lambda: bench_startup(sizes, device, pinned, startup_pools))
    if not args.no_sweep:
        section("chunk_sweep", results, errors,
                lambda: bench_chunk_sweep(sizes, device, min(trials, 3), pinned, sweep))
    # A plugin's block copier (kvcore-nvidia's cuda_batch), when installed and usable here.
    copier = args.block_copier
    if copier is not None and (copier not in block_copier_names()
                               or get_block_copier(copier).unavailable_reason(device)):
        log.info("block copier %s not available here: its rows are skipped", copier)
        copier = None
    if copier is not None:
        section("copier", results, errors, lambda: {
            mode: bench_offload_mode(sizes, device, cross, trials, pinned, chunk_bytes,
                                     id_kinds=("scattered",), block_copier=copier)
            for mode, cross in (("per_layer", False), ("cross_layer", True))})
    section("decode", results, errors,
            lambda: bench_decode(sizes, device, trials, pinned, chunk_bytes, copier))
    problems = self_check(results)
    for problem in problems:
        log.error("check failed: %s", problem)

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
        or "cpu",
        "torch": torch.__version__,
        "kvcore": kvcore.__version__,
        "smoke": args.smoke,
        "sizes": asdict(sizes),
        "chunk_bytes": chunk_bytes,
        "targets": TARGETS,
        "results": results,
        "errors": errors,
        "check_failures": problems,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_offload.json"
    path.write_text(json.dumps(report, indent=2))
    log.info("wrote %s", path)
    print(table(results, errors, args.smoke))
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if errors or problems else 0


if __name__ == "__main__":
    sys.exit(main())
