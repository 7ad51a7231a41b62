#!/usr/bin/env python3
"""TRITON_ATTN's decode on an fp8 e4m3 KV cache beside its bf16 decode and FlashInfer's, on one GPU.

Llama-3.1-8B's layer (Hq 32, Hk 8, D 128, bf16 queries, block 16) at B x L in {64 x 4096,
8 x 32768}, one run, each section isolated (an error is logged and the run goes on):

1. the read ceiling (torch ``sum`` and a Triton streaming read of 2 GiB);
2. per shape, TRITON_ATTN's op (:func:`kvcore.ops.triton_attention.paged_attention`, what the
   backend's ``forward`` calls) with kvcore's default configuration (no plan: the op's own
   choice, which may split an fp8 cache more) on a bf16 cache and on an fp8 e4m3 cache
   holding the same values (per-tensor scales, one-element device tensors as an engine passes
   them), each checked against :func:`kvcore.ops.paged_attention_ref` on four
   of the requests first; and fp8 with the default config's ``fp8_fp16=False``, the fp8 path
   as it was before fp16 products (fp8 tiles converted to bf16 after shared memory);
3. fp8 with candidate tiles and split counts (explicit ``TritonDecodeConfig`` /
   ``TritonSplitKVConfig`` plans; time-boxed by ``--budget-s``), for choosing an fp8 row of
   ``DECODE_TILES``;
4. FlashInfer, when it imports: ``BatchDecodeWithPagedKVCacheWrapper(NHD,
   use_tensor_cores=True)`` on the same caches (``run(q, (k_cache, v_cache))``; fp8 planned
   with ``kv_data_type=torch.float8_e4m3fn`` and run with ``k_scale``/``v_scale``), checked
   against kvcore's output; last, so its JIT build cannot cost the rest.

Times are medians of CUDA-graph replays (:func:`kvcore.cli.harness.time_call`). The table
printed last gives each call's time, the bytes it must read per second and their share of the
read ceiling, and the fp8 / bf16 ratio of each implementation (0.5 would be read-bound on half
the bytes). Logs and JSON go to ``--out`` (default ``$OUT``, else ``benchmarks/results``).
``--smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1`` to check the script.

Usage: ``python benchmarks/bench_fp8_decode.py [--out DIR] [--budget-s 150] [--smoke]``
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
from kvcore.cli.harness import Run, Skip, rel_err  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE, FP8 = torch.bfloat16, torch.float8_e4m3fn
HQ, HK, D, BS = 32, 8, 128, 16
SHAPES = [(64, 4096), (8, 32768)]
#: fp8 candidates (block_n, num_warps, num_stages, num_splits; 0 splits: kvcore's count for
#: the shape on the bf16 cache, which the fp8 default may exceed) beside the default, most
#: promising first.
CANDIDATES = [(32, 4, 4, 0), (64, 4, 3, 0), (64, 8, 3, 0), (32, 4, 3, 0), (64, 4, 4, 0),
              (64, 4, 3, 8), (32, 4, 3, 8), (64, 4, 3, 16), (128, 8, 3, 0)]
if SMOKE:
    HQ, HK, D = 8, 2, 64
    SHAPES = [(4, 256), (2, 1024)]
    CANDIDATES = [(32, 4, 4, 0), (64, 4, 3, 2)]
CHECKED_REQUESTS = 4  # requests of a batch checked against the reference


@dataclasses.dataclass
class Batch:
    """``b`` decode requests of ``length`` tokens over a shuffled paged cache in the standard
    NHD layout ``(num_blocks, 2, BS, HK, D)``: bf16 values, and the same values in fp8 e4m3
    with per-tensor scales (amax / 448)."""

    b: int
    length: int

    def __post_init__(self) -> None:
        pages = -(-self.length // BS)
        num_blocks = self.b * pages + 16
        self.kv = torch.empty(num_blocks, 2, BS, HK, D, device=DEVICE).normal_().to(DTYPE)
        self.k_scale = (self.kv[:, 0].abs().amax().float() / 448).reshape(1)
        self.v_scale = (self.kv[:, 1].abs().amax().float() / 448).reshape(1)
        self.kv8 = torch.empty(self.kv.shape, dtype=FP8, device=DEVICE)
        for half, scale in ((0, self.k_scale), (1, self.v_scale)):
            self.kv8[:, half] = ops.quantize_to_cache(self.kv[:, half], FP8, scale.item())
        perm = torch.randperm(num_blocks, device=DEVICE)[: self.b * pages]
        self.block_table = perm.view(self.b, pages).to(torch.int32)
        self.seq_lens = torch.full((self.b,), self.length, dtype=torch.int32, device=DEVICE)
        self.qsl = torch.arange(self.b + 1, dtype=torch.int32, device=DEVICE)
        self.query = torch.empty(self.b, HQ, D, device=DEVICE).normal_().to(DTYPE)
        self.scale = D ** -0.5

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
                    block_table=self.block_table[:n], scale=self.scale)

    def read_bytes(self, fp8: bool) -> int:
        """Bytes a decode must move: its K/V, the query and the output."""
        kv = 2 * self.b * self.length * HK * D * (1 if fp8 else DTYPE.itemsize)
        return kv + 2 * self.query.numel() * DTYPE.itemsize


def triton_attention():
    from kvcore.ops import triton_attention as mod

    return mod


def default_config(batch: Batch, fp8: bool):
    """kvcore's default config for the batch on the fp8 or the bf16 cache on this device
    (imports triton)."""
    from kvcore.ops.attention_dispatch import default_config as choose

    return choose(batch.b, batch.b, HQ, HK, D, batch.block_table.shape[1] * BS,
                  torch.device(DEVICE), kv_cache_dtype="fp8_e4m3" if fp8 else "auto")


def candidate_config(default, block_n: int, num_warps: int, num_stages: int, splits: int):
    """A candidate with the default's rows (block_q, g_pad) and block-size switch; ``splits``
    0 keeps the default's split count."""
    splits = splits or getattr(default, "num_splits", 1)
    common = dict(block_q=default.block_q, g_pad=default.g_pad, block_n=block_n,
                  num_warps=num_warps, num_stages=num_stages, const_block=default.const_block)
    if splits > 1:
        return ops.TritonSplitKVConfig(num_splits=splits, **common)
    return ops.TritonDecodeConfig(**common)


def short(cfg) -> str:
    if cfg is None:
        return ""
    return (f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
            f"x{getattr(cfg, 'num_splits', 1)}{'' if cfg.fp8_fp16 else ' fp8->bf16'}")


# ----------------------------------------------------------------------------- sections


def measure_ceiling(run: Run) -> None:
    """Read bandwidth (the faster of ``torch.sum`` and a Triton streaming read) after a
    one-second warm-up."""
    nbytes = (1 << 16) if SMOKE else (2 << 30)
    x = torch.empty(nbytes // 4, device=DEVICE).normal_()
    harness.warm_up(torch.empty_like(x), x, 0.0 if SMOKE else 1.0)
    torch_sum, how = harness.read_gbps(x, time_call)
    triton_read, _ = harness.triton_read_gbps(x, time_call)
    run.results["ceilings"] = {"read_GBps": max(torch_sum, triton_read),
                               "read_torch_sum_GBps": torch_sum,
                               "read_triton_GBps": triton_read, "method": how}
    run.log(f"read ceiling {max(torch_sum, triton_read):.0f} GB/s (torch.sum {torch_sum:.0f}, "
            f"triton {triton_read:.0f})")


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
        add_timing(run, batch, cache, "kvcore", t, how, default_config(batch, fp8))
    cfg = default_config(batch, True)
    before = dataclasses.replace(cfg, fp8_fp16=not cfg.fp8_fp16)
    fn = kvcore_call(batch, True, before)
    err = rel_err(fn(), outs["fp8"])
    run.check(f"{batch.shape}.fp8.{short(before)}_vs_default", err < 1e-2, rel_err=err)
    t, how = time_call(fn)
    add_timing(run, batch, "fp8", f"kvcore fp8_fp16={before.fp8_fp16}", t, how, before)
    return outs


def sweep_fp8(run: Run, batch: Batch, default_out: torch.Tensor) -> None:
    """fp8 with the candidate configs until the budget is spent; each checked against the
    default config's output first."""
    default, bf16 = default_config(batch, True), default_config(batch, False)
    for block_n, warps, stages, splits in CANDIDATES:
        if run.budget_s and run.elapsed() > run.budget_s:
            run.log(f"budget of {run.budget_s:.0f} s spent: the other candidates are left out")
            return
        cfg = candidate_config(bf16, block_n, warps, stages, splits)
        if cfg == default:
            continue
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
    wrapper.plan(indptr, batch.block_table.flatten(), last, HQ, HK, D, BS, q_data_type=DTYPE,
                 kv_data_type=FP8 if fp8 else DTYPE, sm_scale=batch.scale)
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
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop the fp8 candidate sweep after this many seconds of the run")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    run = Run(Path(args.out), "bench_fp8_decode", ("correctness", "timings"),
              checks="correctness", device=DEVICE, budget_s=args.budget_s)
    meta = run.results["meta"]
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE,
                shapes=dict(hq=HQ, hk=HK, d=D, bs=BS, dtype=str(DTYPE), kv_fp8=str(FP8)))
    meta["triton"] = harness.triton_version()
    run.log(json.dumps(meta))
    torch.manual_seed(0)

    with run.section("read ceiling"):
        measure_ceiling(run)
    batches, outs = {}, {}
    for b, length in SHAPES:
        with run.section(f"kvcore decode {b}x{length}"):
            batches[b, length] = batch = Batch(b, length)
            outs[b, length] = time_kvcore(run, batch)
    for key, batch in batches.items():
        if key in outs:
            with run.section(f"kvcore fp8 candidates {batch.shape}"):
                sweep_fp8(run, batch, outs[key]["fp8"])
    for key, batch in batches.items():
        if key in outs:
            with run.section(f"flashinfer decode {batch.shape}"):
                time_flashinfer(run, batch, outs[key])
    ops.set_value_checks(True)

    failed = [c["check"] for c in run.results["correctness"] if not c["ok"]]
    run.results["summary"] = {"failed_checks": failed, "errors": len(run.results["errors"])}
    run.save()
    lines = [f"correctness: {'all passed' if not failed else f'FAILED {failed}'}; section "
             f"errors: {len(run.results['errors'])}",
             f"read ceiling: {run.results['ceilings'].get('read_GBps', 0):.0f} GB/s",
             summary_table(run)]
    errors = harness.errors_line(run.results)
    run.write_summary([*lines, *([errors] if errors else [])])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
