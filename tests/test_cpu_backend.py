"""CPU_ATTN against a float64 attention reference on contiguous (non-paged) K/V."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore.testing import run_mixed_step

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def run_case(seed, block_size, num_heads, num_kv_heads, head_size, dtype, window=None,
             cross_layer=True, kv_cache_dtype="auto", backend_name="CPU_ATTN"):
    """A mixed batch (decodes, prefill with cached prefix, fresh prefill) on shuffled blocks of
    layer 1 of a 3-layer cache."""
    rng = random.Random(seed)
    scales = (kvcore.LayerScales(k_scale=0.5, v_scale=0.25) if kv_cache_dtype != "auto"
              else kvcore.LayerScales())
    return run_mixed_step(
        backend_name, query_lens=[1, 1, 7, 19],
        context_lens=[rng.randint(1, 40), rng.randint(30, 70), rng.randint(5, 33), 0],
        block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=dtype, gen=torch.Generator().manual_seed(seed),
        sliding_window=window, kv_cache_dtype=kv_cache_dtype, layer_scales=scales,
        cross_layer=cross_layer, spare_blocks=5)


def assert_each_request_close(step, tol: float) -> None:
    """Every request's rows within ``tol`` (relative to its largest value) of the reference."""
    ref, starts = step.reference(), step.metadata.query_start_loc.tolist()
    for i in range(step.metadata.num_seqs):
        got, want = step.output[starts[i]:starts[i + 1]].double(), ref[starts[i]:starts[i + 1]]
        assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), f"request {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)],
                         ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32, 5], ids=lambda b: f"bs{b}")
def test_mixed_batch_matches_float64_reference(dtype, num_heads, num_kv_heads, block_size):
    step = run_case(
        seed=block_size * 100 + num_heads, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_size=32, dtype=dtype)
    assert_each_request_close(step, TOL[dtype])


@pytest.mark.parametrize("window", [1, 8, 37], ids=lambda w: f"window{w}")
def test_sliding_window(window):
    step = run_case(seed=window, block_size=16, num_heads=4, num_kv_heads=2, head_size=16,
                    dtype=torch.float32, window=window)
    torch.testing.assert_close(step.output.double(), step.reference(), atol=2e-5, rtol=2e-5)


def test_fp8_cache_within_fp8_error():
    step = run_case(seed=3, block_size=16, num_heads=4, num_kv_heads=2, head_size=32,
                    dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert (step.output.double() - step.reference()).abs().max() < 0.15


def test_cross_layer_view_gives_bit_identical_output():
    a = run_case(seed=11, block_size=16, num_heads=8, num_kv_heads=2, head_size=32,
                 dtype=torch.bfloat16, cross_layer=True).output
    b = run_case(seed=11, block_size=16, num_heads=8, num_kv_heads=2, head_size=32,
                 dtype=torch.bfloat16, cross_layer=False).output
    assert torch.equal(a, b)


def test_cache_update_skips_negative_slots_and_touches_nothing_else():
    caches = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=3, num_blocks=4, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    caches.storage.copy_(torch.randn(caches.storage.shape))
    before = caches.storage.clone()
    impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(1, 8, 1.0)
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    impl.do_kv_cache_update(kvcore.LayerScales(), key, value, caches.layers[1],
                            torch.tensor([9, -1, 2]))
    layer = caches.layers[1]
    assert torch.equal(layer[2, 0, 1], key[0]) and torch.equal(layer[2, 1, 1], value[0])
    assert torch.equal(layer[0, 0, 2], key[2])
    expected = before.clone().permute(caches.layout.inverse_stride_order())
    expected[1, 2, 0, 1], expected[1, 2, 1, 1] = key[0], value[0]
    expected[1, 0, 0, 2], expected[1, 0, 1, 2] = key[2], value[2]
    assert torch.equal(caches.storage.permute(caches.layout.inverse_stride_order()), expected)


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [(lambda a: a.update(slot_mapping=torch.tensor([0, 99])), ValueError,
      "slot_mapping contains slot 99, but the cache holds only 4 blocks x 4 tokens = 16 slots"),
     (lambda a: a.update(key=a["key"].double()), TypeError,
      "value has dtype torch.float32 but key has torch.float64"),
     (lambda a: a.update(slot_mapping=torch.tensor([0.0, 1.0])), TypeError,
      "slot_mapping must be int32 or int64"),
     (lambda a: a.update(key=a["key"][:, :, :4]), ValueError, "value has shape")],
    ids=["slot-out-of-range", "dtype-mismatch", "float-slots", "shape-mismatch"],
)
def test_cache_update_bad_input(mutate, error, message):
    caches = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=1, num_blocks=4, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    args = dict(key=torch.randn(2, 1, 8), value=torch.randn(2, 1, 8),
                slot_mapping=torch.tensor([0, 1]))
    mutate(args)
    impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(1, 8, 1.0)
    with pytest.raises(error, match=message):
        impl.do_kv_cache_update(kvcore.LayerScales(), args["key"], args["value"],
                                caches.layers[0], args["slot_mapping"])


def test_forward_rejects_block_table_out_of_range():
    caches = kvcore.allocate_kv_caches("CPU_ATTN", num_layers=1, num_blocks=2, block_size=4,
                                       num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       device="cpu")
    impl = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(2, 8, 1.0, 1)
    meta = kvcore.build_attention_metadata([1], [4], [[0, 5]], 4)
    with pytest.raises(ValueError, match="block_table refers to block id 5, but the cache has 2"):
        impl.forward(kvcore.LayerScales(), torch.randn(1, 2, 8), None, None, caches.layers[0],
                     meta)


def test_metadata_builder():
    meta = kvcore.build_attention_metadata([2, 1], [3, 0], [[4, 1], [7]], block_size=3)
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.seq_lens.tolist() == [5, 1]
    # request 0 writes positions 3 and 4 (block 1, offsets 0 and 1); request 1 position 0
    assert meta.slot_mapping.tolist() == [1 * 3 + 0, 1 * 3 + 1, 7 * 3 + 0]
    assert meta.block_table.tolist() == [[4, 1], [7, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (2, 5, 3)
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks but 5 tokens need 3"):
        kvcore.build_attention_metadata([2], [3], [[4]], block_size=2)
    with pytest.raises(ValueError, match="must have one entry per request"):
        kvcore.build_attention_metadata([2], [3, 1], [[4]], block_size=2)
