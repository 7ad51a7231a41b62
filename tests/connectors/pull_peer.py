"""The producer side of the two-process tests of the pull connectors (``nixl``,
``mooncake``), run as ``python pull_peer.py CONNECTOR SCENARIO SEED LAYOUT CROSS DTYPE
[DEVICE]``. It prints ``port <n>`` once it listens, then one line per event for the parent to
read.

Scenarios:
    serve: publish blocks 3, 4, 5, 9 of its cache (random from SEED) under ``keys_for(SEED,
        4)``; wait for the save; print ``saved <ok> <succeeded> <failed>``; wait for stdin
        to close.
    partial: publish blocks 3, 4 under the first two of ``keys_for(SEED, 4)``; wait until a
        consumer read them; print ``served``; then wait to be killed (the last two keys are
        never published).
    large: a cache of :data:`LARGE` (8 MiB blocks); publish blocks 0..3 under
        ``keys_for(SEED, 4)``; wait to be killed (mid-READ).
"""

from __future__ import annotations

import sys

from kv_helpers import keys_for, make_caches

from kvcore.connectors import get_connector

#: Sizes of the ``large`` scenario: 4 blocks of 8 MiB (2 layers of 4 MiB pages in bf16), so a
#: READ of them takes long enough to be cut by a kill.
LARGE = {"num_layers": 2, "num_blocks": 4, "block_size": 1024, "num_kv_heads": 8,
         "head_size": 128}


def main() -> int:
    name, scenario, seed, layout, cross, dtype = sys.argv[1:7]
    device = sys.argv[7] if len(sys.argv) > 7 else "cpu"
    seed = int(seed)
    sizes = LARGE if scenario == "large" else {"num_blocks": 12}
    kv = make_caches(cross_layer=cross == "1", dtype=dtype, layout=layout, seed=seed,
                     device=device, **sizes)
    conn = get_connector(name, role="producer", port=0, publish_timeout_s=30.0)
    conn.register_kv_caches(kv)
    print(f"port {conn.port}", flush=True)
    keys = keys_for(seed, 4)
    if scenario == "serve":
        result = conn.save(keys, [3, 4, 5, 9]).wait(timeout=60)
        print(f"saved {result.ok} {len(result.succeeded)} {len(result.failed)}", flush=True)
        sys.stdin.read()  # the parent closes stdin when it is done
    elif scenario == "partial":
        assert conn.save(keys[:2], [3, 4]).wait(timeout=60).ok
        print("served", flush=True)
        sys.stdin.read()  # killed before this returns
    elif scenario == "large":
        conn.save(keys, [0, 1, 2, 3])
        sys.stdin.read()  # killed before this returns
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
