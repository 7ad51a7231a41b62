#!/usr/bin/env python3
"""TRITON_MLA's decode on an fp8 e4m3 latent cache beside its bf16 decode, per kernel option,
and FlashInfer's MLA wrapper on the same caches, on one GPU.

DeepSeek-V3's latent (kv_lora_rank 512 + rope 64, bf16 queries, softmax scale of its 128 + 64
query dims) in blocks of ``--block-size`` (16, as ``bench_matrix.py --block-size 16``), at 16
heads (8-way tensor parallelism) for B x L in {64 x 4096, 8 x 32768} and at 128 heads for
64 x 4096. One run, each section isolated (an error is logged and the run goes on):

0. precompile: every launch below compiled at once, one process each (``--compile-workers``,
   by default cores - 2, at most 14), and FlashInfer's bf16 and fp8 MLA modules built beside
   them, for at most ``--precompile-s`` seconds (60), so the budget goes to timing (FlashInfer
   is left out if its build did not finish);
1. the read ceiling (torch ``sum`` and a Triton streaming read of 2 GiB, the faster counts);
2. per shape, TRITON_MLA's op (``kvcore_mla.ops.triton_mla_attention.mla_attention``, the
   launches of the backend's forward, with a plan of config, split count and workspace as its
   builder makes) on a bf16 cache and on an fp8 e4m3 cache of the same values (per-tensor scale
   amax / 448, a one-element device tensor as an engine passes it), per kernel option:

   - ``row``: the ``MLA_DECODE_CONFIGS`` row for the head count (bf16 and fp8 caches), and
     the fp8 cache with its ``fp8_fp16`` on (the row as shipped has it off);
   - at 16 heads, other tiles with ``fp8_fp16`` on (``OPTIONS``), and each tile on the bf16
     cache (where ``fp8_fp16`` changes nothing), so every option has its fp8 / bf16 ratio;

   each at the split count TRITON_MLA's builder picks for its tile
   (``mla_decode_num_splits``); every call checked against the float64 reference
   (``kvcore.ops.mla_attention_ref``) on its cache's values, on four requests, first;
3. FlashInfer's ``BatchMLAPagedAttentionWrapper`` (``bench_flashinfer_mla.flashinfer_mla_direct``,
   planned once) on the same bf16 and fp8 caches, checked against the row's output, if
   flashinfer imports (``--no-flashinfer`` skips it); last, so its JIT cannot cost the rest.

Times are medians of CUDA-graph replays (:func:`kvcore.cli.harness.time_call`); the timing
sections stop at ``--budget-s`` seconds (default 90) into the run. The table printed last gives
each call's time, the bytes it must read per second (each latent once, the query and output),
their share of the read ceiling, the option's fp8 / bf16 time (0.5 would be read-bound on half
the bytes), fp8 with ``fp8_fp16`` on over the row with it off, and FlashInfer's time over this
one on the same cache; then, per shape, the fastest fp8 option. Logs and JSON go to ``--out``
(default ``$OUT``, else ``benchmarks/results``). ``--smoke`` runs tiny shapes on the CPU under
``TRITON_INTERPRET=1`` to check the script.

Usage: ``python benchmarks/bench_mla_fp8_decode.py [--out DIR] [--budget-s 90]
[--block-size 16] [--no-flashinfer] [--compile-workers N] [--precompile-s 60] [--smoke]``;
at most ``budget-s`` and the table's seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
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

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "plugins" / "mla"), str(Path(__file__).parent)]
import kvcore.ops as ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, Skip, rel_err  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE, FP8 = torch.bfloat16, torch.float8_e4m3fn
RANK, ROPE = 512, 64
SCALE = (128 + 64) ** -0.5  # DeepSeek's qk_nope_head_dim + qk_rope_head_dim
#: (heads, batch, tokens): 16 heads at 8-way tensor parallelism, 128 on one GPU.
SHAPES = [(16, 64, 4096), (16, 8, 32768), (128, 64, 4096)]
#: Kernel options beside the table's row, at 16 heads: (name, kernel, block_h, block_n,
#: num_warps, num_stages), timed with ``fp8_fp16`` on (fp8 cache) and on the bf16 cache.
#: "plain" is ``triton_mla_decode``, "halves" ``triton_mla_decode_halves``.
OPTIONS = [("w8", "plain", 16, 64, 8, 3), ("halves w8", "halves", 16, 64, 8, 3),
           ("w8 s2", "plain", 16, 64, 8, 2), ("n32", "plain", 16, 32, 4, 3),
           ("halves", "halves", 16, 64, 4, 3)]
CHECKED_REQUESTS = 4  # requests of a batch checked against the float64 reference
if SMOKE:
    RANK, ROPE = 64, 16
    SHAPES = [(16, 4, 256), (16, 2, 700)]
    OPTIONS = [("n32 halves", "halves", 16, 32, 4, 2)]


def mla_ops():
    from kvcore_mla.ops import mla_configs, triton_mla_attention

    return mla_configs, triton_mla_attention


def tile(kernel: str, block_h: int, block_n: int, warps: int, stages: int):
    configs, _ = mla_ops()
    cls = configs.TritonMLAHalvesConfig if kernel == "halves" else configs.TritonMLADecodeConfig
    return cls(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)


def short(cfg) -> str:
    """A config as ``plain 16/64 w4 s3 fp16`` (``fp16``: fp8_fp16 on)."""
    kind = {"triton_mla_decode": "plain", "triton_mla_decode_halves": "halves",
            "triton_mla_decode_tma_keysplit": "tma", "gluon_mla_ws": "gluon"}[cfg.kernel]
    if kind == "gluon":
        return "gluon 64/64"
    return (f"{kind} {cfg.block_h}/{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            f"{' fp16' if getattr(cfg, 'fp8_fp16', False) else ''}")


@dataclasses.dataclass
class Batch:
    """``b`` decode requests of ``length`` tokens with ``heads`` query heads over a shuffled
    paged latent cache ``(num_blocks, block_size, RANK + ROPE)``: bf16 values, and the same
    values in fp8 e4m3 with a per-tensor scale (amax / 448)."""

    heads: int
    b: int
    length: int
    block_size: int

    def __post_init__(self) -> None:
        pages = -(-self.length // self.block_size)
        num_blocks = self.b * pages + 16
        entry = RANK + ROPE
        self.cache = torch.empty(num_blocks, self.block_size, entry,
                                 device=DEVICE).normal_().to(DTYPE)
        self.k_scale = (self.cache.abs().amax().float() / 448).reshape(1)
        self.cache8 = ops.quantize_to_cache(self.cache, FP8, self.k_scale.item())
        perm = torch.randperm(num_blocks, device=DEVICE)[: self.b * pages]
        self.block_table = perm.view(self.b, pages).to(torch.int32)
        self.seq_lens = torch.full((self.b,), self.length, dtype=torch.int32, device=DEVICE)
        self.qsl = torch.arange(self.b + 1, dtype=torch.int32, device=DEVICE)
        self.q = torch.empty(self.b, self.heads, entry, device=DEVICE).normal_().to(DTYPE)

    @property
    def shape(self) -> str:
        return f"{self.b}x{self.length} H{self.heads}"

    def args(self, fp8: bool, requests: int | None = None) -> dict:
        """The op's arguments for the fp8 or the bf16 cache (the first ``requests``)."""
        n = self.b if requests is None else min(requests, self.b)
        extra = dict(kv_cache_dtype="fp8_e4m3", k_scale=self.k_scale) if fp8 else {}
        return dict(kv_cache=self.cache8 if fp8 else self.cache, kv_lora_rank=RANK,
                    query_start_loc=self.qsl[:n + 1], seq_lens=self.seq_lens[:n],
                    block_table=self.block_table[:n], scale=SCALE, max_query_len=1,
                    max_seq_len=self.length, **extra)

    def read_bytes(self, fp8: bool) -> int:
        """Bytes a decode must move: each latent once, the query and the output."""
        latent = self.b * self.length * (RANK + ROPE) * (1 if fp8 else DTYPE.itemsize)
        return latent + self.q.numel() * DTYPE.itemsize + self.b * self.heads * RANK * 2

    def call(self, fp8: bool, cfg) -> Callable[[], torch.Tensor]:
        """The op on the whole batch with ``cfg`` at the builder's split count for it, a plan
        holding its workspace (nothing allocated per call)."""
        configs, mod = mla_ops()
        splits = configs.mla_decode_num_splits(self.b, self.heads, self.length, cfg,
                                               ops.num_sms(torch.device(DEVICE)))
        workspace = torch.empty(max(1, mod.mla_workspace_numel(self.b, self.heads, RANK,
                                                                splits)),
                                dtype=torch.float32, device=DEVICE)
        plan = configs.TritonMLAPlan(cfg, splits, workspace)
        out = torch.empty(self.b, self.heads, RANK, dtype=DTYPE, device=DEVICE)
        args = self.args(fp8)
        return lambda: mod.mla_attention(self.q, **args, output=out, plan=plan)


def table_row(heads: int, block_size: int, fp8: bool):
    """The table's config for ``heads`` query heads and the bf16 or fp8 cache on this GPU (the
    Gluon and TMA rows where such a cache allows them, as the op chooses)."""
    configs, _ = mla_ops()
    return configs.mla_decode_config(heads, configs.gpu_family(DEVICE), page_size=block_size,
                                     fp8_cache=fp8, dtype=DTYPE)


def launches(heads: int, block_size: int) -> list[tuple[str, bool, object]]:
    """``(option, fp8, config)`` of every TRITON_MLA call timed at a shape of ``heads``."""
    bf16_row, fp8_row = table_row(heads, block_size, False), table_row(heads, block_size, True)
    found = [("row", False, bf16_row), ("row", True, fp8_row),
             ("row", True, dataclasses.replace(fp8_row, fp8_fp16=True))]
    if heads == 16:
        for name, *spec in OPTIONS:
            cfg = tile(*spec)
            found += [(name, False, cfg), (name, True, dataclasses.replace(cfg, fp8_fp16=True))]
    return found


# ----------------------------------------------------------------------------- precompile


def compile_job(job: list) -> str:
    """Worker: one launch of :func:`launches` (or FlashInfer's module of one cache dtype) on
    the real shape, so Triton's (FlashInfer's) disk cache holds it for the main process."""
    ops.set_value_checks(False)
    heads, b, length, block_size, index = job[1:6]
    batch = Batch(heads, b, length, block_size)
    if job[0] == "flashinfer":
        flashinfer_call(batch, bool(index))()
        torch.cuda.synchronize()
        return f"flashinfer fp8={bool(index)}"
    option, fp8, cfg = launches(heads, block_size)[index]
    batch.call(fp8, cfg)()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return f"{batch.shape} {option} {'fp8' if fp8 else 'bf16'} {short(cfg)}"


def precompile(run: Run, workers: int, block_size: int, flashinfer: bool,
               deadline_s: float) -> tuple[set[tuple], bool]:
    """Every launch compiled at once, one process each, ``workers`` at once, for at most
    ``deadline_s`` seconds (unfinished processes are stopped: their Triton launches compile
    when first timed). Returns the ``(shape, option, fp8)`` whose compile failed (left out of
    the timings: a compiler crash aborts a process, so it costs one option, not the run) and
    whether FlashInfer's modules were built (if not, FlashInfer is left out: a cold build can
    take minutes)."""

    configs, _ = mla_ops()
    sms = ops.num_sms(torch.device(DEVICE))
    jobs, seen = [], set()
    if flashinfer:  # the longest jobs first: FlashInfer's builds, then the 64-head programs
        heads, b, length = SHAPES[0]
        jobs += [["flashinfer", heads, b, length, block_size, fp8] for fp8 in (0, 1)]
    for heads, b, length in sorted(SHAPES, key=lambda shape: -shape[0]):
        for i, (_, _, cfg) in enumerate(launches(heads, block_size)):
            # Triton specialises an int on being 1 or a multiple of 16: one compile per class
            # of split counts (the merge kernel, compiled per count, takes a second).
            splits = configs.mla_decode_num_splits(b, heads, length, cfg, sms)
            key = (heads, i, 1 if splits == 1 else 16 if splits % 16 == 0 else 2)
            if key not in seen:
                seen.add(key)
                jobs.append(["triton", heads, b, length, block_size, i])

    t0 = time.time()
    commands = [[sys.executable, str(Path(__file__).resolve()), "--compile-job", json.dumps(job),
                 *(["--smoke"] if SMOKE else [])] for job in jobs]
    results = harness.run_children(commands, workers, deadline_s)
    failed, flashinfer_built = set(), flashinfer
    unfinished = sum(cut for _, _, cut in results)
    for job, (rc, said, cut) in zip(jobs, results, strict=True):
        done = rc == 0
        if job[0] == "flashinfer":
            flashinfer_built &= done
        if not done and not cut:
            run.log(f"precompile {job}: rc {rc}: {said}")
            if job[0] == "triton":
                option, fp8, _ = launches(job[1], block_size)[job[5]]
                failed |= {(f"{b}x{length} H{heads}", option, fp8)
                           for heads, b, length in SHAPES if heads == job[1]}
    run.results["meta"]["precompile"] = dict(
        seconds=time.time() - t0, jobs=len(jobs), workers=workers, failed=len(failed),
        unfinished=unfinished, flashinfer_built=flashinfer_built)
    run.log(f"precompiled {len(jobs)} launches in {time.time() - t0:.1f} s with {workers} "
            f"processes; {len(failed)} failed, {unfinished} stopped at the {deadline_s:.0f} s "
            f"deadline; FlashInfer built: {flashinfer_built}")
    return failed, flashinfer_built


# ----------------------------------------------------------------------------- sections


def add_timing(run: Run, batch: Batch, cache: str, impl: str, option: str, seconds: float,
               how: str, cfg=None, **info: object) -> None:
    nbytes = batch.read_bytes(cache == "fp8")
    row = {"shape": batch.shape, "cache": cache, "impl": impl, "option": option,
           "config": short(cfg) if cfg is not None else "", "time_us": seconds * 1e6,
           "GBps": nbytes / seconds / 1e9, "bytes": nbytes, "method": how, **info}
    run.results["timings"].append(row)
    run.log(f"{batch.shape} {cache} {impl} {option} {row['config']}: {row['time_us']:.1f} us, "
            f"{row['GBps']:.0f} GB/s [{how}]")


def reference(batch: Batch, fp8: bool) -> torch.Tensor:
    """The float64 reference of the first requests on the fp8 or the bf16 cache."""
    args = batch.args(fp8, CHECKED_REQUESTS)
    del args["max_query_len"], args["max_seq_len"]
    if not fp8:
        args["kv_cache"] = args["kv_cache"].double()
    return ops.mla_attention_ref(batch.q[:CHECKED_REQUESTS].double(), **args)


def time_triton(run: Run, batch: Batch, failed: set[tuple]) -> torch.Tensor | None:
    """Every launch of :func:`launches` at this shape, each checked against the float64
    reference on its cache first; the fp8 row's output (FlashInfer's check)."""
    refs = {fp8: reference(batch, fp8) for fp8 in (False, True)}
    n = CHECKED_REQUESTS
    row_out = None
    for option, fp8, cfg in launches(batch.heads, batch.block_size):
        if run.budget_s and run.elapsed() > run.budget_s:
            run.log(f"budget of {run.budget_s:.0f} s spent: {batch.shape}'s other options are "
                    "left out")
            break
        if (batch.shape, option, fp8) in failed:
            continue
        cache = "fp8" if fp8 else "bf16"
        fn = batch.call(fp8, cfg)
        out = fn().clone()
        err = rel_err(out[:n], refs[fp8])
        run.check(f"{batch.shape}.{cache}.{option}.{short(cfg)}_vs_reference", err < 2e-2,
                  rel_err=err)
        if fp8 and option == "row" and not getattr(cfg, "fp8_fp16", False):
            row_out = out
        t, how = time_call(fn)
        add_timing(run, batch, cache, "TRITON_MLA", option, t, how, cfg)
    return row_out


def flashinfer_call(batch: Batch, fp8: bool) -> Callable[[], torch.Tensor]:
    try:
        import flashinfer.mla  # noqa: F401
    except ImportError as exc:
        raise Skip(f"flashinfer does not import: {exc}") from exc
    from bench_flashinfer_mla import flashinfer_mla_direct

    import kvcore

    common = kvcore.build_attention_metadata(
        [1] * batch.b, [batch.length - 1] * batch.b, batch.block_table.tolist(),
        batch.block_size, device=DEVICE)
    return flashinfer_mla_direct(batch.q, batch.cache8 if fp8 else batch.cache, common, SCALE,
                                 k_scale=batch.k_scale.item() if fp8 else None)


def time_flashinfer(run: Run, batch: Batch, row_out: torch.Tensor | None) -> None:
    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        fn = flashinfer_call(batch, fp8)
        info = {}
        if fp8 and row_out is not None:
            info["rel_err_vs_triton"] = err = rel_err(fn(), row_out)
            run.check(f"{batch.shape}.fp8.flashinfer_vs_triton_row", err < 2e-2, rel_err=err)
        t, how = time_call(fn)
        add_timing(run, batch, cache, "flashinfer", "direct", t, how, **info)


# ----------------------------------------------------------------------------- report


def summary_table(run: Run) -> list[str]:
    """One row per timing (see the module docstring), then the fastest fp8 option per shape."""
    ceiling = run.results["ceilings"].get("read_GBps")
    timings = run.results["timings"]

    def find(shape: str, cache: str, impl: str, option: str, fp16: bool | None = None):
        return next((t for t in timings if (t["shape"], t["cache"], t["impl"], t["option"]) ==
                     (shape, cache, impl, option)
                     and (fp16 is None or t["config"].endswith(" fp16") == fp16)), None)

    rows = []
    for t in timings:
        fp8 = t["cache"] == "fp8"
        bf16 = find(t["shape"], "bf16", t["impl"], t["option"])
        off = find(t["shape"], "fp8", "TRITON_MLA", "row", fp16=False)
        fi = find(t["shape"], t["cache"], "flashinfer", "direct")
        rows.append([
            t["shape"], t["cache"], t["impl"], t["option"], t["config"], f"{t['time_us']:.1f}",
            f"{t['GBps']:.0f}", f"{100 * t['GBps'] / ceiling:.1f}%" if ceiling else "-",
            f"{t['time_us'] / bf16['time_us']:.2f}" if bf16 and fp8 else "-",
            f"{t['time_us'] / off['time_us']:.2f}" if off and fp8 and t["impl"] != "flashinfer"
            else "-",
            f"{fi['time_us'] / t['time_us']:.2f}" if fi and t["impl"] != "flashinfer" else "-",
        ])
    headers = ["shape", "cache", "impl", "option", "config", "us", "GB/s", "% read ceiling",
               "fp8/bf16", "/fp8 row", "FI/this"]
    lines = [harness.format_table(rows, headers, tablefmt="simple")]
    for shape in dict.fromkeys(t["shape"] for t in timings):
        fp8 = [t for t in timings if t["shape"] == shape and t["cache"] == "fp8"
               and t["impl"] == "TRITON_MLA"]
        bf16 = find(shape, "bf16", "TRITON_MLA", "row")
        if fp8:
            best = min(fp8, key=lambda t: t["time_us"])
            lines.append(f"{shape}: fastest fp8 TRITON_MLA option {best['option']} "
                         f"({best['config']}) {best['time_us']:.1f} us"
                         + (f", bf16 row {bf16['time_us']:.1f} us" if bf16 else ""))
    return lines


def main() -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="stop timing new options this many seconds into the run")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer")
    parser.add_argument("--compile-workers", type=int,
                        default=0 if SMOKE else max(1, min(14, (os.cpu_count() or 4) - 2)),
                        help="processes compiling the launches before the timings (0: none)")
    parser.add_argument("--precompile-s", type=float, default=60.0,
                        help="stop the precompile after this many seconds")
    parser.add_argument("--compile-job", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.compile_job:
        print(compile_job(json.loads(args.compile_job)))
        return 0
    block_size = 16 if SMOKE else args.block_size
    flashinfer = not (args.no_flashinfer or SMOKE)
    run = Run(Path(args.out), "bench_mla_fp8_decode", ("correctness", "timings"),
              checks="correctness", device=DEVICE, budget_s=args.budget_s)
    meta = run.results["meta"]
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE, triton=harness.triton_version(),
                shapes=dict(rank=RANK, rope=ROPE, block_size=block_size, dtype=str(DTYPE),
                            kv_fp8=str(FP8), shapes=SHAPES))
    run.log(json.dumps(meta))
    torch.manual_seed(0)
    ops.set_value_checks(False)  # timing: no host reads inside the calls

    failed: set[tuple] = set()
    if args.compile_workers > 0:
        with run.section("precompile"):
            failed, built = precompile(run, args.compile_workers, block_size, flashinfer,
                                       args.precompile_s)
            if flashinfer and not built:
                run.log("FlashInfer's modules were not built in the precompile: it is left "
                        "out (--no-flashinfer skips it; a second run finds them cached)")
                flashinfer = False
    with run.section("read ceiling"):
        harness.read_ceiling(run, DEVICE, time_call, SMOKE)
    batches, row_outs = {}, {}
    for heads, b, length in SHAPES:
        with run.section(f"TRITON_MLA decode {b}x{length} H{heads}"):
            batches[heads, b, length] = batch = Batch(heads, b, length, block_size)
            row_outs[heads, b, length] = time_triton(run, batch, failed)
    if flashinfer:
        for key, batch in batches.items():
            if run.budget_s and run.elapsed() > run.budget_s:
                run.log("budget spent: FlashInfer left out")
                break
            with run.section(f"flashinfer MLA decode {batch.shape}"):
                time_flashinfer(run, batch, row_outs.get(key))
    ops.set_value_checks(True)

    return run.finish_checked(after=[
        f"read ceiling: {run.results['ceilings'].get('read_GBps', 0):.0f} GB/s",
        *summary_table(run)])


if __name__ == "__main__":
    sys.exit(main())
