"""Every path of an op refuses the same bad input with the same message, before launching
(issue 18, item 8): fp8 scales of 0/NaN/inf, a NaN or non-positive softmax scale, a
non-float ``output``, duplicate slots in one write, caches whose blocks alias."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.ops import paged_attention_ref, reshape_and_cache_ref, set_value_checks

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
triton_cache = pytest.importorskip("kvcore.ops.triton_cache")

WRITE = {"reference": reshape_and_cache_ref, "triton": triton_cache.reshape_and_cache}
ATTEND = {"reference": paged_attention_ref, "triton": triton_attention.paged_attention}


def _write_args(cache_dtype=torch.float32, num_blocks=4):
    key = torch.randn(3, 2, 16)
    kc = torch.zeros(num_blocks, 4, 2, 16, dtype=cache_dtype)
    vc = torch.zeros(num_blocks, 4, 2, 16, dtype=cache_dtype)
    return key, key.clone(), kc, vc, torch.tensor([0, 5, 9])


def _attend_args():
    query = torch.randn(3, 4, 16)
    kc, vc = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)
    kw = dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
              seq_lens=torch.tensor([6], dtype=torch.int32),
              block_table=torch.tensor([[2, 0]], dtype=torch.int32), scale=0.25)
    return query, kc, vc, kw


@pytest.fixture
def value_checks():
    set_value_checks(True)
    yield
    set_value_checks(True)


@pytest.mark.parametrize("path", list(WRITE))
@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf"), -1.0],
                         ids=["zero", "nan", "inf", "negative"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_fp8_scales_must_be_finite_and_positive(path, scale, as_tensor, value_checks):
    key, value, kc, vc, slots = _write_args(torch.float8_e4m3fn)
    k_scale = torch.tensor([scale]) if as_tensor else scale
    with pytest.raises(ValueError, match=f"k_scale={scale} must be a finite, positive fp8 "
                                         r"scale \(the cache stores x / scale\)"):
        WRITE[path](key, value, kc, vc, slots, "fp8", k_scale, 1.0)
    assert not kc.view(torch.uint8).any()  # nothing written


def test_a_tensor_scale_is_read_only_when_value_checks_are_on():
    key, value, kc, vc, slots = _write_args(torch.float8_e4m3fn)
    set_value_checks(False)
    try:  # no device sync: the value is not read (an engine that validated its scales)
        reshape_and_cache_ref(key, value, kc, vc, slots, "fp8", torch.tensor([2.0]), 1.0)
    finally:
        set_value_checks(True)
    # Scales of a non-fp8 cache are unused, so not judged.
    reshape_and_cache_ref(*_write_args(), "auto", 0.0, float("nan"))


@pytest.mark.parametrize("path", list(ATTEND))
@pytest.mark.parametrize("scale", [float("nan"), 0.0, -0.5, float("inf")],
                         ids=["nan", "zero", "negative", "inf"])
def test_softmax_scale_must_be_finite_and_positive(path, scale):
    query, kc, vc, kw = _attend_args()
    with pytest.raises(ValueError, match=r"scale=.* must be a finite, positive float"):
        ATTEND[path](query, kc, vc, **{**kw, "scale": scale})
    with pytest.raises(ValueError, match=r"scale=.* must be a finite, positive float"):
        kvcore.resolve_backend("CPU_ATTN").get_impl_cls()(num_heads=4, head_size=16,
                                                          scale=scale, num_kv_heads=2)


@pytest.mark.parametrize("path", list(ATTEND))
def test_an_integer_output_is_refused_by_every_path(path):
    query, kc, vc, kw = _attend_args()
    out = torch.zeros(3, 4, 16, dtype=torch.int32)
    with pytest.raises(TypeError, match="output must be a float16/bfloat16/float32/float64 "
                                        "tensor, got torch.int32"):
        ATTEND[path](query, kc, vc, **kw, output=out)
    assert not out.any()


@pytest.mark.parametrize("path", list(WRITE))
def test_duplicate_slots_in_one_write_are_refused(path, value_checks):
    key, value, kc, vc, _ = _write_args()
    with pytest.raises(ValueError, match=r"slot_mapping writes slots \[5\] more than once"):
        WRITE[path](key, value, kc, vc, torch.tensor([5, -1, 5]))
    assert not kc.any()
    WRITE[path](key, value, kc, vc, torch.tensor([-1, 4, -1]))  # repeated padding is fine


@pytest.mark.parametrize("path", list(WRITE))
@pytest.mark.parametrize("alias", ["expanded-blocks", "v-expanded", "k-is-v",
                                   "overlapping-pages"])
def test_caches_whose_blocks_alias_are_refused(path, alias):
    key, value, kc, vc, slots = _write_args()
    if alias == "expanded-blocks":  # every block is the same memory
        kc = torch.zeros(1, 4, 2, 16).expand(4, 4, 2, 16)
        vc = torch.zeros(1, 4, 2, 16).expand(4, 4, 2, 16)
    elif alias == "v-expanded":
        vc = torch.zeros(4, 4, 2, 1).expand(4, 4, 2, 16)
    elif alias == "k-is-v":
        vc = kc
    else:  # pages of 128 elements placed 64 apart: block b's second half is block b+1's first
        base = torch.zeros(4 * 64 + 64)
        kc = base.as_strided((4, 4, 2, 16), (64, 32, 16, 1))
        vc = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="key_cache/value_cache views overlap"):
        WRITE[path](key, value, kc, vc, slots)
    query, _, _, kw = _attend_args()
    with pytest.raises(ValueError, match="key_cache/value_cache views overlap"):
        ATTEND[path](query, kc, vc, **kw)


def test_every_layout_kvcore_allocates_passes_the_alias_check():
    from kvcore.ops import check_distinct_pages

    for backend in ("CPU_ATTN", "TRITON_ATTN", "TRITON_ATTN_HND"):
        for cross in (False, True):
            caches = kvcore.allocate_kv_caches(backend, num_layers=3, num_blocks=5,
                                               block_size=4, num_kv_heads=2, head_size=16,
                                               dtype=torch.float16, device="meta",
                                               cross_layer=cross, platform="cuda")
            for layer in caches.layers:
                check_distinct_pages(*layer.unbind(1))
    legacy = torch.zeros(2, 5, 4, 2, 16)  # ROCM_ATTN's (2, num_blocks, ...) halves
    check_distinct_pages(legacy[0], legacy[1])


def test_duplicate_slots_are_refused_once_per_step():
    """With the step's metadata checked once (build_attention_metadata on the host lists,
    step_facts_from_tensors with one device read), a marked slot_mapping is not read again
    by each layer's write, and a step giving one slot to two tokens is refused up front."""
    from kvcore.ops import checked_step_facts, step_facts_from_tensors

    with pytest.raises(ValueError, match=r"the block tables give slots \[4, 5\] to more than "
                                         "one new token"):
        kvcore.build_attention_metadata([2, 2], [0, 0], [[1], [1]], block_size=4)
    meta = kvcore.build_attention_metadata([2, 1], [0, 3], [[1], [2]], block_size=4)
    assert checked_step_facts(meta.slot_mapping) is not None
    key, value, kc, vc, _ = _write_args()
    reshape_and_cache_ref(key, value, kc, vc, meta.slot_mapping)
    bad = torch.tensor([4, -1, 4])
    with pytest.raises(ValueError, match=r"slot_mapping writes slots \[4\] more than once"):
        step_facts_from_tensors(torch.tensor([0, 3], dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32),
                                torch.tensor([[1]], dtype=torch.int32), bad, 4)
