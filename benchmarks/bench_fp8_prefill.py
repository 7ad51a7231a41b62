#!/usr/bin/env python3
"""TRITON_ATTN's prefill on an fp8 KV cache with and without fp16 products, beside bf16, on one GPU.

The prefill kernel's fp8 switch (``fp8_fp16`` of
:class:`~kvcore.ops.attention_config.TritonPrefillConfig` / ``TritonPrefillTile``): on, bf16
queries meet the fp8 K/V in fp16 products (fp8 -> fp16 is one conversion instruction per
two elements, fp8 -> bf16 three); off, the fp8 tiles are converted to bf16. This run gives
the numbers that decide its value in ``PREFILL_TILES``. Layers (bf16 queries, block 16,
shuffled pages, causal):

- gpt-oss-20B: Hq 64, Hk 8, D 64, attention sinks; its full layers and its sliding ones
  (window 128);
- Llama-3.1-8B: Hq 32, Hk 8, D 128.

Cases: prefill 4 x 2048 new tokens, and a mixed step (2 x 2048 new tokens beside 62 decodes
of 4096-token requests). Per layer and case, one run, each section isolated (an error is
logged and the run goes on):

1. bf16 cache: what :func:`kvcore.ops.triton_attention.paged_attention` runs without a plan
   (on sm90 the Gluon kernel where it applies, sinks included) and, where that is not
   ``triton_prefill``, the ``PREFILL_TILES`` row;
2. fp8 e4m3 cache holding the same values (per-tensor scales amax / 448, one-element device
   tensors as an engine passes them): the ``PREFILL_TILES`` row with ``fp8_fp16`` off and
   on (explicit plans, whatever the row says).

Every call is checked against :func:`kvcore.ops.paged_attention_ref` on its first and last
requests, and fp8 on against fp8 off, before it is timed. Times are medians of CUDA-graph
replays (:func:`kvcore.cli.harness.time_call`); TFLOP/s count the attention FLOPs (QK^T and
PV over the keys each query sees) against a bf16 matmul's. The table printed last gives each
call's time, its fp8 / bf16 ratios (against the bf16 cache on the same Triton row, and
against what runs on the bf16 cache by default) and, on the fp8 rows, off / on; the lines
under it say which value of ``fp8_fp16`` was faster where. Logs and JSON go to ``--out``
(default ``$OUT``, else ``benchmarks/results``). ``--smoke`` runs tiny shapes on the CPU
under ``TRITON_INTERPRET=1`` to check the script.

Usage: ``python benchmarks/bench_fp8_prefill.py [--out DIR] [--smoke]``
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore.ops as ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, rel_err  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE, FP8, BS = torch.bfloat16, torch.float8_e4m3fn, 16


@dataclasses.dataclass(frozen=True)
class Layer:
    hq: int
    hk: int
    d: int
    sinks: bool = False
    window: int | None = None


LAYERS = {
    "gpt-oss-20B": Layer(64, 8, 64, sinks=True),
    "gpt-oss-20B sliding": Layer(64, 8, 64, sinks=True, window=128),
    "Llama-3.1-8B": Layer(32, 8, 128),
}
#: name -> (new tokens, cached tokens) per request
CASES = {"prefill 4x2048": [(2048, 0)] * 4,
         "mixed 2x2048+62x1": [(2048, 0)] * 2 + [(1, 4095)] * 62}
MATMUL_N = 8192
if SMOKE:
    LAYERS = {"gpt-oss-like": Layer(8, 1, 64, sinks=True),
              "gpt-oss-like sliding": Layer(8, 1, 64, sinks=True, window=24),
              "llama-like": Layer(4, 1, 128)}
    CASES = {"prefill 2x40": [(40, 0)] * 2, "mixed 1x40+3x1": [(40, 0)] + [(1, 70)] * 3}
    MATMUL_N = 256


class Batch:
    """One step of ``requests`` ``(new, cached)`` tokens for a layer over a shuffled paged
    cache in the standard NHD layout ``(num_blocks, 2, BS, Hk, D)``: bf16 values, and the
    same values in fp8 e4m3 with per-tensor scales (amax / 448)."""

    def __init__(self, layer: Layer, requests: list[tuple[int, int]]) -> None:
        self.layer, self.requests = layer, requests
        seq_lens = [new + cached for new, cached in requests]
        pages = -(-max(seq_lens) // BS)
        num_blocks = len(requests) * pages + 16
        self.kv = torch.empty(num_blocks, 2, BS, layer.hk, layer.d,
                              device=DEVICE).normal_().to(DTYPE)
        self.k_scale = (self.kv[:, 0].abs().amax().float() / 448).reshape(1)
        self.v_scale = (self.kv[:, 1].abs().amax().float() / 448).reshape(1)
        self.kv8 = torch.empty(self.kv.shape, dtype=FP8, device=DEVICE)
        for half, scale in ((0, self.k_scale), (1, self.v_scale)):
            self.kv8[:, half] = ops.quantize_to_cache(self.kv[:, half], FP8, scale.item())
        perm = torch.randperm(num_blocks, device=DEVICE)[: len(requests) * pages]
        self.block_table = perm.view(len(requests), pages).to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        starts = [0]
        for new, _ in requests:
            starts.append(starts[-1] + new)
        self.qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        self.query = torch.empty(starts[-1], layer.hq, layer.d, device=DEVICE).normal_().to(
            DTYPE)
        self.sinks = (torch.empty(layer.hq, device=DEVICE).normal_() if layer.sinks
                      else None)
        self.scale = layer.d ** -0.5

    def cache(self, fp8: bool) -> dict:
        """The caches and the scale arguments of an fp8 or a bf16 call."""
        kv = self.kv8 if fp8 else self.kv
        k, v = kv.unbind(1)
        extra = dict(kv_cache_dtype="fp8_e4m3", k_scale=self.k_scale,
                     v_scale=self.v_scale) if fp8 else {}
        return dict(key_cache=k, value_cache=v, **extra)

    def features(self) -> dict:
        return dict(sliding_window=self.layer.window, sinks=self.sinks)

    def step(self) -> dict:
        return dict(query_start_loc=self.qsl, seq_lens=self.seq_lens,
                    block_table=self.block_table, scale=self.scale)

    def subset(self, idx: list[int]) -> tuple[torch.Tensor, dict]:
        """The query and step arguments of requests ``idx`` alone (for the reference)."""
        starts = self.qsl.tolist()
        query = torch.cat([self.query[starts[i]:starts[i + 1]] for i in idx])
        lens = [starts[i + 1] - starts[i] for i in idx]
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                           device=DEVICE)
        sel = torch.tensor(idx, device=DEVICE)
        return query, dict(query_start_loc=qsl, seq_lens=self.seq_lens[sel],
                           block_table=self.block_table[sel], scale=self.scale)

    def flops(self) -> float:
        """QK^T and PV FLOPs over the keys each query sees (causal, within the window)."""
        seen = 0
        for new, cached in self.requests:
            for pos in range(cached, cached + new):
                seen += pos + 1 if self.layer.window is None else min(pos + 1,
                                                                      self.layer.window)
        return 4.0 * self.layer.hq * self.layer.d * seen


def dispatch():
    from kvcore.ops import attention_dispatch as mod

    return mod


def triton_attention():
    from kvcore.ops import triton_attention as mod

    return mod


def label(cfg, fp8: bool) -> str:
    if cfg.kernel == "gluon_ws_pingpong":
        return f"gluon n{cfg.block_n}s{cfg.num_stages}"
    switch = f" fp8_fp16={cfg.fp8_fp16}" if fp8 else ""
    return (f"{cfg.kernel} {cfg.block_q * cfg.g_pad}x{cfg.block_n}w{cfg.num_warps}"
            f"s{cfg.num_stages}{switch}")


def configs(batch: Batch) -> list[tuple[str, str, object]]:
    """``(cache, impl, config)`` of the calls timed on ``batch``."""
    d = dispatch()
    layer = batch.layer
    bound = batch.block_table.shape[1] * BS
    bf16 = batch.cache(False)
    default = d.call_config(batch.query, bf16["key_cache"], bf16["value_cache"], "auto",
                            len(batch.requests), bound)
    row = d.default_config(batch.query.shape[0], len(batch.requests), layer.hq, layer.hk,
                           layer.d, bound, torch.device(DEVICE), gluon=False)
    row = dataclasses.replace(row, fp8_fp16=False)
    calls = [("bf16", "kvcore default", default)]
    if default.kernel != "triton_prefill":
        calls.append(("bf16", "triton_prefill row", row))
    calls += [("fp8", "fp8_fp16 off", row),
              ("fp8", "fp8_fp16 on", dataclasses.replace(row, fp8_fp16=True))]
    return calls


def kvcore_call(batch: Batch, fp8: bool, cfg) -> Callable[[], torch.Tensor]:
    ta = triton_attention()
    out = torch.empty_like(batch.query)
    args = dict(**batch.cache(fp8), **batch.step(), **batch.features(), output=out,
                plan=ops.TritonAttentionPlan(config=cfg))
    return lambda: ta.paged_attention(batch.query, **args)


def check(run: Run, name: str, batch: Batch, fp8: bool, cfg) -> None:
    """``cfg`` against the reference on the batch's first and last requests."""
    ops.set_value_checks(True)
    query, step = batch.subset([0, len(batch.requests) - 1])
    ours = triton_attention().paged_attention(query, **batch.cache(fp8), **step,
                                              **batch.features(),
                                              plan=ops.TritonAttentionPlan(config=cfg))
    ref = ops.paged_attention_ref(query, **batch.cache(fp8), **step, **batch.features())
    err = rel_err(ours, ref)
    run.check(f"{name}.vs_reference", err < 1e-2, rel_err=err)
    ops.set_value_checks(False)  # timing: no host reads inside the calls


def time_layer_case(run: Run, layer_name: str, case: str, batch: Batch) -> None:
    outs = {}
    for cache, impl, cfg in configs(batch):
        name = f"{layer_name}.{case}.{cache}.{impl}"
        check(run, name, batch, cache == "fp8", cfg)
        fn = kvcore_call(batch, cache == "fp8", cfg)
        outs[impl] = fn().clone()
        if impl == "fp8_fp16 on":
            err = rel_err(outs[impl], outs["fp8_fp16 off"])
            run.check(f"{layer_name}.{case}.fp8.on_vs_off", err < 1e-2, rel_err=err)
        t, how = time_call(fn)
        row = {"layer": layer_name, "case": case, "cache": cache, "impl": impl,
               "config": label(cfg, cache == "fp8"), "time_us": t * 1e6,
               "TFLOPs": batch.flops() / t / 1e12, "method": how}
        run.results["timings"].append(row)
        run.log(f"{layer_name} {case} {cache} {impl} [{row['config']}]: {row['time_us']:.1f} "
                f"us, {row['TFLOPs']:.1f} TFLOP/s [{how}]")


# ----------------------------------------------------------------------------- report


def summary(run: Run) -> list[str]:
    """The table (one row per timing) and one verdict line per layer and case."""
    ceiling = run.results["ceilings"].get("matmul_tflops")
    timings = run.results["timings"]

    def find(t: dict, cache: str, impl: str) -> dict | None:
        return next((r for r in timings if (r["layer"], r["case"], r["cache"], r["impl"]) ==
                     (t["layer"], t["case"], cache, impl)), None)

    def ratio(t: dict, base: dict | None) -> str:
        return f"{t['time_us'] / base['time_us']:.2f}" if base and t["cache"] == "fp8" else "-"

    rows, verdicts = [], []
    for t in timings:
        default = find(t, "bf16", "kvcore default")
        row = find(t, "bf16", "triton_prefill row") or default
        off = find(t, "fp8", "fp8_fp16 off")
        rows.append([
            t["layer"], t["case"], t["cache"], t["impl"], t["config"], f"{t['time_us']:.1f}",
            f"{t['TFLOPs']:.0f}", f"{100 * t['TFLOPs'] / ceiling:.0f}%" if ceiling else "-",
            ratio(t, row), ratio(t, default),
            f"{off['time_us'] / t['time_us']:.2f}" if off and t["cache"] == "fp8" else "-",
        ])
        if t["impl"] == "fp8_fp16 on" and off:
            faster = "on" if t["time_us"] < off["time_us"] else "off"
            verdicts.append(f"{t['layer']}, {t['case']}: fp8_fp16 {faster} is faster "
                            f"({off['time_us']:.1f} us off, {t['time_us']:.1f} us on, "
                            f"{off['time_us'] / t['time_us']:.2f}x)")
    headers = ["layer", "case", "cache", "impl", "config", "us", "TFLOP/s", "% matmul",
               "fp8/bf16 row", "fp8/bf16 default", "off/on"]
    return [harness.format_table(rows, headers, tablefmt="simple"), *verdicts]


def main() -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    run = Run(Path(args.out), "bench_fp8_prefill", ("correctness", "timings"),
              checks="correctness", device=DEVICE)
    meta = run.results["meta"]
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE, block_size=BS, dtype=str(DTYPE),
                kv_fp8=str(FP8), layers={k: dataclasses.asdict(v) for k, v in LAYERS.items()},
                cases=CASES)
    meta["triton"] = harness.triton_version()
    run.log(json.dumps(meta))
    torch.manual_seed(0)

    with run.section("ceiling"):
        tflops, how = harness.matmul_tflops(MATMUL_N, DTYPE, DEVICE, time_call)
        run.results["ceilings"]["matmul_tflops"] = tflops
        run.log(f"ceiling: {MATMUL_N}^3 {DTYPE} matmul {tflops:.0f} TFLOP/s [{how}]")
    for layer_name, layer in LAYERS.items():
        for case, requests in CASES.items():
            with run.section(f"{layer_name} {case}"):
                time_layer_case(run, layer_name, case, Batch(layer, requests))
    ops.set_value_checks(True)

    return run.finish_checked(after=[
        f"matmul ceiling: {run.results['ceilings'].get('matmul_tflops', 0):.0f} TFLOP/s",
        *summary(run)])


if __name__ == "__main__":
    sys.exit(main())
