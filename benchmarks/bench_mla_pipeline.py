#!/usr/bin/env python3
"""The MLA pipeline: kvcore's ``MLACommonImpl.forward`` (absorption, latent attention, output
projection) through TRITON_MLA and FLASHINFER_MLA, against the same math written directly
around FlashInfer's MLA wrapper, on one GPU (written for the H100/H200).

DeepSeek dims (kv_lora_rank 512, rope 64, qk_nope 128, v_head 128), bf16, decode, blocks of
64, shuffled pages, 16 and 128 heads at B64 x 4096, B128 x 2048 and B8 x 32768 tokens. Per
shape:

- ``flashinfer direct``: what a user writes around ``BatchMLAPagedAttentionWrapper`` (planned
  once): ``torch.bmm(q_nope^T, W_UK, out=)`` into a preallocated buffer, ``run`` on that
  buffer and a view of the query's rope part, ``torch.bmm(o^T, W_UV^T, out=)`` into the
  output;
- ``TRITON_MLA`` / ``FLASHINFER_MLA``: the step built by the backend's builder for a CUDA
  graph of the batch size, then one layer's ``forward`` into a given output.

Each path is checked against direct (relative error of the output), then timed in the same
rounds (taking turns): the median of CUDA-graph replays (the GPU time; ``graph_us``) and of
back-to-back eager calls (``eager_us``: the host's launch path shows where it is longer than
the GPU's work). ``direct/kvcore`` is direct's time over the path's (>= 1.0 is the target).
The table is printed last; log and JSON go to ``--out`` (default ``$OUT``, else
``benchmarks/results``).

``--smoke``: the same run on the CPU on tiny shapes, CPU_MLA against the same math around the
MLA reference op (kvcore.ops.mla_attention_ref) in FlashInfer's place, so the script's
plumbing is tested without a GPU.

Usage: ``python benchmarks/bench_mla_pipeline.py [--out DIR] [--smoke]``; a few minutes plus
FlashInfer's JIT build and Triton's compiles on a cold cache.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "plugins" / "nvidia"), str(_ROOT / "plugins" / "mla")]
import kvcore  # noqa: E402
import kvcore.ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, rel_err  # noqa: E402

RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
BLOCK = 64
SHAPES = [(64, 16, 4096), (64, 128, 4096), (128, 16, 2048), (128, 128, 2048),
          (8, 16, 32768), (8, 128, 32768)]
SMOKE_SHAPES = [(2, 16, 80), (3, 128, 40)]
#: Largest relative error of a path's output against direct's (bf16 absorbed path).
MAX_REL_ERR = 2e-2


class Case:
    """One shape: cache, step, weights, query, and the float64-free direct pipeline."""

    def __init__(self, batch: int, heads: int, tokens: int, device: str) -> None:
        self.batch, self.heads, self.tokens, self.device = batch, heads, tokens, device
        gen = torch.Generator().manual_seed(batch * 1000 + heads)
        pages_per_seq = -(-tokens // BLOCK)
        num_blocks = batch * pages_per_seq + 1
        ids = torch.randperm(num_blocks - 1, generator=gen) + 1
        tables = ids.view(batch, pages_per_seq).tolist()
        self.common = kvcore.build_attention_metadata([1] * batch, [tokens - 1] * batch, tables,
                                                      BLOCK, device=device)
        dtype = torch.bfloat16

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

        self.cache = rand(num_blocks, BLOCK, RANK + ROPE)
        self.weight = rand(heads * (NOPE + V_DIM), RANK, scale=RANK**-0.5)
        self.query = rand(batch, heads, NOPE + ROPE)
        self.scale = (NOPE + ROPE) ** -0.5
        w = self.weight.view(heads, NOPE + V_DIM, RANK)
        self.w_uk, self.w_uv_t = w[:, :NOPE], w[:, NOPE:].transpose(1, 2)

    @property
    def name(self) -> str:
        return f"B{self.batch}x{self.tokens} H{self.heads}"

    def impl(self, backend: str) -> kvcore.AttentionImpl:
        cls = _backend(backend)
        return cls.get_impl_cls()(
            self.heads, RANK + ROPE, self.scale, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE, v_head_dim=V_DIM, kv_b_proj_weight=self.weight)

    def kvcore_forward(self, backend: str) -> Callable[[], torch.Tensor]:
        """One layer's forward with the step its builder made for a graph of this batch."""
        cls = _backend(backend)
        impl = self.impl(backend)
        spec = kvcore.MLAAttentionSpec(block_size=BLOCK, dtype=torch.bfloat16)
        builder = cls.get_builder_cls()(
            spec, num_heads=self.heads, max_num_seqs=self.batch,
            max_num_batched_tokens=self.batch, max_model_len=self.tokens, device=self.device)
        graph = self.device == "cuda" and cls.CUDA_GRAPH_SUPPORT != kvcore.CudaGraphSupport.NEVER
        meta = builder.build(self.common, graph_batch_size=self.batch if graph else None)
        out = torch.empty(self.batch, self.heads, V_DIM, dtype=torch.bfloat16,
                          device=self.device)
        layer, query, cache = kvcore.LayerScales(), self.query, self.cache

        def call() -> torch.Tensor:
            return impl.forward(layer, query, None, None, cache, meta, output=out)

        return call

    def direct(self, smoke: bool) -> Callable[[], torch.Tensor]:
        """The same math written around FlashInfer's MLA wrapper
        (``bench_flashinfer_mla.flashinfer_mla_layer``), or in ``--smoke`` around the
        reference op in its place, every intermediate preallocated."""
        if not smoke:
            from bench_flashinfer_mla import flashinfer_mla_layer

            return flashinfer_mla_layer(self.query, self.cache, self.common, self.weight,
                                        self.scale, qk_nope_head_dim=NOPE, v_head_dim=V_DIM)
        b, h = self.batch, self.heads
        q_nope = torch.empty(h, b, RANK, dtype=torch.bfloat16, device=self.device)
        o_latent = torch.empty(b, h, RANK, dtype=torch.bfloat16, device=self.device)
        out = torch.empty(b, h, V_DIM, dtype=torch.bfloat16, device=self.device)
        query, cache, common = self.query, self.cache, self.common
        w_uk, w_uv_t = self.w_uk, self.w_uv_t

        def latent() -> None:
            q = torch.cat([q_nope.transpose(0, 1), query[..., NOPE:]], -1)
            o_latent.copy_(kvcore.ops.mla_attention_ref(
                q, cache, kv_lora_rank=RANK, query_start_loc=common.query_start_loc,
                seq_lens=common.seq_lens, block_table=common.block_table, scale=self.scale))

        def call() -> torch.Tensor:
            torch.bmm(query[..., :NOPE].transpose(0, 1), w_uk, out=q_nope)
            latent()
            torch.bmm(o_latent.transpose(0, 1), w_uv_t, out=out.transpose(0, 1))
            return out

        return call


@functools.cache
def _backend(name: str) -> type[kvcore.AttentionBackend]:
    if name == "TRITON_MLA":
        from kvcore_mla import TritonMLABackend

        return TritonMLABackend
    if name == "FLASHINFER_MLA":
        from kvcore_nvidia.backends.flashinfer_mla import FlashInferMLABackend

        return FlashInferMLABackend
    config = kvcore.AttentionSelectorConfig(head_size=RANK + ROPE, dtype=torch.bfloat16,
                                            block_size=BLOCK, use_mla=True)
    return kvcore.get_attn_backend(config, backend=name, platform="cpu")


def run_shape(run: Run, case: Case, backends: tuple[str, ...], smoke: bool,
              rows: list[dict] | None = None) -> None:
    """Check each backend's forward against direct, then time them all in the same rounds;
    one row per path into ``rows`` (default ``run.results["timings"]``)."""
    rows = run.results["timings"] if rows is None else rows
    direct = case.direct(smoke)
    want = direct().clone()
    calls = {"direct": direct}
    for backend in backends:
        try:
            call = case.kvcore_forward(backend)
            err = rel_err(call(), want)
            run.check(f"{case.name}: {backend} forward vs direct", err < MAX_REL_ERR,
                      rel_err=err)
            calls[backend] = call
        except Exception as exc:  # a path's failure is logged, the others still run
            run.log(f"{case.name}: {backend} failed: {type(exc).__name__}: {exc}")
            run.results["errors"].append({"section": f"{case.name} {backend}",
                                          "error": f"{type(exc).__name__}: {exc}"})
    device = case.device
    graphs = harness.time_alternating(calls, device, rounds=3)
    eager = {label: harness.time_call(fn, device, graph=False)[0] for label, fn in calls.items()}
    t_direct = graphs["direct"][0]
    for label, (t, rounds, how) in graphs.items():
        row = dict(shape=case.name, batch=case.batch, heads=case.heads, tokens=case.tokens,
                   path=label, graph_us=t * 1e6, eager_us=eager[label] * 1e6,
                   rounds_us=[x * 1e6 for x in rounds], method=how,
                   direct_over_kvcore=None if label == "direct" else t_direct / t)
        rows.append(row)
        run.log(f"{case.name} {label}: {t * 1e6:.1f} us (graph), {eager[label] * 1e6:.1f} us "
                f"(eager)" + ("" if label == "direct" else f", direct/kvcore {t_direct / t:.3f}"))
    run.save()


def table(rows: list[dict]) -> str:
    head = f"{'shape':<20} {'path':<16} {'graph_us':>9} {'eager_us':>9} {'direct/kvcore':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r["direct_over_kvcore"] is None else f"{r['direct_over_kvcore']:.3f}"
        lines.append(f"{r['shape']:<20} {r['path']:<16} {r['graph_us']:>9.1f} "
                     f"{r['eager_us']:>9.1f} {ratio:>13}")
    return "\n".join(lines)


#: ``bench_step.py``'s shapes of the comparison: B64 x 4096 at 16 and 128 heads.
STEP_SHAPES = [(64, 16, 4096), (64, 128, 4096)]


def run_shapes(run: Run, shapes: list[tuple[int, int, int]], device: str, smoke: bool,
               rows: list[dict] | None = None) -> None:
    """:func:`run_shape` at each ``(batch, heads, tokens)`` of ``shapes`` (CPU_MLA with
    ``smoke``, else TRITON_MLA and FLASHINFER_MLA); a shape's failure is logged and the next
    one still runs."""
    backends = ("CPU_MLA",) if smoke else ("TRITON_MLA", "FLASHINFER_MLA")
    for batch, heads, tokens in shapes:
        case = Case(batch, heads, tokens, device)
        try:
            run_shape(run, case, backends, smoke, rows)
        except Exception as exc:
            run.log(f"{case.name} failed: {type(exc).__name__}: {exc}")
            # As Run.section records them (bench_step's summary prints these too).
            run.results["errors"].append({"section": case.name,
                                          "error": f"{type(exc).__name__}: {exc}"})
        del case
        if device == "cuda":
            torch.cuda.empty_cache()


def bench_step_section(run: Run, *, device: str, smoke: bool) -> None:
    """``benchmarks/bench_step.py``'s MLA section: :data:`STEP_SHAPES` (the first of
    :data:`SMOKE_SHAPES` with ``smoke``), rows in ``run.results["mla_pipeline"]``."""
    run_shapes(run, SMOKE_SHAPES[:1] if smoke else STEP_SHAPES, device, smoke,
               rows=run.results["mla_pipeline"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT") or _ROOT / "benchmarks" / "results"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU: CPU_MLA against the reference op")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on a machine without a GPU")
    run = Run(args.out, "bench_mla_pipeline", ("checks", "timings"), device=device)
    run.results["meta"].update(
        date=datetime.date.today().isoformat(), torch=torch.__version__, smoke=args.smoke,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    run_shapes(run, SMOKE_SHAPES if args.smoke else SHAPES, device, args.smoke)
    run.save()
    print(table(run.results["timings"]), flush=True)


if __name__ == "__main__":
    main()
