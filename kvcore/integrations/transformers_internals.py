"""Every transformers internal that :mod:`kvcore.integrations.transformers` relies on, in one
place, with a check that says which of them a given transformers no longer has.

transformers' continuous batching has no public extension point for an attention backend that
reads its paged cache itself, so the integration leans on facts that transformers may change in
any release. They are listed here (:data:`INTERNALS`), the supported range is pinned
(:data:`SUPPORTED_RANGE`, the ``kvcore[transformers]`` extra), and
:func:`check_internals` (run by the tests and on entering ``use_kvcore``) names each one
that is missing or changed. The layout facts (a block is ``[layer][K page | V page]``, block
ids count the two trash sectors, rows are ``block * block_physical_stride + offset``) are
checked by behaviour in the tests, against transformers' own ``update``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

#: The transformers versions the integration is tested with (the ``kvcore[transformers]``
#: extra pins the same range). Continuous batching's cache and kwargs change between minor
#: releases, so the range is one minor release wide.
SUPPORTED_RANGE = ">=5.25,<5.26"
MIN_VERSION = (5, 25)
MAX_VERSION_EXCLUSIVE = (5, 26)

_CB = "transformers.generation.continuous_batching"


@dataclass(frozen=True)
class Internal:
    """One fact about transformers the integration uses.

    Attributes:
        module: the module that holds ``name``.
        name: the attribute (a class, function or constant) looked up in ``module``.
        members: attributes the object (or, for ``instance_members``, its instances) must have.
        parameters: parameters its signature (a function, or a class's ``__init__``) must have.
        instance_members: attributes set on instances (checked in ``__init__``'s source or
            a registration method's, as they are not class attributes).
        why: what the integration does with it.
    """

    module: str
    name: str
    why: str
    members: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    instance_members: tuple[str, ...] = ()


#: Everything the integration touches beyond transformers' documented API.
INTERNALS: tuple[Internal, ...] = (
    Internal(f"{_CB}.cache", "PagedAttentionCache",
             "the paged cache passed as the `cache` kwarg: its tensor is adopted, its "
             "full-attention allocator gives the geometry",
             members=("update",),
             instance_members=("cache_tensor", "cache_allocators", "layer_to_allocator",
                               "max_batch_tokens", "max_tokens_read")),
    Internal(f"{_CB}.cache_allocators", "FullAttentionCacheAllocator",
             "its block layout [layer][K page | V page] is kvcore's cross-layer NHD order; "
             "rows are block * block_physical_stride + offset",
             members=("layer_type", "register_cache_tensor", "get_read_indices",
                      "get_write_indices", "update"),
             instance_members=("index", "layer_indices", "tokens_per_page", "bytes_per_block",
                               "block_physical_stride", "num_key_value_heads", "head_dim",
                               "cache_dtype")),
    Internal(f"{_CB}.cache_allocators", "SlidingAttentionCacheAllocator",
             "a sliding group's ring: token p in slot p % sliding_window; its read index "
             "lists the window's rows oldest first then a sentinel row per new token, its "
             "write index the new tokens' rows (write_trash_index for tokens not stored), "
             "and it reads before it writes; its cu_seq_lens_k span per request is "
             "query + min(past, sliding_window - 1), so max_length_k <= sliding_window "
             "means no new token replaces a key a query of the step sees (then read in "
             "place, through block tables over the ring's pages)",
             members=("layer_type", "get_read_indices", "get_write_indices", "update"),
             instance_members=("sliding_window", "sentinel_index", "write_trash_index")),
    Internal(f"{_CB}.cache_allocators", "MLACacheAllocator",
             "MLA's compressed latents: refused (not a K/V page)"),
    Internal(f"{_CB}.cache", "group_layers_by_attn_type",
             "which allocator serves which layers (cache_allocators by layer type, each "
             "allocator's layer_indices)",
             parameters=("config",)),
    Internal(f"{_CB}.input_outputs", "PagedAttentionArgs",
             "the forward kwargs of a continuous-batching step: cu_seq_lens_q/k, "
             "max_length_q/k, read_index, write_index, cache, block_table",
             members=("__annotations__",)),
    Internal(f"{_CB}.continuous_api", "ContinuousBatchingManager",
             "accepts an attention implementation only if it is paged|eager, sdpa or a name "
             "containing 'flash' (then it builds no attention masks)",
             members=("switch_to_cb_friendly_attn",)),
    Internal("transformers.utils.generic", "is_flash_attention_requested",
             "decides from the name that no masks are built and the decode fast path "
             "(flash_attn_with_kvcache) is off for a name with no version digit",
             parameters=("config", "requested_attention_implementation", "version")),
    Internal("transformers.configuration_utils", "PreTrainedConfig",
             "config._attn_implementation is set directly: set_attn_implementation would try "
             "to load a hub kernel for a name containing 'flash'",
             members=("_attn_implementation",)),
    Internal("transformers.generation.configuration_utils", "ContinuousBatchingConfig",
             "page_size's default is the block size kvcore checks a backend against up front",
             members=("page_size",)),
)

#: The keyword arguments of a step that the integration reads.
STEP_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "read_index",
               "write_index", "cache")


def transformers_version() -> str | None:
    """The installed transformers' version string, or ``None`` when it is not installed."""
    try:
        return importlib.import_module("transformers").__version__
    except ImportError:
        return None


def version_problem(version: str | None = None) -> str | None:
    """Why transformers ``version`` (default: the installed one) is outside
    :data:`SUPPORTED_RANGE`, or ``None`` (also when transformers is not installed)."""
    version = version or transformers_version()
    if version is None:
        return None
    found = tuple(int("".join(c for c in part if c.isdigit()) or 0)
                  for part in version.split(".")[:2])
    if MIN_VERSION <= found < MAX_VERSION_EXCLUSIVE:
        return None
    return (f"transformers {version} is installed but kvcore's transformers integration "
            f"supports transformers{SUPPORTED_RANGE} (its continuous batching internals change "
            "between minor releases); install that range: pip install 'kvcore[transformers]'")


def check_internals() -> list[str]:
    """One sentence per :data:`INTERNALS` entry (or step kwarg) the installed transformers
    lacks or has changed; empty when everything the integration uses is there."""
    problems = []
    for internal in INTERNALS:
        where = f"{internal.module}.{internal.name}"
        try:
            obj = getattr(importlib.import_module(internal.module), internal.name)
        except (ImportError, AttributeError):
            problems.append(f"{where} is gone; kvcore used it because {internal.why}")
            continue
        missing = [m for m in internal.members if not hasattr(obj, m)]
        target = obj.__init__ if inspect.isclass(obj) else obj
        params = inspect.signature(target).parameters
        missing += [f"parameter {p}" for p in internal.parameters if p not in params]
        if internal.instance_members:
            source = _class_source(obj)
            missing += [f"instance attribute {m}" for m in internal.instance_members
                        if f"self.{m} " not in source and f"self.{m}:" not in source
                        and f"self.{m}," not in source]
        if missing:
            problems.append(f"{where} lacks {', '.join(missing)}; kvcore used it because "
                            f"{internal.why}")
    try:
        args = importlib.import_module(f"{_CB}.input_outputs").PagedAttentionArgs
        absent = [k for k in STEP_KWARGS if k not in args.__annotations__]
    except (ImportError, AttributeError):
        absent = []
    if absent:
        problems.append(f"a continuous-batching step no longer passes {', '.join(absent)} "
                        "(PagedAttentionArgs); kvcore builds its step metadata from them")
    return problems


def _class_source(cls: type) -> str:
    """The source of ``cls`` and its bases (where instance attributes are assigned)."""
    parts = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers"):
            try:
                parts.append(inspect.getsource(klass))
            except (OSError, TypeError):
                continue
    return "\n".join(parts)
