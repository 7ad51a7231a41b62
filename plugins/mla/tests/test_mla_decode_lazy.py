"""The MLA decode kernel's lazy rescaling (``LaunchConfig(lazy_rescale=True)``: a program moves
its running row maxima only when a key tile's maximum exceeds them by more than the threshold)
against the float64 reference and the exact path: the plain and the TMA loops, whole and halved
latents, one and several splits, requests shorter than a tile, random scores and scores that
grow along the keys by several thresholds (the rescale taken mid-loop and skipped in between,
both checked on the reference), 16-bit dtypes, an fp8 cache; and real-size GPU cases
(``gpu``, skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch
from mla_helpers import (
    DECODE_RANK,
    DEVICE,
    assert_close,
    block_tables,
    decode_case,
    decode_reference,
    generator,
    randn,
    run_decode,
)

kernels = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")

RANK = DECODE_RANK
TAU = kernels._LAZY_RESCALE_TAU
SCALE = 0.1  # run_decode's softmax scale
# Empty, shorter than a tile of 16, a partial tile, whole pages, several pages and a partial
# last tile.
LENS = [0, 9, 17, 64, 130]
# The growing case's ramp: key j's first rope channel is RAMP * j against a query channel of 1,
# so its score grows by RAMP * SCALE * log2(e) = 0.29 a key in the base-2 domain (4.6 a tile
# of 16), 37 over 130 keys: the running max crosses the threshold every second tile or so.
RAMP = 2.0


def _config(block_h: int, *, lazy: bool = True, tma: bool = False, split_latent: bool = False,
            block_n: int = 16):
    return kernels.LaunchConfig(block_q=1, block_h=block_h, block_n=block_n, num_warps=4,
                                num_stages=2, split_latent=split_latent, tma=tma,
                                lazy_rescale=lazy)


def _case(gen: torch.Generator, scores: str, heads: int, page: int, lens: list[int],
          dtype: torch.dtype = torch.float32):
    """:func:`decode_case`; with ``scores="growing"`` the first rope channel (a key only: the
    values stay random) is ``RAMP * position`` in the cache and 1 in the queries."""
    q, cache, table, seq_lens = decode_case(gen, heads, page, lens, dtype)
    if scores == "growing":
        q[..., RANK] = 1.0
        for i, n in enumerate(lens):
            pos = torch.arange(n, device=DEVICE)
            cache[table[i, pos // page].long(), pos % page, RANK] = (RAMP * pos).to(dtype)
    return q, cache, table, seq_lens


def _lazy_steps(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                seq_lens: torch.Tensor, block_n: int, splits: int) -> tuple[int, int]:
    """Walks each split's key tiles as the lazy kernel does, on the float64 base-2 scores:
    ``(rescales, steps)``, the tiles after a split's first whose maximum exceeds the running
    one by more than the threshold for some head (the branch taken mid-loop), and all tiles
    after a split's first."""
    page = cache.shape[1]
    rescales = steps = 0
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=cache.device)
        keys = cache[table[i, pos // page].long(), pos % page].double()
        s = (q[i].double() @ keys.T) * SCALE * math.log2(math.e)  # (heads, n)
        tiles = -(-n // block_n)
        per_split = -(-tiles // splits) if tiles else 1
        for lo in range(0, tiles, per_split):
            m = s[:, lo * block_n:(lo + 1) * block_n].amax(1)
            for t in range(lo + 1, min(lo + per_split, tiles)):
                tile_max = s[:, t * block_n:(t + 1) * block_n].amax(1)
                steps += 1
                if (tile_max - m).max() > TAU:
                    rescales += 1
                    m = torch.maximum(m, tile_max)
    return rescales, steps


def _check(q, cache, table, seq_lens, splits: int, config, dtype: torch.dtype) -> None:
    """Lazy ``config`` against the float64 reference, and against its exact twin (equal up to
    float rounding, within the dtype's tolerance); an empty request gets 0 and ``-inf``."""
    o, lse = run_decode(q, cache, table, seq_lens, splits, config)
    o_ref, lse_ref = decode_reference(q, cache, table, seq_lens)
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, dtype, "lse")
    exact = run_decode(q, cache, table, seq_lens, splits, _config(
        config.block_h, lazy=False, tma=config.tma, split_latent=config.split_latent,
        block_n=config.block_n))
    assert_close(o, exact[0].double(), dtype, "o vs the exact path")
    assert_close(lse, exact[1].double(), dtype, "lse vs the exact path")
    for i in (seq_lens == 0).nonzero().flatten().tolist():
        assert torch.equal(o[i], torch.zeros_like(o[i])) and torch.isinf(lse[i]).all()


@pytest.mark.parametrize("scores", ["random", "growing"])
@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize(("loop", "page"), [("plain", 32), ("plain", 8), ("tma", 32)],
                         ids=["plain-page32", "plain-tiles-cross-pages", "tma-page32"])
@pytest.mark.parametrize(("heads", "block_h", "split_latent"),
                         [(16, 16, False), (64, 64, True)], ids=["heads16", "heads64-halves"])
def test_lazy_matches_float64_reference_and_exact_path(heads, block_h, split_latent, loop, page,
                                                       splits, scores) -> None:
    gen = generator("mla-decode-lazy", heads, block_h, split_latent, loop, page, splits, scores)
    q, cache, table, seq_lens = _case(gen, scores, heads, page, LENS)
    if scores == "growing":  # the branch is taken after a split's first tile, and skipped
        rescales, steps = _lazy_steps(q, cache, table, seq_lens, 16, splits)
        assert 2 <= rescales < steps, (rescales, steps)
    _check(q, cache, table, seq_lens, splits,
           _config(block_h, tma=loop == "tma", split_latent=split_latent), torch.float32)


@pytest.mark.parametrize("loop", ["plain", "tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lazy_low_precision_within_tolerance(dtype: torch.dtype, loop: str) -> None:
    """Growing scores in 16-bit dtypes: probabilities up to ``2**8`` before the value dot."""
    gen = generator("mla-decode-lazy-dtype", dtype, loop)
    q, cache, table, seq_lens = _case(gen, "growing", 16, 32, [130, 9, 64], dtype)
    assert _lazy_steps(q, cache, table, seq_lens, 16, 2)[0] >= 2
    _check(q, cache, table, seq_lens, 2, _config(16, tma=loop == "tma"), dtype)


def test_lazy_fp8_cache_within_tolerance() -> None:
    """The fp8 scale is folded into the scores before the threshold test."""
    gen = generator("mla-decode-lazy-fp8")
    q, cache, table, seq_lens = _case(gen, "growing", 16, 16, [100, 3, 32], torch.bfloat16)
    fp8 = cache.to(torch.float8_e4m3fn)
    o, lse = run_decode(q, fp8, table, seq_lens, 2, _config(16, split_latent=True),
                        k_scale=0.5, v_scale=0.5)
    o_ref, lse_ref = decode_reference(q, fp8.double() * 0.5, table, seq_lens)
    assert_close(o, o_ref, torch.bfloat16, "o")
    assert_close(lse, lse_ref, torch.bfloat16, "lse")


def test_lazy_rescale_is_off_by_default() -> None:
    config = kernels.LaunchConfig(block_q=1, block_h=16, block_n=16, num_warps=4, num_stages=2)
    assert not config.lazy_rescale
    assert not any(c.lazy_rescale for rows in kernels.MLA_DECODE_CONFIGS.values()
                   for _, c in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("scores", ["random", "growing"])
@pytest.mark.parametrize(("config", "splits"), [
    (dict(block_n=64, num_stages=2, split_latent=True), 1),
    (dict(block_n=64, num_stages=2, split_latent=True, tma=True), 4),
    (dict(block_n=32, num_stages=3, split_latent=True), 4),
    (dict(block_n=32, num_stages=3, split_latent=False, tma=True), 1),
], ids=["n64-s2-halves", "n64-s2-halves-tma-splits4", "n32-s3-halves-splits4", "n32-s3-tma"])
def test_lazy_real_size_on_the_gpu(config: dict, splits: int, scores: str) -> None:
    """DeepSeek sizes on the GPU: B4 x 1024 tokens (one request ends inside a page), 128
    heads, latent 512 + rope 64, bf16, pages of 64, 64-head lazy programs; against the float64
    reference and the exact path."""
    rank, rope, page, lens = 512, 64, 64, [1024, 1024, 1000, 1024]
    gen = generator("mla-decode-lazy-gpu", tuple(config.items()), splits, scores)
    pages = sum(-(-n // page) for n in lens) + 4
    cache = randn((pages, page, rank + rope), torch.bfloat16, gen)
    table = block_tables(lens, page, pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = randn((len(lens), 128, rank + rope), torch.bfloat16, gen)
    scale = (128 + rope) ** -0.5
    if scores == "growing":  # +0.02 a key in the base-2 domain: 21 over 1024 keys
        q[..., rank] = 1.0
        for i, n in enumerate(lens):
            pos = torch.arange(n, device="cuda")
            cache[table[i, pos // page].long(), pos % page, rank] = (0.2 * pos).to(torch.bfloat16)
    lazy = kernels.LaunchConfig(block_q=1, block_h=64, num_warps=8, lazy_rescale=True, **config)
    o, lse = run_decode(q, cache, table, seq_lens, splits, lazy, rank=rank, scale=scale)
    o_ref, lse_ref = decode_reference(q, cache, table, seq_lens, rank=rank, scale=scale)
    assert_close(o, o_ref, torch.bfloat16, "o")
    assert_close(lse, lse_ref, torch.bfloat16, "lse")
    exact = run_decode(q, cache, table, seq_lens, splits,
                       kernels.LaunchConfig(block_q=1, block_h=64, num_warps=8, **config),
                       rank=rank, scale=scale)
    assert_close(o, exact[0].double(), torch.bfloat16, "o vs the exact path")
