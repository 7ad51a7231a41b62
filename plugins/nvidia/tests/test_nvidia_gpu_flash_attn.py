"""FLASH_ATTN on an NVIDIA GPU with flash-attn-4 (Hopper/Blackwell) at real sizes (Hq 32,
Hk 8, D 128, bf16): decode, prefill and mixed batches and a sliding window against the float64
reference, through the builder and without it, at block sizes 16, 64 and 128; its cross-layer
order bit-exact with untouched neighbours; a layer over 2**31 elements; a decode step replayed
from a CUDA graph; kvcore's conformance cases.

The cross-layer and graph tests are the evidence for opting in (``CROSS_LAYER_PLATFORMS``,
``CUDA_GRAPH_SUPPORT``): they run whatever the backend declares today."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends.flash_attn import FlashAttentionBackend, module_installed
from nvidia_helpers import mixed_batch, random_caches, reference, rel_err

import kvcore
from kvcore.testing import conformance_cases

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_SIZE, NUM_BLOCKS = 32, 8, 128, 8192
#: ||out - ref|| / ||ref|| of a bf16 kernel against float64.
BF16_REL_ERR = 1e-2


def _fa4_reason() -> str | None:
    if not module_installed("flash_attn.cute"):
        return "flash-attn-4 is not installed (pip install 'kvcore-nvidia[flash-attn]')"
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = kvcore.DeviceCapability(*torch.cuda.get_device_capability())
    kernels = FlashAttentionBackend.kernels_for(capability)
    if kernels is None or kernels.library != "flash-attn-4":
        return f"flash-attn-4 has no paged kernels on device capability {capability}"
    return None


needs_fa4 = pytest.mark.skipif(_fa4_reason() is not None, reason=str(_fa4_reason()))

MIXED = dict(q_lens=(1, 1, 300, 257, 1), ctx_lens=(1000, 15, 64, 0, 4095))
DECODE = dict(q_lens=(1,) * 48, ctx_lens=tuple(range(40, 48 * 97, 97)))
PREFILL = dict(q_lens=(512, 77, 1024), ctx_lens=(0, 3000, 16))
SHAPES = {"mixed": MIXED, "decode": DECODE, "prefill": PREFILL}


def _impl(sliding_window: int | None = None) -> kvcore.AttentionImpl:
    return FlashAttentionBackend.get_impl_cls()(
        num_heads=HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS,
        sliding_window=sliding_window)


def _random(caches: kvcore.KVCaches, gen: torch.Generator) -> kvcore.KVCaches:
    caches.storage.copy_(torch.randn(caches.storage.shape, generator=gen).to(torch.bfloat16))
    return caches


def _cache(gen: torch.Generator, block_size: int = 16, num_blocks: int = NUM_BLOCKS
           ) -> torch.Tensor:
    return random_caches(FlashAttentionBackend, gen, num_layers=1, num_blocks=num_blocks,
                         block_size=block_size, num_kv_heads=KV_HEADS,
                         head_size=HEAD_SIZE).layers[0]


def _cross_layer_cache(gen: torch.Generator, num_layers: int = 3) -> kvcore.KVCaches:
    """FLASH_ATTN's own cross-layer order (``B,L,N,2,H,D``), allocated whether or not the
    backend opts in on CUDA yet (this is the evidence for opting in)."""
    layout = kvcore.KVCacheLayout.from_backend(
        FlashAttentionBackend, num_blocks=NUM_BLOCKS, block_size=16, num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE, dtype=torch.bfloat16, num_layers=num_layers, cross_layer=True)
    storage = torch.zeros(layout.physical_shape, dtype=torch.bfloat16, device="cuda")
    logical = storage.permute(layout.inverse_stride_order())
    return _random(kvcore.KVCaches(list(logical.unbind(0)), storage, layout, "FLASH_ATTN"), gen)


def _forward(impl: kvcore.AttentionImpl, batch, kv_cache: torch.Tensor,
             meta: kvcore.AttentionMetadata | None = None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value, kv_cache,
                 batch.meta if meta is None else meta, output=out)
    return out


def _builder(block_size: int = 16, max_num_seqs: int = 64, max_tokens: int = 4096,
             max_model_len: int = 8192) -> kvcore.AttentionMetadataBuilder:
    spec = kvcore.FullAttentionSpec(block_size=block_size, dtype=torch.bfloat16,
                                    num_kv_heads=KV_HEADS, head_size=HEAD_SIZE)
    return FlashAttentionBackend.get_builder_cls()(
        spec, num_heads=HEADS, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
        max_model_len=max_model_len, device="cuda")


@needs_fa4
@pytest.mark.parametrize(("shape", "causal", "window", "block_size"), [
    ("mixed", True, None, 16), ("decode", True, None, 16), ("prefill", True, None, 16),
    ("mixed", True, 256, 16), ("decode", True, 256, 16), ("mixed", False, None, 16),
    ("mixed", True, None, 64), ("decode", True, None, 64), ("mixed", True, None, 128),
    ("decode", True, None, 128)],
    ids=["mixed", "decode", "prefill", "mixed-window", "decode-window", "mixed-noncausal",
         "mixed-b64", "decode-b64", "mixed-b128", "decode-b128"])
def test_flash_attn_matches_float64_reference(shape, causal, window, block_size):
    gen = torch.Generator().manual_seed(hash((shape, causal, window, block_size)) % 2**31)
    kv_cache = _cache(gen, block_size, NUM_BLOCKS * 16 // block_size)
    impl = _impl(window)
    batch = mixed_batch(impl, kv_cache, gen, causal=causal, **SHAPES[shape])
    ref = reference(impl, batch, kv_cache)
    assert rel_err(_forward(impl, batch, kv_cache), ref) < BF16_REL_ERR
    meta = _builder(block_size).build(batch.meta)
    assert meta.kernels.library == "flash-attn-4"
    assert rel_err(_forward(impl, batch, kv_cache, meta), ref) < BF16_REL_ERR


@needs_fa4
@pytest.mark.parametrize("shape", ["mixed", "decode"])
def test_flash_attn_on_a_cross_layer_view_is_bit_exact(shape):
    """The evidence for FLASH_ATTN's cross-layer opt-in on CUDA: on layer 1 of a 3-layer
    ``B,L,N,2,H,D`` pool, the write and the forward give exactly what they give on a contiguous
    per-layer copy, and layers 0 and 2 are untouched."""
    gen = torch.Generator().manual_seed(7 if shape == "mixed" else 8)
    caches = _cross_layer_cache(gen)
    view = caches.layers[1]
    plain = kvcore.allocate_kv_caches(
        FlashAttentionBackend, num_layers=1, num_blocks=NUM_BLOCKS, block_size=16,
        num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
        device="cuda").layers[0]
    plain.copy_(view)
    neighbours = [caches.layers[i].clone() for i in (0, 2)]
    impl = _impl()
    batch = mixed_batch(impl, view, gen, **SHAPES[shape])  # writes into the view
    impl.do_kv_cache_update(kvcore.LayerScales(), batch.key, batch.value, plain,
                            batch.meta.slot_mapping)
    assert torch.equal(view, plain)
    assert torch.equal(_forward(impl, batch, view), _forward(impl, batch, plain))
    assert all(torch.equal(caches.layers[i], n) for i, n in zip((0, 2), neighbours, strict=True))


@needs_fa4
def test_flash_attn_beyond_2_pow_31_elements():
    """Requests in the last blocks of a 4.3 GB layer read and write the right pages."""
    page = 2 * 16 * KV_HEADS * HEAD_SIZE
    num_blocks = 2**31 // page + 8
    gen = torch.Generator().manual_seed(9)
    kv_cache = kvcore.allocate_kv_caches(
        FlashAttentionBackend, num_layers=1, num_blocks=num_blocks, block_size=16,
        num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
        device="cuda").layers[0]
    tables = [[num_blocks - 1, num_blocks - 3], [num_blocks - 2, 5]]
    used = sorted({b for t in tables for b in t})
    kv_cache[used] = torch.randn(len(used), 2, 16, KV_HEADS, HEAD_SIZE,
                                 generator=gen).to(torch.bfloat16).cuda()
    impl = _impl()
    meta = kvcore.build_attention_metadata([20, 1], [0, 30], tables, 16, device="cuda")
    n = meta.num_actual_tokens
    q, k, v = (torch.randn(n, h, HEAD_SIZE, generator=gen).to(torch.bfloat16).cuda()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    impl.do_kv_cache_update(kvcore.LayerScales(), k, v, kv_cache, meta.slot_mapping)
    out = impl.forward(kvcore.LayerScales(), q, k, v, kv_cache, meta)
    compact = kv_cache[torch.tensor(used, device="cuda")]
    renumber = {b: i for i, b in enumerate(used)}
    compact_meta = kvcore.build_attention_metadata(
        [20, 1], [0, 30], [[renumber[b] for b in t] for t in tables], 16, device="cuda")
    ref = kvcore.ops.paged_attention_ref(
        q.double(), *(c.double() for c in compact.unbind(1)),
        query_start_loc=compact_meta.query_start_loc, seq_lens=compact_meta.seq_lens,
        block_table=compact_meta.block_table, scale=impl.scale)
    assert rel_err(out, ref) < BF16_REL_ERR


@needs_fa4
def test_flash_attn_decode_replays_from_a_cuda_graph():
    """The evidence for ``CUDA_GRAPH_SUPPORT = UNIFORM_DECODE``: a decode step captured for 8
    requests replays 5- and 8-request steps with other lengths and block tables exactly as
    the same steps run eagerly on the same metadata, and close to the reference."""
    gen = torch.Generator().manual_seed(10)
    kv_cache = _cache(gen)
    impl = _impl()
    builder = _builder(max_num_seqs=8, max_tokens=8, max_model_len=4096)
    out = torch.zeros(8, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")

    def step(inputs: dict[str, torch.Tensor], meta: kvcore.AttentionMetadata) -> torch.Tensor:
        rows = inputs["query"].shape[0]
        impl.do_kv_cache_update(kvcore.LayerScales(), inputs["key"], inputs["value"], kv_cache,
                                meta.slot_mapping)
        impl.forward(kvcore.LayerScales(), inputs["query"], inputs["key"], inputs["value"],
                     kv_cache, meta, output=out[:rows])
        return out[:rows] * 1  # a fresh tensor the graph owns

    runner = kvcore.CudaGraphRunner(builder, step, num_blocks=NUM_BLOCKS, batch_sizes=[8])
    example = {"query": torch.zeros(1, HEADS, HEAD_SIZE), "key": torch.zeros(1, KV_HEADS,
               HEAD_SIZE), "value": torch.zeros(1, KV_HEADS, HEAD_SIZE)}
    runner.capture({k: v.to("cuda", torch.bfloat16) for k, v in example.items()})
    for requests, lengths in ((5, (100, 4000, 17, 1, 2048)), (8, (3000,) * 8)):
        batch = mixed_batch(impl, kv_cache, gen, q_lens=(1,) * requests,
                            ctx_lens=tuple(x - 1 for x in lengths))
        inputs = {"query": batch.query, "key": batch.key, "value": batch.value}
        replayed = runner.run(inputs, batch.meta).clone()
        padded = {k: torch.cat([v, v.new_zeros((8 - requests, *v.shape[1:]))])
                  for k, v in inputs.items()}
        eager = step(padded, builder.build(batch.meta, graph_batch_size=8))[:requests]
        assert torch.equal(replayed, eager)
        assert rel_err(replayed, reference(impl, batch, kv_cache)) < BF16_REL_ERR
    assert runner.replayed_steps == 2


def _bf16_cases() -> list:
    return [c for c in conformance_cases(FlashAttentionBackend, ["cuda"])
            if "-fp16-" not in f"{c.id}-"]


@needs_fa4
@pytest.mark.parametrize("case", _bf16_cases(), ids=str)
def test_flash_attn_conforms(case):
    case.run()


@pytest.mark.parametrize("shape", ["mixed", "decode"])
def test_flex_attention_on_a_cross_layer_view_is_bit_exact(shape):
    """The evidence for FLEX_ATTENTION's cross-layer opt-in on CUDA (its order is the same
    ``B,L,N,2,H,D``): the compiled kernel on layer 1 of a 3-layer pool gives exactly what it
    gives on a contiguous per-layer copy, and layers 0 and 2 are untouched."""
    from kvcore_nvidia.backends.flex_attention import FlexAttentionBackend

    gen = torch.Generator().manual_seed(17 if shape == "mixed" else 18)
    layout = kvcore.KVCacheLayout.from_backend(
        FlexAttentionBackend, num_blocks=2048, block_size=16, num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE, dtype=torch.bfloat16, num_layers=3, cross_layer=True)
    storage = torch.randn(layout.physical_shape, generator=gen).to("cuda", torch.bfloat16)
    layers = storage.permute(layout.inverse_stride_order()).unbind(0)
    view = layers[1]
    plain = kvcore.allocate_kv_caches(
        FlexAttentionBackend, num_layers=1, num_blocks=2048, block_size=16,
        num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
        device="cuda").layers[0]
    plain.copy_(view)
    neighbours = [layers[i].clone() for i in (0, 2)]
    impl = FlexAttentionBackend.get_impl_cls()(num_heads=HEADS, head_size=HEAD_SIZE,
                                               scale=HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS)
    small = dict(q_lens=(1, 1, 100, 37, 1), ctx_lens=(1000, 15, 64, 0, 2000))
    batch = mixed_batch(impl, view, gen, **(small if shape == "mixed" else dict(
        q_lens=(1,) * 16, ctx_lens=tuple(range(40, 16 * 97, 97)))))
    impl.do_kv_cache_update(kvcore.LayerScales(), batch.key, batch.value, plain,
                            batch.meta.slot_mapping)
    assert torch.equal(view, plain)
    assert torch.equal(_forward(impl, batch, view), _forward(impl, batch, plain))
    assert all(torch.equal(layers[i], n) for i, n in zip((0, 2), neighbours, strict=True))
