"""TRITON_ATTN's kernels with attention sinks and a logit soft-cap against the float64
reference: the decode kernel, its split-KV launch (sinks added once, in the merge) and the
prefill kernel, each with a sliding window too (gpt-oss puts sinks on 128-token windowed
layers, Gemma 2 a soft-cap of 50 on 4096-token ones).

Under ``TRITON_INTERPRET=1`` on small shapes without a GPU; the ``gpu`` tests run the two
models' real layer shapes in bf16.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvcore.ops import TritonAttentionPlan as Plan
from kvcore.ops import paged_attention_ref
from kvcore.testing import random_block_tables

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
dispatch = pytest.importorskip("kvcore.ops.attention_dispatch")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Element-wise bound and per-token relative error norm against the float64 reference
#: rounded to the dtype (the conformance suite's bounds).
ATOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
NORM = {torch.float32: 2e-3, torch.bfloat16: 5e-3}


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def make_step(gen: torch.Generator, q_lens: list[int], seq_lens: list[int], *, num_heads: int,
              num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
              query_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 dict]:
    """Fresh random ``(query, key_cache, value_cache, step kwargs)`` on :data:`DEVICE`:
    shuffled block ids, random values in every slot."""
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for i, ids in enumerate(random_block_tables(seq_lens, block_size, num_blocks, gen)):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    query = (torch.randn(sum(q_lens), num_heads, head_size, generator=gen) * query_scale
             ).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    step = dict(query_start_loc=qsl.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
                block_table=table.to(DEVICE), scale=head_size ** -0.5)
    return query, key_cache, value_cache, step


def random_sinks(gen: torch.Generator, num_heads: int) -> torch.Tensor:
    """float32 sink logits near the log of the key counts here: a large share of each row."""
    return (torch.randn(num_heads, generator=gen) + 3.0).to(DEVICE)


def check(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
          value_cache: torch.Tensor, step: dict, **features) -> torch.Tensor:
    """``out`` within the bounds of the float64 reference; returns the reference."""
    ref = paged_attention_ref(query.double(), key_cache.double(), value_cache.double(), **step,
                              **features)
    dtype = out.dtype
    torch.testing.assert_close(out.double(), ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    rounded = ref.to(dtype).double()
    rel = (out.double() - rounded).flatten(1).norm(dim=1) / rounded.flatten(1).norm(dim=1)
    assert rel.max().item() <= NORM[dtype], rel.max().item()
    return ref


FEATURES = {"sinks": (True, None), "softcap": (False, 2.0), "both": (True, 2.0)}
KERNELS = {  # (query lengths, total lengths, plan)
    "decode": ([1, 1, 1], [37, 70, 9], Plan(num_kv_splits=1)),
    "split_kv": ([1, 1, 1], [37, 70, 9], Plan(num_kv_splits=3)),
    "prefill": ([1, 9, 6], [40, 30, 6], None),
}


@pytest.mark.parametrize("window", [None, 13], ids=["full", "window13"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_with_sinks_and_soft_cap_match_the_float64_reference(kernel, feature, window):
    gen = _gen(f"{kernel}-{feature}-{window}")
    has_sink, cap = FEATURES[feature]
    q_lens, seq_lens, plan = KERNELS[kernel]
    query, kc, vc, step = make_step(gen, q_lens, seq_lens, num_heads=4, num_kv_heads=2,
                                    head_size=32, block_size=8, dtype=torch.float32)
    features = dict(logits_soft_cap=cap,
                    sinks=random_sinks(gen, 4) if has_sink else None)
    out = triton_attention.paged_attention(query, kc, vc, **step, sliding_window=window,
                                           plan=plan, **features)
    ref = check(out, query, kc, vc, {**step, "sliding_window": window}, **features)
    plain = paged_attention_ref(query.double(), kc.double(), vc.double(), **step,
                                sliding_window=window)
    assert (ref - plain).abs().max() > 0.05  # the feature changes the answer a lot


def test_bf16_gqa_prefill_with_both_features_and_a_window():
    gen = _gen("bf16-prefill")
    query, kc, vc, step = make_step(gen, [5, 1, 12], [21, 33, 12], num_heads=8,
                                    num_kv_heads=2, head_size=64, block_size=16,
                                    dtype=torch.bfloat16, query_scale=4.0)
    features = dict(logits_soft_cap=5.0, sinks=random_sinks(gen, 8).to(torch.bfloat16))
    out = triton_attention.paged_attention(query, kc, vc, **step, sliding_window=7, **features)
    check(out, query, kc, vc, {**step, "sliding_window": 7}, **features)


def test_the_sink_is_added_once_by_the_merge_whatever_the_split_count():
    gen = _gen("splits")
    query, kc, vc, step = make_step(gen, [1, 1], [50, 23], num_heads=2, num_kv_heads=1,
                                    head_size=16, block_size=4, dtype=torch.float32)
    sinks = random_sinks(gen, 2)
    outs = [triton_attention.paged_attention(query, kc, vc, **step, sinks=sinks,
                                             plan=Plan(num_kv_splits=n)) for n in (1, 2, 5)]
    for out in outs:
        check(out, query, kc, vc, step, sinks=sinks)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_a_soft_cap_never_chooses_the_gluon_prefill_kernel():
    gen = _gen("gluon")
    query, kc, vc, step = make_step(gen, [64], [64], num_heads=8, num_kv_heads=2,
                                    head_size=64, block_size=16, dtype=torch.bfloat16)
    cfg = dispatch.call_config(query, kc, vc, "auto", 1, 64, soft_cap=True, arch="sm90",
                               rocm=False, num_sms=132)
    assert cfg.kernel == "triton_prefill"
    gluon = dispatch.GluonPrefillConfig(block_q=32, g_pad=4, block_n=128, num_stages=3)
    reason = dispatch.gluon_prefill_unmet(query, kc, vc, "auto", gluon, soft_cap=True)
    assert reason.startswith("gluon_ws_pingpong implements no logit soft-cap")
    # Sinks are the Gluon kernel's: what stops it here is the CPU, not the sinks.
    reason = dispatch.gluon_prefill_unmet(query, kc, vc, "auto", gluon)
    assert reason is None or "sink" not in reason, reason
    with pytest.raises(ValueError, match="implements no logit soft-cap"):
        triton_attention.paged_attention(query, kc, vc, **step, logits_soft_cap=30.0,
                                         plan=Plan(config=gluon))


@pytest.mark.parametrize(("change", "match"), [
    ({"logits_soft_cap": 0.0}, r"logits_soft_cap=0\.0 must be None or a finite float > 0"),
    ({"logits_soft_cap": float("inf")}, "logits_soft_cap=inf"),
    ({"sinks": torch.zeros(3)}, r"sinks has shape \(3,\).*\(num_heads,\) = \(4,\)"),
    ({"sinks": lambda: torch.zeros(8, device=DEVICE)[::2]}, r"strides \(2,\).*contiguous"),
], ids=["cap-zero", "cap-inf", "sinks-length", "sinks-strided"])
def test_bad_features_are_refused_before_any_kernel(change, match):
    query, kc, vc, step = make_step(_gen("refused"), [1], [9], num_heads=4, num_kv_heads=2,
                                    head_size=16, block_size=8, dtype=torch.float32)
    # A tensor made on the device (.to() of a strided CPU tensor is a dense copy there).
    change = {k: v() if callable(v) else v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in change.items()}
    with pytest.raises(ValueError, match=match):
        triton_attention.paged_attention(query, kc, vc, **step, **change)


# -- real model shapes on a GPU ---------------------------------------------------------------

#: (num_heads, num_kv_heads, head_size, window, soft-cap, sinks): one rank's layer.
MODELS = {
    "gpt-oss": (64, 8, 64, 128, None, True),
    "gemma-2": (16, 8, 256, 4096, 50.0, False),
}
#: (query lengths, total lengths): decode (split-KV by default at this batch) and prefill
#: (chunked over a cached prefix, and fresh).
PHASES = {
    "decode": ([1] * 8, [8192, 5000, 129, 4097, 6000, 8192, 300, 7000]),
    "prefill": ([1024, 2048], [3000, 2048]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("model", MODELS)
def test_real_model_layers_in_bf16_on_gpu(model, phase):
    """Each model's windowed layer with its feature, and its full-attention layer, through
    the op with the GPU's default kernel choice (split-KV for the decode batch, the Triton
    prefill tile instead of the Gluon one), against the float64 reference."""
    heads, kv_heads, head_size, window, cap, has_sink = MODELS[model]
    gen = _gen(f"{model}-{phase}")
    # Gemma's scores reach the cap only with larger queries; random ones stay near 1.
    query, kc, vc, step = make_step(gen, *PHASES[phase], num_heads=heads,
                                    num_kv_heads=kv_heads, head_size=head_size,
                                    block_size=16, dtype=torch.bfloat16,
                                    query_scale=8.0 if cap else 1.0)
    features = dict(logits_soft_cap=cap, sinks=random_sinks(gen, heads) if has_sink else None)
    for sliding_window in (window, None):
        out = triton_attention.paged_attention(query, kc, vc, **step,
                                               sliding_window=sliding_window, **features)
        ref = check(out, query, kc, vc, {**step, "sliding_window": sliding_window},
                    **features)
        plain = paged_attention_ref(query.double(), kc.double(), vc.double(), **step,
                                    sliding_window=sliding_window)
        assert (ref - plain).abs().max() > 0.05
        del ref, plain


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS)
def test_real_model_decode_through_the_backend_and_its_builder_on_gpu(model):
    """TRITON_ATTN's impl with the model's features and its builder's split plan (a CUDA
    graph capturable decode step) against the float64 reference."""
    import kvcore

    heads, kv_heads, head_size, window, cap, has_sink = MODELS[model]
    gen = _gen(f"{model}-builder")
    q_lens, seq_lens = PHASES["decode"]
    query, kc, vc, step = make_step(gen, q_lens, seq_lens, num_heads=heads,
                                    num_kv_heads=kv_heads, head_size=head_size, block_size=16,
                                    dtype=torch.bfloat16, query_scale=8.0 if cap else 1.0)
    sinks = random_sinks(gen, heads) if has_sink else None
    backend = kvcore.resolve_backend("TRITON_ATTN")
    impl = backend.get_impl_cls()(heads, head_size, head_size ** -0.5, kv_heads,
                                  sliding_window=window, logits_soft_cap=cap, sinks=sinks)
    spec = kvcore.FullAttentionSpec(block_size=16, dtype=torch.bfloat16,
                                    num_kv_heads=kv_heads, head_size=head_size)
    builder = backend.get_builder_cls()(spec, num_heads=heads, max_num_seqs=8,
                                        max_num_batched_tokens=64, max_model_len=8192,
                                        device=torch.device("cuda"))
    tables = [row[:-(-s // 16)].tolist()
              for row, s in zip(step["block_table"].cpu(), seq_lens, strict=True)]
    common = kvcore.build_attention_metadata(
        q_lens, [s - q for q, s in zip(q_lens, seq_lens, strict=True)], tables, block_size=16,
        device="cuda")
    meta = builder.build(common)
    assert meta.plan.num_kv_splits > 1  # the merge adds the sinks
    kv_cache = torch.stack([kc, vc], dim=1)
    unused = torch.empty(len(q_lens), kv_heads, head_size, dtype=torch.bfloat16, device="cuda")
    out = impl.forward(kvcore.LayerScales(), query, unused, unused, kv_cache, meta)
    check(out, query, kc, vc, {**step, "sliding_window": window}, logits_soft_cap=cap,
          sinks=sinks)
