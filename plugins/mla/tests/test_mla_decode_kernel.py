"""The MLA decode kernel (head-group tiles, split-KV, reduce) against the float64 reference:
launch configurations, split counts, ragged lengths, head counts (16, and 128 scaled down to
64), page sizes smaller and larger than the tile; cross-layer views bit-exact; the per-GPU
config table and the split chooser; the builder's choices reaching the kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvcore_mla import TritonMLABackend
from kvcore_mla.ops import decode_attention_ref, mla_attention_ref
from mla_helpers import (
    DECODE_RANK,
    DECODE_ROPE,
    DEVICE,
    assert_close,
    assert_decode_close,
    block_tables,
    cross_layer_view,
    decode_case,
    generator,
    randn,
    run_decode,
)

import kvcore
import kvcore.ops

kernels = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
configs = pytest.importorskip("kvcore_mla.ops.mla_configs")
descriptors = pytest.importorskip("kvcore_mla.ops.descriptors")

RANK, ROPE = DECODE_RANK, DECODE_ROPE
LENS = [0, 1, 17, 64, 130]  # empty, one token, inside a page, a page boundary, several pages


def _config(block_h: int, block_n: int, num_warps: int = 4, num_stages: int = 2,
            split_latent: bool = False):
    """A pointer-load decode config: the latent whole, or in halves."""
    cls = configs.TritonMLAHalvesConfig if split_latent else configs.TritonMLADecodeConfig
    return cls(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


# (split_latent, heads, block_h, block_n, page, splits); split_latent: two latent halves (two
# accumulators, same probabilities) instead of the whole latent.
DECODE_CASES = [
    (False, 16, 16, 16, 16, 1),
    (False, 16, 16, 32, 64, 3),   # tiles inside one page: one block-table read a tile
    (False, 16, 16, 64, 16, 2),   # tiles across pages: a block-table read per latent
    (False, 16, 32, 16, 8, 4),    # head rows padded past the head count
    (False, 64, 16, 32, 32, 1),   # 128 heads scaled down: four head groups
    (False, 64, 64, 16, 64, 5),   # one 64-head group, more splits than some requests have tiles
    (False, 64, 32, 32, 16, 2),
    (True, 16, 16, 32, 64, 1),
    (True, 16, 16, 16, 8, 3),     # tiles across pages
    (True, 64, 64, 32, 32, 4),    # one 64-head group, split
    (True, 64, 32, 16, 16, 1),
]


def _key(split_latent: bool) -> str:
    return "mla-decode-kernel-halves" if split_latent else "mla-decode-kernel"


@pytest.mark.parametrize(("split_latent", "heads", "block_h", "block_n", "page", "splits"),
                         DECODE_CASES, ids=lambda v: str(v))
def test_mla_decode_matches_float64_reference(split_latent, heads, block_h, block_n, page,
                                              splits) -> None:
    gen = generator(_key(split_latent), heads, block_h, block_n, page, splits)
    q, cache, table, lens = decode_case(gen, heads, page, LENS)
    o, lse = run_decode(q, cache, table, lens, splits,
                        _config(block_h, block_n, split_latent=split_latent))
    assert_decode_close(o, lse, q, cache, table, lens, torch.float32)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[0]).all()


@pytest.mark.parametrize("split_latent", [False, True], ids=["whole", "halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mla_decode_low_precision_within_tolerance(dtype: torch.dtype,
                                                   split_latent: bool) -> None:
    gen = generator(f"{_key(split_latent)}-dtype", dtype)
    q, cache, table, lens = decode_case(gen, 16, 16, [50, 9, 33], dtype)
    o, lse = run_decode(q, cache, table, lens, 2, _config(16, 32, split_latent=split_latent))
    assert_decode_close(o, lse, q, cache, table, lens, dtype)


@pytest.mark.parametrize("split_latent", [False, True], ids=["whole", "halves"])
def test_mla_decode_fp8_cache_within_tolerance(split_latent: bool) -> None:
    gen = generator("mla-decode-kernel-fp8")
    q, cache, table, lens = decode_case(gen, 16, 16, [40, 3], torch.bfloat16)
    fp8 = cache.to(torch.float8_e4m3fn)
    o, lse = run_decode(q, fp8, table, lens, 2, _config(16, 16, split_latent=split_latent),
                     k_scale=0.5, v_scale=0.5)
    assert_decode_close(o, lse, q, fp8.double() * 0.5, table, lens, torch.bfloat16)


@pytest.mark.parametrize("split_latent", [False, True], ids=["whole", "halves"])
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_on_a_cross_layer_view_is_bit_exact(splits: int, split_latent: bool) -> None:
    gen = generator("mla-decode-kernel-xl", splits, split_latent)
    q, cache, table, lens = decode_case(gen, 16, 16, [70, 5, 33])
    pool, view = cross_layer_view(tuple(cache.shape), 3, 1, torch.float32, gen)
    view.copy_(cache)
    before = pool.clone()
    config = _config(16, 32, split_latent=split_latent)
    ours = run_decode(q, view, table, lens, splits, config)
    contiguous = run_decode(q, cache, table, lens, splits, config)
    assert view.stride(0) == 3 * cache.stride(0)
    assert all(torch.equal(a, b) for a, b in zip(ours, contiguous, strict=True))
    assert torch.equal(pool, before)  # nothing written into any layer


def test_mla_attention_decode_path_takes_the_decode_kernel() -> None:
    """mla_attention on a decode batch (through its own split choice) equals the reference."""
    gen = generator("mla-decode-kernel-op")
    q, cache, table, _ = decode_case(gen, 32, 16, [1, 45, 16])
    meta = kvcore.build_attention_metadata([1, 1, 1], [0, 44, 15], table.tolist(), 16,
                                           device=DEVICE)
    args = dict(kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.1)
    out = kernels.mla_attention(q, cache, **args, max_query_len=1,
                                plan=configs.TritonMLAPlan(num_kv_splits=3))
    expected = mla_attention_ref(q.double(), cache.double(), **args)
    assert_close(out, expected, torch.float32, "latent output")


def test_the_config_table_rows_are_launchable() -> None:
    for family, rows in configs.MLA_DECODE_CONFIGS.items():
        assert rows[-1][0] == 1, f"{family}: the last row must cover every head count"
        assert [least for least, _ in rows] == sorted((least for least, _ in rows),
                                                      reverse=True), family
        for least in {least for least, _ in rows}:
            group = [config for row_least, config in rows if row_least == least]
            assert not group[-1].uses_tma, f"{family}: {least}+ heads end on a TMA kernel"
        for _, config in rows:
            assert configs.DECODE_CONFIG_TYPES[config.kernel] is type(config)
            assert config.block_h >= 16 and config.block_n >= 16
    assert configs.mla_decode_config(128, "sm90").block_h == 64
    assert configs.mla_decode_config(16, "sm90").block_h == 16
    # block_h never exceeds the heads (rounded up to a power of two, at least 16).
    assert configs.mla_decode_config(20, "sm80").block_h == 16
    with pytest.raises(ValueError, match="family='tpu' \\(known: sm90"):
        configs.mla_decode_config(16, "tpu")


@pytest.mark.parametrize("value", ["0", "off"])
def test_kvcore_gluon_0_keeps_the_table_on_the_triton_kernel(kvcore_gluon, value: str) -> None:
    """The operator's switch: with ``KVCORE_GLUON=0`` the 128-head sm90 choice is the row
    ``gluon=False`` gives, and an explicit Gluon config is not the chooser's business."""
    without = configs.mla_decode_config(128, "sm90", gluon=False)
    kvcore_gluon(value)
    assert configs.mla_decode_config(128, "sm90") == without
    assert without.kernel != "gluon_mla_ws"
    kvcore_gluon("1")
    if descriptors.gluon_available() is None:
        assert configs.mla_decode_config(128, "sm90").kernel == "gluon_mla_ws"


def test_a_table_row_keeps_tma_only_where_it_can_serve_the_cache() -> None:
    """The sm90 128-head rows: gluon_mla_ws, then triton_mla_decode_tma_keysplit, then
    triton_mla_decode_halves (pointer loads). Queries the Gluon kernel does not take (float32)
    or ``gluon=False`` (what the entry points pass when :func:`gluon_unmet` finds the tensors
    unfit) take the TMA row; a page size its tile does not divide, an fp8 cache, or a cache
    TMA cannot address (``tma=False``) take the pointer-load row."""
    gluon_row, tma_row, pointer_row = (c for least, c in configs.MLA_DECODE_CONFIGS["sm90"]
                                       if least == 64)
    assert [gluon_row.kernel, tma_row.kernel, pointer_row.kernel] == [
        "gluon_mla_ws", "triton_mla_decode_tma_keysplit", "triton_mla_decode_halves"]
    has_descriptors = descriptors.descriptors_available()
    has_gluon = descriptors.gluon_available() is None
    row = configs.mla_decode_config(128, "sm90", dtype=torch.float32)
    assert row == (tma_row if has_descriptors else pointer_row)
    assert configs.mla_decode_config(128, "sm90") == (gluon_row if has_gluon else row)
    assert configs.mla_decode_config(128, "sm90", dtype=torch.bfloat16, page_size=128) == (
        gluon_row if has_gluon else row)
    assert configs.mla_decode_config(128, "sm90", gluon=False) == row
    assert configs.mla_decode_config(128, "sm90", page_size=2 * row.block_n,
                                     gluon=False) == row
    for fallback in (configs.mla_decode_config(128, "sm90", page_size=tma_row.block_n // 2),
                     configs.mla_decode_config(128, "sm90", fp8_cache=True),
                     configs.mla_decode_config(128, "sm90", tma=False)):
        assert fallback == pointer_row
    # A table whose rows for a head count all need TMA is refused, naming the fix.
    lone = {"only": ((1, dataclasses.replace(tma_row, block_h=16)),)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(configs, "MLA_DECODE_CONFIGS", lone)
        with pytest.raises(ValueError, match="no row for 16 heads that loads without TMA"):
            configs.mla_decode_config(16, "only", tma=False)
    if not has_descriptors:
        pytest.skip("this Triton has no tl.make_tensor_descriptor")
    cache = torch.empty(4, 64, 576, dtype=torch.bfloat16)
    assert descriptors.tma_unmet(cache, 512, tma_row.block_n) is None
    assert "does not divide the cache's page size 32" in descriptors.tma_unmet(
        cache[:, :32], 512, tma_row.block_n)
    odd = torch.empty(4 * 64 * 577 + 1, dtype=torch.bfloat16)[1:].view(4, 64, 577)[..., :576]
    assert "not a multiple of 16 bytes" in descriptors.tma_unmet(odd, 512, tma_row.block_n)


def test_the_split_choice_fills_the_gpu_and_no_more() -> None:
    """On 132 SMs (an H200): a batch with a program per SM is not split; few long requests
    are; never more splits than tiles or MAX_KV_SPLITS."""
    many = configs.mla_decode_config(128, "sm90")
    few = configs.mla_decode_config(16, "sm90")
    assert configs.mla_decode_num_splits(64, 128, 4096, many, 132) == 1
    assert configs.mla_decode_num_splits(128, 128, 2048, many, 132) == 1
    assert configs.mla_decode_num_splits(8, 128, 32768, many, 132) == 8
    assert configs.mla_decode_num_splits(64, 16, 4096, few, 132) == 2
    assert configs.mla_decode_num_splits(1, 16, 1 << 20, few, 132) == kvcore.ops.MAX_KV_SPLITS
    assert configs.mla_decode_num_splits(1, 16, 320, few, 132) == 5  # 5 tiles of 64
    assert configs.mla_decode_num_splits(1, 16, 4096, few, 1) == 1  # one SM: splitting only costs


def test_the_split_choice_counts_programs_an_sm_runs_at_once() -> None:
    """A config whose programs fit two to an SM fills twice the slots: 64 requests of 4096
    tokens at 16 heads in tiles of 32 take 4 splits (256 programs on 264 slots), not 2."""
    one = _config(16, 32, num_warps=4, num_stages=3)
    two = dataclasses.replace(one, programs_per_sm=2)
    assert configs.mla_decode_num_splits(64, 16, 4096, one, 132) == 2
    assert configs.mla_decode_num_splits(64, 16, 4096, two, 132) == 4
    with pytest.raises(ValueError, match="programs_per_sm=0 must be >= 1: the programs of "
                                         "this config one SM runs at once"):
        dataclasses.replace(one, programs_per_sm=0)


def _check_latent_attention(num_heads: int, q: torch.Tensor, cache: torch.Tensor,
                            meta: kvcore.AttentionMetadata) -> None:
    """TRITON_MLA's latent attention on the builder's metadata ``meta`` against the MLA
    reference (scale 0.1)."""
    impl = TritonMLABackend.get_impl_cls()(
        num_heads, RANK + ROPE, 0.1, kv_lora_rank=RANK, qk_nope_head_dim=16,
        qk_rope_head_dim=ROPE, v_head_dim=16,
        kv_b_proj_weight=torch.zeros(num_heads * 32, RANK, device=DEVICE))
    out = impl._latent_attention(kvcore.LayerScales(), q, cache, meta)
    expected = mla_attention_ref(q.double(), cache.double(), kv_lora_rank=RANK,
                                 query_start_loc=meta.query_start_loc,
                                 seq_lens=meta.seq_lens, block_table=meta.block_table,
                                 scale=0.1)
    assert_close(out, expected, torch.float32, "latent output")


def test_the_builder_hands_its_config_and_splits_to_the_kernel() -> None:
    spec = kvcore.MLAAttentionSpec(block_size=16, dtype=torch.float32, kv_lora_rank=RANK,
                                   qk_rope_head_dim=ROPE)
    config = _config(32, 16)
    builder = TritonMLABackend.get_builder_cls()(
        spec, num_heads=64, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=256,
        device=DEVICE, decode_config=config, num_sms=8)
    assert builder.decode_config == config
    gen = generator("mla-decode-kernel-builder")
    q, cache, table, _ = decode_case(gen, 64, 16, [100, 7])
    step = kvcore.build_attention_metadata([1, 1], [99, 6], table.tolist(), 16, device=DEVICE)
    meta = builder.build(step, graph_batch_size=2)
    assert meta.plan.config == config
    assert meta.plan.num_kv_splits == builder.num_kv_splits(2) > 1
    _check_latent_attention(64, q, cache, meta)
    prefill = builder.build(kvcore.build_attention_metadata([3], [4], table[:1].tolist(), 16,
                                                            device=DEVICE))
    assert prefill.plan == configs.TritonMLAPlan(builder.mixed_config, 1)
    assert prefill.plan.config.kernel == "triton_mla_mixed"
    with pytest.raises(ValueError, match="decode_config=.* must be a decode kernel's "
                                         "configuration"):
        TritonMLABackend.get_builder_cls()(
            spec, num_heads=64, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=256,
            device=DEVICE, decode_config=configs.mixed_config(64, RANK))


@pytest.mark.parametrize("split_latent", [False, True], ids=["whole", "halves"])
def test_mla_decode_rank_not_a_power_of_two(split_latent: bool) -> None:
    """A latent width below its power-of-two tile (48 of 64) is masked by channel too (with
    halves: the second half is partly masked)."""
    gen = generator("mla-decode-kernel-rank48", split_latent)
    rank, rope, page, lens = 48, 16, 16, [37, 3]
    pages = sum(-(-n // page) for n in lens) + 2
    cache = randn((pages, page, rank + rope), torch.float32, gen)
    table = block_tables(lens, page, pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn((2, 16, rank + rope), torch.float32, gen)
    outs = []
    for impl, dtype in ((kernels.decode_attention_fwd, torch.float32),
                        (decode_attention_ref, torch.float64)):
        o = torch.empty(2, 16, rank, dtype=dtype, device=DEVICE)
        lse = torch.empty(2, 16, dtype=dtype, device=DEVICE)
        logits = torch.empty(2, 16, 2, rank + 1, dtype=torch.float32, device=DEVICE)
        c = cache.to(dtype)
        config = {"config": _config(16, 16, split_latent=split_latent)} if dtype != torch.float64 \
            else {}
        impl(q.to(dtype), c, c[..., :rank], o, lse, table, seq_lens, logits, 2, 0.1, page, True,
             **config)
        outs.append((o, lse))
    assert_close(outs[0][0], outs[1][0], torch.float32, "o")
    assert_close(outs[0][1], outs[1][1], torch.float32, "lse")


def test_an_eager_step_never_splits_beyond_the_workspace() -> None:
    """The split choice is not monotone in the length (rounding): on 12 SMs one request of 257
    tokens would take 9 splits where max_model_len=512 takes 8. The builder caps eager steps
    at the graph choice its workspace was sized for, and the result is still right."""
    spec = kvcore.MLAAttentionSpec(block_size=16, dtype=torch.float32, kv_lora_rank=RANK,
                                   qk_rope_head_dim=ROPE)
    builder = TritonMLABackend.get_builder_cls()(
        spec, num_heads=16, max_num_seqs=1, max_num_batched_tokens=4, max_model_len=512,
        device=DEVICE, num_sms=12)
    assert builder.num_kv_splits(1, 257) > builder.num_kv_splits(1) == 8
    gen = generator("mla-decode-kernel-cap")
    q, cache, table, _ = decode_case(gen, 16, 16, [257])
    meta = builder.build(kvcore.build_attention_metadata([1], [256], table.tolist(), 16,
                                                         device=DEVICE))
    assert meta.plan.num_kv_splits == 8
    _check_latent_attention(16, q, cache, meta)


def test_gluon_unmet_names_what_the_gluon_kernel_cannot_take() -> None:
    q = torch.empty(2, 128, 576, dtype=torch.bfloat16)
    cache = torch.empty(4, 64, 576, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(descriptors, "gluon_available", lambda: "no Gluon here")
        patch.setattr(configs, "gluon_available", lambda: "no Gluon here")
        assert descriptors.gluon_unmet(q, cache, 512) == "no Gluon here"
        assert configs.mla_decode_config(128, "sm90") == configs.MLA_DECODE_CONFIGS["sm90"][1][1]
    if descriptors.gluon_available() is not None:
        pytest.skip(descriptors.gluon_available())
    assert "got q torch.float32 and kv_cache torch.float32" in descriptors.gluon_unmet(
        q.float(), cache.float(), 512)
    assert "got q torch.bfloat16 and kv_cache torch.float16" in descriptors.gluon_unmet(
        q, cache.half(), 512)
    assert "kv_lora_rank = 128, 256 or 512" in descriptors.gluon_unmet(
        q[..., :448 + 64], cache[..., :448 + 64], 448)
    assert "kv_lora_rank = 128, 256 or 512" in descriptors.gluon_unmet(
        q[..., :64 + 64], cache[..., :64 + 64], 64)
    wide_q = torch.empty(2, 128, 512 + 128, dtype=torch.bfloat16)
    wide_cache = torch.empty(4, 64, 512 + 128, dtype=torch.bfloat16)
    assert "640 channels in shared memory, 240 KiB, more than Hopper's 227 KiB" in \
        descriptors.gluon_unmet(wide_q, wide_cache, 512)
    assert "rope width = 64 x a power of two" in descriptors.gluon_unmet(q[..., :544],
                                                                     cache[..., :544], 512)
    assert "does not divide the cache's page size 32" in descriptors.gluon_unmet(q, cache[:, :32],
                                                                              512)
    assert "runs on NVIDIA Hopper GPUs (compute capability 9.x); kv_cache is on cpu" in \
        descriptors.gluon_unmet(q, cache, 512)
