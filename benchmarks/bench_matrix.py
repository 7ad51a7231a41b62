#!/usr/bin/env python3
"""The model-shape matrix: model presets (``kvcore.models``) x every valid kvcore backend, and
beside them FlashInfer and flash-attn-4 called directly wherever they run the step.

For each preset, layer kind (full, sliding, MLA), KV-cache dtype (bf16 and fp8 e4m3), block
size (16 and 64) and step (decode at two batch x context points, a prefill, a mixed
chunked-prefill step), :func:`kvcore.cli.model_bench.run_model_bench` times every valid
kvcore backend as an engine calls it (builder once, the layer's ``forward``; CUDA graphs where
the backend declares them) and the peers below, on the same shapes, against the read
bandwidth and matmul rate measured in the same run (the roofline: ``max(bytes / bandwidth,
FLOPs / matmul)``). The peers:

- **flashinfer direct**: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores) for decode
  steps and ``BatchPrefillWithPagedKVCacheWrapper`` (causal) for prefill and mixed steps on a
  standard NHD cache, planned once, with the layer's window (``window_left``) and soft-cap;
  MLA decode as the whole absorbed layer around ``BatchMLAPagedAttentionWrapper``
  (:func:`flashinfer_mla_pipeline`: the ``W_UK`` and ``W_UV`` products beside the wrapper's
  ``run``, the same math kvcore's MLA backends' ``forward`` does); the same wrapper calls
  as ``bench_backends.flashinfer_direct``, with the preset's shapes. Layers with sinks
  (gpt-oss) run every step through ``BatchAttentionWithAttentionSinkWrapper`` (causal, with
  the window), FlashInfer's paged wrapper for sinks on Hopper: a prefill wrapper whose JIT
  variant ``AttentionSink`` adds
  ``exp(sink[h])`` to each row's denominator and no value, the sink an unscaled logit as in
  kvcore; ``backend="auto"`` builds it with fa3 on sm90 for bf16 caches (head sizes 64, 128,
  256) and fa2 for fp8 caches (FlashInfer's fa3 reads fp8 K/V only with an fp8 query). The
  plain wrappers' ``run(..., sinks=...)`` is no peer for them: in FlashInfer 0.7.2 the
  prefill wrapper hands the sinks to its trtllm-gen kernels only, the decode wrapper to
  trtllm-gen, cuDNN and cute-dsl, and their fa2/fa3 paths drop them. Before it is timed, a
  sink step's output is checked against kvcore's float64 reference on its first and last
  requests (:func:`check_against_reference`; sink logits from -2 to 10 across the heads,
  the larger ones outweighing a window's keys); a failed check is the row's error, not a
  time;
- **flashinfer direct (graph wrapper)**, decode steps: the same decode call on a
  ``BatchDecodeWithPagedKVCacheWrapper`` made with ``use_cuda_graph=True`` and its page-list
  buffers, the kind an engine must plan when it captures decode steps and re-plans them (vLLM's
  and kvcore's FLASHINFER); beside the eager wrapper above, it shows what graph mode costs;
- **flash-attn-4 direct**: ``flash_attn.cute.interface.flash_attn_varlen_func`` on the cache
  halves with the block table (bf16/fp16 caches), with the window and soft-cap.

flash-attn-4 and the graph wrapper take no sinks here: a sink step has one peer. The table
printed last gives, per step, each implementation's time, % of the roofline and its speed
against the fastest other implementation; then every step where the backend kvcore selects
is below 0.95x the best peer. JSON and the log go to ``--out`` (default
``$OUT``, else ``benchmarks/results``).

Usage: ``python benchmarks/bench_matrix.py [--model NAME ...] [--kv-cache-dtype auto|fp8_e4m3]
[--block-size N] [--phase decode|prefill|mixed] [--budget-s S] [--small] [--no-peers]
[--backend NAME ...] [--ranking PATH]``; ``--backend`` times only those kvcore backends;
``--ranking`` also writes kvcore's rows as a ranking file (``kvcore tune``'s format; the
CUDA platform's shipped order, ``kvcore/platforms/cuda_ranking.json``, is one).
``--small`` scales every preset down and runs on the CPU in seconds (no peers there).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(Path(__file__).resolve().parent)]
import kvcore  # noqa: E402
from kvcore import build_attention_metadata  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.model_bench import (  # noqa: E402
    ModelBenchOptions,
    ModelBenchReport,
    PeerUnsupported,
    StepInputs,
    format_model_report,
    run_model_bench,
)
from kvcore.cli.tune import ranking_from_report  # noqa: E402
from kvcore.models import MODELS  # noqa: E402
from kvcore.ops import paged_attention_ref  # noqa: E402
from kvcore.ranking import library_versions, write_ranking  # noqa: E402

#: The ratio to the best peer under which a selected backend's step is listed as a gap.
GAP = 0.95
#: Largest relative error norm of a checked peer's output against the float64 reference: a
#: bf16 kernel's rounding stays near 3e-3, a dropped or rescaled sink is far above.
MAX_REL_ERR = 2e-2
PeerList = list[tuple[str, Callable[[], object], bool]]


def sink_logits(num_heads: int, device: torch.device) -> torch.Tensor:
    """``(num_heads,)`` float32 sink logits from -2 to 10: at 10 a sink outweighs a 128-token
    window's keys, at -2 it barely counts, so a sink that is dropped or scaled moves the
    output (the values do not change the time)."""
    return torch.linspace(-2.0, 10.0, num_heads, device=device)


def check_against_reference(inputs: StepInputs, out: torch.Tensor,
                            sinks: torch.Tensor | None) -> float:
    """``out``'s relative error norm on the step's first and last requests against kvcore's
    float64 reference (the layer's scale, window, soft-cap and ``sinks``) on a compact copy
    of their pages; a ``RuntimeError`` above :data:`MAX_REL_ERR`. ``out``: ``(num_tokens,
    num_heads, head_size)``, the peer's output for the whole step."""
    layer, case = inputs.layer, inputs.case
    picked = sorted({0, len(case.q_lens) - 1})
    tables = [inputs.tables[i] for i in picked]
    used = sorted({b for t in tables for b in t})
    renumber = {b: i for i, b in enumerate(used)}
    compact = inputs.kv_cache[torch.tensor(used, device=inputs.device)].double()
    meta = build_attention_metadata([case.q_lens[i] for i in picked],
                                    [case.ctx_lens[i] for i in picked],
                                    [[renumber[b] for b in t] for t in tables],
                                    inputs.config.block_size, device=inputs.device)
    starts = inputs.common.query_start_loc.tolist()
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in picked]).to(inputs.device)
    reference = paged_attention_ref(
        inputs.query[rows].double(), *compact.unbind(1), query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens, block_table=meta.block_table, scale=layer.softmax_scale,
        sliding_window=layer.sliding_window, logits_soft_cap=layer.logits_soft_cap,
        sinks=None if sinks is None else sinks.double())
    err = harness.rel_err(out[rows], reference)
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"the output's relative error {err:.3g} against kvcore's float64 "
                           f"reference (requests {picked}) is above {MAX_REL_ERR:g}: the "
                           "library computes another attention than the step's; not timed")
    return err


def flashinfer_sink_direct(inputs: StepInputs) -> Callable[[], object]:
    """FlashInfer's ``BatchAttentionWithAttentionSinkWrapper`` (causal, the layer's window)
    on the standard NHD cache for every step of a layer with sinks, planned once and checked
    against the float64 reference before it is timed."""
    import flashinfer
    from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

    layer, config, common = inputs.layer, inputs.config, inputs.common
    if layer.mla is not None or layer.logits_soft_cap is not None:
        raise PeerUnsupported("flashinfer direct: BatchAttentionWithAttentionSinkWrapper runs "
                              "K/V layers without a soft-cap (its AttentionSink variant has "
                              "none): sinks beside MLA or a soft-cap are not timed")
    window_left = (layer.sliding_window - 1) if layer.sliding_window else -1
    wrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=inputs.device), "NHD",
        q_data_type=config.dtype, kv_data_type=inputs.kv_cache.dtype,
        head_dim_qk=layer.head_size, head_dim_vo=layer.head_size, window_left=window_left)
    indptr, indices, last = flashinfer_page_table(common, config.block_size)
    wrapper.plan(common.query_start_loc, indptr, indices, last, layer.num_heads,
                 layer.num_kv_heads, layer.head_size, config.block_size, causal=True,
                 window_left=window_left, q_data_type=config.dtype,
                 kv_data_type=inputs.kv_cache.dtype, sm_scale=layer.softmax_scale)
    sinks = sink_logits(layer.num_heads, inputs.device)
    out = torch.empty(common.num_actual_tokens, layer.num_heads, layer.head_size,
                      dtype=config.dtype, device=inputs.device)
    query, scale = inputs.query, layer.softmax_scale

    def call() -> object:
        return wrapper.run(query, inputs.kv_cache, sinks, scale, out=out)

    call()
    check_against_reference(inputs, out, sinks)
    return call


def flashinfer_direct(inputs: StepInputs) -> Callable[[], object]:
    """FlashInfer's wrapper on the standard NHD cache, planned once for the step (layers with
    sinks: :func:`flashinfer_sink_direct`)."""
    if inputs.layer.has_sink:
        return flashinfer_sink_direct(inputs)
    import flashinfer
    from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

    layer, config, common = inputs.layer, inputs.config, inputs.common
    if layer.mla is not None:
        return flashinfer_mla_pipeline(inputs)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=inputs.device)
    indptr, indices, last = flashinfer_page_table(common, config.block_size)
    options = dict(q_data_type=config.dtype, kv_data_type=inputs.kv_cache.dtype,
                   sm_scale=layer.softmax_scale,
                   window_left=(layer.sliding_window - 1) if layer.sliding_window else -1,
                   logits_soft_cap=layer.logits_soft_cap or 0.0)
    heads = (layer.num_heads, layer.num_kv_heads, layer.head_size, config.block_size)
    if inputs.case.phase == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                use_tensor_cores=True)
        wrapper.plan(indptr, indices, last, *heads, **options)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(common.query_start_loc, indptr, indices, last, *heads, causal=True,
                     **options)
    out = torch.empty(common.num_actual_tokens, layer.num_heads, layer.head_size,
                      dtype=config.dtype, device=inputs.device)
    query = inputs.query
    return lambda: wrapper.run(query, inputs.kv_cache, out=out)


def flashinfer_mla_pipeline(inputs: StepInputs) -> Callable[[], object]:
    """An MLA layer's decode, the whole absorbed layer around FlashInfer's
    ``BatchMLAPagedAttentionWrapper`` (``bench_flashinfer_mla.flashinfer_mla_layer``): the
    same math as kvcore's MLA backends' ``forward``, which the matrix times."""
    from bench_flashinfer_mla import flashinfer_mla_layer

    layer, config = inputs.layer, inputs.config
    if inputs.case.phase != "decode" or config.kv_cache_dtype != "auto":
        raise PeerUnsupported("flashinfer direct MLA: bf16 decode steps only here")
    return flashinfer_mla_layer(inputs.query, inputs.kv_cache, inputs.common,
                                inputs.kv_b_proj_weight, layer.softmax_scale,
                                qk_nope_head_dim=layer.mla.qk_nope_head_dim,
                                v_head_dim=layer.mla.v_head_dim)


def flashinfer_graph_wrapper(inputs: StepInputs) -> Callable[[], object]:
    """FlashInfer's tensor-core decode on a CUDA-graph-mode wrapper (decode steps only)."""
    import flashinfer
    from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table

    layer, config, common = inputs.layer, inputs.config, inputs.common
    if inputs.case.phase != "decode" or layer.mla is not None or layer.has_sink:
        # Its run(..., sinks=...) drops the sinks on fa2 (FlashInfer 0.7.2).
        raise PeerUnsupported("flashinfer graph wrapper: K/V decode steps without sinks only")
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=inputs.device)
    indptr, indices, last = flashinfer_page_table(common, config.block_size)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(indices),
        paged_kv_last_page_len_buffer=torch.empty_like(last))
    wrapper.plan(indptr, indices, last, layer.num_heads, layer.num_kv_heads, layer.head_size,
                 config.block_size, q_data_type=config.dtype,
                 kv_data_type=inputs.kv_cache.dtype, sm_scale=layer.softmax_scale,
                 window_left=(layer.sliding_window - 1) if layer.sliding_window else -1,
                 logits_soft_cap=layer.logits_soft_cap or 0.0)
    out = torch.empty(common.num_actual_tokens, layer.num_heads, layer.head_size,
                      dtype=config.dtype, device=inputs.device)
    query = inputs.query
    return lambda: wrapper.run(query, inputs.kv_cache, out=out)


def flash_attn_4_direct(inputs: StepInputs) -> Callable[[], object]:
    """flash-attn-4 on the cache halves, its metadata made once."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    layer, common = inputs.layer, inputs.common
    if layer.mla is not None or layer.has_sink:
        raise PeerUnsupported("flash-attn-4 direct: MLA and sinks are not timed here")
    if inputs.kv_cache.dtype not in (torch.bfloat16, torch.float16):
        raise PeerUnsupported(f"flash-attn-4 direct: a {inputs.kv_cache.dtype} cache is not "
                              "timed here (bf16/fp16 only)")
    key_cache, value_cache = inputs.kv_cache.unbind(1)
    window = (layer.sliding_window - 1, 0) if layer.sliding_window else (None, None)
    extra = {"softcap": layer.logits_soft_cap} if layer.logits_soft_cap else {}

    def call() -> object:
        return flash_attn_varlen_func(
            inputs.query, key_cache, value_cache, cu_seqlens_q=common.query_start_loc,
            max_seqlen_q=common.max_query_len, seqused_k=common.seq_lens,
            max_seqlen_k=common.max_seq_len, page_table=common.block_table,
            softmax_scale=layer.softmax_scale, causal=True, window_size=window, **extra)

    return call


def peers(inputs: StepInputs) -> PeerList:
    """The library calls available here for the step (none on the CPU)."""
    if inputs.device.type != "cuda":
        return []
    found: PeerList = []
    for name, make in (("flashinfer direct", flashinfer_direct),
                       ("flashinfer direct (graph wrapper)", flashinfer_graph_wrapper),
                       ("flash-attn-4 direct", flash_attn_4_direct)):
        try:
            found.append((name, make(inputs), True))
        except (ImportError, PeerUnsupported):
            continue
        except Exception as exc:  # a peer that cannot even plan: its row says why
            message = f"{type(exc).__name__}: {exc}"

            def failing(message: str = message) -> object:
                raise RuntimeError(message)

            found.append((name, failing, False))
    return found


def gaps(report: ModelBenchReport) -> list[str]:
    """Steps where the selected backend is below ``GAP`` x the best peer of the same step."""
    groups: dict[tuple, list] = {}
    for row in report.rows:
        if row.ok:
            groups.setdefault(row.group, []).append(row)
    lines = []
    for group, rows in groups.items():
        pick = next((r for r in rows if r.selected), None)
        peer_times = [r.seconds for r in rows if not r.kvcore]
        if pick is None or not peer_times:
            continue
        ratio = min(peer_times) / pick.seconds
        if ratio < GAP:
            best = min((r for r in rows if not r.kvcore), key=lambda r: r.seconds)
            lines.append(f"{' '.join(map(str, group))}: {pick.impl} {ratio:.2f}x of "
                         f"{best.impl} ({pick.seconds * 1e6:.1f} vs {best.seconds * 1e6:.1f} us)")
    return lines


def main() -> int:
    parser = harness.script_parser(__doc__, _ROOT / "benchmarks" / "results")
    parser.add_argument("--model", action="append", default=None,
                        help="a preset (repeatable; default: every preset)")
    parser.add_argument("--kv-cache-dtype", action="append", default=None)
    parser.add_argument("--block-size", action="append", type=int, default=None)
    parser.add_argument("--phase", action="append", default=None,
                        choices=("decode", "prefill", "mixed"))
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="stop starting new steps after this many seconds (0: no limit)")
    parser.add_argument("--small", action="store_true", help="scaled-down presets (CPU)")
    parser.add_argument("--no-peers", action="store_true", help="kvcore's backends only")
    parser.add_argument("--backend", action="append", default=None, metavar="NAME",
                        help="time only these kvcore backends (repeatable; default: every "
                             "valid one)")
    parser.add_argument("--ranking", type=Path, default=None, metavar="PATH",
                        help="also write kvcore's rows as this device's ranking into PATH "
                             "(what kvcore tune writes, from the same timings)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.small
    if not on_gpu and not args.small:
        print("bench_matrix needs a GPU (or --small for the CPU)")
        return 1
    run = harness.Run(args.out, "bench_matrix", ("rows",), device="cuda" if on_gpu else "cpu")
    run.results["meta"] = harness.run_meta("cuda" if on_gpu else "cpu")
    run.results["meta"]["versions"] = library_versions()
    report = None
    with run.section("matrix"):
        report = run_model_bench(ModelBenchOptions(
            models=args.model or list(MODELS), small=args.small,
            kv_cache_dtypes=args.kv_cache_dtype or ModelBenchOptions.kv_cache_dtypes,
            block_sizes=args.block_size or ModelBenchOptions.block_sizes,
            phases=args.phase or ModelBenchOptions.phases, budget_s=args.budget_s,
            platform="cuda" if on_gpu else "cpu", backends=args.backend, log=run.log),
            peers=None if args.no_peers else peers)
        run.results["rows"] = [r.to_dict() for r in report.rows]
        run.results["ceilings"] = {"read_GBps": report.read_gbps,
                                   "matmul_TFLOPs": report.matmul_tflops}
        run.results["gaps"] = gaps(report)
        if args.ranking is not None:
            platform = kvcore.get_platform("cuda" if on_gpu else "cpu")
            ranking = ranking_from_report(report, platform, args.budget_s)
            run.log(f"ranking of {len(ranking.cases)} cases written to "
                    f"{write_ranking(ranking, args.ranking)}")
    if report is not None:
        run.log("\n" + format_model_report(report))
        below = run.results["gaps"]
        run.log(f"\nselected backend below {GAP}x the best peer: {len(below)} step(s)"
                + "".join(f"\n  {line}" for line in below))
    run.save()
    print(json.dumps({"json": str(args.out / "bench_matrix.json")}))
    return 1 if run.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
