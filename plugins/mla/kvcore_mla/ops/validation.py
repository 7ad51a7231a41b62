"""Argument checks shared by the reference and the Triton implementation of the plugin's ops.

The checks of the MLA cache write and attention are kvcore's
(:func:`kvcore.ops.validate_concat_and_cache_mla`, :func:`kvcore.ops.validate_mla_attention`).

Each check raises ``ValueError`` or ``TypeError`` naming the argument, the value it got and
what is expected, before anything is launched, so a bad argument gets the same message
whichever implementation runs. Checks that read tensor values (slot and block ids in range)
synchronise with the device and follow kvcore's switch
(:func:`kvcore.ops.set_value_checks`, ``KVCORE_CHECK_INDICES=0``).
"""

from __future__ import annotations

import math

import torch

from kvcore.ops import (
    KVScale,
    check_block_table,
    check_scale,
    check_slots_in_range,
    require_float_dtype,
    require_int_dtype,
    require_ndim,
    require_same_device,
    require_tensor,
)

__all__ = [
    "FP8_DTYPES",
    "INDEXER_SCALE_FORMATS",
    "indexer_cache_head_size",
    "validate_decode_attention",
    "validate_indexer_k_quant_and_cache",
]

#: Storage dtypes read as scaled fp8 (``stored * scale``).
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
#: ``scale_fmt`` values of :func:`~kvcore_mla.ops.indexer_k_quant_and_cache`: ``None`` keeps
#: the exact ``amax / 448`` scale, ``"ue8m0"`` rounds it up to a power of two (DeepSeek-V3.2).
INDEXER_SCALE_FORMATS: tuple[str | None, ...] = (None, "ue8m0")


def indexer_cache_head_size(head_dim: int = 128, quant_block_size: int = 128) -> int:
    """Bytes per token of the DeepSeek-V3.2 indexer cache: fp8 keys plus one float32 scale
    per ``quant_block_size`` channels (``128 + 4 = 132`` for DeepSeek-V3.2)."""
    for name, value in (("head_dim", head_dim), ("quant_block_size", quant_block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if head_dim % quant_block_size:
        raise ValueError(
            f"head_dim={head_dim} must be a multiple of quant_block_size={quant_block_size}"
        )
    return head_dim + head_dim // quant_block_size * 4


def validate_indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor,
                                       slot_mapping: torch.Tensor, quant_block_size: int,
                                       scale_fmt: str | None) -> None:
    """Validate ``indexer_k_quant_and_cache``'s arguments."""
    for n, t in (("k", k), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        require_tensor(n, t)
    require_ndim("k", k, 2, "(num_tokens, head_dim)")
    require_ndim("kv_cache", kv_cache, 3,
          "(num_blocks, block_size, head_dim + 4 * head_dim // quant_block_size)")
    require_ndim("slot_mapping", slot_mapping, 1, "(num_tokens,)")
    require_int_dtype("slot_mapping", slot_mapping)
    require_float_dtype("k", k)
    require_same_device([("k", k), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)])
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"kv_cache must be uint8 (fp8 bytes and float32 scales), got "
                        f"{kv_cache.dtype}")
    if scale_fmt not in INDEXER_SCALE_FORMATS:
        raise ValueError(f"scale_fmt={scale_fmt!r} (supported: None, 'ue8m0')")
    head_dim = k.shape[1]
    expected = indexer_cache_head_size(head_dim, quant_block_size)
    if kv_cache.shape[2] != expected:
        raise ValueError(
            f"kv_cache holds {kv_cache.shape[2]} bytes per token but head_dim={head_dim} with "
            f"quant_block_size={quant_block_size} needs {expected}"
        )
    # The in-block layout (all fp8 keys of the block, then all scales) is a byte layout of the
    # whole block, so a block must be one contiguous run; blocks may lie anywhere (stride(0)).
    packed = kv_cache.stride(2) == 1 and (
        kv_cache.shape[1] == 1 or kv_cache.stride(1) == kv_cache.shape[2]
    )
    if not packed:
        raise ValueError(
            f"kv_cache has strides {tuple(kv_cache.stride())}; each block must be one "
            f"contiguous run (stride(1) == {kv_cache.shape[2]}, stride(2) == 1); only "
            "stride(0), the block stride, may be larger"
        )
    if kv_cache.data_ptr() % 4 or kv_cache.stride(0) % 4:
        raise ValueError(
            f"kv_cache starts at byte {kv_cache.data_ptr() % 4} of a 4-byte word and has block "
            f"stride {kv_cache.stride(0)}; both must be multiples of 4 bytes, as each block "
            "stores float32 scales"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but k has {k.shape[0]} tokens"
        )
    check_slots_in_range(slot_mapping, kv_cache.shape[0], kv_cache.shape[1])


def validate_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                              o: torch.Tensor, lse: torch.Tensor, req_to_page: torch.Tensor,
                              b_seq_len: torch.Tensor, attn_logits: torch.Tensor | None,
                              num_kv_splits: int, sm_scale: float, page_size: int, is_mla: bool,
                              k_scale: KVScale,
                              v_scale: KVScale) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``decode_attention_fwd``'s arguments.

    Returns ``(k_buffer, v_buffer)`` as 4-dim ``(num_pages, page_size, 1, dim)`` views (a
    3-dim latent cache gains its single KV-head dim). ``attn_logits=None`` is accepted
    by the reference, which needs no workspace.
    """
    for n, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o),
                 ("lse", lse), ("req_to_page", req_to_page), ("b_seq_len", b_seq_len)):
        require_tensor(n, t)
    require_ndim("q", q, 3, "(batch, num_heads, qk_head_dim)")
    layout = "(num_pages, page_size, num_kv_heads, head_dim) or (num_pages, page_size, head_dim)"
    require_ndim("k_buffer", k_buffer, (3, 4), layout)
    require_ndim("v_buffer", v_buffer, (3, 4), layout)
    require_ndim("o", o, 3, "(batch, num_heads, v_head_dim)")
    require_ndim("lse", lse, 2, "(batch, num_heads)")
    require_ndim("req_to_page", req_to_page, 2, "(batch, max_pages_per_request)")
    require_ndim("b_seq_len", b_seq_len, 1, "(batch,)")
    require_int_dtype("req_to_page", req_to_page)
    require_int_dtype("b_seq_len", b_seq_len)
    require_float_dtype("q", q)
    require_float_dtype("o", o)
    require_float_dtype("lse", lse)
    named = [("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o), ("lse", lse),
             ("req_to_page", req_to_page), ("b_seq_len", b_seq_len)]
    if attn_logits is not None:
        require_tensor("attn_logits", attn_logits)
        named.append(("attn_logits", attn_logits))
    require_same_device(named)
    if k_buffer.dim() == 3:
        k_buffer = k_buffer.unsqueeze(2)
    if v_buffer.dim() == 3:
        v_buffer = v_buffer.unsqueeze(2)
    batch, num_heads, qk_dim = q.shape
    num_pages, block, num_kv_heads, k_dim = k_buffer.shape
    v_dim = v_buffer.shape[3]
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size != block:
        raise ValueError(f"page_size={page_size!r} but k_buffer has pages of {block} tokens "
                         f"(k_buffer.shape[1])")
    if qk_dim != k_dim:
        raise ValueError(f"q has head dim {qk_dim} but k_buffer has {k_dim}")
    if v_buffer.shape[:3] != k_buffer.shape[:3]:
        raise ValueError(
            f"v_buffer has (num_pages, page_size, num_kv_heads)={tuple(v_buffer.shape[:3])} "
            f"but k_buffer has {tuple(k_buffer.shape[:3])}"
        )
    if not is_mla or num_kv_heads != 1:
        raise ValueError(
            f"decode_attention_fwd got is_mla={is_mla!r} and a cache of {num_kv_heads} KV heads; "
            "it computes MLA decode only (is_mla=True, one latent per token): for GQA/MHA "
            "caches use kvcore.ops.paged_attention")
    if k_buffer.dtype != v_buffer.dtype:
        raise TypeError(f"v_buffer has dtype {v_buffer.dtype} but k_buffer has {k_buffer.dtype}")
    if k_buffer.dtype != q.dtype and k_buffer.dtype not in FP8_DTYPES:
        raise TypeError(f"k_buffer has dtype {k_buffer.dtype}; expected q's dtype {q.dtype} or "
                        "fp8 (float8_e4m3fn / float8_e5m2)")
    # MLA's values are the first v_head_dim channels of the latent cache: v_buffer must be
    # that view, so the kernel reads every latent once and uses it for both K and V. Strides
    # of size-1 dims are arbitrary (an unsqueezed KV-head dim), so they are skipped.
    same_strides = all(vs == ks for vs, ks, n in zip(v_buffer.stride(), k_buffer.stride(),
                                                      k_buffer.shape, strict=True) if n > 1)
    aliased = v_buffer.data_ptr() == k_buffer.data_ptr() and same_strides and v_dim <= k_dim
    if not aliased:
        raise ValueError(
            "is_mla=True needs v_buffer = k_buffer[..., :v_head_dim] (the latent's first "
            f"channels, same storage and strides); got v_buffer of shape "
            f"{tuple(v_buffer.shape)} and strides {v_buffer.stride()} for k_buffer of shape "
            f"{tuple(k_buffer.shape)} and strides {k_buffer.stride()}"
        )
    if o.shape != (batch, num_heads, v_dim):
        raise ValueError(f"o has shape {tuple(o.shape)}; expected (batch, num_heads, v_head_dim)"
                         f" = {(batch, num_heads, v_dim)}")
    if lse.shape != (batch, num_heads):
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected {(batch, num_heads)}")
    if req_to_page.shape[0] != batch or b_seq_len.shape[0] != batch:
        raise ValueError(
            f"q has batch {batch} but req_to_page has {req_to_page.shape[0]} rows and "
            f"b_seq_len {b_seq_len.shape[0]} entries"
        )
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits!r} must be a positive int")
    if attn_logits is not None:
        expected = (batch, num_heads, num_kv_splits, v_dim + 1)
        if tuple(attn_logits.shape) != expected or attn_logits.dtype != torch.float32:
            raise ValueError(
                f"attn_logits has shape {tuple(attn_logits.shape)} and dtype {attn_logits.dtype};"
                f" expected float32 (batch, num_heads, num_kv_splits, v_head_dim + 1) = {expected}"
            )
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not (
            math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale={sm_scale!r} must be a finite, positive float")
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    check_block_table("req_to_page", req_to_page, b_seq_len, page_size, num_pages)
    return k_buffer, v_buffer
