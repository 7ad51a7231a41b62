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

Across two devices, ``--serve-device`` puts the producer on another device than the
consumer's ``--device`` (``--serve-device cuda:0 --device cuda:1``); the reference copy then
goes across them too (``src`` on the producer's device, ``dst`` on the consumer's, the bytes
of ``src`` regenerated in this process). ``--scattered``: each side moves its blocks under a
random permutation of its own block ids (the producer's and the consumer's differ), so a
transfer is hundreds of runs of one block instead of one run; bit-exactness is then checked
block by block (consumer block ``c[i]`` against producer block ``p[i]``, every layer).
``--connector mooncake`` measures the ``mooncake`` connector the same way (Mooncake's transfer
engine, TCP between DRAM caches with the non-cuda wheel). ``--connector p2p`` measures the
``p2p`` connector instead, over ``--p2p-backend`` (default ``auto``: NCCL between CUDA caches
on two GPUs, ``ipc`` for two processes on one GPU, where NCCL refuses two ranks: staging
slots both map through CUDA IPC; gloo between CPU caches; ``ipc`` on the CPU moves them
through ``/dev/shm``): the producer, rank 0, sends a trial's blocks when the consumer, rank 1,
writes ``go`` on its stdin; the consumer times from that line to its ``load()``'s result
(receive, then writing the blocks into its cache).

Usage: ``python benchmarks/bench_nixl.py [--device cpu|cuda (default: cuda if there is
one)] [--serve-device DEV] [--connector nixl|mooncake|p2p] [--p2p-backend auto|gloo|nccl|ipc]
[--scattered] [--mib N] [--trials N]
[--per-layer] [--ucx-tls TLS] [--ucx-error-mode peer|none] [--progress-thread on|off]
[--lookup] [--phases] [--out DIR]``; JSON goes to
``--out`` (default ``$OUT``, else the temp dir) as ``bench_nixl.json``. Set
``NIXL_LOG_LEVEL=WARN`` to silence NIXL's INFO lines.
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

``--convert``: the consumer's cache differs from the producer's (blocks 4 times larger, 16 ->
64 tokens at the default ``--block-kib``, HND instead of NHD; the same bytes in all): the
connector converts on load (``nixl``: where the consumer maps the producer's cache, one gather
from it in place; else, or with ``--staged``, READs into its staging buffer, the READ of a chunk
overlapping the gather kernel of the previous one, or in turn with ``--staging-buffers 1``;
``--staging-mib N`` sizes its staging buffer, so a small load still converts in many chunks;
``p2p``: the receiver's gather), checked token by token through the logical views.
``--gather-only`` times the gather kernel alone between those two layouts in one process beside
``dst.copy_(src)``. ``--convert-suite`` runs nixl and p2p with the same layout and with
``--convert`` (nixl in place where it can, and staged with one staging buffer), and
``--gather-only``, each in its own
processes, and prints the table last
(GB/s, of the device copy, of the same connector's same-layout transfer, the p2p data path;
written as ``bench_nixl_convert.json``); ``--only TEXT`` keeps the cases whose label contains
TEXT. One GPU, two processes, 1 GiB: ``--convert-suite --mib 1024`` (p2p over ``ipc``; its
cases alone: ``--only p2p``).

``--phases`` (nixl, mooncake): the consumer also times where each load's wall time goes, per
load (median over the loads after the first, in ms), through the connector's timing hook:
``channel`` (requests to the producer: fetch, confirmations; ``round_trips`` counts them),
``start_read`` (descriptors, the transfer request and its post), ``poll`` (asking the library
whether a READ finished), ``release`` (freeing its handle), ``pause`` (the connector's pauses
between polls), for a converting load ``prepare`` (its gathers' checks and ids: staged, while
the fetch's answer is on the way; in place after a lookup, before the fetch), ``gather``
(launching them; the gather itself on the CPU) and ``wait`` (the host waiting for the
device), ``notify`` (nixl, with ``--lookup``: confirming the READs started before the lease),
and ``other`` (the rest: the loader thread, Python); written as ``phases_ms`` in the JSON.

``--profile``: the consumer's loads after the first run under cProfile (a load runs in the
thread that waits for it), the top functions by own and by cumulative time written to
``profile.txt`` in ``--out``.

``--lookup`` (nixl, mooncake): before each load the consumer looks its keys up, untimed, as an
engine's scheduler does before it asks for the load; the lookup's answer names the producer's
blocks, so the load starts its READs from them while its fetch is on the way (and trusts them
once the lease names the same blocks and serials). Without it, a load fetches first, then
READs.

``--progress-thread on|off`` sets both nixl connectors' ``progress_thread`` (default: the
connector's, on for the producer and off for the consumer).

``--grid`` runs, each in its own pair of processes with this call's devices and sizes, every
connector of ``--grid-connectors`` (default ``nixl,p2p``; nixl rows say why they are skipped
where it is not installed) x cross-layer/per-layer x contiguous/scattered block ids; the
table is printed last and written as ``bench_nixl_grid.json``. ``--budget-s`` bounds the
whole grid: cases not started in time are listed as skipped (and the exit status is 1).
Two GPUs of one host:
``--grid --serve-device cuda:0 --device cuda:1 --mib 1024``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import itertools
import json
import os
import pstats
import queue
import signal
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
#: The nixl consumer's timeout_s; its leases last twice that, so the producer's max_lease_s
#: must grant them (it refuses the consumer at registration otherwise).
CONSUMER_TIMEOUT_S = 120.0


#: ``--convert``: the consumer's blocks hold this many of the producer's (16 -> 64 tokens at
#: the default --block-kib), in HND order.
CONVERT_RATIO = 4


def make_cache(args: argparse.Namespace, fill: bool,
               device: str | None = None, converted: bool = False) -> kvcore.KVCaches:
    """The benchmark's cache on ``device`` (default ``--device``), random bytes from
    :data:`SEED` when ``fill``. ``converted``: the consumer's cache of ``--convert`` (blocks
    :data:`CONVERT_RATIO` times larger, HND, the same bytes in all)."""
    # bf16, 8 KV heads of 128, block 16 -> 64 KiB per layer and block at --block-kib 64.
    block_size = max(1, args.block_kib * 1024 // (2 * 8 * 128 * 2))
    page = 2 * block_size * 8 * 128 * 2
    num_blocks = max(2, args.mib * (1 << 20) // (args.layers * page))
    backend = "CPU_ATTN"
    if args.convert or args.gather_only:
        num_blocks = max(CONVERT_RATIO, num_blocks // CONVERT_RATIO * CONVERT_RATIO)
    if converted:
        backend, block_size = "TRITON_ATTN_HND", block_size * CONVERT_RATIO
        num_blocks //= CONVERT_RATIO
    kv = kvcore.allocate_kv_caches(
        backend, num_layers=args.layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=8, head_size=128, dtype=torch.bfloat16, device=device or args.device,
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


def block_ids(args: argparse.Namespace, num_blocks: int, role: str) -> list[int]:
    """The block ids ``role`` (``producer`` or ``consumer``) moves, in key order: all blocks
    in order, or with ``--scattered`` a random permutation of its own (each side's differs),
    so that a transfer is runs of one block, not one run."""
    if not args.scattered:
        return list(range(num_blocks))
    gen = torch.Generator().manual_seed(SEED + (1 if role == "producer" else 2))
    return torch.randperm(num_blocks, generator=gen).tolist()


def count_runs(ids: list[int]) -> int:
    """How many runs of consecutive block ids ``ids`` has."""
    return 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) if ids else 0


def mismatched_blocks(kv: kvcore.KVCaches, ids: list[int], expected: kvcore.KVCaches,
                      expected_ids: list[int]) -> int:
    """How many of the blocks ``kv[ids[i]]`` differ in any byte, in any layer, from
    ``expected[expected_ids[i]]``."""
    views = ([(kv.block_view(), expected.block_view())] if kv.is_cross_layer else
             list(zip(kv.layer_block_views(), expected.layer_block_views(), strict=True)))
    index = torch.tensor(ids, device=kv.storage.device)
    expected_index = torch.tensor(expected_ids, device=expected.storage.device)
    bad = torch.zeros(len(ids), dtype=torch.bool, device=kv.storage.device)
    for got, want in views:
        bad |= (got[index] != want[expected_index].to(got.device)).any(dim=1)
    return int(bad.sum())


def mismatched_tokens(kv: kvcore.KVCaches, ids: list[int], expected: kvcore.KVCaches,
                      expected_ids: list[int]) -> int:
    """How many tokens (of every layer, K and V, all heads) held by blocks ``kv[ids]`` in
    order differ from those of ``expected[expected_ids]``, through the logical views (the
    two caches may differ in block size and order)."""
    bad = 0
    index = torch.tensor(ids, device=kv.storage.device)
    expected_index = torch.tensor(expected_ids, device=expected.storage.device)
    for got, want in zip(kv.layers, expected.layers, strict=True):
        a = got.index_select(0, index).transpose(0, 1).flatten(1, 2)  # (2, tokens, H, D)
        b = want.index_select(0, expected_index).transpose(0, 1).flatten(1, 2).to(a.device)
        bad += int((a.view(torch.int16) != b.view(torch.int16)).flatten(2).any(-1).sum())
    return bad


def gather_only(args: argparse.Namespace) -> int:
    """``--gather-only``: the conversion's gather kernel alone (producer layout -> the
    consumer's of ``--convert``) on ``--device``, beside ``dst.copy_(src)`` of the same
    bytes; bit-exact through the logical views."""
    from kvcore.connectors import plan_conversion

    src = make_cache(args, fill=True)
    dst = make_cache(args, fill=False, converted=True)
    plan = plan_conversion(src.layout, dst.layout)
    src_ids = block_ids(args, src.num_blocks, "producer")
    dst_ids = block_ids(args, dst.num_blocks, "consumer")
    nbytes = dst.storage.numel() * dst.storage.element_size()
    cuda = dst.storage.is_cuda
    times = []
    for _ in range(args.trials):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan.apply(src, dst, src_ids, dst_ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    copies = copy_seconds(src, args.device, args.trials)
    mismatched = mismatched_tokens(dst, dst_ids, src, src_ids)
    gather_s, copy_s = statistics.median(times[1:]), statistics.median(copies[1:])
    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "connector": "gather",
        "layout": f"{src.layout} -> {dst.layout}", "bytes": nbytes, "trials": args.trials,
        "first_gbps": nbytes / times[0] / 1e9, "gbps": nbytes / gather_s / 1e9,
        "copy_gbps": nbytes / copy_s / 1e9, "fraction_of_copy": copy_s / gather_s,
        "bit_exact": mismatched == 0, "mismatched_tokens": mismatched,
        "consumer_runs": count_runs(dst_ids), "plan": str(plan),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_nixl.json").write_text(json.dumps(record, indent=2))
    print(f"conversion gather alone, {record['device']}, {record['layout']}, "
          f"{nbytes / 2**20:.0f} MiB\n{plan}")
    print(f"  gather:     {record['gbps']:8.2f} GB/s (median of {args.trials - 1}; first "
          f"{record['first_gbps']:.2f} GB/s)")
    print(f"  plain copy: {record['copy_gbps']:8.2f} GB/s (same bytes, one device)")
    print(f"  ratio:      {record['fraction_of_copy']:8.2f}   bit-exact: {mismatched == 0}")
    return 0 if mismatched == 0 else 1


#: ``--convert-suite``: (label, connector, extra arguments).
CONVERT_SUITE = (
    ("nixl same layout", "nixl", []),
    ("nixl 16->64 NHD->HND", "nixl", ["--convert"]),
    ("nixl 16->64 staged", "nixl", ["--convert", "--staged", "--staging-buffers", "1"]),
    ("p2p same layout", "p2p", []),
    ("p2p 16->64 NHD->HND", "p2p", ["--convert"]),
    ("gather kernel alone", "nixl", ["--gather-only"]),
)


def convert_suite(args: argparse.Namespace) -> int:
    """Each case of :data:`CONVERT_SUITE` in its own pair of processes with this call's
    devices and sizes; the table (GB/s, against the device copy and against the same-layout
    transfer of the same connector) is printed last and written as
    ``bench_nixl_convert.json``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for label, connector, extra in CONVERT_SUITE:
        if args.only and args.only not in label:
            continue
        slug = label.replace(" ", "_").replace(">", "").replace("-", "_")
        cmd = [sys.executable, __file__, "--connector", connector, "--device", args.device,
               "--serve-device", args.serve_device, "--mib", str(args.mib),
               "--layers", str(args.layers), "--block-kib", str(args.block_kib),
               "--trials", str(args.trials), "--out", str(out / slug), *extra]
        cmd += ["--per-layer"] if args.per_layer else []
        cmd += ["--p2p-backend", args.p2p_backend] if connector == "p2p" else []
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            log, rc = proc.communicate(timeout=args.run_timeout)[0], proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, rc = f"{proc.communicate()[0]}\nTIMED OUT after {args.run_timeout:.0f} s", None
        (out / f"{slug}.log").write_text(log)
        print(f"== {label}: rc {rc}, {time.perf_counter() - started:.0f} s")
        print("\n".join(f"   {line}" for line in log.strip().splitlines()[-8:]))
        record = {"case": label, "connector": connector, "rc": rc}
        result_file = out / slug / "bench_nixl.json"
        if result_file.exists():
            record.update(json.loads(result_file.read_text()))
        records.append(record)
    same = {r["connector"]: r.get("gbps") for r in records if "same layout" in r["case"]}
    for r in records:
        base = same.get(r.get("connector"))
        if "16->64" in r["case"] and isinstance(base, float) and isinstance(r.get("gbps"), float):
            r["fraction_of_same_layout"] = r["gbps"] / base
    (out / "bench_nixl_convert.json").write_text(json.dumps(records, indent=2))

    def num(v, fmt):
        width = int(fmt.split(".")[0].rstrip("df") or 0)
        return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)

    print(f"\nConverting transfers, {args.mib} MiB, {args.serve_device} -> {args.device}, "
          f"{'per-layer' if args.per_layer else 'cross-layer'}, median of {args.trials - 1} "
          "(first apart); copy = dst.copy_(src) of the same bytes, same run")
    print(f"{'case':24} {'GB/s':>9} {'first':>9} {'copy GB/s':>10} {'of copy':>8} "
          f"{'of same':>8} {'bit-exact':>9} {'rc':>4}  via")
    for r in records:
        print(f"{r['case']:24} {num(r.get('gbps'), '9.2f')} {num(r.get('first_gbps'), '9.2f')} "
              f"{num(r.get('copy_gbps'), '10.1f')} {num(r.get('fraction_of_copy'), '8.3f')} "
              f"{num(r.get('fraction_of_same_layout'), '8.3f')} {r.get('bit_exact')!s:>9} "
              f"{r['rc']!s:>4}  {r.get('transport') or ''}")
    return 0 if all(r.get("bit_exact") is True and r["rc"] == 0 for r in records) else 1


def inbox_bytes(kv: kvcore.KVCaches) -> int:
    """p2p: an inbox that holds a whole trial's blocks twice over (received, then loaded)."""
    return max(1 << 30, 2 * kv.storage.numel() * kv.storage.element_size())


def staging_options(args: argparse.Namespace) -> dict:
    """The consumer's ``staging_bytes`` from ``--staging-mib`` (none: the connector's), and
    ``map_producer=False`` with ``--staged``."""
    options = {} if args.staging_mib is None else {"staging_bytes": args.staging_mib << 20}
    return {**options, "map_producer": False} if args.staged else options


def transport_options(args: argparse.Namespace) -> dict:
    """The connector's transport options from the command line."""
    options: dict = {}
    if args.ucx_tls:
        options["ucx_tls"] = args.ucx_tls
    if args.ucx_error_mode:
        options["backend_params"] = {"UCX": {"ucx_error_handling_mode": args.ucx_error_mode}}
    if args.progress_thread:
        options["progress_thread"] = args.progress_thread == "on"
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


def grid(args: argparse.Namespace) -> int:
    """Every connector of ``--grid-connectors`` x (cross-layer, per-layer) x (contiguous,
    scattered block ids), each a run of this script in its own pair of processes, with this
    call's devices and sizes; the table is printed last and written as
    ``bench_nixl_grid.json``."""
    from kvcore.connectors.nixl import nixl_unavailable_reason

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    deadline = time.monotonic() + (args.budget_s or float("inf"))
    for connector in args.grid_connectors.split(","):
        for per_layer in (False, True):
            for scattered in (False, True):
                label = (f"{connector} {'per-layer' if per_layer else 'cross-layer'} "
                         f"{'scattered' if scattered else 'contiguous'}")
                record = {"case": label, "connector": connector, "per_layer": per_layer,
                          "scattered": scattered}
                records.append(record)
                missing = nixl_unavailable_reason() if connector == "nixl" else None
                left = deadline - time.monotonic()
                if missing is None and left < 1:
                    missing = f"--budget-s {args.budget_s} spent before this case"
                if missing is not None:
                    record["skipped"] = str(missing)
                    print(f"== {label}: skipped: {missing}")
                    continue
                slug = label.replace(" ", "_")
                cmd = [sys.executable, __file__, "--connector", connector,
                       "--device", args.device, "--serve-device", args.serve_device,
                       "--mib", str(args.mib), "--layers", str(args.layers),
                       "--block-kib", str(args.block_kib), "--trials", str(args.trials),
                       "--out", str(out / slug)]
                cmd += ["--per-layer"] if per_layer else []
                cmd += ["--scattered"] if scattered else []
                started = time.perf_counter()
                limit = min(args.run_timeout, left)
                # A session of its own: a case past its time goes with its producer.
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
                try:
                    log, rc = proc.communicate(timeout=limit)[0], proc.returncode
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    log = f"{proc.communicate()[0]}\nTIMED OUT after {limit:.0f} s"
                    rc = None
                seconds = time.perf_counter() - started
                (out / f"{slug}.log").write_text(log)
                print(f"== {label}: rc {rc}, {seconds:.0f} s")
                print("\n".join(f"   {line}" for line in log.strip().splitlines()[-6:]))
                result_file = out / slug / "bench_nixl.json"
                if result_file.exists():
                    record.update(json.loads(result_file.read_text()))
                record.update(rc=rc, seconds=seconds)
    (out / "bench_nixl_grid.json").write_text(json.dumps(records, indent=2))
    print(f"\nKV transfer, {args.mib} MiB, producer {args.serve_device} -> consumer "
          f"{args.device}, median of {args.trials - 1} loads (first apart); copy = dst.copy_(src) "
          "of the same bytes between the same devices, same run")
    print(f"{'case':30} {'GB/s':>9} {'first':>9} {'copy GB/s':>10} {'of copy':>8} "
          f"{'runs':>6} {'bit-exact':>9} {'rc':>4}")

    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in records:
        if "skipped" in r:
            print(f"{r['case']:30} skipped: {r['skipped'][:80]}")
            continue
        print(f"{r['case']:30} {num(r.get('gbps'), '9.2f')} {num(r.get('first_gbps'), '9.2f')} "
              f"{num(r.get('copy_gbps'), '10.1f')} {num(r.get('fraction_of_copy'), '8.4f')} "
              f"{num(r.get('consumer_runs'), '6d')} {r.get('bit_exact')!s:>9} {r['rc']!s:>4}")
    ran = [r for r in records if "skipped" not in r]
    unfinished = any("--budget-s" in r.get("skipped", "") for r in records)
    return 0 if ran and not unfinished and all(
        r.get("bit_exact") is True and r["rc"] == 0 for r in ran) else 1


def serve(args: argparse.Namespace) -> int:
    """The producer, on ``--serve-device``. nixl: publish every block under each trial's keys;
    wait until read, then until the consumer closed (stdin ends). p2p: send every block under
    trial t's keys when this process reads ``go t`` on its stdin (the consumer's clock starts
    then)."""
    kv = make_cache(args, fill=True, device=args.serve_device)
    ids = block_ids(args, kv.num_blocks, "producer")
    if args.connector == "p2p":
        with get_connector("p2p", rank=0, port=0, timeout_s=120.0, connect_timeout_s=120.0,
                           inbox_bytes=inbox_bytes(kv),
                           data_backend=args.p2p_backend) as producer:
            print(f"port {producer.port}", flush=True)
            producer.register_kv_caches(kv)  # waits for the consumer to join
            ok = True
            for line in sys.stdin:
                trial = int(line.split()[1])
                ok &= producer.save(trial_keys(trial, kv.num_blocks), ids).wait(timeout=600).ok
        print(f"served {ok}", flush=True)
        return 0 if ok else 1
    with get_connector(args.connector, role="producer", port=0, publish_timeout_s=600.0,
                       max_lease_s=2 * CONSUMER_TIMEOUT_S,
                       **transport_options(args)) as producer:
        producer.register_kv_caches(kv)
        handles = [producer.save(trial_keys(t, kv.num_blocks), ids) for t in range(args.trials)]
        print(f"port {producer.port}", flush=True)
        ok = all(h.wait(timeout=600).ok for h in handles)
        print(f"served {ok}", flush=True)
        # Close once the consumer closed (its stdin ends): a consumer converting in place
        # maps this cache until then.
        sys.stdin.read()
    return 0 if ok else 1


def copy_seconds(src_kv: kvcore.KVCaches, device: str, trials: int) -> list[float]:
    """``dst.copy_(src)`` of ``src_kv``'s bytes into a tensor on ``device`` (the same device,
    or across two), each timed with both devices synchronised."""
    src = src_kv.storage.view(torch.uint8).view(-1)
    dst = torch.empty_like(src, device=device)
    cuda = [d for d in {src.device, dst.device} if d.type == "cuda"]
    times = []
    for _ in range(trials):
        for d in cuda:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        dst.copy_(src)
        for d in cuda:
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - t0)
    return times


class Phases:
    """``--phases``: wall time per phase of a pull connector's loads, in the consumer, from the
    connector's timing hook (:attr:`kvcore.connectors.pull.PullConnector.timing`); requests
    on the side channel add up to ``channel`` and are counted (``round_trips``)."""

    NAMES = ("channel", "start_read", "poll", "release", "pause", "prepare", "gather", "wait",
             "notify")
    REQUESTS = ("lookup", "fetch", "giveback", "done")

    def __init__(self, consumer) -> None:
        self.now: dict[str, float] = dict.fromkeys(self.NAMES, 0.0)
        self.trips = 0
        self.loads: list[dict[str, float]] = []
        consumer.timing = self._add

    def _add(self, phase: str, seconds: float) -> None:
        if phase in self.REQUESTS:
            self.trips += 1
            phase = "channel"
        self.now[phase] += seconds

    def forget(self) -> None:
        """Drop what was heard since the last load ended (a lookup before the next one)."""
        self.now = dict.fromkeys(self.NAMES, 0.0)
        self.trips = 0

    def end_load(self, seconds: float) -> None:
        """Close one load that took ``seconds`` of wall time."""
        spent = dict(self.now)
        spent["other"] = seconds - sum(spent.values())
        spent["round_trips"] = self.trips
        self.loads.append(spent)
        self.now = dict.fromkeys(self.NAMES, 0.0)
        self.trips = 0

    def medians_ms(self) -> dict[str, float]:
        """Per phase, the median over the loads after the first, in ms (``round_trips``: the
        median count)."""
        later = self.loads[1:] or self.loads
        return {k: (1 if k == "round_trips" else 1e3) * statistics.median(load[k]
                                                                          for load in later)
                for k in (*self.NAMES, "other", "round_trips")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the consumer's device (and the producer's, by default)")
    parser.add_argument("--serve-device", default=None,
                        help="the producer's device (default: --device), e.g. cuda:0 with "
                             "--device cuda:1")
    parser.add_argument("--connector", choices=("nixl", "mooncake", "p2p"), default="nixl")
    parser.add_argument("--p2p-backend", choices=("auto", "gloo", "nccl", "ipc"),
                        default="auto",
                        help="p2p: both connectors' data_backend (default: %(default)s, ipc "
                             "for two processes on one GPU, NCCL on two, gloo on the CPU)")
    parser.add_argument("--scattered", action="store_true",
                        help="both sides move their blocks under shuffled block ids")
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
    parser.add_argument("--grid", action="store_true",
                        help="run every connector x layout x block ids case (see the module "
                             "docstring)")
    parser.add_argument("--grid-connectors", default="nixl,p2p",
                        help="--grid: the connectors, comma-separated")
    parser.add_argument("--run-timeout", type=float, default=240.0,
                        help="--matrix, --grid: seconds one configuration may take")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--grid: seconds for all cases; those not started in time are "
                             "listed as skipped")
    parser.add_argument("--convert", action="store_true",
                        help="the consumer's cache converts: blocks 4x larger, HND (the "
                             "producer's NHD blocks are rearranged on load)")
    parser.add_argument("--staging-buffers", type=int, choices=(1, 2), default=2,
                        help="--convert, nixl/mooncake: the consumer's staging_buffers (2: the "
                             "READ of a chunk overlaps the previous chunk's gather; 1: in turn) "
                             "(default: %(default)s)")
    parser.add_argument("--staged", action="store_true",
                        help="--convert, nixl/mooncake: READ into the staging buffer even where "
                             "the consumer could gather in place from the producer's mapped "
                             "cache (map_producer=False)")
    parser.add_argument("--staging-mib", type=int, default=None,
                        help="--convert, nixl/mooncake: the consumer's staging_bytes in MiB "
                             "(default: the connector's, 512)")
    parser.add_argument("--gather-only", action="store_true",
                        help="time the conversion's gather kernel alone (--convert's layouts) "
                             "beside a device copy, in this process")
    parser.add_argument("--convert-suite", action="store_true",
                        help="nixl and p2p, same layout and --convert, and --gather-only, each "
                             "in its own processes; the table last")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="--convert-suite: only the cases whose label contains TEXT")
    parser.add_argument("--lookup", action="store_true",
                        help="nixl, mooncake: look each trial's keys up before its load, "
                             "untimed (an engine's scheduler does before it asks for the "
                             "load): the load READs from the blocks the lookup named while "
                             "its fetch is on the way")
    parser.add_argument("--phases", action="store_true",
                        help="nixl, mooncake: time where each load's wall time goes (see the "
                             "module docstring)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the consumer's loads after the first (cProfile: the "
                             "load runs in the waiting thread) into OUT/profile.txt")
    parser.add_argument("--progress-thread", choices=("on", "off"), default=None,
                        help="nixl: both connectors' progress_thread (default: the "
                             "connector's, on for the producer, off for the consumer)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 2:
        parser.error("--trials must be >= 2 (the first load is listed apart)")
    if args.serve_device is None:
        args.serve_device = args.device
    if args.connector != "nixl" and (args.ucx_tls or args.ucx_error_mode or args.matrix
                                     or args.progress_thread):
        parser.error("--ucx-tls, --ucx-error-mode, --progress-thread and --matrix are for "
                     "--connector nixl")
    if (args.phases or args.lookup) and args.connector == "p2p":
        parser.error("--phases and --lookup are for the pull connectors (--connector nixl or "
                     "mooncake)")
    own_device = args.serve_device if args.serve else args.device
    if own_device.startswith("cuda:"):  # this process's GPU is its current device
        torch.cuda.set_device(torch.device(own_device))
    if args.serve:
        return serve(args)
    if args.gather_only:
        return gather_only(args)
    if args.convert_suite:
        return convert_suite(args)
    if args.matrix:
        return matrix(args)
    if args.grid:
        return grid(args)

    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    p2p = args.connector == "p2p"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", *sys.argv[1:]],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env)
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

    def go(trial: int) -> None:  # p2p: the producer sends trial's blocks now
        proc.stdin.write(f"go {trial}\n")
        proc.stdin.flush()

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        line = port_line.get(timeout=300)
        if not line.startswith("port "):
            raise RuntimeError(f"the producer did not start (rc {proc.poll()})")
        port = int(line.split()[1])
        kv = make_cache(args, fill=False, converted=args.convert)
        nbytes = kv.storage.numel() * kv.storage.element_size()
        ids = block_ids(args, kv.num_blocks, "consumer")
        num_keys = kv.num_blocks * (CONVERT_RATIO if args.convert else 1)
        times = []
        if p2p:
            connector = get_connector("p2p", rank=1, port=port, timeout_s=120.0,
                                      connect_timeout_s=120.0, inbox_bytes=inbox_bytes(kv),
                                      data_backend=args.p2p_backend)
        else:
            connector = get_connector(args.connector, role="consumer", port=port,
                                      timeout_s=CONSUMER_TIMEOUT_S,
                                      staging_buffers=args.staging_buffers,
                                      **staging_options(args), **transport_options(args))
        with connector as consumer:
            consumer.register_kv_caches(kv)
            transport = getattr(consumer, "transport", None)  # p2p: the data path agreed
            phases = Phases(consumer) if args.phases else None
            profile = cProfile.Profile() if args.profile else None
            for t in range(args.trials):
                keys = trial_keys(t, num_keys)
                if args.lookup:
                    wait_until = time.monotonic() + 60
                    while consumer.lookup(keys) < len(keys) and time.monotonic() < wait_until:
                        time.sleep(0.001)
                    if phases is not None:
                        phases.forget()  # the lookup is the scheduler's, not the load's
                if profile is not None and t:
                    profile.enable()
                t0 = time.perf_counter()
                if p2p:
                    go(t)
                result = consumer.load(keys, ids).wait(timeout=300)
                if kv.storage.is_cuda:
                    torch.cuda.synchronize(kv.storage.device)
                times.append(time.perf_counter() - t0)
                if profile is not None:
                    profile.disable()
                if phases is not None:
                    phases.end_load(times[-1])
                if not result.ok:
                    raise RuntimeError(f"trial {t}: {len(result.failed)} blocks failed, e.g. "
                                       f"{next(iter(result.failed.values()))}")
            if p2p:
                proc.stdin.close()  # the producer closes its end, then this one closes
    except BaseException:
        proc.kill()  # its saves would wait publish_timeout_s for reads that never come
        raise
    finally:
        if not proc.stdin.closed:  # (the consumer closed: the producer may close now)
            proc.stdin.close()
        proc.wait(timeout=120)
        drainer.join(30)
    served = tagged.get("served", "served ?")
    expected = make_cache(args, fill=True, device=args.serve_device)
    producer_ids = block_ids(args, expected.num_blocks, "producer")
    mismatched = (mismatched_tokens(kv, ids, expected, producer_ids) if args.convert else
                  mismatched_blocks(kv, ids, expected, producer_ids))
    exact = mismatched == 0
    across = expected.storage.device != kv.storage.device
    copies = copy_seconds(expected, args.device, args.trials)
    moved_s, copy_s = statistics.median(times[1:]), statistics.median(copies[1:])
    name = args.connector
    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "layout": str(kv.layout), "bytes": nbytes, "blocks": kv.num_blocks,
        "block_bytes": nbytes // kv.num_blocks, "trials": args.trials,
        f"{name}_first_gbps": nbytes / times[0] / 1e9, f"{name}_gbps": nbytes / moved_s / 1e9,
        "copy_gbps": nbytes / copy_s / 1e9, "fraction_of_copy": copy_s / moved_s,
        "bit_exact": exact, "producer": served,
        "connector": name, "first_gbps": nbytes / times[0] / 1e9, "gbps": nbytes / moved_s / 1e9,
        "producer_device": args.serve_device, "consumer_device": args.device,
        "copy": "across devices" if across else "same device",
        "scattered": args.scattered, "consumer_runs": count_runs(ids),
        "producer_runs": count_runs(producer_ids), "mismatched_blocks": mismatched,
        "converted": args.convert, "progress_thread": args.progress_thread,
        "transport": transport, "looked_up_first": args.lookup,
        "converts_in_place": getattr(consumer, "converts_in_place", None),
    }
    if args.convert:
        record["layout"] = f"{expected.layout} -> {kv.layout}"
    if phases is not None:
        record["phases_ms"] = phases.medians_ms()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if profile is not None:
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(30)
        (Path(args.out) / "profile.txt").write_text(
            f"{args.trials - 1} loads, {nbytes} bytes each\n{text.getvalue()}")
    (Path(args.out) / "bench_nixl.json").write_text(json.dumps(record, indent=2))
    what = ((f"{name} gather in place" if record["converts_in_place"] else f"{name} READ")
            if name in ("nixl", "mooncake") else f"p2p send/receive ({transport})")
    print(f"{what} between two processes, {record['device']}, layout {record['layout']}, "
          f"{nbytes / 2**20:.0f} MiB in {kv.num_blocks} blocks of "
          f"{record['block_bytes'] / 1024:.0f} KiB")
    if across or args.scattered:
        print(f"  producer {args.serve_device} -> consumer {args.device}; block ids "
              f"{'scattered' if args.scattered else 'contiguous'} ({record['producer_runs']} "
              f"runs -> {record['consumer_runs']} runs)")
    print(f"  {name} load:  {record['gbps']:8.2f} GB/s (median of {args.trials - 1}; first "
          f"load {record['first_gbps']:.2f} GB/s)")
    where = (f"{args.serve_device} -> {args.device}, one process" if across else "one process")
    print(f"  plain copy: {record['copy_gbps']:8.2f} GB/s (same bytes, {where})")
    print(f"  ratio:      {record['fraction_of_copy']:8.2f}   bit-exact: {exact}   "
          f"producer: {served}")
    if phases is not None:
        print("  per load (ms, median): " + ", ".join(
            f"round trips {v:g}" if k == "round_trips" else f"{k} {v:.3f}"
            for k, v in record["phases_ms"].items()))
    if not exact:
        print(f"  {mismatched} {'tokens' if args.convert else f'of {kv.num_blocks} blocks'} "
              "differ")
    return 0 if exact and served == "served True" else 1


if __name__ == "__main__":
    sys.exit(main())
