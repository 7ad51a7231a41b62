"""kvcore's ops: pure-torch references and the portable fast paths that plugins reuse.

Importing this package imports no kernel library; Triton kernels are imported when first
called. Every op validates its arguments (see :mod:`kvcore.ops.validation`) before launching;
the value checks of a step's metadata run once per step, not per op (:class:`StepFacts`).

Dispatch is explicit and depends only on where the tensors live: :func:`reshape_and_cache`
and :func:`paged_attention` run the Triton kernels (:mod:`kvcore.ops.triton_cache`,
:mod:`kvcore.ops.triton_attention`) when the cache is on a GPU (torch device type ``cuda``,
which is also ROCm's), and the pure-torch references otherwise. Call the Triton modules
directly to run them elsewhere (e.g. on CPU tensors under ``TRITON_INTERPRET=1``).

MLA (:mod:`kvcore.ops.mla_reference`): :func:`concat_and_cache_mla_ref` writes latents,
:func:`mla_attention_ref` is the absorbed latent-space attention (the CPU_MLA backend's kernel)
and :func:`mla_forward_ref` the model's unabsorbed math; MLA plugins validate with the same
checks (:func:`validate_concat_and_cache_mla`, :func:`validate_mla_attention`,
:func:`check_block_table`).

Block movement by id (:mod:`kvcore.blocks`): :func:`check_block_mapping` validates a mapping
``src[src_ids[i]] -> dst[dst_ids[i]]`` between two blocks-first caches (messages name the
caller's arguments), and :func:`block_runs` merges it into ``(first_src, first_dst, count)``
runs, one copy each. Block copiers and platforms use them instead of their own checks.

TRITON_ATTN's kernels by name (:data:`KERNELS`, :mod:`kvcore.ops.attention_config`): each has a
frozen config class (:class:`TritonDecodeConfig`, :class:`TritonSplitKVConfig`,
:class:`TritonPrefillConfig`, :class:`GluonPrefillConfig`); a builder hands its choices to the
op as a :class:`TritonAttentionPlan`. Split-KV (:mod:`kvcore.ops.split_kv`), for any kernel
that writes partial outputs and base-2 log-sum-exps: the split rule (:func:`kv_split_count`,
TRITON_ATTN's :func:`default_num_kv_splits`), :func:`num_sms`, :func:`workspace_numel`, the
merge (:func:`merge_kv_splits`) and the constants :data:`LOG2E`, :data:`LN2`,
:data:`MAX_KV_SPLITS`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from kvcore.blocks import block_runs, check_block_mapping
from kvcore.ops.attention_config import (
    KERNELS,
    AttentionConfig,
    GluonPrefillConfig,
    TritonAttentionPlan,
    TritonDecodeConfig,
    TritonPrefillConfig,
    TritonSplitKVConfig,
)
from kvcore.ops.mla_reference import (
    check_block_table,
    concat_and_cache_mla_ref,
    mla_attention_ref,
    mla_forward_ref,
    validate_concat_and_cache_mla,
    validate_mla_attention,
)
from kvcore.ops.reference import (
    fp8_inverse_scale,
    fp8_scale_values,
    gather_kv_ref,
    paged_attention_ref,
    quantize_to_cache,
    reshape_and_cache_ref,
    scale_value,
)
from kvcore.ops.split_kv import (
    LN2,
    LOG2E,
    MAX_KV_SPLITS,
    default_num_kv_splits,
    kv_split_count,
    merge_kv_splits,
    num_sms,
    round_filling_split_count,
    workspace_numel,
)
from kvcore.ops.torch_attention import paged_attention_torch
from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    KVScale,
    StepFacts,
    cache_torch_dtype,
    check_block_indices,
    check_distinct_pages,
    check_distinct_slots,
    check_kv_cache_dtype,
    check_scale,
    check_slots_in_range,
    check_softmax_scale,
    checked_step_facts,
    mark_step_checked,
    require_float_dtype,
    require_int_dtype,
    require_ndim,
    require_same_device,
    require_tensor,
    set_value_checks,
    step_facts_from_tensors,
    validate_paged_attention,
    validate_reshape_and_cache,
    value_checks_enabled,
)
from kvcore.platform_types import DeviceCapability

__all__ = [
    "KERNELS",
    "LN2",
    "LOG2E",
    "MAX_KV_SPLITS",
    "MIN_TRITON_VERSION",
    "TRITON_FP8_CAPABILITY",
    "FP8_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "AttentionConfig",
    "KVScale",
    "GluonPrefillConfig",
    "StepFacts",
    "TritonAttentionPlan",
    "TritonDecodeConfig",
    "TritonPrefillConfig",
    "TritonSplitKVConfig",
    "block_runs",
    "cache_torch_dtype",
    "check_block_indices",
    "check_block_mapping",
    "check_block_table",
    "check_distinct_pages",
    "check_distinct_slots",
    "check_kv_cache_dtype",
    "check_scale",
    "check_softmax_scale",
    "check_slots_in_range",
    "checked_step_facts",
    "concat_and_cache_mla_ref",
    "default_num_kv_splits",
    "fp8_inverse_scale",
    "fp8_scale_values",
    "gather_kv_ref",
    "kv_split_count",
    "mark_step_checked",
    "merge_kv_splits",
    "mla_attention_ref",
    "mla_forward_ref",
    "num_sms",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_torch",
    "quantize_to_cache",
    "require_float_dtype",
    "require_int_dtype",
    "require_ndim",
    "require_same_device",
    "require_tensor",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "round_filling_split_count",
    "scale_value",
    "set_value_checks",
    "step_facts_from_tensors",
    "triton_available",
    "triton_convert_blocks",
    "triton_fp8_reasons",
    "triton_paged_attention",
    "triton_reshape_and_cache",
    "triton_unavailable_reasons",
    "validate_concat_and_cache_mla",
    "validate_mla_attention",
    "validate_paged_attention",
    "validate_reshape_and_cache",
    "value_checks_enabled",
    "workspace_numel",
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


def triton_unavailable_reasons() -> list[str]:
    """:func:`triton_available` as a backend's unavailable reasons: ``[]`` when triton can run,
    else ``[reason]``. A backend whose kernels (or cache write) are Triton adds these to its
    :meth:`~kvcore.AttentionBackend.unavailable_reasons`."""
    ok, reason = triton_available()
    return [] if ok else [reason]


#: Triton's fp8 conversions on NVIDIA GPUs need this device capability (Ada, Hopper and later).
TRITON_FP8_CAPABILITY = DeviceCapability(8, 9)


def triton_fp8_reasons(kv_cache_dtype: str,
                       device_capability: DeviceCapability | None) -> list[str]:
    """Why a Triton kernel cannot use an fp8 ``kv_cache_dtype`` on this device, if it cannot.

    Triton converts to and from fp8 on CUDA devices of capability >=
    :data:`TRITON_FP8_CAPABILITY`; ROCm devices (``device_capability.arch`` set) and an unknown
    device (``None``) are not refused. For a backend's ``check_combination``.
    """
    if (kv_cache_dtype in FP8_KV_CACHE_DTYPES and device_capability is not None
            and device_capability.arch is None
            and not device_capability.at_least(TRITON_FP8_CAPABILITY)):
        return [f"kv_cache_dtype={kv_cache_dtype} needs device capability >= "
                f"{TRITON_FP8_CAPABILITY} on CUDA for fp8 conversions (got {device_capability}); "
                "use kv_cache_dtype=auto"]
    return []


def triton_reshape_and_cache(*args, **kwargs) -> None:
    """:func:`reshape_and_cache` on the Triton kernel, whatever the device (CPU tensors need
    ``TRITON_INTERPRET=1``). The public handle plugins use for the portable kernel."""
    from kvcore.ops.triton_cache import reshape_and_cache as impl

    impl(*args, **kwargs)


def triton_convert_blocks(*args, **kwargs) -> int:
    """:func:`kvcore.ops.triton_convert.convert_blocks`: a layout conversion's gather in one
    Triton launch, whatever the device (CPU tensors need ``TRITON_INTERPRET=1``)."""
    from kvcore.ops.triton_convert import convert_blocks as impl

    return impl(*args, **kwargs)


def triton_paged_attention(*args, **kwargs) -> torch.Tensor:
    """:func:`paged_attention` on the Triton kernels, whatever the device (CPU tensors need
    ``TRITON_INTERPRET=1``)."""
    from kvcore.ops.triton_attention import paged_attention as impl

    return impl(*args, **kwargs)


def _on_gpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str = "auto", k_scale: KVScale = None,
                      v_scale: KVScale = None) -> None:
    """:func:`reshape_and_cache_ref`'s cache write (arguments, shapes and result documented
    there): :func:`kvcore.ops.triton_cache.reshape_and_cache` when ``key_cache`` is on a GPU,
    the reference otherwise."""
    if _on_gpu(key_cache):
        from kvcore.ops.triton_cache import reshape_and_cache as impl
    else:
        impl = reshape_and_cache_ref
    impl(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def paged_attention(
        query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
        scale: float, causal: bool = True, sliding_window: int | None = None,
        kv_cache_dtype: str = "auto", k_scale: KVScale = None, v_scale: KVScale = None,
        output: torch.Tensor | None = None, plan: TritonAttentionPlan | None = None,
        logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_ref`'s attention (arguments, shapes and result documented
    there): :func:`kvcore.ops.triton_attention.paged_attention` when the tensors are on a GPU
    and ``query`` is fp16/bf16/fp32, the reference otherwise (CPU tensors, float64 queries).
    ``plan`` (:class:`TritonAttentionPlan`: kernel config, split count, split-KV workspace)
    goes to the Triton kernels; the reference ignores it."""
    common = dict(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                  scale=scale, causal=causal, sliding_window=sliding_window,
                  kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                  output=output, logits_soft_cap=logits_soft_cap, sinks=sinks)
    if _on_gpu(key_cache) and _on_gpu(query) and query.dtype != torch.float64:
        from kvcore.ops.triton_attention import paged_attention as impl

        return impl(query, key_cache, value_cache, plan=plan, **common)
    return paged_attention_ref(query, key_cache, value_cache, **common)
