"""KV connectors: move KV blocks between a model's cache and CPU memory, a peer, or disk.

The API is :class:`KVConnector` (see :mod:`kvcore.connectors.base`); connectors are obtained
by name with :func:`get_connector`. Built-ins (registered through the same
``kvcore_register_connectors`` hook as any plugin, and imported only when asked for):

``offload``  pinned CPU memory, bounded, LRU (:mod:`kvcore.connectors.offload`)
``p2p``      another process over ``torch.distributed`` (:mod:`kvcore.connectors.p2p`)
``storage``  one safetensors file per block under a shared directory
             (:mod:`kvcore.connectors.storage`)
``nixl``     another engine's cache, read through NIXL, for disaggregated prefill/decode
             (:mod:`kvcore.connectors.nixl`; needs ``pip install 'kvcore[nixl]'``)
``mooncake`` the same through Mooncake's transfer engine (:mod:`kvcore.connectors.mooncake`;
             needs ``pip install 'kvcore[mooncake]'``)

Layout conversion (:mod:`kvcore.connectors.convert`): :func:`plan_conversion` plans how KV moves
between caches of different layouts (block size, order, cross-layer, TP head slices, fp8) and
:meth:`ConversionPlan.apply` moves it.

Block copiers (:mod:`kvcore.connectors.copiers`) are vendor ways to move many blocks between a
device and pinned memory, registered by plugins; ``offload`` can use one.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvcore.connectors.base import (
    FAILURE_POLICIES,
    ConnectorStats,
    KVConnector,
    KVTransferError,
    RegisteredCaches,
    TransferHandle,
    TransferResult,
)
from kvcore.connectors.blocks import (
    extract_kv_from_layer,
    inject_kv_into_layer,
    virtually_split_kv_in_blocks,
)
from kvcore.connectors.convert import (
    ConversionPlan,
    LayoutConversionError,
    block_rows_layout,
    plan_conversion,
)
from kvcore.connectors.copiers import BlockCopier, block_copier_names, get_block_copier
from kvcore.connectors.keys import check_block_keys, hash_block_tokens, hash_request_tokens
from kvcore.connectors.tp import TPRank, heads_of_rank, reader_ranks, source_ranks
from kvcore.registry import ResolveError, connector_registry

__all__ = [
    "FAILURE_POLICIES",
    "BlockCopier",
    "ConnectorStats",
    "ConversionPlan",
    "KVConnector",
    "KVTransferError",
    "LayoutConversionError",
    "RegisteredCaches",
    "TPRank",
    "TransferHandle",
    "TransferResult",
    "block_copier_names",
    "block_rows_layout",
    "check_block_keys",
    "extract_kv_from_layer",
    "get_block_copier",
    "get_connector",
    "get_connector_class",
    "hash_block_tokens",
    "hash_request_tokens",
    "heads_of_rank",
    "inject_kv_into_layer",
    "plan_conversion",
    "reader_ranks",
    "source_ranks",
    "virtually_split_kv_in_blocks",
]


def get_connector_class(name: str) -> type[KVConnector]:
    """The connector class registered as ``name`` (``UnknownNameError`` lists valid names)."""
    registry = connector_registry()
    cls = registry.resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        reg = registry.get(name)
        raise ResolveError(f"KV connector {reg.name!r} (plugin {reg.plugin!r}) resolves to "
                           f"{cls!r}, which is not a kvcore.connectors.KVConnector subclass")
    return cls


def get_connector(name: str, **config: Any) -> KVConnector:
    """Create the connector registered as ``name`` with its keyword ``config``.

    Unknown or missing options raise ``TypeError`` listing the options the connector takes,
    e.g. ``get_connector("offload", capacity_bytes=8 << 30)``.
    """
    cls = get_connector_class(name)
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY]
    options = sorted(p.name for p in params)
    unknown = sorted(set(config) - set(options))
    missing = sorted(p.name for p in params
                     if p.default is inspect.Parameter.empty and p.name not in config)
    if unknown or missing:
        problems = [f"unknown option(s) {', '.join(unknown)}" if unknown else "",
                    f"missing option(s) {', '.join(missing)}" if missing else ""]
        raise TypeError(f"connector {name!r}: {'; '.join(p for p in problems if p)} "
                        f"(options: {', '.join(options)})")
    return cls(**config)
