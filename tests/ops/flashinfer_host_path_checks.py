"""Checks of FLASHINFER's layer call on the host, run in a process of its own (compiled Triton
kernels, not the interpreter the test session uses) with ``benchmarks/host_path.py``'s
stand-in driver and stand-in FlashInfer (wrappers that plan and run nothing, the cache write on
kvcore's Triton launch path); prints one JSON object with what it found
(``test_flashinfer_host_path.py`` asserts on it; it needs the kvcore-nvidia plugin)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from host_path import Layer, _FlashInferWrapper, fake_flashinfer, fake_gpu  # noqa: E402
from host_path_checks import Dispatched, allocations  # noqa: E402
from kvcore_nvidia.backends import common, flashinfer  # noqa: E402

from kvcore.ops import triton_cache  # noqa: E402

NAMES = ("write + forward", "update_and_forward")


def counting(owner: object, name: str, counts: dict[str, int]) -> None:
    """Count the calls of ``owner.name`` (a function or method) in ``counts[name]``."""
    fn = getattr(owner, name)
    counts[name] = 0

    def counted(*args: object, **kwargs: object) -> object:
        counts[name] += 1
        return fn(*args, **kwargs)

    setattr(owner, name, counted)


def rounds(layer: Layer, n: int, counted: dict[str, int]) -> dict:
    """``n`` rounds of a layer's calls on the step last built: what they counted (full
    checks and signatures) and the torch ops they dispatched."""
    calls = layer.calls()
    counted.update(dict.fromkeys(counted, 0))
    with Dispatched() as mode:
        for _ in range(n):
            for name in NAMES:
                calls[name]()
    found = dict(counts=dict(counted), ops=sorted(set(mode.ops)))
    counted.update(dict.fromkeys(counted, 0))
    return found


def main() -> None:
    result: dict = {}
    with fake_gpu(), fake_flashinfer():
        layer = Layer(backend="FLASHINFER")
        for fn in layer.calls().values():  # first calls: the full checks, compiles
            fn()
        counted: dict[str, int] = {}
        counting(common, "validate_paged_attention", counted)  # the layer's full check
        counting(triton_cache, "_write_key", counted)  # the write's full signature
        counting(flashinfer.FlashInferImpl, "_checked_attend", counted)
        counting(_FlashInferWrapper, "run", counted)  # FlashInfer's argument work
        # Steady state: the impl hands back the cache views it made, the write finds its
        # checks by them, attend takes the short path: no torch op dispatched.
        result["steady"] = rounds(layer, 100, counted)
        layer.meta = layer.builder.build(layer.common)  # a new step: the same
        result["steady_next_step"] = rounds(layer, 100, counted)
        # A new cache object for the layer (an engine that reallocated): split once, checked
        # in full once (the write's signature and the layer's checks), then short again.
        kv = layer.caches.layers[0]
        layer.caches.layers[0] = torch.empty_like(kv).copy_(kv)
        result["new_cache"] = rounds(layer, 100, counted)
        # The same cache object changed in place (another shape): checked in full again.
        shrunk = layer.caches.layers[0]
        shrunk.set_(shrunk.untyped_storage(), 0, (shrunk.shape[0] - 1, *shrunk.shape[1:]),
                    shrunk.stride())
        result["changed_cache"] = rounds(layer, 1, counted)

        result["allocated"] = allocations(layer.calls(), NAMES, layer.q)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
