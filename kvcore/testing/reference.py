"""float64 attention references on contiguous K/V (and MLA latents), for backend and kernel
tests.

Independent of the paged ops (no block table, no cache): a test writes a request's tokens
through a backend, runs it, and compares against this on the same tokens held contiguously.
"""

from __future__ import annotations

import torch

__all__ = ["contiguous_attention_ref", "contiguous_mla_ref"]


def contiguous_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    allowed: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 softmax attention of one request over its contiguous keys and values.

    Args:
        query: ``(q_len, num_heads, head_size)``: the request's last ``q_len`` positions
            (query ``j`` sits at position ``seq_len - q_len + j``, kvcore's convention).
        key, value: ``(seq_len, num_kv_heads, head_size)``; ``num_heads`` must be a multiple
            of ``num_kv_heads`` (GQA: each KV head serves ``num_heads // num_kv_heads``).
        scale: softmax scale of ``q . k``.
        causal: a query sees the keys at or before its position.
        sliding_window: a query sees only the positions within ``sliding_window`` of its
            own: the last ``sliding_window`` up to it (causal), or ``|q_pos - k_pos| <
            sliding_window`` on both sides (not causal).
        allowed: ``(q_len, seq_len)`` bool mask that replaces ``causal`` and
            ``sliding_window`` when given.
        logits_soft_cap: each scaled score ``s`` becomes ``cap * tanh(s / cap)`` before
            masking (Gemma 2).
        sinks: ``(num_heads,)``: each head's sink logit joins the softmax denominator as
            ``exp(sink)`` and adds no value (gpt-oss).

    Returns:
        ``(q_len, num_heads, head_size)`` float64 on ``query``'s device.
    """
    q, k, v = query.double(), key.double(), value.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if allowed is None:
        seq_len = k.shape[0]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None]
        allowed = torch.ones_like(scores[0], dtype=torch.bool)
        if causal:
            allowed &= k_pos <= q_pos
        if sliding_window:
            distance = q_pos - k_pos if causal else (q_pos - k_pos).abs()
            allowed &= distance < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # exp(s) / (sum exp(s) + exp(sink)), shifted by the larger of both maxima
        sink = sinks.double().to(q.device)[:, None, None]
        top = torch.maximum(scores.amax(-1, keepdim=True), sink)
        weights = (scores - top).exp()
        probs = weights / (weights.sum(-1, keepdim=True) + (sink - top).exp())
    return torch.einsum("hqk,khd->qhd", probs, v)


def contiguous_mla_ref(
    query: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    scale: float,
    *,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> torch.Tensor:
    """float64 MLA attention of one request, unabsorbed, over its contiguous latents.

    The model's definition, independent of any cache or absorption: each latent is expanded
    per head to ``k = [W_UK c, k_pe]`` and ``v = W_UV c``, then causal softmax attention runs.

    Args:
        query: ``(q_len, num_heads, qk_nope_head_dim + rope_dim)``: the request's last
            ``q_len`` positions (kvcore's convention).
        kv_c: ``(seq_len, kv_lora_rank)`` and k_pe: ``(seq_len, rope_dim)``, the request's
            latents in position order (as stored: dequantise fp8 first).
        kv_b_proj_weight: ``(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)``, per
            head the ``W_UK`` rows, then the ``W_UV`` rows.
        scale: softmax scale of ``q . k``.

    Returns:
        ``(q_len, num_heads, v_head_dim)`` float64 on ``query``'s device.
    """
    q, c, pe = query.double(), kv_c.double(), k_pe.double()
    num_heads = q.shape[1]
    w = kv_b_proj_weight.double().view(num_heads, qk_nope_head_dim + v_head_dim, c.shape[1])
    kv = torch.einsum("sl,hel->she", c, w)
    k = torch.cat([kv[..., :qk_nope_head_dim], pe[:, None, :].expand(-1, num_heads, -1)], -1)
    return contiguous_attention_ref(q, k, kv[..., qk_nope_head_dim:], scale)
