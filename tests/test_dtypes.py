"""kvcore.dtypes: dtype names and the KV-cache dtype table (a leaf the whole package uses)."""

from __future__ import annotations

import pytest
import torch

import kvcore
import kvcore.ops
from kvcore import dtypes


@pytest.mark.parametrize(("name", "dtype"), [
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.float16", torch.float16),
    ("HALF", torch.float16), ("fp32", torch.float32), ("float8_e4m3fn", torch.float8_e4m3fn),
])
def test_parse_dtype_accepts_names_and_dtypes(name, dtype):
    assert dtypes.parse_dtype(name) is dtype
    assert dtypes.parse_dtype(dtype) is dtype


def test_parse_dtype_errors_name_the_value():
    with pytest.raises(ValueError, match=r"dtype='bfloat61' is not a known dtype name \(known: "):
        dtypes.parse_dtype("bfloat61")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or its name, got int"):
        dtypes.parse_dtype(16)


@pytest.mark.parametrize(("kv_cache_dtype", "expected"), [
    ("auto", torch.float16), ("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
    ("fp8_e5m2", torch.float8_e5m2),
])
def test_cache_torch_dtype(kv_cache_dtype, expected):
    assert dtypes.cache_torch_dtype(kv_cache_dtype, torch.float16) is expected


def test_every_kv_cache_dtype_has_a_storage_dtype_and_unknown_names_are_refused():
    assert set(dtypes.FP8_KV_CACHE_DTYPES) == set(dtypes.KV_CACHE_DTYPES) - {"auto"}
    for name in dtypes.FP8_KV_CACHE_DTYPES:
        assert dtypes.cache_torch_dtype(name, torch.bfloat16).itemsize == 1
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' .*\(supported: auto, fp8, "):
        dtypes.cache_torch_dtype("int4", torch.bfloat16)


def test_the_public_modules_export_the_same_objects():
    assert kvcore.parse_dtype is dtypes.parse_dtype
    assert kvcore.ops.KV_CACHE_DTYPES is dtypes.KV_CACHE_DTYPES
    assert kvcore.ops.FP8_KV_CACHE_DTYPES is dtypes.FP8_KV_CACHE_DTYPES
    assert kvcore.ops.cache_torch_dtype is dtypes.cache_torch_dtype
