"""TRITON_MLA's builder: persistent buffers, the decode split choice and its workspace.

The kernels run on the GPU when there is one, else under the Triton interpreter (set by the
conftest only without a GPU); CUDA-graph replays of the backend are the conformance rule
``cuda-graph-replay`` (GPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvcore_mla import TritonMLABackend
from kvcore_mla.ops import mla_attention_ref
from mla_helpers import DEVICE, assert_close, block_tables, generator, randn

import kvcore
from kvcore import ops

tma = pytest.importorskip("kvcore_mla.ops.triton_mla_attention")
TritonMLAPlan = pytest.importorskip("kvcore_mla.ops.mla_configs").TritonMLAPlan
TritonMLAMixedConfig = pytest.importorskip("kvcore_mla.ops.mla_configs").TritonMLAMixedConfig

HEADS, RANK, ROPE, PAGE, PAGES = 16, 64, 16, 8, 24
SPEC = kvcore.MLAAttentionSpec(block_size=PAGE, dtype=torch.float32, kv_lora_rank=RANK,
                               qk_rope_head_dim=ROPE)


def builder(max_model_len: int = 1024, max_num_seqs: int = 4) -> kvcore.PersistentMetadataBuilder:
    # 16 SMs on any device, so a step of one or two requests splits (a CPU counts as one).
    return TritonMLABackend.get_builder_cls()(
        SPEC, num_heads=HEADS, max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
        max_model_len=max_model_len, device=DEVICE, num_sms=16)


def decode(gen: torch.Generator, context_lens: list[int]) -> kvcore.AttentionMetadata:
    seq_lens = [c + 1 for c in context_lens]
    table = block_tables(seq_lens, PAGE, PAGES, gen).tolist()
    return kvcore.build_attention_metadata([1] * len(seq_lens), context_lens, table, PAGE,
                                           device=DEVICE)


def attend(meta: kvcore.AttentionMetadata, q: torch.Tensor, cache: torch.Tensor
           ) -> torch.Tensor:
    """The backend's latent attention with ``meta``."""
    impl = TritonMLABackend.get_impl_cls()(
        HEADS, RANK + ROPE, 0.12, kv_lora_rank=RANK, qk_nope_head_dim=16,
        qk_rope_head_dim=ROPE, v_head_dim=16,
        kv_b_proj_weight=torch.zeros(HEADS * 32, RANK, device=DEVICE))
    return impl._latent_attention(kvcore.LayerScales(), q, cache, meta)


def latent(meta: kvcore.AttentionMetadata, q: torch.Tensor, cache: torch.Tensor, rows: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's latent attention with ``meta`` and the float64 reference's first rows."""
    out = attend(meta, q, cache)
    n = rows
    expected = mla_attention_ref(q[:n].double(), cache.double(), kv_lora_rank=RANK,
                                 query_start_loc=meta.query_start_loc[:n + 1],
                                 seq_lens=meta.seq_lens[:n], block_table=meta.block_table[:n],
                                 scale=0.12)
    return out[:n], expected


def test_the_builder_needs_an_mla_spec() -> None:
    spec = kvcore.FullAttentionSpec(block_size=PAGE, dtype=torch.float32, num_kv_heads=1,
                                    head_size=RANK + ROPE)
    with pytest.raises(TypeError, match="spec must be a kvcore.MLAAttentionSpec"):
        TritonMLABackend.get_builder_cls()(spec, num_heads=HEADS, max_num_seqs=2,
                                           max_num_batched_tokens=2, max_model_len=64,
                                           device=DEVICE)


def test_graph_steps_split_by_batch_size_and_reuse_every_buffer() -> None:
    b = builder()
    gen = generator("mla-builder-buffers")
    # One request of 16 heads on 16 SMs: split.
    short = b.build(decode(gen, [3]), graph_batch_size=1)
    longer = b.build(decode(gen, [40]), graph_batch_size=1)
    assert short.plan.num_kv_splits == longer.plan.num_kv_splits == b.num_kv_splits(1) > 1
    assert short.plan.workspace is b.workspace and longer.plan.workspace is b.workspace
    fields = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    assert [getattr(short, f).data_ptr() for f in fields] == \
        [getattr(longer, f).data_ptr() for f in fields]
    # Eagerly the split count follows the step's longest request (never above the graph's).
    eager = b.build(decode(gen, [3]))
    assert eager.plan.num_kv_splits == b.num_kv_splits(1, eager.max_seq_len) <= \
        b.num_kv_splits(1)


@pytest.mark.parametrize(("context_lens", "size"), [([40], 1), ([0], 1), ([9], 2)],
                         ids=["long", "one-token", "padded"])
def test_graph_built_steps_equal_the_reference_with_empty_splits(context_lens, size) -> None:
    """Split as if every request were max_model_len long: short requests leave splits empty;
    the workspace holds stale values that must never be read; a padded step's real rows are
    right."""
    b = builder(max_model_len=1024, max_num_seqs=2)
    gen = generator("mla-builder-graph", context_lens)
    meta = b.build(decode(gen, context_lens), graph_batch_size=size)
    assert meta.plan.num_kv_splits == b.num_kv_splits(size)
    if size == 1:
        assert meta.plan.num_kv_splits > 1 and meta.plan.workspace is b.workspace
        b.workspace.fill_(float("nan"))
    q = randn((size, HEADS, RANK + ROPE), torch.float32, gen)
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen)
    out, expected = latent(meta, q, cache, len(context_lens))
    assert_close(out, expected, torch.float32, "latent output with the builder's metadata")


def test_a_marked_step_is_not_read_back_and_still_refuses_blocks_beyond_the_cache(
        monkeypatch) -> None:
    b = builder()
    gen = generator("mla-builder-facts")
    meta = b.build(decode(gen, [5, 17]))
    assert ops.checked_step_facts(meta.query_start_loc, meta.seq_lens, meta.block_table)

    def no_reads(*args, **kwargs):
        raise AssertionError("a marked step's tensors were read back")

    q = randn((2, HEADS, RANK + ROPE), torch.float32, gen)
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", no_reads)
        out = attend(meta, q, cache)
    expected = latent(meta, q, cache, 2)[1]
    assert_close(out, expected, torch.float32, "latent output")
    small = cache[:2]
    with pytest.raises(ValueError, match="block_table contains block id .*, but the cache "
                                         "has only 2 blocks"):
        tma.mla_attention(q, small, kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                          seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.12)


def test_the_op_refuses_a_workspace_it_cannot_use() -> None:
    gen = generator("mla-builder-workspace")
    meta = decode(gen, [30])
    q = randn((1, HEADS, RANK + ROPE), torch.float32, gen)
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen)
    args = dict(kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.12,
                max_query_len=1)
    needed = tma.mla_workspace_numel(1, HEADS, RANK, 2)
    # Room for the mixed kernel's rows (output and LSE padded to a multiple of 16 floats,
    # aligned stores) and, ahead of them, the decode path's LSE block (16-float aligned).
    assert needed == -(-HEADS * 2 // 16) * 16 + HEADS * 2 * -(-(RANK + 1) // 16) * 16
    with pytest.raises(ValueError, match=f"workspace has 10 elements but this call's split-KV "
                                         f"path needs {needed}"):
        tma.mla_attention(q, cache, plan=TritonMLAPlan(num_kv_splits=2, workspace=torch.empty(
            10, device=DEVICE)), **args)
    with pytest.raises(ValueError, match="workspace must be a contiguous float32 tensor"):
        tma.mla_attention(q, cache, plan=TritonMLAPlan(num_kv_splits=2, workspace=torch.empty(
            needed, dtype=torch.float16, device=DEVICE)), **args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_decode_partials_fit_the_workspace_without_overlap(dtype: torch.dtype) -> None:
    """The decode path's split buffers, carved from a workspace of mla_workspace_numel
    elements: float32 LSEs first, then the outputs in the query's 16-bit dtype (float32 for
    float32 queries), rows on 64-byte boundaries, the two regions disjoint and inside it."""
    tokens, splits, rank = 3, 5, 72  # 72 channels: rows padded (16-bit: to 96, float32: 80)
    flat = torch.zeros(tma.mla_workspace_numel(tokens, HEADS, rank, splits))
    partials, partial_lse = tma.decode_partials(flat, tokens, HEADS, rank, splits, dtype)
    assert partials.shape == (tokens, HEADS, splits, rank)
    assert partial_lse.shape == (tokens, HEADS, splits)
    assert partials.dtype == dtype and partial_lse.dtype == torch.float32
    base = flat.data_ptr()
    lse_end = partial_lse.data_ptr() - base + partial_lse.numel() * 4
    start = partials.data_ptr() - base
    assert lse_end <= start and start % 64 == 0
    assert partials.stride(2) * dtype.itemsize % 64 == 0
    end = start + (partials[-1, -1, -1, -1].data_ptr() - partials.data_ptr()) + dtype.itemsize
    assert end <= flat.numel() * 4
    partials.fill_(7)
    partial_lse.fill_(-3)
    assert (partial_lse == -3).all() and (partials == 7).all()  # neither overwrote the other


def test_a_bf16_decode_split_through_16_bit_partials_matches_the_reference() -> None:
    """bf16 queries and cache, split 3 ways through a NaN-filled workspace: the bf16 partial
    outputs add no more than bf16 rounding to the one-split result and the float64 reference."""
    gen = generator("mla-bf16-partials")
    meta = decode(gen, [120, 47])
    q = randn((2, HEADS, RANK + ROPE), torch.float32, gen).to(torch.bfloat16)
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen).to(torch.bfloat16)
    args = dict(kv_lora_rank=RANK, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.12,
                max_query_len=1)
    workspace = torch.full((tma.mla_workspace_numel(2, HEADS, RANK, 3),), float("nan"),
                           device=DEVICE)
    split = tma.mla_attention(q, cache, plan=TritonMLAPlan(num_kv_splits=3, workspace=workspace),
                              **args)
    whole = tma.mla_attention(q, cache, plan=TritonMLAPlan(num_kv_splits=1), **args)
    expected = mla_attention_ref(q.double(), cache.double(), **{
        k: v for k, v in args.items() if k != "max_query_len"})
    assert_close(split, expected, torch.bfloat16, "3 splits, bf16 partials")
    assert_close(whole, expected, torch.bfloat16, "one split")
    torch.testing.assert_close(split, whole, atol=2e-2, rtol=2e-2)


def test_forward_through_the_builder_uses_its_step_buffers(monkeypatch) -> None:
    """A layer's forward with the builder's metadata: the kernel reads the step's latent-query
    buffer (W_UK's output and q_pe beside it) and writes the step's latent-output buffer, the
    same memory every layer, and the output equals CPU_MLA's forward."""
    gen = generator(9)
    meta = decode(gen, [30, 7])
    b = builder()
    step = b.build(meta)
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen)
    query = randn((2, HEADS, 16 + ROPE), torch.float32, gen)
    weight = randn((HEADS * 32, RANK), torch.float32, gen, RANK**-0.5)
    dims = dict(kv_lora_rank=RANK, qk_nope_head_dim=16, qk_rope_head_dim=ROPE, v_head_dim=16,
                kv_b_proj_weight=weight)
    impl = TritonMLABackend.get_impl_cls()(HEADS, RANK + ROPE, 0.12, **dims)
    seen = []
    real = tma.mla_attention
    monkeypatch.setattr(tma, "mla_attention", lambda q, *a, **k: seen.append(
        (q.data_ptr(), k["output"].data_ptr())) or real(q, *a, **k))
    outs = [impl.forward(kvcore.LayerScales(), query, None, None, cache, step) for _ in range(2)]
    assert seen == [(b.step_buffers.q_latent.data_ptr(), b.step_buffers.o_latent.data_ptr())] * 2
    cpu = kvcore.get_attn_backend(
        kvcore.AttentionSelectorConfig(head_size=RANK + ROPE, dtype=torch.float32,
                                       block_size=PAGE, use_mla=True),
        backend="CPU_MLA", platform="cpu").get_impl_cls()(
            HEADS, RANK + ROPE, 0.12, **{**dims, "kv_b_proj_weight": weight.cpu()})
    expected = cpu.forward(kvcore.LayerScales(), query.cpu(), None, None, cache.cpu(),
                           kvcore.build_attention_metadata(
                               [1, 1], [30, 7], meta.block_table.cpu().tolist(), PAGE))
    for out in outs:
        assert_close(out.cpu(), expected.double(), torch.float32, "TRITON_MLA forward")


@pytest.mark.parametrize(("query_lens", "pad"), [([1, 1], 0), ([1, 1], 3), ([1, 3], 0),
                                                 ([0, 2], 0)],
                         ids=["decode", "decode-padded", "mixed", "two-tokens-and-none"])
def test_the_plan_names_the_decode_kernel_exactly_for_uniform_decode_steps(query_lens, pad):
    """The builder takes a step for decode by kvcore.is_uniform_decode (padding rows after the
    tokens change nothing), and the op, given the layer's real rows, runs the kernel the plan
    names (it refuses a plan of the other kind) with the reference's result."""
    gen = generator(11)
    context = [9, 20]
    seq_lens = [c + q for c, q in zip(context, query_lens, strict=True)]
    table = block_tables(seq_lens, PAGE, PAGES, gen).tolist()
    common = kvcore.build_attention_metadata(query_lens, context, table, PAGE, device=DEVICE)
    if pad:
        slots = torch.cat([common.slot_mapping, common.slot_mapping.new_full((pad,), -1)])
        common = dataclasses.replace(common, slot_mapping=slots)
    step = builder().build(common)
    assert (not isinstance(step.plan.config, TritonMLAMixedConfig)) is (
        kvcore.is_uniform_decode(common))
    assert kvcore.is_uniform_decode(common) is (query_lens == [1, 1])
    n = step.num_actual_tokens
    cache = randn((PAGES, PAGE, RANK + ROPE), torch.float32, gen)
    out, expected = latent(step, randn((n, HEADS, RANK + ROPE), torch.float32, gen), cache, n)
    assert_close(out, expected, torch.float32, "latent attention")
