"""Every vLLM name this plugin reads beyond vLLM's documented plugin interface, in one place.

vLLM's attention-backend interface changes between minor releases, and some of what a backend
needs is private (underscore names). Each such read goes through a function here, and
:data:`PRIVATE_ATTRIBUTES` lists them; ``tests/test_vllm_plugin.py`` checks every one against
the installed vLLM, so an upgrade that renames one fails there, not in a user's engine.
"""

from __future__ import annotations

from typing import Any

import torch

#: Private attributes of vLLM objects the plugin reads: (object, attribute, why).
PRIVATE_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("vllm.model_executor.layers.attention.Attention", "_k_scale_float",
     "the K dequantisation scale as a float (kvcore's LayerScales.k_scale)"),
    ("vllm.model_executor.layers.attention.Attention", "_v_scale_float",
     "the V dequantisation scale as a float (kvcore's LayerScales.v_scale)"),
)


def backend_enum() -> Any:
    """vLLM's ``AttentionBackendEnum`` (the names ``--attention-backend`` takes)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum


def register_backend(name: Any, class_path: str) -> None:
    """vLLM's ``register_backend``: a new name (a string) or an override (an enum member)."""
    from vllm.v1.attention.backends.registry import register_backend as vllm_register

    vllm_register(name, class_path)


def cpu_platform_is_current() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def layer_scales(layer: Any) -> tuple[float, float]:
    """The (k_scale, v_scale) floats of a vLLM attention layer."""
    return float(layer._k_scale_float), float(layer._v_scale_float)


def current_attn_metadata(layer_name: str) -> Any:
    """This step's metadata for ``layer_name`` from vLLM's forward context (``None`` outside
    a step)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    return metadata.get(layer_name) if isinstance(metadata, dict) else metadata


def _attention_layers(vllm_config: Any, layer_names: list[str]) -> list[Any]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return list(get_layers_from_vllm_config(vllm_config, Attention, layer_names).values())


def layer_impls(vllm_config: Any, layer_names: list[str]) -> list[Any]:
    """The attention impls of these vLLM attention layers (made with the model, before any
    builder)."""
    return [layer.impl for layer in _attention_layers(vllm_config, layer_names)]


def layer_kv_caches(vllm_config: Any, layer_names: list[str]) -> list[torch.Tensor]:
    """The KV-cache tensors vLLM bound to these attention layers (empty before allocation)."""
    caches = []
    for layer in _attention_layers(vllm_config, layer_names):
        cache = layer.kv_cache
        if isinstance(cache, (list, tuple)):  # one per virtual engine in some releases
            cache = cache[0] if cache else None
        if isinstance(cache, torch.Tensor) and cache.numel():
            caches.append(cache)
    return caches
