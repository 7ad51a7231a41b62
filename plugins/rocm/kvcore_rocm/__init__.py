"""kvcore-rocm: AMD attention backends for kvcore.

Backends (registered by :mod:`kvcore_rocm.plugin`, one module each in
:mod:`kvcore_rocm.backends`):

- ``ROCM_AITER_UNIFIED_ATTN``: blocks-first cache, aiter's unified attention when aiter is
  installed, kvcore's portable Triton kernels otherwise.
- ``ROCM_AITER_FA``: blocks-first cache whose pages hold aiter's *shuffled* layout
  (:mod:`kvcore_rocm.ops.shuffle`); needs aiter for attention.
- ``ROCM_ATTN``: the legacy ``(2, num_blocks, ...)`` layout; KV connectors not supported.

Kernels: :mod:`kvcore_rocm.ops`. Importing this package imports no kernel library.
"""
