"""TRITON_MLA's attention ops over a paged latent cache (Triton), and the split-KV workspace.

- :func:`mla_attention`: latent-space MLA for a batch that mixes prefill (with a cached prefix)
  and decode requests, as the TRITON_MLA backend calls it, with the step's
  :class:`~kvcore_mla.ops.mla_configs.TritonMLAPlan`;
- :func:`decode_attention_fwd`: the decode API engines know from SGLang/vLLM (one query per
  request, a float32 split workspace ``attn_logits``) for an MLA cache.

Each call runs the kernel its configuration names (:mod:`~kvcore_mla.ops.mla_configs`): a
decode batch one of the decode kernels (:mod:`~kvcore_mla.ops.triton_mla_decode`,
:mod:`~kvcore_mla.ops.gluon_mla_decode`), a mixed batch
:mod:`~kvcore_mla.ops.triton_mla_mixed`. Given no configuration, decode takes the GPU's row
of :data:`~kvcore_mla.ops.mla_configs.MLA_DECODE_CONFIGS`, its Gluon and TMA rows only where
:func:`~kvcore_mla.ops.descriptors.gluon_unmet` and
:func:`~kvcore_mla.ops.descriptors.tma_unmet` accept the tensors.

This module imports triton; :mod:`kvcore_mla.ops` imports it lazily.
"""

from __future__ import annotations

import functools
import math

import torch

from kvcore.ops import (
    FP8_KV_CACHE_DTYPES,
    MAX_KV_SPLITS,
    KVScale,
    num_sms,
    validate_mla_attention,
)
from kvcore_mla.ops.descriptors import gluon_available, gluon_unmet, tma_unmet
from kvcore_mla.ops.mla_configs import (
    GluonMLAWSConfig,
    MLADecodeConfig,
    TritonMLAMixedConfig,
    TritonMLAPlan,
    gpu_family,
    mixed_config,
    mla_decode_config,
    mla_decode_num_splits,
)
from kvcore_mla.ops.triton_mla_decode import launch_triton_mla_decode
from kvcore_mla.ops.triton_mla_mixed import launch_triton_mla_mixed
from kvcore_mla.ops.validation import FP8_DTYPES, validate_decode_attention

__all__ = ["decode_attention_fwd", "decode_partials", "mla_attention", "mla_workspace_numel",
           "plan_mla_attention"]


def _launch_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                   out: torch.Tensor, lse: torch.Tensor | None,
                   partials: tuple[torch.Tensor, torch.Tensor] | None, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, scale: float, k_scale: KVScale,
                   num_splits: int, config: MLADecodeConfig) -> None:
    """Run the decode kernel ``config`` names (arguments as
    :func:`~kvcore_mla.ops.triton_mla_decode.launch_triton_mla_decode` takes them)."""
    if not isinstance(config, GluonMLAWSConfig):
        launch_triton_mla_decode(q, kv_cache, kv_lora_rank, out, lse, partials, seq_lens,
                                 block_table, scale, k_scale, num_splits, config)
        return
    reason = gluon_available()
    if reason is not None:
        raise ValueError(reason)
    # Imported here: the Gluon module needs Triton's Gluon API (3.6 or newer).
    from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode

    if q.shape[0] == 0:
        return
    part, part_lse = partials if num_splits > 1 else (None, None)
    gluon_mla_decode(q, kv_cache, kv_lora_rank, seq_lens.contiguous(), block_table, scale, out,
                     lse, num_splits, part, part_lse)


def _table_config(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> MLADecodeConfig:
    """The table's decode config for these queries and cache: its Gluon and TMA rows only where
    they can serve them."""
    rows = functools.partial(mla_decode_config, q.shape[1], gpu_family(q.device),
                             page_size=kv_cache.shape[1], fp8_cache=kv_cache.dtype in FP8_DTYPES,
                             dtype=q.dtype)
    config = rows()
    if (isinstance(config, GluonMLAWSConfig)
            and gluon_unmet(q, kv_cache, kv_lora_rank) is not None):
        config = rows(gluon=False)
    if config.uses_tma and not isinstance(config, GluonMLAWSConfig) and tma_unmet(
            kv_cache, kv_lora_rank, config.block_n) is not None:
        config = rows(gluon=False, tma=False)
    return config


def _check_decode_config(config: object) -> None:
    if isinstance(config, TritonMLAMixedConfig) or not hasattr(config, "uses_tma"):
        raise ValueError(f"config={config!r}: a decode batch runs a decode kernel's "
                         "configuration (mla_decode_config gives the table's); "
                         "TritonMLAMixedConfig is for batches with prefill")


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, lse: torch.Tensor, req_to_page: torch.Tensor,
                         b_seq_len: torch.Tensor, attn_logits: torch.Tensor, num_kv_splits: int,
                         sm_scale: float, page_size: int, is_mla: bool = True, *,
                         k_scale: KVScale = None, v_scale: KVScale = None,
                         config: MLADecodeConfig | None = None) -> None:
    """Split-KV MLA decode over a paged latent cache, in place (Triton).

    Args:
        q: ``(batch, num_heads, kv_lora_rank + rope)``; request ``i``'s single query, at
            position ``b_seq_len[i] - 1``. fp16/bf16/fp32, any strides.
        k_buffer: the latent cache, ``(num_pages, page_size, kv_lora_rank + rope)`` (or with a
            KV-head dim of 1), of any strides: the page stride ``stride(0)`` may exceed the
            page size (one layer of a cross-layer pool). q's dtype, or fp8 (read as ``stored
            * k_scale``).
        v_buffer: ``k_buffer[..., :v_head_dim]`` (the latent's first channels): the kernel
            reads each latent once for keys and values.
        o: ``(batch, num_heads, v_head_dim)`` output, any strides.
        lse: ``(batch, num_heads)`` natural-log log-sum-exp of ``sm_scale * q.k`` per head.
        req_to_page: ``(batch, max_pages)`` int32/int64 page ids (the block table).
        b_seq_len: ``(batch,)`` tokens per request (a request with 0 tokens gets ``o = 0``,
            ``lse = -inf``).
        attn_logits: float32 workspace ``(batch, num_heads, num_kv_splits, v_head_dim + 1)``
            (unused with one split); afterwards it holds each split's normalised output and
            base-2 log-sum-exp.
        num_kv_splits: parts each request's keys are cut into (1..:data:`kvcore.ops.MAX_KV_SPLITS`).
        sm_scale: softmax scale.
        page_size: tokens per page; must equal ``k_buffer.shape[1]``.
        is_mla: must be True (MLA only; GQA/MHA caches are ``kvcore.ops.paged_attention``'s).
        k_scale, v_scale: fp8 per-tensor scales (1-element tensors or floats).
        config: a decode configuration (tuning, benchmarks); otherwise the table's
            (:func:`~kvcore_mla.ops.mla_configs.mla_decode_config`).
    """
    k_buffer, v_buffer = validate_decode_attention(
        q, k_buffer, v_buffer, o, lse, req_to_page, b_seq_len, attn_logits, num_kv_splits,
        sm_scale, page_size, is_mla, k_scale, v_scale)
    if num_kv_splits > MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits={num_kv_splits} exceeds {MAX_KV_SPLITS}")
    if q.dtype == torch.float64:
        raise TypeError("q has dtype float64; the Triton kernels take fp16/bf16/fp32 "
                        "(use kvcore_mla.ops.reference.decode_attention_ref)")
    v_dim = v_buffer.shape[3]
    cache = k_buffer[:, :, 0]
    cfg = config or _table_config(q, cache, v_dim)
    _check_decode_config(cfg)
    _launch_decode(q, cache, v_dim, o, lse, (attn_logits[..., :v_dim], attn_logits[..., v_dim]),
                   b_seq_len, req_to_page, sm_scale, k_scale, num_kv_splits, cfg)


def plan_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, *,
                       decode: bool, max_seq_len: int,
                       plan: TritonMLAPlan | None = None) -> TritonMLAPlan:
    """``plan`` with what it leaves to the op (``None`` fields) chosen: for a decode batch the
    table's config and :func:`~kvcore_mla.ops.mla_configs.mla_decode_num_splits` for requests
    of at most ``max_seq_len`` tokens on ``q``'s GPU; otherwise the mixed kernel's config and
    one split. The workspace stays as given (the call allocates one when it splits)."""
    plan = plan or TritonMLAPlan()
    config, splits = plan.config, plan.num_kv_splits
    if config is None:
        config = (_table_config(q, kv_cache, kv_lora_rank) if decode
                  else mixed_config(q.shape[1], kv_lora_rank))
    if splits is None:
        splits = 1 if not decode else mla_decode_num_splits(q.shape[0], q.shape[1], max_seq_len,
                                                            config, num_sms(q.device))
    if config is plan.config and splits == plan.num_kv_splits:
        return plan
    return TritonMLAPlan(config, splits, plan.workspace)


def _workspace(plan: TritonMLAPlan, needed: int, device: torch.device) -> torch.Tensor:
    workspace = plan.workspace
    if workspace is None:
        return torch.empty(needed, dtype=torch.float32, device=device)
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"plan.workspace must be a tensor, got {type(workspace).__name__}")
    if (workspace.dtype != torch.float32 or workspace.device != device
            or not workspace.is_contiguous()):
        raise ValueError(f"plan.workspace must be a contiguous float32 tensor on {device}, "
                         f"got {workspace.dtype} on {workspace.device} (contiguous: "
                         f"{workspace.is_contiguous()})")
    if workspace.numel() < needed:
        raise ValueError(f"plan.workspace has {workspace.numel()} elements but this call's "
                         f"split-KV path needs {needed} (see mla_workspace_numel)")
    return workspace.reshape(-1)


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, *, kv_lora_rank: int,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                  scale: float, kv_cache_dtype: str = "auto", k_scale: KVScale = None,
                  output: torch.Tensor | None = None, max_query_len: int | None = None,
                  max_seq_len: int | None = None,
                  plan: TritonMLAPlan | None = None) -> torch.Tensor:
    """Latent-space MLA attention for a batch mixing prefill and decode requests (Triton).

    Semantics and shapes are those of :func:`kvcore.ops.mla_attention_ref`:
    ``q`` ``(num_tokens, num_heads, kv_lora_rank + rope_dim)`` (absorbed ``W_UK^T q_nope``,
    then ``q_pe``); ``kv_cache`` ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` of any
    strides; causal; returns ``(num_tokens, num_heads, kv_lora_rank)`` (``output`` if given).

    Args:
        max_query_len: host-side maximum query length; when it is 1 and every request has one
            token the batch is a decode batch (one query per program, split-KV).
        max_seq_len: host-side bound on ``seq_lens`` for the split choice (default
            ``block_table.shape[1] * block_size``).
        plan: the kernel configuration (a decode one for a decode batch, the mixed kernel's
            otherwise), split count and workspace; what it leaves ``None`` (or all, with
            ``plan=None``) :func:`plan_mla_attention` chooses.
    """
    validate_mla_attention(q, kv_cache, kv_lora_rank, query_start_loc, seq_lens, block_table,
                           scale, kv_cache_dtype, k_scale, output)
    if q.dtype == torch.float64:
        raise TypeError("q has dtype float64; the Triton kernels take fp16/bf16/fp32 "
                        "(use kvcore.ops.mla_attention_ref)")
    num_tokens, num_heads, _ = q.shape
    num_seqs = seq_lens.shape[0]
    out = output if output is not None else torch.empty(
        num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    decode = max_query_len == 1 and num_tokens == num_seqs
    if plan is not None and not isinstance(plan, TritonMLAPlan):
        raise TypeError(f"plan must be a TritonMLAPlan or None, got {type(plan).__name__}")
    if plan is None or plan.config is None or plan.num_kv_splits is None:
        bound = max_seq_len if max_seq_len is not None else (
            block_table.shape[1] * kv_cache.shape[1])
        plan = plan_mla_attention(q, kv_cache, kv_lora_rank, decode=decode, max_seq_len=bound,
                                  plan=plan)
    splits = plan.num_kv_splits
    workspace = None
    if splits > 1:
        workspace = _workspace(plan, mla_workspace_numel(num_tokens, num_heads, kv_lora_rank,
                                                         splits), q.device)
    scale_used = k_scale if kv_cache_dtype in FP8_KV_CACHE_DTYPES else None
    if decode:
        _check_decode_config(plan.config)
        partials = None
        if splits > 1:
            partials = decode_partials(workspace, num_tokens, num_heads, kv_lora_rank, splits,
                                       q.dtype)
        _launch_decode(q, kv_cache, kv_lora_rank, out, None, partials, seq_lens, block_table,
                       scale, scale_used, splits, plan.config)
        return out
    if not isinstance(plan.config, TritonMLAMixedConfig):
        raise ValueError(f"plan.config names the kernel {plan.config.kernel!r}, a decode "
                         "kernel, but this batch has prefill tokens: plan it with "
                         "TritonMLAMixedConfig (mixed_config)")
    part = None
    if splits > 1:  # the mixed kernel's rows: output then base-2 LSE, float32
        padded = (num_tokens, num_heads, splits, _part_row(kv_lora_rank))
        part = workspace[:math.prod(padded)].view(padded)[..., :kv_lora_rank + 1]
    launch_triton_mla_mixed(q, kv_cache, kv_lora_rank, out, part, query_start_loc, seq_lens,
                            block_table, scale, scale_used, splits, plan.config)
    return out


def decode_partials(workspace: torch.Tensor, num_tokens: int, num_heads: int, v_dim: int,
                    num_splits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, partial_lse)`` carved out of a flat float32 workspace of
    :func:`mla_workspace_numel` elements for the MLA decode path: the base-2 log-sum-exps
    first, float32 ``(tokens, heads, splits)``; then the normalised outputs ``(tokens, heads,
    splits, v_dim)`` in ``dtype`` when it is 16-bit (the output's: half the bytes written and
    merged, rounding the merge adds is below the output's own), else float32, rows padded to
    64 bytes for vector stores."""
    rows = num_tokens * num_heads * num_splits
    partial_lse = workspace[:rows].view(num_tokens, num_heads, num_splits)
    part_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    per_float = 4 // part_dtype.itemsize
    row = -(-v_dim // (16 * per_float)) * 16 * per_float
    start = -(-rows // 16) * 16
    partials = workspace[start:start + rows * row // per_float].view(part_dtype).view(
        num_tokens, num_heads, num_splits, row)[..., :v_dim]
    return partials, partial_lse


def mla_workspace_numel(num_tokens: int, num_heads: int, kv_lora_rank: int,
                        num_kv_splits: int) -> int:
    """float32 elements of :func:`mla_attention`'s split-KV workspace (0 without splits):
    room for either layout it takes. Mixed batches: each split's normalised output and
    log-sum-exp, ``(num_tokens, num_heads, num_kv_splits, kv_lora_rank + 1)``, rows padded to
    a multiple of 16 elements. Decode: :func:`decode_partials` (the log-sum-exps, then the
    outputs in the query's 16-bit dtype or float32, rows padded to 64 bytes)."""
    if num_kv_splits <= 1:
        return 0
    rows = num_tokens * num_heads * num_kv_splits
    return -(-rows // 16) * 16 + rows * _part_row(kv_lora_rank)


def _part_row(kv_lora_rank: int) -> int:
    """float32 elements a workspace row takes: ``kv_lora_rank + 1`` rounded up to a multiple
    of 16, so every row starts 64-byte aligned and Triton (which specialises integer arguments
    divisible by 16) can store partial outputs 16 bytes at a time."""
    return -(-(kv_lora_rank + 1) // 16) * 16
