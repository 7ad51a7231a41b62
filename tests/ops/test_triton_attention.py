"""Triton paged attention against the references (fp32 and float64), on every cache layout.

Runs on the CPU under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``) on small shapes,
and on a GPU when there is one; ``gpu``-marked tests need real sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import pytest
import torch

import kvcore.ops
from kvcore.ops import TritonAttentionPlan as Plan
from kvcore.ops import (
    TritonDecodeConfig,
    TritonPrefillConfig,
    TritonSplitKVConfig,
    paged_attention_ref,
    reshape_and_cache_ref,
)
from kvcore.ops import attention_config as tables
from kvcore.ops.attention_config import DecodeTile, TritonPrefillTile
from kvcore.testing import random_block_tables

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
dispatch = pytest.importorskip("kvcore.ops.attention_dispatch")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ||out - ref|| / ||ref|| against the float64 reference, and elementwise against the fp32 one.
REL_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclasses.dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scale: float

    def kwargs(self) -> dict:
        return dict(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                    block_table=self.block_table, scale=self.scale)


def _seed(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def make_batch(gen: torch.Generator, *, q_lens: list[int], seq_lens: list[int], num_heads: int,
               num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
               cache_dtype: torch.dtype | None = None, spare_blocks: int = 5) -> Batch:
    """A random batch: shuffled, distinct block ids per request; unused block-table columns
    hold -1 (never read); the cache is random everywhere (never zeros)."""
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq) + 2
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for i, ids in enumerate(random_block_tables(seq_lens, block_size, num_blocks, gen)):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    return Batch(query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), qsl.to(DEVICE),
                 torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE), table.to(DEVICE),
                 head_size ** -0.5)


def mixed_batch(gen: torch.Generator, num_seqs: int, **kw) -> Batch:
    """Decode requests with long contexts, prefills with a cached prefix and fresh prefills."""
    q_lens, seq_lens = [], []
    for i in range(num_seqs):
        kind = i % 3
        if kind == 0:  # decode
            q, ctx = 1, int(torch.randint(20, 90, (1,), generator=gen))
        elif kind == 1:  # chunked prefill over a cached prefix
            q, ctx = int(torch.randint(3, 24, (1,), generator=gen)), \
                int(torch.randint(1, 40, (1,), generator=gen))
        else:  # fresh prefill
            q, ctx = int(torch.randint(5, 30, (1,), generator=gen)), 0
        q_lens.append(q)
        seq_lens.append(q + ctx)
    return make_batch(gen, q_lens=q_lens, seq_lens=seq_lens, **kw)


def check_against_references(out: torch.Tensor, batch: Batch, **kw) -> None:
    ref = paged_attention_ref(batch.query, batch.key_cache, batch.value_cache,
                              **batch.kwargs(), **kw)
    torch.testing.assert_close(out, ref, atol=ATOL[out.dtype], rtol=ATOL[out.dtype])
    if batch.key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return  # the fp32 reference already dequantises exactly like the kernel
    ref64 = paged_attention_ref(batch.query.double(), batch.key_cache.double(),
                                batch.value_cache.double(), **batch.kwargs(), **kw)
    rel = ((out.double() - ref64).norm() / ref64.norm()).item()
    assert rel < REL_TOL[out.dtype], rel


CASES = {
    "B3-bs16-gqa1-D64-bf16": dict(num_seqs=3, block_size=16, num_heads=2, num_kv_heads=2,
                                  head_size=64, dtype=torch.bfloat16),
    "B4-bs16-gqa4-D64-fp16": dict(num_seqs=4, block_size=16, num_heads=8, num_kv_heads=2,
                                  head_size=64, dtype=torch.float16),
    "B3-bs32-gqa8-D64-bf16": dict(num_seqs=3, block_size=32, num_heads=16, num_kv_heads=2,
                                  head_size=64, dtype=torch.bfloat16),
    "B3-bs32-gqa4-D80-fp32": dict(num_seqs=3, block_size=32, num_heads=4, num_kv_heads=1,
                                  head_size=80, dtype=torch.float32),
    "B3-bs16-mqa6-D96-bf16": dict(num_seqs=3, block_size=16, num_heads=6, num_kv_heads=1,
                                  head_size=96, dtype=torch.bfloat16),
    "B2-bs64-gqa2-D128-fp16": dict(num_seqs=2, block_size=64, num_heads=4, num_kv_heads=2,
                                   head_size=128, dtype=torch.float16),
    "B3-bs16-gqa2-D256-bf16": dict(num_seqs=3, block_size=16, num_heads=2, num_kv_heads=1,
                                   head_size=256, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_batch_matches_references(name: str) -> None:
    batch = mixed_batch(_seed(name), **CASES[name])
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs())
    check_against_references(out, batch)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(window: int) -> None:
    batch = mixed_batch(_seed(f"window{window}"), 3, block_size=16, num_heads=4,
                        num_kv_heads=2, head_size=64, dtype=torch.float32)
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs(), sliding_window=window)
    check_against_references(out, batch, sliding_window=window)


@pytest.mark.parametrize("window", [46, 64, 130])
def test_sliding_window_skips_whole_tiles_exactly(window: int) -> None:
    """Long decodes whose window starts just before / at / after a key-tile boundary."""
    batch = make_batch(_seed(f"longwindow{window}"), q_lens=[1, 1, 1, 1, 30],
                       seq_lens=[300, 290, 281, 270, 200], block_size=16, num_heads=4,
                       num_kv_heads=2, head_size=64, dtype=torch.float32)
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs(), sliding_window=window)
    check_against_references(out, batch, sliding_window=window)


@pytest.mark.parametrize("window", [None, 9], ids=["full", "window9"])
def test_non_causal(window: int | None) -> None:
    batch = mixed_batch(_seed(f"noncausal{window}"), 3, block_size=16, num_heads=4,
                        num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs(), causal=False, sliding_window=window)
    check_against_references(out, batch, causal=False, sliding_window=window)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_fp8_cache(kv_cache_dtype: str, scale_kind: str) -> None:
    cache_dtype = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    gen = _seed(f"fp8{kv_cache_dtype}{scale_kind}")
    batch = mixed_batch(gen, 3, block_size=16, num_heads=8, num_kv_heads=2, head_size=64,
                        dtype=torch.bfloat16, cache_dtype=cache_dtype)
    ks, vs = 0.05, 0.08
    if scale_kind == "tensor":
        ks, vs = torch.tensor([ks], device=DEVICE), torch.tensor([vs], device=DEVICE)
    # Quantise real K/V through the reference write so the stored values mean something.
    num_slots = batch.key_cache.shape[0] * batch.key_cache.shape[1]
    kv = torch.randn(2, num_slots, *batch.key_cache.shape[2:], generator=gen)
    kv = kv.to(torch.bfloat16).to(DEVICE)
    reshape_and_cache_ref(kv[0], kv[1], batch.key_cache, batch.value_cache,
                          torch.arange(num_slots, device=DEVICE), kv_cache_dtype, ks, vs)
    out = triton_attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(),
        kv_cache_dtype=kv_cache_dtype, k_scale=ks, v_scale=vs)
    check_against_references(out, batch, kv_cache_dtype=kv_cache_dtype, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_split_kv_equals_unsplit(splits: int, kind: str) -> None:
    gen = _seed(f"split{splits}{kind}")
    shape = dict(block_size=16, num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32)
    if kind == "decode":
        batch = make_batch(gen, q_lens=[1, 1, 1], seq_lens=[150, 7, 64], **shape)
    else:
        batch = mixed_batch(gen, 3, **shape)
    whole = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), plan=Plan(num_kv_splits=1))
    split = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), plan=Plan(num_kv_splits=splits),
                                             sliding_window=None)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    check_against_references(split, batch)


def test_split_kv_with_window_and_bf16() -> None:
    batch = make_batch(_seed("splitwin"), q_lens=[1, 1], seq_lens=[200, 33], block_size=32,
                       num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs(), plan=Plan(num_kv_splits=3),
                                           sliding_window=70)
    check_against_references(out, batch, sliding_window=70)


def test_split_heuristic() -> None:
    cfg = dispatch.default_config
    cpu = torch.device("cpu")  # one "SM": target = split_waves programs
    assert cfg(1, 1, 8, 2, 128, 32768, cpu) == TritonSplitKVConfig(
        block_q=4, g_pad=4, block_n=32, num_splits=2, num_warps=4, num_stages=3)  # 2 < 4
    assert cfg(1, 1, 8, 2, 128, 600, cpu).kernel == "triton_decode"  # too short to split
    assert cfg(9, 1, 8, 2, 128, 32768, cpu).kernel == "triton_prefill"  # never split
    assert cfg(8, 8, 8, 2, 128, 32768, cpu).kernel == "triton_decode"  # enough programs
    assert cfg(1, 1, 8, 2, 128, 32768, cpu, num_kv_splits=7).num_splits == 7


def test_prefill_batches_route_to_the_prefill_kernel_with_the_gpus_tile() -> None:
    cfg, cpu = dispatch.default_config, torch.device("cpu")
    decode = cfg(8, 8, 32, 8, 128, 4096, cpu, arch="sm90")
    assert decode.kernel == "triton_decode" and (decode.block_q, decode.block_n) == (4, 32)
    tile = tables.PREFILL_TILES["sm90"][0]
    prefill = cfg(4096, 2, 32, 8, 128, 4096, cpu, arch="sm90", gluon=False)
    assert prefill == TritonPrefillConfig(
        block_q=tile.rows // 4, g_pad=4, block_n=tile.block_n, num_warps=tile.num_warps,
        num_stages=tile.num_stages, const_block=tile.const_block, edge_stages=tile.edge_stages,
        fp8_fp16=tile.fp8_fp16)
    # Without gluon=False, sm90 takes its Gluon row (paged_attention falls back to the Triton
    # row for calls the Gluon kernel cannot run).
    row = tables.GLUON_PREFILL_TILES["sm90"]
    gluon = cfg(4096, 2, 32, 8, 128, 4096, cpu, arch="sm90")
    assert gluon == kvcore.ops.GluonPrefillConfig(block_q=32, g_pad=4, block_n=row.block_n,
                                                  num_stages=row.num_stages)
    assert gluon.kernel == row.kernel == "gluon_ws_pingpong"
    big = tables.PREFILL_TILES["sm90"][1]
    assert cfg(4096, 2, 16, 8, 256, 4096, cpu, arch="sm90").block_n == big.block_n
    # An architecture without a row gets its platform's default; forced splits run the
    # split-KV kernel.
    assert cfg(99, 2, 32, 8, 128, 4096, cpu, arch="sm75").block_n == \
        tables.PREFILL_TILES["cuda"][0].block_n
    assert cfg(99, 2, 32, 8, 128, 4096, cpu, arch="gfx1100", rocm=True).num_stages == \
        tables.PREFILL_TILES["rocm"][0].num_stages
    assert cfg(99, 2, 32, 8, 128, 4096, cpu, num_kv_splits=2).kernel == "triton_split_kv"


def _prefill_config(rows: int, block_n: int, num_heads: int, num_kv_heads: int):
    g_pad = 1 << (num_heads // num_kv_heads - 1).bit_length()
    return TritonPrefillConfig(block_q=rows // g_pad, g_pad=g_pad, block_n=block_n,
                               num_warps=4, num_stages=2)


# (query tokens, cached tokens) per request: a decode, fresh prefills of one tile and of one
# tile and one token, chunks whose first query sits two before / one before / on a key-tile
# boundary (62, 63, 64 for 16-, 32- and 64-key tiles alike), a long chunk.
RAGGED = [(1, 70), (16, 0), (17, 0), (9, 62), (20, 63), (13, 64), (40, 5)]
PREFILL_CASES = {
    "gqa1-bs16-m16n16-fp32": (2, 2, 16, 16, 16, torch.float32),
    "gqa1-bs64-m32n64-bf16": (2, 2, 64, 32, 64, torch.bfloat16),
    "gqa4-bs32-m64n32-fp32": (8, 2, 32, 64, 32, torch.float32),
    "gqa4-bs16-m128n64-fp16": (4, 1, 16, 128, 64, torch.float16),
    "gqa8-bs64-m16n64-fp32": (8, 1, 64, 16, 64, torch.float32),
    "gqa8-bs32-m64n16-bf16": (16, 2, 32, 64, 16, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_kernel_tiles_match_references(name: str) -> None:
    """The prefill kernel at several tile shapes, GQA ratios and block sizes, on ragged
    requests whose causal diagonals fall on and beside key-tile edges."""
    num_heads, num_kv_heads, block_size, rows, block_n, dtype = PREFILL_CASES[name]
    batch = make_batch(_seed(name), q_lens=[q for q, _ in RAGGED],
                       seq_lens=[q + c for q, c in RAGGED], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_size=32, block_size=block_size,
                       dtype=dtype)
    out = triton_attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(),
        plan=Plan(config=_prefill_config(rows, block_n, num_heads, num_kv_heads)))
    check_against_references(out, batch)


@pytest.mark.parametrize(("causal", "window"), [(True, 20), (True, 33), (False, None),
                                                 (False, 12)],
                         ids=["causal-window20", "causal-window33", "noncausal",
                              "noncausal-window12"])
def test_prefill_kernel_window_edges_and_non_causal_tails(causal: bool, window: int | None
                                                          ) -> None:
    """Windows narrower and wider than a 16-key tile (masked lower edge, unmasked middle,
    masked diagonal) and non-causal requests whose last key tile is partial."""
    batch = make_batch(_seed(f"prefill-edges{causal}{window}"), q_lens=[24, 5, 33],
                       seq_lens=[90, 41, 33], num_heads=4, num_kv_heads=1, head_size=40,
                       block_size=16, dtype=torch.float32)
    out = triton_attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(), causal=causal,
        sliding_window=window, plan=Plan(config=_prefill_config(16, 16, 4, 1)))
    check_against_references(out, batch, causal=causal, sliding_window=window)


#: Compile parameters of TritonPrefillConfig: each changes speed only, never a bit of the
#: output.
VARIANTS = {
    "const-block": dict(const_block=True),
    "edge-stages1": dict(edge_stages=1),
    "edge-stages3": dict(edge_stages=3),
    "all": dict(const_block=True, edge_stages=1),
}
# (kernel kwargs, heads, kv heads, block size, rows, block_n, cache dtype): causal GQA over
# ragged requests with key tiles wider / narrower than a block, a window, non-causal, fp8.
VARIANT_CASES = {
    "causal-gqa4-bs16-n32-bf16": (dict(), 8, 2, 16, 64, 32, None),
    "causal-gqa2-bs32-n16-fp16": (dict(), 4, 2, 32, 32, 16, None),
    "window20-gqa4-bs16-n16-fp32": (dict(sliding_window=20), 4, 1, 16, 16, 16, None),
    "noncausal-gqa1-bs64-n32-bf16": (dict(causal=False), 2, 2, 64, 32, 32, None),
    "fp8-gqa4-bs16-n32-bf16": (dict(kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.08), 4, 1,
                               16, 32, 32, torch.float8_e4m3fn),
}


@functools.cache
def _variant_batch(case: str) -> tuple[Batch, dict, TritonPrefillConfig, torch.Tensor]:
    """The case's batch, kernel kwargs and plain config, and the plain kernel's output (run
    once per case, not once per variant)."""
    kwargs, num_heads, num_kv_heads, block_size, rows, block_n, cache_dtype = \
        VARIANT_CASES[case]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        case.rsplit("-", 1)[1]]
    batch = make_batch(_seed(f"variant-{case}"), q_lens=[q for q, _ in RAGGED],
                       seq_lens=[q + c for q, c in RAGGED], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_size=32, block_size=block_size,
                       dtype=dtype, cache_dtype=cache_dtype)
    base = _prefill_config(rows, block_n, num_heads, num_kv_heads)
    plain = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), **kwargs, plan=Plan(config=base))
    return batch, kwargs, base, plain


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_prefill_kernel_variants_equal_the_plain_kernel(case: str, variant: str) -> None:
    """Each variant against the references, and bit for bit against the plain kernel under
    the interpreter (on a GPU another schedule may round differently: tolerances only)."""
    batch, kwargs, base, plain = _variant_batch(case)
    out = triton_attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(), **kwargs,
        plan=Plan(config=dataclasses.replace(base, **VARIANTS[variant])))
    check_against_references(out, batch, **kwargs)
    if DEVICE == "cpu":
        assert torch.equal(out, plain)


@pytest.mark.parametrize(("splits", "block_n"), [(1, 32), (3, 32), (3, 64)],
                         ids=["unsplit", "split", "split-64-keys"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_kernel_with_the_block_size_compiled_in(splits: int, block_n: int,
                                                       block_size: int) -> None:
    """``const_block`` on the decode kernel (split and unsplit, 32 or 64 keys a step as the
    sm90 row launches splits, mixed batch, window) equals the plain kernel and the
    references."""
    batch = mixed_batch(_seed(f"const-block{splits}{block_n}{block_size}"), 4,
                        block_size=block_size, num_heads=8, num_kv_heads=2, head_size=32,
                        dtype=torch.bfloat16)
    cfg = (TritonSplitKVConfig(block_q=4, g_pad=4, block_n=block_n, num_splits=splits,
                               num_warps=4, num_stages=2) if splits > 1 else
           TritonDecodeConfig(block_q=4, g_pad=4, block_n=block_n, num_warps=4, num_stages=2))
    outs = [triton_attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(), sliding_window=50,
        plan=Plan(config=dataclasses.replace(cfg, const_block=const))) for const in (False, True)]
    check_against_references(outs[1], batch, sliding_window=50)
    if DEVICE == "cpu":
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("config", "match"), [
    (TritonPrefillConfig(block_q=16, g_pad=2, block_n=16, num_warps=4, num_stages=2,
                         edge_stages=-1), "edge_stages=-1; it must be >= 0"),
    (TritonSplitKVConfig(block_q=16, g_pad=2, block_n=16, num_splits=65, num_warps=4,
                         num_stages=2), "num_splits=65 must be an int in 1..64"),
], ids=["negative-edge-stages", "too-many-splits"])
def test_configs_the_kernels_cannot_run_are_refused(config, match: str) -> None:
    batch = make_batch(_seed("variant-refused"), q_lens=[4], seq_lens=[9], num_heads=2,
                       num_kv_heads=1, head_size=32, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                         **batch.kwargs(), plan=Plan(config=config))


def test_a_plan_of_another_type_is_refused() -> None:
    batch = make_batch(_seed("plan-refused"), q_lens=[1], seq_lens=[9], num_heads=2,
                       num_kv_heads=1, head_size=32, block_size=16, dtype=torch.float32)
    with pytest.raises(TypeError, match="plan must be a kvcore.ops.TritonAttentionPlan"):
        triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                         **batch.kwargs(), plan={"num_kv_splits": 2})
    with pytest.raises(ValueError, match=r"plan.num_kv_splits=0 must be an int in 1..64"):
        triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                         **batch.kwargs(), plan=Plan(num_kv_splits=0))


def test_default_configs_come_from_the_tables(monkeypatch) -> None:
    """Editing one row of PREFILL_TILES / DECODE_TILES changes the launches and the split
    heuristic for that GPU, and only for it."""
    cfg, cpu = dispatch.default_config, torch.device("cpu")
    prefill = TritonPrefillTile(64, 64, 8, 2, const_block=True, edge_stages=1)
    decode = DecodeTile(block_n=64, num_warps=8, num_stages=2, const_block=True, split_waves=1,
                        min_split_tokens=2048)
    monkeypatch.setitem(tables.PREFILL_TILES, "sm90", (prefill, tables.PREFILL_TILES["sm90"][1]))
    monkeypatch.setitem(tables.DECODE_TILES, "sm90", decode)
    p = cfg(4096, 2, 32, 8, 128, 4096, cpu, arch="sm90", num_sms=132, gluon=False)
    assert (p.block_q * p.g_pad, p.block_n, p.num_warps, p.num_stages, p.const_block,
            p.edge_stages) == (64, 64, 8, 2, True, 1)
    d = cfg(16, 16, 32, 8, 128, 4096, cpu, arch="sm90", num_sms=132)
    # 128 programs, 1 wave of 132 SMs: split by the table's 1 wave (1 split), not 4 (4).
    assert d == TritonDecodeConfig(block_q=4, g_pad=4, block_n=64, num_warps=8, num_stages=2,
                                   const_block=True)
    assert cfg(16, 16, 32, 8, 128, 4096, cpu, arch="sm80", num_sms=132).num_splits == 4
    # 8 programs: 16 fit a wave, but 4096 tokens allow 2 splits of 2048.
    assert kvcore.ops.default_num_kv_splits(1, 1, 8, 4096, cpu, num_sms=16, arch="sm90") == 2
    other = cfg(16, 16, 32, 8, 128, 4096, cpu, arch="sm80", num_sms=132)
    assert (other.block_n, other.const_block) == (32, False)


@pytest.mark.parametrize(("batch", "length", "splits", "block_n"), [
    (64, 4096, 1, 32), (256, 1024, 1, 32), (8, 32768, 4, 64), (16, 4096, 2, 64),
    (32, 4096, 1, 32), (4, 8192, 8, 64)], ids=lambda v: str(v))
def test_sm90_decode_rule_at_the_benchmark_shapes(batch, length, splits, block_n) -> None:
    """The H200's row (132 SMs, Hk 8): unsplit launches keep 32 keys a step; split launches
    take 64 keys at 2 waves (kvcore.ops.attention_config, tuned rows), while other NVIDIA GPUs keep
    32 keys at 4 waves."""
    cfg, cpu = dispatch.default_config, torch.device("cpu")
    d = cfg(batch, batch, 32, 8, 128, length, cpu, arch="sm90", num_sms=132)
    assert (getattr(d, "num_splits", 1), d.block_n) == (splits, block_n)
    other = cfg(batch, batch, 32, 8, 128, length, cpu, arch="sm80", num_sms=132)
    assert other.block_n == 32 and getattr(other, "num_splits", 1) >= splits


@pytest.mark.parametrize(("batch", "length", "bf16", "fp8"), [
    (8, 32768, 4, 6), (64, 4096, 1, 1), (16, 4096, 2, 3), (1, 32768, 33, 49)],
    ids=lambda v: str(v))
def test_sm90_fp8_caches_split_more(batch, length, bf16, fp8) -> None:
    """An fp8 split program reads half the bytes of a bf16 one: on the sm90 row (132 SMs,
    Hk 8) a launch the rule splits aims at 3 programs per SM on an fp8 cache instead of 2
    (8 x 32768: 6 splits of 64 keys a step, one round of the 396 programs that fit at once,
    as benchmarks/bench_fp8_decode.py measured), one it does not split (64 x 4096) stays
    unsplit; the other rows ignore the cache dtype."""
    splits, cpu = kvcore.ops.default_num_kv_splits, torch.device("cpu")
    args = (batch, batch, 8, length, cpu)
    assert splits(*args, num_sms=132, arch="sm90") == bf16
    assert splits(*args, num_sms=132, arch="sm90", kv_cache_dtype="auto") == bf16
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert splits(*args, num_sms=132, arch="sm90", kv_cache_dtype=dtype) == fp8
    d = dispatch.default_config(batch, batch, 32, 8, 128, length, cpu, arch="sm90",
                                num_sms=132, kv_cache_dtype="fp8_e4m3")
    assert (getattr(d, "num_splits", 1), d.block_n, d.num_warps, d.num_stages, d.fp8_fp16) == (
        fp8, 64 if fp8 > 1 else 32, 4, 3, True)
    assert dispatch.default_config(batch, batch, 32, 8, 128, length, cpu, arch="sm90",
                                   num_sms=132) == dispatch.default_config(
        batch, batch, 32, 8, 128, length, cpu, arch="sm90", num_sms=132, kv_cache_dtype="auto")
    for arch, rocm in (("sm80", False), ("sm100", False), ("gfx942", True)):
        assert splits(*args, num_sms=132, arch=arch, rocm=rocm, kv_cache_dtype="fp8_e4m3") == (
            splits(*args, num_sms=132, arch=arch, rocm=rocm))


@pytest.mark.parametrize(("programs", "length", "splits"), [
    (256, 4096, 3), (200, 4096, 3), (128, 4096, 3), (64, 32768, 6), (8, 32768, 49),
    (300, 4096, 1), (396, 4096, 1), (256, 1024, 1), (8, 1024, 2)], ids=lambda v: str(v))
def test_fp8_splits_fill_whole_rounds(programs, length, splits) -> None:
    """396 programs at once (3 an SM on 132 SMs): 256 programs take 3 splits (two full rounds,
    2/3 of the unsplit time) where filling one round allows none, 2 splits would run a second
    round nearly empty; 300 stay unsplit (2 splits: two rounds for half the work each, no
    gain). 512 keys a split at least (1024 keys: 2 splits at most)."""
    count = kvcore.ops.round_filling_split_count(programs, length, capacity=396,
                                                 min_split_tokens=512)
    assert count == splits
    rounds = -(-programs * count // 396)
    assert rounds <= 2 and all(rounds / count <= -(-programs * s // 396) / s
                               for s in range(1, min(length // 512, 2 * 396 // programs) + 1))
    # Qwen2.5-7B at 64 x 4096 (4 KV heads): 256 programs, on the sm90 row's fp8 decode tile.
    assert kvcore.ops.default_num_kv_splits(64, 64, 4, 4096, torch.device("cpu"), num_sms=132,
                                            arch="sm90", kv_cache_dtype="fp8_e4m3") == 3
    assert kvcore.ops.round_filling_split_count(0, 4096, capacity=396, min_split_tokens=512) == 1


@pytest.mark.parametrize(("hk", "hq", "batch", "length", "splits"), [
    (1, 8, 8, 32768, 49), (1, 8, 64, 4096, 6), (8, 64, 8, 32768, 6),
    (8, 32, 8, 32768, 4), (8, 32, 16, 4096, 2), (4, 28, 8, 32768, 12), (4, 32, 8, 32768, 12)],
    ids=lambda v: str(v))
def test_a_wide_gqa_group_splits_a_bf16_cache_into_three_programs_an_sm(hk, hq, batch, length,
                                                                        splits) -> None:
    """On the sm90 row (132 SMs), a 16-bit cache whose KV heads serve 8 query heads or more
    (padded to a power of two: Qwen2.5-7B's 7 fill the same 8-row tile as Qwen3's 8) aims at
    3 programs an SM (Llama-3.1-70B at TP 8: 49 splits at 8 x 32768, 6 at 64 x 4096; the
    Qwens at 8 x 32768: 12); a group of 4 (Llama-3.1-8B) keeps 2."""
    cpu = torch.device("cpu")
    assert dispatch.default_config(batch, batch, hq, hk, 128, length, cpu, arch="sm90",
                                   num_sms=132).num_splits == splits
    # The builder's own choice is the op's.
    assert kvcore.ops.default_num_kv_splits(batch, batch, hk, length, cpu, num_sms=132,
                                            arch="sm90", group_size=hq // hk) == splits


def test_the_ops_own_choice_splits_an_fp8_cache_more() -> None:
    """Without a plan the op picks by its caches' kv_cache_dtype: Llama-3.1-8B's layer at
    8 x 32768 on the sm90 row (132 SMs) takes 6 splits on an fp8 cache, 4 on a bf16 one."""
    query = torch.empty(8, 32, 128, dtype=torch.bfloat16)
    bf16 = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
    fp8 = torch.empty(4, 16, 8, 128, dtype=torch.float8_e4m3fn)
    target = dict(arch="sm90", num_sms=132, rocm=False)
    assert dispatch.call_config(query, fp8, fp8, "fp8_e4m3", 8, 32768, **target) == (
        TritonSplitKVConfig(block_q=4, g_pad=4, block_n=64, num_splits=6, num_warps=4,
                            num_stages=3, const_block=True))
    assert dispatch.call_config(query, bf16, bf16, "auto", 8, 32768, **target).num_splits == 4


def test_output_in_place_with_strides() -> None:
    batch = mixed_batch(_seed("inplace"), 3, block_size=16, num_heads=4, num_kv_heads=2,
                        head_size=64, dtype=torch.float16)
    big = torch.randn(batch.query.shape[0], 2 * batch.query.shape[1], 64,
                      dtype=torch.float16, device=DEVICE)
    before = big.clone()
    output = big[:, 1::2]  # every other head: non-contiguous
    result = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                              **batch.kwargs(), output=output)
    assert result is output
    assert torch.equal(big[:, 0::2], before[:, 0::2])
    check_against_references(output, batch)


@pytest.mark.parametrize(("kind", "splits"), [("decode", 1), ("decode", 3), ("mixed", 1),
                                             ("prefill", None)])
def test_step_tensors_as_views_of_larger_buffers(kind: str, splits: int | None) -> None:
    """query_start_loc, seq_lens and block_table as stride-2 views whose gaps hold other
    plausible values (as engines pass slices of persistent buffers): the output equals the
    dense tensors' bit for bit. "prefill" takes the GPU's default prefill kernel (Gluon on
    Hopper), the others the Triton decode/split kernels."""
    from kvcore.testing import strided_view

    gen = _seed(f"strided-steps-{kind}")
    shape = dict(num_heads=8, num_kv_heads=2, block_size=16, dtype=torch.bfloat16)
    if kind == "prefill":
        batch = make_batch(gen, q_lens=[37, 20, 64], seq_lens=[37, 52, 64], head_size=128,
                           **shape)
    elif kind == "decode":
        batch = make_batch(gen, q_lens=[1, 1, 1], seq_lens=[70, 17, 33], head_size=64, **shape)
    else:
        batch = mixed_batch(gen, 4, head_size=64, **shape)
    dense = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), plan=Plan(num_kv_splits=splits))
    spare = batch.key_cache.shape[0] - 1  # an id inside the cache
    views = dataclasses.replace(batch, query_start_loc=strided_view(batch.query_start_loc, 0),
                                seq_lens=strided_view(batch.seq_lens, 0),
                                block_table=strided_view(batch.block_table, spare))
    assert not views.seq_lens.is_contiguous() and views.block_table.stride(1) == 2
    out = triton_attention.paged_attention(views.query, views.key_cache, views.value_cache,
                                           **views.kwargs(), plan=Plan(num_kv_splits=splits))
    assert torch.equal(out, dense)
    check_against_references(out, batch)


def test_key_and_value_views_with_different_strides() -> None:
    """K in the HND physical order, V a strided layer of a cross-layer pool: each view is read
    through its own strides."""
    gen = _seed("kvstrides")
    batch = mixed_batch(gen, 3, block_size=16, num_heads=4, num_kv_heads=2, head_size=64,
                        dtype=torch.float32)
    num_blocks = batch.key_cache.shape[0]
    key_view = torch.empty(num_blocks, 2, 16, 64, device=DEVICE).transpose(1, 2)
    key_view.copy_(batch.key_cache)
    pool = torch.randn(num_blocks, 3, 2, 16, 2, 64, generator=gen).to(DEVICE)
    value_view = pool[:, 2, 1]
    value_view.copy_(batch.value_cache)
    out = triton_attention.paged_attention(batch.query, key_view, value_view, **batch.kwargs())
    check_against_references(out, batch)


@pytest.mark.parametrize("layout", ["cross_layer", "legacy"])
@pytest.mark.parametrize("splits", [1, 3])
def test_layout_views_bit_exact(layout: str, splits: int) -> None:
    """A per-layer view of a cross-layer pool (inflated page stride, non-zero offset) and the
    halves of a legacy (2, num_blocks, ...) cache give exactly the contiguous result, and
    attention writes nothing into the pool."""
    gen = _seed(f"layout{layout}{splits}")
    num_layers, block_size, hk, d = 3, 16, 2, 64
    batch = mixed_batch(gen, 3, block_size=block_size, num_heads=8, num_kv_heads=hk,
                        head_size=d, dtype=torch.bfloat16)
    num_blocks = batch.key_cache.shape[0]
    if layout == "cross_layer":
        pool = torch.randn(num_blocks, num_layers, 2, block_size, hk, d, generator=gen).to(
            torch.bfloat16).to(DEVICE)
        kc, vc = pool.permute(1, 0, 2, 3, 4, 5)[1].unbind(1)
    else:
        pool = torch.randn(2, num_blocks, block_size, hk, d, generator=gen).to(
            torch.bfloat16).to(DEVICE)
        kc, vc = pool[0], pool[1]
    assert vc.storage_offset() > 0
    snapshot = pool.clone()
    strided = triton_attention.paged_attention(batch.query, kc, vc, **batch.kwargs(),
                                               plan=Plan(num_kv_splits=splits))
    flat = triton_attention.paged_attention(batch.query, kc.contiguous(), vc.contiguous(),
                                            **batch.kwargs(), plan=Plan(num_kv_splits=splits))
    assert torch.equal(strided, flat)
    assert torch.equal(pool, snapshot)


def test_dispatcher() -> None:
    batch = mixed_batch(_seed("dispatch"), 3, block_size=16, num_heads=4, num_kv_heads=2,
                        head_size=64, dtype=torch.float32)
    out = kvcore.ops.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                     **batch.kwargs())
    check_against_references(out, batch)
    q64 = kvcore.ops.paged_attention(batch.query.double(), batch.key_cache.double(),
                                     batch.value_cache.double(), **batch.kwargs())
    assert q64.dtype == torch.float64  # float64 always runs the reference


@pytest.mark.parametrize(
    ("change", "error", "names"),
    [
        ("query_float64", TypeError, "query"),
        ("head_size", ValueError, "head_size"),
        ("splits_zero", ValueError, "num_kv_splits"),
        ("block_id", ValueError, "block_table"),
        ("scale", ValueError, "scale"),
        ("heads", ValueError, "heads"),
        ("window", ValueError, "sliding_window"),
        ("output_shape", ValueError, "output"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(change: str, error: type, names: str) -> None:
    d = 320 if change == "head_size" else 64
    batch = make_batch(_seed("bad"), q_lens=[1, 3], seq_lens=[20, 3], block_size=16,
                       num_heads=4, num_kv_heads=2, head_size=d, dtype=torch.float32)
    query, kwargs = batch.query, batch.kwargs()
    if change == "query_float64":
        query = query.double()
        batch.key_cache, batch.value_cache = batch.key_cache.double(), batch.value_cache.double()
    elif change == "splits_zero":
        kwargs["plan"] = Plan(num_kv_splits=0)
    elif change == "block_id":
        kwargs["block_table"] = batch.block_table.clone()
        kwargs["block_table"][0, 0] = 10_000
    elif change == "scale":
        kwargs["scale"] = -1.0
    elif change == "heads":
        query = query[:, :3]
    elif change == "window":
        kwargs["sliding_window"] = 0
    elif change == "output_shape":
        kwargs["output"] = torch.empty_like(query)[:, :2]
    with pytest.raises(error, match=names):
        triton_attention.paged_attention(query, batch.key_cache, batch.value_cache, **kwargs)


@pytest.mark.gpu
def test_real_size_decode_and_prefill_on_gpu() -> None:
    gen = torch.Generator().manual_seed(21)
    for q_lens, seq_lens in (([1] * 16, [4096] * 16), ([1] * 4, [32768] * 4),
                             ([512, 1, 300], [2048, 3000, 300]), ([1000], [1000]),
                             ([256, 256], [3256, 4000])):
        batch = make_batch(gen, q_lens=q_lens, seq_lens=seq_lens, block_size=16, num_heads=32,
                           num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                               **batch.kwargs())
        check_against_references(out, batch)


@pytest.mark.gpu
def test_int64_offsets_in_a_32_layer_cross_layer_pool() -> None:
    """Layer 31 of a 32-layer cross-layer pool, block ids above 2,048: offsets > 2**31."""
    num_blocks, num_layers, bs, hk, d = 2200, 32, 16, 8, 128
    pool = torch.empty(num_blocks, num_layers, 2, bs, hk, d, dtype=torch.bfloat16,
                       device="cuda")
    pool.normal_()
    kc, vc = pool[:, num_layers - 1].unbind(1)
    gen = torch.Generator().manual_seed(22)
    table = (torch.randperm(150, generator=gen) + 2048).to(torch.int32).reshape(3, 50)
    seq_lens = torch.tensor([800, 1, 777], dtype=torch.int32)
    q_lens = [1, 1, 40]
    qsl = torch.tensor([0, 1, 2, 42], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 32, d, generator=gen).to(torch.bfloat16)
    kwargs = dict(query_start_loc=qsl.cuda(), seq_lens=seq_lens.cuda(), block_table=table.cuda(),
                  scale=d ** -0.5)
    for splits in (1, 4):
        strided = triton_attention.paged_attention(query.cuda(), kc, vc, **kwargs,
                                                   plan=Plan(num_kv_splits=splits))
        flat = triton_attention.paged_attention(query.cuda(), kc.contiguous(), vc.contiguous(),
                                                **kwargs, plan=Plan(num_kv_splits=splits))
        assert torch.equal(strided, flat)
    # The block size compiled in (shifts, not divisions), on both kernels.
    for num_tokens, splits in ((42, 1), (42, 4)):
        cfg = dispatch.default_config(num_tokens, 3, 32, hk, d, 50 * bs, torch.device("cuda"),
                                      splits, gluon=False)
        plain = triton_attention.paged_attention(query.cuda(), kc, vc, **kwargs,
                                                 plan=Plan(config=cfg))
        const = triton_attention.paged_attention(
            query.cuda(), kc, vc, **kwargs,
            plan=Plan(config=dataclasses.replace(cfg, const_block=True)))
        torch.testing.assert_close(const, plain, atol=0, rtol=0)


def test_host_next_power_of_2_matches_triton_and_refuses_bad_input() -> None:
    import triton

    from kvcore.ops.triton_utils import next_power_of_2

    assert [next_power_of_2(n) for n in range(0, 2100)] == \
        [triton.next_power_of_2(n) for n in range(0, 2100)]
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="must be a non-negative int"):
            next_power_of_2(bad)
