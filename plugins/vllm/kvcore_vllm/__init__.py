"""kvcore-vllm: kvcore's attention backends inside vLLM's engine.

A vLLM general plugin (entry point ``vllm.general_plugins``, name ``kvcore``) that registers
every backend kvcore's registry knows, built-in and third-party, as a vLLM attention backend
named ``KVCORE_<NAME>`` (pick one with ``--attention-backend KVCORE_TRITON_ATTN``), plus
``KVCORE``, which lets kvcore's selector choose per layer. On a CPU, where vLLM's platform
hard-codes ``CPU_ATTN``, ``KVCORE`` stands in for it (``KVCORE_VLLM_CPU=0`` keeps vLLM's own).

vLLM's memory and metadata are adopted, never copied: each layer's ``[B, H, N, C]`` view
becomes kvcore's ``(B, 2, N, H, D)`` view (:func:`kvcore.from_vllm_layer_view`), and the step's
``CommonAttentionMetadata`` becomes kvcore metadata without a device read
(:func:`kvcore.attention_metadata_from_engine`).
"""

__all__ = ["SUPPORTED_VLLM"]

#: The vLLM releases this plugin follows (its backend interface changes between minors).
SUPPORTED_VLLM = ">=0.32,<0.33"
