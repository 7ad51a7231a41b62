"""Saves to a small full file system, run as ``python storage_full_disk.py ROOT`` with ROOT a
fresh mount that holds only a few block files (the test mounts a tmpfs there).

Saves more blocks than fit, then loads back what the save reported saved, and prints one JSON
line: the save's succeeded and failed blocks, the stats, the files left under ROOT and whether
the loaded blocks are bit-exact.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from kv_helpers import block_bytes, keys_for, make_caches

from kvcore.connectors import get_connector

#: Blocks of 48 KiB (3 layers of 16 KiB pages).
SIZES = {"num_blocks": 24, "head_size": 512}


def main() -> int:
    root = Path(sys.argv[1])
    kv = make_caches(cross_layer=True, **SIZES)
    keys = keys_for(random.randrange(2**31), 12)
    with get_connector("storage", root=root) as conn:
        conn.register_kv_caches(kv)
        saved = conn.save(keys, list(range(12))).wait(timeout=60)
        ok = [keys[b] for b in saved.succeeded]
        loaded = conn.load(ok, [12 + i for i in range(len(ok))]).wait(timeout=60)
        exact = torch.equal(block_bytes(kv, list(saved.succeeded)),
                            block_bytes(kv, [12 + i for i in range(len(ok))]))
        report = {
            "succeeded": list(saved.succeeded),
            "failed": {str(b): why for b, why in saved.failed.items()},
            "num_bytes": saved.num_bytes,
            "block_bytes": conn.block_bytes,
            "stats": {k: conn.stats.to_dict()[k] for k in ("saved_blocks", "failed_blocks")},
            "files": sorted(p.name for p in root.rglob("*") if p.is_file()),
            "keys": keys,
            "loaded_ok": loaded.ok,
            "exact": exact,
        }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
