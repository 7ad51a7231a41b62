#!/usr/bin/env python3
"""Where the time of a same-layout ``nixl`` READ between two processes goes, in one run.

Each case runs in its own processes (UCX reads its settings once per process) under a
per-case timeout, the whole under ``--budget-s`` (cases not started in time are listed as
skipped); the table is printed last and written, with every case's log, under ``--out``.

``raw`` cases (one per UCX setting of :data:`RAW_CASES`): a producer process (spawned by the
case) fills ``--mib`` MiB on ``--device``, registers it with its own NIXL agent and hands this
process its agent metadata and a copy of the bytes in another allocation (torch's CUDA
IPC). The case then times, in this process, median of ``--trials`` after the first:

- ``copy local``: ``dst.copy_(src)`` of the same bytes within this process (the ceiling);
- ``copy ipc``: ``dst.copy_(the producer's tensor)`` opened through CUDA IPC (what cuda_ipc
  does, without UCX);
- NIXL READs of the whole buffer with the descriptors ``one`` (one descriptor),
  ``blocks 2M`` (one per cross-layer block of 2 MiB), ``blocks 64K`` (one per block of 64 KiB,
  a per-layer block), and ``merged 64K`` (a prepared list of 64 KiB descriptors, the request
  asking for all of them: NIXL merges contiguous ones). ``prepped`` rows prepare the lists and
  the request once and time post -> ``DONE`` (polled without pause); ``init`` rows build the
  descriptors and the request every time (``initialize_xfer``, as the connector does) and
  include that; ``init+notif`` adds the connector's notification; ``init+notif+backoff``
  polls with the connector's pauses (``kvcore.connectors.pull.poll_pause``) instead of at once.

Every READ row is checked bit-exact against the producer's bytes (the destination is zeroed
before each row). The first case also logs UCX's protocol choice (``UCX_PROTO_INFO=y``); the
lines naming transports are printed and kept in the JSON.

``connector`` cases run ``bench_nixl.py`` (same layout with ``--phases``: the connector's
load split into channel (and its round trips) / start_read / poll / release / pause /
prepare / gather / wait (the last three: a converting load's gathers) / other,
and again with ``--progress-thread on``: NIXL's progress thread on in the consumer too, off
by default; ``--convert``: 16 -> 64 tokens a block with NHD -> HND) for ``nixl`` and ``p2p``
(both processes on one GPU: its ``ipc`` data path, staging slots mapped through CUDA IPC),
and the conversion's gather alone.

Usage: ``python benchmarks/nixl_diagnose.py [--device cuda] [--mib 1024] [--trials 6]
[--budget-s 240] [--case-timeout 60] [--only TEXT] [--out DIR]``; on the CPU (DRAM, to check
the script): ``--device cpu --mib 16``. Set ``NIXL_LOG_LEVEL=WARN`` to quiet NIXL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SEED = 1234
#: One READ that has not finished after this long is abandoned (the row says so).
READ_LIMIT_S = 20.0

#: ``raw`` cases: (name, extra environment, agent options). The connector's CUDA default
#: (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``) applies to all unless a case sets it.
RAW_CASES = (
    ("raw default", {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}, {}),
    ("raw tls=cuda_ipc,cuda_copy,tcp", {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}, {}),
    ("raw no progress thread", {}, {"progress_thread": False}),
    ("raw tls=cuda_ipc,cuda_copy,sm,self err=none", {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"},
     {"error_mode": "none"}),
    ("raw cuda_ipc streams=1", {"UCX_CUDA_IPC_MAX_STREAMS": "1"}, {}),
    ("raw rndv thresh=0 get_zcopy", {"UCX_RNDV_THRESH": "0", "UCX_RNDV_SCHEME": "get_zcopy"},
     {}),
)
#: ``connector`` cases: (name, bench_nixl.py arguments), in the order they run.
CONNECTOR_CASES = (
    ("nixl same layout", ["--connector", "nixl", "--phases"]),
    ("nixl same layout, progress thread on", ["--connector", "nixl", "--phases",
                                              "--progress-thread", "on"]),
    ("nixl 16->64 NHD->HND", ["--connector", "nixl", "--convert", "--phases"]),
    ("p2p same layout", ["--connector", "p2p"]),
    ("p2p 16->64 NHD->HND", ["--connector", "p2p", "--convert"]),
    ("gather kernel alone", ["--gather-only"]),
)
#: The order cases run in: what answers the question first.
ORDER = ("raw default", "nixl same layout", "nixl same layout, progress thread on",
         "nixl 16->64 NHD->HND", "p2p same layout", "p2p 16->64 NHD->HND",
         "raw tls=cuda_ipc,cuda_copy,tcp", "raw no progress thread", "gather kernel alone",
         "raw tls=cuda_ipc,cuda_copy,sm,self err=none", "raw cuda_ipc streams=1",
         "raw rndv thresh=0 get_zcopy")
#: Words in UCX's log that name a transport or protocol choice.
PROTO_WORDS = ("cuda", "read by", "tcp", "posix", "sysv", "cma", "rc_", "dc_", "zcopy",
               "bcopy", "get ", "self/")


# -- the raw case: two NIXL agents, no connector ---------------------------------------------


def _agent(name: str, options: dict):
    from kvcore.connectors.nixl import _nixl_api

    api = _nixl_api()
    config = api.nixl_agent_config(enable_prog_thread=options.get("progress_thread", True),
                                   backends=[], capture_telemetry=True)
    agent = api.nixl_agent(name, config)
    params = {"ucx_error_handling_mode": options["error_mode"]} if "error_mode" in options \
        else {}
    agent.create_backend("UCX", params)
    return agent


def _fill(nbytes: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(SEED)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _producer(device: str, nbytes: int, options: dict, conn) -> None:
    """The producer: its buffer registered with its agent; answers with its metadata and the
    tensor, then progresses its agent (notifications) until told to stop."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" names device 0
    src = _fill(nbytes, device)
    # The consumer opens a copy in its own allocation through torch's IPC: UCX maps src, and
    # one process may not open the same CUDA IPC handle twice.
    twin = src.clone()
    if src.is_cuda:
        torch.cuda.synchronize()
    else:
        twin.share_memory_()
    agent = _agent("diag-producer", options)
    mem = "VRAM" if src.is_cuda else "DRAM"
    reg = agent.register_memory([(src.data_ptr(), nbytes, src.device.index or 0, "")], mem)
    conn.send({"metadata": agent.get_agent_metadata(), "addr": src.data_ptr(), "tensor": twin})
    notifs = 0
    while not conn.poll(0.001):
        notifs += sum(len(v) for v in agent.get_new_notifs().values())
    conn.recv()
    conn.send({"notifications": notifs})
    agent.deregister_memory(reg)


def _descs(addr: int, nbytes: int, piece: int, dev: int):
    import numpy as np

    count = nbytes // piece
    out = np.empty((count, 3), dtype=np.int64)
    out[:, 0] = addr + np.arange(count, dtype=np.int64) * piece
    out[:, 1], out[:, 2] = piece, dev
    return out


def _wait(agent, handle, backoff: bool) -> str:
    """Poll until the READ is no longer in flight: at once, or with the connector's pauses."""
    from kvcore.connectors.pull import poll_pause

    started = time.monotonic()
    while True:
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            return state
        now = time.monotonic()
        if now - started > READ_LIMIT_S:
            return f"not done after {READ_LIMIT_S} s"
        if backoff:
            time.sleep(poll_pause(now - started))


def raw_case(args: argparse.Namespace, options: dict) -> int:
    import torch.multiprocessing as mp

    device, nbytes = args.device, args.mib << 20
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" names device 0
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_producer, args=(device, nbytes, options, there), daemon=True)
    child.start()
    hello = here.recv()
    src_ipc = hello["tensor"]
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    local_src = src_ipc.clone()
    agent = _agent("diag-consumer", options)
    mem, dev = ("VRAM", dst.device.index or 0) if cuda else ("DRAM", 0)
    reg = agent.register_memory([(dst.data_ptr(), nbytes, dev, "")], mem)
    remote = agent.add_remote_agent(hello["metadata"])
    remote = remote.decode() if isinstance(remote, bytes) else remote
    agent.make_connection(remote)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows: list[dict] = []

    def timed(label: str, one, check: bool = True, **extra) -> None:
        if check:
            dst.zero_()
        sync()
        times, why = [], None
        for _ in range(args.trials):
            t0 = time.perf_counter()
            why = one()
            sync()
            times.append(time.perf_counter() - t0)
            if why:
                break
        row = {"variant": label, **extra, "trials": len(times)}
        if len(times) >= 2 and not why:
            row["seconds"] = statistics.median(times[1:])
            row["gbps"] = nbytes / row["seconds"] / 1e9
            row["first_gbps"] = nbytes / times[0] / 1e9
        if why:
            row["error"] = str(why)
        if check:
            row["bit_exact"] = bool(torch.equal(dst, src_ipc))
        rows.append(row)
        print(f"  {label:36} " + (f"{row['gbps']:9.2f} GB/s" if "gbps" in row else
                                  f"failed: {row.get('error')}") +
              (f"  bit-exact {row['bit_exact']}" if check else ""), flush=True)

    copy_dst = torch.empty_like(dst)

    def copy(into: torch.Tensor, source: torch.Tensor) -> None:
        into.copy_(source)

    timed("copy local", lambda: copy(copy_dst, local_src), check=False, descs=0)
    timed("copy ipc", lambda: copy(dst, src_ipc), descs=0)

    pieces = (("one", nbytes), ("blocks 2M", 2 << 20), ("blocks 64K", 64 << 10))
    for name, piece in pieces:
        piece = min(piece, nbytes)
        local = _descs(dst.data_ptr(), nbytes, piece, dev)
        remote_descs = _descs(hello["addr"], nbytes, piece, dev)
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
        remote_h = agent.prep_xfer_dlist(remote, remote_descs, mem)
        indices = list(range(len(local)))
        for merged in ((False, True) if name == "blocks 64K" else (False,)):
            handle = agent.make_prepped_xfer("READ", local_h, indices, remote_h, indices,
                                             b"", skip_desc_merge=not merged)

            def post(handle=handle) -> str | None:
                if agent.transfer(handle) == "ERR":
                    return "transfer() returned ERR (a finished request not reposted?)"
                state = _wait(agent, handle, backoff=False)
                return None if state == "DONE" else state

            label = f"prepped {'merged 64K' if merged else name}"
            timed(label, post, descs=len(local))
            try:
                tel = agent.get_xfer_telemetry(handle)
                rows[-1]["telemetry_us"] = {"post": tel.postDuration, "xfer": tel.xferDuration,
                                            "descs": tel.descCount}
            except Exception as exc:  # telemetry is optional in NIXL builds
                rows[-1]["telemetry_us"] = f"unavailable: {exc}"
            agent.release_xfer_handle(handle)
        agent.release_dlist_handle(local_h)
        agent.release_dlist_handle(remote_h)

        for notif, backoff in ((False, False), (True, False), (True, True)):
            if name != "one" and (notif or backoff):
                continue  # the connector's variants once, on its own descriptors

            def init(notif=notif, backoff=backoff, piece=piece) -> str | None:
                ld = agent.get_xfer_descs(
                    [(dst.data_ptr() + i * piece, piece, dev) for i in range(nbytes // piece)],
                    mem)
                rd = agent.get_xfer_descs(
                    [(hello["addr"] + i * piece, piece, dev) for i in range(nbytes // piece)],
                    mem)
                handle = agent.initialize_xfer("READ", ld, rd, remote,
                                               b"diag:0:1" if notif else b"")
                try:
                    if agent.transfer(handle) == "ERR":
                        return "transfer() returned ERR"
                    state = _wait(agent, handle, backoff)
                    return None if state == "DONE" else state
                finally:
                    agent.release_xfer_handle(handle)

            label = (f"init {name}" + ("+notif" if notif else "") +
                     ("+backoff" if backoff else ""))
            timed(label, init, descs=nbytes // piece)

    here.send("stop")
    producer = here.recv() if here.poll(30) else {}
    child.join(30)
    agent.deregister_memory(reg)
    copy_s = next(r["seconds"] for r in rows if r["variant"] == "copy local")
    for r in rows:
        if "seconds" in r:
            r["fraction_of_copy"] = copy_s / r["seconds"]
    record = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "bytes": nbytes,
              "trials": args.trials, "options": options, "rows": rows,
              "producer_notifications": producer.get("notifications")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "raw.json").write_text(json.dumps(record, indent=2))
    bad = [r["variant"] for r in rows if r.get("bit_exact") is False or "error" in r]
    return 1 if bad else 0


# -- the orchestrator ------------------------------------------------------------------------


def _run(cmd: list[str], env: dict, limit: float) -> tuple[str, int | None]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # a case past its time goes whole
    try:
        return proc.communicate(timeout=limit)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return f"{proc.communicate()[0]}\nTIMED OUT after {limit:.0f} s", None


def orchestrate(args: argparse.Namespace) -> int:
    from kvcore.connectors.nixl import UCX_DEFAULTS, nixl_unavailable_reason

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = {name: (env, options) for name, env, options in RAW_CASES}
    connector = dict(CONNECTOR_CASES)
    deadline = time.monotonic() + args.budget_s
    missing = nixl_unavailable_reason()
    cases = []
    for name in ORDER:
        if args.only and args.only not in name:
            continue
        case: dict = {"case": name}
        cases.append(case)
        left = deadline - time.monotonic()
        needs_nixl = name in raw or "nixl" in name
        if needs_nixl and missing:
            case["skipped"] = missing
        elif left < 5:
            case["skipped"] = f"--budget-s {args.budget_s} spent before this case"
        if "skipped" in case:
            print(f"== {name}: skipped: {case['skipped'][:100]}", flush=True)
            continue
        slug = "".join(c if c.isalnum() else "_" for c in name)
        env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
        common = ["--device", args.device, "--mib", str(args.mib), "--trials",
                  str(args.trials), "--out", str(out / slug)]
        if name in raw:
            extra_env, options = raw[name]
            if args.device.startswith("cuda"):
                env.update((k, v) for k, v in UCX_DEFAULTS.items() if k not in os.environ)
            env.update(extra_env)
            cmd = [sys.executable, __file__, "--case-raw", json.dumps(options), *common]
        else:
            cmd = [sys.executable, str(HERE / "bench_nixl.py"), *connector[name], *common]
            if args.device == "cpu":  # the CPU check: a cache of two layers
                cmd += ["--layers", "2"]
        started = time.perf_counter()
        log, rc = _run(cmd, env, min(args.case_timeout, left))
        case.update(rc=rc, seconds=time.perf_counter() - started)
        (out / f"{slug}.log").write_text(log)
        print(f"== {name}: rc {rc}, {case['seconds']:.0f} s", flush=True)
        if name in raw:
            result = out / slug / "raw.json"
            if result.exists():
                case.update(json.loads(result.read_text()))
            # UCX's protocol tables: those of reads and of CUDA memory first.
            proto = sorted({line.split("]", 1)[-1].strip()[:200] for line in log.splitlines()
                            if "|" in line and any(w in line for w in PROTO_WORDS)},
                           key=lambda line: ("cuda" not in line, "read" not in line
                                             and "get" not in line, line))
            if proto:
                case["proto_lines"] = proto[:120]
                print("   UCX protocol lines (CUDA and reads first, 30 of "
                      f"{len(proto)}):")
                print("\n".join(f"   {line}" for line in proto[:30]))
            print("\n".join(f"   {line}" for line in log.strip().splitlines()
                            if line.startswith("  ")))
        else:
            result = out / slug / "bench_nixl.json"
            if result.exists():
                case.update(json.loads(result.read_text()))
            print("\n".join(f"   {line}" for line in log.strip().splitlines()[-6:]))
        if rc != 0 and "rows" not in case and "gbps" not in case:
            print("\n".join(f"   {line}" for line in log.strip().splitlines()[-15:]))
    same = {c.get("connector"): c.get("gbps") for c in cases
            if c["case"].endswith("same layout")}
    for c in cases:
        base = same.get(c.get("connector"))
        if "16->64" in c["case"] and isinstance(base, float) and isinstance(c.get("gbps"),
                                                                             float):
            c["fraction_of_same_layout"] = c["gbps"] / base
    (out / "nixl_diagnose.json").write_text(json.dumps(cases, indent=2))
    print_table(args, cases)
    ran = [c for c in cases if "skipped" not in c]
    budget_cut = any("--budget-s" in c.get("skipped", "") for c in cases)
    return 0 if ran and not budget_cut and all(c["rc"] == 0 for c in ran) else 1


def print_table(args: argparse.Namespace, cases: list[dict]) -> None:
    def num(v, fmt: str) -> str:
        width = int(fmt.split(".")[0].rstrip("df") or 0)
        return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)

    device = next((c["device"] for c in cases if "device" in c), args.device)
    print(f"\nnixl READ diagnosis, {args.mib} MiB, {device}, two processes, median of "
          f"{args.trials - 1} after the first; 'of copy' = of dst.copy_(src) in one process, "
          "same case")
    print(f"{'case':44} {'row':28} {'descs':>6} {'GB/s':>9} {'first':>8} {'of copy':>8} "
          f"{'exact':>6}")
    for c in cases:
        if "skipped" in c:
            print(f"{c['case']:44} skipped: {c['skipped'][:70]}")
            continue
        for r in c.get("rows", []):
            print(f"{c['case']:44} {r['variant']:28} {num(r.get('descs'), '6d')} "
                  f"{num(r.get('gbps'), '9.2f')} {num(r.get('first_gbps'), '8.2f')} "
                  f"{num(r.get('fraction_of_copy'), '8.3f')} {r.get('bit_exact', '-')!s:>6}"
                  + (f"  {r['error'][:40]}" if "error" in r else ""))
        if "gbps" in c:
            of_same = c.get("fraction_of_same_layout")
            print(f"{c['case']:44} {'connector load':28} {'':>6} {num(c['gbps'], '9.2f')} "
                  f"{num(c.get('first_gbps'), '8.2f')} {num(c.get('fraction_of_copy'), '8.3f')} "
                  f"{c.get('bit_exact')!s:>6}"
                  + (f"  of same layout {of_same:.3f}" if of_same is not None else ""))
            if "phases_ms" in c:
                print(f"{'':44}   per load ms: " + ", ".join(
                    f"round trips {v:g}" if k == "round_trips" else f"{k} {v:.3f}"
                    for k, v in c["phases_ms"].items()))
        if "rows" not in c and "gbps" not in c:
            print(f"{c['case']:44} failed: rc {c.get('rc')} (see its log)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="seconds for all cases; those not started in time are skipped")
    parser.add_argument("--case-timeout", type=float, default=60.0,
                        help="seconds one case may take")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="only the cases whose name contains TEXT")
    parser.add_argument("--out", default=str(Path(os.environ.get("OUT") or
                                                  tempfile.gettempdir()) / "nixl_diagnose"))
    parser.add_argument("--case-raw", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 2:
        parser.error("--trials must be >= 2 (the first is listed apart)")
    if args.mib < 2:
        parser.error("--mib must be >= 2 (the 2 MiB descriptors of a cross-layer block)")
    if args.case_raw is not None:
        return raw_case(args, json.loads(args.case_raw))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
