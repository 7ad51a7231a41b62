"""Paged attention in pure torch, batched: CPU_ATTN's kernel.

:func:`paged_attention_torch` has the signature and semantics of
:func:`kvcore.ops.paged_attention_ref` (which is its test oracle) but does the work in a few
large tensor ops instead of one small op per request: all decode requests (one query token)
of a batch are gathered and attended together, and each longer request is attended in one
go, its query heads grouped onto their KV head instead of copying K/V per query head.

Keys are processed in chunks of a fixed number of tokens (:data:`CHUNK_TOKENS`, rounded to
whole pages), each chunk with the same matrix shapes whatever the batch holds; the partial
sums of the chunks are added in chunk order, and a request's chunks beyond its own length
add exact zeros. So a request gets the same bits alone as in any batch (batch-invariant
numerics, which CPU_ATTN declares), although the decode batch is padded to its longest
request.
"""

from __future__ import annotations

import itertools

import torch

from kvcore.ops.reference import check_attention_features, fp8_scale_values
from kvcore.ops.validation import KVScale, validate_paged_attention

__all__ = ["CHUNK_TOKENS", "paged_attention_torch"]

#: Keys per chunk (rounded down to whole pages, at least one page).
CHUNK_TOKENS = 256


def _gather(cache: torch.Tensor, table: torch.Tensor, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """``(num_kv_heads, n, pages * block_size, head_size)`` in ``dtype``, contiguous: the
    pages of ``table`` ``(n, pages)``, dequantised with ``scale``."""
    n, pages = table.shape
    _, block_size, num_kv_heads, head_size = cache.shape
    # index_select copies whole pages (through the view's strides); then one copy puts
    # heads first, so that every (head, request, chunk) below is one dense matrix.
    picked = cache.index_select(0, table.flatten()).view(n, pages * block_size, num_kv_heads,
                                                         head_size)
    tokens = torch.empty((num_kv_heads, n, pages * block_size, head_size), dtype=dtype,
                         device=cache.device)
    tokens.copy_(picked.permute(2, 0, 1, 3))
    return tokens.mul_(scale) if scale != 1.0 else tokens


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float, chunk: int, logits_soft_cap: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of ``n`` padded requests.

    Args:
        q: ``(n, Q, num_heads, D)``; k, v: ``(num_kv_heads, n, T, D)`` contiguous, ``T`` a
            multiple of ``chunk``; allowed: ``(n, Q, T)``, every query row allowing at least
            one key, and ``v`` zero where no row allows its key.
        logits_soft_cap, sinks: as :func:`kvcore.ops.paged_attention_ref` takes them (the
            sink joins the row's maximum and, once, the sum of the chunks).

    Returns:
        ``(n, Q, num_heads, D)`` in ``q.dtype``.
    """
    n, num_q, num_heads, d = q.shape
    num_kv_heads, tokens = k.shape[0], k.shape[2]
    group, chunks = num_heads // num_kv_heads, tokens // chunk
    # The query rows of each KV head, (query, head in group) -> (Hk, n, 1, Q * g, D).
    rows = q.view(n, num_q, num_kv_heads, group, d).permute(2, 0, 1, 3, 4)
    rows = rows.reshape(num_kv_heads, n, 1, num_q * group, d)
    k = k.view(num_kv_heads, n, chunks, chunk, d)
    v = v.view(num_kv_heads, n, chunks, chunk, d)
    scores = torch.matmul(rows, k.transpose(-1, -2))  # (Hk, n, chunks, Q * g, chunk)
    scores *= scale
    if logits_soft_cap is not None:
        scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    mask = allowed.view(n, num_q, 1, chunks, chunk).expand(n, num_q, group, chunks, chunk)
    mask = mask.reshape(n, num_q * group, chunks, chunk).transpose(1, 2)
    scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # (Hk, n, 1, Q * g, 1)
    if sinks is not None:  # each row's sink logit, (query, head in group) as the rows
        sink = sinks.to(scores.dtype).view(num_kv_heads, 1, group).expand(
            num_kv_heads, num_q, group).reshape(num_kv_heads, 1, 1, num_q * group, 1)
        top = torch.maximum(top, sink)
    probs = torch.exp(scores - top)
    sums = probs.sum(dim=-1)  # (Hk, n, chunks, Q * g)
    outs = torch.matmul(probs, v)  # (Hk, n, chunks, Q * g, D)
    total, out = sums[:, :, 0], outs[:, :, 0]
    for c in range(1, chunks):  # in chunk order: the same additions alone and in a batch
        total, out = total + sums[:, :, c], out + outs[:, :, c]
    if sinks is not None:
        total = total + torch.exp(sink - top)[:, :, 0, :, 0]
    out = out / total[..., None]  # (Hk, n, Q * g, D)
    return out.view(num_kv_heads, n, num_q, group, d).permute(1, 2, 0, 3, 4).reshape(
        n, num_q, num_heads, d)


def paged_attention_torch(
        query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
        scale: float, causal: bool = True, sliding_window: int | None = None,
        kv_cache_dtype: str = "auto", k_scale: KVScale = None, v_scale: KVScale = None,
        output: torch.Tensor | None = None, logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kvcore.ops.paged_attention_ref`'s attention in a few large tensor ops (module
    docstring): the same arguments, shapes and result, computed in float32 (float64 for
    float64 queries)."""
    validate_paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                             block_table, kv_cache_dtype=kv_cache_dtype,
                             sliding_window=sliding_window, output=output)
    if logits_soft_cap is not None or sinks is not None:
        check_attention_features(query, logits_soft_cap, sinks)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    ks, vs = fp8_scale_values(kv_cache_dtype, k_scale, v_scale)
    out = output if output is not None else torch.empty_like(query)
    device = query.device
    block_size = key_cache.shape[1]
    pages_per_chunk = max(1, CHUNK_TOKENS // block_size)
    chunk = pages_per_chunk * block_size
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [hi - lo for lo, hi in itertools.pairwise(starts)]

    def run(seqs: list[int], num_q: int) -> torch.Tensor:
        """Requests ``seqs`` with ``num_q`` query tokens each: ``(n, num_q, heads, D)``."""
        n = len(seqs)
        longest = max(lens[i] for i in seqs)
        pages = -(-longest // chunk) * pages_per_chunk
        idx = torch.tensor(seqs, device=device)
        seq = seq_lens[idx].long()
        table = block_table.new_zeros(n, pages, dtype=torch.int64)
        cols = min(pages, block_table.shape[1])
        table[:, :cols] = block_table[idx, :cols]
        # Pages beyond a request's own may hold any id: read block 0 there instead.
        needed = (seq + block_size - 1) // block_size
        table.masked_fill_(torch.arange(pages, device=device) >= needed[:, None], 0)
        k_pos = torch.arange(pages * block_size, device=device)
        valid = k_pos < seq[:, None]
        k = _gather(key_cache, table, ks, compute)
        v = _gather(value_cache, table, vs, compute)
        # Keys past a request's length may hold anything, NaN included: their scores are
        # masked, and their values, multiplied by zero probabilities, must be finite.
        padding = (~valid).flatten().nonzero()[:, 0]
        v.view(v.shape[0], -1, v.shape[-1]).index_fill_(1, padding, 0)
        q_pos = (seq - num_q)[:, None] + torch.arange(num_q, device=device)  # (n, Q)
        allowed = valid[:, None, :].expand(n, num_q, -1)
        if causal:
            allowed = allowed & (k_pos <= q_pos[:, :, None])
        if sliding_window is not None:
            distance = q_pos[:, :, None] - k_pos
            if not causal:  # the symmetric window of non-causal layers
                distance = distance.abs()
            allowed = allowed & (distance < sliding_window)
        rows = torch.stack([query[starts[i]:starts[i] + num_q] for i in seqs]).to(compute)
        return _attend(rows, k, v, allowed, scale, chunk, logits_soft_cap, sinks)

    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        result = run(decodes, 1)[:, 0]
        out[torch.tensor([starts[i] for i in decodes], device=device)] = result.to(out.dtype)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            out[starts[i]:starts[i + 1]] = run([i], q_len)[0].to(out.dtype)
    return out
