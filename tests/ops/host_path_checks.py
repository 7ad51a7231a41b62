"""Checks of TRITON_ATTN's and TRITON_MLA's host paths, run in a process of its own (compiled
kernels, not the interpreter the test session uses) with ``benchmarks/host_path.py``'s
stand-in driver; prints one JSON object with what it found (``tests/ops/test_host_path.py``
asserts on it). TRITON_MLA's ops are checked where the kvcore-mla plugin is installed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from host_path import Layer, Step, _Kernel, fake_gpu  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kvcore  # noqa: E402
from kvcore.ops import triton_attention, triton_cache, triton_launch, triton_merge  # noqa: E402

RUNS: list[tuple[int, tuple]] = []  # (kernel id, arguments after the launcher's nine)


def record(self: _Kernel, *args: object) -> None:
    RUNS.append((id(self), tuple(_plain(a) for a in args[9:])))


def _plain(a: object) -> object:
    return ("tensor", a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else a


class NewStorage(TorchDispatchMode):
    """Counts op outputs whose storage none of the op's inputs has (allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.allocated.append(str(func))
        return out


class Dispatched(TorchDispatchMode):
    """Records every torch op dispatched (a view, an unbind, a copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def allocations(calls: dict, names: tuple[str, ...], like: torch.Tensor) -> dict[str, int]:
    """New storages each of ``calls[name]()`` makes, and, as the control that shows the
    counter works, ``torch.empty_like(like)``'s."""
    allocated = {}
    for name in names:
        with NewStorage() as mode:
            calls[name]()
        allocated[name] = mode.allocated
    with NewStorage() as mode:
        torch.empty_like(like)
    allocated["torch.empty_like"] = mode.allocated
    return allocated


def counting(module: object, name: str, counts: dict[str, int]) -> None:
    """Count the calls of ``module.name`` (a module-level function) in ``counts[name]``."""
    fn = getattr(module, name)
    counts[name] = 0

    def counted(*args: object) -> object:
        counts[name] += 1
        return fn(*args)

    setattr(module, name, counted)


def forget() -> None:
    """Drop every kept check, choice and launch (the next calls start afresh)."""
    triton_attention._LAYERS.clear()
    triton_attention._RECENT.clear()
    triton_cache._WRITES.clear()
    triton_cache._RECENT.clear()
    triton_merge._LAUNCHES.clear()
    triton_launch._BOUND.clear()
    for module in _mla_modules():
        module._LAUNCHES.clear()


def _mla_modules() -> list:
    try:
        from kvcore_mla.ops import triton_cache as mla_cache
        from kvcore_mla.ops import triton_mla_decode, triton_mla_mixed
    except ImportError:
        return []
    return [mla_cache, triton_mla_decode, triton_mla_mixed]


def mla_calls() -> dict:
    """TRITON_MLA's calls by name (the plugin installed), else none: the latent cache write,
    decode on the pointer and the two-halves kernels with one and two splits (merge
    launched), mixed batches with one and two splits; 128 heads, kv_lora_rank 512, rope 64,
    bf16, block 64, with aligned and unaligned queries."""
    if not _mla_modules():
        return {}
    from kvcore_mla.ops.mla_configs import (
        TritonMLAHalvesConfig,
        TritonMLAPlan,
        mixed_config,
        mla_decode_config,
    )
    from kvcore_mla.ops.triton_cache import concat_and_cache_mla
    from kvcore_mla.ops.triton_mla_attention import mla_attention, mla_workspace_numel

    heads, rank, rope, bs, b = 128, 512, 64, 64, 4
    cache = torch.zeros(b * 4 + 2, bs, rank + rope, dtype=torch.bfloat16)
    tables = [[i * 4 + j for j in range(4)] for i in range(b)]
    found = {}
    meta = kvcore.build_attention_metadata([1] * b, [200] * b, tables, bs)
    kv_c = torch.randn(b, rank).to(torch.bfloat16)
    k_pe = torch.randn(b, rope).to(torch.bfloat16)
    found["mla cache write"] = lambda: concat_and_cache_mla(kv_c, k_pe, cache,
                                                            meta.slot_mapping)
    for name, tokens, cfgs in (
            ("mla decode", 1, (mla_decode_config(heads, page_size=bs),
                               TritonMLAHalvesConfig(block_h=64, block_n=64, num_warps=8,
                                                     num_stages=2))),
            ("mla mixed", 3, (mixed_config(heads, rank),))):
        m = kvcore.build_attention_metadata([tokens] * b, [200] * b, tables, bs)
        q = torch.randn(m.num_actual_tokens, heads, rank + rope).to(torch.bfloat16)
        unaligned = torch.empty(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)
        unaligned.copy_(q)
        out = torch.empty(q.shape[0], heads, rank, dtype=torch.bfloat16)
        for cfg in cfgs:
            for splits in (1, 2):
                workspace = torch.empty(max(1, mla_workspace_numel(q.shape[0], heads, rank,
                                                                   splits)))
                plan = TritonMLAPlan(cfg, splits, workspace if splits > 1 else None)
                for query, which in ((q, "aligned"), (unaligned, "unaligned")):
                    found[f"{name} {cfg.kernel} splits={splits} {which}"] = (
                        lambda query=query, m=m, out=out, plan=plan: mla_attention(
                            query, cache, kv_lora_rank=rank,
                            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                            block_table=m.block_table, scale=0.1, output=out,
                            max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
                            plan=plan))
    return found


def variants(layer: Layer) -> list:
    """Calls that Triton specialises differently: aligned and unaligned queries, one and
    seventeen requests, a split step (merge launched)."""
    impl, sc = layer.impl, layer.scales
    cache = layer.caches.layers[0]
    found = []
    for b in (1, 17):
        meta = kvcore.build_attention_metadata([1] * b, [40] * b,
                                               [[i * 3, i * 3 + 1, i * 3 + 2] for i in range(b)],
                                               16)
        q = torch.randn(b, 32, 128).to(torch.bfloat16)
        k = torch.randn(b, 8, 128).to(torch.bfloat16)
        out = torch.empty_like(q)
        unaligned = torch.empty(b * 32 * 128 + 1, dtype=torch.bfloat16)[1:].view(b, 32, 128)
        unaligned.copy_(q)
        for query in (q, unaligned):
            found.append(lambda query=query, meta=meta, k=k, out=out: impl.update_and_forward(
                sc, query, k, k, cache, meta, output=out))
        numel = kvcore.ops.workspace_numel(b, 32, 128, 2)
        split = kvcore.ops.TritonAttentionPlan(num_kv_splits=2, workspace=(
            torch.empty(numel[0]), torch.empty(numel[1])))
        found.append(lambda q=q, meta=meta, out=out, split=split: kvcore.ops.triton_paged_attention(
            q, *cache.unbind(1), query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
            block_table=meta.block_table, scale=0.1, output=out, plan=split))
    return found


def main() -> None:
    result: dict = {}
    _Kernel.run = record
    with fake_gpu() as counts:
        layer = Layer()
        # Triton's own choice for every variant: direct launches off.
        forget()
        runtime, triton_launch._RUNTIME = triton_launch._RUNTIME, None
        truth = []
        mla = mla_calls()
        cases = variants(layer) + list(mla.values())  # the same tensors in both runs
        for call in cases:
            RUNS.clear()
            call()
            truth.append(list(RUNS))
        triton_launch._RUNTIME = runtime
        forget()
        same_kernel, same_args, direct_runs = [], [], 0
        for call, expected in zip(cases, truth, strict=True):
            for _ in range(2):  # through kernel[grid] first, then direct
                RUNS.clear()
                before = triton_launch.launch_counts().direct
                call()
                direct_runs += triton_launch.launch_counts().direct - before
                same_kernel.append([r[0] for r in RUNS] == [r[0] for r in expected])
                same_args.append([r[1] for r in RUNS] == [r[1] for r in expected])
        result.update(same_kernel=same_kernel, same_args=same_args, direct_runs=direct_runs,
                      mla_cases=len(mla))

        # Many calls of one shape: nothing compiled, bound or bound again; all direct.
        calls = layer.calls()
        for fn in calls.values():
            fn()
        counted = triton_launch.launch_counts()
        start = (counts["compiles"], counted.bound, counted.triton, counted.direct)
        for _ in range(200):
            calls["update_and_forward"]()
            calls["write + forward"]()
            layer.meta = layer.builder.build(layer.common)
        calls = layer.calls()
        for _ in range(50):
            calls["update_and_forward"]()
        end = (counts["compiles"], counted.bound, counted.triton, counted.direct)
        result["flat"] = dict(zip(("compiles", "bound", "triton", "direct"),
                                  (e - s for s, e in zip(start, end, strict=True)),
                                  strict=True))

        # Steady state: each op finds its checks by the impl's cache views (no full
        # signature built) and the impl hands back the views it made (no unbind): a layer's
        # call dispatches no torch op at all.
        keys: dict[str, int] = {}
        counting(triton_attention, "_layer_key", keys)
        counting(triton_cache, "_write_key", keys)

        def hundred_rounds(*names: str) -> dict:
            """Full signatures built and torch ops dispatched over 100 rounds of the calls."""
            calls = layer.calls()
            with Dispatched() as mode:
                for _ in range(100):
                    for name in names:
                        calls[name]()
            found = dict(full_keys=dict(keys), ops=sorted(set(mode.ops)))
            keys.update(dict.fromkeys(keys, 0))
            return found

        result["steady"] = hundred_rounds("update_and_forward", "write + forward")
        layer.meta = layer.builder.build(layer.common)  # a new step: the same
        result["steady_next_step"] = hundred_rounds("update_and_forward")
        # A new cache object for the layer (an engine that reallocated): split again, the
        # full signature looked up once per op, then the views again.
        kv = layer.caches.layers[0]
        layer.caches.layers[0] = torch.empty_like(kv).copy_(kv)
        result["new_cache"] = hundred_rounds("update_and_forward")

        # The same for TRITON_MLA: each call 100 times after its first.
        start = (counts["compiles"], counted.bound, counted.triton, counted.direct)
        for _ in range(100):
            for call in mla.values():
                call()
        end = (counts["compiles"], counted.bound, counted.triton, counted.direct)
        result["mla_flat"] = dict(zip(("compiles", "bound", "triton", "direct"),
                                      (e - s for s, e in zip(start, end, strict=True)),
                                      strict=True))

        # No tensor allocated by a layer's calls (output given, the builder's metadata).
        result["allocated"] = allocations(calls, ("update_and_forward", "write + forward"),
                                          layer.q)

        # An engine's step: 8 layers, each its own impl and cache, on metadata built anew per
        # step. What the step's tensors give (facts, value checks) is derived by its first
        # layer only; every launch is direct.
        step = Step(layer, 8)
        step.time("update_and_forward", 1, 1)
        derived: dict[str, int] = {}
        counting(triton_attention, "checked_step_facts", derived)
        counting(triton_attention, "check_paged_attention_values", derived)
        counting(triton_cache, "checked_step_facts", derived)
        counting(triton_cache, "check_reshape_and_cache_values", derived)
        start = (counts["compiles"], counted.bound, counted.triton, counted.direct)
        step.time("update_and_forward", 5, 1)  # a warm-up round, then one timed: 10 steps
        step.time("write + forward", 5, 1)  # 10 more
        end = (counts["compiles"], counted.bound, counted.triton, counted.direct)
        result["engine_step"] = dict(derived, **dict(zip(
            ("compiles", "bound", "triton", "direct"),
            (e - s for s, e in zip(start, end, strict=True)), strict=True)))

        # Metadata made in inference mode (tensors without a version counter) is checked
        # per call, never kept; the launches are direct all the same.
        meta = layer.builder.build(layer.common)
        with torch.inference_mode():
            inference = type(meta)(**{name: t.clone() if isinstance(t, torch.Tensor) else t
                                      for name, t in vars(meta).items()})
            before = counted.direct
            for _ in range(3):
                layer.impl.update_and_forward(layer.scales, layer.q, layer.k, layer.v,
                                              layer.caches.layers[0], inference,
                                              output=layer.out)
            result["inference_metadata"] = dict(
                direct=counted.direct - before,
                kept=triton_attention._last_step.tensors[0] is inference.query_start_loc)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
