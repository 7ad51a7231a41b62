"""kvcore's ops: pure-torch references and the portable fast paths that plugins reuse.

Importing this package imports no kernel library; Triton kernels are imported when first
called. Every op validates its arguments (see :mod:`kvcore.ops.validation`) before launching;
the value checks of a step's metadata run once per step, not per op (:class:`StepFacts`).

Dispatch is explicit and depends only on where the tensors live: :func:`reshape_and_cache`
and :func:`paged_attention` run the Triton kernels (:mod:`kvcore.ops.triton_cache`,
:mod:`kvcore.ops.triton_attention`) when the cache is on a GPU (torch device type ``cuda``,
which is also ROCm's), and the pure-torch references otherwise. Call the Triton modules
directly to run them elsewhere (e.g. on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from kvcore.ops.reference import (
    gather_kv_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    scale_value,
)
from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    StepFacts,
    cache_torch_dtype,
    check_block_indices,
    checked_step_facts,
    mark_step_checked,
    set_value_checks,
    step_facts_from_tensors,
    validate_paged_attention,
    validate_reshape_and_cache,
    value_checks_enabled,
)

__all__ = [
    "MIN_TRITON_VERSION",
    "FP8_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "StepFacts",
    "cache_torch_dtype",
    "check_block_indices",
    "checked_step_facts",
    "gather_kv_ref",
    "mark_step_checked",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "scale_value",
    "set_value_checks",
    "step_facts_from_tensors",
    "triton_available",
    "triton_paged_attention",
    "triton_reshape_and_cache",
    "validate_paged_attention",
    "validate_reshape_and_cache",
    "value_checks_enabled",
]

#: Oldest triton the kernels are tested with (the H200 image's); CI runs 3.8+.
MIN_TRITON_VERSION = (3, 6)


def triton_available() -> tuple[bool, str]:
    """Whether triton can be imported, without importing it.

    Returns:
        ``(True, "")``, or ``(False, reason)`` where ``reason`` says what is missing and how to
        fix it (the TRITON_ATTN backend reports it as its unavailable reason).
    """
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # e.g. a source checkout on sys.path
        return True, ""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_TRITON_VERSION:
        need = ".".join(map(str, MIN_TRITON_VERSION))
        return False, f"triton {version} is too old (need >= {need}; pip install -U triton)"
    return True, ""


def triton_reshape_and_cache(*args, **kwargs) -> None:
    """:func:`reshape_and_cache` on the Triton kernel, whatever the device (CPU tensors need
    ``TRITON_INTERPRET=1``). The public handle plugins use for the portable kernel."""
    from kvcore.ops.triton_cache import reshape_and_cache as impl

    impl(*args, **kwargs)


def triton_paged_attention(*args, **kwargs) -> torch.Tensor:
    """:func:`paged_attention` on the Triton kernel, whatever the device; also takes
    ``num_kv_splits``, ``config`` and ``workspace`` (see :mod:`kvcore.ops.triton_attention`)."""
    from kvcore.ops.triton_attention import paged_attention as impl

    return impl(*args, **kwargs)


def _on_gpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Scatter new tokens into a paged cache, in place.

    Shapes and semantics are those of :func:`reshape_and_cache_ref`: ``key``/``value``
    ``(num_tokens, num_kv_heads, head_size)``; caches ``(num_blocks, block_size, num_kv_heads,
    head_size)`` of any strides; negative slots skipped; fp8 caches store ``x / scale``.
    Runs :func:`kvcore.ops.triton_cache.reshape_and_cache` when ``key_cache`` is on a GPU,
    the reference otherwise.
    """
    if _on_gpu(key_cache):
        from kvcore.ops.triton_cache import reshape_and_cache as impl
    else:
        impl = reshape_and_cache_ref
    impl(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    output: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention over a paged KV cache for a batch mixing prefill and decode requests.

    Shapes and semantics are those of :func:`paged_attention_ref` (``query`` ``(num_tokens,
    num_heads, head_size)``, caches ``(num_blocks, block_size, num_kv_heads, head_size)`` of
    any strides, varlen ``query_start_loc``/``seq_lens``, ``block_table`` ``(num_seqs,
    max_blocks_per_seq)``). Runs :func:`kvcore.ops.triton_attention.paged_attention` when the
    tensors are on a GPU and ``query`` is fp16/bf16/fp32; the reference otherwise (CPU
    tensors, float64 queries). ``num_kv_splits`` forces the Triton split-KV path and
    ``workspace`` gives it preallocated partial-result buffers (both ignored by the
    reference).
    """
    common = dict(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                  scale=scale, causal=causal, sliding_window=sliding_window,
                  kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                  output=output)
    if _on_gpu(key_cache) and _on_gpu(query) and query.dtype != torch.float64:
        from kvcore.ops.triton_attention import paged_attention as impl

        return impl(query, key_cache, value_cache, num_kv_splits=num_kv_splits,
                    workspace=workspace, **common)
    return paged_attention_ref(query, key_cache, value_cache, **common)
