"""KV-cache specs: what one layer stores per block, and how many bytes that takes.

An engine's block manager sizes its pool from :attr:`page_size_bytes`: the bytes one block of
one layer occupies, which is the same for every stride order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.dtypes import cache_torch_dtype, parse_dtype

__all__ = ["KVCacheSpec", "FullAttentionSpec", "MLAAttentionSpec"]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class KVCacheSpec:
    """Base: ``block_size`` tokens per block, stored in ``cache_dtype``."""

    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        cache_torch_dtype(self.kv_cache_dtype, self.dtype)  # validates the name

    @property
    def cache_dtype(self) -> torch.dtype:
        """Storage dtype: the model dtype, or fp8 for an fp8 cache."""
        return cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def elements_per_block(self) -> int:
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        return self.elements_per_block * torch.empty((), dtype=self.cache_dtype).element_size()


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V for every token: ``2 * block_size * num_kv_heads * head_size`` per block.

    ``sliding_window`` is the window of the layers this spec's builder serves (``None``:
    full attention, or layers of mixed windows, one of them full). A builder's step check
    then lets a new token replace context outside every query's window, as a ring buffer of
    the window's tokens does on decode (:func:`kvcore.ops.step_facts_from_tensors`); layers
    of another window need their own spec and builder. It does not change the storage.
    """

    num_kv_heads: int = 1
    head_size: int = 128
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_size", self.head_size)
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)

    @property
    def elements_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """One latent per token (``kv_lora_rank + qk_rope_head_dim``, e.g. 512 + 64), no K/V split."""

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("kv_lora_rank", self.kv_lora_rank)
        _positive("qk_rope_head_dim", self.qk_rope_head_dim)

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def elements_per_block(self) -> int:
        return self.block_size * self.head_size
