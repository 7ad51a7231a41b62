"""TRITON_ATTN's decode kernel on fp8 caches: bf16 queries meet the fp8 K/V in fp16 products
(:func:`kvcore.ops.triton_decode.fp16_query` rescales the query rows), V is converted before
it is staged in shared memory.

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

from kvcore.ops import TritonAttentionPlan, TritonDecodeConfig, paged_attention_ref

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
triton_decode = pytest.importorskip("kvcore.ops.triton_decode")
dispatch = pytest.importorskip("kvcore.ops.attention_dispatch")
from kvcore.ops.triton_utils import is_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 8, 2, 64


@triton.jit
def _fp16_query_kernel(q_ptr, q16_ptr, up_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                       INTERPRET: tl.constexpr):
    rows = tl.arange(0, ROWS)
    offs = rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
    q16, up = triton_decode.fp16_query(tl.load(q_ptr + offs), INTERPRET)
    tl.store(q16_ptr + offs, q16.to(tl.float32))
    tl.store(up_ptr + rows, up)


def test_fp16_query_scales_each_row_exactly_into_fp16() -> None:
    """Rows of every magnitude bf16 holds: ``q16`` is fp16 (no value over 65504), each row's
    largest in ``[2**14, 2**15)``, and ``q16 * up`` gives ``q`` back bit for bit; a row of
    zeros stays zero, inf and NaN stay inf and NaN."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = [1.0, 2.0 ** 20, 2.0 ** 100, 2.0 ** 125, 2.0 ** -20, 2.0 ** -80, 1e-3, 448.0,
                  2.0 ** -10, 2.0 ** 10, 2.0 ** 30, 2.0 ** 60, 2.0 ** -50]
    rows = [torch.randn(32, generator=gen) * m for m in magnitudes]
    rows.append(torch.randn(32, generator=gen) * torch.logspace(-6, 6, 32, base=2.0))  # mixed
    zeros, special = len(rows), len(rows) + 1
    rows.append(torch.zeros(32))
    rows.append(torch.randn(32, generator=gen))
    rows[special][3], rows[special][7] = float("inf"), float("nan")
    q = torch.stack(rows).to(torch.bfloat16).to(DEVICE)
    q16 = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    up = torch.empty(q.shape[0], dtype=torch.float32, device=DEVICE)
    _fp16_query_kernel[(1,)](q, q16, up, ROWS=q.shape[0], COLS=q.shape[1],
                             INTERPRET=is_interpreted(_fp16_query_kernel))
    q16, up, q = q16.cpu(), up.cpu(), q.float().cpu()
    normal = torch.arange(q.shape[0]) < zeros
    assert torch.equal(q16[normal].to(torch.float16).float(), q16[normal])  # fp16 values
    assert (q16[normal].abs().amax(1) >= 2.0 ** 14).all()
    assert (q16[normal].abs().amax(1) < 2.0 ** 15).all()
    back = q16.double() * up.double()[:, None]
    assert torch.equal(back[normal], q.double()[normal])
    assert torch.equal(back[zeros], torch.zeros(32, dtype=torch.float64))
    assert back[special, 3] == float("inf") and back[special, 7].isnan()


def _decode_batch(name: str, cache_dtype: torch.dtype, seq_lens: list[int], q_magnitude: float,
                  kv_magnitude: float):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    batch = fp8_paged_batch(gen, cache_dtype, seq_lens, len(seq_lens), block_size=BLOCK_SIZE,
                            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                            head_size=HEAD_SIZE, q_magnitude=q_magnitude,
                            kv_magnitude=kv_magnitude, device=DEVICE)
    batch["query_start_loc"] = torch.arange(len(seq_lens) + 1, dtype=torch.int32,
                                            device=DEVICE)
    return batch


@pytest.mark.parametrize("fp8_fp16", [True, False], ids=["fp16", "query_dtype"])
@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitudes", [(1.0, 1.0), (2.0 ** 17, 2.0 ** -14)],
                         ids=["unit", "query_beyond_fp16"])
def test_decode_on_fp8_cache_matches_the_reference(magnitudes, cache_dtype, splits,
                                                   fp8_fp16) -> None:
    """Decode-only batches (the decode kernel, whole and split, both fp8 paths) on e4m3 and
    e5m2 caches with tensor scales: the reference's output within bf16 tolerance.
    ``query_beyond_fp16`` holds queries ~2**17 (fp16 overflows at 65504) against keys
    ~2**-14, logits of order one: the per-row rescaling keeps them exact."""
    seq_lens = [150, 37, 64, 1]
    call = _decode_batch(f"fp8decode{magnitudes}{cache_dtype}", cache_dtype, seq_lens,
                         *magnitudes)
    config = dispatch.default_config(len(seq_lens), len(seq_lens), NUM_HEADS, NUM_KV_HEADS,
                                     HEAD_SIZE, call["block_table"].shape[1] * BLOCK_SIZE,
                                     torch.device(DEVICE), splits)
    assert config.fp8_fp16  # the default rows but ROCm's
    plan = TritonAttentionPlan(config=dataclasses.replace(config, fp8_fp16=fp8_fp16))
    out = triton_attention.paged_attention(**call, plan=plan)
    ref = paged_attention_ref(**call)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


#: Gemma-2's sliding layers in small: head size 256, two query heads per KV head, logits
#: soft-capped at 50, a window shorter than the longest request.
WIDE_HEADS, WIDE_KV_HEADS, WIDE_HEAD_SIZE, WIDE_CAP, WIDE_WINDOW = 4, 2, 256, 50.0, 100


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitudes", [(1.0, 1.0), (48.0, 1.0), (2.0 ** 17, 2.0 ** -14)],
                         ids=["unit", "logits_near_the_cap", "query_beyond_fp16"])
def test_wide_head_decode_on_fp8_cache_matches_the_float64_reference(magnitudes, cache_dtype,
                                                                     splits) -> None:
    """Gemma-like decode (head size 256, groups of 2, soft-cap, sliding window) on e4m3 and
    e5m2 caches with sm90's config for it (the ``fp8_wide`` tile), whole and split: the
    float64 reference's output within bf16 tolerance. ``logits_near_the_cap`` has scores of
    order 48 against the cap of 50, where capping changes the softmax."""
    seq_lens = [150, 37, 64, 1]
    gen = torch.Generator().manual_seed(zlib.crc32(f"wide{magnitudes}{cache_dtype}".encode()))
    call = fp8_paged_batch(gen, cache_dtype, seq_lens, len(seq_lens), block_size=BLOCK_SIZE,
                           num_heads=WIDE_HEADS, num_kv_heads=WIDE_KV_HEADS,
                           head_size=WIDE_HEAD_SIZE, q_magnitude=magnitudes[0],
                           kv_magnitude=magnitudes[1], device=DEVICE)
    call.update(query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32,
                                             device=DEVICE),
                logits_soft_cap=WIDE_CAP, sliding_window=WIDE_WINDOW)
    config = dispatch.default_config(len(seq_lens), len(seq_lens), WIDE_HEADS, WIDE_KV_HEADS,
                                     WIDE_HEAD_SIZE, call["block_table"].shape[1] * BLOCK_SIZE,
                                     torch.device(DEVICE), splits, arch="sm90", rocm=False,
                                     num_sms=132, kv_cache_dtype=call["kv_cache_dtype"])
    assert config.max_registers is not None  # the fp8_wide tile
    out = triton_attention.paged_attention(**call, plan=TritonAttentionPlan(config=config))
    ref = paged_attention_ref(**{**call, "query": call["query"].double()})
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_fp8_caches_above_head_size_128_take_the_fp8_wide_tile() -> None:
    """sm90's row gives fp8 caches above head size 128 its ``fp8_wide`` tile (32 keys, one
    tile in flight, 128 registers), unsplit and split, split for the tile's 4 programs an SM
    (8 splits at 8 x 32768; head size 128 takes 6); 16-bit caches and fp8 caches of head size
    128 keep the row's tile; rows without ``fp8_wide`` (other GPUs, ROCm) cap no
    registers."""
    cpu = torch.device("cpu")
    sm90 = dict(arch="sm90", rocm=False, num_sms=132)
    for b, length, splits in ((64, 4096, 1), (8, 32768, 8)):
        wide = dispatch.default_config(b, b, 16, 8, 256, length, cpu, kv_cache_dtype="fp8",
                                       **sm90)
        assert (wide.block_n, wide.num_warps, wide.num_stages, wide.max_registers) == \
            (32, 4, 2, 128)
        assert getattr(wide, "num_splits", 1) == splits
        assert dispatch.default_config(b, b, 16, 8, 256, length, cpu, kv_cache_dtype="fp8_e5m2",
                                       **sm90) == wide
        for head_size, kv_cache_dtype in ((256, "auto"), (128, "fp8"), (128, "auto")):
            kept = dispatch.default_config(b, b, 16, 8, head_size, length, cpu,
                                           kv_cache_dtype=kv_cache_dtype, **sm90)
            assert kept.max_registers is None and kept.num_stages == 3
    for target in (dict(arch="sm80", rocm=False, num_sms=108),
                   dict(arch="gfx942", rocm=True, num_sms=304)):
        other = dispatch.default_config(64, 64, 16, 8, 256, 4096, cpu, kv_cache_dtype="fp8",
                                        **target)
        assert other.max_registers is None


@pytest.mark.parametrize("splits", [None, 4], ids=["whole", "split"])
def test_narrow_head_decode_on_fp8_cache_matches_the_float64_reference(splits) -> None:
    """Decode at head size 64 on an e4m3 cache with sm90's config for it (the ``fp8_narrow``
    tile, 64 keys a step), whole and split: the float64 reference's output within bf16
    tolerance, the last blocks partly filled."""
    seq_lens = [150, 37, 64, 1]
    gen = torch.Generator().manual_seed(zlib.crc32(b"narrow"))
    call = fp8_paged_batch(gen, torch.float8_e4m3fn, seq_lens, len(seq_lens),
                           block_size=BLOCK_SIZE, num_heads=NUM_HEADS,
                           num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, q_magnitude=1.0,
                           kv_magnitude=1.0, device=DEVICE)
    call.update(query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32,
                                             device=DEVICE))
    config = dispatch.default_config(len(seq_lens), len(seq_lens), NUM_HEADS, NUM_KV_HEADS,
                                     HEAD_SIZE, call["block_table"].shape[1] * BLOCK_SIZE,
                                     torch.device(DEVICE), splits, arch="sm90", rocm=False,
                                     num_sms=132, kv_cache_dtype=call["kv_cache_dtype"])
    assert config.block_n == 64
    out = triton_attention.paged_attention(**call, plan=TritonAttentionPlan(config=config))
    ref = paged_attention_ref(**{**call, "query": call["query"].double()})
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_fp8_caches_up_to_head_size_64_take_the_fp8_narrow_tile() -> None:
    """sm90's row gives fp8 caches of head size 64 its ``fp8_narrow`` tile (64 keys a step)
    unsplit and the row's split tile (64 keys, 8 splits at 8 x 32768: the narrow tile's 4
    programs an SM, not the row's 3) split; 16-bit caches of head size 64 and fp8 caches of
    head size 128 keep the row's 32-key tile; rows without ``fp8_narrow`` (other GPUs, ROCm)
    keep theirs."""
    cpu = torch.device("cpu")
    sm90 = dict(arch="sm90", rocm=False, num_sms=132)
    narrow = dispatch.default_config(64, 64, 64, 8, 64, 4096, cpu, kv_cache_dtype="fp8",
                                     **sm90)
    assert (narrow.block_n, narrow.num_warps, narrow.num_stages, narrow.const_block) == \
        (64, 4, 3, True)
    assert getattr(narrow, "num_splits", 1) == 1
    split = dispatch.default_config(8, 8, 64, 8, 64, 32768, cpu, kv_cache_dtype="fp8_e5m2",
                                    **sm90)
    assert (split.block_n, split.num_splits) == (64, 8)
    for head_size, kv_cache_dtype in ((64, "auto"), (128, "fp8")):
        kept = dispatch.default_config(64, 64, 64, 8, head_size, 4096, cpu,
                                       kv_cache_dtype=kv_cache_dtype, **sm90)
        assert kept.block_n == 32
    for target in (dict(arch="sm80", rocm=False, num_sms=108),
                   dict(arch="gfx942", rocm=True, num_sms=304)):
        other = dispatch.default_config(64, 64, 64, 8, 64, 4096, cpu, kv_cache_dtype="fp8",
                                        **target)
        assert other.block_n == dispatch.decode_tile(target["arch"], target["rocm"]).block_n


def test_max_registers_is_refused_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A register cap is an NVIDIA compile option: a ROCm build refuses a config with one,
    naming the field and the fix."""
    call = _decode_batch("rocm_cap", torch.float8_e4m3fn, [40], 1.0, 1.0)
    config = TritonDecodeConfig(block_q=4, g_pad=4, block_n=32, num_warps=4, num_stages=2,
                                max_registers=128)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    with pytest.raises(ValueError, match=r"max_registers=128.*pass max_registers=None"):
        triton_attention.paged_attention(**call, plan=TritonAttentionPlan(config=config))


def test_the_rocm_row_keeps_fp8_tiles_in_the_query_dtype() -> None:
    """``fp8_fp16`` comes from the GPU's DECODE_TILES row: on for NVIDIA's, off for ROCm's
    (more registers there, not measured), in unsplit and split configs alike."""
    cpu = torch.device("cpu")
    for splits in (1, 4):
        args = (64, 64, 32, 8, 128, 4096, cpu, splits)
        assert dispatch.default_config(*args, arch="sm90", rocm=False, num_sms=132).fp8_fp16
        assert not dispatch.default_config(*args, arch="gfx942", rocm=True,
                                           num_sms=304).fp8_fp16


_COMPILE = """
import json, re, torch
from kvcore.testing import compile_launches
from kvcore.ops import TritonAttentionPlan, TritonDecodeConfig, triton_attention
blocks = 256
key = torch.empty(blocks, 16, 8, 128, dtype=torch.float8_e4m3fn)
config = TritonDecodeConfig(block_q=4, g_pad=4, block_n=32, num_warps=4, num_stages=3,
                            const_block=True)
(c,) = compile_launches(lambda: triton_attention.paged_attention(
    torch.empty(64, 32, 128, dtype=torch.bfloat16), key, torch.empty_like(key),
    query_start_loc=torch.arange(65, dtype=torch.int32),
    seq_lens=torch.full((64,), 4096, dtype=torch.int32),
    block_table=torch.arange(64 * 256, dtype=torch.int32).reshape(64, 256) % blocks,
    scale=0.088, kv_cache_dtype="fp8", k_scale=torch.ones(1), v_scale=torch.ones(1),
    plan=TritonAttentionPlan(config=config)), "sm90")
ptx = c.asm["ptx"]
print(json.dumps(dict(
    copies=sorted(set(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^]]+\\], "
                                 r"\\[[^]]+\\], (0x[0-9a-f]+)", ptx))),
    byte_loads=len(re.findall(r"ld\\.shared\\.(?:u8|b8|s8)", ptx)),
    transposed_loads=len(re.findall(r"ldmatrix\\.sync\\.aligned\\.m8n8\\.x4\\.trans", ptx)),
    fp16_mma=len(re.findall(r"mma\\.sync\\.aligned\\.m16n8k16\\.row\\.col\\.f32\\.f16\\.f16", ptx)),
    bf16_conversions=len(re.findall(r"cvt\\.\\w*\\.?bf16\\.f16|cvt\\.rn\\.bf16x2\\.e4m3", ptx)))))
"""


@pytest.mark.compile
def test_sm90_compile_reads_fp8_tiles_in_16_byte_copies_and_16_bit_operands() -> None:
    """Compiled ahead of time for sm_90a (no GPU; in a subprocess, the suite sets
    ``TRITON_INTERPRET``) at Llama-3.1-8B's decode shape: K and V arrive by 16-byte
    ``cp.async`` copies, no shared-memory load reads single bytes (V's ``P @ V`` operand comes
    from transposing 16-bit matrix loads), both products are fp16 ``mma`` and nothing converts
    to bf16."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["copies"] == ["0x10"], facts
    assert facts["byte_loads"] == 0 and facts["transposed_loads"] > 0, facts
    assert facts["fp16_mma"] > 0 and facts["bf16_conversions"] == 0, facts


_COMPILE_WIDE = """
import json, re, torch
from kvcore.testing import compile_launches
from kvcore.ops import TritonAttentionPlan, triton_attention
from kvcore.ops.attention_dispatch import default_config
blocks, facts = 256, {}
for cache in ("fp8", "auto"):
    dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    key = torch.empty(blocks, 16, 8, 256, dtype=dtype)
    config = default_config(64, 64, 16, 8, 256, 4096, torch.device("cpu"), arch="sm90",
                            rocm=False, num_sms=132, kv_cache_dtype=cache)
    scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1)) if cache == "fp8" else {}
    (c,) = compile_launches(lambda: triton_attention.paged_attention(
        torch.empty(64, 16, 256, dtype=torch.bfloat16), key, torch.empty_like(key),
        query_start_loc=torch.arange(65, dtype=torch.int32),
        seq_lens=torch.full((64,), 4096, dtype=torch.int32),
        block_table=torch.arange(64 * 256, dtype=torch.int32).reshape(64, 256) % blocks,
        scale=0.0625, sliding_window=4096, logits_soft_cap=50.0, kv_cache_dtype=cache,
        plan=TritonAttentionPlan(config=config), **scales), "sm90")
    ptx = c.asm["ptx"]
    facts[cache] = dict(
        shared=c.shared, maxnreg=re.findall(r"\\.maxnreg (\\d+)", ptx),
        fp16_mma=len(re.findall(r"mma\\.sync\\.aligned\\.m16n8k16\\.row\\.col\\.f32"
                                r"\\.f16\\.f16", ptx)),
        bf16_conversions=len(re.findall(r"cvt\\.\\w*\\.?bf16\\.f16|cvt\\.rn\\.bf16x2\\.e4m3", ptx)))
print(json.dumps(facts))
"""


@pytest.mark.compile
def test_sm90_compile_fits_four_wide_head_fp8_programs_on_an_sm() -> None:
    """Compiled ahead of time for sm_90a at Gemma-2-9B's sliding-layer decode (Hq 16, Hk 8,
    D 256, soft-cap, window; 64 x 4096): the fp8 cache's default config caps registers at
    128 (``.maxnreg``) and takes at most 56 KiB of shared memory, so four programs (and
    their 1 KiB reserves) fit an H100/H200 SM's 228 KiB; its products are fp16 ``mma`` with
    nothing converted to bf16. The bf16 cache's kernel caps no registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_WIDE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    fp8, bf16 = facts["fp8"], facts["auto"]
    assert fp8["maxnreg"] == ["128"] and 4 * (fp8["shared"] + 1024) <= 228 * 1024, facts
    assert fp8["fp16_mma"] > 0 and fp8["bf16_conversions"] == 0, facts
    assert bf16["maxnreg"] == [], facts
