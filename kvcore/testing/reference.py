"""A float64 attention reference on contiguous K/V, for backend and kernel tests.

Independent of the paged ops (no block table, no cache): a test writes a request's tokens
through a backend, runs it, and compares against this on the same tokens held contiguously.
"""

from __future__ import annotations

import torch

__all__ = ["contiguous_attention_ref"]


def contiguous_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 softmax attention of one request over its contiguous keys and values.

    Args:
        query: ``(q_len, num_heads, head_size)``: the request's last ``q_len`` positions
            (query ``j`` sits at position ``seq_len - q_len + j``, kvcore's convention).
        key, value: ``(seq_len, num_kv_heads, head_size)``; ``num_heads`` must be a multiple
            of ``num_kv_heads`` (GQA: each KV head serves ``num_heads // num_kv_heads``).
        scale: softmax scale of ``q . k``.
        causal: a query sees the keys at or before its position.
        sliding_window: a query sees only the last ``sliding_window`` of those positions.
        allowed: ``(q_len, seq_len)`` bool mask that replaces ``causal`` and
            ``sliding_window`` when given.

    Returns:
        ``(q_len, num_heads, head_size)`` float64 on ``query``'s device.
    """
    q, k, v = query.double(), key.double(), value.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if allowed is None:
        seq_len = k.shape[0]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None]
        allowed = torch.ones_like(scores[0], dtype=torch.bool)
        if causal:
            allowed &= k_pos <= q_pos
        if sliding_window:
            allowed &= q_pos - k_pos < sliding_window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
