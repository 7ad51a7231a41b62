"""Pure-torch reference implementations of kvcore's ops.

These run on any device, in any float dtype (float64 included), and are the numerical
reference every fast path is tested against. They take strides from the tensors they get:
a per-layer view of a cross-layer allocation or the K/V halves of a legacy
``(2, num_blocks, ...)`` cache work unchanged.

Conventions shared by every implementation:

- ``key_cache`` / ``value_cache``: ``(num_blocks, block_size, num_kv_heads, head_size)`` views of
  any strides (``kv_cache.unbind(1)`` of the blocks-first cache).
- ``slot_mapping[i] = block_id * block_size + offset_in_block`` for new token ``i``; a negative
  slot is padding and is skipped.
- A request ``i`` of a batch owns queries ``query_start_loc[i]:query_start_loc[i+1]`` and has
  ``seq_lens[i]`` tokens in total (cached prefix plus its new tokens), so its query ``j`` sits at
  position ``seq_lens[i] - q_len + j``. Causal masking lets a query see keys at positions
  ``<=`` its own; a sliding window ``w`` keeps only the last ``w`` of those (``q_pos - k_pos < w``).
- Logit soft-capping (``logits_soft_cap=cap``) turns each scaled score ``s`` into
  ``cap * tanh(s / cap)`` before masking; attention sinks (``sinks``, one logit per query
  head) add ``exp(sink)`` to every row's softmax denominator and no value
  (:func:`apply_attention_features`).
- fp8 caches store ``x * float32(1 / scale)`` (per-tensor ``k_scale`` / ``v_scale``), clamped to
  the fp8 range and rounded to nearest even, and are read back as ``stored * scale``.
"""

from __future__ import annotations

import math

import torch

from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KVScale,
    validate_paged_attention,
    validate_reshape_and_cache,
)

__all__ = [
    "apply_attention_features",
    "check_attention_features",
    "fp8_inverse_scale",
    "fp8_scale_values",
    "gather_kv_ref",
    "paged_attention_ref",
    "quantize_to_cache",
    "reshape_and_cache_ref",
    "scale_value",
]


def scale_value(scale: KVScale) -> float:
    """A per-tensor scale as a Python float (1.0 when absent)."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return float(scale.reshape(()).item())
    return float(scale)


def fp8_scale_values(kv_cache_dtype: str, k_scale: KVScale, v_scale: KVScale
                     ) -> tuple[float, float]:
    """``(k_scale, v_scale)`` as Python floats for an fp8 ``kv_cache_dtype``, ``(1.0, 1.0)``
    for any other (the scales are ignored then)."""
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        return 1.0, 1.0
    return scale_value(k_scale), scale_value(v_scale)


def fp8_inverse_scale(scale: float) -> float:
    """``float32(1 / float32(scale))`` as a Python float (exactly a float32 value).

    The one definition of the fp8 quantisation multiplier: references and kernels store
    ``x * fp8_inverse_scale(scale)``, never ``x / scale``. torch turns a division by a scalar
    into this multiply on CUDA but not on CPU, so only the multiply gives the same bytes on
    every device (Triton kernels compute ``div_rn(1.0, float32(scale))`` on the device).
    """
    s = torch.tensor(scale, dtype=torch.float32)
    return (torch.ones((), dtype=torch.float32) / s).item()  # CPU: an IEEE division


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as stored in a cache of ``cache_dtype``.

    fp8 (``float8_e4m3fn``, ``float8_e5m2``): ``x * fp8_inverse_scale(scale)`` in float32,
    clamped to the fp8 range and rounded to nearest even; any other dtype: a plain cast
    (``scale`` unused).
    """
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(cache_dtype).max
        return (x.float() * fp8_inverse_scale(scale)).clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_cache_dtype: str = "auto", k_scale: KVScale = None,
                          v_scale: KVScale = None) -> None:
    """Scatter new tokens into a paged cache, in place: the definition every cache write
    (:func:`kvcore.ops.reshape_and_cache`, plugins' kernels) meets.

    Args:
        key, value: ``(num_tokens, num_kv_heads, head_size)``, any strides.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_size)``, any strides
            (``kv_cache.unbind(1)``, per-layer views of a cross-layer cache included); the
            model dtype, or fp8 (e4m3/e5m2) when ``kv_cache_dtype`` names one.
        slot_mapping: ``(num_tokens,)`` int32/int64, ``block_id * block_size + offset``;
            negative entries are skipped.
        kv_cache_dtype: ``"auto"`` or an fp8 name; fp8 stores ``x * float32(1 / scale)``,
            clamped to the fp8 range and rounded to nearest even.
        k_scale, v_scale: per-tensor fp8 scales (:data:`~kvcore.ops.KVScale`).

    Raises:
        ValueError, TypeError: from :func:`kvcore.ops.validate_reshape_and_cache`, before
            anything is written.
    """
    validate_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                               kv_cache_dtype, k_scale, v_scale)
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    ks, vs = fp8_scale_values(kv_cache_dtype, k_scale, v_scale)
    # Advanced indexing on (block, offset) writes through the view's real strides.
    key_cache[blocks, offsets] = quantize_to_cache(key[keep], key_cache.dtype, ks)
    value_cache[blocks, offsets] = quantize_to_cache(value[keep], value_cache.dtype, vs)


def gather_kv_ref(
    cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request as ``(seq_len, num_kv_heads, head_size)``.

    ``block_ids`` are the request's block-table entries; fp8 data is dequantised with ``scale``.
    """
    block_size = cache.shape[1]
    num_blocks_used = -(-seq_len // block_size)
    pages = cache[block_ids[:num_blocks_used].to(torch.int64)]
    tokens = pages.reshape(-1, *cache.shape[2:])[:seq_len]
    out = tokens.to(dtype)
    if scale != 1.0:
        out = out * scale
    return out


def check_attention_features(query: torch.Tensor, logits_soft_cap: float | None,
                             sinks: torch.Tensor | None) -> None:
    """Refuse a soft-cap or sinks the attention ops cannot use: ``logits_soft_cap`` a finite
    float > 0 (or ``None``); ``sinks`` a contiguous floating ``(num_heads,)`` tensor on the
    query's device (or ``None``)."""
    if logits_soft_cap is not None and (
            isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float))
            or not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0)):
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be None or a finite float "
                         "> 0 (scores become cap * tanh(score / cap))")
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a torch.Tensor, got {type(sinks).__name__}")
    num_heads = query.shape[1]
    if (sinks.dim() != 1 or sinks.shape[0] != num_heads or not sinks.is_floating_point()
            or sinks.device != query.device or sinks.stride(0) != 1):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, dtype {sinks.dtype}, device "
                         f"{sinks.device} and strides {sinks.stride()}; it must be a contiguous "
                         f"floating (num_heads,) = ({num_heads},) tensor on the query's device "
                         f"{query.device} (one sink logit per query head)")


def apply_attention_features(scores: torch.Tensor, allowed: torch.Tensor,
                             logits_soft_cap: float | None, sinks: torch.Tensor | None
                             ) -> torch.Tensor:
    """Softmax probabilities of scaled ``scores`` ``(heads, q, k)`` over the ``allowed``
    ``(q, k)`` keys, with the soft-cap applied before the mask and each head's sink logit in
    the denominator (the sink's own probability is dropped): the definition of both
    features, in the scores' dtype."""
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    scores = scores.masked_fill(~allowed, float("-inf"))  # NaN keys masked: exactly out
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def paged_attention_ref(
        query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
        scale: float, causal: bool = True, sliding_window: int | None = None,
        kv_cache_dtype: str = "auto", k_scale: KVScale = None, v_scale: KVScale = None,
        output: torch.Tensor | None = None, logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a paged KV cache for a batch mixing prefill and decode requests: the
    definition every attention implementation (:func:`kvcore.ops.paged_attention`, backends'
    kernels) meets, and the one place its arguments are documented.

    Args:
        query: ``(num_tokens, num_heads, head_size)``; ``num_heads`` a multiple of the cache's
            ``num_kv_heads`` (MHA, GQA and MQA).
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_size)``, any strides.
        query_start_loc: ``(num_seqs + 1,)`` cumulative query lengths.
        seq_lens: ``(num_seqs,)`` total tokens per request (cached prefix + new).
        block_table: ``(num_seqs, max_blocks_per_seq)`` block ids.
        scale: softmax scale, usually ``head_size ** -0.5``.
        causal: mask keys after each query's position; ``False`` lets every query of a request
            see all ``seq_lens[i]`` keys.
        sliding_window: keep only the keys within ``sliding_window`` positions of each query,
            itself included: causal, ``q_pos - k_pos < sliding_window`` (the query and the
            ``sliding_window - 1`` keys before it); not causal, the symmetric window
            ``|q_pos - k_pos| < sliding_window`` (as many keys after it as before).
        kv_cache_dtype, k_scale, v_scale: ``"auto"`` or an fp8 name, and the per-tensor fp8
            scales (:data:`~kvcore.ops.KVScale`) the cache is read back with.
        output: optional ``(num_tokens, num_heads, head_size)`` tensor written in place.
        logits_soft_cap: ``cap``: each scaled score ``s`` becomes ``cap * tanh(s / cap)``
            before masking (Gemma 2); ``None``: no cap.
        sinks: ``(num_heads,)`` floating, contiguous, on the query's device: one logit per
            query head that joins every row's softmax denominator as ``exp(sink)`` and adds
            no value (gpt-oss); ``None``: no sinks.

    Returns:
        ``(num_tokens, num_heads, head_size)`` in ``query.dtype`` (``output`` if given).
        Computed in float32, or float64 when ``query`` is float64.
    """
    validate_paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                             block_table, kv_cache_dtype=kv_cache_dtype,
                             sliding_window=sliding_window, output=output, scale=scale,
                             k_scale=k_scale, v_scale=v_scale)
    check_attention_features(query, logits_soft_cap, sinks)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    ks, vs = fp8_scale_values(kv_cache_dtype, k_scale, v_scale)
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    out = output if output is not None else torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        k = gather_kv_ref(key_cache, block_table[i], seq_len, ks, compute)
        v = gather_kv_ref(value_cache, block_table[i], seq_len, vs, compute)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_lo:q_hi].to(compute)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
        if causal:
            allowed &= k_pos <= q_pos
        if sliding_window is not None:
            distance = q_pos - k_pos if causal else (q_pos - k_pos).abs()
            allowed &= distance < sliding_window
        probs = apply_attention_features(scores, allowed, logits_soft_cap, sinks)
        out[q_lo:q_hi] = _weighted_values(probs, v, allowed).to(out.dtype)
    return out


def _weighted_values(probs: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
                     ) -> torch.Tensor:
    """``probs @ v`` per head (``(h, q, k) x (k, h, d) -> (q, h, d)``) in which a key a query
    may not see contributes exactly nothing, even when its V holds NaN/Inf (``0 * NaN`` would
    poison the query). A non-finite V at a key the query sees still reaches its output."""
    bad = ~torch.isfinite(v)
    if not bad.any():
        return torch.einsum("hqk,khd->qhd", probs, v)
    keys = bad.flatten(1).any(1).nonzero().squeeze(1)  # the few keys with non-finite V
    clean = v.index_fill(0, keys, 0)
    vb = v[keys].permute(1, 0, 2)[:, None]  # (h, 1, nb, d)
    pb = probs[:, :, keys, None]  # (h, q, nb, 1)
    term = torch.where(allowed[None, :, keys, None], pb * vb, 0).sum(2)  # (h, q, d)
    return torch.einsum("hqk,khd->qhd", probs, clean) + term.permute(1, 0, 2)
