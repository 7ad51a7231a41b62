"""kvcore-mla: MLA attention backends for kvcore.

- The MLA common base (latent-cache layout, absorbed forward) is kvcore's:
  :class:`kvcore.MLACommonBackend` / :class:`kvcore.MLACommonImpl`, shared with CPU_MLA.
- :class:`TritonMLABackend` (``TRITON_MLA``, cuda and rocm): Triton kernels, cross-layer
  verified.
- :class:`DeepseekV32IndexerBackend`: the layout of DeepSeek-V3.2's indexer key cache.
- :mod:`kvcore_mla.ops`: ``concat_and_cache_mla``, ``decode_attention_fwd``,
  ``indexer_k_quant_and_cache`` and their pure-torch references.

Importing this package imports no kernel library; the backend registers through the
``kvcore.plugins`` entry point (:mod:`kvcore_mla.plugin`).
"""

from kvcore_mla.backends.indexer import DeepseekV32IndexerBackend
from kvcore_mla.backends.triton_mla import TritonMLABackend, TritonMLAImpl

__version__ = "0.1.0"

__all__ = [
    "DeepseekV32IndexerBackend",
    "TritonMLABackend",
    "TritonMLAImpl",
    "__version__",
]
