#!/usr/bin/env python3
"""Where a pull connector's load spends the time its phases do not name: ``bench_nixl.py``'s
consumer run with four stages timed around it, each a median over the loads after the second,
in ms:

- ``load_call``: ``KVConnector.load`` (the keys' and ids' checks, queueing the load);
- ``read_blocks``: the load itself (``PullConnector._read_blocks_from_producer``: the phases
  ``--phases`` lists, and the Python between them);
- ``wait_call``: ``TransferHandle.wait`` (the load, run in the waiting thread, and its result);
- ``sync``: the benchmark's ``torch.cuda.synchronize`` after the load.

``wait_call`` less ``read_blocks`` is the hand-off and the result; ``read_blocks`` less the
phases is Python in the load. Every argument goes to ``bench_nixl.py``.

Usage: ``python benchmarks/nixl_load_stages.py --device cuda --mib 1024 --trials 12 --lookup
--phases``
"""

from __future__ import annotations

import atexit
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvcore.connectors import base, pull

STAGES: dict[str, list[float]] = {"load_call": [], "read_blocks": [], "wait_call": [],
                                  "sync": []}


def timed(stage: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STAGES[stage].append(time.perf_counter() - started)
    return call


def report() -> None:
    medians = {k: round(statistics.median(v[2:]) * 1e3, 3) for k, v in STAGES.items()
               if len(v) > 2}
    print(f"load stages (ms, median of the loads after the second): {medians}")


if __name__ == "__main__":
    base.KVConnector.load = timed("load_call", base.KVConnector.load)
    base.TransferHandle.wait = timed("wait_call", base.TransferHandle.wait)
    pull.PullConnector._read_blocks_from_producer = timed(
        "read_blocks", pull.PullConnector._read_blocks_from_producer)
    torch.cuda.synchronize = timed("sync", torch.cuda.synchronize)
    atexit.register(report)
    sys.argv = ["bench_nixl.py", *sys.argv[1:]]
    runpy.run_path(str(Path(__file__).with_name("bench_nixl.py")), run_name="__main__")
