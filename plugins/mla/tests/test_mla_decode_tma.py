"""The MLA decode kernel's TMA path (``"triton_mla_decode_tma_keysplit"``: latent tiles
through tensor descriptors) against the float64 reference and against pointer loads: page
sizes 16, 32 and 64, one and several splits, 16 heads and 128 scaled down to 64, stale NaN
bytes past a request's last key, cross-layer views; the refusals of caches and configs it
cannot take; the scoped scratch allocator; and a real-size GPU case (``gpu``, skipped without
one)."""

from __future__ import annotations

import contextvars

import pytest
import torch
from kvcore_mla import TritonMLABackend
from mla_helpers import (
    DECODE_RANK,
    DECODE_ROPE,
    DEVICE,
    REAL_RANK,
    REAL_SCALE,
    assert_close,
    assert_decode_close,
    block_tables,
    cross_layer_view,
    decode_case,
    generator,
    randn,
    real_size_decode_case,
    run_decode,
)

import kvcore

kernels = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
configs = pytest.importorskip("kvcore_mla.ops.mla_configs")
descriptors = pytest.importorskip("kvcore_mla.ops.descriptors")

RANK, ROPE = DECODE_RANK, DECODE_ROPE
# Empty, one token, a partial tile, whole pages, several pages with a partial last tile.
LENS = [0, 1, 17, 64, 130]


def _config(block_h: int, block_n: int, *, tma: bool = True, num_warps: int = 4,
            num_stages: int = 2):
    """The TMA kernel's config, or with ``tma=False`` the same tile on pointer loads."""
    cls = configs.TritonMLATMAKeySplitConfig if tma else configs.TritonMLADecodeConfig
    return cls(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _assert_same_as_default(ours, default, dtype) -> None:
    """The TMA kernel scales each score part before the sum (key-split scores), the pointer
    path after it: the same results within rounding."""
    for a, b, what in zip(ours, default, ("o", "lse"), strict=True):
        assert_close(a, b.double(), dtype, what)


@pytest.mark.parametrize("splits", [1, 4], ids=["splits1", "splits4"])
@pytest.mark.parametrize(("page", "block_n"), [(16, 16), (32, 32), (64, 32)],
                         ids=["page16-n16", "page32-n32", "page64-n32"])
@pytest.mark.parametrize(("heads", "block_h"), [(16, 16), (64, 64)],
                         ids=["heads16", "heads64"])
def test_tma_matches_float64_reference_and_default_path(heads, block_h, page, block_n,
                                                        splits) -> None:
    gen = generator("mla-decode-tma", heads, block_h, page, block_n, splits)
    q, cache, table, lens = decode_case(gen, heads, page, LENS)
    o, lse = run_decode(q, cache, table, lens, splits, _config(block_h, block_n))
    assert_decode_close(o, lse, q, cache, table, lens, torch.float32)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[0]).all()
    default = run_decode(q, cache, table, lens, splits, _config(block_h, block_n, tma=False))
    _assert_same_as_default((o, lse), default, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tma_low_precision_within_tolerance(dtype: torch.dtype) -> None:
    gen = generator("mla-decode-tma-dtype", dtype)
    q, cache, table, lens = decode_case(gen, 16, 32, [50, 9, 33, 64], dtype)
    o, lse = run_decode(q, cache, table, lens, 2, _config(16, 16))
    assert_decode_close(o, lse, q, cache, table, lens, dtype)


def test_tma_fp8_cache_within_tolerance() -> None:
    gen = generator("mla-decode-tma-fp8")
    q, cache, table, lens = decode_case(gen, 16, 16, [40, 3, 32], torch.bfloat16)
    fp8 = cache.to(torch.float8_e4m3fn)
    o, lse = run_decode(q, fp8, table, lens, 2, _config(16, 16), k_scale=0.5, v_scale=0.5)
    assert_decode_close(o, lse, q, fp8.double() * 0.5, table, lens, torch.bfloat16)


def test_tma_rank_not_a_power_of_two() -> None:
    """48 latent channels in a 64-wide tile: the descriptor's width (48) zero-fills the rest,
    and the rope descriptor starts at channel 48."""
    gen = generator("mla-decode-tma-rank48")
    rank, page, lens = 48, 16, [37, 3, 16]
    q, cache, table, seq_lens = decode_case(gen, 16, page, lens, rank=rank)
    o, lse = run_decode(q, cache, table, seq_lens, 2, _config(16, 16), rank=rank)
    assert_decode_close(o, lse, q, cache, table, seq_lens, torch.float32, rank=rank)


@pytest.mark.parametrize("splits", [1, 3])
def test_tma_ignores_stale_nan_bytes_past_the_last_key(splits: int) -> None:
    """Rows of a request's last page past its length hold NaN (stale or never-written cache
    bytes): the unmasked tile loads must not let them into the output."""
    gen = generator("mla-decode-tma-stale", splits)
    page, lens = 32, [17, 45, 1, 64]
    q, cache, table, seq_lens = decode_case(gen, 16, page, lens)
    for i, n in enumerate(lens):
        last = table[i, (n - 1) // page]
        cache[last, (n - 1) % page + 1:] = float("nan")
    o, lse = run_decode(q, cache, table, seq_lens, splits, _config(16, 16))
    assert_decode_close(o, lse, q, torch.nan_to_num(cache, nan=0.0), table, seq_lens,
                        torch.float32)


def test_tma_on_a_cross_layer_view_is_bit_exact() -> None:
    """A layer of a cross-layer pool (page stride 3 pages): the descriptor's rows step a page
    every ``3 * page_size`` rows; same bits as the contiguous cache, the pool untouched."""
    gen = generator("mla-decode-tma-xl")
    q, cache, table, lens = decode_case(gen, 16, 16, [70, 5, 33])
    pool, view = cross_layer_view(tuple(cache.shape), 3, 1, torch.float32, gen)
    view.copy_(cache)
    before = pool.clone()
    config = _config(16, 16)
    ours = run_decode(q, view, table, lens, 3, config)
    contiguous = run_decode(q, cache, table, lens, 3, config)
    assert view.stride(0) == 3 * cache.stride(0)
    assert all(torch.equal(a, b) for a, b in zip(ours, contiguous, strict=True))
    assert torch.equal(pool, before)


def _refused(cache, config, match: str, rank: int = RANK) -> None:
    """The call raises ValueError matching ``match`` before any kernel writes its outputs."""
    gen = generator("mla-decode-tma-refusal", match)
    lens = [5, 20]
    table = block_tables(lens, cache.shape[1], cache.shape[0], gen)
    q = randn((2, 16, cache.shape[2]), torch.float32, gen)
    o = torch.full((2, 16, rank), float("nan"), device=DEVICE)
    lse = torch.full((2, 16), float("nan"), device=DEVICE)
    logits = torch.full((2, 16, 2, rank + 1), float("nan"), device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        kernels.decode_attention_fwd(q, cache, cache[..., :rank], o, lse, table, seq_lens,
                                     logits, 2, 0.1, cache.shape[1], True, config=config)
    assert o.isnan().all() and lse.isnan().all() and logits.isnan().all()


def test_tma_refuses_a_tile_larger_than_the_page() -> None:
    cache = randn((8, 16, RANK + ROPE), torch.float32, generator("tma-page"))
    _refused(cache, _config(16, 32), r"block_n=32 does not divide the cache's page size 16: "
                                     r"the TMA kernel loads tiles that lie in one page \(use a "
                                     r"block_n that divides the page size, or a pointer-load "
                                     r"config")


def test_tma_refuses_a_cache_with_strided_channels() -> None:
    wide = randn((8, 16, 2 * (RANK + ROPE)), torch.float32, generator("tma-stride"))
    _refused(wide[..., ::2], _config(16, 16), r"kv_cache has last stride 2; the TMA kernel needs "
                                              r"contiguous channels \(stride 1\)")


def test_tma_refuses_an_unaligned_base_address() -> None:
    flat = randn((8 * 16 * (RANK + ROPE) + 1,), torch.float32, generator("tma-base"))
    cache = flat[1:].view(8, 16, RANK + ROPE)  # 4 bytes past an aligned address
    _refused(cache, _config(16, 16), r"kv_cache's base address 0x[0-9a-f]+ is not a multiple "
                                     r"of 16 bytes, as tensor descriptors \(TMA\) need: use a "
                                     r"16-byte aligned cache, or a pointer-load config")


def test_tma_refuses_an_unaligned_token_stride() -> None:
    padded = randn((8, 16, RANK + ROPE + 1), torch.float32, generator("tma-token"))
    _refused(padded[..., :RANK + ROPE], _config(16, 16),
             r"kv_cache's token stride \(81 x 4 bytes\) is not a multiple of 16 bytes")


def test_tma_refuses_a_page_stride_that_is_not_whole_tokens() -> None:
    width, page = RANK + ROPE, 16
    storage = randn((8 * (page * width + 4),), torch.float32, generator("tma-page-stride"))
    cache = storage.as_strided((8, page, width), (page * width + 4, width, 1))
    _refused(cache, _config(16, 16), r"kv_cache's page stride 1284 is not a multiple of its "
                                     r"token stride 80; the TMA kernel addresses the cache as rows")


def test_tma_refuses_a_triton_without_tensor_descriptors(monkeypatch) -> None:
    monkeypatch.delattr(descriptors.tl, "make_tensor_descriptor")
    cache = randn((8, 16, RANK + ROPE), torch.float32, generator("tma-triton"))
    _refused(cache, _config(16, 16), r"the kernel triton_mla_decode_tma_keysplit needs "
                                     r"tl.make_tensor_descriptor \(Triton 3.4 or newer\); "
                                     r"Triton \S+ lacks it: upgrade Triton or use a "
                                     r"pointer-load config")


def _current_allocator():
    from triton.runtime import _allocation

    return _allocation._allocator.get()


def test_the_scratch_allocator_is_scoped_to_the_launch() -> None:
    """Without an allocator of the caller's, the launch sees a torch one that allocates on the
    device, and it is gone afterwards; a caller's own allocator is kept as it is."""
    import triton

    def check() -> list:
        seen = []
        before = type(_current_allocator())
        descriptors.with_scratch_allocator(torch.device("cpu"),
                                           lambda: seen.append(_current_allocator()))
        assert type(_current_allocator()) is before  # nothing leaks out of the launch
        return seen

    (ours,) = contextvars.copy_context().run(check)
    assert type(_current_allocator()).__name__ == "NullAllocator"
    buffer = ours(256, 128, None)
    assert buffer.numel() == 256 and buffer.device.type == "cpu"

    def users(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    def with_user_allocator() -> list:
        triton.set_allocator(users)
        return check()

    assert contextvars.copy_context().run(with_user_allocator) == [users]


def test_the_builder_refuses_a_tma_config_whose_tiles_cross_pages() -> None:
    """At construction, not at the first decode step."""
    spec = kvcore.MLAAttentionSpec(block_size=16, dtype=torch.float32, kv_lora_rank=RANK,
                                   qk_rope_head_dim=ROPE)
    args = dict(num_heads=16, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                device=DEVICE)
    builder_cls = TritonMLABackend.get_builder_cls()
    with pytest.raises(ValueError, match=r"decode_config.block_n=32 does not divide the block "
                                         r"size 16: the kernel triton_mla_decode_tma_keysplit "
                                         r"loads tiles that lie in one page"):
        builder_cls(spec, **args, decode_config=_config(16, 32))
    assert builder_cls(spec, **args, decode_config=_config(16, 16)).decode_config.uses_tma


@pytest.mark.gpu
@pytest.mark.parametrize(("config", "splits"), [
    (dict(block_n=64, num_stages=2), 1),
    (dict(block_n=64, num_stages=2), 4),
    (dict(block_n=32, num_stages=4), 1),
    (dict(block_n=32, num_stages=3), 4),
], ids=["n64-s2", "n64-s2-splits4", "n32-s4", "n32-s3-splits4"])
def test_tma_real_size_on_the_gpu(config: dict, splits: int) -> None:
    """DeepSeek sizes on the GPU: B4 x 1024 tokens (ragged: one request ends inside a page),
    128 heads, latent 512 + rope 64, bf16, pages of 64, 64-head TMA programs; against the
    float64 reference and the default path; the scratch allocator set for the launch only."""
    q, cache, table, seq_lens = real_size_decode_case(
        generator("mla-decode-tma-gpu", tuple(config.items()), splits))
    rank, scale = REAL_RANK, REAL_SCALE
    tma_config = _config(64, num_warps=8, **config)
    allocator = _current_allocator()
    o, lse = run_decode(q, cache, table, seq_lens, splits, tma_config, rank=rank, scale=scale)
    torch.cuda.synchronize()
    assert _current_allocator() is allocator  # the launch's own allocator did not outlive it
    assert_decode_close(o, lse, q, cache, table, seq_lens, torch.bfloat16, rank=rank,
                        scale=scale)
    default = run_decode(q, cache, table, seq_lens, splits,
                      _config(64, num_warps=8, tma=False, **config),
                      rank=rank, scale=scale)
    assert_close(o, default[0].double(), torch.bfloat16, "o vs default path")
