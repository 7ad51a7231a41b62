#!/usr/bin/env python3
"""TRITON_ATTN prefill on one GPU (written for the H200): correctness, a tile sweep, decode
unchanged, FlashInfer beside it.

One run does, in order, each section isolated (an error is logged and the run goes on):

1. ceiling: a bf16 matmul (TFLOP/s), the compute bound prefill is held to;
2. correctness of the default prefill configuration on the three prefill cases against torch
   SDPA in float32 on the gathered K/V (max abs error and relative error);
3. the sweep: every candidate tile of :data:`CANDIDATES` (rows = query tokens x padded GQA
   group, keys per step, warps, stages) on every case, each output checked against the
   case's SDPA output before it is timed; us and TFLOP/s per config, the best per case;
4. the four decode shapes through the production path (``paged_attention`` with its default
   configuration, split-KV chosen by the heuristic);
5. FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (default backend, planned once,
   timed in a CUDA graph) on the same caches, when ``flashinfer`` imports, checked against
   kvcore's output; last, so its JIT build cannot cost the rest.

Cases (Hq 32, Hk 8, D 128, bf16, block 16, causal, shuffled pages): 4 x 2048 new tokens,
1 x 8192 new tokens, 4 x 512 new tokens over 16,384 cached (chunked prefill). TFLOP/s count
the attention FLOPs (QK^T and PV over the keys each query sees). Timings are CUDA-graph
replays of one call (median; :func:`kvcore.cli.harness.time_call`).

The table is printed last (``--json``: the JSON instead); log and JSON go to ``--out``
(default ``$OUT``, else ``benchmarks/results``). ``--smoke`` runs tiny shapes on the CPU under
``TRITON_INTERPRET=1`` to check the script.

Usage: ``python benchmarks/bench_triton_prefill.py [--out DIR] [--json] [--smoke]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore.ops as ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, Skip, rel_err  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
time_call = functools.partial(harness.time_call, device=DEVICE)
DTYPE = torch.bfloat16
HQ, HK, D, BS = 32, 8, 128, 16
#: name -> (requests, new tokens per request, cached tokens per request)
CASES = {"4x2048": (4, 2048, 0), "1x8192": (1, 8192, 0), "4x512+16k": (4, 512, 16384)}
#: name -> (requests, context): the decode shapes, and their time before the prefill kernel
DECODES = {"64x4096": (64, 4096), "8x32768": (8, 32768), "256x1024": (256, 1024),
           "16x4096": (16, 4096)}
DECODE_BEFORE_US = {"64x4096": 252.0, "8x32768": 255.0, "256x1024": 264.0, "16x4096": 72.0}
#: FlashInfer direct prefill measured before (issue 19), for the ratio when it is missing.
FLASHINFER_BEFORE_US = {"4x2048": 326.0, "1x8192": 1009.0, "4x512+16k": 953.0}
#: Candidate prefill tiles (rows, block_n, num_warps, num_stages), the current sm90 row first.
CANDIDATES = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3),
              (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3),
              (64, 128, 4, 2)]
MATMUL_N = 8192
if SMOKE:
    DTYPE = torch.float32
    HQ, HK, D = 8, 2, 32
    CASES = {"2x40": (2, 40, 0), "1x70": (1, 70, 0), "2x9+50": (2, 9, 50)}
    DECODES = {"4x100": (4, 100)}
    DECODE_BEFORE_US = {}
    CANDIDATES = [(32, 16, 4, 2), (16, 32, 4, 2)]
    MATMUL_N = 256


def randn(*shape: int) -> torch.Tensor:
    t = torch.empty(*shape, dtype=DTYPE, device=DEVICE)
    return t.normal_()


class Batch:
    """``b`` requests of ``new`` query tokens over ``cached + new`` tokens, pages shuffled, in
    one ``(num_blocks, 2, BS, HK, D)`` NHD cache (kvcore reads its K and V halves)."""

    def __init__(self, b: int, new: int, cached: int) -> None:
        self.b, self.new, self.cached = b, new, cached
        length = cached + new
        pages = -(-length // BS)
        num_blocks = b * pages + 16
        self.kv = randn(num_blocks, 2, BS, HK, D)
        perm = torch.randperm(num_blocks, device=DEVICE)[: b * pages]
        self.block_table = perm.view(b, pages).to(torch.int32)
        self.seq_lens = torch.full((b,), length, dtype=torch.int32, device=DEVICE)
        self.qsl = (torch.arange(b + 1, device=DEVICE) * new).to(torch.int32)
        self.query = randn(b * new, HQ, D)
        self.scale = D ** -0.5
        self.k_cache, self.v_cache = self.kv.unbind(1)

    def kwargs(self) -> dict:
        return dict(query_start_loc=self.qsl, seq_lens=self.seq_lens,
                    block_table=self.block_table, scale=self.scale)

    def flops(self) -> float:
        """QK^T and PV over the keys each query sees (causal: its position + 1)."""
        visible = self.new * self.cached + self.new * (self.new + 1) / 2
        return 4.0 * self.b * HQ * D * visible

    def sdpa_reference(self) -> torch.Tensor:
        """float32 SDPA over the gathered K/V, query i of a request at position cached + i."""
        length = self.cached + self.new
        out = torch.empty(self.b * self.new, HQ, D, dtype=torch.float32, device=DEVICE)
        mask = (torch.arange(length, device=DEVICE)[None, :]
                <= torch.arange(self.cached, length, device=DEVICE)[:, None])
        for i in range(self.b):
            pages = self.block_table[i]
            k = self.k_cache[pages].reshape(-1, HK, D)[:length].float().transpose(0, 1)
            v = self.v_cache[pages].reshape(-1, HK, D)[:length].float().transpose(0, 1)
            q = self.query[i * self.new:(i + 1) * self.new].float().transpose(0, 1)
            k = k.repeat_interleave(HQ // HK, 0)
            v = v.repeat_interleave(HQ // HK, 0)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                 scale=self.scale)
            out[i * self.new:(i + 1) * self.new] = o.transpose(0, 1)
        return out


def triton_attention():
    from kvcore.ops import triton_attention as mod

    return mod


def config_for(tile: tuple[int, int, int, int]):
    """An :class:`~kvcore.ops.triton_attention.AttentionConfig` of the prefill kernel."""
    ta = triton_attention()
    rows, block_n, warps, stages = tile
    g_pad = 1 << (HQ // HK - 1).bit_length()
    return ta.AttentionConfig(block_q=max(1, rows // g_pad), g_pad=g_pad, block_n=block_n,
                              num_splits=1, num_warps=warps, num_stages=stages, prefill=True)


def tile_of(cfg) -> list[int]:
    return [cfg.block_q * cfg.g_pad, cfg.block_n, cfg.num_warps, cfg.num_stages]


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    return {"max_abs_err": (out.float() - ref).abs().max().item(), "rel_err": rel_err(out, ref)}


def tolerance() -> float:
    return 1e-4 if DTYPE == torch.float32 else 1e-2


def measure_ceiling(run: Run) -> None:
    a = randn(MATMUL_N, MATMUL_N)
    b = randn(MATMUL_N, MATMUL_N)
    c = torch.empty_like(a)
    t, how = time_call(lambda: torch.matmul(a, b, out=c))
    tflops = 2 * MATMUL_N**3 / t / 1e12
    run.results["ceilings"]["matmul_tflops"] = tflops
    run.log(f"ceiling: {MATMUL_N}^3 {DTYPE} matmul {tflops:.0f} TFLOP/s [{how}]")


def check_default(run: Run, name: str, batch: Batch, ref: torch.Tensor) -> None:
    ta = triton_attention()
    cfg = ta.default_config(batch.query.shape[0], batch.b, HQ, HK, D,
                            batch.block_table.shape[1] * BS, torch.device(DEVICE))
    out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, **batch.kwargs())
    err = errors(out, ref)
    run.check(f"prefill.{name}.default_vs_sdpa", cfg.prefill and err["rel_err"] < tolerance(),
              tile=tile_of(cfg), **err)


def sweep_case(run: Run, name: str, batch: Batch, ref: torch.Tensor) -> None:
    ta = triton_attention()
    out = torch.empty_like(batch.query)
    for tile in CANDIDATES:
        cfg = config_for(tile)

        def call(cfg=cfg) -> None:
            ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, **batch.kwargs(),
                               output=out, config=cfg)
        try:
            call()
            err = errors(out, ref)
            ok = err["rel_err"] < tolerance()
            run.check(f"prefill.{name}.tile{tile}_vs_sdpa", ok, **err)
            if not ok:
                continue
            t, how = time_call(call)
        except Exception as exc:  # a tile that does not compile here (shared memory)
            run.log(f"tile {tile} on {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        row = {"case": name, "tile": list(tile), "time_us": t * 1e6,
               "TFLOPs": batch.flops() / t / 1e12, "method": how}
        run.results["sweeps"].append(row)
        run.log(f"{name} tile {tile}: {row['time_us']:.1f} us, {row['TFLOPs']:.0f} TFLOP/s "
                f"[{how}]")


def time_decodes(run: Run) -> None:
    ta = triton_attention()
    for name, (b, length) in DECODES.items():
        batch = Batch(b, 1, length - 1)
        out = torch.empty_like(batch.query)
        cfg = ta.default_config(b, b, HQ, HK, D, batch.block_table.shape[1] * BS,
                                torch.device(DEVICE))
        t, how = time_call(lambda batch=batch, out=out: ta.paged_attention(
            batch.query, batch.k_cache, batch.v_cache, **batch.kwargs(), output=out))
        kv_bytes = 2 * b * length * HK * D * DTYPE.itemsize
        row = {"case": name, "time_us": t * 1e6, "GBps": kv_bytes / t / 1e9, "method": how,
               "config": dataclasses.asdict(cfg), "before_us": DECODE_BEFORE_US.get(name)}
        run.results["decode"].append(row)
        run.log(f"decode {name}: {row['time_us']:.1f} us, {row['GBps']:.0f} GB/s, "
                f"{cfg.num_splits} splits [{how}]")


def time_flashinfer(run: Run, name: str, batch: Batch, kvcore_out: torch.Tensor) -> None:
    try:
        import flashinfer
    except ImportError as exc:
        raise Skip(f"flashinfer does not import: {exc}") from exc
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    pages = batch.block_table.shape[1]
    length = batch.cached + batch.new
    wrapper.plan(batch.qsl, (torch.arange(batch.b + 1, device=DEVICE) * pages).to(torch.int32),
                 batch.block_table.flatten(),
                 torch.full((batch.b,), length - (pages - 1) * BS, dtype=torch.int32,
                            device=DEVICE),
                 HQ, HK, D, BS, causal=True, sm_scale=batch.scale, q_data_type=DTYPE,
                 kv_data_type=DTYPE)
    out = torch.empty_like(batch.query)
    wrapper.run(batch.query, batch.kv, out=out)
    err = errors(out, kvcore_out.float())
    run.check(f"prefill.{name}.flashinfer_vs_kvcore", err["rel_err"] < 1e-2, **err)
    t, how = time_call(lambda: wrapper.run(batch.query, batch.kv, out=out))
    row = {"case": name, "impl": "flashinfer", "time_us": t * 1e6,
           "TFLOPs": batch.flops() / t / 1e12, "method": how}
    run.results["flashinfer"].append(row)
    run.log(f"flashinfer {name}: {row['time_us']:.1f} us, {row['TFLOPs']:.0f} TFLOP/s [{how}]")


def table(run: Run) -> str:
    from tabulate import tabulate

    res = run.results
    ceiling = res["ceilings"].get("matmul_tflops", 0.0)
    fi = {r["case"]: r["time_us"] for r in res["flashinfer"]}
    default_tile = {c["check"].split(".")[1]: c["tile"] for c in res["correctness"]
                    if c["check"].endswith("default_vs_sdpa")}
    rows = []
    for r in sorted(res["sweeps"], key=lambda r: (list(CASES).index(r["case"]), r["time_us"])):
        base = fi.get(r["case"]) or FLASHINFER_BEFORE_US.get(r["case"])
        best = r is min((s for s in res["sweeps"] if s["case"] == r["case"]),
                        key=lambda s: s["time_us"])
        rows.append([r["case"], "x".join(map(str, r["tile"])),
                     ("default " if r["tile"] == default_tile.get(r["case"]) else "")
                     + ("best" if best else ""),
                     f"{r['time_us']:.1f}", f"{r['TFLOPs']:.0f}",
                     f"{100 * r['TFLOPs'] / ceiling:.0f}%" if ceiling else "",
                     f"{base / r['time_us']:.2f}x" if base else ""])
    for r in res["flashinfer"]:
        rows.append([r["case"], "flashinfer direct", "", f"{r['time_us']:.1f}",
                     f"{r['TFLOPs']:.0f}",
                     f"{100 * r['TFLOPs'] / ceiling:.0f}%" if ceiling else "", "1.00x"])
    lines = [f"matmul ceiling: {ceiling:.0f} TFLOP/s",
             tabulate(rows, headers=["prefill", "tile rows x n x warps x stages", "",
                                     "us", "TFLOP/s", "of matmul", "FlashInfer / this"],
                      disable_numparse=True), ""]
    drows = [[r["case"], f"{r['time_us']:.1f}", f"{r['GBps']:.0f}", r["config"]["num_splits"],
              f"{r['before_us']:.0f}" if r["before_us"] else "",
              f"{r['time_us'] / r['before_us']:.3f}" if r["before_us"] else ""]
             for r in res["decode"]]
    lines.append(tabulate(drows, headers=["decode", "us", "GB/s", "splits", "before us",
                                          "now / before"],
                           disable_numparse=True))
    failed = [c["check"] for c in res["correctness"] if not c["ok"]]
    lines.append(f"\ncorrectness: {len(res['correctness']) - len(failed)} passed, "
                 f"{len(failed)} failed {failed if failed else ''}; "
                 f"{len(res['errors'])} section errors")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or
                        str(Path(__file__).parent / "results"))
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    run = Run(Path(args.out), "bench_triton_prefill",
              ("correctness", "sweeps", "decode", "flashinfer"), checks="correctness",
              device=DEVICE)
    meta = run.results["meta"]
    meta.update(date=datetime.date.today().isoformat(), python=platform.python_version(),
                torch=torch.__version__, smoke=SMOKE,
                shapes=dict(hq=HQ, hk=HK, d=D, bs=BS, dtype=str(DTYPE)))
    import triton

    meta["triton"] = triton.__version__
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(device=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                    arch=triton_attention().device_arch(torch.device("cuda")))
    run.log(json.dumps(meta))
    torch.manual_seed(0)
    ops.set_value_checks(False)  # timing: no host syncs inside the calls

    with run.section("ceiling"):
        measure_ceiling(run)
    batches, refs, outs = {}, {}, {}
    for name, shape in CASES.items():
        with run.section(f"correctness {name}"):
            batches[name] = Batch(*shape)
            refs[name] = batches[name].sdpa_reference()
            check_default(run, name, batches[name], refs[name])
    for name in CASES:
        with run.section(f"sweep {name}"):
            sweep_case(run, name, batches[name], refs[name])
            outs[name] = triton_attention().paged_attention(
                batches[name].query, batches[name].k_cache, batches[name].v_cache,
                **batches[name].kwargs())
    refs.clear()
    with run.section("decode (production path)"):
        time_decodes(run)
    for name in CASES:
        with run.section(f"flashinfer {name}"):
            time_flashinfer(run, name, batches[name], outs[name])
    run.save()
    print(json.dumps(run.results, indent=1, default=str) if args.json else table(run))
    return 0 if all(c["ok"] for c in run.results["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
