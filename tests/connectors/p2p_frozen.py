"""Rank 0 of the frozen-peer test, run as ``python p2p_frozen.py SCENARIO [DATA_BACKEND]``:
starts a ``p2p_peer.py idle`` peer (both with that ``data_backend``, ``auto`` by default),
registers with it, freezes it with SIGSTOP, then

    send: saves blocks larger than the socket buffers (the send times out), then closes;
    idle: closes (the peer never answers the bye).

Prints one JSON line (the peer's pid, the save's failures, how long close took, the
connector threads still alive after close), kills the peer and exits, so that anything
close() left behind meets the interpreter's exit. (The parent kills the peer too if this
process fails first.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kv_helpers import keys_for, make_caches

from kvcore.connectors import get_connector

#: Blocks of 48 KiB: one save of all of them is 24 MiB, more than loopback socket buffers hold.
SIZES = {"num_blocks": 512, "head_size": 512}
TIMEOUT_S = 1.0
#: The connector stays referenced until the interpreter exits, as an engine's would.
KEPT = []


def main() -> int:
    scenario = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "auto"
    kv = make_caches(cross_layer=False, **SIZES)
    conn = get_connector("p2p", rank=0, timeout_s=TIMEOUT_S, connect_timeout_s=60.0,
                         data_backend=backend)
    KEPT.append(conn)
    # Not our stderr: the parent reads our output to its end, which a frozen peer holding it
    # open would delay until the peer is killed.
    peer = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("p2p_peer.py")), "idle", str(conn.port),
         "1", "nhd", "0", "bf16", "cpu", json.dumps(SIZES),
         json.dumps({"data_backend": backend})],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    report: dict = {"peer_pid": peer.pid}
    print(json.dumps(report), flush=True)  # the parent can kill the peer whatever happens
    conn.register_kv_caches(kv)
    assert peer.stdout.readline().strip() == "ok"
    os.kill(peer.pid, signal.SIGSTOP)
    if scenario == "send":
        blocks = list(range(SIZES["num_blocks"]))
        result = conn.save(keys_for(random.randrange(2**31), len(blocks)), blocks).wait(60)
        report["failed"] = len(result.failed)
        report["reason"] = next(iter(result.failed.values()), "")
    start = time.monotonic()
    conn.close()
    report["close_s"] = time.monotonic() - start
    report["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("kvcore")]
    print(json.dumps(report), flush=True)
    # The frozen peer dies as this process exits (its supervisor kills it): a receive still
    # waiting on it fails in the middle of the interpreter's shutdown, which used to abort.
    os.kill(peer.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
