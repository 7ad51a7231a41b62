"""kvcore: one KV-cache layout contract, a plugin registry of attention backends, and KV
connectors for LLM inference engines.

The public API (what plugins may import) is what this module, :mod:`kvcore.ops`,
:mod:`kvcore.connectors` and :mod:`kvcore.testing` export. Importing kvcore loads no plugin
and no kernel library: backends are resolved when selected.
"""

from kvcore.allocate import KVCaches, allocate_kv_caches
from kvcore.backend import (
    FEATURE_FLAGS,
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    LayerScales,
    PagedAttentionImpl,
    build_attention_metadata,
)
from kvcore.config import AttentionSelectorConfig
from kvcore.dtypes import parse_dtype
from kvcore.hookspecs import hookimpl
from kvcore.layout import KVCacheLayout, LayoutMismatchError
from kvcore.mla import MLACommonBackend, MLACommonImpl, latent_cache_shape
from kvcore.platform import (
    Platform,
    available_platforms,
    clear_platform_cache,
    current_platform,
    get_platform,
)
from kvcore.platform_types import AttentionType, DeviceCapability, MultipleOf
from kvcore.plugins import (
    PluginInfo,
    list_plugins,
    register_plugin,
    reset_plugins,
    unregister_plugin,
)
from kvcore.registry import (
    DuplicateRegistrationError,
    ResolveError,
    UnknownNameError,
    backend_registry,
    block_copier_registry,
    connector_registry,
    platform_registry,
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

__version__ = "0.1.0"

__all__ = [
    "FEATURE_FLAGS",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadata",
    "AttentionSelectorConfig",
    "AttentionType",
    "BackendSelectionError",
    "CandidateReport",
    "DeviceCapability",
    "DuplicateRegistrationError",
    "FullAttentionSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCaches",
    "LayerScales",
    "LayoutMismatchError",
    "MLAAttentionSpec",
    "MLACommonBackend",
    "MLACommonImpl",
    "MultipleOf",
    "NoValidBackendError",
    "PagedAttentionImpl",
    "Platform",
    "PluginInfo",
    "ResolveError",
    "SelectionReport",
    "UnknownNameError",
    "allocate_kv_caches",
    "available_platforms",
    "backend_registry",
    "block_copier_registry",
    "build_attention_metadata",
    "clear_platform_cache",
    "clear_selection_cache",
    "connector_registry",
    "current_platform",
    "explain_selection",
    "get_attn_backend",
    "get_platform",
    "latent_cache_shape",
    "hookimpl",
    "list_plugins",
    "parse_dtype",
    "platform_registry",
    "register_plugin",
    "reset_plugins",
    "resolve_backend",
    "unregister_plugin",
    "__version__",
]
