#!/usr/bin/env python3
"""FLASHINFER through kvcore against FlashInfer called directly (one GPU).

One run does, in order, each section isolated (an error is logged and the run goes on):

1. warmup: a fresh builder's ``warmup()`` (FlashInfer's JIT modules of the configuration:
   a cold build when FlashInfer's JIT cache is empty), then a second builder's (cached);
2. correctness against the float64 reference: the three prefill cases (the last rows of each
   request, which see its whole context), a mixed batch (decodes first, then prefill chunks:
   split in two), decode at 64 x 4096; beside it kvcore's prefill output against FlashInfer
   direct on the whole output;
3. prefill: 4 x 2048 new tokens, 1 x 8192 new, 4 x 512 new over 16384 cached (bf16, Hq 32,
   Hk 8, D 128, block 16, causal): kvcore's ``impl.forward`` on the builder's metadata and
   FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` with its default backend, planned
   once; each timed from a CUDA graph of repeated calls, taking turns for two rounds (the
   faster round); TFLOP/s of the attention FLOPs (4 * D * Hq per visible query-key pair);
4. one-layer decode at 64 x 4096, 8 x 32768, 256 x 1024, 16 x 4096: kvcore through the
   builder (``graph_batch_size``) against FlashInfer's decode wrapper (the same tensor-core
   choice) planned once, and the same in FlashInfer's CUDA-graph mode (the mode kvcore's
   replayable steps need), all captured, taking turns for two rounds;
5. the 32-layer decode step at 16 x 4096 and 64 x 4096 through ``CudaGraphRunner`` (the
   builder's ``build()`` then one replay per step, steps back to back) beside the kernels'
   own times (``bench_step.time_step``): the host overhead.

The table printed last has the times and ratios. Logs and JSON go to ``--out`` (default
``$OUT``, else ``benchmarks/results``). ``--cpu`` times the builder's ``build()`` on the CPU
against a stand-in FlashInfer whose ``plan`` does nothing (kvcore's own host work per step).

Usage: ``python benchmarks/bench_flashinfer.py [--out DIR] [--cpu]``.
"""

from __future__ import annotations

import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvcore
from kvcore.cli import harness
from kvcore.cli.harness import Run, rel_err
from kvcore.ops.reference import paged_attention_ref

DTYPE = torch.bfloat16
HQ, HK, D, BS = 32, 8, 128, 16
PREFILL_CASES = {"4x2048 new": (4, 2048, 0), "1x8192 new": (1, 8192, 0),
                 "4x512 new over 16k cached": (4, 512, 16384)}
DECODE_SHAPES = [(64, 4096), (8, 32768), (256, 1024), (16, 4096)]
STEP_SHAPES = [(16, 4096), (64, 4096)]
#: Rows per request checked against the float64 reference (the last ones: the whole context).
REF_ROWS = 256


def _spec() -> kvcore.FullAttentionSpec:
    return kvcore.FullAttentionSpec(block_size=BS, dtype=DTYPE, num_kv_heads=HK, head_size=D)


class Case:
    """One attention call's inputs: a random paged cache, block tables, the step's metadata
    and the FLASHINFER builder's metadata for it."""

    def __init__(self, num_reqs: int, new: int, cached: int, graph: bool = False,
                 seed: int = 0, q_lens: list[int] | None = None,
                 ctx_lens: list[int] | None = None) -> None:
        self.q_lens = q_lens or [new] * num_reqs
        self.ctx_lens = ctx_lens or [cached] * num_reqs
        gen = torch.Generator().manual_seed(seed)
        pages = [-(-(q + c) // BS) for q, c in zip(self.q_lens, self.ctx_lens, strict=True)]
        self.num_blocks = sum(pages) + 8
        ids = torch.randperm(self.num_blocks, generator=gen).tolist()
        starts = [sum(pages[:i]) for i in range(len(pages))]
        self.tables = [ids[s:s + p] for s, p in zip(starts, pages, strict=True)]
        self.kv_cache = torch.randn(self.num_blocks, 2, BS, HK, D, generator=gen).to(
            "cuda", DTYPE)
        self.common = kvcore.build_attention_metadata(self.q_lens, self.ctx_lens, self.tables,
                                                      BS, device="cuda")
        rows = self.common.num_actual_tokens
        self.query = torch.randn(rows, HQ, D, generator=gen).to("cuda", DTYPE)
        self.kv_new = torch.zeros(rows, HK, D, dtype=DTYPE, device="cuda")
        self.out = torch.empty_like(self.query)
        backend = kvcore.resolve_backend("FLASHINFER")
        n = len(self.q_lens)
        self.builder = backend.get_builder_cls()(
            _spec(), num_heads=HQ, max_num_seqs=n, max_num_batched_tokens=max(rows, n),
            max_model_len=max(q + c for q, c in zip(self.q_lens, self.ctx_lens, strict=True)),
            device="cuda")
        self.meta = self.builder.build(self.common, graph_batch_size=n if graph else None)
        self.impl = backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D**-0.5,
                                           num_kv_heads=HK)
        self.scales = kvcore.LayerScales()

    def kvcore(self) -> Callable[[], object]:
        return lambda: self.impl.forward(self.scales, self.query, self.kv_new, self.kv_new,
                                         self.kv_cache, self.meta, output=self.out)

    def flops(self) -> float:
        """4 * D * Hq per visible (query, key) pair, causal."""
        pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(self.q_lens, self.ctx_lens,
                                                              strict=True))
        return 4.0 * D * HQ * pairs

    def reference_rows(self, out: torch.Tensor, rows: int = REF_ROWS) -> float:
        """rel_err of ``out``'s last ``rows`` rows per request against float64."""
        m = self.common
        starts = m.query_start_loc.tolist()
        picks, q_lens = [], []
        for i, q in enumerate(self.q_lens):
            r = min(rows, q)
            picks.append(torch.arange(starts[i + 1] - r, starts[i + 1], device="cuda"))
            q_lens.append(r)
        idx = torch.cat(picks)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda")
        k, v = self.kv_cache.unbind(1)
        ref = paged_attention_ref(self.query[idx].double(), k.double(), v.double(),
                                  query_start_loc=qsl, seq_lens=m.seq_lens,
                                  block_table=m.block_table, scale=D**-0.5)
        return rel_err(out[idx], ref)


def direct_prefill(case: Case) -> Callable[[], object]:
    """FlashInfer's prefill wrapper with its default backend, planned once."""
    import flashinfer
    from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    indptr, indices, last = flashinfer_page_table(case.common, BS)
    wrapper.plan(case.common.query_start_loc, indptr, indices, last, HQ, HK, D, BS,
                 causal=True, sm_scale=D**-0.5, q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(case.query)
    case.direct_out = out
    case.direct_backend = getattr(wrapper, "_backend", "?")
    return lambda: wrapper.run(case.query, case.kv_cache, out=out)


def direct_decode(case: Case, graph_mode: bool = False) -> Callable[[], object]:
    """FlashInfer's decode wrapper with kvcore's tensor-core choice, planned once; with
    ``graph_mode`` in FlashInfer's CUDA-graph mode (what replays any later step of the batch
    size, as kvcore's builder needs: its plan is made for the worst case of that size)."""
    import flashinfer
    from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    indptr, indices, last = flashinfer_page_table(case.common, BS)
    buffers = {}
    if graph_mode:
        buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
                       paged_kv_indices_buffer=torch.empty_like(indices),
                       paged_kv_last_page_len_buffer=torch.empty_like(last))
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=case.builder.kernels.decode_tensor_cores,
        backend="fa2", **buffers)
    wrapper.plan(indptr, indices, last, HQ, HK, D, BS, sm_scale=D**-0.5, q_data_type=DTYPE,
                 kv_data_type=DTYPE)
    out = torch.empty_like(case.query)
    return lambda: wrapper.run(case.query, case.kv_cache, out=out)


def alternating(fns: dict[str, Callable[[], object]], rounds: int = 2) -> dict[str, dict]:
    """Each variant timed from a CUDA graph, the variants taking turns; the faster round."""
    return {name: {"time_us": t * 1e6, "rounds_us": [x * 1e6 for x in samples],
                   "timing": how}
            for name, (t, samples, how) in harness.time_alternating(fns, "cuda",
                                                                    rounds).items()}


# ----------------------------------------------------------------------------- sections


def warmup(run: Run) -> None:
    for label in ("first builder (cold when FlashInfer's JIT cache is empty)",
                  "second builder (modules loaded)"):
        builder = kvcore.resolve_backend("FLASHINFER").get_builder_cls()(
            _spec(), num_heads=HQ, max_num_seqs=64, max_num_batched_tokens=8192,
            max_model_len=32768, device="cuda")
        t0 = time.perf_counter()
        seconds = builder.warmup()
        row = {"builder": label, "kernels": str(builder.kernels), "seconds": seconds,
               "total_s": time.perf_counter() - t0}
        run.results["warmup"].append(row)
        run.log(json.dumps(row, default=str))


def correctness(run: Run) -> None:
    for name, (b, new, cached) in PREFILL_CASES.items():
        with run.section(f"correctness prefill {name}"):
            case = Case(b, new, cached, seed=1)
            case.kvcore()()
            direct = direct_prefill(case)
            direct()
            row = {"case": f"prefill {name}", "kernels": str(case.builder.kernels),
                   "rel_err_vs_ref_last_rows": case.reference_rows(case.out),
                   "direct_backend": case.direct_backend,
                   "rel_err_vs_direct": rel_err(case.out, case.direct_out),
                   "max_abs_diff_vs_direct": float((case.out.float() - case.direct_out.float())
                                                   .abs().max())}
            row["ok"] = row["rel_err_vs_ref_last_rows"] < 1e-2
            run.results["correctness"].append(row)
            run.log(json.dumps(row))
    mixed = dict(q_lens=[1] * 6 + [700, 300, 1], ctx_lens=[4000, 15, 900, 64, 3000, 17,
                                                           0, 2048, 500])
    for name, kwargs, graph in (("mixed (6 decodes first, 2 prefills, 1 decode)", mixed,
                                 False),
                                ("decode 64x4096 (graph wrapper)", dict(
                                    q_lens=[1] * 64, ctx_lens=[4095] * 64), True)):
        with run.section(f"correctness {name}"):
            case = Case(0, 0, 0, graph=graph, seed=2, **kwargs)
            case.kvcore()()
            row = {"case": name, "num_decodes": case.meta.num_decodes,
                   "rel_err_vs_ref": case.reference_rows(case.out, rows=10**9)}
            row["ok"] = row["rel_err_vs_ref"] < 1e-2
            run.results["correctness"].append(row)
            run.log(json.dumps(row))


def prefill(run: Run) -> None:
    for name, (b, new, cached) in PREFILL_CASES.items():
        with run.section(f"prefill {name}"):
            case = Case(b, new, cached, seed=3)
            times = alternating({"kvcore": case.kvcore(), "direct": direct_prefill(case)})
            row = {"case": name, "kernels": str(case.builder.kernels),
                   "direct_backend": case.direct_backend, "flops": case.flops()}
            for impl, t in times.items():
                row[impl] = {**t, "tflops": case.flops() / t["time_us"] / 1e6}
            row["ratio_direct_over_kvcore"] = times["direct"]["time_us"] / times["kvcore"][
                "time_us"]
            run.results["prefill"].append(row)
            run.log(json.dumps(row))


def decode(run: Run) -> None:
    for b, length in DECODE_SHAPES:
        with run.section(f"one-layer decode {b}x{length}"):
            case = Case(b, 1, length - 1, graph=True, seed=4)
            times = alternating({"kvcore": case.kvcore(), "direct": direct_decode(case),
                                 "direct_graph_mode": direct_decode(case, graph_mode=True)})
            row = {"shape": f"{b}x{length}", **times,
                   "ratio_direct_over_kvcore": times["direct"]["time_us"] / times["kvcore"][
                       "time_us"]}
            run.results["decode"].append(row)
            run.log(json.dumps(row))


def steps(run: Run) -> None:
    import bench_step

    for b, length in STEP_SHAPES:
        with run.section(f"32-layer decode step {b}x{length}"):
            bench_step.time_step(run, "FLASHINFER", b, length)  # appends to results["steps"]


def build_cpu(run: Run) -> None:
    """kvcore's host work in ``build()`` per step, FlashInfer's ``plan`` a no-op."""

    class NoOpWrapper:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def plan(self, *args: object, **kwargs: object) -> None:
            pass

    sys.modules["flashinfer"] = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=NoOpWrapper,
        BatchDecodeWithPagedKVCacheWrapper=NoOpWrapper)
    torch.set_num_threads(1)
    backend = kvcore.resolve_backend("FLASHINFER")
    for b, length in STEP_SHAPES:
        spec = _spec()
        builder = backend.get_builder_cls()(spec, num_heads=HQ, max_num_seqs=b,
                                            max_num_batched_tokens=b, max_model_len=length + 64,
                                            device="cpu")
        pages = -(-(length + 64) // BS)
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
        steps_meta = [kvcore.build_attention_metadata([1] * b, [length - 1 + s] * b, tables, BS)
                      for s in range(BS)]
        for label, graph in (("graph decode", b), ("eager decode", None)):
            builder.build(steps_meta[0], graph_batch_size=graph)
            t0 = time.perf_counter()
            plans0 = builder.plans
            rounds = 4
            for _ in range(rounds):
                for meta in steps_meta:
                    builder.build(meta, graph_batch_size=graph)
            per = (time.perf_counter() - t0) / (rounds * len(steps_meta))
            row = {"shape": f"{b}x{length}", "build": label, "us_per_build": per * 1e6,
                   "plans_per_step": (builder.plans - plans0) / (rounds * len(steps_meta))}
            run.results["build_cpu"].append(row)
            run.log(json.dumps(row))


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table of already formatted cells (kept as written)."""
    return "\n".join(f"| {' | '.join(row)} |"
                     for row in [headers, ["---"] * len(headers), *rows])


def summary_table(run: Run) -> str:
    r = run.results
    parts = []
    if r["warmup"]:
        parts.append(markdown(["warmup", "seconds by phase", "total s"], [
            [x["builder"], ", ".join(f"{k} {v:.2f}" for k, v in x["seconds"].items()),
             f"{x['total_s']:.2f}"] for x in r["warmup"]]))
    if r["correctness"]:
        rows = []
        for x in r["correctness"]:
            err = x.get("rel_err_vs_ref_last_rows", x.get("rel_err_vs_ref"))
            vs = x.get("rel_err_vs_direct")
            rows.append([x["case"], f"{err:.2e}", "" if vs is None else f"{vs:.2e}",
                         str(x["ok"])])
        parts.append(markdown(["correctness", "rel err vs float64", "vs direct", "ok"], rows))
    if r["prefill"]:
        parts.append(markdown(
            ["prefill", "kvcore FLASHINFER", "FlashInfer direct", "direct / kvcore"],
            [[f"{x['case']} ({x['kernels']}; direct {x['direct_backend']})",
              f"{x['kvcore']['time_us']:.0f} us, {x['kvcore']['tflops']:.0f} TFLOP/s",
              f"{x['direct']['time_us']:.0f} us, {x['direct']['tflops']:.0f} TFLOP/s",
              f"{x['ratio_direct_over_kvcore']:.3f}"] for x in r["prefill"]]))
    if r["decode"]:
        parts.append(markdown(
            ["one-layer decode", "kvcore us", "direct us", "direct / kvcore",
             "direct in FlashInfer's CUDA-graph mode us"],
            [[x["shape"], f"{x['kvcore']['time_us']:.1f}", f"{x['direct']['time_us']:.1f}",
              f"{x['ratio_direct_over_kvcore']:.3f}", f"{x['direct_graph_mode']['time_us']:.1f}"]
             for x in r["decode"]]))
    if r["steps"]:
        parts.append(markdown(
            ["32-layer decode step", "step us", "kernels us", "host overhead"],
            [[x["shape"], f"{x['step_us']:.0f}", f"{x['kernels_us']:.0f}",
              f"{x['host_overhead_pct']:.1f}%"] for x in r["steps"]]))
    if r["build_cpu"]:
        parts.append(markdown(
            ["build() on the CPU (plan a no-op)", "us per build", "plans per step"],
            [[f"{x['shape']} {x['build']}", f"{x['us_per_build']:.0f}",
              f"{x['plans_per_step']:.3f}"] for x in r["build_cpu"]]))
    if r["errors"]:
        parts.append(harness.errors_line(r))
    return "\n\n".join(parts)


def main() -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--cpu", action="store_true",
                        help="time build() on the CPU against a no-op FlashInfer stand-in")
    args = parser.parse_args()
    run = Run(Path(args.out), "bench_flashinfer",
              ("warmup", "correctness", "prefill", "decode", "steps", "build_cpu"),
              checks="correctness", device="cpu" if args.cpu else "cuda")
    meta = run.results["meta"]
    meta.update(harness.run_meta("cpu" if args.cpu else "cuda"), cpu=args.cpu,
                shapes=dict(hq=HQ, hk=HK, d=D, bs=BS, dtype=str(DTYPE)))
    if args.cpu:
        with run.section("build() on the CPU"):
            build_cpu(run)
        run.log("\n" + summary_table(run))
        run.save()
        return 1 if run.results["errors"] else 0
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except Exception as exc:
        meta["flashinfer"] = f"unavailable: {type(exc).__name__}: {exc}"
        run.log(json.dumps(meta))
        run.save()
        return 1
    run.log(json.dumps(meta))
    torch.manual_seed(0)
    with run.section("warmup"):
        warmup(run)
    correctness(run)
    prefill(run)
    decode(run)
    steps(run)
    run.log("\n" + summary_table(run))
    run.save()
    return 1 if run.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
