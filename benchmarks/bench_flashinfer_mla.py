#!/usr/bin/env python3
"""FLASHINFER_MLA through kvcore (builder + CUDA graph) against FlashInfer's MLA wrapper called
directly, on the same latent cache, on one GPU (written for the H200).

MLA decode, DeepSeek dims (kv_lora_rank 512, rope 64), bf16, blocks of 64, shuffled pages, at
B64 x 4096 tokens with 16 and 128 heads, B8 x 32768 and B128 x 2048 with 128 heads. One run
does, each section isolated (an error is logged and the run goes on):

1. the read ceiling (torch ``sum`` and a Triton streaming read, the faster counts);
2. correctness per shape: kvcore's latent attention against the float64 reference
   (``kvcore.ops.mla_attention_ref``) and against FlashInfer direct;
3. timings per shape (median of CUDA-graph replays, the harness's ``time_call``):
   - ``flashinfer direct``: ``BatchMLAPagedAttentionWrapper`` (``backend="auto"``) planned once,
     ``run`` on the cache's two views, the query halves contiguous;
   - ``FLASHINFER_MLA``: the step built by ``FlashInferMLAMetadataBuilder.build(common,
     graph_batch_size=B)`` (its CUDA-graph wrapper), then the impl's latent attention, the
     part FlashInfer replaces (``forward`` adds the two absorption matmuls);
   - ``FLASHINFER_MLA forward``: the whole layer forward (absorption, attention, ``W_UV``),
     for context;
   - where a gap comes from: direct in FlashInfer's CUDA-graph mode, direct with query
     views, kvcore's graph plan run by direct's call, and kvcore's eager plan (FlashInfer's
     plain wrapper);
   - the builder's ``build()`` host time per step (the plan: once per step, not per layer).
   ``--fp8`` adds the fp8-cache rows (another FlashInfer JIT module) at B64 x 4096 H128.

The table printed last gives time, GB/s (latent bytes a perfect kernel reads: each once), % of
the read ceiling, TFLOP/s (``2 * B * H * L * (576 + 512)``) and kvcore's ratio to direct
(direct time / kvcore time: >= 0.99 is the target). Logs and JSON go to ``--out`` (default
``$OUT``, else ``benchmarks/results``).

Usage: ``python benchmarks/bench_flashinfer_mla.py [--out DIR] [--fp8]``; about a minute plus
FlashInfer's JIT build on a cold cache.
"""

from __future__ import annotations

import datetime
import functools
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "plugins" / "nvidia")]
import kvcore  # noqa: E402
import kvcore.ops  # noqa: E402
from kvcore.cli import harness  # noqa: E402
from kvcore.cli.harness import Run, rel_err  # noqa: E402

DEVICE = "cuda"
time_call = functools.partial(harness.time_call, device=DEVICE)
RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
ENTRY = RANK + ROPE
BLOCK = 64
SHAPES = [(64, 16, 4096), (64, 128, 4096), (8, 128, 32768), (128, 128, 2048)]
FP8_SHAPE = (64, 128, 4096)


def shape_name(batch: int, heads: int, tokens: int) -> str:
    return f"B{batch}x{tokens} H{heads}"


class Decode:
    """``batch`` decode requests of ``tokens`` tokens over shuffled pages of a random latent
    cache, and their latent queries ``[W_UK^T q_nope, q_pe]`` ``(batch, heads, 576)``."""

    def __init__(self, batch: int, heads: int, tokens: int, kv_cache_dtype: str = "auto",
                 device: str = DEVICE):
        self.batch, self.heads, self.tokens = batch, heads, tokens
        self.kv_cache_dtype = kv_cache_dtype
        pages = -(-tokens // BLOCK)
        num_blocks = batch * pages + 16
        g = torch.Generator(device=device).manual_seed(batch * 7919 + heads * 31 + tokens)
        cache = torch.randn(num_blocks, BLOCK, ENTRY, generator=g, device=device)
        self.fp8 = kv_cache_dtype != "auto"
        self.k_scale = 0.25 if self.fp8 else 1.0
        self.cache = ((cache / self.k_scale).to(torch.float8_e4m3fn) if self.fp8
                      else cache.to(torch.bfloat16))
        perm = torch.randperm(num_blocks, generator=g, device=device)[: batch * pages]
        tables = perm.view(batch, pages).tolist()
        self.common = kvcore.build_attention_metadata([1] * batch, [tokens - 1] * batch,
                                                      tables, BLOCK, device=device)
        self.q = (torch.randn(batch, heads, ENTRY, generator=g, device=device)
                  .to(torch.bfloat16))
        self.scale = (NOPE + ROPE) ** -0.5

    def kv_bytes(self) -> int:
        return self.batch * self.tokens * ENTRY * self.cache.element_size()

    def flops(self) -> float:
        return 2.0 * self.batch * self.heads * self.tokens * (ENTRY + RANK)


def reference(d: Decode) -> torch.Tensor:
    """The float64 latent attention of ``d`` (``kvcore.ops.mla_attention_ref``).

    A float64 query needs a float64 cache (an fp8 cache is read as it is, dequantised by the
    reference): a bf16 cache is widened first, which is exact.
    """
    m = d.common
    cache = d.cache if d.fp8 else d.cache.double()
    return kvcore.ops.mla_attention_ref(
        d.q.double(), cache, kv_lora_rank=RANK, query_start_loc=m.query_start_loc,
        seq_lens=m.seq_lens, block_table=m.block_table, scale=d.scale,
        kv_cache_dtype=d.kv_cache_dtype, k_scale=d.k_scale)


# ----------------------------------------------------------------------------- the two paths


def flashinfer_mla_direct(q: torch.Tensor, cache: torch.Tensor,
                          common: kvcore.AttentionMetadata, scale: float, *,
                          k_scale: float | None = None, graph_mode: bool = False,
                          query_views: bool = False):
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` as a user calls it on kvcore's MLA cache,
    planned once for a decode batch: returns ``run() -> out`` (``(batch, heads, 512)`` bf16).

    ``q`` ``(batch, heads, 576)`` latent queries (bf16); ``cache`` ``(num_blocks, block, 576)``
    (bf16, or fp8 with ``k_scale``), read through its ``ckv``/``kpe`` views (no copies);
    ``common`` the step's metadata (every request uses all of its block-table columns).
    ``graph_mode``: the wrapper in FlashInfer's CUDA-graph mode (its metadata in buffers given
    at construction), as a step captured once and replayed for later steps must use;
    ``query_views``: the query halves passed as views of ``q`` (as FLASHINFER_MLA passes
    them) instead of contiguous copies. Shared by this script and ``bench_mla.py``, so both
    time FlashInfer the same way.
    """
    import flashinfer.mla

    batch, heads, _ = q.shape
    block = cache.shape[1]
    pages = (common.seq_lens + block - 1) // block
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    kv_indices = common.block_table.flatten().contiguous()
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    if graph_mode:
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True, qo_indptr=common.query_start_loc.clone(),
            kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(),
            kv_len_arr=common.seq_lens.clone())
    else:
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(metadata=flashinfer.mla.MLAPlanMetadata.csr(
                     common.query_start_loc, kv_indptr, kv_indices, common.seq_lens),
                 num_heads=heads, head_dim_ckv=RANK, head_dim_kpe=ROPE, page_size=block,
                 causal=False, sm_scale=scale, q_data_type=torch.bfloat16,
                 kv_data_type=cache.dtype, query_layout="split", kv_cache_layout="split")
    q_nope, q_pe = q[..., :RANK], q[..., RANK:]
    if not query_views:
        q_nope, q_pe = q_nope.contiguous(), q_pe.contiguous()
    ckv, kpe = cache[..., :RANK], cache[..., RANK:]
    out = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device=q.device)
    fp8 = {"ckv_scale": k_scale, "kpe_scale": k_scale} if k_scale is not None else {}

    def call() -> torch.Tensor:
        return wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=out, **fp8)

    return call


def flashinfer_mla_layer(query: torch.Tensor, cache: torch.Tensor,
                         common: kvcore.AttentionMetadata, kv_b_proj_weight: torch.Tensor,
                         scale: float, *, qk_nope_head_dim: int, v_head_dim: int):
    """An absorbed MLA layer's decode as a user writes it around FlashInfer's
    ``BatchMLAPagedAttentionWrapper`` (planned once, every intermediate preallocated), the
    math kvcore's MLA backends' ``forward`` does: ``q_nope^T W_UK`` into a buffer, the
    wrapper's ``run`` on it and a view of the query's rope part, ``o^T W_UV^T`` into the
    output. Returns ``run() -> out`` (``(batch, heads, v_head_dim)``).

    ``query`` ``(batch, heads, qk_nope_head_dim + rope)``; ``cache`` ``(num_blocks, block,
    kv_lora_rank + rope)`` bf16; ``kv_b_proj_weight`` ``(heads * (qk_nope_head_dim +
    v_head_dim), kv_lora_rank)``; ``common`` the decode step's metadata. Shared by
    ``bench_mla_pipeline.py`` and ``bench_matrix.py``."""
    import flashinfer.mla

    batch, heads, _ = query.shape
    rank = kv_b_proj_weight.shape[1]
    rope, block = cache.shape[-1] - rank, cache.shape[1]
    nope, device, dtype = qk_nope_head_dim, query.device, query.dtype
    w = kv_b_proj_weight.view(heads, nope + v_head_dim, rank)
    w_uk, w_uv_t = w[:, :nope], w[:, nope:].transpose(1, 2)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    torch.cumsum((common.seq_lens + block - 1) // block, 0, out=kv_indptr[1:])
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(metadata=flashinfer.mla.MLAPlanMetadata.csr(
                     common.query_start_loc, kv_indptr,
                     common.block_table.flatten().contiguous(), common.seq_lens),
                 num_heads=heads, head_dim_ckv=rank, head_dim_kpe=rope, page_size=block,
                 causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=cache.dtype,
                 query_layout="split", kv_cache_layout="split")
    q_nope = torch.empty(heads, batch, rank, dtype=dtype, device=device)
    o_latent = torch.empty(batch, heads, rank, dtype=dtype, device=device)
    out = torch.empty(batch, heads, v_head_dim, dtype=dtype, device=device)
    ckv, kpe = cache[..., :rank], cache[..., rank:]

    def call() -> torch.Tensor:
        torch.bmm(query[..., :nope].transpose(0, 1), w_uk, out=q_nope)
        wrapper.run(query=(q_nope.transpose(0, 1), query[..., nope:]), kv_cache=(ckv, kpe),
                    out=o_latent)
        torch.bmm(o_latent.transpose(0, 1), w_uv_t, out=out.transpose(0, 1))
        return out

    return call


def direct(d: Decode, graph_mode: bool = False, query_views: bool = False):
    """FlashInfer's wrapper as a user calls it, planned once: returns ``run() -> out``
    (the options: :func:`flashinfer_mla_direct`'s)."""
    return flashinfer_mla_direct(d.q, d.cache, d.common, d.scale,
                                 k_scale=d.k_scale if d.fp8 else None, graph_mode=graph_mode,
                                 query_views=query_views)


class Kvcore:
    """FLASHINFER_MLA as an engine runs it: one builder, the step built for a CUDA graph of
    the batch size, one layer's impl."""

    def __init__(self, d: Decode) -> None:
        from kvcore_nvidia.backends.flashinfer_mla import FlashInferMLABackend

        g = torch.Generator(device=DEVICE).manual_seed(d.heads)
        self.weight = (torch.randn(d.heads * (NOPE + V_DIM), RANK, generator=g, device=DEVICE)
                       * RANK**-0.5).to(torch.bfloat16)
        self.impl = FlashInferMLABackend.get_impl_cls()(
            d.heads, ENTRY, d.scale, kv_cache_dtype=d.kv_cache_dtype, kv_lora_rank=RANK,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
            kv_b_proj_weight=self.weight)
        spec = kvcore.MLAAttentionSpec(block_size=BLOCK, dtype=torch.bfloat16,
                                       kv_cache_dtype=d.kv_cache_dtype)
        self.spec, self.d = spec, d
        self.builder = self.make_builder()
        self.layer = kvcore.LayerScales(k_scale=d.k_scale, v_scale=d.k_scale)
        self.meta = self.build()

    def make_builder(self) -> kvcore.AttentionMetadataBuilder:
        from kvcore_nvidia.backends.flashinfer_mla import FlashInferMLABackend

        d = self.d
        return FlashInferMLABackend.get_builder_cls()(
            self.spec, num_heads=d.heads, max_num_seqs=d.batch, max_num_batched_tokens=d.batch,
            max_model_len=d.tokens, device=DEVICE, scale=d.scale)

    def build(self) -> kvcore.AttentionMetadata:
        return self.builder.build(self.d.common, graph_batch_size=self.d.batch)

    def latent(self) -> torch.Tensor:
        # The latent attention alone: what FlashInfer direct computes.
        return self.impl._latent_attention(self.layer, self.d.q, self.d.cache, self.meta)

    def forward_call(self):
        query = torch.randn(self.d.batch, self.d.heads, NOPE + ROPE, device=DEVICE,
                            dtype=torch.bfloat16)
        out = torch.empty(self.d.batch, self.d.heads, V_DIM, dtype=torch.bfloat16,
                          device=DEVICE)

        def call() -> torch.Tensor:
            return self.impl.forward(self.layer, query, None, None, self.d.cache, self.meta,
                                     output=out)

        return call


# ----------------------------------------------------------------------------- sections


def measure_ceiling(run: Run) -> None:
    x = torch.randn((2 << 30) // 4, device=DEVICE)
    harness.warm_up(torch.empty_like(x), x, 1.0)
    read_sum, _ = harness.read_gbps(x, time_call)
    read_triton, _ = harness.triton_read_gbps(x, time_call)
    c = run.results["ceilings"]
    c.update(read_torch_sum_GBps=read_sum, read_triton_GBps=read_triton,
             read_GBps=max(read_sum, read_triton))
    run.log(f"read ceiling {c['read_GBps']:.0f} GB/s (torch.sum {read_sum:.0f}, triton "
            f"{read_triton:.0f})")


def check_and_time(run: Run, batch: int, heads: int, tokens: int,
                   kv_cache_dtype: str = "auto") -> None:
    d = Decode(batch, heads, tokens, kv_cache_dtype)
    name = shape_name(batch, heads, tokens) + ("" if kv_cache_dtype == "auto" else " fp8")
    ours = Kvcore(d)
    fi = direct(d)
    out_fi = fi().clone()
    out_ours = ours.latent().clone()
    ref = reference(d)
    err_ref, err_fi = rel_err(out_ours, ref), rel_err(out_ours, out_fi)
    run.check(f"{name}: FLASHINFER_MLA vs float64 reference", err_ref < 2e-2, rel_err=err_ref)
    run.check(f"{name}: FLASHINFER_MLA vs FlashInfer direct", err_fi < 1e-2, rel_err=err_fi,
              bit_exact=bool(torch.equal(out_ours, out_fi)))
    del ref
    # Every variant of the shape, timed in the same rounds (taking turns). Where a gap to
    # direct comes from: FlashInfer's CUDA-graph mode, the query views (direct's side);
    # kvcore's graph plan run by direct's own call, kvcore's eager plan (FlashInfer's plain
    # wrapper, planned by a second builder: a build invalidates the previous build's step).
    q_nope, q_pe = d.q[..., :RANK].contiguous(), d.q[..., RANK:].contiguous()
    out = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device=DEVICE)
    fp8 = {"ckv_scale": d.k_scale, "kpe_scale": d.k_scale} if d.fp8 else {}

    def kvcore_plan_direct_call(wrapper=ours.meta.wrapper) -> torch.Tensor:
        return wrapper.run(query=(q_nope, q_pe),
                           kv_cache=(d.cache[..., :RANK], d.cache[..., RANK:]), out=out, **fp8)

    eager_meta = ours.make_builder().build(d.common)

    def kvcore_eager_plan() -> torch.Tensor:
        return ours.impl._latent_attention(ours.layer, d.q, d.cache, eager_meta)

    calls = {"flashinfer direct": fi}
    makers = (("flashinfer direct, graph mode", lambda: direct(d, graph_mode=True)),
              ("flashinfer direct, query views", lambda: direct(d, query_views=True)),
              ("FLASHINFER_MLA's graph plan, direct's call", lambda: kvcore_plan_direct_call),
              ("FLASHINFER_MLA, eager plan", lambda: kvcore_eager_plan))
    same = {}
    for label, make in makers:
        try:
            call = make()
            same[label] = bool(torch.equal(call(), out_fi))
            calls[label] = call
        except Exception as exc:  # a variant's failure is logged, not fatal
            run.log(f"{name}: {label} failed: {type(exc).__name__}: {exc}")
    calls["FLASHINFER_MLA"] = ours.latent
    calls["FLASHINFER_MLA forward"] = ours.forward_call()
    timed = harness.time_alternating(calls, DEVICE, rounds=3)
    builds = []
    for _ in range(5):
        t0 = time.perf_counter()
        ours.meta = ours.build()
        torch.cuda.synchronize()
        builds.append(time.perf_counter() - t0)
    ceiling = run.results["ceilings"].get("read_GBps")
    t_fi = timed["flashinfer direct"][0]
    for label, (t, samples, how) in timed.items():
        gbps = d.kv_bytes() / t / 1e9
        row = dict(path=label, shape=name, time_us=t * 1e6, GBps=gbps,
                   ceiling_frac=gbps / ceiling if ceiling else None,
                   TFLOPs=d.flops() / t / 1e12, rounds_us=[x * 1e6 for x in samples],
                   method=how if label not in same
                   else f"{how}, same output as direct: {same[label]}")
        if label == "FLASHINFER_MLA":
            row.update(direct_over_kvcore=t_fi / t,
                       build_ms=sorted(builds)[len(builds) // 2] * 1e3)
            if "flashinfer direct, graph mode" in timed:
                row.update(graph_direct_over_kvcore=(
                    timed["flashinfer direct, graph mode"][0] / t))
        run.results["timings"].append(row)
        run.log("TIME", row)


def print_table(run: Run) -> None:
    headers = ["path", "shape", "time us", "GB/s", "% read", "TFLOP/s", "direct/kvcore",
               "graph-mode direct/kvcore", "build ms"]
    cell = harness.format_value
    rows = []
    for r in run.results["timings"]:
        rows.append([r["path"], r["shape"], cell(r, "time_us", ".1f"), cell(r, "GBps", ".0f"),
                     cell(r, "ceiling_frac", ".1f", 100), cell(r, "TFLOPs", ".0f"),
                     cell(r, "direct_over_kvcore", ".3f"),
                     cell(r, "graph_direct_over_kvcore", ".3f"), cell(r, "build_ms", ".2f")])
    checks = run.results["checks"]
    lines = [f"device: {run.results['meta'].get('device')}; read ceiling "
             f"{run.results['ceilings'].get('read_GBps', float('nan')):.0f} GB/s; correctness: "
             f"{sum(x['ok'] for x in checks)}/{len(checks)} passed; errors: "
             f"{len(run.results['errors'])}"]
    lines.append(harness.format_table(rows, headers))
    lines.extend(f"FAILED check: {c}" for c in checks if not c["ok"])
    run.write_summary(lines)


def main() -> None:
    parser = harness.script_parser(__doc__, _ROOT / "benchmarks" / "results")
    parser.add_argument("--fp8", action="store_true",
                        help=f"also the fp8 cache at {shape_name(*FP8_SHAPE)} (Hopper only)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no GPU: this benchmark compares two GPU paths")
    from kvcore_nvidia.backends.flashinfer_mla import FlashInferMLABackend

    missing = FlashInferMLABackend.unavailable_reasons()
    if missing:
        sys.exit("FLASHINFER_MLA cannot run here: " + "; ".join(missing))
    import flashinfer

    run = Run(args.out, "bench_flashinfer_mla", ("checks", "timings"), device=DEVICE)
    run.results["meta"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "flashinfer": getattr(flashinfer, "__version__", "?"),
        "dims": {"kv_lora_rank": RANK, "rope": ROPE, "block_size": BLOCK, "dtype": "bfloat16"},
    }
    run.log("meta", run.results["meta"])
    # Checked once per step by the builder; the timings capture graphs, which cannot sync.
    kvcore.ops.set_value_checks(False)
    with run.section("ceiling"):
        measure_ceiling(run)
    for shape in SHAPES:
        with run.section(shape_name(*shape)):
            check_and_time(run, *shape)
    if args.fp8:
        with run.section(shape_name(*FP8_SHAPE) + " fp8"):
            if torch.cuda.get_device_capability()[0] != 9:
                raise harness.Skip("FlashInfer's fp8 MLA cache needs capability 9.x")
            check_and_time(run, *FP8_SHAPE, kv_cache_dtype="fp8")
    print_table(run)
    run.save()


if __name__ == "__main__":
    main()
