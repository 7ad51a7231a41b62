"""Rank 1 of the two-process p2p tests, run as ``python p2p_peer.py SCENARIO PORT SEED LAYOUT
CROSS DTYPE [DEVICE [SIZES [OPTIONS]]]`` (the cache's device, ``cpu`` by default: blocks then
go over gloo; on a CUDA device over NCCL; SIZES a JSON dict of cache sizes that replace
``kv_helpers.SIZES``'s; OPTIONS a JSON dict of connector options, e.g. ``data_backend``).

Scenarios:
    echo LAYOUT CROSS DTYPE: send blocks 3, 7 of its own cache (random from SEED) under keys
        ``keys_for(SEED + 1, 2)``; load the parent's two blocks (keys ``keys_for(SEED, 2)``)
        into blocks 0, 5 (block 0 alone when its blocks hold both of the parent's) and send
        those back under ``keys_for(SEED + 2, n)``, one key a block; close.
    mismatch LAYOUT CROSS DTYPE: register; print the LayoutMismatchError; exit 3.
    idle LAYOUT CROSS DTYPE: register and wait to be killed.

Prints one line ``ok`` or ``mismatch: <message>`` for the parent to read.
"""

from __future__ import annotations

import json
import sys
import time

from kv_helpers import keys_for, make_caches

from kvcore import LayoutMismatchError
from kvcore.connectors import get_connector


def main() -> int:
    scenario, port, seed, layout, cross, dtype = sys.argv[1:7]
    device = sys.argv[7] if len(sys.argv) > 7 else "cpu"
    sizes = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}
    options = {"timeout_s": 10.0, "connect_timeout_s": 20.0,
               **(json.loads(sys.argv[9]) if len(sys.argv) > 9 else {})}
    seed = int(seed)
    kv = make_caches(cross_layer=cross == "1", dtype=dtype, layout=layout, seed=seed,
                     device=device, **sizes)
    conn = get_connector("p2p", rank=1, port=int(port), **options)
    try:
        conn.register_kv_caches(kv)
    except LayoutMismatchError as exc:
        print(f"mismatch: {exc}", flush=True)
        conn.close()
        return 3
    if scenario == "idle":
        print("ok", flush=True)
        time.sleep(120)  # the parent kills this process
        return 1
    with conn:
        assert conn.save(keys_for(seed + 1, 2), [3, 7]).wait(timeout=10).ok
        ids = [0, 5][:conn.blocks_for_keys(2)]
        loaded = conn.load(keys_for(seed, 2), ids).wait(timeout=10)
        assert loaded.ok, loaded.failed
        assert conn.save(keys_for(seed + 2, len(ids)), ids).wait(timeout=10).ok
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
