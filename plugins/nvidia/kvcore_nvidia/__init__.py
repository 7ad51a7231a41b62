"""kvcore-nvidia: NVIDIA attention backends and CUDA C++ kernels for kvcore.

Backends (registered lazily by :mod:`kvcore_nvidia.plugin`, implemented in
:mod:`kvcore_nvidia.backends`), all on kvcore's blocks-first caches
(``(num_blocks, 2, block_size, num_kv_heads, head_size)``, the MLA one below excepted):

- ``FLASHINFER``: FlashInfer's paged prefill/decode wrappers (``flashinfer-python``).
- ``FLASH_ATTN``: FlashAttention's paged varlen kernels: flash-attn-4 (``flash_attn.cute``) on
  Hopper/Blackwell, flash-attn 2 elsewhere; K and V side by side per token (``B,N,2,H,D``).
- ``FLASHINFER_MLA``: FlashInfer's MLA wrapper on kvcore's MLA latent cache
  ``(num_blocks, block_size, 576)`` (``flashinfer-python``).
- ``FLEX_ATTENTION``: torch's ``flex_attention`` with a block mask built from the block table;
  runs on CUDA (compiled) and on CPU (eager).

Kernels (:mod:`kvcore_nvidia.ops`): ``reshape_and_cache_flash`` (stride-aware cache write,
optional fp8) and ``copy_blocks`` (batched block copy between GPU and pinned host memory,
also the offload connector's ``cuda_batch`` block copier), CUDA C++ built on first use with
``torch.utils.cpp_extension``.

Importing this package imports no kernel library and builds nothing.
"""
