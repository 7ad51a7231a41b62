"""Pure-torch references of the plugin's own kernels (split-KV decode, the DeepSeek-V3.2
indexer cache): the numerical ground truth of their fast paths. The MLA cache write and
attention references are kvcore's (:mod:`kvcore.ops`: ``concat_and_cache_mla_ref``,
``mla_attention_ref``, ``mla_forward_ref``).

They run on any device and in any float dtype (float64 included) and take strides from the
tensors they get, so a per-layer view of a cross-layer cache works unchanged.

Conventions (shared with the Triton kernels):

- The MLA cache is ``(num_blocks, block_size, kv_lora_rank + rope_dim)``: one latent per token,
  ``kv_c`` in the first ``kv_lora_rank`` channels, the shared rope key ``k_pe`` after it. It is
  both the key (all channels) and the value (the first ``kv_lora_rank`` channels).
- ``slot_mapping[i] = block_id * block_size + offset``; negative slots are padding, skipped.
- A request with ``q_len`` new tokens and ``seq_len`` tokens in total has its query ``j`` at
  position ``seq_len - q_len + j``; it sees the keys at positions ``<=`` its own (causal).
- fp8 caches store ``fp8(clamp(x * inv_scale))``, ``inv_scale = float32(1 / float32(scale))``
  (:func:`kvcore.ops.fp8_inverse_scale`, :func:`kvcore.ops.quantize_to_cache`): one float32
  multiply by the rounded reciprocal, then round-to-nearest-even into fp8 (after clamping to
  its largest finite value). This is exactly what ``x.float() / scale`` computes on CUDA for a
  Python ``scale`` (torch replaces a division by a CPU scalar with a multiplication by its
  float32 reciprocal) but *not* what it computes on the CPU (a true division), so the
  references spell it out and give the same bytes on every device; the Triton kernels compute
  the same two roundings. Caches are read back as ``stored * scale``.
- ``lse`` is the natural-log log-sum-exp of the scaled scores ``scale * q.k`` of a query
  head (``-inf`` for a query that sees no key, whose output is 0).
"""

from __future__ import annotations

import torch

from kvcore.ops import KVScale, gather_kv_ref, scale_value
from kvcore_mla.ops.validation import (
    FP8_DTYPES,
    validate_decode_attention,
    validate_indexer_k_quant_and_cache,
)

__all__ = [
    "INDEXER_FP8_MAX",
    "decode_attention_ref",
    "indexer_k_dequant_ref",
    "indexer_k_quant_and_cache_ref",
]

#: Largest finite float8_e4m3fn value: the indexer scales each block of keys to it.
INDEXER_FP8_MAX = 448.0
# Smallest indexer scale numerator, so an all-zero block gets a finite, positive scale.
_INDEXER_MIN_AMAX = 1e-4


def _indexer_quantize(
    k: torch.Tensor, quant_block_size: int, scale_fmt: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 keys and their float32 scales, ``(n, head_dim)`` and ``(n, head_dim // qbs)``."""
    n, head_dim = k.shape
    groups = k.float().reshape(n, head_dim // quant_block_size, quant_block_size)
    amax = groups.abs().amax(dim=-1).clamp_min(_INDEXER_MIN_AMAX)
    # True IEEE divisions on every device, as in the kernel: a same-device tensor divisor
    # (torch turns a division by a Python/CPU scalar into a reciprocal multiply on CUDA only).
    scale = amax / torch.full_like(amax, INDEXER_FP8_MAX)
    if scale_fmt == "ue8m0":
        # Round up to a power of two from the exponent, not exp2(ceil(log2(s))): float32 log2
        # rounds to an integer for values just above a power of two.
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    q = (groups / scale[..., None]).clamp(-INDEXER_FP8_MAX, INDEXER_FP8_MAX)
    return q.to(torch.float8_e4m3fn).reshape(n, head_dim), scale


def indexer_k_quant_and_cache_ref(k: torch.Tensor, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, quant_block_size: int = 128,
                                  scale_fmt: str | None = None) -> None:
    """Quantise the DeepSeek-V3.2 indexer keys to fp8 and write them into its cache, in place.

    Every ``quant_block_size`` channels of a key share one float32 scale
    ``max(amax, 1e-4) / 448`` (``scale_fmt="ue8m0"``: rounded up to a power of two); the cache
    stores ``fp8(k / scale)``; both divisions are IEEE float32 divisions on every device.

    Args:
        k: ``(num_tokens, head_dim)`` float keys.
        kv_cache: uint8 ``(num_blocks, block_size, head_dim + 4 * head_dim // quant_block_size)``
            whose blocks are contiguous runs placed anywhere (``stride(0)`` is the block
            stride, e.g. a per-layer view of a cross-layer pool). A block holds the fp8 keys of
            its ``block_size`` tokens (``block_size * head_dim`` bytes, token-major), then
            their scales (``block_size * head_dim // quant_block_size`` float32, token-major).
        slot_mapping: ``(num_tokens,)``; negative entries are skipped.
        quant_block_size: channels per scale.
        scale_fmt: ``None`` or ``"ue8m0"``.
    """
    validate_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    if slots.numel() == 0:
        return
    q, scale = _indexer_quantize(k[keep], quant_block_size, scale_fmt)
    block_size = kv_cache.shape[1]
    head_dim = k.shape[1]
    scale_bytes = head_dim // quant_block_size * 4
    blocks, offsets = slots // block_size, slots % block_size
    # One row of raw bytes per block: a view (each block is one run), so writes reach the cache.
    rows = kv_cache.view(kv_cache.shape[0], -1)
    key_cols = offsets[:, None] * head_dim + torch.arange(head_dim, device=k.device)
    rows[blocks[:, None], key_cols] = q.view(torch.uint8)
    scale_cols = (block_size * head_dim + offsets[:, None] * scale_bytes
                  + torch.arange(scale_bytes, device=k.device))
    rows[blocks[:, None], scale_cols] = scale.contiguous().view(torch.uint8)


def indexer_k_dequant_ref(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_dim: int,
    quant_block_size: int = 128,
) -> torch.Tensor:
    """Read keys back from the indexer cache: ``(num_tokens, head_dim)`` float32 ``fp8 * scale``.

    The inverse of :func:`indexer_k_quant_and_cache_ref` up to fp8 rounding; ``slot_mapping``
    must hold valid (non-negative) slots.
    """
    slots = slot_mapping.to(torch.int64)
    block_size = kv_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    groups = head_dim // quant_block_size
    rows = kv_cache.view(kv_cache.shape[0], -1)
    key_cols = offsets[:, None] * head_dim + torch.arange(head_dim, device=kv_cache.device)
    keys = rows[blocks[:, None], key_cols].view(torch.float8_e4m3fn).float()
    scale_cols = (block_size * head_dim + offsets[:, None] * groups * 4
                  + torch.arange(groups * 4, device=kv_cache.device))
    scale = rows[blocks[:, None], scale_cols].contiguous().view(torch.float32)
    return (keys.reshape(-1, groups, quant_block_size) * scale[..., None]).reshape(-1, head_dim)


def _attention_with_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor,
                        scale: float, k_scale: float,
                        v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal paged attention returning ``(out, lse)``; caches ``(nb, bs, H_kv, D)``."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, v_cache.shape[3], dtype=compute, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=compute, device=q.device)
    for i, seq_len in enumerate(seq_lens):
        lo, hi = query_start_loc[i], query_start_loc[i + 1]
        if hi == lo or seq_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_table[i], seq_len, k_scale, compute)
        v = gather_kv_ref(v_cache, block_table[i], seq_len, v_scale, compute)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].to(compute), k) * scale
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # (heads, queries)
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[lo:hi] = row_lse.transpose(0, 1)
    return out, lse


def _fp8_scale(cache: torch.Tensor, scale: KVScale) -> float:
    return scale_value(scale) if cache.dtype in FP8_DTYPES else 1.0


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, lse: torch.Tensor, req_to_page: torch.Tensor,
                         b_seq_len: torch.Tensor, attn_logits: torch.Tensor | None,
                         num_kv_splits: int, sm_scale: float, page_size: int, is_mla: bool = True,
                         *, k_scale: KVScale = None, v_scale: KVScale = None) -> None:
    """Reference of :func:`kvcore_mla.ops.triton_mla_attention.decode_attention_fwd`.

    Same arguments (``attn_logits`` and ``num_kv_splits`` are validated, not used); writes
    ``o`` ``(batch, num_heads, v_head_dim)`` and the natural-log ``lse`` ``(batch, num_heads)``
    of each request's single query, which sits at position ``b_seq_len[i] - 1``.
    """
    k_buffer, v_buffer = validate_decode_attention(
        q, k_buffer, v_buffer, o, lse, req_to_page, b_seq_len, attn_logits, num_kv_splits,
        sm_scale, page_size, is_mla, k_scale, v_scale)
    batch = q.shape[0]
    out, row_lse = _attention_with_lse(
        q, k_buffer, v_buffer, list(range(batch + 1)), b_seq_len.tolist(), req_to_page,
        float(sm_scale), _fp8_scale(k_buffer, k_scale), _fp8_scale(v_buffer, v_scale))
    o.copy_(out)
    lse.copy_(row_lse)
