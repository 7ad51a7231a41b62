"""A sliding window on a non-causal layer is symmetric: a query sees the keys with
``|q_pos - k_pos| < sliding_window`` (bidirectional windows, e.g. EmbeddingGemma), where a
causal layer sees ``0 <= q_pos - k_pos < sliding_window``. Checked against a dense float64
computation written here, for the reference op, CPU_ATTN's torch path, the Triton prefill
and split-KV kernels (on the GPU, else under the interpreter) and an encoder-only layer."""

from __future__ import annotations

import pytest
import torch

import kvcore
import kvcore.ops
from kvcore.ops import paged_attention_ref, paged_attention_torch
from kvcore.testing import random_block_tables

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")

HEADS, KV_HEADS, D, BS = 4, 2, 16, 8
#: Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(q_lens, ctx_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    num_blocks = sum(-(-s // BS) for s in seq_lens) + 3
    tables = random_block_tables(seq_lens, BS, num_blocks, gen)
    meta = kvcore.build_attention_metadata(q_lens, ctx_lens, tables, BS, causal=False)
    kc = torch.randn(num_blocks, BS, KV_HEADS, D, generator=gen)
    vc = torch.randn(num_blocks, BS, KV_HEADS, D, generator=gen)
    query = torch.randn(meta.num_actual_tokens, HEADS, D, generator=gen)
    return meta, query, kc, vc, tables


def _expected(meta, query, kc, vc, tables, window, block_size=BS):
    """Dense float64 attention, mask written out: same request, |q_pos - k_pos| < window."""
    out = []
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        slots = [tables[i][p // block_size] * block_size + p % block_size
                 for p in range(seq_len)]
        k = kc.flatten(0, 1)[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
        v = vc.flatten(0, 1)[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
        q = query[starts[i]:starts[i + 1]].double()
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = (q_pos - k_pos).abs() < window
        scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(out)


def _torch(query, kc, vc, meta, window, **_):
    return paged_attention_torch(query, kc, vc, query_start_loc=meta.query_start_loc,
                                 seq_lens=meta.seq_lens, block_table=meta.block_table,
                                 scale=D**-0.5, causal=False, sliding_window=window)


def _reference(query, kc, vc, meta, window, **_):
    return paged_attention_ref(query.double(), kc.double(), vc.double(),
                               query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                               block_table=meta.block_table, scale=D**-0.5, causal=False,
                               sliding_window=window)


def _triton(query, kc, vc, meta, window, splits=None):
    def on(t):
        return t.to(DEVICE)

    return triton_attention.paged_attention(
        on(query), on(kc), on(vc), query_start_loc=on(meta.query_start_loc),
        seq_lens=on(meta.seq_lens), block_table=on(meta.block_table), scale=D**-0.5,
        causal=False, sliding_window=window,
        plan=kvcore.ops.TritonAttentionPlan(num_kv_splits=splits)).cpu()


@pytest.mark.parametrize("window", [1, 5, 40, 90], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("path", ["reference", "torch", "triton-prefill", "triton-split"])
def test_non_causal_windows_are_symmetric(path, window):
    # A prefill with a cached prefix, a fresh one longer than the tiles, a decode.
    meta, query, kc, vc, tables = _batch([37, 150, 1], [20, 0, 9], seed=window)
    fn = {"reference": _reference, "torch": _torch, "triton-prefill": _triton,
          "triton-split": lambda *a: _triton(*a, splits=3)}[path]
    out = fn(query, kc, vc, meta, window)
    expected = _expected(meta, query, kc, vc, tables, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_causal_windows_keep_their_one_sided_meaning():
    """The same step, causal: the torch path equals the reference, which keeps the query and
    the window - 1 keys before it (no key after the query)."""
    _, query, kc, vc, tables = _batch([37, 1], [20, 9], seed=7)
    meta = kvcore.build_attention_metadata([37, 1], [20, 9], tables, BS)
    kwargs = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                  block_table=meta.block_table, scale=D**-0.5, causal=True, sliding_window=6)
    ref = paged_attention_ref(query.double(), kc.double(), vc.double(), **kwargs)
    torch.testing.assert_close(paged_attention_torch(query, kc, vc, **kwargs).double(), ref,
                               atol=2e-5, rtol=2e-5)
    # The first query of the prefill (position 20) sees keys 15..20 only.
    q = query[0].double()
    slots = [tables[0][p // BS] * BS + p % BS for p in range(15, 21)]
    k = kc.flatten(0, 1)[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
    v = vc.flatten(0, 1)[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
    probs = (torch.einsum("hd,khd->hk", q, k) * D**-0.5).softmax(-1)
    torch.testing.assert_close(ref[0], torch.einsum("hk,khd->hd", probs, v))


@pytest.mark.parametrize("name", ["CPU_ATTN", "TRITON_ATTN"])
def test_encoder_only_layers_get_the_symmetric_window(name):
    backend = kvcore.resolve_backend(name)
    impl = backend.get_impl_cls()(num_heads=HEADS, head_size=D, scale=D**-0.5,
                                  num_kv_heads=KV_HEADS, sliding_window=6,
                                  attn_type=kvcore.AttentionType.ENCODER_ONLY)
    device = "cpu" if name == "CPU_ATTN" else DEVICE
    gen = torch.Generator().manual_seed(11)
    q_lens = [30, 9]
    meta = kvcore.build_attention_metadata(q_lens, [0, 0], [[0, 1, 2, 3], [4, 5]], BS,
                                           device=device)
    n = sum(q_lens)
    query = torch.randn(n, HEADS, D, generator=gen)
    key, value = torch.randn(n, KV_HEADS, D, generator=gen), torch.randn(n, KV_HEADS, D,
                                                                         generator=gen)
    caches = kvcore.allocate_kv_caches(backend, num_layers=1, num_blocks=8, block_size=BS,
                                       num_kv_heads=KV_HEADS, head_size=D,
                                       dtype=torch.float32, device=device)
    out = impl.forward(kvcore.LayerScales(), query.to(device), key.to(device),
                       value.to(device), caches.layers[0], meta).cpu()
    meta = kvcore.build_attention_metadata(q_lens, [0, 0], [[0, 1, 2, 3], [4, 5]], BS)
    # The step's own tokens, as a cache of one-token blocks in order.
    kc, vc = key.view(n, 1, KV_HEADS, D), value.view(n, 1, KV_HEADS, D)
    tables = [list(range(0, 30)), list(range(30, 39))]
    expected = _expected(meta, query, kc, vc, tables, 6, block_size=1)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_a_backend_that_cannot_cut_both_edges_refuses_with_its_declared_reason():
    """FLASHINFER's window is one-sided: it declares NON_CAUSAL_WINDOW_UNSUPPORTED and its
    impl refuses a window on an encoder-only layer (construction) and on a non-causal step
    (forward, before anything runs); causal windowed layers are unaffected."""
    backend = kvcore.resolve_backend("FLASHINFER")
    reason = backend.NON_CAUSAL_WINDOW_UNSUPPORTED
    assert reason and reason.endswith("run such layers on FLASH_ATTN or TRITON_ATTN")
    impl_cls = backend.get_impl_cls()
    kwargs = dict(num_heads=HEADS, head_size=64, scale=0.125, num_kv_heads=KV_HEADS,
                  sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding_window=8 on a non-causal layer: FLASHINFER "
                                         r"cannot run it: FlashInfer's window \(window_left\) "
                                         "is one-sided"):
        impl_cls(**kwargs, attn_type=kvcore.AttentionType.ENCODER_ONLY)
    impl = impl_cls(**kwargs)
    meta = kvcore.build_attention_metadata([3], [0], [[0]], 16, causal=False)
    q = torch.randn(3, HEADS, 64)
    with pytest.raises(ValueError, match="on a non-causal layer: FLASHINFER cannot run it"):
        impl.forward(kvcore.LayerScales(), q, q[:, :KV_HEADS], q[:, :KV_HEADS],
                     torch.zeros(2, 2, 16, KV_HEADS, 64), meta)
    # Backends that declare nothing run the symmetric window.
    kvcore.resolve_backend("CPU_ATTN").check_non_causal_window(8, causal=False)
    backend.check_non_causal_window(8, causal=True)
    backend.check_non_causal_window(None, causal=False)
