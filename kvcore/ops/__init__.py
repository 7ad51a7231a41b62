"""kvcore's ops: pure-torch references and the portable fast paths that plugins reuse.

Importing this package imports no kernel library; Triton kernels are imported when first
called. Every op validates its arguments (see :mod:`kvcore.ops.validation`) before launching.
"""

from kvcore.ops.reference import (
    gather_kv_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    scale_value,
)
from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    cache_torch_dtype,
    check_block_indices,
    set_value_checks,
    validate_paged_attention,
    validate_reshape_and_cache,
    value_checks_enabled,
)

__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "cache_torch_dtype",
    "check_block_indices",
    "gather_kv_ref",
    "paged_attention_ref",
    "reshape_and_cache_ref",
    "scale_value",
    "set_value_checks",
    "validate_paged_attention",
    "validate_reshape_and_cache",
    "value_checks_enabled",
]
