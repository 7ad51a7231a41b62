"""TRITON_ATTN's prefill kernel on fp8 caches with ``fp8_fp16``: bf16 queries meet the fp8 K/V
in fp16 products (:func:`kvcore.ops.triton_decode.fp16_query` rescales the query rows, which
reach the products through the program's output rows), V is converted where it is loaded.

Runs on the CPU under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``) on small shapes,
and on a GPU when there is one; the compile test checks the sm_90a code without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib

import pytest
import torch
from fp8_batches import fp8_paged_batch

from kvcore.ops import TritonAttentionPlan, TritonPrefillConfig, paged_attention_ref
from kvcore.ops import attention_config as tables

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
dispatch = pytest.importorskip("kvcore.ops.attention_dispatch")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 8, 2, 64
# (query tokens, cached tokens) per request: a decode, a fresh prefill of one tile and one
# token, chunks whose first query sits on and beside a 16-key tile edge.
REQUESTS = [(1, 70), (17, 0), (9, 62), (20, 64)]
#: Small tiles of the prefill kernel (16 rows: 4 tokens x 4 query heads, 16 keys a step),
#: masked edge loops pipelined on their own, block size compiled in.
CONFIG = TritonPrefillConfig(block_q=4, g_pad=4, block_n=16, num_warps=4, num_stages=2,
                             const_block=True, edge_stages=1, fp8_fp16=True)


def _prefill_batch(name: str, cache_dtype: torch.dtype, q_magnitude: float,
                   kv_magnitude: float, query_dtype: torch.dtype = torch.bfloat16) -> dict:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q_lens = [q for q, _ in REQUESTS]
    batch = fp8_paged_batch(gen, cache_dtype, [q + c for q, c in REQUESTS], sum(q_lens),
                            block_size=BLOCK_SIZE, num_heads=NUM_HEADS,
                            num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                            q_magnitude=q_magnitude, kv_magnitude=kv_magnitude,
                            query_dtype=query_dtype, device=DEVICE)
    batch["query_start_loc"] = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                            dtype=torch.int32, device=DEVICE)
    return batch


def _features(name: str) -> dict:
    if name == "sinks":
        gen = torch.Generator().manual_seed(7)
        return dict(sinks=torch.randn(NUM_HEADS, generator=gen).to(DEVICE))
    return {"plain": {}, "window": dict(sliding_window=20), "softcap": dict(logits_soft_cap=8.0),
            "noncausal-window": dict(causal=False, sliding_window=12)}[name]


def _check(call: dict, config: TritonPrefillConfig = CONFIG, **kw) -> torch.Tensor:
    out = triton_attention.paged_attention(**call, **kw,
                                           plan=TritonAttentionPlan(config=config))
    ref = paged_attention_ref(**call, **{k: v for k, v in kw.items() if k != "output"})
    assert out.isfinite().all()
    torch.testing.assert_close(out.to(ref.dtype), ref, atol=3e-2, rtol=3e-2)
    return out


CASES = [
    # (cache dtype, magnitudes, features)
    ("e4m3", "unit", "plain"),
    ("e4m3", "query_beyond_fp16", "plain"),
    ("e4m3", "query_beyond_fp16", "sinks"),
    ("e4m3", "unit", "window"),
    ("e4m3", "query_beyond_fp16", "softcap"),
    ("e4m3", "unit", "noncausal-window"),
    ("e5m2", "unit", "sinks"),
    ("e5m2", "query_beyond_fp16", "window"),
]
MAGNITUDES = {"unit": (1.0, 1.0), "query_beyond_fp16": (2.0 ** 17, 2.0 ** -14)}
CACHE_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize(("cache", "magnitudes", "features"), CASES,
                         ids=["-".join(c) for c in CASES])
def test_prefill_on_fp8_cache_with_fp16_products_matches_the_reference(cache, magnitudes,
                                                                        features) -> None:
    """Ragged prefill/decode batches on e4m3 and e5m2 caches with tensor scales, with sinks,
    windows (causal and not) and a soft-cap: the reference's output within bf16 tolerance.
    ``query_beyond_fp16`` holds queries ~2**17 (fp16 overflows at 65504) against keys
    ~2**-14, logits of order one: the per-row rescaling keeps them exact."""
    call = _prefill_batch(f"fp8prefill{cache}{magnitudes}{features}", CACHE_DTYPES[cache],
                          *MAGNITUDES[magnitudes])
    _check(call, **_features(features))


def test_fp16_products_and_the_query_dtype_path_agree() -> None:
    """The switch changes how the products run, not what they compute: on and off both meet
    the reference and each other within a bf16 step (the unmasked middle loop runs too: the
    long chunk's tiles are all visible to all its queries)."""
    call = _prefill_batch("fp8prefill-onoff", torch.float8_e4m3fn, 1.0, 1.0)
    on = _check(call)
    off = _check(call, dataclasses.replace(CONFIG, fp8_fp16=False))
    torch.testing.assert_close(on, off, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", ["fp32", "strided-bf16"])
def test_the_query_staged_in_the_output_rows_leaves_a_correct_output(layout) -> None:
    """The fp16 query goes through the output's rows before the output is written: a float32
    output (each fp16 value in an element's first half) and a strided bf16 view of a larger
    buffer (whose other elements stay untouched) both come out right."""
    call = _prefill_batch(f"fp8prefill-out-{layout}", torch.float8_e4m3fn, 2.0 ** 17,
                          2.0 ** -14)
    shape = call["query"].shape
    if layout == "fp32":
        output = torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE)
        _check(call, output=output)
        return
    big = torch.full((shape[0], shape[1], 2 * shape[2]), 7.0, dtype=torch.bfloat16,
                     device=DEVICE)
    output = big[:, :, ::2]
    out = _check(call, output=output)
    assert out.data_ptr() == big.data_ptr()
    assert (big[:, :, 1::2] == 7.0).all()


def test_fp16_queries_take_fp8_tiles_without_rescaling() -> None:
    """fp16 queries on an fp8 cache: the products were fp16 already; with the switch V is
    converted where it is loaded (the query is not rescaled or staged)."""
    call = _prefill_batch("fp8prefill-fp16q", torch.float8_e4m3fn, 1.0, 1.0,
                          query_dtype=torch.float16)
    _check(call, sinks=_features("sinks")["sinks"])


def test_prefill_rows_turn_fp16_products_on_where_measured_and_configs_carry_the_switch(
        monkeypatch) -> None:
    """On in sm90's head <= 128 row (timed on an H100), off in the others; the
    prefill configs carry their row's switch, at both head-size rows."""
    on = {arch: tuple(t.fp8_fp16 for t in row) for arch, row in tables.PREFILL_TILES.items()}
    assert on == {"sm90": (True, False), "sm100": (False, False), "cuda": (False, False),
                  "rocm": (False, False)}
    cpu = torch.device("cpu")
    for head_size, expected in ((64, True), (128, True), (256, False)):
        cfg = dispatch.default_config(8192, 4, 32, 8, head_size, 2048, cpu, arch="sm90",
                                      rocm=False, num_sms=132, gluon=False)
        assert cfg.kernel == "triton_prefill" and cfg.fp8_fp16 is expected, head_size
    cfg = dispatch.default_config(8192, 4, 64, 8, 64, 2048, cpu, arch="cuda", rocm=False,
                                  num_sms=132, gluon=False)
    assert cfg.kernel == "triton_prefill" and not cfg.fp8_fp16
    small, big = tables.PREFILL_TILES["cuda"]
    monkeypatch.setitem(tables.PREFILL_TILES, "cuda",
                        (dataclasses.replace(small, fp8_fp16=True),
                         dataclasses.replace(big, fp8_fp16=True)))
    for head_size in (64, 128, 256):
        cfg = dispatch.default_config(8192, 4, 32, 8, head_size, 2048, cpu, arch="cuda",
                                      rocm=False, num_sms=132, gluon=False)
        assert cfg.kernel == "triton_prefill" and cfg.fp8_fp16


_COMPILE = """
import json, re, sys, torch
from kvcore.testing import compile_launches
from kvcore.ops import TritonAttentionPlan, TritonPrefillConfig, triton_attention
from kvcore.ops.attention_config import PREFILL_TILES
head_size, num_heads, fp8_fp16 = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
tile, seqs, length = PREFILL_TILES["sm90"][0], 4, 2048
g_pad = num_heads // 8
config = TritonPrefillConfig(block_q=tile.rows // g_pad, g_pad=g_pad, block_n=tile.block_n,
                             num_warps=tile.num_warps, num_stages=tile.num_stages,
                             const_block=tile.const_block, edge_stages=tile.edge_stages,
                             fp8_fp16=fp8_fp16)
blocks = seqs * length // 16
key = torch.empty(blocks, 16, 8, head_size, dtype=torch.float8_e4m3fn)
(c,) = compile_launches(lambda: triton_attention.paged_attention(
    torch.empty(seqs * length, num_heads, head_size, dtype=torch.bfloat16), key,
    torch.empty_like(key), query_start_loc=torch.arange(seqs + 1, dtype=torch.int32) * length,
    seq_lens=torch.full((seqs,), length, dtype=torch.int32),
    block_table=torch.arange(blocks, dtype=torch.int32).reshape(seqs, -1),
    scale=head_size ** -0.5, kv_cache_dtype="fp8", k_scale=torch.ones(1),
    v_scale=torch.ones(1), sinks=torch.zeros(num_heads), plan=TritonAttentionPlan(config=config)),
    "sm90")
ptx = c.asm["ptx"]
scores = re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n%dk16\\.f32\\.(\\w+)\\.\\w+ "
                    r"\\{[^}]*\\}, (\\S)" % tile.block_n, ptx)
print(json.dumps(dict(
    score_products=sorted({dtype for dtype, _ in scores}),
    query_from_registers=sum(a == "{" for _, a in scores),
    score_count=len(scores),
    byte_loads=len(re.findall(r"ld\\.shared\\.(?:u8|b8|s8)", ptx)),
    bf16_conversions=len(re.findall(r"cvt(?:\\.rn)?\\.bf16(?:x2)?\\.(?:f16|e4m3x2)\\b", ptx)))))
"""


@pytest.mark.compile
@pytest.mark.parametrize(("head_size", "num_heads"), [(64, 64), (128, 32)],
                         ids=["gpt-oss-D64", "llama-D128"])
def test_sm90_compile_runs_fp8_prefill_in_fp16_products_from_shared_memory(head_size,
                                                                            num_heads) -> None:
    """Compiled ahead of time for sm_90a (no GPU; in a subprocess, the suite sets
    ``TRITON_INTERPRET``) with the sm90 row's tile at gpt-oss's (64 query heads, 8 KV heads,
    D 64, sinks) and Llama-3.1-8B's (32/8, D 128) prefill shapes: with ``fp8_fp16`` the score
    products are fp16 ``wgmma`` reading the query from shared memory (a descriptor, not
    registers reloaded every step), nothing converts fp16 to bf16 and no shared-memory load
    reads single bytes; without it the scores are bf16 products of converted tiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    facts = {}
    for switch in ("1", "0"):
        proc = subprocess.run([sys.executable, "-c", _COMPILE, str(head_size), str(num_heads),
                               switch], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        facts[switch] = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = facts["1"], facts["0"]
    assert on["score_products"] == ["f16"] and on["score_count"] > 0, on
    assert on["query_from_registers"] == 0, on
    assert on["bf16_conversions"] == 0 and on["byte_loads"] == 0, on
    assert off["score_products"] == ["bf16"] and off["bf16_conversions"] > 0, off
