"""The ROCm attention backends, one module each (:mod:`.rocm_attn`, :mod:`.aiter_unified_attn`,
:mod:`.aiter_fa`) over the shared :mod:`.common`.

================================  =====================================  ==================
backend                           one layer's KV cache (logical shape)   KV connectors
================================  =====================================  ==================
``ROCM_AITER_UNIFIED_ATTN``       ``(num_blocks, 2, N, H, D)``            yes
``ROCM_AITER_FA``                 ``(num_blocks, 2, N, H, D)``, pages     yes
                                  shuffled (:mod:`kvcore_rocm.ops.shuffle`)
``ROCM_ATTN``                     legacy ``(2, num_blocks, N, H, D)``     no
================================  =====================================  ==================

(``N`` = block_size, ``H`` = num_kv_heads, ``D`` = head_size.) The blocks-first backends split
K and V with ``kv_cache.unbind(1)``; ROCM_ATTN with ``kv_cache.unbind(0)``.

Kernels:

- ``ROCM_AITER_UNIFIED_ATTN`` calls aiter's ``unified_attention`` when ``amd-aiter`` is
  installed and the tensors are on the GPU; otherwise kvcore's portable Triton kernels
  (``kvcore.ops.triton_reshape_and_cache`` / ``triton_paged_attention``), which take every stride
  from the views, so the backend opts in to cross-layer caches when it runs on them.
- ``ROCM_AITER_FA`` writes the cache with the stride-aware Triton
  :func:`~kvcore_rocm.ops.shuffle.reshape_and_cache_shuffle` and needs aiter for attention: the
  shuffled K page interleaves ``head_size`` with ``block_size`` (``(H, D // x, N, x)``), which no
  ``(block, token, head, dim)`` stride set can describe, so the portable kernels cannot read it.
- ``ROCM_ATTN`` runs kvcore's Triton kernels on the two halves of the legacy cache.

**Unverified:** the aiter calls (``aiter.ops.triton.unified_attention.unified_attention`` and
``aiter.flash_attn_varlen_func``) are written from aiter's documented Python entry points but
have never run: no machine here has an AMD GPU or aiter. Everything else is tested on CPU under
``TRITON_INTERPRET=1``.
"""
