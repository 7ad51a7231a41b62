#!/usr/bin/env python3
"""TRITON_ATTN's decode on an fp8 e4m3 KV cache beside its bf16 decode and FlashInfer's, on one GPU.

``--layer`` picks the attention layer, bf16 queries, block 16, at B x L in {64 x 4096,
8 x 32768}: ``llama3-8b`` (default; Hq 32, Hk 8, D 128), ``gemma2-sliding`` (Gemma-2-9B's
sliding-window layer: Hq 16, Hk 8, D 256, logit soft-cap 50, window 4096) or
``gpt-oss-full`` (gpt-oss-20B's full layers: Hq 64, Hk 8, D 64, sinks left out) or
``llama3-70b-tp8`` (Llama-3.1-70B at tensor-parallel 8: Hq 8, Hk 1, D 128). One run, each
section isolated (an error is logged and the run goes on):

0. precompile: every Triton launch below (and FlashInfer's two modules) built at once, one
   process each (``--compile-workers``), for at most ``--precompile-s`` seconds, so the budget
   goes to timing (an unfinished Triton launch compiles when first timed; FlashInfer is left
   out when its build did not finish);
1. the read ceiling (torch ``sum`` and a Triton streaming read of 2 GiB);
2. per shape, TRITON_ATTN's op (:func:`kvcore.ops.triton_attention.paged_attention`, what the
   backend's ``forward`` calls) with kvcore's default configuration (no plan: the op's own
   choice, which may split an fp8 cache more and take the ``fp8_wide`` tile above head size
   128) on a bf16 cache and on an fp8 e4m3 cache holding the same values (per-tensor scales,
   one-element device tensors as an engine passes them), each checked against
   :func:`kvcore.ops.paged_attention_ref` on four of the requests first; and fp8 with the
   default config's ``fp8_fp16=False``, the fp8 path as it was before fp16 products (fp8
   tiles converted to bf16 after shared memory);
3. fp8 with the layer's candidate tiles, split counts and register caps (explicit
   ``TritonDecodeConfig`` / ``TritonSplitKVConfig`` plans; time-boxed by ``--budget-s``),
   for choosing an fp8 row of ``DECODE_TILES``;
4. FlashInfer, when it imports: ``BatchDecodeWithPagedKVCacheWrapper(NHD,
   use_tensor_cores=True)`` on the same caches (``run(q, (k_cache, v_cache))``; fp8 planned
   with ``kv_data_type=torch.float8_e4m3fn`` and run with ``k_scale``/``v_scale``; the
   layer's soft-cap and window as ``logits_soft_cap`` / ``window_left``), checked against
   kvcore's output; last, so its JIT build cannot cost the rest.

Times are medians of CUDA-graph replays (:func:`kvcore.cli.harness.time_call`). The table
printed last gives each call's time, the bytes it must read per second and their share of the
read ceiling, and the fp8 / bf16 ratio of each implementation (0.5 would be read-bound on half
the bytes). Logs and JSON go to ``--out`` (default ``$OUT``, else ``benchmarks/results``),
named ``bench_fp8_decode`` (``bench_fp8_decode_<layer>`` for a layer other than the default).
``--smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1`` to check the script.

Usage: ``python benchmarks/bench_fp8_decode.py [--layer NAME] [--out DIR] [--budget-s 150]
[--compile-workers N] [--precompile-s 70] [--no-flashinfer] [--smoke]``
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore.ops as ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, Skip, rel_err  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE, FP8 = torch.bfloat16, torch.float8_e4m3fn
BS = 16
SHAPES = [(64, 4096), (8, 32768)] if not SMOKE else [(4, 256), (2, 1024)]
CHECKED_REQUESTS = 4  # requests of a batch checked against the reference


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An fp8 config to time beside the default: its tile, ``splits`` (0: kvcore's count for
    the shape on the bf16 cache; -1: on the fp8 cache, which may be more) and register cap;
    ``shapes``: the ``BxL`` shapes it is timed at (``None``: all)."""

    block_n: int
    num_warps: int
    num_stages: int
    splits: int = 0
    max_registers: int | None = None
    shapes: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Layer:
    """An attention layer: heads, head size, soft-cap and window, and its fp8 candidates (most
    promising first); ``smoke``: (Hq, Hk, D) of ``--smoke``."""

    name: str
    hq: int
    hk: int
    d: int
    soft_cap: float | None
    window: int | None
    candidates: tuple[Candidate, ...]
    smoke: tuple[int, int, int]


LAYERS = {
    "llama3-8b": Layer("Llama-3.1-8B", 32, 8, 128, None, None, (
        Candidate(32, 4, 4), Candidate(64, 4, 3), Candidate(64, 8, 3), Candidate(32, 4, 3),
        Candidate(64, 4, 4), Candidate(64, 4, 3, 8), Candidate(32, 4, 3, 8),
        Candidate(64, 4, 3, 16), Candidate(128, 8, 3), Candidate(64, 4, 3, 12),
        Candidate(64, 4, 3, 6), Candidate(64, 4, 3, 24)), smoke=(8, 2, 64)),
    # The fp8_wide tile's alternatives: the sm90 row's own tiles (3 programs an SM), the tail
    # of 64 x 4096's second wave cut by splits, other ways to 4 programs (16 warps) an SM.
    "gemma2-sliding": Layer("Gemma-2-9B sliding", 16, 8, 256, 50.0, 4096, (
        Candidate(32, 4, 3, 1, shapes=("64x4096",)),
        Candidate(64, 4, 3, -1, shapes=("8x32768",)),
        Candidate(32, 4, 3, 3, shapes=("64x4096",)),
        Candidate(32, 4, 2, 2, 128, shapes=("64x4096",)),
        Candidate(32, 4, 2, 8, 128, shapes=("8x32768",)),
        Candidate(32, 4, 3, -1, shapes=("8x32768",)),
        Candidate(64, 8, 3, -1, 128),
        Candidate(16, 4, 3, -1, 128),
        Candidate(32, 8, 3, -1)), smoke=(4, 2, 256)),
    # gpt-oss-20B's full layers (sinks left out: they do not change the loop).
    "gpt-oss-full": Layer("gpt-oss-20B full", 64, 8, 64, None, None, (
        Candidate(32, 4, 4), Candidate(64, 4, 3), Candidate(64, 8, 3), Candidate(32, 4, 3),
        Candidate(64, 4, 4), Candidate(64, 4, 3, 8), Candidate(32, 4, 3, 8),
        Candidate(128, 8, 3), Candidate(128, 4, 3), Candidate(64, 4, 2, 2, 128)),
        smoke=(8, 2, 64)),
    # Llama-3.1-70B at tensor-parallel 8: one KV head a rank, so a long request's grid is
    # almost all splits; the candidates sweep the split count at the default tile.
    "llama3-70b-tp8": Layer("Llama-3.1-70B TP8", 8, 1, 128, None, None, (
        Candidate(64, 4, 3, 16), Candidate(64, 4, 3, 24), Candidate(64, 4, 3, 32),
        Candidate(64, 4, 3, 48), Candidate(32, 4, 4, 32), Candidate(32, 4, 3, 64),
        Candidate(128, 8, 3, 16), Candidate(128, 8, 3, 32), Candidate(64, 4, 3, 8),
        Candidate(64, 4, 3, 40), Candidate(64, 4, 3, 49), Candidate(64, 4, 3, 56)),
        smoke=(4, 1, 64)),
}
SMOKE_CANDIDATES = (Candidate(32, 4, 4), Candidate(64, 4, 3, 2, 128))


def layer_dims(layer: Layer) -> tuple[int, int, int]:
    """(Hq, Hk, D) the run uses: the layer's, or its small ones under ``--smoke``."""
    return layer.smoke if SMOKE else (layer.hq, layer.hk, layer.d)


def candidates(layer: Layer, shape: str) -> list[Candidate]:
    if SMOKE:
        return list(SMOKE_CANDIDATES)
    return [c for c in layer.candidates if c.shapes is None or shape in c.shapes]


@dataclasses.dataclass
class Batch:
    """``b`` decode requests of ``length`` tokens of ``layer`` over a shuffled paged cache in
    the standard NHD layout ``(num_blocks, 2, BS, Hk, D)``: bf16 values, and the same values
    in fp8 e4m3 with per-tensor scales (amax / 448). ``pool``: blocks the requests' pages
    share (``None``: a block of its own for every page), for a compile job that needs the
    shape, not the memory."""

    layer: Layer
    b: int
    length: int
    pool: int | None = None

    def __post_init__(self) -> None:
        self.hq, self.hk, self.d = layer_dims(self.layer)
        pages = -(-self.length // BS)
        num_blocks = self.pool or self.b * pages + 16
        self.kv = torch.empty(num_blocks, 2, BS, self.hk, self.d, device=DEVICE).normal_()
        self.kv = self.kv.to(DTYPE)
        self.k_scale = (self.kv[:, 0].abs().amax().float() / 448).reshape(1)
        self.v_scale = (self.kv[:, 1].abs().amax().float() / 448).reshape(1)
        self.kv8 = torch.empty(self.kv.shape, dtype=FP8, device=DEVICE)
        for half, scale in ((0, self.k_scale), (1, self.v_scale)):
            self.kv8[:, half] = ops.quantize_to_cache(self.kv[:, half], FP8, scale.item())
        perm = torch.randperm(num_blocks, device=DEVICE).repeat(-(-self.b * pages // num_blocks))
        perm = perm[: self.b * pages]
        self.block_table = perm.view(self.b, pages).to(torch.int32)
        self.seq_lens = torch.full((self.b,), self.length, dtype=torch.int32, device=DEVICE)
        self.qsl = torch.arange(self.b + 1, dtype=torch.int32, device=DEVICE)
        self.query = torch.empty(self.b, self.hq, self.d, device=DEVICE).normal_().to(DTYPE)
        self.scale = self.d ** -0.5

    @property
    def shape(self) -> str:
        return f"{self.b}x{self.length}"

    def cache(self, fp8: bool) -> dict:
        """The caches and the scale arguments of an fp8 or a bf16 call."""
        kv = self.kv8 if fp8 else self.kv
        k, v = kv.unbind(1)
        extra = dict(kv_cache_dtype="fp8_e4m3", k_scale=self.k_scale,
                     v_scale=self.v_scale) if fp8 else {}
        return dict(key_cache=k, value_cache=v, **extra)

    def step(self, requests: int | None = None) -> dict:
        n = self.b if requests is None else min(requests, self.b)
        return dict(query_start_loc=self.qsl[:n + 1], seq_lens=self.seq_lens[:n],
                    block_table=self.block_table[:n], scale=self.scale,
                    sliding_window=self.layer.window, logits_soft_cap=self.layer.soft_cap)

    def read_bytes(self, fp8: bool) -> int:
        """Bytes a decode must move: its K/V (within the window), the query and the output."""
        keys = min(self.length, self.layer.window or self.length)
        kv = 2 * self.b * keys * self.hk * self.d * (1 if fp8 else DTYPE.itemsize)
        return kv + 2 * self.query.numel() * DTYPE.itemsize


def triton_attention():
    from kvcore.ops import triton_attention as mod

    return mod


def default_config(layer: Layer, b: int, length: int, fp8: bool):
    """kvcore's default config for ``b`` requests of ``length`` tokens of ``layer`` on the
    fp8 or the bf16 cache on this device (imports triton)."""
    from kvcore.ops.attention_dispatch import default_config as choose

    hq, hk, d = layer_dims(layer)
    return choose(b, b, hq, hk, d, -(-length // BS) * BS, torch.device(DEVICE),
                  kv_cache_dtype="fp8_e4m3" if fp8 else "auto")


def candidate_config(layer: Layer, b: int, length: int, candidate: Candidate):
    """A candidate with the bf16 default's rows (block_q, g_pad) and block-size switch."""
    bf16 = default_config(layer, b, length, False)
    splits = candidate.splits
    if splits <= 0:
        splits = getattr(default_config(layer, b, length, splits < 0), "num_splits", 1)
    common = dict(block_q=bf16.block_q, g_pad=bf16.g_pad, block_n=candidate.block_n,
                  num_warps=candidate.num_warps, num_stages=candidate.num_stages,
                  const_block=bf16.const_block, max_registers=candidate.max_registers)
    if splits > 1:
        return ops.TritonSplitKVConfig(num_splits=splits, **common)
    return ops.TritonDecodeConfig(**common)


def short(cfg) -> str:
    if cfg is None:
        return ""
    cap = f"r{cfg.max_registers}" if cfg.max_registers else ""
    return (f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}{cap}"
            f"x{getattr(cfg, 'num_splits', 1)}{'' if cfg.fp8_fp16 else ' fp8->bf16'}")


def launches(layer: Layer, b: int, length: int) -> list[tuple[bool, object]]:
    """Every kvcore launch the run times at ``b x length``: (fp8, config; ``None``: the
    default), in the order of the sections."""
    default = default_config(layer, b, length, True)
    found = [(False, None), (True, None),
             (True, dataclasses.replace(default, fp8_fp16=not default.fp8_fp16))]
    for candidate in candidates(layer, f"{b}x{length}"):
        cfg = candidate_config(layer, b, length, candidate)
        if cfg != default:
            found.append((True, cfg))
    return found


# ----------------------------------------------------------------------------- precompile


def compile_job(layer: str, job: list) -> str:
    """Worker: one launch of :func:`launches` (or FlashInfer's module of one cache dtype) at
    its real shape, so Triton's (FlashInfer's) disk cache holds it for the main process."""
    ops.set_value_checks(False)
    kind, b, length, index = job
    batch = Batch(LAYERS[layer], b, length, pool=64)
    if kind == "flashinfer":
        flashinfer_decode(batch, bool(index))()
        torch.cuda.synchronize()
        return f"flashinfer fp8={bool(index)}"
    fp8, cfg = launches(batch.layer, b, length)[index]
    kvcore_call(batch, fp8, cfg)()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return f"{batch.shape} {'fp8' if fp8 else 'bf16'} {short(cfg) or 'default'}"


def precompile(run: Run, layer: str, workers: int, flashinfer: bool,
               deadline_s: float) -> bool:
    """Every launch compiled at once, one process each, ``workers`` at once, for at most
    ``deadline_s`` seconds (unfinished processes are stopped: their Triton launches compile
    when first timed). Returns whether FlashInfer's modules were built (if not, FlashInfer
    is left out: a cold build can take minutes)."""
    jobs = []
    if flashinfer:  # the longest jobs first
        b, length = SHAPES[0]
        jobs += [["flashinfer", b, length, fp8] for fp8 in (0, 1)]
    for b, length in SHAPES:
        # Under --smoke (nothing to compile) one launch a shape checks the path.
        count = 1 if SMOKE else len(launches(LAYERS[layer], b, length))
        jobs += [["triton", b, length, i] for i in range(count)]

    t0 = time.time()
    commands = [[sys.executable, str(Path(__file__).resolve()), "--layer", layer,
                 "--compile-job", json.dumps(job), *(["--smoke"] if SMOKE else [])]
                for job in jobs]
    results = harness.run_children(commands, workers, deadline_s)
    built, failed = flashinfer, 0
    for job, (rc, said, cut) in zip(jobs, results, strict=True):
        if job[0] == "flashinfer":
            built &= rc == 0
        if rc not in (0, None) and not cut:
            failed += 1
            run.log(f"precompile {job}: rc {rc}: {said}")
    unfinished = sum(cut for _, _, cut in results)
    run.results["meta"]["precompile"] = dict(
        seconds=time.time() - t0, jobs=len(jobs), workers=workers, failed=failed,
        unfinished=unfinished, flashinfer_built=built)
    run.log(f"precompiled {len(jobs)} launches in {time.time() - t0:.1f} s with {workers} "
            f"processes; {failed} failed, {unfinished} stopped at the {deadline_s:.0f} s "
            f"deadline; FlashInfer built: {built}")
    return built


# ----------------------------------------------------------------------------- sections


def add_timing(run: Run, batch: Batch, cache: str, impl: str, seconds: float, how: str,
               cfg=None, **info: object) -> None:
    nbytes = batch.read_bytes(cache == "fp8")
    row = {"shape": batch.shape, "cache": cache, "impl": impl, "config": short(cfg),
           "time_us": seconds * 1e6, "GBps": nbytes / seconds / 1e9, "bytes": nbytes,
           "method": how, **info}
    run.results["timings"].append(row)
    run.log(f"{batch.shape} {cache} {impl} {row['config']}: {row['time_us']:.1f} us, "
            f"{row['GBps']:.0f} GB/s [{how}]")


def kvcore_call(batch: Batch, fp8: bool, cfg=None) -> Callable[[], torch.Tensor]:
    ta = triton_attention()
    out = torch.empty_like(batch.query)
    plan = None if cfg is None else ops.TritonAttentionPlan(config=cfg)
    args = dict(**batch.cache(fp8), **batch.step(), output=out, plan=plan)
    return lambda: ta.paged_attention(batch.query, **args)


def check_kvcore(run: Run, batch: Batch, fp8: bool) -> torch.Tensor:
    """kvcore's default call against the reference on the first requests; its full output."""
    cache = "fp8" if fp8 else "bf16"
    ops.set_value_checks(True)
    n = min(CHECKED_REQUESTS, batch.b)
    ours = triton_attention().paged_attention(batch.query[:n], **batch.cache(fp8),
                                              **batch.step(n))
    ref = ops.paged_attention_ref(batch.query[:n], **batch.cache(fp8), **batch.step(n))
    err = rel_err(ours, ref)
    run.check(f"{batch.shape}.{cache}.kvcore_vs_reference", err < 1e-2, rel_err=err)
    ops.set_value_checks(False)  # timing: no host reads inside the calls
    full = kvcore_call(batch, fp8)()
    return full.clone()


def time_kvcore(run: Run, batch: Batch) -> dict[str, torch.Tensor]:
    """kvcore's default on the bf16 and the fp8 cache, and fp8 with ``fp8_fp16=False``; the
    defaults' outputs."""
    outs = {}
    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        outs[cache] = check_kvcore(run, batch, fp8)
        t, how = time_call(kvcore_call(batch, fp8))
        add_timing(run, batch, cache, "kvcore", t, how,
                   default_config(batch.layer, batch.b, batch.length, fp8))
    before = launches(batch.layer, batch.b, batch.length)[2][1]
    fn = kvcore_call(batch, True, before)
    err = rel_err(fn(), outs["fp8"])
    run.check(f"{batch.shape}.fp8.{short(before)}_vs_default", err < 1e-2, rel_err=err)
    t, how = time_call(fn)
    add_timing(run, batch, "fp8", f"kvcore fp8_fp16={before.fp8_fp16}", t, how, before)
    return outs


def sweep_fp8(run: Run, batch: Batch, default_out: torch.Tensor) -> None:
    """fp8 with the candidate configs until the budget is spent; each checked against the
    default config's output first."""
    for _, cfg in launches(batch.layer, batch.b, batch.length)[3:]:
        if run.budget_s and run.elapsed() > run.budget_s:
            run.log(f"budget of {run.budget_s:.0f} s spent: the other candidates are left out")
            return
        fn = kvcore_call(batch, True, cfg)
        err = rel_err(fn(), default_out)
        run.check(f"{batch.shape}.fp8.{short(cfg)}_vs_default", err < 1e-2, rel_err=err)
        t, how = time_call(fn)
        add_timing(run, batch, "fp8", "kvcore candidate", t, how, cfg)


def flashinfer_decode(batch: Batch, fp8: bool) -> Callable[[], torch.Tensor]:
    try:
        import flashinfer
    except ImportError as exc:
        raise Skip(f"flashinfer does not import: {exc}") from exc
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                            use_tensor_cores=True)
    pages = batch.block_table.shape[1]
    indptr = torch.arange(batch.b + 1, dtype=torch.int32, device=DEVICE) * pages
    last = torch.full((batch.b,), batch.length - (pages - 1) * BS, dtype=torch.int32,
                      device=DEVICE)
    layer = batch.layer
    wrapper.plan(indptr, batch.block_table.flatten(), last, batch.hq, batch.hk, batch.d, BS,
                 q_data_type=DTYPE, kv_data_type=FP8 if fp8 else DTYPE, sm_scale=batch.scale,
                 window_left=layer.window - 1 if layer.window else -1,
                 logits_soft_cap=layer.soft_cap or 0.0)
    kv = (batch.kv8 if fp8 else batch.kv).unbind(1)
    scales = dict(k_scale=batch.k_scale.item(), v_scale=batch.v_scale.item()) if fp8 else {}
    out = torch.empty_like(batch.query)
    return lambda: wrapper.run(batch.query, kv, out=out, **scales)


def time_flashinfer(run: Run, batch: Batch, outs: dict[str, torch.Tensor]) -> None:
    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        fn = flashinfer_decode(batch, fp8)
        err = rel_err(fn(), outs[cache])
        run.check(f"{batch.shape}.{cache}.flashinfer_vs_kvcore", err < 2e-2, rel_err=err)
        t, how = time_call(fn)
        add_timing(run, batch, cache, "flashinfer", t, how, rel_err_vs_kvcore=err)


# ----------------------------------------------------------------------------- report


def summary_table(run: Run) -> str:
    """One row per timing: time, GB/s of the bytes the call must read, share of the read
    ceiling, and the implementation's fp8 / bf16 time (defaults) and kvcore / FlashInfer on
    the same cache."""
    ceiling = run.results["ceilings"].get("read_GBps")
    timings = run.results["timings"]

    def find(shape: str, cache: str, impl: str) -> dict | None:
        return next((t for t in timings if (t["shape"], t["cache"], t["impl"]) ==
                     (shape, cache, impl)), None)

    rows = []
    for t in timings:
        bf16 = find(t["shape"], "bf16", "flashinfer" if t["impl"] == "flashinfer" else "kvcore")
        fi = find(t["shape"], t["cache"], "flashinfer")
        rows.append([
            t["shape"], t["cache"], t["impl"], t["config"], f"{t['time_us']:.1f}",
            f"{t['GBps']:.0f}", f"{100 * t['GBps'] / ceiling:.1f}%" if ceiling else "-",
            f"{t['time_us'] / bf16['time_us']:.2f}" if bf16 and t["cache"] == "fp8" else "-",
            f"{fi['time_us'] / t['time_us']:.2f}" if fi and t["impl"] != "flashinfer" else "-",
        ])
    headers = ["shape", "cache", "impl", "config", "us", "GB/s", "% read ceiling",
               "fp8/bf16", "FI/this"]
    return harness.format_table(rows, headers, tablefmt="simple")


def main() -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--layer", choices=sorted(LAYERS), default="llama3-8b",
                        help="the attention layer timed (default llama3-8b)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop the fp8 candidate sweep after this many seconds of the run")
    parser.add_argument("--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="processes compiling at once in the precompile")
    parser.add_argument("--precompile-s", type=float, default=70.0,
                        help="stop the precompile after this many seconds (0: no precompile)")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out")
    parser.add_argument("--compile-job", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.compile_job:
        print(compile_job(args.layer, json.loads(args.compile_job)))
        return 0
    layer = LAYERS[args.layer]
    # The default layer keeps the script's name for its files; another layer adds its own.
    name = "bench_fp8_decode" + ("" if args.layer == "llama3-8b" else f"_{args.layer}")
    run = Run(Path(args.out), name, ("correctness", "timings"),
              checks="correctness", device=DEVICE, budget_s=args.budget_s)
    meta = run.results["meta"]
    hq, hk, d = layer_dims(layer)
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE,
                shapes=dict(layer=layer.name, hq=hq, hk=hk, d=d, bs=BS, dtype=str(DTYPE),
                            kv_fp8=str(FP8), logits_soft_cap=layer.soft_cap,
                            sliding_window=layer.window))
    meta["triton"] = harness.triton_version()
    run.log(json.dumps(meta))
    torch.manual_seed(0)

    flashinfer = not args.no_flashinfer
    if flashinfer and importlib.util.find_spec("flashinfer") is None:
        flashinfer = False
        run.log("flashinfer is not installed: it is left out")
    if args.precompile_s > 0:
        with run.section("precompile"):
            built = precompile(run, args.layer, args.compile_workers, flashinfer,
                               args.precompile_s)
            if not built and flashinfer:
                run.log("FlashInfer's modules were not built in the precompile: it is left "
                        "out (run again, or with a longer --precompile-s)")
                flashinfer = False
    with run.section("read ceiling"):
        harness.read_ceiling(run, DEVICE, time_call, SMOKE)
    batches, outs = {}, {}
    for b, length in SHAPES:
        with run.section(f"kvcore decode {b}x{length}"):
            batches[b, length] = batch = Batch(layer, b, length)
            outs[b, length] = time_kvcore(run, batch)
    for key, batch in batches.items():
        if key in outs:
            with run.section(f"kvcore fp8 candidates {batch.shape}"):
                sweep_fp8(run, batch, outs[key]["fp8"])
    for key, batch in batches.items():
        if key in outs and flashinfer:
            with run.section(f"flashinfer decode {batch.shape}"):
                time_flashinfer(run, batch, outs[key])
    ops.set_value_checks(True)

    return run.finish_checked(
        before=[f"{layer.name} (Hq {hq}, Hk {hk}, D {d}, soft-cap {layer.soft_cap}, window "
                f"{layer.window}, block {BS}, bf16 queries)"],
        after=[f"read ceiling: {run.results['ceilings'].get('read_GBps', 0):.0f} GB/s",
               summary_table(run)])


if __name__ == "__main__":
    sys.exit(main())
