"""MLA ops: pure-torch references and the Triton fast paths, dispatched by device.

Importing this package imports no kernel library. Each op below runs its Triton kernel
(:mod:`kvcore_mla.ops.triton_cache`, :mod:`kvcore_mla.ops.triton_mla_attention`) when the
cache is on a GPU (torch device type ``cuda``, which is also ROCm's) and the query is not
float64, and its reference otherwise: kvcore's for the MLA cache write and attention
(``concat_and_cache_mla_ref``, ``mla_attention_ref``, ``mla_forward_ref``, re-exported here
from :mod:`kvcore.ops`), :mod:`kvcore_mla.ops.reference` for the plugin's own kernels. Call
the Triton modules directly to run them elsewhere (e.g. on CPU tensors under
``TRITON_INTERPRET=1``). Every implementation validates its arguments with the same checks
(:mod:`kvcore_mla.ops.validation`).
"""

from __future__ import annotations

import torch

from kvcore.ops import KVScale, concat_and_cache_mla_ref, mla_attention_ref, mla_forward_ref
from kvcore_mla.ops.reference import (
    INDEXER_FP8_MAX,
    decode_attention_ref,
    indexer_k_dequant_ref,
    indexer_k_quant_and_cache_ref,
)
from kvcore_mla.ops.validation import INDEXER_SCALE_FORMATS, indexer_cache_head_size

__all__ = [
    "INDEXER_FP8_MAX",
    "INDEXER_SCALE_FORMATS",
    "concat_and_cache_mla",
    "concat_and_cache_mla_ref",
    "decode_attention_fwd",
    "decode_attention_ref",
    "indexer_cache_head_size",
    "indexer_k_dequant_ref",
    "indexer_k_quant_and_cache",
    "indexer_k_quant_and_cache_ref",
    "mla_attention_ref",
    "mla_forward_ref",
]


def _on_gpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                         scale: KVScale = None) -> None:
    """Write latents ``[kv_c, k_pe]`` into the MLA cache at ``slot_mapping``, in place.

    See :func:`kvcore.ops.concat_and_cache_mla_ref` for shapes and semantics.
    """
    if _on_gpu(kv_cache):
        from kvcore_mla.ops.triton_cache import concat_and_cache_mla as impl
    else:
        impl = concat_and_cache_mla_ref
    impl(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int = 128, scale_fmt: str | None = None) -> None:
    """Quantise DeepSeek-V3.2 indexer keys to fp8 (per-block scales) into their cache, in place.

    See :func:`kvcore_mla.ops.reference.indexer_k_quant_and_cache_ref` for the byte layout.
    """
    if _on_gpu(kv_cache):
        from kvcore_mla.ops.triton_cache import indexer_k_quant_and_cache as impl
    else:
        impl = indexer_k_quant_and_cache_ref
    impl(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, *args: object,
                         **scales: KVScale) -> None:
    """Split-KV MLA decode over a paged latent cache, writing ``o`` and ``lse``: the Triton
    kernels for GPU tensors (a query not float64), else
    :func:`~kvcore_mla.ops.reference.decode_attention_ref`.

    Arguments as :func:`kvcore_mla.ops.triton_mla_attention.decode_attention_fwd` takes them
    (``v_buffer, o, lse, req_to_page, b_seq_len, attn_logits, num_kv_splits, sm_scale,
    page_size, is_mla`` after ``q`` and ``k_buffer``; ``k_scale``, ``v_scale`` by keyword).
    """
    if _on_gpu(k_buffer) and q.dtype != torch.float64:
        from kvcore_mla.ops.triton_mla_attention import decode_attention_fwd as impl
    else:
        impl = decode_attention_ref
    impl(q, k_buffer, *args, **scales)
