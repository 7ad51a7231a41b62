#!/usr/bin/env python3
"""Host time of TRITON_ATTN's and FLASHINFER's layer calls on a machine without a GPU.

Triton's real launch path (argument binding, specialisation, cache look-up, kvcore's own
checks and launch code) runs with a stand-in driver whose compiled kernels do nothing, so only
the host's work is timed.

:func:`fake_gpu` installs the stand-in: a driver that reports an sm_90 device on stream 0, and
a compile step that returns a kernel whose launch does nothing (counted in :data:`COUNTS`).
The tensors stay on the CPU; nothing is compiled or run. Tests use it to hold the host path
to its promises (no re-specialisation per call, no allocation per layer); :func:`main` times
the calls an engine makes per layer and per step.

FLASHINFER (where the kvcore-nvidia plugin is installed) is timed the same way with
:func:`fake_flashinfer`: FlashInfer's wrappers plan and run nothing, the cache write is the
Triton kernel's launch path.

Besides one layer called over and over (``Layer``: its step and tensors never change), it
times the calls per layer of an engine's step (``Step``): ``--layers`` layers with their own
caches and tensors on metadata built anew each step, so what is kept per step or per layer is
found as in an engine, not only because nothing changed.

Usage: ``python benchmarks/host_path.py [--root DIR] [--calls N] [--rounds R] [--backend NAME]
[--layers L] [--cpu-time] [--profile]`` (``--root``: another checkout's kvcore and
kvcore-nvidia, e.g. an earlier commit's, timed the same way; ``--cpu-time``: this thread's CPU
time, for a machine shared with other work; ``--profile``: a cProfile of each backend's write
+ forward).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: Compiles the stand-in made and launches its kernels received, by kernel name.
COUNTS: dict[str, int] = {"compiles": 0, "launches": 0}
#: The clock the timings read (nanoseconds): wall time, or with ``--cpu-time`` this thread's
#: CPU time (on a machine shared with other work, time spent descheduled is not counted).
CLOCK = [time.perf_counter_ns]


class _Kernel:
    """A compiled kernel that launches nothing (the attributes a launch reads)."""

    function = None
    packed_metadata = None

    def run(self, *args: object) -> None:
        COUNTS["launches"] += 1

    def launch_metadata(self, *args: object) -> None:
        return None


class _Driver:
    """The calls Triton's launch path makes on its active driver."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def fake_gpu() -> Iterator[dict[str, int]]:
    """Triton launches on CPU tensors through its real launch path, the kernels compiled and
    run by nothing (see the module). Yields :data:`COUNTS`."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("fake_gpu needs compiled (not interpreted) kernels: unset "
                           "TRITON_INTERPRET before triton is imported")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    original = JITFunction._do_compile

    def compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _Kernel()
        self.device_caches[device][0][key] = kernel
        COUNTS["compiles"] += 1
        return kernel

    previous = driver._active
    JITFunction._do_compile = compile_nothing
    driver.set_active(_Driver())
    try:
        yield COUNTS
    finally:
        JITFunction._do_compile = original
        driver._active = previous


class Layer:
    """One layer of a decode step (``b`` requests of ``length`` tokens; Hq 32, Hk 8, D 128,
    bf16, block 16) through kvcore's engine path: builder, impl, per-layer cache, output
    given. TRITON_ATTN by default; ``backend="FLASHINFER"`` needs :func:`fake_flashinfer`."""

    def __init__(self, b: int = 16, length: int = 4096, layers: int = 2,
                 backend: str = "TRITON_ATTN") -> None:
        import torch

        import kvcore

        hq, hk, d, bs = 32, 8, 128, 16
        self.backend = kvcore.resolve_backend(backend)
        pages = -(-length // bs)
        self.caches = kvcore.allocate_kv_caches(
            self.backend, num_layers=layers, num_blocks=b * pages + 8, block_size=bs,
            num_kv_heads=hk, head_size=d, dtype=torch.bfloat16, device="cpu")
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
        self.common = kvcore.build_attention_metadata([1] * b, [length - 1] * b, tables, bs)
        spec = kvcore.FullAttentionSpec(block_size=bs, dtype=torch.bfloat16, num_kv_heads=hk,
                                        head_size=d)
        self.builder = self.backend.get_builder_cls()(
            spec, num_heads=hq, max_num_seqs=b, max_num_batched_tokens=b,
            max_model_len=length, device="cpu")
        self.impl = self.backend.get_impl_cls()(num_heads=hq, head_size=d, scale=d**-0.5,
                                                num_kv_heads=hk)
        self.scales = kvcore.LayerScales()
        gen = torch.Generator().manual_seed(0)
        self.q = torch.randn(b, hq, d, generator=gen).to(torch.bfloat16)
        self.k = torch.randn(b, hk, d, generator=gen).to(torch.bfloat16)
        self.v = torch.randn(b, hk, d, generator=gen).to(torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.meta = self.builder.build(self.common)

    def calls(self) -> dict[str, Callable[[], object]]:
        """The calls an engine makes, by name (each on layer 0 of the step built once)."""
        import kvcore

        impl, sc, q, k, v, out = self.impl, self.scales, self.q, self.k, self.v, self.out
        cache, meta = self.caches.layers[0], self.meta

        def write_then_forward() -> None:
            impl.do_kv_cache_update(sc, k, v, cache, meta.slot_mapping)
            impl.forward(sc, q, k, v, cache, meta, output=out)

        found = {
            "do_kv_cache_update": lambda: impl.do_kv_cache_update(sc, k, v, cache,
                                                                  meta.slot_mapping),
            "forward": lambda: impl.forward(sc, q, k, v, cache, meta, output=out),
            "write + forward": write_then_forward,
        }
        if hasattr(impl, "update_and_forward"):
            found["update_and_forward"] = lambda: impl.update_and_forward(sc, q, k, v, cache,
                                                                          meta, output=out)
        found["builder.build (per step)"] = lambda: self.builder.build(self.common)
        if self.backend.CUDA_GRAPH_SUPPORT is not kvcore.CudaGraphSupport.NEVER:
            # What a replayed step builds (CudaGraphRunner.run): the captured size's views.
            size = self.common.num_seqs
            found["builder.build (graph step)"] = lambda: self.builder.build(
                self.common, graph_batch_size=size)
        return found


class Step:
    """A decode step as an engine runs it: ``layers`` layers, each with its own impl, cache
    and ``q``/``k``/``v``/output tensors (``first``'s for layer 0), on one step's
    metadata built anew per step (the builder's buffers written, so whatever a layer keeps
    per step is found by the first layer and reused by the others, and whatever it keeps per
    layer is found again each step). :meth:`time` gives host microseconds per layer of the
    chosen call. Nothing may be kept by the identity of ``q``/``k``/``v``/output (an engine
    makes them anew each step; here they are made once)."""

    def __init__(self, first: Layer, layers: int = 32) -> None:
        import torch

        self.first = first
        impl_cls = first.backend.get_impl_cls()
        _, hq, d = first.q.shape
        cache = first.caches.layers[0]
        self.layers = [(first.impl, first.scales, first.q, first.k, first.v, first.out, cache)]
        for _ in range(layers - 1):
            impl = impl_cls(num_heads=hq, head_size=d, scale=d**-0.5,
                            num_kv_heads=first.k.shape[1])
            # Uninitialised (the stand-in kernels read nothing): no memory is touched.
            self.layers.append((impl, type(first.scales)(), first.q.clone(), first.k.clone(),
                                first.v.clone(), first.out.clone(), torch.empty_like(cache)))

    def time(self, call: str, steps: int, repeats: int) -> float:
        """Microseconds per layer of ``call`` (``"update_and_forward"`` or ``"write +
        forward"``), the fastest of ``repeats`` runs of ``steps`` steps after one untimed
        warm-up run; each step's build is not timed."""
        build, common = self.first.builder.build, self.first.common
        fused = call == "update_and_forward"
        best = float("inf")
        for timed in [False] + [True] * repeats:
            total = 0
            for _ in range(steps):
                meta = build(common)
                t0 = CLOCK[0]()
                for impl, sc, q, k, v, out, cache in self.layers:
                    if fused:
                        impl.update_and_forward(sc, q, k, v, cache, meta, output=out)
                    else:
                        impl.do_kv_cache_update(sc, k, v, cache, meta.slot_mapping)
                        impl.forward(sc, q, k, v, cache, meta, output=out)
                total += CLOCK[0]() - t0
            if timed:
                best = min(best, total / (steps * len(self.layers)) / 1e3)
        return best


class _CompiledModule:
    """A FlashInfer wrapper's compiled module: its ``paged_run`` launches nothing (counted)."""

    def paged_run(self, *args: object) -> None:
        COUNTS["launches"] += 1


class _FlashInferWrapper:
    """FlashInfer's paged prefill and decode wrappers, planning and running nothing, shaped
    like FlashInfer's: ``plan`` makes a new ``_plan_info``, ``run`` unpacks the cache and
    builds its compiled module's argument list (about forty entries) before the call."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._cached_module = _CompiledModule()
        self._plan_info: list[int] = []

    def plan(self, *args: object, **kwargs: object) -> None:
        self._plan_info = [0] * 8

    def run(self, q: Any, paged_kv_cache: tuple, *, out: object = None,
            k_scale: float | None = None, v_scale: float | None = None) -> object:
        k_cache, v_cache = paged_kv_cache
        sm_scale = q.shape[-1] ** -0.5 * (1.0 if k_scale is None else k_scale)
        self._cached_module.paged_run(
            None, None, self._plan_info, q, k_cache, v_cache, None, None, None, None, out,
            None, 0, 0, -1, False, *([None] * 6), 0.0, sm_scale, None, None, None, 1.0, 1e4,
            0, 0, q.shape[1], k_cache.shape[2], None, None, k_cache.shape[1], None, 0,
            None, None, None, None, None, None, None, True)
        return out


@contextlib.contextmanager
def fake_flashinfer() -> Iterator[None]:
    """FLASHINFER on CPU tensors through its GPU path (inside :func:`fake_gpu`): a
    ``flashinfer`` module whose wrappers plan and run nothing, and the plugin's cache write on
    kvcore's Triton ``reshape_and_cache`` (the GPU write; the stand-in driver launches it)
    instead of the CPU reference."""
    from kvcore_nvidia.backends import flashinfer as backend
    from kvcore_nvidia.ops import cache_write

    from kvcore.ops.triton_cache import reshape_and_cache

    module = type(sys)("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = _FlashInferWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = _FlashInferWrapper
    previous = sys.modules.get("flashinfer"), cache_write.reshape_and_cache
    sys.modules["flashinfer"] = module
    cache_write.reshape_and_cache = reshape_and_cache
    backend._wrappers.cache_clear()
    try:
        yield
    finally:
        backend._wrappers.cache_clear()
        cache_write.reshape_and_cache = previous[1]
        if previous[0] is None:
            sys.modules.pop("flashinfer", None)
        else:
            sys.modules["flashinfer"] = previous[0]


def time_calls(calls: dict[str, Callable[[], object]], n: int, rounds: int
               ) -> dict[str, float]:
    """Microseconds per call of each: the fastest of ``rounds`` means of ``n`` calls, the
    calls taking turns (a shared machine's load then touches all alike)."""
    for fn in calls.values():
        for _ in range(20):
            fn()
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = CLOCK[0]()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (CLOCK[0]() - t0) / n / 1e3)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="a kvcore checkout to time instead of this one")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this thread's CPU time instead of wall time (a "
                        "machine shared with other work)")
    parser.add_argument("--layers", type=int, default=32,
                        help="layers of the engine step timed per layer (each its own cache)")
    parser.add_argument("--backend", action="append", choices=("TRITON_ATTN", "FLASHINFER"),
                        help="backends to time (repeatable; default: both where the "
                        "kvcore-nvidia plugin is installed)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of write + forward (self time)")
    args = parser.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.thread_time_ns
    os.environ.pop("TRITON_INTERPRET", None)
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "plugins" / "nvidia")]  # kvcore, kvcore-nvidia
    import torch

    import kvcore

    torch.set_num_threads(1)
    names = args.backend or ["TRITON_ATTN", "FLASHINFER"]
    print(f"kvcore at {Path(kvcore.__file__).parent.parent}; decode 16x4096, Hq 32, Hk 8, "
          "D 128, bf16, block 16; stand-in driver (host work only)")
    for name in names:
        with contextlib.ExitStack() as stack:
            counts = stack.enter_context(fake_gpu())
            if name == "FLASHINFER":
                try:
                    stack.enter_context(fake_flashinfer())
                except ImportError as exc:
                    print(f"{name}: skipped ({exc})")
                    continue
            layer = Layer(backend=name, layers=1)
            calls = layer.calls()
            compiles = counts["compiles"]
            times = time_calls(calls, args.calls, args.rounds)
            step = Step(layer, args.layers)
            for call in ("update_and_forward", "write + forward"):
                if call in calls:
                    times[f"step of {args.layers}: {call}"] = step.time(
                        call, max(1, args.calls // args.layers), args.rounds)
            new_compiles = counts["compiles"] - compiles
            print(f"{name}")
            for call, us in times.items():
                print(f"  {call:38s} {us:8.1f} us")
            print(f"  kernels compiled (all calls): {new_compiles}")
            if args.profile:
                profile(calls["write + forward"], args.calls)
    return 0


def profile(fn: Callable[[], object], n: int, top: int = 20) -> None:
    """Print the functions with the most time of their own over ``n`` calls of ``fn``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue())


if __name__ == "__main__":
    sys.exit(main())
