"""kvcore-mla: MLA attention backends for kvcore.

- :class:`MLACommonBackend` / :class:`MLACommonImpl`: the latent-cache layout ``(num_blocks,
  block_size, kv_lora_rank + rope_dim)`` (opted out of cross-layer) and the absorbed forward.
- :class:`TritonMLABackend` (``TRITON_MLA``, cuda and rocm): Triton kernels, cross-layer
  verified.
- :class:`DeepseekV32IndexerBackend`: the layout of DeepSeek-V3.2's indexer key cache.
- :mod:`kvcore_mla.ops`: ``concat_and_cache_mla``, ``decode_attention_fwd``,
  ``indexer_k_quant_and_cache`` and their pure-torch references.

Importing this package imports no kernel library; the backend registers through the
``kvcore.plugins`` entry point (:mod:`kvcore_mla.plugin`).
"""

from kvcore_mla.backends.common import MLACommonBackend, MLACommonImpl
from kvcore_mla.backends.indexer import DeepseekV32IndexerBackend
from kvcore_mla.backends.triton_mla import TritonMLABackend, TritonMLAImpl

__version__ = "0.1.0"

__all__ = [
    "DeepseekV32IndexerBackend",
    "MLACommonBackend",
    "MLACommonImpl",
    "TritonMLABackend",
    "TritonMLAImpl",
    "__version__",
]
