#!/usr/bin/env python3
"""kvcore's CUDA attention backends side by side on one GPU: decode and prefill.

For each shape (bf16, Hq 32, Hk 8, D 128, block 16) and each backend of TRITON_ATTN,
FLASHINFER, FLASH_ATTN that can run here, the backend is called as an engine calls it: its
builder's ``build()`` once (with ``graph_batch_size`` for a decode step when the backend
declares CUDA-graph support), then the layer's ``forward`` with a given output. Beside them,
FlashInfer's wrappers and flash-attn-4's ``flash_attn_varlen_func`` called directly, when
installed. Each shape runs, in order:

1. **correctness first**: every row's output against the float64 reference on its first
   requests (a compact copy of their pages), relative error ``||out - ref|| / ||ref||``;
2. **timing** (``kvcore.cli.harness.time_call``): a backend that declares CUDA-graph support
   for the step is timed from a captured graph of repeated calls (the kernels alone, as a
   replayed engine step runs them); one that does not is timed eagerly with CUDA events around
   back-to-back calls (host work included, as an engine runs it). FLASH_ATTN also gets a
   graph-timed row (its kernels alone) while it does not declare graph support; direct library
   calls are graph-timed.

Decode shapes (requests x tokens each): 64x4096, 8x32768, 256x1024, 16x4096; reported as us
and % of the read bandwidth measured in this run (``torch.sum`` over 2 GiB), counting the K
and V bytes of every request. Prefill shapes: 4 x 2048 new tokens, 1 x 8192 new tokens, 4 x 512
new tokens over a 16384-token cached prefix, causal; reported as TFLOP/s (4 * Hq * D flops
per attended query-key pair), % of ``--peak-tflops`` (default 790, the H200's bf16 dense
peak as the issue states it) and % of a bf16 8192^3 ``torch.matmul`` measured in this run (a
ceiling the device reaches today, beside the datasheet's). The table printed last has every
row.

Usage: ``python benchmarks/bench_backends.py [--json PATH] [--out DIR] [--smoke]``
(``--out`` default ``$OUT``, else ``benchmarks/results``; ``--json`` default
``<out>/bench_backends.json``). ``--smoke`` runs tiny shapes, TRITON_ATTN only, on the CPU
(Triton under ``TRITON_INTERPRET=1``) to check the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Skip, rel_err  # noqa: E402
from kvcore.ops import paged_attention_ref  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE = torch.float32 if SMOKE else torch.bfloat16
HQ, HK, D, BS = (4, 2, 32, 16) if SMOKE else (32, 8, 128, 16)
#: (requests, tokens each): the decode shapes of benchmarks/RESULTS.md.
DECODE = [(3, 40), (2, 70)] if SMOKE else [(64, 4096), (8, 32768), (256, 1024), (16, 4096)]
#: (name, requests, new tokens each, cached tokens each).
PREFILL = ([("2x24", 2, 24, 0), ("1x8+40", 1, 8, 40)] if SMOKE else
           [("4x2048", 4, 2048, 0), ("1x8192", 1, 8192, 0), ("4x512+16k", 4, 512, 16384)])
BACKENDS = ["TRITON_ATTN"] if SMOKE else ["TRITON_ATTN", "FLASHINFER", "FLASH_ATTN"]
#: Requests of each shape checked against the float64 reference.
CHECKED_REQUESTS = 2
#: ||out - ref|| / ||ref|| a bf16 kernel must stay under (fp32 in --smoke).
MAX_REL_ERR = 1e-4 if SMOKE else 2e-2


class Run(harness.Run):
    def __init__(self, out_dir: Path, json_path: Path | None) -> None:
        super().__init__(out_dir, "bench_backends", ("rows", "checks", "skipped"),
                         device=DEVICE)
        self.json_path = json_path

    def save(self) -> None:
        super().save()
        if self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.json_path.write_text(json.dumps(self.results, indent=1, default=str))


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run on this machine, or ``None``."""
    try:
        backend = kvcore.resolve_backend(name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    reasons = [*backend.unavailable_reasons(), *backend.import_reasons()]
    if not reasons and DEVICE == "cuda":
        capability = kvcore.DeviceCapability(*torch.cuda.get_device_capability())
        reasons = backend.validate_configuration(
            head_size=D, dtype=DTYPE, kv_cache_dtype="auto", block_size=BS, use_mla=False,
            has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=capability,
            attn_type="decoder")
    return "; ".join(reasons) if reasons else None


def flash_attn_4() -> Callable | None:
    """flash-attn-4's ``flash_attn_varlen_func`` when it is installed and imports."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


@dataclass
class Step:
    """One step's requests over a paged cache: ``q_lens`` new tokens after ``ctx_lens``."""

    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]] = field(default_factory=list)
    num_blocks: int = 0

    def __post_init__(self) -> None:
        pages = [-(-(q + c) // BS) for q, c in zip(self.q_lens, self.ctx_lens, strict=True)]
        self.num_blocks = sum(pages) + 8
        ids = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(
            sum(pages))).tolist()
        start = 0
        for n in pages:
            self.tables.append(ids[start:start + n])
            start += n

    @property
    def decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    def metadata(self, requests: slice = slice(None), **kw) -> kvcore.AttentionMetadata:
        return kvcore.build_attention_metadata(self.q_lens[requests], self.ctx_lens[requests],
                                               self.tables[requests], BS, device=DEVICE, **kw)


@dataclass
class Case:
    """A shape: the step, its inputs, the reference of its first requests, the work it does."""

    kind: str  # "decode" or "prefill"
    name: str
    step: Step
    query: torch.Tensor
    reference: torch.Tensor | None = None  # rows of the first CHECKED_REQUESTS requests
    checked_rows: int = 0

    @property
    def read_bytes(self) -> int:
        """K and V bytes every request reads (decode: the whole cache it attends)."""
        tokens = sum(q + c for q, c in zip(self.step.q_lens, self.step.ctx_lens, strict=True))
        return 2 * tokens * HK * D * DTYPE.itemsize

    @property
    def flops(self) -> float:
        """4 * Hq * D per attended (query, key) pair, causal."""
        pairs = sum(q * c + q * (q + 1) // 2
                    for q, c in zip(self.step.q_lens, self.step.ctx_lens, strict=True))
        return 4.0 * HQ * D * pairs


def make_case(kind: str, name: str, q_lens: list[int], ctx_lens: list[int]) -> Case:
    step = Step(q_lens, ctx_lens)
    gen = torch.Generator().manual_seed(len(q_lens) * 131 + sum(ctx_lens) + sum(q_lens))
    query = torch.randn(sum(q_lens), HQ, D, generator=gen).to(DEVICE, DTYPE)
    return Case(kind, name, step, query)


def fill(caches: kvcore.KVCaches, case: Case) -> None:
    """The same K/V values in every backend's cache (whatever its layout): drawn per
    (block, token) from one seed, written through the logical view."""
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    layer = caches.layers[0]
    for start in range(0, layer.shape[0], 4096):
        chunk = layer[start:start + 4096]
        chunk.copy_(torch.randn(chunk.shape, generator=gen, device=DEVICE, dtype=DTYPE))


def reference_of(case: Case, kv_cache: torch.Tensor) -> None:
    """The float64 reference of the case's first requests, on a compact copy of their pages."""
    k = min(CHECKED_REQUESTS, len(case.step.q_lens))
    tables = case.step.tables[:k]
    used = sorted({b for t in tables for b in t})
    renumber = {b: i for i, b in enumerate(used)}
    compact = kv_cache[torch.tensor(used, device=DEVICE)].double()
    meta = kvcore.build_attention_metadata(
        case.step.q_lens[:k], case.step.ctx_lens[:k], [[renumber[b] for b in t] for t in tables],
        BS, device=DEVICE)
    rows = meta.num_actual_tokens
    case.reference = paged_attention_ref(
        case.query[:rows].double(), *compact.unbind(1), query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens, block_table=meta.block_table, scale=D**-0.5)
    case.checked_rows = rows


@dataclass
class Runner:
    """One way to run a case: ``fn()`` writes the output; ``graphs``: graph-timed."""

    impl: str
    fn: Callable[[], torch.Tensor]
    graphs: bool
    path: str


def backend_runner(name: str, case: Case, kv_cache: torch.Tensor) -> list[Runner]:
    """The backend as an engine calls it: builder once, then the layer's forward."""
    backend = kvcore.resolve_backend(name)
    step = case.step
    n, b = step.metadata().num_actual_tokens, len(step.q_lens)
    spec = kvcore.FullAttentionSpec(block_size=BS, dtype=DTYPE, num_kv_heads=HK, head_size=D)
    max_len = max(q + c for q, c in zip(step.q_lens, step.ctx_lens, strict=True))
    builder = backend.get_builder_cls()(spec, num_heads=HQ, max_num_seqs=b,
                                        max_num_batched_tokens=max(n, b), max_model_len=max_len,
                                        device=DEVICE)
    declared = backend.CUDA_GRAPH_SUPPORT
    graphs = DEVICE == "cuda" and (
        declared is kvcore.CudaGraphSupport.ALWAYS
        or (declared is kvcore.CudaGraphSupport.UNIFORM_DECODE and step.decode))
    meta = builder.build(step.metadata(), graph_batch_size=b if graphs else None)
    impl = backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK)
    out = torch.empty(n, HQ, D, dtype=DTYPE, device=DEVICE)
    scales = kvcore.LayerScales()
    q = case.query

    def fn() -> torch.Tensor:
        return impl.forward(scales, q, q[:, :HK], q[:, :HK], kv_cache, meta, output=out)

    runners = [Runner(f"kvcore {name}", fn, graphs,
                      "builder + graph" if graphs else "builder + eager")]
    if name == "FLASH_ATTN" and not graphs and DEVICE == "cuda":
        # The kernels alone, as a graph replay would run them (not declared yet).
        runners.append(Runner(f"kvcore {name} [graph-timed, undeclared]", fn, True,
                              "builder + graph (graph support not declared)"))
    return runners


def flashinfer_direct(case: Case, kv_cache: torch.Tensor) -> Runner:
    """FlashInfer's wrapper on the FLASHINFER backend's NHD cache, planned once."""
    import flashinfer
    from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

    step = case.step
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    meta = step.metadata()
    indptr, indices, last = flashinfer_page_table(meta, BS)
    out = torch.empty_like(case.query)
    options = dict(q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=D**-0.5)
    if step.decode:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=True, backend="fa2")
        wrapper.plan(indptr, indices, last, HQ, HK, D, BS, **options)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
                                                                 backend="fa2")
        wrapper.plan(meta.query_start_loc, indptr, indices, last, HQ, HK, D, BS, causal=True,
                     **options)
    return Runner("flashinfer direct", lambda: wrapper.run(case.query, kv_cache, out=out),
                  True, "plan once + run")


def flash_attn_4_direct(case: Case, kv_cache: torch.Tensor, fa4: Callable) -> Runner:
    """flash-attn-4 on the FLASH_ATTN backend's cache halves, its metadata made once."""
    meta = case.step.metadata()
    key_cache, value_cache = kv_cache.unbind(1)
    out = torch.empty_like(case.query)

    def fn() -> torch.Tensor:
        result, _ = fa4(case.query, key_cache, value_cache,
                        cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
                        seqused_k=meta.seq_lens, max_seqlen_k=meta.max_seq_len,
                        page_table=meta.block_table, softmax_scale=D**-0.5, causal=True)
        return out.copy_(result)

    return Runner("flash-attn-4 direct", fn, True, "flash_attn_varlen_func")


def run_case(run: Run, case: Case, read_gbps: float, peak_tflops: float,
             matmul_tflops: float) -> None:
    fa4 = flash_attn_4() if DEVICE == "cuda" else None
    for name in BACKENDS:
        with run.section(f"{case.kind} {case.name} {name}"):
            why = unavailable(name)
            if why:
                raise Skip(f"{name}: {why}")
            caches = kvcore.allocate_kv_caches(
                name, num_layers=1, num_blocks=case.step.num_blocks, block_size=BS,
                num_kv_heads=HK, head_size=D, dtype=DTYPE, device=DEVICE, cross_layer=False)
            fill(caches, case)
            kv_cache = caches.layers[0]
            if case.reference is None:
                reference_of(case, kv_cache)
            runners = backend_runner(name, case, kv_cache)
            if name == "FLASHINFER":
                runners.append(flashinfer_direct(case, kv_cache))
            if name == "FLASH_ATTN" and fa4 is not None:
                runners.append(flash_attn_4_direct(case, kv_cache, fa4))
            for runner in runners:
                measure(run, case, runner, read_gbps, peak_tflops, matmul_tflops)
            del caches, kv_cache, runners


def measure(run: Run, case: Case, runner: Runner, read_gbps: float,
            peak_tflops: float, matmul_tflops: float) -> None:
    out = runner.fn()
    err = rel_err(out[:case.checked_rows], case.reference)
    run.check(f"{case.kind} {case.name} {runner.impl} vs float64 reference",
              err < MAX_REL_ERR, rel_err=err)
    seconds, how = time_call(runner.fn, graph=runner.graphs)
    row = {"kind": case.kind, "shape": case.name, "impl": runner.impl, "path": runner.path,
           "us": seconds * 1e6, "timing": how, "rel_err": err}
    if case.kind == "decode":
        row["GBps"] = case.read_bytes / seconds / 1e9
        row["pct_read_bw"] = 100 * row["GBps"] / read_gbps
        metric = f"{row['GBps']:.0f} GB/s, {row['pct_read_bw']:.1f}% of read bandwidth"
    else:
        row["TFLOPs"] = case.flops / seconds / 1e12
        row["pct_peak"] = 100 * row["TFLOPs"] / peak_tflops
        row["pct_matmul"] = 100 * row["TFLOPs"] / matmul_tflops
        metric = (f"{row['TFLOPs']:.0f} TFLOP/s, {row['pct_peak']:.1f}% of peak, "
                  f"{row['pct_matmul']:.1f}% of the measured matmul")
    run.results["rows"].append(row)
    run.log(f"{case.kind} {case.name} {runner.impl}: {row['us']:.1f} us, {metric} [{how}; "
            f"{runner.path}]")


def table(run: Run) -> str:
    lines = [f"{'kind':8} {'shape':12} {'impl':48} {'us':>10} {'metric':>30} {'rel_err':>9}"]
    for row in run.results["rows"]:
        metric = (f"{row['pct_read_bw']:.1f}% read bw" if row["kind"] == "decode"
                  else f"{row['TFLOPs']:.0f} TF/s {row['pct_peak']:.0f}% / "
                       f"{row['pct_matmul']:.0f}% mm")
        lines.append(f"{row['kind']:8} {row['shape']:12} {row['impl']:48} {row['us']:10.1f} "
                     f"{metric:>30} {row['rel_err']:9.1e}")
    failed = [c["check"] for c in run.results["checks"] if not c["ok"]]
    lines.append(f"checks: {len(run.results['checks']) - len(failed)} passed, "
                 f"{len(failed)} failed" + (f": {failed}" if failed else ""))
    for skip in run.results.get("skipped", []):
        lines.append(f"skipped {skip['section']}: {skip['reason']}")
    for error in run.results["errors"]:
        lines.append(f"ERROR {error['section']}: {error['error']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "")
                                                         or Path(__file__).parent / "results"))
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_backends needs a CUDA GPU (or --smoke)")
        return 1
    run = Run(args.out, args.json)
    run.results["meta"] = {"device": harness.device_name(DEVICE), "torch": torch.__version__,
                           "dtype": str(DTYPE), "heads": [HQ, HK], "head_size": D,
                           "block_size": BS, "peak_tflops": args.peak_tflops,
                           "flash_attn_4": flash_attn_4() is not None if not SMOKE else False}
    read_gbps = float("nan")
    with run.section("read bandwidth"):
        x = torch.empty((64 << 20) if SMOKE else (2 << 30), dtype=torch.uint8,
                        device=DEVICE).random_()
        read_gbps, how = harness.read_gbps(x.view(torch.bfloat16),
                                           functools.partial(time_call, graph=False),
                                           lambda t: t.sum(dtype=torch.float32))
        run.results["ceilings"]["read_torch_sum_GBps"] = read_gbps
        run.log(f"read bandwidth: {read_gbps:.0f} GB/s [{how}]")
        del x
    matmul = float("nan")
    with run.section("bf16 matmul"):
        matmul, how = harness.matmul_tflops(256 if SMOKE else 8192, torch.bfloat16, DEVICE,
                                            time_call)
        run.results["ceilings"]["matmul_bf16_TFLOPs"] = matmul
        run.log(f"bf16 matmul: {matmul:.0f} TFLOP/s [{how}]")
    for b, length in DECODE:
        case = make_case("decode", f"{b}x{length}", [1] * b, [length - 1] * b)
        run_case(run, case, read_gbps, args.peak_tflops, matmul)
    for name, b, q, ctx in PREFILL:
        case = make_case("prefill", name, [q] * b, [ctx] * b)
        run_case(run, case, read_gbps, args.peak_tflops, matmul)
    summary = table(run)
    run.log("\n" + summary)
    run.save()
    return 1 if run.results["errors"] or any(not c["ok"] for c in run.results["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
