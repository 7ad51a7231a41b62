#!/usr/bin/env python3
"""TRITON_ATTN prefill on one GPU (written for the H200): correctness, a tile and kernel-variant
sweep, a decode sweep, FlashInfer beside it.

One run does, in order, each section isolated (an error is logged and the run goes on):

1. ceiling: a bf16 matmul (TFLOP/s), the compute bound prefill is held to;
2. correctness of the default prefill configuration and of EVERY prefill candidate on the
   three prefill cases against torch SDPA in float32 on the gathered K/V (max abs error and
   relative error); a candidate that fails or does not compile is not timed;
3. the prefill sweep: every candidate of :func:`prefill_candidates` on every case, us and
   TFLOP/s: ``triton_prefill`` tiles (:class:`~kvcore.ops.attention_config.TritonPrefillTile`:
   rows = query tokens x padded GQA group, keys per step, warps, stages, ``const_block``,
   ``edge_stages``) and ``gluon_ws_pingpong`` tiles
   (:class:`~kvcore.ops.attention_config.GluonPrefillTile`, the Hopper kernel of
   :mod:`kvcore.ops.gluon_prefill`). The Gluon candidates are first compiled, run and checked
   against SDPA in a child process (``--probe``), so a kernel that faults cannot end this
   run;
4. the decode sweep on the four decode shapes through the production entry point
   (``paged_attention`` with a ``TritonAttentionPlan`` naming the config and a preallocated
   split-KV workspace, as the builder passes): split counts around the heuristic's (x1/2,
   x1, x2, and 1) times the tiles of :func:`decode_candidates`, each output checked against
   SDPA before it is timed; the default configuration's time beside the best;
5. FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (default backend, planned once,
   timed in a CUDA graph) on the same caches, when ``flashinfer`` imports, checked against
   kvcore's output; with ``--flashinfer-decode`` also its tensor-core decode on the decode
   shapes (otherwise the decode ratios use FlashInfer's times recorded in RESULTS.md); last,
   so their JIT builds cannot cost the rest.

Cases (Hq 32, Hk 8, D 128, bf16, block 16, causal, shuffled pages): 4 x 2048 new tokens,
1 x 8192 new tokens, 4 x 512 new tokens over 16,384 cached (chunked prefill). TFLOP/s count
the attention FLOPs (QK^T and PV over the keys each query sees). Timings are CUDA-graph
replays of one call (median; :func:`kvcore.cli.harness.time_call`).

The tables are printed last (``--json``: the JSON instead), each ending with the winners
written as the ``TritonPrefillTile(...)`` / ``GluonPrefillTile(...)`` / ``DecodeTile(...)``
rows to paste into ``PREFILL_TILES`` / ``GLUON_PREFILL_TILES`` / ``DECODE_TILES`` of
``kvcore/ops/attention_config.py``. Log and JSON go to
``--out`` (default ``$OUT``, else ``benchmarks/results``). ``--budget-s`` stops starting new
prefill candidates after that many seconds. ``--smoke`` runs tiny shapes on the CPU under
``TRITON_INTERPRET=1`` to check the script.

``--gluon-only`` keeps the table's row, sm90's Gluon row and its two nearest rivals, and skips
the decode sweep (a short run while working on the Gluon kernel).

Usage: ``python benchmarks/bench_triton_prefill.py [--out DIR] [--json] [--smoke]
[--budget-s S] [--flashinfer-decode] [--gluon-only]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SMOKE = "--smoke" in sys.argv
#: --gluon-only: the table row and the leading Gluon tiles, no decode sweep (a short run to
#: iterate on the Gluon kernel).
GLUON_ONLY = "--gluon-only" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kvcore.ops as ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, Skip, rel_err  # noqa: E402
from kvcore.ops import attention_config as tables  # noqa: E402

DEVICE, time_call = harness.script_timer(SMOKE)
DTYPE = torch.bfloat16
HQ, HK, D, BS = 32, 8, 128, 16
#: name -> (requests, new tokens per request, cached tokens per request)
CASES = {"4x2048": (4, 2048, 0), "1x8192": (1, 8192, 0), "4x512+16k": (4, 512, 16384)}
#: name -> (requests, context): the decode shapes
DECODES = {"64x4096": (64, 4096), "8x32768": (8, 32768), "256x1024": (256, 1024),
           "16x4096": (16, 4096)}
#: FlashInfer direct, measured on the H200 (RESULTS.md), for the ratios
#: when it is not measured in this run.
FLASHINFER_BEFORE_US = {"4x2048": 311.1, "1x8192": 1031.2, "4x512+16k": 973.3}
FLASHINFER_DECODE_BEFORE_US = {"64x4096": 245.8, "8x32768": 245.8, "256x1024": 259.9,
                               "16x4096": 71.6}
MATMUL_N = 8192
#: The probe's shape for the warp-specialised and Gluon candidates (compile + one checked run
#: in a child); 300 new over 100 cached tokens: partial tiles, a causal diagonal, a prefix.
PROBE = (1, 300, 100)
if SMOKE:
    DTYPE = torch.float32
    HQ, HK, D = 8, 2, 32
    CASES = {"2x40": (2, 40, 0), "1x70": (1, 70, 0), "2x9+50": (2, 9, 50)}
    DECODES = {"4x100": (4, 100)}
    MATMUL_N = 256
    PROBE = (1, 20, 0)


def triton_attention():
    from kvcore.ops import triton_attention as mod

    return mod


def dispatch():
    from kvcore.ops import attention_dispatch as mod

    return mod


def prefill_candidates() -> list:
    """The prefill candidates, the current table row first: the Gluon tiles, tile shapes
    around the Triton row, then its compile parameters on the strongest shapes."""
    tile, gluon_tile = tables.TritonPrefillTile, tables.GluonPrefillTile
    if SMOKE:
        return [tile(32, 16, 4, 2), tile(16, 32, 4, 2, const_block=True, edge_stages=1)]
    # Compiled for sm_90a by Triton 3.9 with its register report (compile_check), the
    # 128 x 32 x 4 x 3 tile uses 255 registers and spills 44 bytes; the block size compiled
    # in leaves 20, unpipelined edge loops 0. 4-warp 128-row tiles run 2 programs per SM;
    # 64 x 32 x 4 (153 registers, 64 KiB) 3.
    shapes = [tile(128, 32, 4, 3), tile(128, 64, 8, 3), tile(128, 128, 8, 2),
              tile(64, 64, 4, 3), tile(128, 32, 4, 3, const_block=True),
              tile(128, 32, 4, 3, edge_stages=1)]
    c, e = dict(const_block=True), dict(const_block=True, edge_stages=1)
    variants = [tile(128, 32, 4, 3, **e), tile(128, 32, 4, 4, **e), tile(128, 32, 4, 2, **e),
                tile(64, 32, 4, 3, **e), tile(64, 32, 4, 4, **e), tile(64, 64, 4, 3, **e),
                tile(64, 64, 4, 2, **e), tile(128, 64, 8, 3, **e), tile(128, 64, 8, 2, **e),
                tile(128, 128, 8, 2, **e), tile(128, 32, 8, 3, **e), tile(256, 32, 8, 3, **e),
                tile(128, 64, 8, 3, **c)]
    # The Gluon kernel's tiles (keys a step x shared-memory stages) come right after the
    # table row, so the budget never cuts them: sm90's row (128 x 3) and its nearest rival
    # first; --gluon-only stops there. The full sweep adds the tiles that lost (two stages
    # starve the consumers; 64 x 4 ties 64 x 3).
    gluon = [gluon_tile(128, 3), gluon_tile(64, 3)]
    gluon_lost = [gluon_tile(64, 4), gluon_tile(128, 2)]
    if GLUON_ONLY:
        return [table_rows()[0], *gluon]
    return list(dict.fromkeys([table_rows()[0], *gluon, *gluon_lost, *shapes, *variants]))


def risky(tile) -> bool:
    """Candidates first run in a child process (``--probe``): the Gluon kernel's (a fault
    would end the run)."""
    return isinstance(tile, tables.GluonPrefillTile)


def table_rows() -> tuple:
    """This GPU's current :data:`PREFILL_TILES` and :data:`DECODE_TILES` entries."""
    arch = tables.device_arch(torch.device(DEVICE))
    rocm = tables.is_rocm()
    return tables.prefill_tile(D, arch, rocm), tables.decode_tile(arch, rocm)


def decode_candidates() -> list:
    """Decode tiles (keys per step, warps, stages, const_block), the current one first."""
    tile = tables.DecodeTile
    if SMOKE:
        return [tile(), tile(16, 4, 2, const_block=True)]
    return list(dict.fromkeys([
            table_rows()[1], tile(), tile(32, 4, 3, const_block=True),
            tile(16, 4, 3, const_block=True),
            tile(64, 4, 3, const_block=True), tile(64, 8, 3, const_block=True),
            tile(32, 4, 2, const_block=True), tile(32, 4, 4, const_block=True),
            tile(32, 8, 3, const_block=True), tile(16, 2, 4, const_block=True)]))


def label(tile) -> str:
    """A candidate as the row to paste into its table: the constructor with its positional
    fields and the variant fields that differ from the defaults."""
    cls = type(tile)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    if cls is tables.TritonPrefillTile:
        parts = [str(getattr(tile, f.name)) for f in fields[:4]]
        rest = fields[4:]
    else:
        parts, rest = [], fields
    parts += [f"{f.name}={getattr(tile, f.name)}" for f in rest
              if getattr(tile, f.name) != f.default]
    return f"{cls.__name__}({', '.join(parts)})"


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


def config_for(tile):
    """The launch config of a prefill candidate."""
    g_pad = 1 << (HQ // HK - 1).bit_length()
    if isinstance(tile, tables.GluonPrefillTile):
        return ops.GluonPrefillConfig(block_q=128 // g_pad, g_pad=g_pad, block_n=tile.block_n,
                                      num_stages=tile.num_stages)
    return ops.TritonPrefillConfig(block_q=max(1, tile.rows // g_pad), g_pad=g_pad,
                                   block_n=tile.block_n, num_warps=tile.num_warps,
                                   num_stages=tile.num_stages, const_block=tile.const_block,
                                   edge_stages=tile.edge_stages)


def plan_for(tile) -> ops.TritonAttentionPlan:
    return ops.TritonAttentionPlan(config=config_for(tile))


def tile_of(cfg) -> str:
    """The table row a prefill config came from, as its label."""
    if isinstance(cfg, ops.GluonPrefillConfig):
        return label(tables.GluonPrefillTile(cfg.block_n, cfg.num_stages))
    return label(tables.TritonPrefillTile(cfg.block_q * cfg.g_pad, cfg.block_n, cfg.num_warps,
                                          cfg.num_stages, cfg.const_block, cfg.edge_stages))


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    return {"max_abs_err": (out.float() - ref).abs().max().item(), "rel_err": rel_err(out, ref)}


def tolerance() -> float:
    return 1e-4 if DTYPE == torch.float32 else 1e-2


def measure_ceiling(run: Run) -> None:
    tflops, how = harness.matmul_tflops(MATMUL_N, DTYPE, DEVICE, time_call)
    run.results["ceilings"]["matmul_tflops"] = tflops
    run.log(f"ceiling: {MATMUL_N}^3 {DTYPE} matmul {tflops:.0f} TFLOP/s [{how}]")


def check_default(run: Run, name: str, batch: Batch, ref: torch.Tensor) -> None:
    ta = triton_attention()
    # What paged_attention runs without a config (on sm90 the Gluon row, where it can).
    cfg = dispatch().call_config(batch.query, batch.k_cache, batch.v_cache, "auto", batch.b,
                         batch.block_table.shape[1] * BS)
    out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, **batch.kwargs())
    err = errors(out, ref)
    prefill = cfg.kernel in ("triton_prefill", "gluon_ws_pingpong")
    run.check(f"prefill.{name}.default_vs_sdpa", prefill and err["rel_err"] < tolerance(),
              tile=tile_of(cfg), **err)


def probe_candidates() -> int:
    """Child process: compile and run each :func:`risky` candidate once on a small prefill
    and check it against SDPA; prints ``OK <label>`` per candidate that ran and matched,
    ``FAIL <label> <why>`` per one that did not (a crash ends the child only)."""
    ta = triton_attention()
    torch.manual_seed(0)
    batch = Batch(*PROBE)
    ref = batch.sdpa_reference()
    skip = set(json.loads(os.environ.get("PROBE_SKIP", "[]")))
    for tile in prefill_candidates():
        if not risky(tile) or label(tile) in skip:
            continue
        print("TRY", label(tile), flush=True)  # the last TRY of a child that hangs is the culprit
        try:
            out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                     **batch.kwargs(), plan=plan_for(tile))
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except ValueError as exc:  # refused before any launch (e.g. not this GPU)
            print("FAIL", label(tile), str(exc)[:300], flush=True)
            continue
        err = errors(out, ref)
        ok = err["rel_err"] < tolerance()
        print("OK" if ok else "FAIL", label(tile), "" if ok else err, flush=True)
    return 0


def usable_candidates(run: Run) -> list:
    """The candidates this Triton and GPU can run: :func:`risky` ones only where the child
    process compiled, ran and checked them (where the Gluon kernel's conditions are met)."""
    cands = prefill_candidates()
    if not any(risky(t) for t in cands):
        return cands
    ok: set[str] = set()
    done: set[str] = set()
    cmd = ([sys.executable, __file__, "--probe"] + (["--smoke"] if SMOKE else [])
           + (["--gluon-only"] if GLUON_ONLY else []))
    # A candidate that hangs (a deadlocked kernel) is marked failed and the child restarted
    # without it, so one bad candidate does not cost the others.
    for _ in range(4):
        env = {**os.environ, "PROBE_SKIP": json.dumps(sorted(done))}
        try:
            child = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
            out, note = child.stdout, (f" rc {child.returncode}: "
                                       + (child.stdout + child.stderr)[-1500:]
                                       if child.returncode else "")
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            tried = [line[4:].strip() for line in out.splitlines() if line.startswith("TRY ")]
            note = f" timed out after 120 s in {tried[-1] if tried else '(start-up)'}"
        lines = out.splitlines()
        ok |= {line[3:].strip() for line in lines if line.startswith("OK ")}
        failed = [line for line in lines if line.startswith("FAIL ")]
        done |= {line[4:].strip() for line in lines if line.startswith("TRY ")}
        run.log(f"probe: {len(ok)} ran and matched; " + "; ".join(failed) + note)
        if "timed out" not in note:
            break
    run.results["meta"]["probe_ok"] = sorted(ok)
    return [t for t in cands if not risky(t) or label(t) in ok]


def check_candidates(run: Run, cands: list, batches: dict, refs: dict, budget_s: float
                     ) -> list:
    """Every candidate on every case against SDPA; returns those that passed all."""
    ta = triton_attention()
    passed = []
    for tile in cands:
        if budget_s and run.elapsed() > budget_s:
            run.log(f"budget: {label(tile)} and later candidates not run")
            run.results["meta"].setdefault("not_run", []).append(label(tile))
            continue
        good = True
        for name, batch in batches.items():
            out = torch.empty_like(batch.query)
            try:
                ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, **batch.kwargs(),
                                   output=out, plan=plan_for(tile))
                err = errors(out, refs[name])
            except Exception as exc:  # a tile that does not compile here (shared memory)
                run.check(f"prefill.{name}.{label(tile)}_runs", False,
                          error=f"{type(exc).__name__}: {str(exc)[:300]}")
                good = False
                break
            ok = err["rel_err"] < tolerance()
            run.check(f"prefill.{name}.{label(tile)}_vs_sdpa", ok, **err)
            good &= ok
        if good:
            passed.append(tile)
    return passed


def sweep_case(run: Run, name: str, batch: Batch, cands: list) -> None:
    ta = triton_attention()
    out = torch.empty_like(batch.query)
    for tile in cands:
        plan = plan_for(tile)
        t, how = time_call(lambda plan=plan: ta.paged_attention(
            batch.query, batch.k_cache, batch.v_cache, **batch.kwargs(), output=out,
            plan=plan))
        row = {"case": name, "tile": label(tile), "time_us": t * 1e6,
               "TFLOPs": batch.flops() / t / 1e12, "method": how}
        run.results["sweeps"].append(row)
        run.log(f"{name} {row['tile']}: {row['time_us']:.1f} us, {row['TFLOPs']:.0f} TFLOP/s "
                f"[{how}]")


def split_options(splits: int) -> list[int]:
    """Split counts around the heuristic's: 1, half, itself, double."""
    return sorted({1, max(1, splits // 2), splits, min(64, 2 * splits)})


def sweep_decodes(run: Run) -> None:
    """Every decode tile x split count on every decode shape, through ``paged_attention``
    with an explicit config and a preallocated workspace; each checked before it is timed."""
    ta = triton_attention()
    for name, (b, length) in DECODES.items():
        batch = Batch(b, 1, length - 1)
        ref = batch.sdpa_reference()
        out = torch.empty_like(batch.query)
        default = dispatch().default_config(b, b, HQ, HK, D, batch.block_table.shape[1] * BS,
                                            torch.device(DEVICE))
        heuristic = getattr(default, "num_splits", 1)
        for tile in decode_candidates():
            for splits in split_options(heuristic):
                # As default_config launches a tile: split launches take split_block_n keys.
                common = dict(block_q=default.block_q, g_pad=default.g_pad,
                              num_warps=tile.num_warps, num_stages=tile.num_stages,
                              const_block=tile.const_block)
                cfg = (ops.TritonSplitKVConfig(block_n=tile.split_block_n or tile.block_n,
                                               num_splits=splits, **common)
                       if splits > 1 else ops.TritonDecodeConfig(block_n=tile.block_n, **common))
                numel = ops.workspace_numel(b, HQ, D, splits)
                ws = (torch.empty(max(1, numel[0]), device=DEVICE),
                      torch.empty(max(1, numel[1]), device=DEVICE))
                tag = f"decode.{name}.{label(tile)}.splits{splits}"
                plan = ops.TritonAttentionPlan(config=cfg, workspace=ws)

                def call(plan=plan, batch=batch, out=out) -> None:
                    ta.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                       **batch.kwargs(), output=out, plan=plan)
                try:
                    call()
                    err = errors(out, ref)
                except Exception as exc:
                    run.check(f"{tag}_runs", False, error=f"{type(exc).__name__}: {exc}"[:300])
                    continue
                ok = err["rel_err"] < tolerance()
                run.check(f"{tag}_vs_sdpa", ok, **err)
                if not ok:
                    continue
                t, how = time_call(call)
                kv_bytes = 2 * b * length * HK * D * DTYPE.itemsize
                row = {"case": name, "tile": label(tile), "splits": splits,
                       "default": tile == table_rows()[1] and splits == heuristic,
                       "heuristic_splits": heuristic, "time_us": t * 1e6,
                       "GBps": kv_bytes / t / 1e9, "method": how}
                run.results["decode"].append(row)
                run.log(f"decode {name} {row['tile']} splits {splits}: {row['time_us']:.1f} "
                        f"us, {row['GBps']:.0f} GB/s [{how}]")


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


def time_flashinfer_decode(run: Run, name: str) -> None:
    try:
        import flashinfer
    except ImportError as exc:
        raise Skip(f"flashinfer does not import: {exc}") from exc
    b, length = DECODES[name]
    batch = Batch(b, 1, length - 1)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                            use_tensor_cores=True)
    pages = batch.block_table.shape[1]
    wrapper.plan((torch.arange(b + 1, device=DEVICE) * pages).to(torch.int32),
                 batch.block_table.flatten(),
                 torch.full((b,), length - (pages - 1) * BS, dtype=torch.int32, device=DEVICE),
                 HQ, HK, D, BS, sm_scale=batch.scale, q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(batch.query)
    wrapper.run(batch.query, batch.kv, out=out)
    err = errors(out, batch.sdpa_reference())
    run.check(f"decode.{name}.flashinfer_vs_sdpa", err["rel_err"] < tolerance(), **err)
    t, how = time_call(lambda: wrapper.run(batch.query, batch.kv, out=out))
    run.results["flashinfer"].append({"case": name, "impl": "flashinfer decode",
                                      "time_us": t * 1e6, "method": how})
    run.log(f"flashinfer decode {name}: {t * 1e6:.1f} us [{how}]")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def prefill_table(res: dict) -> list[str]:
    from tabulate import tabulate

    ceiling = res["ceilings"].get("matmul_tflops", 0.0)
    fi = {r["case"]: r["time_us"] for r in res["flashinfer"] if r["impl"] == "flashinfer"}
    base = {c: fi.get(c) or FLASHINFER_BEFORE_US.get(c) for c in CASES}
    default_tile = next((c["tile"] for c in res["correctness"]
                         if c["check"].endswith("default_vs_sdpa")), None)
    times = {(r["tile"], r["case"]): r for r in res["sweeps"]}
    tiles = list(dict.fromkeys(r["tile"] for r in res["sweeps"]))
    best = {c: min((t for t in tiles if (t, c) in times),
                   key=lambda t, c=c: times[(t, c)]["time_us"], default=None) for c in CASES}
    rows = []
    for t in tiles:
        cells, ratios = [], []
        for c in CASES:
            r = times.get((t, c))
            if r is None:
                cells.append("")
                continue
            ratio = base[c] / r["time_us"] if base[c] else float("nan")
            ratios.append(ratio)
            cells.append(f"{r['time_us']:.1f} ({r['TFLOPs']:.0f} TF, {ratio:.2f}x)"
                         + (" *" if best[c] == t else ""))
        rows.append([t + (" [default]" if t == default_tile else ""), *cells,
                     f"{geomean(ratios):.3f}" if len(ratios) == len(CASES) else ""])
    rows.append(["FlashInfer direct" + ("" if fi else " (recorded, not measured)"),
                 *[f"{base[c]:.1f}" if base[c] else "" for c in CASES], "1.000"])
    complete = [t for t in tiles if all((t, c) in times for c in CASES)]
    winner = min(complete, key=lambda t: geomean([times[(t, c)]["time_us"] for c in CASES]),
                 default=None)
    lines = [f"matmul ceiling: {ceiling:.0f} TFLOP/s",
             "prefill: us (TFLOP/s, FlashInfer / this), * = best of the case",
             tabulate(rows, headers=["candidate", *CASES, "geomean FI/this"],
                      disable_numparse=True)]
    if winner:
        table = ("GLUON_PREFILL_TILES['sm90']" if winner.startswith("GluonPrefillTile")
                 else "PREFILL_TILES['sm90'][0]")
        lines.append(f"prefill winner (best geomean time): {winner}  -> {table} in "
                     "kvcore/ops/attention_config.py")
    return lines


def decode_table(res: dict) -> list[str]:
    from tabulate import tabulate

    fi = {r["case"]: r["time_us"] for r in res["flashinfer"] if r["impl"] == "flashinfer decode"}
    rows, at_heuristic = [], {}
    for name in DECODES:
        mine = [r for r in res["decode"] if r["case"] == name]
        if not mine:
            continue
        ref = fi.get(name) or FLASHINFER_DECODE_BEFORE_US.get(name)
        default = next((r for r in mine if r["default"]), None)
        shown = sorted(mine, key=lambda r: r["time_us"])[:4]
        if default is not None and default not in shown:
            shown.append(default)
        for r in shown:
            rows.append([name, r["tile"], r["splits"], f"{r['time_us']:.1f}",
                         f"{r['GBps']:.0f}",
                         f"{default['time_us'] / r['time_us']:.3f}" if default else "",
                         f"{ref / r['time_us']:.3f}" if ref else "",
                         "default" if r["default"] else ""])
        for r in mine:
            if r["splits"] == r["heuristic_splits"]:
                at_heuristic.setdefault(r["tile"], {})[name] = r["time_us"]
    lines = ["decode (production entry, explicit config): 4 fastest per shape and the default",
             tabulate(rows, headers=["decode", "tile", "splits", "us", "GB/s",
                                     "default/this", "FlashInfer/this", ""],
                      disable_numparse=True)]
    complete = {t: v for t, v in at_heuristic.items() if len(v) == len(DECODES)}
    default_label = label(table_rows()[1])
    if complete and default_label in complete:
        score = {t: geomean([complete[default_label][n] / v[n] for n in DECODES])
                 for t, v in complete.items()}
        winner = max(score, key=score.get)
        lines.append(f"decode tile winner at the heuristic's splits (geomean default/this "
                     f"{score[winner]:.3f}): {winner} -> DECODE_TILES['sm90']")
    return lines


def table(run: Run) -> str:
    res = run.results
    lines = [*prefill_table(res), "", *decode_table(res)]
    failed = [c["check"] for c in res["correctness"] if not c["ok"]]
    lines.append(f"\ncorrectness: {len(res['correctness']) - len(failed)} passed, "
                 f"{len(failed)} failed {failed if failed else ''}; "
                 f"{len(res['errors'])} section errors")
    return "\n".join(lines)


def main() -> int:
    parser = harness.script_parser(__doc__, Path(__file__).parent / "results")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--budget-s", type=float, default=0 if SMOKE else 150,
                        help="start no new prefill candidate after this many seconds (0: no "
                             "limit)")
    parser.add_argument("--flashinfer-decode", action="store_true",
                        help="also time FlashInfer's decode (a ~30 s JIT build when cold)")
    parser.add_argument("--gluon-only", action="store_true",
                        help="only the table's row and the Gluon tiles, no decode sweep")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe_candidates()
    run = Run(Path(args.out), "bench_triton_prefill",
              ("correctness", "sweeps", "decode", "flashinfer"), checks="correctness",
              device=DEVICE)
    meta = run.results["meta"]
    meta.update(harness.run_meta(DEVICE), smoke=SMOKE,
                shapes=dict(hq=HQ, hk=HK, d=D, bs=BS, dtype=str(DTYPE)))
    meta["triton"] = harness.triton_version()
    if DEVICE == "cuda":
        meta["arch"] = tables.device_arch(torch.device("cuda"))
    run.log(json.dumps(meta))
    torch.manual_seed(0)
    ops.set_value_checks(False)  # timing: no host syncs inside the calls

    with run.section("ceiling"):
        measure_ceiling(run)
    cands: list = []
    with run.section("probe of the Gluon candidates"):
        cands = usable_candidates(run)
    batches, refs, outs = {}, {}, {}
    for name, shape in CASES.items():
        with run.section(f"correctness {name}"):
            batches[name] = Batch(*shape)
            refs[name] = batches[name].sdpa_reference()
            check_default(run, name, batches[name], refs[name])
    passed: list = []
    with run.section("correctness of every candidate"):
        cands = cands or [t for t in prefill_candidates() if not risky(t)]
        passed = check_candidates(run, cands, batches, refs, args.budget_s)
    refs.clear()
    for name in CASES:
        with run.section(f"sweep {name}"):
            sweep_case(run, name, batches[name], passed)
            outs[name] = triton_attention().paged_attention(
                batches[name].query, batches[name].k_cache, batches[name].v_cache,
                **batches[name].kwargs())
    if not GLUON_ONLY:
        with run.section("decode sweep (production entry point)"):
            sweep_decodes(run)
    for name in CASES:
        with run.section(f"flashinfer {name}"):
            time_flashinfer(run, name, batches[name], outs[name])
    if args.flashinfer_decode:
        for name in DECODES:
            with run.section(f"flashinfer decode {name}"):
                time_flashinfer_decode(run, name)
    run.save()
    print(json.dumps(run.results, indent=1, default=str) if args.json else table(run))
    return 0 if all(c["ok"] for c in run.results["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
