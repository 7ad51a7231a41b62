#!/usr/bin/env python3
"""Before/after timing of kvcore's public ops: two source trees, one GPU, one run.

A change to an op's Python path or kernel must not make it slower. This script times the
ops an engine calls, at the shapes the README's results table reports, for two source trees:
``--before DIR`` (a tree holding ``kvcore/`` and the plugins' packages, e.g. ``git archive``
of an earlier commit; it is put first on ``PYTHONPATH``) and the installed tree. Each tree
runs in its own process (one process cannot import two kvcores); the two take turns for
``--rounds`` rounds, so a drift of the device touches both alike, and each row keeps the
fastest round of each side.

Cases (bf16, block 16 unless said):

- decode, TRITON_ATTN's op (``kvcore.ops.paged_attention``): Hq 32, Hk 8, D 128 at
  B x L in 64 x 4096, 8 x 32768, 256 x 1024, 16 x 4096;
- prefill, the same op: 4 x 2048 new tokens, 1 x 8192, 4 x 512 new over 16k cached (causal);
- MLA decode, TRITON_MLA's op (``kvcore_mla.ops.triton_mla_attention.mla_attention``):
  128 heads, latent 512 + rope 64, page 64, at 64 x 4096, 8 x 32768, 128 x 2048;
- cache write (``kvcore.ops.reshape_and_cache``): 32768 tokens, Hk 8, D 128;
- host time of one eager call (decode, 1 request of 16 tokens: the GPU work is tiny, so the
  time per call is the Python path's), for attention and for the cache write.

GPU times are CUDA-graph replays of the call (``kvcore.cli.harness.time_call``); host times
are wall time per call over 300 back-to-back calls after a warm-up. The table printed last
gives both sides and after / before; the JSON goes to ``--out``.

Usage: ``python benchmarks/bench_ab.py --before DIR [--rounds 3] [--only TEXT] [--out DIR]``
(``--side`` runs one side and prints its JSON: what the driver calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _decode_case(batch: int, length: int, *, new: int = 1, heads: int = 32, kv_heads: int = 8,
                 dim: int = 128, block: int = 16, cached: int | None = None):
    """Query, caches and metadata of ``batch`` requests of ``new`` new tokens over
    ``length`` tokens in all (``cached`` + ``new``), blocks shuffled."""
    import torch

    import kvcore

    gen = torch.Generator().manual_seed(batch * 100003 + length)
    per_seq = -(-length // block)
    num_blocks = batch * per_seq + 8
    ids = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)
    meta = kvcore.build_attention_metadata(
        [new] * batch, [length - new] * batch, ids.tolist(), block, device="cuda",
        num_blocks=num_blocks)
    kv = torch.randn(num_blocks, 2, block, kv_heads, dim, generator=gen).to(
        torch.bfloat16).cuda()
    query = torch.randn(batch * new, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    return query, kv, meta


def _attention(case):
    import kvcore.ops

    query, kv, meta = case
    k, v = kv.unbind(1)
    out = query.new_empty(query.shape)
    return lambda: kvcore.ops.paged_attention(
        query, k, v, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
        block_table=meta.block_table, scale=query.shape[-1] ** -0.5, output=out)


def _mla(batch: int, length: int):
    import torch
    from kvcore_mla.ops.triton_mla_attention import mla_attention

    gen = torch.Generator().manual_seed(batch + length)
    page, rank, rope = 64, 512, 64
    per_seq = -(-length // page)
    pages = batch * per_seq + 4
    table = torch.randperm(pages, generator=gen)[:batch * per_seq].view(batch, per_seq)
    cache = torch.randn(pages, page, rank + rope, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(batch, 128, rank + rope, generator=gen).to(torch.bfloat16).cuda()
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    table = table.to(torch.int32).cuda()
    out = torch.empty(batch, 128, rank, dtype=torch.bfloat16, device="cuda")
    return lambda: mla_attention(q, cache, kv_lora_rank=rank, query_start_loc=qsl,
                                 seq_lens=lens, block_table=table, scale=(128 + rope) ** -0.5,
                                 output=out, max_query_len=1, max_seq_len=length)


def _cache_write(tokens: int):
    import torch

    import kvcore.ops

    gen = torch.Generator().manual_seed(tokens)
    block, kv_heads, dim = 16, 8, 128
    num_blocks = tokens // block + 8
    kv = torch.randn(num_blocks, 2, block, kv_heads, dim, generator=gen).to(
        torch.bfloat16).cuda()
    key = torch.randn(tokens, kv_heads, dim, generator=gen).to(torch.bfloat16).cuda()
    value = torch.randn(tokens, kv_heads, dim, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randperm(num_blocks * block, generator=gen)[:tokens].cuda()
    k, v = kv.unbind(1)
    return lambda: kvcore.ops.reshape_and_cache(key, value, k, v, slots)


def _host_seconds(fn, calls: int = 300) -> float:
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def run_side(only: list[str]) -> dict[str, float]:
    """Every case (those whose name contains one of ``only``, when given) once in this
    process; seconds by case name."""
    from kvcore.cli.harness import time_call

    cases = {
        **{f"decode {b}x{n}": lambda b=b, n=n: _attention(_decode_case(b, n))
           for b, n in ((64, 4096), (8, 32768), (256, 1024), (16, 4096))},
        "prefill 4x2048": lambda: _attention(_decode_case(4, 2048, new=2048)),
        "prefill 1x8192": lambda: _attention(_decode_case(1, 8192, new=8192)),
        "prefill 4x512 over 16k": lambda: _attention(_decode_case(4, 16384 + 512, new=512)),
        **{f"MLA decode 128 heads {b}x{n}": lambda b=b, n=n: _mla(b, n)
           for b, n in ((64, 4096), (8, 32768), (128, 2048))},
        "cache write 32768": lambda: _cache_write(32768),
    }
    cases["host: attention call"] = lambda: _attention(_decode_case(1, 16))
    cases["host: cache write call"] = lambda: _cache_write(16)
    found = {}
    for name, make in cases.items():
        if only and not any(text in name for text in only):
            continue
        fn = make()
        found[name] = _host_seconds(fn) if name.startswith("host:") else time_call(fn, "cuda")[0]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="source tree timed as 'before'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="time only the cases whose name contains TEXT (repeatable)")
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print("AB-JSON " + json.dumps(run_side(args.only)), flush=True)
        return
    if args.before is None or not (args.before / "kvcore").is_dir():
        parser.error(f"--before {args.before}: give a folder holding kvcore/ (and the plugins' "
                     "packages) of the tree to compare against")
    import torch

    from kvcore.cli.harness import format_table

    sides = {"before": str(args.before.resolve()), "after": None}
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, path in sides.items():
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
            only = [arg for text in args.only for arg in ("--only", text)]
            proc = subprocess.run([sys.executable, __file__, "--side", *only], env=env,
                                  capture_output=True, text=True, timeout=600)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("AB-JSON ")), None)
            if proc.returncode or line is None:
                sys.exit(f"{side} side, round {r + 1} failed:\n{proc.stderr[-3000:]}")
            rounds[side].append(json.loads(line[len("AB-JSON "):]))
            print(f"round {r + 1} {side} done", flush=True)
    best = {side: {k: min(rd[k] for rd in rs) for k in rs[0]} for side, rs in rounds.items()}
    rows = [[name, f"{best['before'][name] * 1e6:.1f}", f"{best['after'][name] * 1e6:.1f}",
             f"{best['after'][name] / best['before'][name]:.3f}"] for name in best["before"]]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    record = {"date": stamp, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "before": sides["before"], "rounds": rounds, "best": best}
    (args.out / f"bench_ab_{stamp}.json").write_text(json.dumps(record, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, {stamp}; fastest of {args.rounds} rounds each, "
          "the two trees taking turns")
    print(format_table(rows, ["case", "before us", "after us", "after / before"]))


if __name__ == "__main__":
    main()
