#!/usr/bin/env python3
"""The ``nixl`` connector's READ bandwidth between two processes, beside a plain copy of the
same bytes in one process (the memory's own limit).

A producer process (this script with ``--serve``) allocates a cross-layer or per-layer KV
cache (bf16, ``--layers`` x blocks of ``--block-kib`` KiB per layer, about ``--mib`` MiB in
all) on ``--device`` (``cpu``: DRAM regions; ``cuda``: VRAM), fills it with random bytes and
publishes every block once per trial. This process, the consumer, allocates the same cache,
connects over loopback and loads all blocks per trial: one NIXL READ per run of consecutive
blocks (one run here), timed from ``load()`` to the handle's result (wall time; on a GPU the
consumer synchronises the device before reporting). The first load is listed apart (it pays
for UCX's first use of the memory), then the median of the others. The reference is
``dst.copy_(src)`` of a tensor of the same bytes on the same device (memcpy on the CPU, a
device-to-device copy on a GPU), median of the same number of trials. The last load is
checked bit-exact against the producer's bytes (regenerated here from the same seed).

Usage: ``python benchmarks/bench_nixl.py [--device cpu|cuda (default: cuda if there is
one)] [--mib N] [--trials N]
[--per-layer] [--out DIR]``; JSON goes to ``--out`` (default ``$OUT``, else the temp dir) as
``bench_nixl.json``. Set ``NIXL_LOG_LEVEL=WARN`` to silence NIXL's INFO lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcore
from kvcore.connectors import get_connector, hash_block_tokens

SEED = 1234


def make_cache(args: argparse.Namespace, fill: bool) -> kvcore.KVCaches:
    # bf16, 8 KV heads of 128, block 16 -> 64 KiB per layer and block at --block-kib 64.
    block_size = max(1, args.block_kib * 1024 // (2 * 8 * 128 * 2))
    page = 2 * block_size * 8 * 128 * 2
    num_blocks = max(2, args.mib * (1 << 20) // (args.layers * page))
    kv = kvcore.allocate_kv_caches(
        "CPU_ATTN", num_layers=args.layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device=args.device,
        cross_layer=not args.per_layer)
    if fill:
        gen = torch.Generator().manual_seed(SEED)
        data = torch.randint(0, 256, (kv.storage.numel() * 2,), dtype=torch.uint8,
                             generator=gen)
        kv.storage.view(torch.uint8).view(-1).copy_(data.to(kv.storage.device))
    return kv


def trial_keys(trial: int, num_blocks: int) -> list[str]:
    keys, parent = [], None
    for b in range(num_blocks):
        parent = hash_block_tokens(parent, [trial, b])
        keys.append(parent)
    return keys


def serve(args: argparse.Namespace) -> int:
    """The producer: publish every block under each trial's keys; wait until read."""
    kv = make_cache(args, fill=True)
    with get_connector("nixl", role="producer", port=0, publish_timeout_s=600.0) as producer:
        producer.register_kv_caches(kv)
        ids = list(range(kv.num_blocks))
        handles = [producer.save(trial_keys(t, kv.num_blocks), ids) for t in range(args.trials)]
        print(f"port {producer.port}", flush=True)
        ok = all(h.wait(timeout=600).ok for h in handles)
    print(f"served {ok}", flush=True)
    return 0 if ok else 1


def copy_seconds(kv: kvcore.KVCaches, trials: int) -> list[float]:
    src = kv.storage.view(torch.uint8).view(-1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(trials):
        if src.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--per-layer", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir())
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 2:
        parser.error("--trials must be >= 2 (the first load is listed apart)")
    if args.serve:
        return serve(args)

    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("port "):
            raise RuntimeError(f"the producer did not start: {line!r}")
        port = int(line.split()[1])
        kv = make_cache(args, fill=False)
        nbytes = kv.storage.numel() * kv.storage.element_size()
        times = []
        with get_connector("nixl", role="consumer", port=port, timeout_s=120.0) as consumer:
            consumer.register_kv_caches(kv)
            ids = list(range(kv.num_blocks))
            for t in range(args.trials):
                keys = trial_keys(t, kv.num_blocks)
                t0 = time.perf_counter()
                result = consumer.load(keys, ids).wait(timeout=300)
                times.append(time.perf_counter() - t0)
                if not result.ok:
                    raise RuntimeError(f"trial {t}: {len(result.failed)} blocks failed, e.g. "
                                       f"{next(iter(result.failed.values()))}")
        served = proc.stdout.readline().strip()
    finally:
        proc.wait(timeout=120)
    expected = make_cache(args, fill=True)
    exact = torch.equal(kv.storage.view(torch.uint8).cpu(),
                        expected.storage.view(torch.uint8).cpu())
    copies = copy_seconds(expected, args.trials)
    nixl_s, copy_s = statistics.median(times[1:]), statistics.median(copies[1:])
    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "layout": str(kv.layout), "bytes": nbytes, "blocks": kv.num_blocks,
        "block_bytes": nbytes // kv.num_blocks, "trials": args.trials,
        "nixl_first_gbps": nbytes / times[0] / 1e9, "nixl_gbps": nbytes / nixl_s / 1e9,
        "copy_gbps": nbytes / copy_s / 1e9, "fraction_of_copy": copy_s / nixl_s,
        "bit_exact": exact, "producer": served,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_nixl.json").write_text(json.dumps(record, indent=2))
    print(f"nixl READ between two processes, {record['device']}, layout {record['layout']}, "
          f"{nbytes / 2**20:.0f} MiB in {kv.num_blocks} blocks of "
          f"{record['block_bytes'] / 1024:.0f} KiB")
    print(f"  nixl load:  {record['nixl_gbps']:8.2f} GB/s (median of {args.trials - 1}; first "
          f"load {record['nixl_first_gbps']:.2f} GB/s)")
    print(f"  plain copy: {record['copy_gbps']:8.2f} GB/s (same bytes, one process)")
    print(f"  ratio:      {record['fraction_of_copy']:8.2f}   bit-exact: {exact}   "
          f"producer: {served}")
    return 0 if exact and served == "served True" else 1


if __name__ == "__main__":
    sys.exit(main())
