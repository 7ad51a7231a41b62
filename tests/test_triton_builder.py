"""TRITON_ATTN's builder: persistent buffers, the split-KV choice and its workspace.

The kernels run on the GPU when there is one, else on the CPU under the Triton interpreter
(``tests/conftest.py`` sets it only without a GPU, so CPU tensors never reach a compiled
kernel); the captured-graph replays are in ``tests/test_cuda_graphs.py``."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.ops.reference import paged_attention_ref

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, HQ, HK, D = 4, 4, 2, 16


def spec(hk=HK):
    return kvcore.FullAttentionSpec(block_size=BS, dtype=torch.float32, num_kv_heads=hk,
                                    head_size=D)


def builder(max_model_len=1024, max_num_seqs=4, device="cpu", hk=HK):
    cls = kvcore.resolve_backend("TRITON_ATTN").get_builder_cls()
    return cls(spec(hk), num_heads=HQ, max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
               max_model_len=max_model_len, device=device)


def decode(context_lens, tables, device="cpu"):
    return kvcore.build_attention_metadata([1] * len(context_lens), list(context_lens),
                                           tables, BS, device=device)


def forward(meta, kv, query):
    impl = kvcore.resolve_backend("TRITON_ATTN").get_impl_cls()(
        num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=kv.shape[3])
    out = torch.full_like(query, float("nan"))
    return impl.forward(kvcore.LayerScales(), query, query, query, kv, meta, output=out)


def reference(meta, kv, query, rows):
    k, v = kv.unbind(1)
    return paged_attention_ref(query[:rows].double().cpu(), k.double().cpu(), v.double().cpu(),
                               query_start_loc=meta.query_start_loc[:rows + 1].cpu(),
                               seq_lens=meta.seq_lens[:rows].cpu(),
                               block_table=meta.block_table[:rows].cpu(), scale=D**-0.5)


def random_kv(hk=HK):
    """A random cache on ``DEVICE`` (the kernels' device: the GPU, else the interpreter)."""
    gen = torch.Generator().manual_seed(3)
    return torch.randn(12, 2, BS, hk, D, generator=gen).to(DEVICE)


@pytest.fixture
def kv():
    return random_kv()


def test_graph_split_count_depends_only_on_the_batch_size():
    b = builder()
    # On the CPU the heuristic sees one "SM": only a single request (2 KV heads) is split.
    assert [b.graph_num_kv_splits(n) for n in (1, 2, 3, 4)] == [2, 1, 1, 1]
    short = b.build(decode([0], [[5]]), graph_batch_size=1)
    assert short.plan.num_kv_splits == 2
    assert b.build(decode([0], [[5]])).plan.num_kv_splits == 1  # eagerly: by the step's length
    assert builder(max_model_len=256).graph_num_kv_splits(1) == 1


def test_an_fp8_builder_splits_more_and_sizes_its_workspace_for_it(monkeypatch):
    """On the sm90 row (132 SMs) a builder of Llama-3.1-8B's layer (Hq 32, Hk 8, D 128)
    captures 8 requests with 6 splits on an fp8 cache (3 programs per SM) and 4 on a bf16
    one (2 per SM); each workspace is the largest split decode of its own rule, so the fp8
    one is the larger."""
    from kvcore.ops import split_kv, workspace_numel

    monkeypatch.setattr(split_kv, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(split_kv, "_num_sms", lambda device_type, index: 132)
    cls = kvcore.resolve_backend("TRITON_ATTN").get_builder_cls()
    built = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        llama = kvcore.FullAttentionSpec(block_size=16, dtype=torch.bfloat16,
                                         kv_cache_dtype=kv_cache_dtype, num_kv_heads=8,
                                         head_size=128)
        built[kv_cache_dtype] = cls(llama, num_heads=32, max_num_seqs=64,
                                    max_num_batched_tokens=64, max_model_len=32768,
                                    device="cpu")
    bf16, fp8 = built["auto"], built["fp8_e4m3"]
    assert [bf16.graph_num_kv_splits(n) for n in (1, 8, 16, 64)] == [33, 4, 2, 1]
    assert [fp8.graph_num_kv_splits(n) for n in (1, 8, 16, 64)] == [49, 6, 3, 1]
    for b in (bf16, fp8):
        most = max(workspace_numel(n, 32, 128, b.graph_num_kv_splits(n)) for n in range(1, 65))
        assert tuple(t.numel() for t in b.workspace) == most
    assert bf16.workspace[0].numel() < fp8.workspace[0].numel()
    assert fp8.workspace[0].numel() >= workspace_numel(8, 32, 128, 6)[0]
    step = kvcore.build_attention_metadata([1] * 8, [5] * 8, [[i] for i in range(8)], 16,
                                           device="cpu")
    meta = fp8.build(step, graph_batch_size=8)
    assert meta.plan.num_kv_splits == 6 and meta.plan.workspace is fp8.workspace
    assert bf16.build(step, graph_batch_size=8).plan.num_kv_splits == 4


def test_builder_owns_the_workspace_and_reuses_every_buffer(kv):
    b = builder()
    assert b.workspace is not None
    first = b.build(decode([2, 5, 9], [[1], [2, 3], [4, 5, 6]]))
    second = b.build(decode([30], [[0, 1, 2, 3, 4, 5, 6, 7]]), graph_batch_size=1)
    assert second.plan.workspace is b.workspace and first.plan.workspace is None
    tensors = [first.query_start_loc, first.seq_lens, first.block_table, first.slot_mapping]
    again = [second.query_start_loc, second.seq_lens, second.block_table, second.slot_mapping]
    assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in again]


@pytest.mark.parametrize("context_lens", [[20], [0], [2, 9]], ids=["long", "one-token", "two"])
def test_graph_built_steps_equal_the_reference_with_empty_splits(context_lens):
    """A step built for a graph of 2 requests (split as if every request were max_model_len
    long) gives the reference's rows; the short requests leave splits empty. One KV head, so
    that 2 requests split on the CPU's single "SM" too."""
    kv = random_kv(hk=1)
    b = builder(max_model_len=1024, max_num_seqs=2, device=DEVICE, hk=1)
    # Each request on blocks of its own (a new token must not land in another's context).
    tables = [[3, 7, 1, 8, 0, 11][3 * i:][: -(-(c + 1) // BS)]
              for i, c in enumerate(context_lens)]
    meta = b.build(decode(context_lens, tables, DEVICE), graph_batch_size=2)
    assert meta.plan.num_kv_splits == 2  # as if each request were max_model_len long
    query = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = forward(meta, kv, query)
    n = len(context_lens)
    ref = reference(meta, kv, query, n)
    assert torch.allclose(out[:n].double().cpu(), ref, atol=1e-4, rtol=1e-4)


def test_forced_splits_use_the_workspace_and_equal_the_reference(kv):
    b = builder(device=DEVICE)
    meta = b.build(decode([13], [[4, 9, 2, 6]], DEVICE), graph_batch_size=1)
    assert meta.plan.num_kv_splits == 2 and meta.plan.workspace is b.workspace
    b.workspace[0].fill_(float("nan"))  # stale partials must be overwritten, never read
    query = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = forward(meta, kv, query)
    assert torch.allclose(out.double().cpu(), reference(meta, kv, query, 1), atol=1e-4,
                          rtol=1e-4)


def test_prefill_steps_are_never_split_and_run_the_prefill_kernel(kv):
    """A chunked prefill beside a fresh one and a decode: no split, no workspace, the prefill
    kernel's config, the reference's rows."""
    b = builder(device=DEVICE)
    meta = b.build(kvcore.build_attention_metadata([6, 5, 1], [7, 0, 20],
                                                   [[3, 7, 1, 8], [2, 5], [0, 4, 6, 9, 10, 11]],
                                                   BS, device=DEVICE))
    assert meta.plan == kvcore.ops.TritonAttentionPlan(num_kv_splits=1)
    from kvcore.ops.attention_dispatch import default_config

    assert default_config(12, 3, HQ, HK, D, 6 * BS, torch.device(DEVICE),
                          num_kv_splits=meta.plan.num_kv_splits, gluon=False).kernel == \
        "triton_prefill"
    query = torch.randn(12, HQ, D, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = forward(meta, kv, query)
    k, v = kv.unbind(1)
    ref = paged_attention_ref(query.double().cpu(), k.double().cpu(), v.double().cpu(),
                              query_start_loc=meta.query_start_loc.cpu(),
                              seq_lens=meta.seq_lens.cpu(), block_table=meta.block_table.cpu(),
                              scale=D**-0.5)
    assert torch.allclose(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)


def test_the_op_refuses_a_workspace_it_cannot_use(kv):
    from kvcore.ops import TritonAttentionPlan as Plan
    from kvcore.ops.triton_attention import paged_attention

    meta = decode([13], [[4, 9, 2, 6]], DEVICE)
    k, v = kv.unbind(1)
    query = torch.randn(1, HQ, D, device=DEVICE)
    args = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                block_table=meta.block_table, scale=0.25)
    small = (torch.empty(10, device=DEVICE), torch.empty(10, device=DEVICE))
    with pytest.raises(ValueError, match=r"plan.workspace\[0\] has 10 elements but this "
                                         "call's split-KV path needs 128"):
        paged_attention(query, k, v, plan=Plan(num_kv_splits=2, workspace=small), **args)
    wrong = (torch.empty(256, dtype=torch.float16, device=DEVICE),
             torch.empty(16, device=DEVICE))
    with pytest.raises(ValueError, match=r"plan.workspace\[0\] must be a contiguous float32"):
        paged_attention(query, k, v, plan=Plan(num_kv_splits=2, workspace=wrong), **args)
    with pytest.raises(TypeError, match="plan.workspace must be a pair of tensors"):
        paged_attention(query, k, v, **args, plan=Plan(
            num_kv_splits=2, workspace=torch.empty(256, device=DEVICE)))


def test_update_and_forward_runs_a_subclass_s_own_kernel_hooks(kv):
    # A plugin's impl over TRITON_ATTN (ROCm's aiter one) overrides attend or the op; the
    # one-call path must run them as forward does.
    seen = []

    class OwnAttend(kvcore.TritonAttentionImpl):
        def attend(self, layer, query, kv_cache, attn_metadata, output):
            seen.append("attend")
            output.zero_()

    class OwnOp(kvcore.TritonAttentionImpl):
        @staticmethod
        def paged_attention(query, key_cache, value_cache, **kwargs):
            seen.append("paged_attention")
            kwargs["output"].zero_()

    class OwnWrite(OwnOp):
        def write_kv_cache(self, layer, key, value, kv_cache, slot_mapping):
            seen.append("write_kv_cache")

    meta = decode([5], [[1, 2]], DEVICE)
    query = torch.randn(1, HQ, D, device=DEVICE)
    for cls in (OwnAttend, OwnOp, OwnWrite):
        impl = cls(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK)
        out = impl.update_and_forward(kvcore.LayerScales(), query, query[:, :HK], query[:, :HK],
                                      kv.clone(), meta, output=torch.ones_like(query))
        assert not out.any()
    assert seen == ["attend", "paged_attention", "write_kv_cache", "paged_attention"]
