"""The FLASHINFER and FLASH_ATTN glue on CPU, against stand-ins for the libraries.

None of the libraries runs here (no GPU). Each stand-in implements the library's *documented*
contract independently of kvcore — FlashInfer's ragged page lists (``indptr``, ``indices``,
``last_page_len``) and ``window_left``; flash-attn 2's ``cu_seqlens_k``, ``block_table`` and
``window_size``; flash-attn-4's ``seqused_k``, int32 ``page_table``, ``window_size`` with
``None`` for unbounded and its ``(out, lse)`` result; both with bottom-right causal alignment —
and refuses what the library refuses. The backends must then agree with kvcore's float64
reference on caches in their own stride order: that checks how they translate kvcore's metadata
and strides, not the libraries' kernels (those are checked on the GPU).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from kvcore_nvidia.backends import flash_attn as fa_backend
from kvcore_nvidia.backends import flashinfer as fi_backend
from kvcore_nvidia.backends.flash_attn import FlashAttentionBackend
from kvcore_nvidia.backends.flashinfer import FlashInferBackend
from kvcore_nvidia.backends.flashinfer_pages import flashinfer_page_table
from nvidia_helpers import REL_ERR, mixed_batch, plan_lists, reference, rel_err

import kvcore
from kvcore.testing import contiguous_attention_ref


def _allowed(s_q: int, s_k: int, causal: bool, left: int | None = None,
             right: int | None = None) -> torch.Tensor:
    """The ``(s_q, s_k)`` keys each query sees, query rows aligned to the end of the keys
    (both libraries' convention): up to itself when ``causal``, at most ``left`` before and
    (not causal) ``right`` after it; ``None`` is unbounded."""
    qi, kj = torch.arange(s_q)[:, None] + s_k - s_q, torch.arange(s_k)[None, :]
    allowed = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        allowed &= kj <= qi
    if left is not None:
        allowed &= kj >= qi - left
    if right is not None and not causal:
        allowed &= kj <= qi + right
    return allowed


def _paged_varlen(q, k, v, cu_seqlens_q, kv_lens, max_seqlen_q, max_seqlen_k, block_table,
                  scale, causal, left, right):
    """The paged varlen forward both flash-attn libraries document: request ``b`` has query
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and its first ``kv_lens[b]`` keys in the
    pages of ``block_table[b]``."""
    page = k.shape[1]
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        s_q, s_k = rows.stop - rows.start, int(kv_lens[b])
        assert s_q <= max_seqlen_q and s_k <= max_seqlen_k
        pages = block_table[b, : -(-s_k // page)].long()
        keys, values = k[pages].flatten(0, 1)[:s_k], v[pages].flatten(0, 1)[:s_k]
        out[rows] = contiguous_attention_ref(
            q[rows], keys, values, scale,
            allowed=_allowed(s_q, s_k, causal, left, right)).to(q.dtype)
    return out


class _FakeWrapper:
    """FlashInfer's paged wrappers as documented: ``plan`` takes the ragged page lists,
    ``run`` reads pages ``indices[indptr[b]:indptr[b+1]]``, the last one holding
    ``last_page_len[b]`` tokens."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **kwargs: object) -> None:
        assert kv_layout == "NHD" and kwargs.get("backend") == "fa2"
        self.decode = "use_tensor_cores" in kwargs
        self.planned: dict[str, object] = {}

    def plan(self, *args: object, **kwargs: object) -> None:
        qo, indptr, indices, last, page = plan_lists(self.decode, args, kwargs)
        self.planned = dict(qo=qo.cpu(), indptr=indptr.cpu(), indices=indices.cpu(),
                            last=last.cpu(), page=page, **kwargs)

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        p = self.planned
        for b in range(p["indptr"].numel() - 1):
            pages = p["indices"][p["indptr"][b]:p["indptr"][b + 1]]
            s_k = (pages.numel() - 1) * p["page"] + int(p["last"][b]) if pages.numel() else 0
            rows = slice(int(p["qo"][b]), int(p["qo"][b + 1]))
            s_q = rows.stop - rows.start
            k = k_cache[pages].flatten(0, 1)[:s_k]
            v = v_cache[pages].flatten(0, 1)[:s_k]
            left = p["window_left"] if p["window_left"] >= 0 else None
            out[rows] = contiguous_attention_ref(
                q[rows], k, v, p["sm_scale"],
                allowed=_allowed(s_q, s_k, p["causal"], left)).to(out.dtype)
        return out


def _fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale, causal, window_size, block_table):
    """flash-attn 2's paged varlen forward as its docstring states it."""
    if k.shape[1] % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    left, right = (None if w < 0 else w for w in window_size)  # unbounded is -1
    return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                         max_seqlen_q, max_seqlen_k, block_table, softmax_scale, causal,
                         left, right)


def _fake_flash_attn_4_varlen_func(q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                                   max_seqlen_k, page_table, softmax_scale, causal,
                                   window_size):
    """flash-attn-4's paged varlen forward as ``flash_attn.cute.interface`` states it."""
    assert page_table.dtype == cu_seqlens_q.dtype == seqused_k.dtype == torch.int32
    assert page_table.stride(-1) == 1 and page_table.shape[0] == seqused_k.shape[0]
    assert k.shape == v.shape and k.dim() == 4  # (num_pages, page_size, nheads_k, headdim)
    align = 16 // k.element_size()
    for t in (k, v):  # anything else it would copy (maybe_contiguous)
        assert t.stride(-1) == 1 and all(st % align == 0 for st in t.stride()[:-1])
        assert t.data_ptr() % 16 == 0
    left, right = window_size  # unbounded is None
    return _paged_varlen(q, k, v, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                         page_table, softmax_scale, causal, left, right), None


def _use_library(monkeypatch: pytest.MonkeyPatch, library: str) -> None:
    kernels = next(k for k in FlashAttentionBackend.KERNELS if k.library == library)
    monkeypatch.setattr(fa_backend, "device_kernels", lambda device: kernels)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
                                   BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    fi_backend._wrappers.cache_clear()
    yield
    fi_backend._wrappers.cache_clear()


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    _use_library(monkeypatch, "flash-attn 2")


@pytest.fixture
def fake_flash_attn_4(monkeypatch):
    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_varlen_func = _fake_flash_attn_4_varlen_func
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    _use_library(monkeypatch, "flash-attn-4")


def _cache(backend: type[kvcore.AttentionBackend], shape: tuple[int, ...],
           gen: torch.Generator) -> torch.Tensor:
    """A random ``shape`` cache laid out in ``backend``'s stride order (its logical view)."""
    order = backend.get_kv_cache_stride_order()
    storage = torch.randn([shape[d] for d in order], generator=gen)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return storage.permute(inverse)


def _run(backend: type[kvcore.AttentionBackend], block_size: int, num_blocks: int,
         sliding_window: int | None, causal: bool, shape: dict, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv_cache = _cache(backend, (num_blocks, 2, block_size, 2, 32), gen)
    impl = backend.get_impl_cls()(num_heads=8, head_size=32, scale=32**-0.5, num_kv_heads=2,
                                  sliding_window=sliding_window)
    batch = mixed_batch(impl, kv_cache, gen, causal=causal, **shape)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                 batch.meta, output=out)
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]


MIXED = dict(q_lens=(1, 1, 19, 7, 0), ctx_lens=(37, 15, 16, 0, 5))
DECODE = dict(q_lens=(1, 1, 1), ctx_lens=(37, 15, 0))


@pytest.mark.parametrize(("shape", "causal", "window"), [
    (MIXED, True, None), (MIXED, False, None), (MIXED, True, 6), (DECODE, True, None),
    (DECODE, True, 6)], ids=["mixed", "mixed-noncausal", "mixed-window", "decode",
                             "decode-window"])
def test_flashinfer_glue_matches_the_reference(fake_flashinfer, shape, causal, window):
    _run(FlashInferBackend, 16, 24, window, causal, shape, seed=1)


def test_flashinfer_refuses_a_window_on_non_causal_layers(fake_flashinfer):
    """FlashInfer's window_left is one-sided; the symmetric window of a non-causal layer is
    refused with the backend's declared reason instead of computed wrong."""
    with pytest.raises(ValueError, match="on a non-causal layer: FLASHINFER cannot run it"):
        _run(FlashInferBackend, 16, 24, 6, False, MIXED, seed=1)


def test_flashinfer_plans_the_decode_wrapper_only_for_one_token_per_request(fake_flashinfer):
    impl = FlashInferBackend.get_impl_cls()(num_heads=8, head_size=32, scale=1.0,
                                            num_kv_heads=2)
    key_cache = torch.zeros(8, 16, 2, 32)
    for q_lens, decode in (((1, 1), True), ((1, 2), False), ((1, 0), False)):
        meta = kvcore.build_attention_metadata(list(q_lens), [3, 4], [[0], [1]], 16)
        q = torch.zeros(meta.num_actual_tokens, 8, 32)
        assert impl.plan(q, key_cache, meta).decode is decode


def test_flashinfer_page_table_of_a_mixed_batch():
    meta = kvcore.build_attention_metadata([1, 3, 0, 2], [16, 30, 0, 0], [[7, 2], [4, 5, 6], [],
                                                                          [9]], 16)
    indptr, indices, last = flashinfer_page_table(meta, 16)
    assert indptr.tolist() == [0, 2, 5, 5, 6]
    assert indices.tolist() == [7, 2, 4, 5, 6, 9]
    assert last.tolist() == [1, 1, 0, 2]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 100),
                                                (False, 100)])
def test_flash_attn_glue_matches_the_reference(fake_flash_attn, causal, window):
    shape = dict(q_lens=(1, 40, 300), ctx_lens=(700, 256, 0))
    _run(FlashAttentionBackend, 256, 12, window, causal, shape, seed=2)


@pytest.mark.parametrize(("shape", "causal", "window", "block_size"), [
    (MIXED, True, None, 16), (MIXED, False, None, 16), (MIXED, True, 6, 16),
    (MIXED, False, 6, 16), (DECODE, True, None, 16), (DECODE, True, 6, 16),
    (MIXED, True, None, 5)], ids=[
    "mixed", "mixed-noncausal", "mixed-window", "mixed-noncausal-window", "decode",
    "decode-window", "mixed-block5"])
def test_flash_attn_4_glue_matches_the_reference(fake_flash_attn_4, shape, causal, window,
                                                 block_size):
    _run(FlashAttentionBackend, block_size, 40, window, causal, shape, seed=4)


def test_flash_attn_4_glue_through_the_builder(fake_flash_attn_4):
    gen = torch.Generator().manual_seed(5)
    kv_cache = _cache(FlashAttentionBackend, (40, 2, 16, 2, 32), gen)
    impl = FlashAttentionBackend.get_impl_cls()(num_heads=8, head_size=32, scale=32**-0.5,
                                                num_kv_heads=2)
    batch = mixed_batch(impl, kv_cache, gen, **MIXED)
    spec = kvcore.FullAttentionSpec(block_size=16, dtype=torch.float32, num_kv_heads=2,
                                    head_size=32)
    builder = FlashAttentionBackend.get_builder_cls()(
        spec, num_heads=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
        device="cpu")
    meta = builder.build(batch.meta)
    assert meta.seq_lens.data_ptr() == builder.seq_lens.data_ptr()  # persistent buffers
    assert meta.cu_seqlens_k.tolist() == [0, *torch.cumsum(batch.meta.seq_lens, 0).tolist()]
    out = impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                       meta)
    assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]


def test_flash_attn_4_refuses_a_cache_it_would_copy(fake_flash_attn_4):
    impl = FlashAttentionBackend.get_impl_cls()(num_heads=2, head_size=12, scale=1.0,
                                                num_kv_heads=1)
    kv_cache = torch.zeros(4, 2, 16, 1, 12, dtype=torch.float16)  # strides of 12 elements
    meta = kvcore.build_attention_metadata([1], [3], [[1]], 16)
    q = torch.zeros(1, 2, 12, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"key_cache has strides \(384, 12, 12, 1\).*multiples "
                                         r"of 8 elements"):
        impl.forward(kvcore.LayerScales(), q, q[:, :1], q[:, :1], kv_cache, meta)


def test_flash_attn_refuses_a_cpu_cache_without_a_library():
    impl = FlashAttentionBackend.get_impl_cls()(num_heads=2, head_size=16, scale=1.0,
                                                num_kv_heads=1)
    kv_cache = torch.zeros(4, 2, 16, 1, 16)
    meta = kvcore.build_attention_metadata([1], [3], [[1]], 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="FLASH_ATTN runs on CUDA devices only, got cpu"):
        impl.forward(kvcore.LayerScales(), q, q[:, :1], q[:, :1], kv_cache, meta)


def test_flashinfer_plans_once_per_step_and_replans_when_anything_changes(fake_flashinfer,
                                                                          monkeypatch):
    plans = []
    plan = _FakeWrapper.plan
    monkeypatch.setattr(_FakeWrapper, "plan",
                        lambda self, *a, **kw: (plans.append(kw["window_left"]),
                                                plan(self, *a, **kw)))
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(24, 2, 16, 2, 32, generator=gen)

    def layer(window: int | None) -> kvcore.AttentionImpl:
        return FlashInferBackend.get_impl_cls()(num_heads=8, head_size=32, scale=32**-0.5,
                                                num_kv_heads=2, sliding_window=window)

    plain, windowed = layer(None), layer(6)
    batch = mixed_batch(plain, kv_cache, gen, **MIXED)

    def forward(impl: kvcore.AttentionImpl, meta: kvcore.AttentionMetadata) -> None:
        out = impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                           meta)
        assert rel_err(out, reference(impl, batch, kv_cache)) < REL_ERR[torch.float32]

    for _ in range(3):  # three layers of one step: one plan
        forward(plain, batch.meta)
    assert plans == [-1]
    forward(windowed, batch.meta)  # another window: another plan
    forward(plain, batch.meta)     # one entry: planned again
    assert plans == [-1, 5, -1]
    batch.meta.seq_lens.add_(0)    # refilled in place (same values): the version moved
    forward(plain, batch.meta)
    forward(plain, dataclasses.replace(batch.meta))  # a new metadata object
    assert plans == [-1, 5, -1, -1, -1]
