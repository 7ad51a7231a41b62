"""The MLA decode kernel ``"triton_mla_decode_tma_keysplit"``: tiles through tensor
descriptors and the warpgroups sharing the score tile by keys instead of both computing it
(module docstring of ``kvcore_mla.ops.triton_mla_decode``). Same results as the float64
reference and as ``"triton_mla_decode"`` (pointer loads, head-row scores) of the same tile,
fp8, cross-layer views; compiled for sm90, the score dots really get the key-split layout; real
size on a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mla_helpers import (
    REAL_RANK,
    REAL_SCALE,
    assert_close,
    assert_decode_close,
    cross_layer_view,
    decode_case,
    generator,
    real_size_decode_case,
    run_decode,
)

kernels = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
configs = pytest.importorskip("kvcore_mla.ops.mla_configs")

LENS = [0, 1, 17, 64, 130]  # empty, one token, a partial tile, whole pages, several pages


def _key_split(block_h: int, block_n: int, **tile):
    return configs.TritonMLATMAKeySplitConfig(block_h=block_h, block_n=block_n,
                                              **{"num_warps": 4, "num_stages": 2, **tile})


def _default_layout(config):
    """``config``'s tile on ``"triton_mla_decode"`` (pointer loads, head-row scores)."""
    return configs.TritonMLADecodeConfig(block_h=config.block_h, block_n=config.block_n,
                                         num_warps=config.num_warps,
                                         num_stages=config.num_stages)


# Head groupings beside each other (the interpreter runs every one as the same float32
# operations; the GPU tests compile them).
@pytest.mark.parametrize(("heads", "block_h", "block_n", "page", "splits"), [
    (16, 16, 16, 16, 1),
    (64, 64, 32, 64, 3),   # one 64-head group (the production shape, scaled down)
    (64, 32, 16, 32, 2),   # two head groups
], ids=["h16", "h64-group64", "h64-group32"])
def test_key_split_scores_match_float64_reference_and_default_layout(
        heads, block_h, block_n, page, splits) -> None:
    gen = generator("mla-decode-keysplit", heads, block_h, block_n, page, splits)
    q, cache, table, lens = decode_case(gen, heads, page, LENS)
    config = _key_split(block_h, block_n)
    o, lse = run_decode(q, cache, table, lens, splits, config)
    assert_decode_close(o, lse, q, cache, table, lens, torch.float32)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[0]).all()
    # Scaling each score part before the sum rounds differently: close, not bit-exact.
    default = run_decode(q, cache, table, lens, splits, _default_layout(config))
    assert_close(o, default[0].double(), torch.float32, "o vs default layout")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_key_split_scores_low_precision_and_fp8(dtype: torch.dtype) -> None:
    gen = generator("mla-decode-keysplit-dtype", dtype)
    q, cache, table, lens = decode_case(gen, 64, 16, [50, 9, 33], dtype)
    o, lse = run_decode(q, cache, table, lens, 2, _key_split(64, 16))
    assert_decode_close(o, lse, q, cache, table, lens, dtype)
    fp8 = cache.to(torch.float8_e4m3fn)
    o, lse = run_decode(q, fp8, table, lens, 2, _key_split(64, 16), k_scale=0.5, v_scale=0.5)
    assert_decode_close(o, lse, q, fp8.double() * 0.5, table, lens, dtype)


def test_key_split_scores_on_a_cross_layer_view_are_bit_exact() -> None:
    gen = generator("mla-decode-keysplit-xl")
    q, cache, table, lens = decode_case(gen, 64, 32, [70, 5, 33])
    pool, view = cross_layer_view(tuple(cache.shape), 3, 1, torch.float32, gen)
    view.copy_(cache)
    before = pool.clone()
    config = _key_split(64, 32)
    ours = run_decode(q, view, table, lens, 3, config)
    contiguous = run_decode(q, cache, table, lens, 3, config)
    assert all(torch.equal(a, b) for a, b in zip(ours, contiguous, strict=True))
    assert torch.equal(pool, before)  # nothing written into any layer


def sm90_wgmma_layouts(kernel: str) -> list[list[str]]:
    """``[warpsPerCTA, instruction N]`` of every wgmma result layout of the production-size
    decode kernel named ``kernel`` (64 heads, 64 keys, 8 warps, 2 stages) compiled for sm90
    (ahead of time, no GPU needed). Run with ``TRITON_INTERPRET`` unset."""
    from kvcore.testing import compile_launches

    rank, rope, page, heads = 512, 64, 64, 128
    q = torch.empty(2, heads, rank + rope, dtype=torch.bfloat16)
    cache = torch.empty(8, page, 1, rank + rope, dtype=torch.bfloat16)
    o = torch.empty(2, heads, rank, dtype=torch.bfloat16)
    lse = torch.empty(2, heads, dtype=torch.float32)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.full((2,), 200, dtype=torch.int32)
    config = configs.DECODE_CONFIG_TYPES[kernel](block_h=64, block_n=64, num_warps=8,
                                                 num_stages=2)
    (compiled,) = [c for c in compile_launches(
        lambda: kernels.decode_attention_fwd(
            q, cache, cache[..., :rank], o, lse, table, lens,
            torch.empty(2, heads, 1, rank + 1), 1, 0.1, page, is_mla=True, config=config),
        "sm90") if c.kernel == "_mla_decode_kernel"]
    return [list(m) for m in re.findall(
        r"nvidia_mma<\{versionMajor = 3[^}]*warpsPerCTA = \[(\d+, \d+)\], "
        r"instrShape = \[16, (\d+), 16\]", compiled.asm["ttgir"])]


def _compiled_layouts(kernel: str) -> list[list[str]]:
    """:func:`sm90_wgmma_layouts` in a subprocess: the test process may interpret Triton
    kernels (``TRITON_INTERPRET=1``), which compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    code = ("import json, sys, test_mla_decode_score_split as t; "
            "print(json.dumps(t.sm90_wgmma_layouts(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, kernel], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compiled_for_sm90_no_score_is_computed_by_both_warpgroups() -> None:
    """The production 64-head program (8 warps, 64 keys a tile): with head-row scores
    (``"triton_mla_decode"``) the score dots lay all 8 warps along the 64 head rows (both
    warpgroups compute them); with key-split scores every wgmma layout splits its columns
    between the warpgroups. Fails if a Triton release changes the rule the key split relies
    on."""
    pytest.importorskip("triton.backends.nvidia")
    assert any(warps == "8, 1" for warps, _ in _compiled_layouts("triton_mla_decode"))
    key_split = _compiled_layouts("triton_mla_decode_tma_keysplit")
    assert key_split and all(warps == "4, 2" for warps, _ in key_split), key_split


@pytest.mark.gpu
@pytest.mark.parametrize(("tile", "splits"), [
    (dict(block_n=32, num_stages=3), 1),
    (dict(block_n=64, num_stages=2), 4),
], ids=["n32-s3", "n64-s2-splits4"])
def test_key_split_scores_real_size_on_the_gpu(tile: dict, splits: int) -> None:
    """DeepSeek sizes: B4 x 1024 tokens (one request ends inside a page), 128 heads, latent
    512 + rope 64, bf16, pages of 64, 64-head programs of 8 warps; against the float64
    reference and the default layout."""
    q, cache, table, seq_lens = real_size_decode_case(
        generator("mla-decode-keysplit-gpu", tuple(tile.items()), splits))
    rank, scale = REAL_RANK, REAL_SCALE
    key_split = _key_split(64, tile["block_n"], num_warps=8, num_stages=tile["num_stages"])
    o, lse = run_decode(q, cache, table, seq_lens, splits, key_split, rank=rank, scale=scale)
    assert_decode_close(o, lse, q, cache, table, seq_lens, torch.bfloat16, rank=rank,
                        scale=scale)
    default = run_decode(q, cache, table, seq_lens, splits, _default_layout(key_split),
                         rank=rank, scale=scale)
    assert_close(o, default[0].double(), torch.bfloat16, "o vs default layout")
