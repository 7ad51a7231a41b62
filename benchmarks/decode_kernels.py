#!/usr/bin/env python3
"""Which kernels a decode step launches, and for how long: kvcore's FLASHINFER and TRITON_ATTN
(the builder's step for a CUDA graph of the batch, then the layer's ``forward``, as
``bench_matrix.py`` times them), TRITON_ATTN's op called directly on the same inputs with its
own defaults, beside FlashInfer's decode wrapper called directly, planned
eagerly and in its CUDA-graph mode (``bench_matrix.flashinfer_direct`` and
``flashinfer_graph_wrapper``), on the same random cache, at the preset's two decode points.

Per path: the median time of CUDA-graph replays and of eager back-to-back calls
(``kvcore.cli.harness.time_call``), then each kernel of five eager calls under
``torch.profiler`` with its mean device time per call. It answers "why is path A slower than
B on the same step": a split the other does not make, a merge kernel, an extra copy. The table
is printed last. Needs a CUDA GPU and FlashInfer.

Usage: ``python benchmarks/decode_kernels.py [--model llama-3.1-8b] [--kv-cache-dtype
fp8_e4m3|auto] [--block-size 16]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_matrix

from kvcore.cli import harness
from kvcore.cli.model_bench import _Step
from kvcore.models import FULL_CASES, get_model


def kernels(fn, calls: int = 5) -> list[tuple[str, float, int]]:
    """``(kernel name, mean device µs per call, launches per call)`` of ``calls`` eager calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / calls, e.count // calls)
            for e in prof.key_averages() if e.device_time_total > 0]


def triton_op(inputs, kv_cache_dtype: str):
    """TRITON_ATTN's op called directly on the peers' cache and metadata, its defaults
    planning the call (no builder): tells the kernel apart from what the builder adds."""
    from kvcore.ops import triton_attention

    common, layer = inputs.common, inputs.layer
    key_cache, value_cache = inputs.kv_cache.unbind(1)
    out = torch.empty_like(inputs.query)
    return lambda: triton_attention.paged_attention(
        inputs.query, key_cache, value_cache, query_start_loc=common.query_start_loc,
        seq_lens=common.seq_lens, block_table=common.block_table, scale=layer.softmax_scale,
        kv_cache_dtype=kv_cache_dtype, k_scale=1.0, v_scale=1.0, output=out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    preset = get_model(args.model)
    layer = preset.layers[0]
    print(f"{torch.cuda.get_device_name()}: {preset.name} {layer.kind} layers, "
          f"kv={args.kv_cache_dtype}, block {args.block_size}", flush=True)
    rows = []
    for case in (c for c in FULL_CASES if c.phase == "decode"):
        config = layer.selector_config(preset.dtype, args.kv_cache_dtype, args.block_size)
        step = _Step(preset, layer, case, config, device, 0)
        paths = {name: step.runner(name)[0] for name in ("FLASHINFER", "TRITON_ATTN")}
        inputs = step.inputs()
        paths["TRITON_ATTN op, same inputs"] = triton_op(inputs, args.kv_cache_dtype)
        paths["flashinfer direct"] = bench_matrix.flashinfer_direct(inputs)
        paths["flashinfer direct (graph wrapper)"] = bench_matrix.flashinfer_graph_wrapper(
            inputs)
        for name, fn in paths.items():
            graph_s, _ = harness.time_call(fn, device, graph=True, warmup=2)
            eager_s, _ = harness.time_call(fn, device, graph=False, warmup=2)
            rows.append((case.name, name, graph_s * 1e6, eager_s * 1e6))
            print(f"{case.name} {name}: graph {graph_s * 1e6:.1f} us, eager "
                  f"{eager_s * 1e6:.1f} us", flush=True)
            for kernel, us, count in kernels(fn):
                print(f"    {us:8.1f} us x{count}  {kernel[:100]}")
        del step, paths, inputs
        torch.cuda.empty_cache()
    print(f"\n{'step':16} {'path':36} {'graph us':>9} {'eager us':>9}")
    for case, name, graph_us, eager_us in rows:
        print(f"{case:16} {name:36} {graph_us:9.1f} {eager_us:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
