"""fp8 paged caches for the fp8 kernel tests: real K/V written through the reference."""

from __future__ import annotations

import torch

from kvcore.ops import reshape_and_cache_ref
from kvcore.testing import random_block_tables


def fp8_paged_batch(gen: torch.Generator, cache_dtype: torch.dtype, seq_lens: list[int],
                    num_tokens: int, *, block_size: int, num_heads: int, num_kv_heads: int,
                    head_size: int, q_magnitude: float, kv_magnitude: float,
                    query_dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict:
    """``paged_attention``'s arguments but the query offsets: ``num_tokens`` random queries
    (scaled by ``q_magnitude``), an fp8 (``cache_dtype``) cache over random block tables
    (``-1`` past each request's blocks) holding bf16 K/V written by
    :func:`kvcore.ops.reshape_and_cache_ref` with scales that use the fp8 range (K scaled
    by ``kv_magnitude``), ``seq_lens`` and the scale ``head_size ** -0.5``."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    width = max(-(-s // block_size) for s in seq_lens) + 1
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for i, ids in enumerate(random_block_tables(seq_lens, block_size, num_blocks, gen)):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    value_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    slots = num_blocks * block_size
    kv = torch.randn(2, slots, num_kv_heads, head_size, generator=gen)
    kv[0] *= kv_magnitude
    kv = kv.to(torch.bfloat16).to(device)
    kv_cache_dtype = "fp8_e5m2" if cache_dtype == torch.float8_e5m2 else "fp8"
    scales = (torch.tensor([kv_magnitude / 64], device=device),
              torch.tensor([0.05], device=device))
    reshape_and_cache_ref(kv[0], kv[1], key_cache, value_cache,
                          torch.arange(slots, device=device), kv_cache_dtype, *scales)
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen) * q_magnitude
    return dict(query=query.to(query_dtype).to(device), key_cache=key_cache,
                value_cache=value_cache, kv_cache_dtype=kv_cache_dtype, k_scale=scales[0],
                v_scale=scales[1], scale=head_size ** -0.5, block_table=table.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))
