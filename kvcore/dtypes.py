"""Dtype names and tables: model dtypes by name, and the KV-cache dtypes a backend may declare.

A leaf module: it imports torch only, so every layer of kvcore (the contract, the ops, the
tools) can use it.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "cache_torch_dtype",
    "parse_dtype",
]

#: Names accepted for ``kv_cache_dtype``; ``"auto"`` means "same dtype as the model".
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: The ``kv_cache_dtype`` names that store scaled fp8.
FP8_KV_CACHE_DTYPES: tuple[str, ...] = ("fp8", "fp8_e4m3", "fp8_e5m2")

#: Storage dtype of each fp8 ``kv_cache_dtype`` name (``"fp8"`` is e4m3).
_FP8_STORAGE: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or one of its names (``"bfloat16"``, ``"bf16"``, ``"torch.bfloat16"``)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.removeprefix("torch.").lower()
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(
            f"dtype={value!r} is not a known dtype name (known: {', '.join(sorted(_DTYPE_NAMES))})"
        )
    raise TypeError(f"dtype must be a torch.dtype or its name, got {type(value).__name__}")


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of a KV cache given its ``kv_cache_dtype`` name and the model dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in _FP8_STORAGE:
        return _FP8_STORAGE[kv_cache_dtype]
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not a known KV cache dtype "
        f"(supported: {', '.join(KV_CACHE_DTYPES)})"
    )
