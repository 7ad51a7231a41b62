"""The producer side of the two-process ``nixl`` tests, run as ``python nixl_peer.py SCENARIO
SEED LAYOUT CROSS DTYPE [DEVICE]``. It prints ``port <n>`` once it listens, then one line
per event for the parent to read.

Scenarios:
    serve: publish blocks 3, 4, 5, 9 of its cache (random from SEED) under ``keys_for(SEED,
        4)``; wait for the save; print ``saved <ok> <succeeded> <failed>``; wait for stdin
        to close.
    partial: publish blocks 3, 4 under the first two of ``keys_for(SEED, 4)``; wait until a
        consumer read them; print ``served``; then wait to be killed (the last two keys are
        never published).
"""

from __future__ import annotations

import sys

from kv_helpers import keys_for, make_caches

from kvcore.connectors import get_connector


def main() -> int:
    scenario, seed, layout, cross, dtype = sys.argv[1:6]
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    seed = int(seed)
    kv = make_caches(cross_layer=cross == "1", dtype=dtype, layout=layout, seed=seed,
                     device=device, num_blocks=12)
    conn = get_connector("nixl", role="producer", port=0, publish_timeout_s=30.0)
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
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
