"""The absorbed MLA pipeline of :class:`kvcore.MLACommonImpl`: ``W_UK`` and ``W_UV`` write into
the step's buffers and the layer's output (``bmm(..., out=)``), the query's rope part goes to
the kernel hook apart, and with a builder's buffers (handed over in :class:`kvcore.MLAMetadata`)
a layer's forward allocates nothing."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcore
from kvcore import MLAStepBuffers

HEADS, RANK, ROPE, NOPE, V_DIM, BLOCK = 4, 32, 8, 16, 16, 8


class _InPlaceImpl(kvcore.MLACommonImpl):
    """An MLA impl whose 'kernel' writes the step's latent output in place (the latent query's
    first channels plus its rope channels' sum)."""

    seen: list[tuple[int, ...]]

    def write_kv_cache(self, layer, key, value, kv_cache, slot_mapping) -> None:
        raise NotImplementedError

    def _latent_attention(self, layer, q, kv_cache, attn_metadata) -> torch.Tensor:
        return q[..., :RANK] + q[..., RANK:].sum(-1, keepdim=True)

    def _latent_attention_into(self, layer, views, q_pe, kv_cache, attn_metadata) -> None:
        self.seen.append((views.q_latent.data_ptr(), views.o_latent.data_ptr(),
                          q_pe.data_ptr()))
        torch.sum(q_pe, -1, keepdim=True, out=views.o_latent[..., :1])
        torch.add(views.q_nope, views.o_latent[..., :1], out=views.o_latent)


def _impl(gen: torch.Generator) -> _InPlaceImpl:
    weight = torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen, dtype=torch.float64)
    impl = _InPlaceImpl(HEADS, RANK + ROPE, 0.1, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                        qk_rope_head_dim=ROPE, v_head_dim=V_DIM, kv_b_proj_weight=weight)
    impl.seen = []
    return impl


def _step(n: int, buffers: MLAStepBuffers | None = None) -> kvcore.MLAMetadata:
    """A decode step of ``n`` requests carrying the views of ``buffers``, as an MLA builder's
    ``build`` returns it."""
    meta = kvcore.build_attention_metadata([1] * n, [3] * n, [[i] for i in range(n)], BLOCK)
    return meta.extend(kvcore.MLAMetadata,
                       mla_views=None if buffers is None else buffers.for_step(n))


def _expected(impl: _InPlaceImpl, query: torch.Tensor) -> torch.Tensor:
    """The absorbed forward written out: concatenated latent query, the kernel, W_UV."""
    q_nope, q_pe = query.split([NOPE, ROPE], -1)
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, impl.w_uk), q_pe], -1)
    return torch.einsum("thr,hrv->thv", impl._latent_attention(None, q, None, None),
                        impl.w_uv_t)


class _Allocations(TorchDispatchMode):
    """Records every op whose result is new memory: a tensor result that aliases no input
    (views, in-place and ``out=`` ops alias one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(r.alias_info is None and str(r.type) == "Tensor" for r in func._schema.returns):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_forward_with_step_buffers_allocates_nothing_and_keeps_its_intermediates():
    gen = torch.Generator().manual_seed(0)
    impl = _impl(gen)
    n = 5
    buffers = MLAStepBuffers(16, HEADS, RANK, ROPE, torch.float64, "cpu")
    meta = _step(n, buffers)
    query = torch.randn(n, HEADS, NOPE + ROPE, generator=gen, dtype=torch.float64)
    output = torch.empty(n, HEADS, V_DIM, dtype=torch.float64)
    impl.forward(kvcore.LayerScales(), query, None, None, None, meta, output=output)  # warm
    with _Allocations() as allocations:
        for _ in range(3):  # three layers of one step
            impl.forward(kvcore.LayerScales(), query, None, None, None, meta, output=output)
    assert allocations.ops == []
    for plain in (_step(n), kvcore.build_attention_metadata([1] * n, [3] * n,
                                                             [[i] for i in range(n)], BLOCK)):
        with _Allocations() as without:  # the counter sees what a call without views makes
            impl.forward(kvcore.LayerScales(), query, None, None, None, plain, output=output)
        assert without.ops == ["aten.new_empty.default"] * 2
        impl.seen.pop()
    assert len(set(impl.seen)) == 1  # the same buffers every layer
    q_latent_ptr, o_latent_ptr, q_pe_ptr = impl.seen[0]
    assert q_latent_ptr == buffers.q_latent.data_ptr()
    assert o_latent_ptr == buffers.o_latent.data_ptr()
    assert q_pe_ptr == query[..., NOPE:].data_ptr()  # the query's own rope part, no copy
    torch.testing.assert_close(output, _expected(impl, query), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("buffers", [False, True], ids=["allocated", "step-buffers"])
def test_forward_equals_the_concatenated_formula(buffers):
    """The default hook (one query tensor: ``q_pe`` copied beside the absorbed part, the
    kernel's result copied into the step's output) and the in-place hook give the formula."""
    gen = torch.Generator().manual_seed(1)
    impl = _impl(gen)
    step = _step(6, MLAStepBuffers(8, HEADS, RANK, ROPE, torch.float64, "cpu") if buffers
                 else None)
    query = torch.randn(6, HEADS, NOPE + ROPE, generator=gen, dtype=torch.float64)
    out = impl.forward(kvcore.LayerScales(), query, None, None, None, step)
    torch.testing.assert_close(out, _expected(impl, query), rtol=1e-12, atol=1e-12)
    default = kvcore.MLACommonImpl._latent_attention_into
    out_default = torch.empty_like(out)
    impl._latent_attention_into = lambda *a: default(impl, *a)
    impl.forward(kvcore.LayerScales(), query, None, None, None, step, output=out_default)
    torch.testing.assert_close(out_default, out, rtol=1e-12, atol=1e-12)


def test_views_of_another_shape_are_not_used():
    """Buffers made for other heads or dtype are passed over (the call allocates its own);
    a step larger than the buffers is refused by name."""
    gen = torch.Generator().manual_seed(2)
    impl = _impl(gen)
    buffers = MLAStepBuffers(8, HEADS, RANK, ROPE, torch.float32, "cpu")
    query = torch.randn(3, HEADS, NOPE + ROPE, generator=gen, dtype=torch.float64)
    out = impl.forward(kvcore.LayerScales(), query, None, None, None, _step(3, buffers))
    torch.testing.assert_close(out, _expected(impl, query), rtol=1e-12, atol=1e-12)
    assert impl.seen[-1][0] != buffers.q_latent.data_ptr()
    with pytest.raises(ValueError, match="num_tokens=9 exceeds the 8 rows"):
        buffers.for_step(9)


def test_backends_make_step_buffers_from_the_spec():
    spec = kvcore.MLAAttentionSpec(block_size=BLOCK, dtype=torch.bfloat16, kv_lora_rank=RANK,
                                   qk_rope_head_dim=ROPE)
    buffers = kvcore.MLACommonBackend.new_step_buffers(spec, num_heads=HEADS, max_num_tokens=7,
                                                       device="cpu")
    assert tuple(buffers.q_latent.shape) == (7, HEADS, RANK + ROPE)
    assert tuple(buffers.o_latent.shape) == (7, HEADS, RANK)
    assert buffers.q_latent.dtype == buffers.o_latent.dtype == torch.bfloat16
    views = buffers.for_step(3)
    assert views is buffers.for_step(3)  # made once per row count
    assert views.q_nope_t.shape == (HEADS, 3, RANK) and views.q_rope.shape == (3, HEADS, ROPE)
