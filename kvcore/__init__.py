"""kvcore: one KV-cache layout contract, a plugin registry of attention backends, and KV
connectors for LLM inference engines.

The public API (what plugins may import) is what this module, :mod:`kvcore.ops`,
:mod:`kvcore.connectors` and :mod:`kvcore.testing` export. Importing kvcore loads no plugin
and no kernel library: backends are resolved when selected. The names below are imported on
first use (PEP 562), so ``import kvcore`` alone, as the ``kvcore`` command's ``--help`` does,
does not import torch: the first name used imports the whole API at once, except the names
of :data:`_LEAF_MODULES`, which import nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (imported on first access).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvcore.adopt": ("adopt_kv_caches", "attention_metadata_from_engine", "from_vllm_layer_view"),
    "kvcore.allocate": ("KVCaches", "allocate_kv_caches"),
    "kvcore.backends.triton_attn": (
        "TritonAttentionImpl", "TritonAttentionMetadata", "TritonAttentionMetadataBuilder",
    ),
    "kvcore.backend": (
        "FEATURE_FLAGS", "AttentionBackend", "CudaGraphSupport", "format_supported",
        "is_supported",
    ),
    "kvcore.builder": ("AttentionMetadataBuilder", "PersistentMetadataBuilder"),
    "kvcore.impl": ("AttentionImpl", "KVSplit", "PagedAttentionImpl"),
    "kvcore.config": ("AttentionSelectorConfig",),
    "kvcore.cuda_graphs": ("CudaGraphRunner",),
    "kvcore.dtypes": ("parse_dtype",),
    "kvcore.hookspecs": ("hookimpl",),
    "kvcore.layout": ("KVCacheLayout", "LayoutMismatchError"),
    "kvcore.layout_names": ("VLLM_LAYOUTS", "vllm_layout_name", "vllm_layout_order"),
    "kvcore.metadata": (
        "AttentionLayer", "AttentionMetadata", "LayerScales", "build_attention_metadata",
        "encoder_only_cache", "is_uniform_decode",
    ),
    "kvcore.mla": ("MLACommonBackend", "MLACommonImpl", "MLAMetadata", "MLAStepBuffers",
                   "MLAStepViews", "latent_cache_shape"),
    "kvcore.models": ("LayerAttention", "MLADims", "MODELS", "ModelCase", "ModelPreset",
                      "get_model"),
    "kvcore.platform": (
        "Platform", "available_platforms", "clear_platform_cache", "current_platform",
        "get_platform", "require_present_platform",
    ),
    "kvcore.platform_types": (
        "PHASES", "AttentionType", "DeviceCapability", "MultipleOf", "PhaseRanking",
    ),
    "kvcore.plugins": (
        "PluginInfo", "list_plugins", "register_plugin", "reset_plugins", "unregister_plugin",
    ),
    "kvcore.progress": ("long_step", "progress_enabled", "set_progress"),
    "kvcore.ranking": (
        "DeviceIdentity", "MeasuredCase", "MeasuredOrder", "Ranking", "RankingFileError",
        "ShippedOrder", "current_identity", "library_versions", "load_rankings",
        "load_shipped_rankings", "merged_ranking", "nearest_cases", "ranking_config_key",
        "ranking_path", "ranking_shape_class", "shipped_order", "write_ranking",
    ),
    "kvcore.registry": (
        "DuplicateRegistrationError", "ResolveError", "UnknownNameError", "backend_platforms",
        "backend_registry", "block_copier_registry", "connector_registry", "platform_registry",
        "plugin_status_reports", "resolve_backend",
    ),
    "kvcore.selector": (
        "BackendSelectionError", "CandidateReport", "NoValidBackendError", "SelectionReport",
        "clear_selection_cache", "explain_selection", "get_attn_backend",
    ),
    "kvcore.spec": ("FullAttentionSpec", "KVCacheSpec", "MLAAttentionSpec"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
#: Modules that import neither torch nor the rest of kvcore: their names load alone.
_LEAF_MODULES = frozenset({"kvcore.layout_names", "kvcore.platform_types", "kvcore.progress"})
#: Backend modules: loaded only when one of their names is used (after the rest of the API),
#: so that registering the backends still imports none of them.
_ON_DEMAND_MODULES = frozenset({"kvcore.backends.triton_attn"})

if TYPE_CHECKING:  # what type checkers and import-linter see
    from kvcore.adopt import adopt_kv_caches, attention_metadata_from_engine, from_vllm_layer_view
    from kvcore.allocate import KVCaches, allocate_kv_caches
    from kvcore.backend import (
        FEATURE_FLAGS,
        AttentionBackend,
        CudaGraphSupport,
        format_supported,
        is_supported,
    )
    from kvcore.backends.triton_attn import (
        TritonAttentionImpl,
        TritonAttentionMetadata,
        TritonAttentionMetadataBuilder,
    )
    from kvcore.builder import AttentionMetadataBuilder, PersistentMetadataBuilder
    from kvcore.config import AttentionSelectorConfig
    from kvcore.cuda_graphs import CudaGraphRunner
    from kvcore.dtypes import parse_dtype
    from kvcore.hookspecs import hookimpl
    from kvcore.impl import AttentionImpl, KVSplit, PagedAttentionImpl
    from kvcore.layout import KVCacheLayout, LayoutMismatchError
    from kvcore.layout_names import VLLM_LAYOUTS, vllm_layout_name, vllm_layout_order
    from kvcore.metadata import (
        AttentionLayer,
        AttentionMetadata,
        LayerScales,
        build_attention_metadata,
        encoder_only_cache,
        is_uniform_decode,
    )
    from kvcore.mla import (
        MLACommonBackend,
        MLACommonImpl,
        MLAMetadata,
        MLAStepBuffers,
        MLAStepViews,
        latent_cache_shape,
    )
    from kvcore.models import MODELS, LayerAttention, MLADims, ModelCase, ModelPreset, get_model
    from kvcore.platform import (
        Platform,
        available_platforms,
        clear_platform_cache,
        current_platform,
        get_platform,
        require_present_platform,
    )
    from kvcore.platform_types import (
        PHASES,
        AttentionType,
        DeviceCapability,
        MultipleOf,
        PhaseRanking,
    )
    from kvcore.plugins import (
        PluginInfo,
        list_plugins,
        register_plugin,
        reset_plugins,
        unregister_plugin,
    )
    from kvcore.progress import long_step, progress_enabled, set_progress
    from kvcore.ranking import (
        DeviceIdentity,
        MeasuredCase,
        MeasuredOrder,
        Ranking,
        RankingFileError,
        ShippedOrder,
        current_identity,
        library_versions,
        load_rankings,
        load_shipped_rankings,
        merged_ranking,
        nearest_cases,
        ranking_config_key,
        ranking_path,
        ranking_shape_class,
        shipped_order,
        write_ranking,
    )
    from kvcore.registry import (
        DuplicateRegistrationError,
        ResolveError,
        UnknownNameError,
        backend_platforms,
        backend_registry,
        block_copier_registry,
        connector_registry,
        platform_registry,
        plugin_status_reports,
        resolve_backend,
    )
    from kvcore.selector import (
        BackendSelectionError,
        CandidateReport,
        NoValidBackendError,
        SelectionReport,
        clear_selection_cache,
        explain_selection,
        get_attn_backend,
    )
    from kvcore.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSelectorConfig",
    "AttentionType",
    "BackendSelectionError",
    "CandidateReport",
    "CudaGraphRunner",
    "CudaGraphSupport",
    "DeviceCapability",
    "DeviceIdentity",
    "DuplicateRegistrationError",
    "FEATURE_FLAGS",
    "FullAttentionSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCaches",
    "KVSplit",
    "LayerAttention",
    "LayerScales",
    "LayoutMismatchError",
    "MLAAttentionSpec",
    "MLACommonBackend",
    "MLACommonImpl",
    "MLADims",
    "MLAMetadata",
    "MLAStepBuffers",
    "MLAStepViews",
    "MODELS",
    "MeasuredCase",
    "MeasuredOrder",
    "ModelCase",
    "ModelPreset",
    "MultipleOf",
    "NoValidBackendError",
    "PHASES",
    "PagedAttentionImpl",
    "PersistentMetadataBuilder",
    "PhaseRanking",
    "Platform",
    "PluginInfo",
    "Ranking",
    "RankingFileError",
    "ResolveError",
    "SelectionReport",
    "ShippedOrder",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
    "UnknownNameError",
    "VLLM_LAYOUTS",
    "__version__",
    "adopt_kv_caches",
    "allocate_kv_caches",
    "attention_metadata_from_engine",
    "available_platforms",
    "backend_platforms",
    "backend_registry",
    "block_copier_registry",
    "build_attention_metadata",
    "clear_platform_cache",
    "clear_selection_cache",
    "connector_registry",
    "current_identity",
    "current_platform",
    "encoder_only_cache",
    "explain_selection",
    "format_supported",
    "from_vllm_layer_view",
    "get_attn_backend",
    "get_model",
    "get_platform",
    "hookimpl",
    "is_supported",
    "is_uniform_decode",
    "latent_cache_shape",
    "library_versions",
    "list_plugins",
    "load_rankings",
    "load_shipped_rankings",
    "long_step",
    "merged_ranking",
    "nearest_cases",
    "parse_dtype",
    "platform_registry",
    "plugin_status_reports",
    "progress_enabled",
    "ranking_config_key",
    "ranking_path",
    "ranking_shape_class",
    "register_plugin",
    "require_present_platform",
    "reset_plugins",
    "resolve_backend",
    "set_progress",
    "shipped_order",
    "unregister_plugin",
    "vllm_layout_name",
    "vllm_layout_order",
    "write_ranking",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:  # a submodule, e.g. ``kvcore.ops`` after a bare ``import kvcore``
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module in _LEAF_MODULES:
        modules = [module]
    else:
        modules = [m for m in _EXPORTS if m not in _ON_DEMAND_MODULES]
        modules += [module] if module in _ON_DEMAND_MODULES else []
    for loading in modules:
        loaded = importlib.import_module(loading)
        for export in _EXPORTS[loading]:
            globals()[export] = getattr(loaded, export)  # later lookups skip this function
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
