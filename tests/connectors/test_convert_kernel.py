"""The conversion gather kernel (kvcore.ops.triton_convert) against the pure-torch gather of
ConversionPlan.apply, bit for bit, bytes outside the destination blocks untouched. On a CPU
the kernel runs under the Triton interpreter: small shapes, the property tests in the
``triton`` group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_convert import (
    BLOCK_SIZES,
    FP8,
    KV_CASES,
    MLA_ORDERS,
    NUM_LAYERS,
    TP_CASES,
    make_layout,
    noise,
    pick_ids,
)

import kvcore
from kvcore.connectors.convert import LayoutConversionError, TPRank, heads_of_rank, plan_conversion
from kvcore.ops import triton_available, triton_convert_blocks

pytestmark = pytest.mark.skipif(not triton_available()[0], reason="needs triton")

NHD, HND = (0, 1, 2, 3, 4), (0, 1, 3, 2, 4)
#: Where the kernel runs: compiled on a GPU, else interpreted on the CPU (TRITON_INTERPRET=1,
#: set by the test setup without a GPU).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def both_ways(plan, src, dst, src_ids, dst_ids, num_tokens, scales=None):
    """Apply ``plan`` with the torch gather and with the kernel onto copies of ``dst``;
    assert equal bytes, the source unchanged, and only destination blocks written."""
    kw = {"dst_scales": scales} if plan.dtype_op == "quantize" else {}
    before = src.clone()
    expected, got = dst.clone(), dst.to(KERNEL_DEVICE, copy=True)
    plan.apply(src, expected, src_ids, dst_ids, num_tokens, kernel="torch", **kw)
    plan.apply(src.to(KERNEL_DEVICE), got, src_ids, dst_ids, num_tokens, kernel="triton", **kw)
    got = got.cpu()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(src.view(torch.uint8), before.view(torch.uint8))
    # Outside the destination blocks nothing changed (through the logical view).
    logical = got.view(plan.dst.physical_shape).permute(plan.dst.inverse_stride_order())
    old = dst.view(plan.dst.physical_shape).permute(plan.dst.inverse_stride_order())
    others = [b for b in range(plan.dst.num_blocks) if b not in set(dst_ids)]
    block_dim = plan.dst.block_dim
    idx = torch.tensor(others, dtype=torch.int64)
    assert torch.equal(logical.index_select(block_dim, idx).contiguous().view(torch.uint8),
                       old.index_select(block_dim, idx).contiguous().view(torch.uint8))


def kv_case(orders, bs, cross, tp_case, fp8, num_tokens, seed, src_rank, dst_rank):
    _, tp_s, tp_d, num_heads = tp_case
    gen = torch.Generator().manual_seed(seed)
    src_tp, dst_tp = TPRank(tp_s, src_rank % tp_s), TPRank(tp_d, dst_rank % tp_d)
    need_s, need_d = -(-num_tokens // bs[0]), -(-num_tokens // bs[1])
    src_l = make_layout(orders[0], bs[0], len(heads_of_rank(num_heads, src_tp)), cross[0],
                        num_blocks=need_s + 2)
    dst_l = make_layout(orders[1], bs[1], len(heads_of_rank(num_heads, dst_tp)), cross[1],
                        FP8 if fp8 else torch.bfloat16, num_blocks=need_d + 2)
    try:
        plan = plan_conversion(src_l, dst_l, src_tp=src_tp, dst_tp=dst_tp,
                               num_kv_heads=num_heads, quantize=fp8)
    except LayoutConversionError as exc:
        assert "none of the heads" in str(exc)
        return
    # Quantising needs finite values; a copy moves any bits (NaN patterns included).
    src = (torch.randn(src_l.physical_shape, generator=gen).mul(200).to(torch.bfloat16)
           if fp8 else noise(src_l, gen))
    dst = noise(dst_l, gen)
    scales = torch.rand(NUM_LAYERS, 2, generator=gen) + 0.25
    both_ways(plan, src, dst, pick_ids(gen, need_s, need_s + 2),
              pick_ids(gen, need_d, need_d + 2), num_tokens, scales)


@pytest.mark.parametrize("orders, bs, cross, tp_case, fp8, num_tokens", [
    ((NHD, HND), (16, 64), (False, True), TP_CASES[0], False, 41),
    ((HND, NHD), (64, 16), (True, False), TP_CASES[2], True, 70),
    ((NHD, NHD), (32, 32), (False, False), TP_CASES[3], False, 33),
], ids=["16nhd->64hnd-tp1->2", "64hnd-cross->16nhd-tp4->2-fp8", "tp1->8-2heads"])
def test_kernel_matches_torch_gather_smoke(orders, bs, cross, tp_case, fp8, num_tokens):
    """A few fixed cases in the fast suite (each one launch under the interpreter)."""
    kv_case(orders, bs, cross, tp_case, fp8, num_tokens, 7, 1, 1)


@pytest.mark.triton
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**KV_CASES, num_tokens=st.integers(1, 200),
       ranks=st.tuples(st.integers(0, 7), st.integers(0, 7)))
def test_kernel_matches_torch_gather(bs, orders, cross, tp_case, fp8, num_tokens, seed, ranks):
    kv_case(orders, bs, cross, tp_case, fp8, num_tokens, seed, *ranks)


@pytest.mark.triton
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bs=st.tuples(st.sampled_from(BLOCK_SIZES), st.sampled_from(BLOCK_SIZES)),
    orders=st.tuples(st.sampled_from(MLA_ORDERS), st.sampled_from(MLA_ORDERS)),
    cross=st.tuples(st.booleans(), st.booleans()),
    num_tokens=st.integers(1, 200),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_converts_mla(bs, orders, cross, num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    need_s, need_d = -(-num_tokens // bs[0]), -(-num_tokens // bs[1])
    src_l = make_layout(orders[0], bs[0], None, cross[0], num_blocks=need_s + 2)
    dst_l = make_layout(orders[1], bs[1], None, cross[1], num_blocks=need_d + 2)
    plan = plan_conversion(src_l, dst_l)
    both_ways(plan, noise(src_l, gen), noise(dst_l, gen), pick_ids(gen, need_s, need_s + 2),
              pick_ids(gen, need_d, need_d + 2), num_tokens)


def test_kernel_dequantizes_fp8_to_bf16():
    gen = torch.Generator().manual_seed(3)
    src_l = make_layout(NHD, 16, 2, True, FP8, num_blocks=4)
    dst_l = make_layout(HND, 32, 2, False, num_blocks=3)
    plan = plan_conversion(src_l, dst_l, dequantize=True)
    src = torch.randn(src_l.physical_shape, generator=gen).mul(50).to(FP8)
    dst = noise(dst_l, gen)
    scales = torch.rand(NUM_LAYERS, 2, generator=gen) + 0.25
    expected, got = dst.clone(), dst.to(KERNEL_DEVICE, copy=True)
    plan.apply(src, expected, [3, 0, 1], [2, 0], 40, src_scales=scales, kernel="torch")
    plan.apply(src.to(KERNEL_DEVICE), got, [3, 0, 1], [2, 0], 40, src_scales=scales,
               kernel="triton")
    assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_kernel_refuses_ids_past_the_tensor_and_moves_nothing():
    src = torch.zeros(64, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    dst = torch.ones(64, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    kwargs = {"num_tokens": 4, "src_block_size": 4, "dst_block_size": 4,
              "src_strides": (32, 0, 0, 8, 0, 1), "dst_strides": (32, 0, 0, 8, 0, 1),
              "num_layers": 1, "num_kv": 1, "head_pairs": [(0, 0)], "head_size": 8}
    with pytest.raises(ValueError, match=r"dst_ids address past dst.*too small"):
        triton_convert_blocks(src, dst, [0], [2], **kwargs)
    with pytest.raises(ValueError, match=r"need 1 source and 1 destination block ids"):
        triton_convert_blocks(src, dst, [], [0], **kwargs)
    with pytest.raises(ValueError, match=r"src is on .* and dst on"):
        triton_convert_blocks(src.to("meta"), dst, [0], [0], **kwargs)
    assert bool((dst == 1).all())
    assert triton_convert_blocks(src, dst, [1], [0], **kwargs) == 4 * 8 * 2
    assert bool((dst[:32] == 0).all()) and bool((dst[32:] == 1).all())


def test_repeated_shapes_at_other_addresses_move_words_those_addresses_allow():
    """Prepared gathers of one shape reuse its tiling, but the word the bytes move as
    follows each allocation's address: 8-byte words at an aligned one, narrower ones where
    the allocation starts 2 or 4 bytes past it; each writes the torch gather's bytes. Ids
    that are not ints, or name blocks past the allocation, are refused on every call."""
    plan = plan_conversion(make_layout(NHD, 16, 2, False), make_layout(HND, 32, 2, False))
    gen = torch.Generator().manual_seed(9)
    src = noise(plan.src, gen)
    dst_bytes = plan.dst.total_bytes
    buffer = torch.empty(dst_bytes + 16, dtype=torch.uint8, device=KERNEL_DEVICE)
    for offset, word in ((0, torch.int64), (2, torch.int16), (4, torch.int32), (0, torch.int64)):
        dst = buffer[offset:offset + dst_bytes]
        dst.copy_(noise(plan.dst, gen).view(torch.uint8).reshape(-1))
        expected = dst.cpu().view(plan.dst.dtype).view(plan.dst.physical_shape).clone()
        plan.apply(src, expected, [5, 2, 7], [3, 1], 40, kernel="torch")
        run = plan.prepare(src.to(KERNEL_DEVICE), dst, [5, 2, 7], [3, 1], 40, kernel="triton")
        assert run.args[1].dtype == word
        run()
        assert torch.equal(dst.cpu(), expected.view(torch.uint8).reshape(-1))
    with pytest.raises(TypeError, match=r"src_ids\[1\]=2.0 must be an int"):
        plan.prepare(src.to(KERNEL_DEVICE), dst, [5, 2.0, 7], [3, 1], 40, kernel="triton")
    with pytest.raises(ValueError, match=r"dst_ids contains 8, outside the destination's 8"):
        plan.prepare(src.to(KERNEL_DEVICE), dst, [5, 2, 7], [3, 8], 40, kernel="triton")


#: Tilings of the gather kernel: each must write the same bytes as the torch gather.
GATHER_CONFIGS = {
    "default": None,
    "per-token lookup": {"block_aligned": False},
    "one head, tiny tiles": {"tile_bytes": 64, "max_heads": 1, "num_warps": 1},
    "two heads, evict first": {"tile_bytes": 256, "max_heads": 2, "num_warps": 2,
                               "evict_first": True},
}
DH_ORDER = (0, 1, 2, 4, 3)  # D outside H: the head's elements are strided


def layout_of(order, block_size, heads, head_size, cross, dtype=torch.bfloat16, num_blocks=8):
    """A K/V layout with ``heads`` heads of ``head_size`` (test_convert's ``make_layout``
    with any head size)."""
    full = (1, 0, *(d + 1 for d in order if d)) if cross else (0, *(d + 1 for d in order))
    return kvcore.KVCacheLayout((NUM_LAYERS, num_blocks, 2, block_size, heads, head_size), full,
                                ("L", "B", "2", "N", "H", "D"), dtype)


@pytest.mark.parametrize("config", list(GATHER_CONFIGS), ids=list(GATHER_CONFIGS))
@pytest.mark.parametrize("orders, bs, heads, head_size, cross, fp8, num_tokens", [
    ((NHD, HND), (16, 64), 3, 8, (False, True), False, 70),
    ((HND, NHD), (64, 16), 2, 6, (True, False), False, 41),
    ((NHD, HND), (12, 24), 2, 8, (False, False), False, 50),
    ((DH_ORDER, HND), (16, 32), 2, 8, (False, True), False, 37),
    ((NHD, DH_ORDER), (32, 16), 3, 8, (True, True), True, 45),
], ids=["3-heads", "head-6-elements", "block-12->24", "strided-head", "strided-head-fp8"])
def test_every_tiling_matches_torch_gather(monkeypatch, config, orders, bs, heads, head_size,
                                           cross, fp8, num_tokens):
    """Odd head counts and sizes, block sizes whose tiles cannot align, strided heads, fp8:
    bit for bit under every tiling (one launch each)."""
    from kvcore.ops import triton_convert

    if GATHER_CONFIGS[config] is not None:
        monkeypatch.setattr(triton_convert, "DEFAULT_GATHER_CONFIG",
                            triton_convert.GatherConfig(**GATHER_CONFIGS[config]))
    gen = torch.Generator().manual_seed(num_tokens)
    need_s, need_d = -(-num_tokens // bs[0]), -(-num_tokens // bs[1])
    src_l = layout_of(orders[0], bs[0], heads, head_size, cross[0], num_blocks=need_s + 2)
    dst_l = layout_of(orders[1], bs[1], heads, head_size, cross[1],
                      FP8 if fp8 else torch.bfloat16, num_blocks=need_d + 2)
    plan = plan_conversion(src_l, dst_l, quantize=fp8)
    src = (torch.randn(src_l.physical_shape, generator=gen).mul(200).to(torch.bfloat16)
           if fp8 else noise(src_l, gen))
    both_ways(plan, src, noise(dst_l, gen), pick_ids(gen, need_s, need_s + 2),
              pick_ids(gen, need_d, need_d + 2), num_tokens,
              torch.rand(NUM_LAYERS, 2, generator=gen) + 0.25)


def test_tiles_align_to_blocks_when_the_block_sizes_allow():
    """A tile whose height divides both block sizes looks its blocks up once; 12 -> 24
    (largest common power of two: 4) looks them up per token."""
    from kvcore.ops.triton_convert import GatherConfig, _tile

    config = GatherConfig()
    # 8 heads of 128 bf16 as int64 words: [16 tokens, 8 heads, 32 words] = 32 KiB.
    assert _tile(config, 8, 32, 8, 8192, 16, 64) == (16, 8, 32, True)
    assert _tile(config, 8, 32, 8, 8192, 12, 24)[3] is False
    assert _tile(GatherConfig(max_heads=1), 8, 32, 8, 8192, 64, 64) == (64, 1, 32, True)
    assert _tile(config, 8, 32, 8, 5, 16, 64)[0] == 8  # no taller than the transfer
    with pytest.raises(ValueError, match=r"num_warps=3 must be a power of two"):
        GatherConfig(num_warps=3)
