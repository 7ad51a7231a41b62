"""Layout conversion plans (kvcore.connectors.convert) against a reference conversion through
the logical (layer, K/V, token, head, dim) view, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcore
from kvcore.connectors.convert import (
    LayoutConversionError,
    TPRank,
    block_rows_layout,
    heads_of_rank,
    plan_conversion,
)
from kvcore.connectors.tp import reader_ranks, source_ranks
from kvcore.ops import quantize_to_cache
from kvcore.registry import backend_registry

NUM_LAYERS, HEAD_SIZE = 2, 8
BLOCK_SIZES = (16, 32, 64, 128)
FP8 = torch.float8_e4m3fn


def _registered_orders(mla: bool) -> list[tuple[int, ...]]:
    """Every per-layer stride order a registered backend declares."""
    orders = set()
    for name in backend_registry().names():
        try:
            cls = kvcore.resolve_backend(name)
        except Exception:  # a plugin that cannot load here declares nothing
            continue
        if bool(getattr(cls, "IS_MLA", False)) == mla:
            orders.add(tuple(cls.get_kv_cache_stride_order(False)))
    return sorted(orders)


KV_ORDERS = _registered_orders(mla=False)
# Registered MLA backends all declare B,N,D; B,D,N exercises a head dim that is not innermost.
MLA_ORDERS = [*_registered_orders(mla=True), (0, 2, 1)]
#: (name, source TP degree, destination TP degree, num_kv_heads)
TP_CASES = [("tp1->2", 1, 2, 4), ("tp2->1", 2, 1, 4), ("tp4->2", 4, 2, 4),
            ("tp1->8 (2 heads)", 1, 8, 2)]


def test_registered_orders_cover_nhd_hnd_and_interleaved():
    assert {(0, 1, 2, 3, 4), (0, 1, 3, 2, 4), (0, 2, 1, 3, 4)} <= set(KV_ORDERS)
    assert (0, 1, 2) in MLA_ORDERS


def make_layout(order: tuple[int, ...], block_size: int, heads: int | None, cross: bool,
                dtype: torch.dtype = torch.bfloat16, num_blocks: int = 8
                ) -> kvcore.KVCacheLayout:
    """A layout with layers, per-layer order ``order``; ``heads=None``: MLA."""
    if heads is None:
        shape, names = (NUM_LAYERS, num_blocks, block_size, HEAD_SIZE), ("L", "B", "N", "D")
    else:
        shape = (NUM_LAYERS, num_blocks, 2, block_size, heads, HEAD_SIZE)
        names = ("L", "B", "2", "N", "H", "D")
    full = (1, 0, *(d + 1 for d in order if d)) if cross else (0, *(d + 1 for d in order))
    return kvcore.KVCacheLayout(shape, full, names, dtype)


def logical(storage: torch.Tensor, layout: kvcore.KVCacheLayout) -> torch.Tensor:
    return storage.view(layout.physical_shape).permute(layout.inverse_stride_order())


def noise(layout: kvcore.KVCacheLayout, gen: torch.Generator) -> torch.Tensor:
    """A physical allocation of ``layout`` full of random bits (fp8 NaNs included)."""
    nbytes = layout.total_bytes
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(layout.dtype).view(layout.physical_shape)


def write_tokens(storage: torch.Tensor, layout: kvcore.KVCacheLayout, ids: list[int],
                 tokens: torch.Tensor) -> None:
    """Reference write: ``tokens`` ``(L, [2,] T, [H,] D)`` into blocks ``ids`` in order."""
    view = logical(storage, layout)
    bs = layout.layer_shape[layout.layer_dim_names.index("N")]
    mla = "2" not in layout.dim_names
    num_tokens = tokens.shape[1 if mla else 2]
    for j, block in enumerate(ids):
        t0, t1 = j * bs, min(num_tokens, (j + 1) * bs)
        if mla:
            view[:, block, :t1 - t0] = tokens[:, t0:t1]
        else:
            view[:, block, :, :t1 - t0] = tokens[:, :, t0:t1]


def pick_ids(gen: torch.Generator, count: int, pool: int) -> list[int]:
    return torch.randperm(pool, generator=gen)[:count].tolist()


def quantized(values: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor) -> torch.Tensor:
    """Reference quantisation of ``(L, 2, ...)`` values, one scale per layer and K/V."""
    out = torch.empty(values.shape, dtype=dtype)
    for layer in range(values.shape[0]):
        for kv in range(values.shape[1]):
            out[layer, kv] = quantize_to_cache(values[layer, kv], dtype,
                                               float(scales[layer, kv]))
    return out


@pytest.mark.parametrize(("num_heads", "src", "dst"), [(8, 1, 2), (8, 2, 1), (8, 4, 2), (2, 1, 8),
                                                     (2, 4, 1), (1, 2, 4), (4, 2, 8)])
def test_source_and_reader_ranks_are_the_plans_choice_seen_from_each_side(num_heads, src, dst):
    """source_ranks is what each destination rank's plans list; reader_ranks inverts it (a
    producer rank's readers), every destination rank reading each of its heads once."""
    readers = {s: reader_ranks(num_heads, TPRank(src, s), dst) for s in range(src)}
    for d in range(dst):
        ranks = source_ranks(num_heads, TPRank(dst, d), src)
        assert ranks == tuple(s for s in range(src) if d in readers[s])
        heads = [h for s in ranks for h in heads_of_rank(num_heads, TPRank(src, s))]
        assert set(heads_of_rank(num_heads, TPRank(dst, d))) <= set(heads)
        layouts = [make_layout((0, 1, 2, 3, 4), 16, len(heads_of_rank(num_heads, t)), False)
                   for t in (TPRank(src, ranks[0]), TPRank(dst, d))]
        plan = plan_conversion(*layouts, src_tp=TPRank(src, ranks[0]), dst_tp=TPRank(dst, d),
                               num_kv_heads=num_heads)
        assert plan.source_ranks == ranks


#: Hypothesis strategies of a K/V conversion case: block sizes, per-layer orders and
#: cross-layer flags (source, destination), a TP case, fp8 destination, a seed.
KV_CASES = {
    "bs": st.tuples(st.sampled_from(BLOCK_SIZES), st.sampled_from(BLOCK_SIZES)),
    "orders": st.tuples(st.sampled_from(KV_ORDERS), st.sampled_from(KV_ORDERS)),
    "cross": st.tuples(st.booleans(), st.booleans()),
    "tp_case": st.sampled_from(TP_CASES),
    "fp8": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**KV_CASES, num_tokens=st.integers(1, 300), data=st.data())
def test_kv_conversion_matches_reference(bs, orders, cross, tp_case, fp8, num_tokens, seed,
                                         data):
    _, tp_s, tp_d, num_heads = tp_case
    dst_rank = data.draw(st.integers(0, tp_d - 1), label="dst_rank")
    gen = torch.Generator().manual_seed(seed)
    dst_tp = TPRank(tp_d, dst_rank)
    dst_heads = heads_of_rank(num_heads, dst_tp)
    dst_dtype = FP8 if fp8 else torch.bfloat16
    need_s, need_d = -(-num_tokens // bs[0]), -(-num_tokens // bs[1])
    dst_layout = make_layout(orders[1], bs[1], len(dst_heads), cross[1], dst_dtype,
                             num_blocks=need_d + 3)
    values = torch.randn(NUM_LAYERS, 2, num_tokens, num_heads, HEAD_SIZE,
                         generator=gen).to(torch.bfloat16)
    scales = torch.rand(NUM_LAYERS, 2, generator=gen) + 0.25
    dst = noise(dst_layout, gen)
    expected = dst.clone()
    dst_ids = pick_ids(gen, need_d, need_d + 3)
    want = values[:, :, :, list(dst_heads)]
    write_tokens(expected, dst_layout, dst_ids, quantized(want, FP8, scales) if fp8 else want)

    used_ranks = []
    for src_rank in range(tp_s):
        src_tp = TPRank(tp_s, src_rank)
        src_heads = heads_of_rank(num_heads, src_tp)
        src_layout = make_layout(orders[0], bs[0], len(src_heads), cross[0],
                                 num_blocks=need_s + 2)
        try:
            plan = plan_conversion(src_layout, dst_layout, src_tp=src_tp, dst_tp=dst_tp,
                                   num_kv_heads=num_heads, quantize=fp8)
        except LayoutConversionError as exc:
            assert "none of the heads" in str(exc)
            continue
        used_ranks.append(src_rank)
        src = noise(src_layout, gen)
        src_ids = pick_ids(gen, need_s, need_s + 2)
        write_tokens(src, src_layout, src_ids, values[:, :, :, list(src_heads)])
        before = src.clone()
        plan.apply(src, dst, src_ids, dst_ids, num_tokens, dst_scales=scales)
        assert torch.equal(src.view(torch.uint8), before.view(torch.uint8))
    assert set(plan.source_ranks) <= set(used_ranks)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(
    bs=st.tuples(st.sampled_from(BLOCK_SIZES), st.sampled_from(BLOCK_SIZES)),
    orders=st.tuples(st.sampled_from(MLA_ORDERS), st.sampled_from(MLA_ORDERS)),
    cross=st.tuples(st.booleans(), st.booleans()),
    ranks=st.tuples(st.integers(0, 3), st.integers(0, 1)),
    num_tokens=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_conversion_matches_reference(bs, orders, cross, ranks, num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    need_s, need_d = -(-num_tokens // bs[0]), -(-num_tokens // bs[1])
    src_layout = make_layout(orders[0], bs[0], None, cross[0], num_blocks=need_s + 2)
    dst_layout = make_layout(orders[1], bs[1], None, cross[1], num_blocks=need_d + 2)
    # Latents are replicated: any source rank gives all of them, TP degrees aside.
    plan = plan_conversion(src_layout, dst_layout, src_tp=TPRank(4, ranks[0]),
                           dst_tp=TPRank(2, ranks[1]))
    values = torch.randn(NUM_LAYERS, num_tokens, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    src, dst = noise(src_layout, gen), noise(dst_layout, gen)
    src_ids, dst_ids = pick_ids(gen, need_s, need_s + 2), pick_ids(gen, need_d, need_d + 2)
    write_tokens(src, src_layout, src_ids, values)
    expected = dst.clone()
    write_tokens(expected, dst_layout, dst_ids, values)
    plan.apply(src, dst, src_ids, dst_ids, num_tokens)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("num_tokens", [48, 41], ids=["whole-blocks", "partial-last-block"])
def test_same_layout_copies_blocks_exactly(num_tokens):
    gen = torch.Generator().manual_seed(1)
    layout = make_layout((0, 1, 2, 3, 4), 16, 2, False, num_blocks=6)
    plan = plan_conversion(layout, layout)
    assert plan.is_identity and "none: the layouts match" in str(plan)
    values = torch.randn(NUM_LAYERS, 2, num_tokens, 2, HEAD_SIZE, generator=gen)
    src, dst = noise(layout, gen), noise(layout, gen)
    write_tokens(src, layout, [1, 2, 5], values.to(torch.bfloat16))
    expected = dst.clone()
    write_tokens(expected, layout, [3, 4, 0], values.to(torch.bfloat16))
    plan.apply(src, dst, [1, 2, 5], [3, 4, 0], num_tokens)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_packed_block_rows_convert_like_the_cache():
    """Rows as connectors move them (block_rows_layout) convert like the cache they came
    from."""
    gen = torch.Generator().manual_seed(2)
    src_layout = make_layout((0, 1, 2, 3, 4), 16, 2, False, num_blocks=5)
    dst_layout = make_layout((0, 1, 3, 2, 4), 32, 2, True, num_blocks=4)
    src = noise(src_layout, gen)
    rows_layout = block_rows_layout(src_layout, num_blocks=3)
    assert str(rows_layout) == "B,L,2,N,H,D"
    kv = kvcore.KVCaches(list(logical(src, src_layout).unbind(0)), src, src_layout, "X")
    rows = torch.stack([kv.block_view(layer)[[4, 0, 2]] for layer in range(NUM_LAYERS)], 1)
    dst_a, dst_b = noise(dst_layout, gen), None
    dst_b = dst_a.clone()
    plan_conversion(src_layout, dst_layout).apply(src, dst_a, [4, 0, 2], [3, 1], 40)
    plan_conversion(rows_layout, dst_layout).apply(rows.contiguous(), dst_b, [0, 1, 2],
                                                   [3, 1], 40)
    assert torch.equal(dst_a.view(torch.uint8), dst_b.view(torch.uint8))


def test_plan_prints_every_change():
    src = make_layout((0, 1, 2, 3, 4), 16, 4, False)
    dst = make_layout((0, 1, 3, 2, 4), 64, 1, True, FP8)
    text = str(plan_conversion(src, dst, src_tp=TPRank(1, 0), dst_tp=TPRank(8, 5),
                               num_kv_heads=4, quantize=True))
    for phrase in ("block size 16 -> 64 (4 source block(s) to 1 destination block(s))",
                   "order within a block 2,N,H,D -> 2,H,N,D", "per-layer -> cross-layer",
                   "TP1 rank 0 (heads 0-3) -> TP8 rank 5 (heads 2) of 4",
                   "dtype bfloat16 -> float8_e4m3fn (quantize"):
        assert phrase in text, text


# -- refusals and bad input: clear errors, nothing moved ---------------------------------------

NHD16 = make_layout((0, 1, 2, 3, 4), 16, 4, False)


@pytest.mark.parametrize("dst, kwargs, match", [
    (make_layout((0, 1, 2), 16, None, False), {}, r"dims B,2,N,H,D vs B,N,D: an MLA"),
    (make_layout((0, 1, 2, 3, 4), 24, 4, False), {}, r"block size \(N\) 16 vs 24: one must"),
    (make_layout((0, 1, 2, 3, 4), 16, 4, False, FP8), {}, r"pass quantize=True"),
    (make_layout((0, 1, 2, 3, 4), 16, 4, False, torch.float16), {"quantize": True},
     r"dtype bfloat16 vs float16: only"),
    (make_layout((0, 1, 2, 3, 4), 16, 3, False), {}, r"KV heads \(H\) 4 vs 3"),
    (make_layout((0, 1, 2, 3, 4), 16, 1, False), {"dst_tp": TPRank(3, 1)},
     r"on the destination: 4 KV heads cannot be split evenly over tensor-parallel degree 3"),
    (make_layout((0, 1, 2, 3, 4), 16, 2, False), {"src_tp": TPRank(2, 0),
                                                   "dst_tp": TPRank(2, 1)},
     r"none of the heads 2-3 destination TP2 rank 1 holds; read from source "
     r"rank\(s\) \[1\]"),
], ids=["mla-vs-kv", "block-sizes-not-dividing", "fp8-not-opted-in", "bf16-to-fp16",
        "head-counts", "heads-not-splitting", "rank-without-the-heads"])
def test_unconvertible_layouts_are_refused_naming_both(dst, kwargs, match):
    src = kwargs.pop("src", NHD16)
    if "src_tp" in kwargs:
        src = make_layout((0, 1, 2, 3, 4), 16, 2, False)
    with pytest.raises(LayoutConversionError, match=match) as info:
        plan_conversion(src, dst, **kwargs)
    assert str(src) in str(info.value) and dst.describe() in str(info.value)


def test_fp8_to_wider_needs_dequantize():
    src = make_layout((0, 1, 2, 3, 4), 16, 4, False, FP8)
    with pytest.raises(LayoutConversionError, match="pass dequantize=True"):
        plan_conversion(src, NHD16)
    gen = torch.Generator().manual_seed(3)
    plan = plan_conversion(src, NHD16, dequantize=True)
    values = torch.randn(NUM_LAYERS, 2, 20, 4, HEAD_SIZE, generator=gen)
    stored = quantized(values, FP8, torch.full((NUM_LAYERS, 2), 0.5))
    s, d = noise(src, gen), noise(NHD16, gen)
    write_tokens(s, src, [2, 3], stored)
    expected = d.clone()
    write_tokens(expected, NHD16, [0, 1], (stored.float() * 0.5).to(torch.bfloat16))
    plan.apply(s, d, [2, 3], [0, 1], 20, src_scales=0.5)
    assert torch.equal(d.view(torch.uint8), expected.view(torch.uint8))


def test_tp_rank_outside_degree_is_refused():
    with pytest.raises(ValueError, match=r"TPRank.rank=2 is outside the tensor-parallel "
                                         r"degree 2 \(valid ranks: 0..1\)"):
        TPRank(2, 2)


DST64 = make_layout((0, 1, 3, 2, 4), 64, 4, True, num_blocks=3)


@pytest.mark.parametrize("src_ids, dst_ids, num_tokens, kwargs, match", [
    ([0, 1, 2], [0, 1], 40, {}, r"40 tokens occupy 3 source block\(s\) of 16 and 1 "
                                 r"destination block\(s\) of 64, but src_ids has 3 and dst_ids 2"),
    ([0, 1, 2, 3, 4], [0, 3], None, {}, r"dst_ids contains 3, outside the destination's 3 "
                                        r"blocks \(valid: 0..2\); is the destination too small"),
    ([0, 1, 9], [0], 40, {}, r"src_ids contains 9, outside the source's 8 blocks"),
    ([0, 1, 2, 3, 4], [1, 1], None, {}, r"dst_ids repeats blocks"),
    ([0, 1], [0], 20, {"dst": torch.zeros(100, dtype=torch.bfloat16)},
     r"dst holds 200 bytes, not a whole number of blocks"),
], ids=["block-counts", "destination-too-small", "source-id-out-of-range", "repeated-dst",
        "not-an-allocation"])
def test_bad_transfers_are_refused_and_move_nothing(src_ids, dst_ids, num_tokens, kwargs,
                                                   match):
    gen = torch.Generator().manual_seed(4)
    plan = plan_conversion(NHD16, DST64)
    src = noise(NHD16, gen)
    dst = kwargs.get("dst", noise(DST64, gen))
    before = dst.clone()
    with pytest.raises(ValueError, match=match):
        plan.apply(src, dst, src_ids, dst_ids, num_tokens)
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8))


def test_quantize_without_scales_is_refused():
    plan = plan_conversion(NHD16, make_layout((0, 1, 2, 3, 4), 16, 4, False, FP8),
                           quantize=True)
    gen = torch.Generator().manual_seed(5)
    src, dst = noise(plan.src, gen), noise(plan.dst, gen)
    with pytest.raises(ValueError, match=r"pass dst_scales, the per-layer K/V scales, "
                                         r"shape \(2, 2\)"):
        plan.apply(src, dst, [0], [0])
    with pytest.raises(ValueError, match=r"dst_scales has shape \(3,\)"):
        plan.apply(src, dst, [0], [0], dst_scales=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("kernel", ["torch", "same-layout"])
def test_prepare_converts_when_called_and_again_with_the_bytes_then(kernel):
    """A prepared conversion moves nothing until called; each call moves what the source
    holds then, the same bytes as apply (a connector prepares a chunk while it is READ)."""
    gen = torch.Generator().manual_seed(6)
    src_layout = NHD16 if kernel == "torch" else DST64
    plan = plan_conversion(src_layout, DST64)
    src, dst = noise(src_layout, gen), noise(DST64, gen)
    src_ids, dst_ids, tokens = ([4, 0, 2, 7, 5], [2, 0], 72) if kernel == "torch" \
        else ([2, 0], [1, 2], 100)
    before = dst.clone()
    run = plan.prepare(src, dst, src_ids, dst_ids, tokens, kernel="torch")
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8))
    for _ in range(2):
        expected = before.clone()
        plan.apply(src, expected, src_ids, dst_ids, tokens, kernel="torch")
        assert run() == plan.apply(src, before.clone(), src_ids, dst_ids, tokens) > 0
        assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
        src.copy_(noise(src_layout, gen))  # the next call reads these


def test_ids_that_are_not_ints_are_named():
    """Ids are checked in C passes when all are ints; otherwise the first bad one is named."""
    plan = plan_conversion(NHD16, DST64)
    gen = torch.Generator().manual_seed(7)
    src, dst = noise(NHD16, gen), noise(DST64, gen)
    before = dst.clone()
    for bad, text in ((True, "True"), (1.0, "1.0")):
        with pytest.raises(TypeError, match=rf"src_ids\[1\]={text} must be an int"):
            plan.apply(src, dst, [0, bad], [0], 20)
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("src_bs, dst_bs, num_keys", [
    (16, 64, 9), (16, 64, 8), (64, 16, 3), (32, 32, 2)], ids=lambda v: str(v))
def test_apply_keys_writes_whole_groups_and_names_the_first_lost_key(src_bs, dst_bs, num_keys):
    """A load's keys convert by groups (key_groups: keys and destination blocks, the last
    partial): a group with a key that did not arrive is not written and names that key;
    the others equal a conversion of their keys alone; nothing else moves."""
    src_l = make_layout((0, 1, 2, 3, 4), src_bs, 4, False, num_blocks=12)
    dst_l = make_layout((0, 1, 3, 2, 4), dst_bs, 4, False, num_blocks=40)
    plan = plan_conversion(src_l, dst_l)
    groups = plan.key_groups(num_keys)
    assert [i for keys, _ in groups for i in keys] == list(range(num_keys))
    assert groups[-1][1].stop == plan.blocks_for_keys(num_keys)
    assert [dst.start for _, dst in groups[1:]] == [dst.stop for _, dst in groups[:-1]]
    gen = torch.Generator().manual_seed(8)
    src, dst = noise(src_l, gen), noise(dst_l, gen)
    slots = torch.randperm(12, generator=gen)[:num_keys].tolist()
    dst_ids = torch.randperm(40, generator=gen)[:plan.blocks_for_keys(num_keys)].tolist()
    lost = {num_keys - 1} if len(groups) == 1 else {groups[0][0][-1], num_keys - 1}
    arrived = [i not in lost for i in range(num_keys)]
    expected = dst.clone()
    for keys, blocks in groups:
        if all(arrived[i] for i in keys):
            plan.apply(src, expected, slots[keys.start:keys.stop], dst_ids[blocks],
                       len(keys) * src_bs, kernel="torch")
    written, missing, nbytes = plan.apply_keys(src, dst, slots, dst_ids, arrived,
                                               kernel="torch")
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    for keys, blocks in groups:
        first_lost = next((i for i in keys if not arrived[i]), None)
        for block in dst_ids[blocks]:
            assert (block in written) == (first_lost is None)
            assert missing.get(block) == first_lost
    assert (nbytes > 0) == bool(written)
