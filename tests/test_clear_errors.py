"""Inputs that used to fail with an unclear error (a raw TypeError from a comparison, a
Triton dtype error, an int32 overflow, an AttributeError) are refused up front with a
sentence naming the argument."""

from __future__ import annotations

import re

import pytest
import torch

import kvcore
from kvcore.ops import paged_attention_ref, reshape_and_cache_ref

triton_cache = pytest.importorskip("kvcore.ops.triton_cache")


@pytest.mark.parametrize("window", [2.5, True, "4", 0, -3], ids=repr)
def test_sliding_window_must_be_an_int(window):
    impl_cls = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()
    with pytest.raises(ValueError, match=rf"sliding_window={window!r} must be None or an int "
                                         r">= 1 \(how many positions each query sees"):
        impl_cls(num_heads=2, head_size=16, scale=0.25, sliding_window=window)
    meta = kvcore.build_attention_metadata([2], [0], [[0]], 4)
    kc, vc = torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16)
    with pytest.raises(ValueError, match=rf"sliding_window={window!r} must be None or an int"):
        paged_attention_ref(torch.randn(2, 2, 16), kc, vc, query_start_loc=meta.query_start_loc,
                            seq_lens=meta.seq_lens, block_table=meta.block_table, scale=0.25,
                            sliding_window=window)


def test_an_integer_window_of_another_type_is_taken_as_an_int():
    impl_cls = kvcore.resolve_backend("CPU_ATTN").get_impl_cls()
    impl = impl_cls(num_heads=2, head_size=16, scale=0.25, sliding_window=torch.tensor(4))
    assert impl.sliding_window == 4 and type(impl.sliding_window) is int


@pytest.mark.parametrize("scale", [1e-45, 1e-39, 1e39], ids=["denormal-1e-45", "subnormal",
                                                              "overflows-float32"])
@pytest.mark.parametrize("write", [reshape_and_cache_ref, triton_cache.reshape_and_cache],
                         ids=["reference", "triton"])
def test_fp8_scales_outside_float32s_normal_range_are_refused(scale, write):
    key = torch.randn(2, 2, 16)
    kc = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=re.escape(
            f"k_scale={scale} is outside float32's normal range (1.175e-38 to 3.403e+38): the "
            "kernels compute float32(1 / scale)")):
        write(key, key, kc, kc.clone(), torch.tensor([0, 5]), "fp8", scale, 1.0)


@pytest.mark.parametrize("bad", [-2**31 - 1, -2**40], ids=["int32-min-minus-1", "-2**40"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_block_ids_below_int32_are_refused(bad, as_tensor):
    row = [1, bad]
    blocks = torch.tensor(row, dtype=torch.int64) if as_tensor else row
    with pytest.raises(ValueError, match=rf"block_tables\[0\] contains {bad}, below "
                                         r"-2147483648: the block table is int32"):
        kvcore.build_attention_metadata([1], [0], [blocks], 4)


@pytest.mark.parametrize("backend", [5, 2.0, object()], ids=["int", "float", "object"])
def test_get_attn_backend_names_a_bad_backend_argument(backend):
    config = kvcore.AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"backend=.* must be a backend name \(e.g. 'CPU_ATTN'\), "
                                        "an AttentionBackend subclass or None"):
        kvcore.get_attn_backend(config, backend=backend, platform="cpu")
    with pytest.raises(TypeError, match="must be a backend name"):
        kvcore.explain_selection(config, "cpu", backend)
