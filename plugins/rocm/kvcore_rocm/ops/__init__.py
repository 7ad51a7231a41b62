"""kvcore-rocm's kernels: AITER's shuffled page layout (:mod:`kvcore_rocm.ops.shuffle`), its
pure-torch cache write and read, and the stride-aware Triton cache write
(:mod:`kvcore_rocm.ops._triton_shuffle`, imported on first use). Attention itself runs on
kvcore's portable Triton kernels (:mod:`kvcore.ops`) or on aiter.

Importing this package imports no kernel library.
"""

from kvcore_rocm.ops.shuffle import (
    gather_shuffled_kv,
    reshape_and_cache_shuffle,
    reshape_and_cache_shuffle_ref,
    shuffle_width,
    shuffled_views,
    validate_shuffle_caches,
)

__all__ = [
    "gather_shuffled_kv",
    "reshape_and_cache_shuffle",
    "reshape_and_cache_shuffle_ref",
    "shuffle_width",
    "shuffled_views",
    "validate_shuffle_caches",
]
