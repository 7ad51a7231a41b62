"""MLA attention against float64 references: the decode entry point, the mixed-batch latent
kernel, and TRITON_MLA end to end against the unabsorbed model math."""

from __future__ import annotations

import pytest
import torch
from kvcore_mla import TritonMLABackend
from kvcore_mla.ops import decode_attention_ref, mla_attention_ref, mla_forward_ref
from mla_helpers import DEVICE, assert_close, block_tables, generator, randn

import kvcore

tma = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
configs = pytest.importorskip("kvcore_mla.ops.mla_configs")
triton_cache = pytest.importorskip("kvcore_mla.ops.triton_cache")

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _decode_case(shape: tuple, dtype: torch.dtype, seq_lens: list[int], page_size: int,
                 gen: torch.Generator, cache_dtype: torch.dtype | None = None) -> dict:
    num_heads, num_kv_heads, qk_dim, v_dim, is_mla = shape
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    cache_dtype = cache_dtype or dtype
    k = randn((num_pages, page_size, num_kv_heads, qk_dim), cache_dtype, gen)
    v = k[..., :v_dim] if is_mla else randn((num_pages, page_size, num_kv_heads, v_dim),
                                            cache_dtype, gen)
    return dict(q=randn((len(seq_lens), num_heads, qk_dim), dtype, gen), k_buffer=k, v_buffer=v,
                req_to_page=block_tables(seq_lens, page_size, num_pages, gen),
                b_seq_len=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                sm_scale=qk_dim ** -0.5, page_size=page_size, is_mla=is_mla)


def _run_decode(case: dict, num_splits: int, out_dtype: torch.dtype, impl=None,
                **scales) -> tuple[torch.Tensor, torch.Tensor]:
    batch, num_heads, _ = case["q"].shape
    v_dim = case["v_buffer"].shape[-1]
    o = torch.full((batch, num_heads, v_dim), float("nan"), dtype=out_dtype, device=DEVICE)
    lse = torch.full((batch, num_heads), float("nan"), dtype=torch.float32, device=DEVICE)
    logits = torch.empty(batch, num_heads, num_splits, v_dim + 1, dtype=torch.float32,
                         device=DEVICE)
    (impl or tma.decode_attention_fwd)(
        case["q"], case["k_buffer"], case["v_buffer"], o, lse, case["req_to_page"],
        case["b_seq_len"], logits, num_splits, case["sm_scale"], case["page_size"],
        case["is_mla"], **scales)
    return o, lse


def _reference(case: dict, **scales) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention_ref in float64 on the same (dtype-rounded) inputs."""
    k = case["k_buffer"].double()
    v = k[..., : case["v_buffer"].shape[-1]] if case["is_mla"] else case["v_buffer"].double()
    if case["k_buffer"].dtype in FP8.values():  # dequantise here; the float64 ref sees no fp8
        k = k * scales.get("k_scale", 1.0)
        v = k[..., : case["v_buffer"].shape[-1]] if case["is_mla"] else \
            v * scales.get("v_scale", 1.0)
    ref_case = {**case, "q": case["q"].double(), "k_buffer": k, "v_buffer": v}
    return _run_decode(ref_case, 1, torch.float64, impl=decode_attention_ref)


DECODE_SHAPES = {
    "MLA-H16-576": (16, 1, 576, 512, True),
    "MLA-H128-576": (128, 1, 576, 512, True),  # default config: 64-head programs (wgmma)
    "MLA-H32-80": (32, 1, 80, 64, True),
}


@pytest.mark.parametrize("shape", DECODE_SHAPES.values(), ids=DECODE_SHAPES.keys())
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_float64_reference(shape: tuple, num_splits: int) -> None:
    gen = generator("decode", shape, num_splits)
    # Empty, single-token, page-boundary and multi-page requests.
    case = _decode_case(shape, torch.float32, [0, 1, 16, 70], 16, gen)
    o, lse = _run_decode(case, num_splits, torch.float32)
    o_ref, lse_ref = _reference(case)
    assert_close(o, o_ref, torch.float32, "o")
    assert_close(lse, lse_ref, torch.float32, "lse")
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_attention_low_precision_within_tolerance(dtype: torch.dtype) -> None:
    shape = DECODE_SHAPES["MLA-H32-80"]
    gen = generator("decode-dtype", dtype)
    case = _decode_case(shape, dtype, [33, 5], 8, gen)
    o, lse = _run_decode(case, 2, dtype)
    o_ref, lse_ref = _reference(case)
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, dtype, "lse")


@pytest.mark.parametrize("kv_cache_dtype", FP8.keys())
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_decode_attention_on_fp8_caches(kv_cache_dtype: str, scale_kind: str) -> None:
    gen = generator("decode-fp8", kv_cache_dtype, scale_kind)
    case = _decode_case(DECODE_SHAPES["MLA-H32-80"], torch.bfloat16, [40, 3], 16, gen,
                        FP8[kv_cache_dtype])
    ks = vs = 0.5
    if scale_kind == "tensor":
        ks, vs = (torch.tensor([x], device=DEVICE) for x in (ks, vs))
    o, lse = _run_decode(case, 2, torch.bfloat16, k_scale=ks, v_scale=vs)
    o_ref, lse_ref = _reference(case, k_scale=float(ks), v_scale=float(vs))
    assert_close(o, o_ref, torch.bfloat16, "o")
    assert_close(lse, lse_ref, torch.bfloat16, "lse")


def _mixed_batch(gen: torch.Generator, page_size: int, num_pages: int) -> kvcore.AttentionMetadata:
    """A prefill with a cached prefix, a fresh prefill, two decodes and an idle request."""
    query_lens = [13, 1, 0, 21, 1]
    context_lens = [18, 40, 5, 0, 0]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    table = block_tables(seq_lens, page_size, num_pages, gen).tolist()
    return kvcore.build_attention_metadata(query_lens, context_lens, table, page_size,
                                           device=DEVICE)


@pytest.mark.parametrize(("config", "num_kv_splits"), [
    (None, None),
    (configs.TritonMLAMixedConfig(block_q=4, block_h=4, block_n=16, num_warps=4,
                                  num_stages=1), None),
    (None, 3),
], ids=["default", "small-tiles", "split"])
def test_mixed_batch_latent_attention_matches_float64_reference(config, num_kv_splits) -> None:
    gen = generator("mla-mixed", str(config), num_kv_splits)
    num_heads, rank, rope, page_size, num_pages = 16, 64, 16, 8, 24
    meta = _mixed_batch(gen, page_size, num_pages)
    q = randn((meta.num_actual_tokens, num_heads, rank + rope), torch.float32, gen)
    cache = randn((num_pages, page_size, rank + rope), torch.float32, gen)
    args = dict(kv_lora_rank=rank, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.12)
    out = tma.mla_attention(q, cache, **args, max_query_len=meta.max_query_len,
                            plan=configs.TritonMLAPlan(config, num_kv_splits))
    expected = mla_attention_ref(q.double(), cache.double(), **args)
    assert_close(out, expected, torch.float32, "latent output")


def _impl(gen: torch.Generator, num_heads: int, rank: int, rope: int, nope: int, v_dim: int,
          dtype: torch.dtype, kv_cache_dtype: str = "auto") -> tuple:
    w = randn((num_heads * (nope + v_dim), rank), dtype, gen, scale=rank ** -0.5)
    impl = TritonMLABackend.get_impl_cls()(
        num_heads, rank + rope, (nope + rope) ** -0.5, kv_cache_dtype=kv_cache_dtype,
        kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
        kv_b_proj_weight=w)
    return impl, w


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "fp8"),
], ids=["fp32", "bf16", "bf16-fp8cache"])
def test_triton_mla_matches_the_unabsorbed_model(dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """Absorbed latent attention equals attention over K/V expanded with kv_b_proj."""
    gen = generator("backend", dtype, kv_cache_dtype)
    num_heads, rank, rope, nope, v_dim, page_size, num_pages = 16, 64, 16, 32, 48, 8, 24
    impl, w = _impl(gen, num_heads, rank, rope, nope, v_dim, dtype, kv_cache_dtype)
    meta = _mixed_batch(gen, page_size, num_pages)
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else dtype
    cache = torch.zeros(num_pages, page_size, rank + rope, dtype=cache_dtype, device=DEVICE)
    layer = kvcore.LayerScales(k_scale=torch.tensor([0.25], device=DEVICE))
    # Fill every request's history (cached prefix and new tokens) through the backend.
    history = kvcore.build_attention_metadata(
        [int(n) for n in meta.seq_lens.tolist()], [0] * meta.num_seqs,
        meta.block_table.tolist(), page_size, device=DEVICE)
    kv_c = randn((history.num_actual_tokens, rank), dtype, gen)
    k_pe = randn((history.num_actual_tokens, 1, rope), dtype, gen)
    impl.do_kv_cache_update(layer, kv_c, k_pe, cache, history.slot_mapping)

    padded = meta.num_actual_tokens + 2  # rows past num_actual_tokens are padding
    query = randn((padded, num_heads, nope + rope), dtype, gen)
    output = torch.full((padded, num_heads, v_dim), 7.0, dtype=dtype, device=DEVICE)
    impl.forward(layer, query, None, None, cache, meta, output=output)

    expected = mla_forward_ref(
        query[: meta.num_actual_tokens].double(), cache, w, kv_lora_rank=rank,
        qk_nope_head_dim=nope, v_head_dim=v_dim, query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens, block_table=meta.block_table, scale=impl.scale,
        kv_cache_dtype=kv_cache_dtype, k_scale=layer.k_scale)
    assert_close(output[: meta.num_actual_tokens], expected, dtype, "output")
    assert (output[meta.num_actual_tokens:] == 7.0).all()


def test_triton_mla_refuses_cpu_tensors_outside_the_interpreter(monkeypatch) -> None:
    gen = generator("cpu-guard")
    impl, _ = _impl(gen, 16, 64, 16, 32, 32, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = torch.zeros(2, 16, 80)
    with pytest.raises(ValueError, match="kv_cache is on cpu; TRITON_MLA runs Triton kernels"):
        impl.do_kv_cache_update(kvcore.LayerScales(), torch.zeros(1, 64), torch.zeros(1, 16),
                                cache, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize(("change", "message"), [
    ({"head_size": 576}, "head_size=576 must be the latent size"),
    ({"kv_b_proj_weight": torch.zeros(16 * 64, 80)}, "kv_b_proj_weight has shape"),
    ({"num_kv_heads": 2}, "num_kv_heads=2"),
    ({"sliding_window": 128}, "sliding_window=128"),
    ({"attn_type": "encoder_only"}, "attn_type=encoder_only"),
])
def test_mla_impl_errors_name_the_argument(change: dict, message: str) -> None:
    args = dict(num_heads=16, head_size=80, scale=0.1, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, kv_b_proj_weight=torch.zeros(16 * 64, 64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        TritonMLABackend.get_impl_cls()(**args)


def _decode_args() -> dict:
    k = torch.zeros(4, 16, 1, 80)
    return dict(q=torch.zeros(2, 16, 80), k_buffer=k, v_buffer=k[..., :64],
                o=torch.zeros(2, 16, 64), lse=torch.zeros(2, 16),
                req_to_page=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                b_seq_len=torch.tensor([20, 3], dtype=torch.int32),
                attn_logits=torch.zeros(2, 16, 2, 65), num_kv_splits=2, sm_scale=0.1,
                page_size=16, is_mla=True)


@pytest.mark.parametrize(("change", "message"), [
    ({"v_buffer": torch.zeros(4, 16, 1, 64)}, "is_mla=True needs v_buffer = k_buffer"),
    ({"is_mla": False}, "is_mla=False and a cache of 1 KV heads; it computes MLA decode only "
                        r"\(is_mla=True, one latent per token\): for GQA/MHA caches use "
                        "kvcore.ops.paged_attention"),
    ({"attn_logits": torch.zeros(2, 16, 3, 65)}, "attn_logits has shape"),
    ({"page_size": 8}, "page_size=8 but k_buffer has pages of 16 tokens"),
    ({"o": torch.zeros(2, 16, 80)}, "o has shape"),
    ({"num_kv_splits": 0}, "num_kv_splits=0"),
    ({"b_seq_len": torch.tensor([20, 40], dtype=torch.int32)}, "req_to_page has only 2 columns"),
    ({"req_to_page": torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)}, "block id 9"),
    ({"q": torch.zeros(2, 16, 64)}, "q has head dim 64 but k_buffer has 80"),
    ({"sm_scale": -1.0}, "sm_scale=-1.0"),
])
def test_decode_attention_errors_name_the_argument(change: dict, message: str) -> None:
    args = {**_decode_args(), **change}
    for impl in (tma.decode_attention_fwd, decode_attention_ref):
        with pytest.raises((ValueError, TypeError), match=message):
            impl(**args)
