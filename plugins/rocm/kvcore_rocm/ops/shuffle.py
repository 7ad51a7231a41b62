"""AITER's shuffled KV page layout, on kvcore's blocks-first cache.

ROCM_AITER_FA's cache has the standard blocks-first logical shape ``(num_blocks, 2,
block_size, num_kv_heads, head_size)`` (``N = block_size``, ``H = num_kv_heads``,
``D = head_size``); ``kv_cache.unbind(1)`` gives the K and V halves, each
``(num_blocks, N, H, D)``. Only the order of elements *inside* one half-page differs: each
half-page is ``N * H * D`` contiguous elements, the stride between blocks is whatever the view
has (``2 * N * H * D`` for one layer, ``num_layers * 2 * N * H * D`` for a layer of a
cross-layer allocation). With ``x = 16 // element_size`` (8 for fp16/bf16: one 16-byte vector):

- **K** half-page, physically ``(H, D // x, N, x)``: element ``(token n, head h, dim d)`` lies at
  ``h * D * N + (d // x) * N * x + n * x + d % x``. Block ``b`` of the whole cache is AITER's
  K tensor ``(num_blocks, num_kv_heads, head_size // x, block_size, x)``.
- **V** half-page, physically ``(H, N // x, D, x)``: element ``(n, h, d)`` lies at
  ``h * N * D + (n // x) * D * x + d * x + n % x``; AITER's V tensor is
  ``(num_blocks, num_kv_heads, block_size // x, head_size, x)``.

So ``block_size`` and ``head_size`` must be multiples of ``x``. Because the block dim stays
outermost and every page keeps its size, connectors move these pages like any other
blocks-first page; only kernels that read tokens need to know the shuffle.

:func:`shuffled_views` builds AITER's 5-D views over the halves (strided in the block dim);
:func:`reshape_and_cache_shuffle_ref` and :func:`gather_shuffled_kv` are the pure-torch cache
write and read; :func:`reshape_and_cache_shuffle` is the Triton cache write, which takes the K
and V block strides from the views it gets (``k_cache_block_stride`` /
``v_cache_block_stride``) so it writes correctly into ``unbind(1)`` and cross-layer views and
touches no byte outside the slots it writes. Triton is imported on the first call.
"""

from __future__ import annotations

import torch

from kvcore.ops import validate_reshape_and_cache


def shuffle_width(dtype: torch.dtype) -> int:
    """``x``: elements per 16-byte vector of ``dtype`` (8 for fp16/bf16, 16 for fp8)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def validate_shuffle_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """Check that the ``(num_blocks, N, H, D)`` halves can hold shuffled pages; returns ``x``.

    Raises:
        ValueError: a half-page is not contiguous (the shuffle addresses it as one run), or
            ``block_size`` / ``head_size`` is not a multiple of ``x``.
    """
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (num_blocks, block_size, num_kv_heads, head_size), "
                f"got shape {tuple(cache.shape)}"
            )
        h, d = cache.shape[2:]
        if cache.stride()[1:] != (h * d, d, 1):
            raise ValueError(
                f"{name} has strides {cache.stride()}; the shuffled layout needs each block's "
                f"(block_size, num_kv_heads, head_size) page contiguous, i.e. strides "
                f"(any, {h * d}, {d}, 1) (use the NHD blocks-first order)"
            )
    x = shuffle_width(key_cache.dtype)
    _, block_size, _, head_size = key_cache.shape
    if block_size % x or head_size % x:
        raise ValueError(
            f"block_size={block_size} and head_size={head_size} must be multiples of "
            f"x={x} (16 bytes of {key_cache.dtype}) for the shuffled layout"
        )
    return x


def shuffled_views(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER's views of the halves: K ``(B, H, D // x, N, x)``, V ``(B, H, N // x, D, x)``.

    Both keep the block stride of the given views, so they are valid on cross-layer caches.
    """
    x = validate_shuffle_caches(key_cache, value_cache)
    _, n, h, d = key_cache.shape
    k = key_cache.as_strided(
        (key_cache.shape[0], h, d // x, n, x), (key_cache.stride(0), n * d, n * x, x, 1),
        key_cache.storage_offset(),
    )
    v = value_cache.as_strided(
        (value_cache.shape[0], h, n // x, d, x), (value_cache.stride(0), n * d, d * x, x, 1),
        value_cache.storage_offset(),
    )
    return k, v


def _check_write_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str) -> int:
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: the shuffled cache write supports only 'auto'"
        )
    validate_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    return validate_shuffle_caches(key_cache, value_cache)


def reshape_and_cache_shuffle_ref(key: torch.Tensor, value: torch.Tensor,
                                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                                  ) -> None:
    """Pure-torch shuffled cache write (the definition :func:`reshape_and_cache_shuffle` meets).

    Args:
        key, value: ``(num_tokens, num_kv_heads, head_size)``.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_size)`` halves
            (e.g. ``kv_cache.unbind(1)``) whose pages hold the shuffled layout.
        slot_mapping: ``(num_tokens,)``, ``block_id * block_size + offset``; negative: skipped.
        kv_cache_dtype: only ``"auto"``.
    """
    x = _check_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    k_view, v_view = shuffled_views(key_cache, value_cache)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // key_cache.shape[1], slots % key_cache.shape[1]
    num_tokens, h, d = key[keep].shape
    k_view[blocks, :, :, offsets, :] = key[keep].to(key_cache.dtype).reshape(
        num_tokens, h, d // x, x)
    v_view[blocks, :, offsets // x, :, offsets % x] = value[keep].to(value_cache.dtype)


def gather_shuffled_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read every request's tokens out of shuffled pages into packed (varlen) K and V.

    Args:
        key_cache, value_cache: shuffled ``(num_blocks, N, H, D)`` halves.
        block_table: ``(num_seqs, max_blocks_per_seq)`` block ids.
        seq_lens: ``(num_seqs,)`` tokens per request.

    Returns:
        ``(key, value, cu_seqlens_k)``: ``(sum(seq_lens), H, D)`` contiguous K and V in request
        order, and ``(num_seqs + 1,)`` int32 cumulative lengths.
    """
    k_view, v_view = shuffled_views(key_cache, value_cache)
    block_size = key_cache.shape[1]
    keys, values = [], []
    for i, seq_len in enumerate(seq_lens.tolist()):
        ids = block_table[i, : -(-seq_len // block_size)].to(torch.int64)
        # K (b, H, D//x, N, x) -> (b, N, H, D//x, x); V (b, H, N//x, D, x) -> (b, N//x, x, H, D)
        k = k_view[ids].permute(0, 3, 1, 2, 4)
        v = v_view[ids].permute(0, 2, 4, 1, 3)
        keys.append(k.reshape(-1, *key_cache.shape[2:])[:seq_len])
        values.append(v.reshape(-1, *value_cache.shape[2:])[:seq_len])
    cu = torch.zeros(len(keys) + 1, dtype=torch.int32, device=seq_lens.device)
    cu[1:] = torch.cumsum(seq_lens.to(torch.int32), 0)
    return torch.cat(keys), torch.cat(values), cu


def reshape_and_cache_shuffle(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              kv_cache_dtype: str = "auto") -> None:
    """Triton shuffled cache write; same arguments and result as
    :func:`reshape_and_cache_shuffle_ref`, bit for bit.

    The kernel gets ``key_cache.stride(0)`` and ``value_cache.stride(0)`` as the block strides
    and addresses inside a half-page with the shuffle formulas of the module docstring, in
    int64. One program writes one token's K and V for all heads.
    """
    x = _check_write_args(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)
    if key.shape[0] == 0:
        return
    from kvcore_rocm.ops._triton_shuffle import launch_reshape_and_cache_shuffle

    # The kernel indexes slot_mapping densely; a view of a larger buffer may have stride > 1.
    launch_reshape_and_cache_shuffle(key, value, key_cache, value_cache,
                                     slot_mapping.contiguous(), x)
