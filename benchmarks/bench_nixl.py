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
one)] [--mib N] [--trials N] [--per-layer] [--ucx-tls TLS] [--ucx-error-mode peer|none]
[--out DIR]``; JSON goes to ``--out`` (default ``$OUT``, else the temp dir) as
``bench_nixl.json``. Set ``NIXL_LOG_LEVEL=WARN`` to silence NIXL's INFO lines.
``--ucx-tls`` and ``--ucx-error-mode`` reach both processes' connectors (``ucx_tls=`` and
``backend_params={"UCX": {"ucx_error_handling_mode": ...}}``).

``--matrix`` runs the transport matrix instead, each configuration in its own pair of
processes, cross-layer and per-layer, first with UCX's own rule for CUDA IPC reads
(``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto``): UCX's default, ``UCX_TLS=cuda_ipc,cuda_copy,tcp``,
``UCX_TLS=cuda_ipc,cuda_copy,sm,self``, and both of those with UCX's peer error handling
off (``ucx_error_handling_mode=none``: with NIXL's default, ``peer``, UCX uses only
transports that detect a dead peer; shared memory does not, so ``sm,self`` alone has no
transport for its active messages); then the default and ``cuda_ipc,cuda_copy,tcp`` with
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, the connector's default (cuda_ipc offers READs only
between NVLink-connected GPUs unless told to). ``--matrix-only TEXT`` runs the configurations
whose name contains TEXT. Each run sets ``UCX_PROTO_INFO=y`` and ``UCX_LOG_LEVEL=info``; its
log goes to ``--out`` and the lines naming the transports UCX chose are printed. The table
(GB/s, the fraction of the device copy measured in the same run, bit-exact) is printed last
and written as ``bench_nixl_matrix.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
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


def transport_options(args: argparse.Namespace) -> dict:
    """The connector's transport options from the command line."""
    options: dict = {}
    if args.ucx_tls:
        options["ucx_tls"] = args.ucx_tls
    if args.ucx_error_mode:
        options["backend_params"] = {"UCX": {"ucx_error_handling_mode": args.ucx_error_mode}}
    return options


#: UCX's cuda_ipc transport offers GET (what a consumer's READ is) only between GPUs it finds
#: NVLink between (``auto``, UCX's rule); two processes on one GPU have none, so READs went
#: over tcp or cma. The connector sets ``y`` (``kvcore.connectors.nixl.UCX_DEFAULTS``).
GET_ZCOPY = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
UCX_RULE = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}
#: ``--matrix``: (name, --ucx-tls, --ucx-error-mode, extra environment).
MATRIX = (
    ("default get_zcopy=auto", None, None, UCX_RULE),
    ("cuda_ipc,cuda_copy,tcp get_zcopy=auto", "cuda_ipc,cuda_copy,tcp", None, UCX_RULE),
    ("cuda_ipc,cuda_copy,sm,self get_zcopy=auto", "cuda_ipc,cuda_copy,sm,self", None, UCX_RULE),
    ("cuda_ipc,cuda_copy,tcp err=none get_zcopy=auto", "cuda_ipc,cuda_copy,tcp", "none",
     UCX_RULE),
    ("cuda_ipc,cuda_copy,sm,self err=none get_zcopy=auto", "cuda_ipc,cuda_copy,sm,self", "none",
     UCX_RULE),
    ("default get_zcopy=y", None, None, GET_ZCOPY),
    ("cuda_ipc,cuda_copy,tcp get_zcopy=y", "cuda_ipc,cuda_copy,tcp", None, GET_ZCOPY),
)
#: Words in UCX's log that name a transport choice.
TRANSPORT_WORDS = ("cuda_ipc", "cuda_copy", "tcp", "posix", "sysv", "cma", "rc_", "dc_",
                   "ud_", "gdr_copy", "self/")


def matrix(args: argparse.Namespace) -> int:
    """Every configuration of :data:`MATRIX`, cross-layer and per-layer, each a run of this
    script in its own processes (UCX reads its configuration once per process)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, records = [], []
    for name, tls, err, extra_env in MATRIX:
        if args.matrix_only and args.matrix_only not in name:
            continue
        for per_layer in (False, True):
            label = f"{name} {'per-layer' if per_layer else 'cross-layer'}"
            slug = "".join(c if c.isalnum() else "_" for c in label)
            cmd = [sys.executable, __file__, "--device", args.device, "--mib", str(args.mib),
                   "--layers", str(args.layers), "--block-kib", str(args.block_kib),
                   "--trials", str(args.trials), "--out", str(out / slug)]
            cmd += ["--per-layer"] if per_layer else []
            cmd += ["--ucx-tls", tls] if tls else []
            cmd += ["--ucx-error-mode", err] if err else []
            env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info",
                   "NIXL_LOG_LEVEL": "WARN", **extra_env}  # UCX reads it once per process
            env.pop("UCX_TLS", None)
            started = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                      timeout=args.run_timeout)
                log, rc = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired as exc:
                # What it wrote before the timeout comes as bytes, even with text=True.
                said = b"".join(part or b"" for part in (exc.stdout, exc.stderr))
                log = (f"{said.decode(errors='replace')}\nTIMED OUT after {args.run_timeout} "
                       "s")
                rc = None
            (out / f"{slug}.log").write_text(log)
            chosen = sorted({line.strip()[:160] for line in log.splitlines()
                             if any(w in line for w in TRANSPORT_WORDS)
                             and ("UCX" in line or "|" in line)})
            print(f"== {label}: rc {rc}, {time.perf_counter() - started:.0f} s; transports "
                  f"in UCX's log ({len(chosen)} lines, first 12):")
            for line in chosen[:12]:
                print(f"   {line}")
            result_file = out / slug / "bench_nixl.json"
            record = json.loads(result_file.read_text()) if result_file.exists() else {}
            record.update(config=name, per_layer=per_layer, rc=rc, transport_lines=chosen[:40])
            records.append(record)
            rows.append((label, record.get("nixl_gbps"), record.get("nixl_first_gbps"),
                         record.get("copy_gbps"), record.get("fraction_of_copy"),
                         record.get("bit_exact"), rc))
    (out / "bench_nixl_matrix.json").write_text(json.dumps(records, indent=2))
    print(f"\nnixl READ matrix, {args.mib} MiB, {args.device}, median of {args.trials - 1} "
          "loads (first apart); copy = same bytes in one process, same run")
    print(f"{'configuration':44} {'GB/s':>9} {'first':>9} {'copy GB/s':>10} {'of copy':>8} "
          f"{'bit-exact':>9} {'rc':>4}")

    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for label, gbps, first, copy, frac, exact, rc in rows:
        print(f"{label:44} {num(gbps, '9.2f')} {num(first, '9.2f')} {num(copy, '10.1f')} "
              f"{num(frac, '8.4f')} {exact!s:>9} {rc!s:>4}")
    return 0 if all(r[5] is True and r[6] == 0 for r in rows) else 1


def serve(args: argparse.Namespace) -> int:
    """The producer: publish every block under each trial's keys; wait until read."""
    kv = make_cache(args, fill=True)
    with get_connector("nixl", role="producer", port=0, publish_timeout_s=600.0,
                       **transport_options(args)) as producer:
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
    parser.add_argument("--ucx-tls", default=None,
                        help="UCX transports for both connectors (UCX_TLS syntax)")
    parser.add_argument("--ucx-error-mode", choices=("peer", "none"), default=None,
                        help="the UCX backend's ucx_error_handling_mode (NIXL's default: peer)")
    parser.add_argument("--matrix", action="store_true",
                        help="run the transport matrix (see the module docstring)")
    parser.add_argument("--matrix-only", default=None, metavar="TEXT",
                        help="--matrix: only the configurations whose name contains TEXT")
    parser.add_argument("--run-timeout", type=float, default=240.0,
                        help="--matrix: seconds one configuration may take")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 2:
        parser.error("--trials must be >= 2 (the first load is listed apart)")
    if args.serve:
        return serve(args)
    if args.matrix:
        return matrix(args)

    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]],
                            stdout=subprocess.PIPE, text=True, env=env)
    # The producer's stdout carries "port N" and "served ..." lines, and UCX's own log when
    # it is on (UCX logs to stdout): a thread drains it, so the producer never blocks on it.
    port_line: queue.Queue[str] = queue.Queue()
    tagged: dict[str, str] = {}

    def drain() -> None:
        for line in proc.stdout:
            if line.startswith(("port ", "served ")):
                tagged[line.split()[0]] = line.strip()
                if line.startswith("port "):
                    port_line.put(line.strip())
            else:
                sys.stderr.write(f"[producer] {line}")
        port_line.put("")  # the producer closed its stdout

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        line = port_line.get(timeout=300)
        if not line.startswith("port "):
            raise RuntimeError(f"the producer did not start (rc {proc.poll()})")
        port = int(line.split()[1])
        kv = make_cache(args, fill=False)
        nbytes = kv.storage.numel() * kv.storage.element_size()
        times = []
        with get_connector("nixl", role="consumer", port=port, timeout_s=120.0,
                           **transport_options(args)) as consumer:
            consumer.register_kv_caches(kv)
            ids = list(range(kv.num_blocks))
            for t in range(args.trials):
                keys = trial_keys(t, kv.num_blocks)
                t0 = time.perf_counter()
                result = consumer.load(keys, ids).wait(timeout=300)
                if kv.storage.is_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if not result.ok:
                    raise RuntimeError(f"trial {t}: {len(result.failed)} blocks failed, e.g. "
                                       f"{next(iter(result.failed.values()))}")
    finally:
        proc.wait(timeout=120)
        drainer.join(30)
    served = tagged.get("served", "served ?")
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
