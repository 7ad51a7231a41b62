"""TRITON_MLA's decode kernel on fp8 latent caches with ``fp8_fp16`` (the config switch): bf16
queries meet the fp8 latents in fp16 products (each head's query scaled by a power of two into
fp16's range) and each tile is converted once, where it is loaded.

Under ``TRITON_INTERPRET=1`` (no GPU) the tests run the query scaling and the kernel's math on
small shapes against the float64 reference; the compile test checks the sm_90a code (the tile
converted once, no fp16 -> bf16 conversions) without a GPU; the ``gpu`` test runs DeepSeek's
sizes on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mla_helpers import (
    DEVICE,
    REAL_RANK,
    REAL_SCALE,
    assert_close,
    assert_decode_close,
    decode_case,
    generator,
    real_size_decode_case,
    run_decode,
)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
decode = pytest.importorskip("kvcore_mla.ops.triton_mla_decode")
configs = pytest.importorskip("kvcore_mla.ops.mla_configs")
from kvcore.ops.triton_utils import is_interpreted  # noqa: E402

PARTS = 3  # q0, q1 and q_pe of _fp16_rows


@triton.jit
def _fp16_rows_kernel(q_ptr, out_ptr, up_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      INTERPRET: tl.constexpr):
    rows = tl.arange(0, ROWS)
    offs = rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
    q0 = tl.load(q_ptr + offs)
    q1 = tl.load(q_ptr + ROWS * COLS + offs)
    q_pe = tl.load(q_ptr + 2 * ROWS * COLS + offs)
    q0, q1, q_pe, up = decode._fp16_rows(q0, q1, q_pe, True, True, INTERPRET)
    tl.store(out_ptr + offs, q0.to(tl.float32))
    tl.store(out_ptr + ROWS * COLS + offs, q1.to(tl.float32))
    tl.store(out_ptr + 2 * ROWS * COLS + offs, q_pe.to(tl.float32))
    tl.store(up_ptr + rows, up)


def test_fp16_rows_scale_each_head_exactly_into_fp16() -> None:
    """Heads of every magnitude bf16 holds, the largest element in any of the three parts: the
    parts are fp16 values, each head's largest in ``[2**14, 2**15)``, and ``part * up`` gives
    the query back bit for bit; a head of zeros stays zero, inf and NaN stay inf and NaN."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = [1.0, 2.0 ** 20, 2.0 ** 100, 2.0 ** 119, 2.0 ** -20, 2.0 ** -80, 1e-3, 448.0,
                  2.0 ** 17, 2.0 ** -50, 2.0 ** 60, 2.0 ** -10, 3.0]
    heads = [torch.randn(PARTS, 16, generator=gen) * m for m in magnitudes]
    for head, part in zip(heads, [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 1], strict=True):
        head[part, 5] *= 64  # the head's largest element, in one part or another
    heads.append(torch.randn(PARTS, 16, generator=gen) * torch.logspace(-6, 6, 16, base=2.0))
    zeros, special = len(heads), len(heads) + 1
    heads.append(torch.zeros(PARTS, 16))
    heads.append(torch.randn(PARTS, 16, generator=gen))
    heads[special][2, 3], heads[special][0, 7] = float("inf"), float("nan")
    q = torch.stack(heads, dim=1).to(torch.bfloat16).to(DEVICE)  # (PARTS, heads, 16)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    up = torch.empty(q.shape[1], dtype=torch.float32, device=DEVICE)
    _fp16_rows_kernel[(1,)](q, out, up, ROWS=q.shape[1], COLS=q.shape[2],
                            INTERPRET=is_interpreted(_fp16_rows_kernel))
    out, up, q = out.cpu(), up.cpu(), q.float().cpu()
    normal = torch.arange(q.shape[1]) < zeros
    scaled = out[:, normal]
    assert torch.equal(scaled.to(torch.float16).float(), scaled)  # fp16 values
    largest = scaled.abs().amax(dim=(0, 2))
    assert (largest >= 2.0 ** 14).all() and (largest < 2.0 ** 15).all()
    back = out.double() * up.double()[None, :, None]
    assert torch.equal(back[:, normal], q.double()[:, normal])
    assert torch.equal(back[:, zeros], torch.zeros(PARTS, 16, dtype=torch.float64))
    assert back[2, special, 3] == float("inf") and back[0, special, 7].isnan()


def _config(split_latent: bool, fp8_fp16: bool, block_n: int = 16):
    cls = configs.TritonMLAHalvesConfig if split_latent else configs.TritonMLADecodeConfig
    return cls(block_h=16, block_n=block_n, num_warps=4, num_stages=2, fp8_fp16=fp8_fp16)


@pytest.mark.parametrize("magnitudes",
                         [(1.0, 0.5), (2.0 ** 17, 2.0 ** -17), (2.0 ** -20, 2.0 ** 18)],
                         ids=["unit", "query_beyond_fp16", "query_below_fp16"])
@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("split_latent", [False, True], ids=["latent", "halves"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_fp8_fp16_decode_matches_the_reference(cache_dtype, split_latent, splits,
                                               magnitudes) -> None:
    """fp8 caches with ``fp8_fp16`` on, the latent whole and in halves, whole and split, e4m3
    and e5m2: the float64 reference on the cache's values times the scale, within bf16
    tolerance. ``query_beyond_fp16`` holds queries ~2**17 (fp16 overflows at 65504) against a
    scale of 2**-17, ``query_below_fp16`` queries ~2**-20 (fp16 subnormal) against 2**18:
    logits of order one, which the per-head rescaling keeps exact."""
    q_magnitude, k_scale = magnitudes
    gen = generator("mla-decode-fp8-fp16", cache_dtype, split_latent, splits, magnitudes)
    q, cache, table, lens = decode_case(gen, 16, 16, [40, 3, 17], torch.bfloat16)
    q = (q.float() * q_magnitude).to(torch.bfloat16)
    fp8 = cache.to(cache_dtype)
    o, lse = run_decode(q, fp8, table, lens, splits, _config(split_latent, True),
                        k_scale=k_scale, v_scale=k_scale)
    assert_decode_close(o, lse, q, fp8.double() * k_scale, table, lens, torch.bfloat16)
    before = run_decode(q, fp8, table, lens, splits, _config(split_latent, False),
                        k_scale=k_scale, v_scale=k_scale)
    assert_close(o, before[0].double(), torch.bfloat16, "o vs fp8_fp16=False")


def test_fp8_fp16_leaves_16_bit_caches_alone() -> None:
    """A bf16 cache runs the kernel it always ran whatever ``fp8_fp16`` says (the switch is
    compiled in as False), so the outputs are bit for bit the same."""
    gen = generator("mla-decode-fp8-fp16-bf16")
    q, cache, table, lens = decode_case(gen, 16, 16, [40, 3], torch.bfloat16)
    on = run_decode(q, cache, table, lens, 2, _config(False, True))
    off = run_decode(q, cache, table, lens, 2, _config(False, False))
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    launches = [launch for found, launch in decode._LAUNCHES.items()
                if found[0].fp8_fp16 and not launch.kwargs["FP8"]]
    assert launches and not any(launch.kwargs["FP8_FP16"] for launch in launches)


def test_fp8_fp16_is_refused_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 path's PTX move does not assemble for AMD GPUs: the launcher says so."""
    monkeypatch.setattr(decode, "is_rocm", lambda: True)
    gen = generator("mla-decode-fp8-fp16-rocm")
    q, cache, table, lens = decode_case(gen, 16, 16, [8], torch.bfloat16)
    with pytest.raises(ValueError, match=r"config.fp8_fp16=True on ROCm"):
        run_decode(q, cache.to(torch.float8_e4m3fn), table, lens, 1, _config(False, True),
                   k_scale=1.0, v_scale=1.0)


def sm90_fp8_decode_code(fp8_fp16: bool) -> dict[str, object]:
    """DeepSeek-V3's decode at 8-way tensor parallelism (16 heads, latent 512 + rope 64, pages
    of 16, bf16 queries, e4m3 cache) with the sm90 row's 16-head tile, compiled for sm90 ahead
    of time: the PTX's fp16 -> bf16 conversions, the shared-memory tiles of the TTGIR's loop and
    the ``kWidth`` of its dot operands. Run with ``TRITON_INTERPRET`` unset."""
    import re

    from kvcore.testing import compile_launches

    rank, rope, page, heads = 512, 64, 16, 16
    row = configs.mla_decode_config(heads, "sm90", page_size=page, fp8_cache=True)
    config = dataclasses.replace(row, fp8_fp16=fp8_fp16)
    q = torch.empty(2, heads, rank + rope, dtype=torch.bfloat16)
    cache = torch.empty(16, page, 1, rank + rope, dtype=torch.float8_e4m3fn)
    o = torch.empty(2, heads, rank, dtype=torch.bfloat16)
    lse = torch.empty(2, heads, dtype=torch.float32)
    table = torch.zeros(2, 8, dtype=torch.int32)
    lens = torch.full((2,), 100, dtype=torch.int32)
    kernels = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
    (compiled,) = [c for c in compile_launches(
        lambda: kernels.decode_attention_fwd(
            q, cache, cache[..., :rank], o, lse, table, lens,
            torch.empty(2, heads, 2, rank + 1), 2, 0.1, page, is_mla=True,
            k_scale=torch.ones(1), config=config),
        "sm90") if c.kernel == "_mla_decode_kernel"]
    ttgir = compiled.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):]
    return {
        "bf16_conversions": len(re.findall(r"cvt\.rn\.bf16x?2?\.f16|cvt\.bf16\.f16",
                                           compiled.asm["ptx"])),
        "tile_allocs": re.findall(r"ttg\.local_alloc %\S+ : \(tensor<(\d+x\d+x\w+)", loop),
        "k_widths": sorted(set(re.findall(r"kWidth = (\d+)", loop))),
    }


def _compiled(fp8_fp16: bool) -> dict[str, object]:
    """:func:`sm90_fp8_decode_code` in a subprocess: the test process may interpret Triton
    kernels (``TRITON_INTERPRET=1``), which compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    code = ("import json, sys, test_mla_decode_fp8 as t; "
            "print(json.dumps(t.sm90_fp8_decode_code(sys.argv[1] == 'on')))")
    proc = subprocess.run([sys.executable, "-c", code, "on" if fp8_fp16 else "off"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.compile
def test_compiled_for_sm90_the_fp8_tile_is_converted_once() -> None:
    """sm_90a: with ``fp8_fp16`` the latent tile is stored to shared memory once, as one fp16
    tile the score and value dots both read (16-bit operand layouts, ``kWidth`` 2), and nothing
    converts fp16 to bf16; without it the loop converts to bf16 and lays the dots out for 8-bit
    data. Fails if a Triton release stops honouring the opaque move the path relies on."""
    pytest.importorskip("triton.backends.nvidia")
    on = _compiled(True)
    assert on["bf16_conversions"] == 0, on
    assert on["tile_allocs"].count("64x512xf16") == 1, on
    assert on["k_widths"] == ["2"], on
    off = _compiled(False)
    assert off["bf16_conversions"] > 0 and "4" in off["k_widths"], off


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_fp16_real_size_on_the_gpu(heads: int, cache_dtype: torch.dtype) -> None:
    """DeepSeek sizes (latent 512 + rope 64, pages of 64, bf16 queries, B4 x 1024 tokens, one
    request ending inside a page) on an fp8 cache with a tensor scale, the table's tile for
    the head count with ``fp8_fp16`` on: the float64 reference within bf16 tolerance, and the
    tile with it off."""
    q, cache, table, seq_lens = real_size_decode_case(
        generator("mla-decode-fp8-fp16-gpu", heads, cache_dtype))
    q = q[:, :heads].contiguous()
    scale = torch.tensor([0.25], device=DEVICE)
    fp8 = (cache.float() / 0.25).to(cache_dtype)
    row = configs.mla_decode_config(heads, configs.gpu_family(DEVICE), page_size=cache.shape[1],
                                    fp8_cache=True)
    on = dataclasses.replace(row, fp8_fp16=True)
    o, lse = run_decode(q, fp8, table, seq_lens, 4, on, rank=REAL_RANK, scale=REAL_SCALE,
                        k_scale=scale, v_scale=scale)
    assert_decode_close(o, lse, q, fp8.double() * 0.25, table, seq_lens, torch.bfloat16,
                        rank=REAL_RANK, scale=REAL_SCALE)
    off = run_decode(q, fp8, table, seq_lens, 4, dataclasses.replace(row, fp8_fp16=False),
                     rank=REAL_RANK, scale=REAL_SCALE, k_scale=scale, v_scale=scale)
    assert_close(o, off[0].double(), torch.bfloat16, "o vs fp8_fp16=False")
