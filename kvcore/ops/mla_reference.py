"""Pure-torch references of the MLA ops, and their argument checks.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) caches one latent per token,
``[kv_c, k_pe]`` of ``kv_lora_rank + rope_dim`` channels, shared by all heads. These functions
are the numerical ground truth of every MLA fast path (the kvcore-mla Triton kernels,
vendor kernels) and the kernels of the CPU_MLA backend. They run on any device and in any
float dtype (float64 included) and take strides from the tensors they get, so a per-layer view
of a cross-layer cache works unchanged.

Conventions (shared with every fast path):

- The MLA cache is ``(num_blocks, block_size, kv_lora_rank + rope_dim)``: ``kv_c`` in the first
  ``kv_lora_rank`` channels, the shared rope key ``k_pe`` after it. It is both the key (all
  channels) and the value (the first ``kv_lora_rank`` channels).
- ``slot_mapping[i] = block_id * block_size + offset``; negative slots are padding, skipped.
- A request with ``q_len`` new tokens and ``seq_len`` tokens in total has its query ``j`` at
  position ``seq_len - q_len + j``; it sees the keys at positions ``<=`` its own (causal).
- fp8 caches store ``fp8(clamp(x * fp8_inverse_scale(scale)))`` (:func:`quantize_to_cache`)
  and are read back as ``stored * scale``.

Checks raise ``ValueError`` / ``TypeError`` naming the argument before anything runs; those that
read tensor values (slot and block ids in range) follow :func:`kvcore.ops.set_value_checks`.
"""

from __future__ import annotations

import torch

from kvcore.ops.reference import quantize_to_cache, scale_value
from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KVScale,
    cache_torch_dtype,
    check_block_indices,
    check_distinct_slots,
    check_kv_cache_dtype,
    check_scale,
    check_slots_in_range,
    check_softmax_scale,
    check_step_block_size,
    check_step_tensor_layout,
    checked_step_facts,
    require_float_dtype,
    require_int_dtype,
    require_ndim,
    require_same_device,
    require_tensor,
    value_checks_enabled,
)

__all__ = [
    "check_block_table",
    "concat_and_cache_mla_ref",
    "mla_attention_ref",
    "mla_forward_ref",
    "validate_concat_and_cache_mla",
    "validate_mla_attention",
]


# -- checks ----------------------------------------------------------------------------------


def validate_concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, kv_cache_dtype: str,
                                  scale: KVScale) -> torch.Tensor:
    """Validate ``concat_and_cache_mla``'s arguments; returns ``k_pe`` as ``(num_tokens, rope)``."""
    for n, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache),
                 ("slot_mapping", slot_mapping)):
        require_tensor(n, t)
    require_ndim("kv_c", kv_c, 2, "(num_tokens, kv_lora_rank)")
    require_ndim("k_pe", k_pe, (2, 3), "(num_tokens, rope_dim) or (num_tokens, 1, rope_dim)")
    require_ndim("kv_cache", kv_cache, 3, "(num_blocks, block_size, kv_lora_rank + rope_dim)")
    require_ndim("slot_mapping", slot_mapping, 1, "(num_tokens,)")
    require_int_dtype("slot_mapping", slot_mapping)
    require_float_dtype("kv_c", kv_c)
    require_same_device([("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache),
                         ("slot_mapping", slot_mapping)])
    if k_pe.dim() == 3:
        if k_pe.shape[1] != 1:
            raise ValueError(
                f"k_pe has shape {tuple(k_pe.shape)}; a 3-dim k_pe must be (num_tokens, 1, "
                "rope_dim) (MLA shares one rope key across heads)"
            )
        k_pe = k_pe[:, 0]
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe has dtype {k_pe.dtype} but kv_c has {kv_c.dtype}")
    num_tokens, kv_lora_rank = kv_c.shape
    if k_pe.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"kv_c has {num_tokens} tokens but k_pe has {k_pe.shape[0]} and slot_mapping "
            f"{slot_mapping.shape[0]}; all three need one row per token"
        )
    entry = kv_lora_rank + k_pe.shape[1]
    if kv_cache.shape[2] != entry:
        raise ValueError(
            f"kv_cache holds {kv_cache.shape[2]} channels per token but kv_lora_rank="
            f"{kv_lora_rank} + rope_dim={k_pe.shape[1]} = {entry}"
        )
    check_kv_cache_dtype(kv_cache_dtype)
    expected = cache_torch_dtype(kv_cache_dtype, kv_c.dtype)
    if kv_cache.dtype != expected:
        raise TypeError(
            f"kv_cache has dtype {kv_cache.dtype} but kv_cache_dtype={kv_cache_dtype!r} with "
            f"kv_c of dtype {kv_c.dtype} needs {expected}"
        )
    check_scale("scale", scale, used=kv_cache_dtype in FP8_KV_CACHE_DTYPES)
    check_step_block_size(kv_cache.shape[1], slot_mapping)
    check_slots_in_range(slot_mapping, kv_cache.shape[0], kv_cache.shape[1])
    check_distinct_slots(slot_mapping)
    return k_pe


def check_block_table(name: str, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      page_size: int, num_pages: int) -> None:
    """Every page a sequence uses is named by ``block_table`` and lies in ``[0, num_pages)``.

    ``name`` is the caller's argument name for the table (messages use it). Reads values
    (synchronises with the device); skipped when :func:`kvcore.ops.value_checks_enabled` is off.
    """
    if not value_checks_enabled() or seq_lens.numel() == 0:
        return
    lens = seq_lens.tolist()
    width = block_table.shape[1]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"sequence {i} has a negative length {n}")
        if -(-n // page_size) > width:
            raise ValueError(
                f"sequence {i} has {n} tokens, which need {-(-n // page_size)} pages of "
                f"{page_size}, but {name} has only {width} columns"
            )
    ids = torch.cat([block_table[i, : -(-n // page_size)] for i, n in enumerate(lens)])
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"{name} refers to page id {int(ids.min())}; page ids must be >= 0")
    check_block_indices(name, ids, num_pages)


def validate_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, scale: float, kv_cache_dtype: str,
                           k_scale: KVScale, output: torch.Tensor | None) -> None:
    """Validate the arguments of the latent-space ``mla_attention`` (mixed batches)."""
    for n, t in (("q", q), ("kv_cache", kv_cache), ("query_start_loc", query_start_loc),
                 ("seq_lens", seq_lens), ("block_table", block_table)):
        require_tensor(n, t)
    require_ndim("q", q, 3, "(num_tokens, num_heads, kv_lora_rank + rope_dim)")
    require_ndim("kv_cache", kv_cache, 3, "(num_blocks, block_size, kv_lora_rank + rope_dim)")
    check_step_tensor_layout(query_start_loc, seq_lens, block_table)
    require_float_dtype("q", q)
    require_same_device([("q", q), ("kv_cache", kv_cache), ("query_start_loc", query_start_loc),
                         ("seq_lens", seq_lens), ("block_table", block_table)])
    num_tokens, num_heads, entry = q.shape
    if kv_cache.shape[2] != entry:
        raise ValueError(f"q has {entry} channels but kv_cache holds {kv_cache.shape[2]}")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or not (
        0 < kv_lora_rank <= entry
    ):
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an int in 1..{entry}")
    check_kv_cache_dtype(kv_cache_dtype)
    expected = cache_torch_dtype(kv_cache_dtype, q.dtype)
    if kv_cache.dtype != expected:
        raise TypeError(f"kv_cache has dtype {kv_cache.dtype} but kv_cache_dtype="
                        f"{kv_cache_dtype!r} with q of dtype {q.dtype} needs {expected}")
    check_scale("k_scale", k_scale, used=kv_cache_dtype in FP8_KV_CACHE_DTYPES)
    check_softmax_scale(scale)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens has {num_seqs} sequences, so query_start_loc needs {num_seqs + 1} entries "
            f"(got {query_start_loc.shape[0]}) and block_table {num_seqs} rows (got "
            f"{block_table.shape[0]})"
        )
    if output is not None:
        require_tensor("output", output)
        want = (num_tokens, num_heads, kv_lora_rank)
        if tuple(output.shape) != want or output.device != q.device:
            raise ValueError(f"output has shape {tuple(output.shape)} on {output.device}; "
                             f"expected {want} on {q.device}")
    check_step_block_size(kv_cache.shape[1], query_start_loc, seq_lens, block_table)
    if not value_checks_enabled() or num_seqs == 0:
        return
    facts = checked_step_facts(query_start_loc, seq_lens, block_table)
    if facts is not None and (facts.num_tokens, facts.num_seqs, facts.block_size) == (
            num_tokens, num_seqs, kv_cache.shape[1]):
        # Checked once for the step (kvcore.ops.mark_step_checked): compare with this cache
        # instead of reading the tensors back (a sync per layer, impossible in a CUDA graph).
        if facts.max_blocks_per_seq > block_table.shape[1]:
            raise ValueError(f"a request of the step uses {facts.max_blocks_per_seq} blocks "
                             f"but block_table has only {block_table.shape[1]} columns")
        if facts.max_block_id >= kv_cache.shape[0]:
            raise ValueError(f"block_table contains block id {facts.max_block_id}, but the "
                             f"cache has only {kv_cache.shape[0]} blocks (valid ids: "
                             f"0..{kv_cache.shape[0] - 1})")
        return
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}, got "
                         f"{starts[0]}..{starts[-1]}")
    for i in range(num_seqs):
        q_len = starts[i + 1] - starts[i]
        if q_len < 0 or lens[i] < q_len:
            raise ValueError(
                f"sequence {i} has {q_len} query tokens and seq_lens[{i}]={lens[i]}; query "
                "lengths must be >= 0 and seq_lens counts cached plus new tokens"
            )
    check_block_table("block_table", block_table, seq_lens, kv_cache.shape[1],
                      kv_cache.shape[0])


# -- references ------------------------------------------------------------------------------


def concat_and_cache_mla_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                             scale: KVScale = None) -> None:
    """Write each token's latent ``[kv_c, k_pe]`` into the MLA cache, in place.

    Args:
        kv_c: ``(num_tokens, kv_lora_rank)``, the compressed KV.
        k_pe: ``(num_tokens, rope_dim)`` or ``(num_tokens, 1, rope_dim)``, the rope key.
        kv_cache: ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, any strides.
        slot_mapping: ``(num_tokens,)`` int32/int64; negative entries are skipped.
        kv_cache_dtype: ``"auto"`` (cache dtype = ``kv_c``'s) or an fp8 name.
        scale: per-tensor fp8 scale (float or 1-element tensor); ignored unless fp8.
    """
    k_pe = validate_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                                         scale)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    block_size = kv_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    s = scale_value(scale) if kv_cache_dtype in FP8_KV_CACHE_DTYPES else 1.0
    rank = kv_c.shape[1]
    # Advanced indexing on (block, offset) writes through the view's real strides.
    kv_cache[blocks, offsets, :rank] = quantize_to_cache(kv_c[keep], kv_cache.dtype, s)
    kv_cache[blocks, offsets, rank:] = quantize_to_cache(k_pe[keep], kv_cache.dtype, s)


def _gather_latents(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                    scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The latents of the requests, padded: ``(num_seqs, max(seq_lens), entry)`` in ``dtype``.

    One gather for all of them (int64 page and token indices through the cache's strides);
    positions past a request's length read page 0 and are zeroed here (a stale NaN there
    would survive a zero probability), and masked out of the softmax by the caller.
    """
    block_size = kv_cache.shape[1]
    device = kv_cache.device
    pos = torch.arange(max(seq_lens, default=0), device=device)
    valid = pos[None, :] < torch.tensor(seq_lens, device=device, dtype=torch.int64)[:, None]
    col = (pos // block_size).clamp_max(max(block_table.shape[1] - 1, 0))
    pages = block_table.to(torch.int64)[:, col].masked_fill(~valid, 0)
    offsets = (pos % block_size).expand_as(pages)
    latents = kv_cache[pages, offsets].to(dtype).masked_fill(~valid[..., None], 0.0)
    return latents * scale if scale != 1.0 else latents


def _attend(q: torch.Tensor, latents: torch.Tensor, allowed: torch.Tensor, scale: float,
            kv_lora_rank: int) -> torch.Tensor:
    """``q`` ``(n, q_len, heads, entry)`` over ``latents`` ``(n, len, entry)`` where
    ``allowed`` ``(n, q_len, len)``; returns ``(n, q_len, heads, kv_lora_rank)``."""
    scores = torch.einsum("nqhd,nkd->nqhk", q, latents) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key: zeros
    return torch.einsum("nqhk,nkd->nqhd", probs, latents[..., :kv_lora_rank])


def mla_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, *, kv_lora_rank: int,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, scale: float, kv_cache_dtype: str = "auto",
                      k_scale: KVScale = None, output: torch.Tensor | None = None) -> torch.Tensor:
    """Latent-space MLA attention for a batch mixing prefill and decode (reference).

    Vectorised: every single-token (decode) request of the batch in one gather and one batched
    product over their padded latents, then each longer request on its own (a loop over
    requests, never over tokens). Computed in float32 (float64 for a float64 ``q``).

    Args:
        q: ``(num_tokens, num_heads, kv_lora_rank + rope_dim)``: ``[W_UK^T q_nope, q_pe]``.
        kv_cache: ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, any strides; keys are
            whole latents, values their first ``kv_lora_rank`` channels.
        query_start_loc, seq_lens, block_table: the batch, as in
            :class:`kvcore.AttentionMetadata`.
        scale: softmax scale of ``q.k``.
        kv_cache_dtype, k_scale: fp8 cache and its per-tensor scale.
        output: optional ``(num_tokens, num_heads, kv_lora_rank)``, written in place.

    Returns:
        ``(num_tokens, num_heads, kv_lora_rank)`` latent outputs in ``q.dtype``; a query that
        sees no key gets zeros.
    """
    validate_mla_attention(q, kv_cache, kv_lora_rank, query_start_loc, seq_lens, block_table,
                           scale, kv_cache_dtype, k_scale, output)
    if output is None:
        output = torch.empty(*q.shape[:2], kv_lora_rank, dtype=q.dtype, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    ks = scale_value(k_scale) if kv_cache_dtype in FP8_KV_CACHE_DTYPES else 1.0
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:  # all single-token requests at once, their latents padded to the longest
        dec_lens = [lens[i] for i in decodes]
        latents = _gather_latents(kv_cache, block_table[decodes], dec_lens, ks, compute)
        width = torch.arange(latents.shape[1], device=q.device)
        allowed = width[None, None, :] < torch.tensor(dec_lens, device=q.device)[:, None, None]
        rows = torch.tensor([starts[i] for i in decodes], device=q.device)
        out = _attend(q[rows].to(compute)[:, None], latents, allowed, scale, kv_lora_rank)
        output[rows] = out[:, 0].to(output.dtype)
    for i, q_len in enumerate(q_lens):  # prefills (and chunks), one request at a time
        if q_len < 2:
            continue
        latents = _gather_latents(kv_cache, block_table[i:i + 1], [lens[i]], ks, compute)
        q_pos = torch.arange(lens[i] - q_len, lens[i], device=q.device)[:, None]
        allowed = (torch.arange(lens[i], device=q.device)[None, :] <= q_pos)[None]
        out = _attend(q[starts[i]:starts[i + 1]].to(compute)[None], latents, allowed, scale,
                      kv_lora_rank)
        output[starts[i]:starts[i + 1]] = out[0].to(output.dtype)
    return output


def mla_forward_ref(query: torch.Tensor, kv_cache: torch.Tensor, kv_b_proj_weight: torch.Tensor, *,
                    kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, scale: float, kv_cache_dtype: str = "auto",
                    k_scale: KVScale = None) -> torch.Tensor:
    """MLA attention as the model defines it: latents expanded to per-head K and V (reference).

    Independent of the absorption the backends use: each cached latent ``[c, k_pe]`` is
    expanded with ``kv_b_proj`` to ``k = [W_UK c, k_pe]`` and ``v = W_UV c`` per head, then
    ordinary causal attention runs, one request at a time.

    Args:
        query: ``(num_tokens, num_heads, qk_nope_head_dim + rope_dim)``.
        kv_cache: ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, any strides.
        kv_b_proj_weight: ``(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)``,
            the checkpoint's ``kv_b_proj.weight`` (per head: W_UK rows, then W_UV rows).
        query_start_loc, seq_lens, block_table, scale, kv_cache_dtype, k_scale: as in
            :func:`mla_attention_ref`.

    Returns:
        ``(num_tokens, num_heads, v_head_dim)``, float64 for a float64 query, else float32.
    """
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    num_tokens, num_heads, _ = query.shape
    w = kv_b_proj_weight.to(compute).view(num_heads, qk_nope_head_dim + v_head_dim,
                                          kv_lora_rank)
    ks = scale_value(k_scale) if kv_cache_dtype in FP8_KV_CACHE_DTYPES else 1.0
    out = torch.zeros(num_tokens, num_heads, v_head_dim, dtype=compute, device=query.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    latents = _gather_latents(kv_cache, block_table, lens, ks, compute)
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        latent = latents[i, :seq_len]
        c, k_pe = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
        kv = torch.einsum("sl,hel->she", c, w)
        k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi].to(compute), k) * scale
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
