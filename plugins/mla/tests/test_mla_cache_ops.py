"""The MLA cache writes (latent cache, DeepSeek-V3.2 indexer cache) against their references.

The Triton kernels must match the pure-torch references bit for bit (fp8 bytes included),
and the references must mean what they document (checked against plain arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from kvcore_mla.ops import (
    INDEXER_FP8_MAX,
    concat_and_cache_mla_ref,
    indexer_cache_head_size,
    indexer_k_dequant_ref,
    indexer_k_quant_and_cache_ref,
)
from mla_helpers import DEVICE, generator, randn, random_bytes

from kvcore.ops import fp8_inverse_scale
from kvcore.testing import random_slot_mapping

triton_cache = pytest.importorskip("kvcore_mla.ops.triton_cache")

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _slots(num_tokens: int, num_slots: int, gen: torch.Generator,
           dtype: torch.dtype) -> torch.Tensor:
    return random_slot_mapping(num_tokens, num_slots, gen, dtype).to(DEVICE)


def _latents(num_tokens: int, rank: int, rope: int, dtype: torch.dtype, gen: torch.Generator,
             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_c and k_pe as column slices of one projection output, as models produce them."""
    fused = randn((num_tokens, rank + rope), dtype, gen, scale)
    return fused[:, :rank], fused[:, rank:].unsqueeze(1)


CONCAT_CASES = [
    # (num_tokens, block_size, kv_lora_rank, rope_dim, dtype, slot dtype)
    (37, 16, 64, 16, torch.bfloat16, torch.int64),
    (23, 64, 512, 64, torch.bfloat16, torch.int32),
    (30, 16, 96, 32, torch.float16, torch.int64),
    (19, 32, 64, 16, torch.float32, torch.int32),
]


@pytest.mark.parametrize("case", CONCAT_CASES,
                         ids=lambda c: f"T{c[0]}-bs{c[1]}-L{c[2]}-R{c[3]}-{c[4]}-{c[5]}"
                         .replace("torch.", ""))
def test_concat_and_cache_mla_matches_reference_exactly(case: tuple) -> None:
    num_tokens, block_size, rank, rope, dtype, slot_dtype = case
    gen = generator("concat", case)
    num_blocks = 6
    kv_c, k_pe = _latents(num_tokens, rank, rope, dtype, gen)
    cache = randn((num_blocks, block_size, rank + rope), dtype, gen)
    expected = cache.clone()
    slots = _slots(num_tokens, num_blocks * block_size, gen, slot_dtype)
    triton_cache.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    concat_and_cache_mla_ref(kv_c, k_pe, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_concat_and_cache_mla_fp8_matches_reference_bytes(kv_cache_dtype: str,
                                                          scale_kind: str) -> None:
    gen = generator("concat-fp8", kv_cache_dtype, scale_kind)
    num_tokens, block_size, rank, rope = 41, 16, 64, 16
    # Large values so that some saturate and many round across an exponent boundary.
    kv_c, k_pe = _latents(num_tokens, rank, rope, torch.bfloat16, gen, scale=200.0)
    scale = torch.tensor([0.37], device=DEVICE) if scale_kind == "tensor" else 0.37
    cache = torch.zeros(5, block_size, rank + rope, dtype=FP8[kv_cache_dtype], device=DEVICE)
    expected = cache.clone()
    slots = _slots(num_tokens, 5 * block_size, gen, torch.int64)
    triton_cache.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)
    concat_and_cache_mla_ref(kv_c, k_pe, expected, slots, kv_cache_dtype, scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def _all_finite_bf16() -> torch.Tensor:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x)]


# Every finite bf16 value goes in, so x * (1 / 0.3) overflows float32 to +-inf for |x| above
# ~1e38, and the clamp saturates that to +-448: the definition, and what a GPU does silently
# (IEEE overflow). The interpreter runs the kernel on numpy, which warns on that overflow.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_fp8_quantisation_multiplies_by_the_float32_reciprocal(scale_kind: str) -> None:
    """The one fp8 definition: ``fp8_rne(clamp(x * float32(1 / float32(scale))))``.

    That is what torch computes on CUDA for ``x.float() / scale`` (a CPU scalar divisor becomes
    a reciprocal multiply) and not what a true division gives: with scale 0.3 the bf16 value
    9 * 2**-11 lands on an e4m3 rounding tie (7.5 subnormal quanta) only through the reciprocal,
    so the kernel and the reference must agree on this one definition (a kernel that divided
    gave other bytes than torch, which multiplied, on a GPU).
    """
    x = _all_finite_bf16()
    n = x.numel()
    rank, rope, block_size = 64, 16, 64
    entry = rank + rope
    pad = (-n) % entry
    x = torch.cat([x, torch.zeros(pad, dtype=torch.bfloat16)]).view(-1, entry)
    kv_c, k_pe = x[:, :rank], x[:, rank:]
    num_tokens = x.shape[0]
    num_blocks = -(-num_tokens // block_size)
    scale = torch.tensor([0.3], device=DEVICE) if scale_kind == "tensor" else 0.3
    slots = torch.arange(num_tokens, device=DEVICE)
    cache = torch.zeros(num_blocks, block_size, entry, dtype=torch.float8_e4m3fn, device=DEVICE)
    expected = cache.clone()
    concat_and_cache_mla_ref(kv_c.to(DEVICE), k_pe.to(DEVICE), expected, slots, "fp8", scale)
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(0.3, dtype=torch.float32)
    assert fp8_inverse_scale(0.3) == inv.item()
    by_hand = (x.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = expected.view(-1, entry)[:num_tokens].cpu()
    assert torch.equal(got.view(torch.uint8), by_hand.view(torch.uint8))
    divided = (x.float() / torch.tensor(0.3, dtype=torch.float32)).clamp(-448, 448)
    assert not torch.equal(divided.to(torch.float8_e4m3fn).view(torch.uint8),
                           by_hand.view(torch.uint8))  # the definition matters
    tie = torch.tensor([[9 * 2.0**-11]], dtype=torch.bfloat16)
    assert (tie.float() * inv).to(torch.float8_e4m3fn).view(torch.uint8).item() == 8
    # The kernel gives the same bytes (here under the interpreter; on a GPU in test_mla_gpu).
    triton_cache.concat_and_cache_mla(kv_c.to(DEVICE), k_pe.to(DEVICE), cache, slots, "fp8",
                                      scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_indexer_reference_divides_on_every_device() -> None:
    """The indexer's scale is ``amax / 448`` and its keys ``k / scale``, true IEEE divisions
    (not torch-CUDA's reciprocal multiply by a scalar): checked against float64 arithmetic
    rounded once to float32."""
    gen = generator("indexer-div")
    k = randn((64, 128), torch.bfloat16, gen, scale=3.0)
    cache = torch.zeros(4, 16, indexer_cache_head_size(128, 128), dtype=torch.uint8,
                        device=DEVICE)
    indexer_k_quant_and_cache_ref(k, cache, torch.arange(64, device=DEVICE), 128, None)
    rows = cache.view(4, -1).cpu()
    scales = rows[:, 16 * 128:].contiguous().view(torch.float32).reshape(64)
    amax = k.float().abs().amax(dim=1).clamp_min(1e-4).cpu()
    assert torch.equal(scales, (amax.double() / 448.0).float())


def test_concat_reference_stores_the_latent_and_skips_padding() -> None:
    kv_c = torch.arange(6.0).view(2, 3)
    k_pe = torch.tensor([[10.0], [11.0]])
    cache = torch.full((2, 2, 4), -1.0)
    concat_and_cache_mla_ref(kv_c, k_pe, cache, torch.tensor([3, -1]))
    assert cache[1, 1].tolist() == [0.0, 1.0, 2.0, 10.0]
    assert (cache.flatten()[:12] == -1).all()


@pytest.mark.parametrize(("head_dim", "quant_block_size"), [(128, 128), (128, 64)])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_indexer_write_matches_reference_bytes(head_dim: int, quant_block_size: int,
                                               scale_fmt: str | None) -> None:
    gen = generator("indexer", head_dim, quant_block_size, scale_fmt)
    num_tokens, block_size, num_blocks = 45, 16, 5
    k = randn((num_tokens, head_dim), torch.bfloat16, gen, scale=3.0)
    k[0, :quant_block_size] = 0  # an all-zero group gets the minimum scale
    cache = random_bytes((num_blocks, block_size,
                          indexer_cache_head_size(head_dim, quant_block_size)), gen)
    expected = cache.clone()
    slots = _slots(num_tokens, num_blocks * block_size, gen, torch.int64)
    triton_cache.indexer_k_quant_and_cache(k, cache, slots, quant_block_size, scale_fmt)
    indexer_k_quant_and_cache_ref(k, expected, slots, quant_block_size, scale_fmt)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_indexer_reference_round_trips_within_fp8_precision(scale_fmt: str | None) -> None:
    gen = generator("indexer-roundtrip", scale_fmt)
    head_dim, qbs, block_size = 128, 64, 16
    k = randn((40, head_dim), torch.float32, gen, scale=5.0)
    cache = torch.zeros(4, block_size, indexer_cache_head_size(head_dim, qbs),
                        dtype=torch.uint8, device=DEVICE)
    slots = torch.randperm(4 * block_size, generator=gen)[:40].to(DEVICE)
    indexer_k_quant_and_cache_ref(k, cache, slots, qbs, scale_fmt)
    back = indexer_k_dequant_ref(cache, slots, head_dim, qbs)

    groups = k.view(40, head_dim // qbs, qbs)
    amax = groups.abs().amax(-1, keepdim=True)
    rows = cache.view(4, -1)
    scale_cols = (block_size * head_dim + (slots % block_size)[:, None] * (head_dim // qbs) * 4
                  + torch.arange(head_dim // qbs * 4, device=DEVICE))
    scales = rows[(slots // block_size)[:, None], scale_cols].contiguous().view(torch.float32)
    if scale_fmt == "ue8m0":
        assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
        assert (scales[..., None] * INDEXER_FP8_MAX >= amax).all()
    else:
        torch.testing.assert_close(scales[..., None], amax / INDEXER_FP8_MAX)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value (2**-10 of the scale
    # below the normal range).
    bound = groups.abs() * 2.0 ** -4 + scales[..., None] * 2.0 ** -10
    assert ((back.view_as(groups) - groups).abs() <= bound * 1.0001).all()


def test_indexer_rejects_a_cache_whose_blocks_are_not_contiguous() -> None:
    k = torch.randn(3, 128)
    pool = torch.zeros(4, 132, 16, dtype=torch.uint8).transpose(1, 2)  # token stride 1
    with pytest.raises(ValueError, match="each block must be one contiguous run"):
        triton_cache.indexer_k_quant_and_cache(k, pool, torch.tensor([0, 1, 2]))


def _concat_args() -> dict[str, object]:
    return dict(kv_c=torch.randn(4, 64), k_pe=torch.randn(4, 16),
                kv_cache=torch.zeros(2, 16, 80), slot_mapping=torch.tensor([0, 1, 2, 3]),
                kv_cache_dtype="auto", scale=None)


@pytest.mark.parametrize(("change", "message"), [
    ({"kv_cache": torch.zeros(2, 16, 81)}, "kv_cache holds 81 channels per token"),
    ({"k_pe": torch.randn(4, 2, 16)}, "k_pe has shape"),
    ({"slot_mapping": torch.tensor([0, 1, 2])}, "slot_mapping 3"),
    ({"slot_mapping": torch.tensor([0.0, 1, 2, 3])}, "slot_mapping must be int32 or int64"),
    ({"slot_mapping": torch.tensor([0, 1, 2, 32])}, "slot_mapping contains slot 32"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache has dtype torch.float32 but kv_cache_dtype='fp8'"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
    ({"scale": torch.ones(2)}, "scale must be a per-tensor scale"),
])
def test_concat_and_cache_mla_errors_name_the_argument(change: dict, message: str) -> None:
    args = {**_concat_args(), **change}
    for impl in (triton_cache.concat_and_cache_mla, concat_and_cache_mla_ref):
        with pytest.raises((ValueError, TypeError), match=message):
            impl(**args)


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_block_size": 48}, "head_dim=128 must be a multiple of quant_block_size=48"),
    ({"scale_fmt": "e8m0"}, "scale_fmt='e8m0'"),
    ({"kv_cache": torch.zeros(2, 16, 132)}, "kv_cache must be uint8"),
    ({"kv_cache": torch.zeros(2, 16, 136, dtype=torch.uint8)}, "kv_cache holds 136 bytes"),
    ({"kv_cache": torch.zeros(2 * 16 * 132 + 1, dtype=torch.uint8)[1:].view(2, 16, 132)},
     "must be multiples of 4 bytes"),
])
def test_indexer_errors_name_the_argument(change: dict, message: str) -> None:
    args = dict(k=torch.randn(2, 128), kv_cache=torch.zeros(2, 16, 132, dtype=torch.uint8),
                slot_mapping=torch.tensor([0, 5]), quant_block_size=128, scale_fmt=None)
    args.update(change)
    for impl in (triton_cache.indexer_k_quant_and_cache, indexer_k_quant_and_cache_ref):
        with pytest.raises((ValueError, TypeError), match=message):
            impl(**args)
