"""The attention-backend contract every backend honours.

A backend is a class whose *capabilities* are declared once, as class attributes
(``SUPPORTED_DTYPES``, ``SUPPORTED_HEAD_SIZES``, ``MIN_DEVICE_CAPABILITY``, ...). Validation,
rejection reasons, the ``kvcore list`` columns and the docs are all derived from those
declarations, so a capability is stated in exactly one place.

The KV cache of a backend is **blocks-first**: its logical shape is
``(num_blocks, 2, block_size, num_kv_heads, head_size)`` (MLA: ``(num_blocks, block_size,
head_size)``), and ``get_kv_cache_stride_order`` fixes how those logical dims are laid out in
memory. Kernels get ``kv_cache.unbind(1)`` views and must take strides from them.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import itertools
import math
import operator
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from kvcore.config import AttentionSelectorConfig
from kvcore.layout_names import VLLM_LAYOUTS, vllm_layout_order
from kvcore.platform_types import AttentionType, DeviceCapability, MultipleOf
from kvcore.step_facts import (
    StepFacts,
    context_overwrite_error,
    context_overwrites,
    mark_step_checked,
    overwrites_context,
)

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadata",
    "AttentionType",
    "CudaGraphSupport",
    "LayerScales",
    "build_attention_metadata",
    "encoder_only_cache",
    "format_supported",
    "is_supported",
    "FEATURE_FLAGS",
]

#: Optional features: (config field, backend capability attribute, what the feature is).
#: A config that asks for a feature the backend does not declare gets a reason naming it.
FEATURE_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("has_sink", "SUPPORTS_SINK", "attention sinks"),
    ("use_sparse", "SUPPORTS_SPARSE", "sparse attention"),
    ("use_mm_prefix", "SUPPORTS_MM_PREFIX", "bidirectional multimodal prefixes"),
    ("use_per_head_quant_scales", "SUPPORTS_PER_HEAD_QUANT_SCALES", "per-head KV quant scales"),
    ("use_non_causal", "SUPPORTS_NON_CAUSAL", "non-causal attention"),
    ("use_batch_invariant", "SUPPORTS_BATCH_INVARIANT", "batch-invariant numerics"),
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_supported(values: Any) -> str:
    """A capability declaration as reasons write it: ``"16, 32, multiples of 64"`` for a tuple
    mixing plain values, dtypes and :class:`MultipleOf` entries (or one :class:`MultipleOf`),
    as the ``SUPPORTED_*`` attributes of :class:`AttentionBackend` hold them."""
    if isinstance(values, MultipleOf):
        return str(values)
    return ", ".join(
        _dtype_name(v) if isinstance(v, torch.dtype) else str(v) for v in values
    )


def is_supported(value: Any, supported: Any) -> bool:
    """``value`` in a tuple that may mix plain values and :class:`MultipleOf` entries (or one
    :class:`MultipleOf`), as the ``SUPPORTED_*`` attributes of :class:`AttentionBackend` hold
    them; ``supported=None`` accepts anything."""
    if supported is None:
        return True
    if isinstance(supported, MultipleOf):
        return value in supported
    return any(value in s if isinstance(s, MultipleOf) else value == s for s in supported)


#: The default builder class. kvcore.builder (a layer above this module, importing it) fills
#: the slot when it is imported, and ``import kvcore`` imports it, so it is set before any
#: backend can be used.
_default_builder: list[type] = []


def _resolve_class(backend: type, attr: str) -> type:
    """The class ``backend.<attr>`` names (see :attr:`AttentionBackend.IMPL_CLS`)."""
    value = getattr(backend, attr)
    if isinstance(value, type):
        return value
    where = f"{backend.__qualname__}.{attr}={value!r}"
    if not isinstance(value, str) or not value:
        raise TypeError(f"{where} is not a class or a class name; set it to the class, its "
                        "name in the backend's module or 'package.module:Class'")
    if ":" in value:
        module_name, _, name = value.partition(":")
        if not module_name or not name:
            raise ValueError(f"{where} lacks a module or a class name; write it as "
                             "'package.module:Class'")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not f"{module_name}.".startswith(f"{exc.name}."):
                raise  # a module it imports (a kernel library) is missing: say that one
            raise ModuleNotFoundError(f"{where}: there is no module {module_name!r}; correct "
                                      "the module path", name=module_name) from None
    else:
        # The module of the class that declares the name, not of a subclass inheriting it;
        # the one it was defined in (kept at definition: sys.modules may have dropped it since,
        # as pytest's in-process runs do).
        owner = next(k for k in backend.__mro__ if attr in vars(k))
        module, name = vars(owner).get("_defining_module"), value
        if module is None:
            module = importlib.import_module(owner.__module__)
    try:
        found = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"{where}: module {module.__name__} has no class {name!r}; define "
                             "it there or name its module as 'package.module:Class'") from None
    if not isinstance(found, type):
        raise TypeError(f"{where} names {found!r}, which is not a class; name the class "
                        "itself")
    return found


class CudaGraphSupport(enum.Enum):
    """How much of a step a backend's ``forward`` lets an engine capture in a CUDA graph
    (declared as ``AttentionBackend.CUDA_GRAPH_SUPPORT``; see :mod:`kvcore.builder`).

    - ``NEVER``: ``forward`` may synchronise with the host or allocate per call; run eagerly.
    - ``UNIFORM_DECODE``: a step where every request has exactly one new token, padded to a
      captured batch size, replays correctly for any later lengths and block tables: the
      builder keeps the step's tensors in persistent buffers, and ``forward`` does no host
      sync and allocates nothing when given ``output``.
    - ``ALWAYS``: the same for any batch, prefill and mixed steps included, at a captured
      (tokens, requests) size.
    """

    NEVER = "never"
    UNIFORM_DECODE = "uniform_decode"
    ALWAYS = "always"


class AttentionBackend:
    """Static description of an attention backend: capabilities, layout, implementation.

    Subclasses set :attr:`NAME`, :attr:`IMPL_CLS` (and :attr:`BUILDER_CLS` for their own
    builder) and the capability class attributes below; :meth:`get_name`,
    :meth:`get_impl_cls` and :meth:`get_builder_cls` return them, and a subclass may still
    override those methods instead. Everything else has a default derived from the
    declarations.
    """

    #: The registry name, e.g. ``"FLASH_ATTN"`` (upper case, stable): :meth:`get_name`.
    NAME: ClassVar[str | None] = None
    #: The :class:`AttentionImpl` subclass (:meth:`get_impl_cls`): the class itself, or its
    #: name, resolved when it is asked for: a class of the module that declares the attribute
    #: (``"AcmeImpl"``, for a class defined below the backend) or ``"package.module:Class"``
    #: (imported then, so kernel libraries are not imported with the backend).
    IMPL_CLS: ClassVar[type[AttentionImpl] | str | None] = None
    #: The per-step metadata builder (:meth:`get_builder_cls`), in the same forms as
    #: :attr:`IMPL_CLS`; ``None``: :class:`kvcore.AttentionMetadataBuilder`.
    BUILDER_CLS: ClassVar[type | str | None] = None

    #: Model (query/key/value) dtypes the kernels accept.
    SUPPORTED_DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    #: ``kv_cache_dtype`` names (``"auto"`` = model dtype; fp8 names store scaled fp8).
    SUPPORTED_KV_CACHE_DTYPES: ClassVar[tuple[str, ...]] = ("auto",)
    #: Head sizes: a tuple of ints (may include :class:`MultipleOf`), or ``None`` for any.
    SUPPORTED_HEAD_SIZES: ClassVar[tuple[int | MultipleOf, ...] | None] = None
    #: Block sizes (tokens per block): a tuple of ints / :class:`MultipleOf`, ``None`` for any.
    SUPPORTED_BLOCK_SIZES: ClassVar[tuple[int | MultipleOf, ...] | None] = None
    #: Lowest device capability the kernels run on (``None``: no requirement).
    MIN_DEVICE_CAPABILITY: ClassVar[DeviceCapability | None] = None
    #: Highest device capability the kernels were built for (``None``: no limit).
    MAX_DEVICE_CAPABILITY: ClassVar[DeviceCapability | None] = None
    #: Whether this backend runs MLA layers (and only those).
    IS_MLA: ClassVar[bool] = False
    SUPPORTS_SINK: ClassVar[bool] = False
    SUPPORTS_SPARSE: ClassVar[bool] = False
    SUPPORTS_MM_PREFIX: ClassVar[bool] = False
    SUPPORTS_PER_HEAD_QUANT_SCALES: ClassVar[bool] = False
    SUPPORTS_NON_CAUSAL: ClassVar[bool] = False
    SUPPORTS_BATCH_INVARIANT: ClassVar[bool] = False
    #: Why a non-causal layer (an encoder-only one, or a step with ``causal=False``) cannot
    #: have a sliding window on this backend, as a sentence with the alternative; ``None``:
    #: such layers get kvcore's symmetric window ``|q_pos - k_pos| < sliding_window`` (causal
    #: layers keep ``q_pos - k_pos < sliding_window``). With a reason, the impl refuses the
    #: combination where it becomes known (:meth:`check_non_causal_window`).
    NON_CAUSAL_WINDOW_UNSUPPORTED: ClassVar[str | None] = None
    #: Attention types the backend implements.
    SUPPORTED_ATTN_TYPES: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    #: Platform names the backend runs on (``"cpu"``, ``"cuda"``, ``"rocm"``, a plugin's).
    PLATFORMS: ClassVar[tuple[str, ...]] = ()
    #: Importable modules the backend needs, with the pip requirement that provides each,
    #: e.g. ``(("flash_attn", "flash-attn"),)``. A missing one is a reason, not an ImportError.
    REQUIRED_PACKAGES: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: Largest number of elements one layer's cache view may span (``None``: no limit, every
    #: offset int64). For kernels with 32-bit offsets; ``allocate_kv_caches`` refuses a larger
    #: cache with the limit and the largest ``num_blocks`` that fits.
    MAX_KV_CACHE_SPAN: ClassVar[int | None] = None
    #: Platforms where the cross-layer order of :meth:`get_kv_cache_stride_order` was verified
    #: (the bit-exact tests run there); ``None``: every platform in ``PLATFORMS``. A Triton
    #: backend verified on NVIDIA only lists ``("cuda",)`` and stays per-layer on ROCm.
    CROSS_LAYER_PLATFORMS: ClassVar[tuple[str, ...] | None] = None
    #: Conformance-suite tolerances that widen the defaults: ``{dtype or kv-cache dtype name:
    #: (atol, rtol)}`` (see ``docs/conformance.md``). Empty: the suite's defaults.
    CONFORMANCE_TOLERANCES: ClassVar[dict[torch.dtype | str, tuple[float, float]]] = {}
    #: Which steps an engine may capture in a CUDA graph and replay (see
    #: :class:`CudaGraphSupport`); anything but ``NEVER`` needs a builder with persistent
    #: buffers (:class:`kvcore.PersistentMetadataBuilder`) from :meth:`get_builder_cls`.
    CUDA_GRAPH_SUPPORT: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    #: Per-layer stride orders (of ``(B, 2, N, H, D)``) the kernels also read, beyond their own
    #: :meth:`get_kv_cache_stride_order`: memory an engine allocated in another order
    #: (:func:`kvcore.adopt_kv_caches`), e.g. the K-and-V-side-by-side orders of vLLM's named
    #: layouts (:func:`kvcore.vllm_layout_order`). The conformance rule ``adopted-orders``
    #: runs the backend on each one and requires the bits it gives on its own order.
    EXTRA_STRIDE_ORDERS: ClassVar[tuple[tuple[int, ...], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._defining_module = sys.modules.get(cls.__module__)

    @classmethod
    def get_name(cls) -> str:
        """The registry name, e.g. ``"FLASH_ATTN"`` (upper case, stable): :attr:`NAME`."""
        if cls.NAME is None:
            raise NotImplementedError(f"{cls.__qualname__} declares no NAME; set the class "
                                      "attribute NAME (or override get_name())")
        return cls.NAME

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """The implementation class, :attr:`IMPL_CLS`; kernel libraries are imported by it
        (or when this resolves its ``"module:Class"``), not at the backend's import."""
        if cls.IMPL_CLS is None:
            raise NotImplementedError(f"{cls.__qualname__} declares no IMPL_CLS; set the class "
                                      "attribute IMPL_CLS (or override get_impl_cls())")
        return _resolve_class(cls, "IMPL_CLS")

    @classmethod
    def get_builder_cls(cls) -> type:
        """The per-step metadata builder (a :class:`kvcore.AttentionMetadataBuilder`
        subclass) the engine makes once and calls once per step: :attr:`BUILDER_CLS`.

        Default: :class:`kvcore.AttentionMetadataBuilder`, which checks the step's values
        once and returns the metadata unchanged. Declare your own for per-step work (a kernel
        library's plan, split choices, workspaces) and for CUDA-graph support.
        """
        if cls.BUILDER_CLS is None:
            return _default_builder[0]
        return _resolve_class(cls, "BUILDER_CLS")

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """Logical (blocks-first) shape of one layer's KV cache.

        The default is ``(num_blocks, 2, block_size, num_kv_heads, head_size)``: dim 0 is the
        block, dim 1 splits K from V (``kv_cache.unbind(1)``).
        """
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Physical order of the logical dims, outermost first.

        Example: the logical shape ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` with
        the order ``(0, 1, 3, 2, 4)`` is stored as ``(num_blocks, 2, num_kv_heads, block_size,
        head_size)`` (HND); the identity order is NHD. Allocate in physical order and
        ``permute`` back to get the logical view.

        With ``include_num_layers_dimension=True`` the logical shape gains a leading
        ``num_layers`` dim. A backend whose kernels are verified on strided pages returns an
        order with the block dim outermost, e.g. ``(1, 0, 2, 3, 4, 5)``: all layers of one block
        are then contiguous (*cross-layer*). The default keeps the layer dim outermost, which
        means "no cross-layer": the safe choice for unverified kernels.
        """
        return tuple(range(6 if include_num_layers_dimension else 5))

    @classmethod
    def readable_stride_orders(cls) -> tuple[tuple[int, ...], ...]:
        """Every per-layer stride order the kernels read: :meth:`get_kv_cache_stride_order`
        (``False``) first, then :attr:`EXTRA_STRIDE_ORDERS`."""
        own = tuple(cls.get_kv_cache_stride_order(False))
        return (own, *(tuple(o) for o in cls.EXTRA_STRIDE_ORDERS if tuple(o) != own))

    @classmethod
    def supported_vllm_layouts(cls, platform: str | None = None) -> tuple[str, ...]:
        """vLLM's layout names (``LBNHC``, ...) this backend reads, most preferred first.

        Derived from :meth:`readable_stride_orders`: a name whose order within a layer is one
        of them, and, for the names that interleave layers inside a block (``BLHNC``,
        ``BLNHC``, ``BHLNC``: a layer's pages are strided), only when the backend opts in to
        cross-layer caches (:meth:`supports_cross_layer`, on ``platform`` when given).
        """
        names = []
        cross_ok = cls.supports_cross_layer(platform)
        for order in cls.readable_stride_orders():
            for name in VLLM_LAYOUTS:
                full = vllm_layout_order(name)
                if (vllm_layout_order(name, include_num_layers_dimension=False) == order
                        and (full[0] == 0 or cross_ok)):
                    names.append(name)
        return tuple(sorted(names, key=lambda n: vllm_layout_order(n)[0] != 0))

    @classmethod
    def supports_cross_layer(cls, platform: str | None = None) -> bool:
        """Derived from :meth:`get_kv_cache_stride_order` (is the block dim outermost?) and,
        given a ``platform`` name, from :attr:`CROSS_LAYER_PLATFORMS` (verified there?)."""
        order = cls.get_kv_cache_stride_order(include_num_layers_dimension=True)
        if not (len(order) > 1 and order[0] == 1):
            return False
        return (platform is None or cls.CROSS_LAYER_PLATFORMS is None
                or platform in cls.CROSS_LAYER_PLATFORMS)

    @classmethod
    def cross_layer_note(cls, platform: str) -> str:
        """Why ``platform`` gets per-layer caches from this backend ("" when it gets
        cross-layer): for ``kvcore select --explain`` and ``kvcore layout``."""
        if cls.supports_cross_layer(platform):
            return ""
        if not cls.supports_cross_layer():
            return f"{cls.get_name()} does not opt in to cross-layer KV caches (per-layer caches)"
        verified = ", ".join(cls.CROSS_LAYER_PLATFORMS or ())
        where = f"is verified on {verified} only" if verified else "is not verified yet"
        return (f"{cls.get_name()}'s cross-layer layout {where}; on {platform} it allocates "
                "per-layer caches until the bit-exact cross-layer tests pass there")

    @classmethod
    def supports_kv_connector(cls) -> bool:
        """Whether KV connectors may move this backend's blocks (blocks-first layout)."""
        return True

    @classmethod
    def kv_connector_unsupported_reason(cls) -> str:
        """Why :meth:`supports_kv_connector` is False, with the alternative to use."""
        return f"{cls.get_name()} does not use the blocks-first layout that connectors move"

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Reasons this backend cannot run in this Python environment (missing packages).

        Derived from ``REQUIRED_PACKAGES`` without importing them. Backends that need a
        runtime check (a compiled extension, a driver feature) extend this.
        """
        reasons = []
        for module, requirement in cls.REQUIRED_PACKAGES:
            if importlib.util.find_spec(module) is None:
                reasons.append(f"{requirement} not installed (pip install {requirement})")
        return reasons

    @classmethod
    def stale_bytes_reason(cls, device_type: str) -> str | None:
        """Why ``forward`` on ``device_type`` may let NaN/Inf bit patterns in cache slots a
        request does not own (the tail of its last block, other blocks) reach its output;
        ``None``, the contract, when it never does (loads masked, not multiplied by zero).
        A backend wrapping a kernel it cannot change says so here; the conformance rule
        ``stale-bytes-masked`` is then skipped with this reason."""
        return None

    @classmethod
    def import_reasons(cls) -> list[str]:
        """Reasons from importing each ``REQUIRED_PACKAGES`` module that is installed: a
        package found by name whose import raises (a broken build, a missing shared library)
        gives its error. The selector calls this for the backend it is about to pick only
        (importing kernel libraries is slow), so a broken package is a rejection reason, not
        a failure at the first forward."""
        reasons = []
        for module, requirement in cls.REQUIRED_PACKAGES:
            if importlib.util.find_spec(module) is None:
                continue  # unavailable_reasons() already says so
            try:
                importlib.import_module(module)
            except (Exception, SystemExit) as exc:  # whatever a broken package raises
                reasons.append(f"{requirement} is installed but importing {module} fails: "
                               f"{type(exc).__name__}: {exc} (reinstall {requirement})")
        return reasons

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The declared capabilities as plain data (for ``kvcore list`` and docs)."""
        return {
            "name": cls.get_name(),
            "platforms": list(cls.PLATFORMS),
            "dtypes": [_dtype_name(d) for d in cls.SUPPORTED_DTYPES],
            "kv_cache_dtypes": list(cls.SUPPORTED_KV_CACHE_DTYPES),
            "head_sizes": "any" if cls.SUPPORTED_HEAD_SIZES is None
            else format_supported(cls.SUPPORTED_HEAD_SIZES),
            "block_sizes": "any" if cls.SUPPORTED_BLOCK_SIZES is None
            else format_supported(cls.SUPPORTED_BLOCK_SIZES),
            "min_device_capability": str(cls.MIN_DEVICE_CAPABILITY)
            if cls.MIN_DEVICE_CAPABILITY else None,
            "mla": cls.IS_MLA,
            "attn_types": [t.value for t in cls.SUPPORTED_ATTN_TYPES],
            "features": [field for field, attr, _ in FEATURE_FLAGS if getattr(cls, attr)],
            "cross_layer": cls.supports_cross_layer(),
            "cross_layer_platforms": None if cls.CROSS_LAYER_PLATFORMS is None
            else list(cls.CROSS_LAYER_PLATFORMS),
            "kv_connector": cls.supports_kv_connector(),
            "max_kv_cache_span": cls.MAX_KV_CACHE_SPAN,
            "stride_order": list(cls.get_kv_cache_stride_order()),
            "vllm_layouts": list(cls.supported_vllm_layouts()),
            "cuda_graphs": cls.CUDA_GRAPH_SUPPORT.value,
        }

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: DeviceCapability | None,
        attn_type: AttentionType | str,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
    ) -> list[str]:
        """Every reason this backend cannot run the configuration; empty means valid.

        Each reason is self-contained: the field, the value, what is supported and, where one
        exists, the fix. Derived from the capability attributes, then
        :meth:`check_combination` adds cross-field rules. With an
        :class:`AttentionSelectorConfig` ``config``, call
        ``validate_configuration(**config.as_kwargs(), device_capability=...)``.
        """
        config = AttentionSelectorConfig(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype or "auto",
            block_size=block_size, use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse,
            use_mm_prefix=use_mm_prefix, use_per_head_quant_scales=use_per_head_quant_scales,
            attn_type=attn_type, use_non_causal=use_non_causal,
            use_batch_invariant=use_batch_invariant, use_kv_connector=use_kv_connector,
        )
        name = cls.get_name()
        reasons: list[str] = []
        if not is_supported(config.head_size, cls.SUPPORTED_HEAD_SIZES):
            reasons.append(
                f"head_size={config.head_size} "
                f"(supported: {format_supported(cls.SUPPORTED_HEAD_SIZES)})"
            )
        if config.dtype not in cls.SUPPORTED_DTYPES:
            reasons.append(
                f"dtype={_dtype_name(config.dtype)} "
                f"(supported: {format_supported(cls.SUPPORTED_DTYPES)})"
            )
        if config.kv_cache_dtype not in cls.SUPPORTED_KV_CACHE_DTYPES:
            reasons.append(
                f"kv_cache_dtype={config.kv_cache_dtype} "
                f"(supported: {format_supported(cls.SUPPORTED_KV_CACHE_DTYPES)})"
            )
        if not is_supported(config.block_size, cls.SUPPORTED_BLOCK_SIZES):
            reasons.append(
                f"block_size={config.block_size} "
                f"(supported: {format_supported(cls.SUPPORTED_BLOCK_SIZES)})"
            )
        if config.use_mla and not cls.IS_MLA:
            reasons.append(f"use_mla=True but {name} is not an MLA backend (choose an MLA backend)")
        elif cls.IS_MLA and not config.use_mla:
            reasons.append(f"use_mla=False but {name} only runs MLA layers")
        for field, attr, feature in FEATURE_FLAGS:
            if getattr(config, field) and not getattr(cls, attr):
                reasons.append(f"{field}=True: {name} does not support {feature}")
        if config.attn_type not in cls.SUPPORTED_ATTN_TYPES:
            supported = ", ".join(t.value for t in cls.SUPPORTED_ATTN_TYPES)
            reasons.append(f"attn_type={config.attn_type.value} (supported: {supported})")
        reasons.extend(cls._capability_reasons(device_capability))
        if config.use_kv_connector and not cls.supports_kv_connector():
            reasons.append(f"KV connector not supported: {cls.kv_connector_unsupported_reason()}")
        reasons.extend(cls.check_combination(config, device_capability))
        reasons.extend(cls.unavailable_reasons())
        return reasons

    @classmethod
    def _capability_reasons(cls, capability: DeviceCapability | None,
                            simulate: str | None = None) -> list[str]:
        """The reason ``capability`` is outside the declared bounds (``[]``: inside).
        Unknown (``None``), the reason says how to simulate a device: ``simulate`` (the
        settings, spelled for the platform at hand; the selector knows it), by default
        ``KVCORE_DEVICE_CAPABILITY`` set to the bound."""
        lo, hi = cls.MIN_DEVICE_CAPABILITY, cls.MAX_DEVICE_CAPABILITY
        if lo is None and hi is None:
            return []
        wanted = " and ".join(
            part for part in (f">= {lo}" if lo else "", f"<= {hi}" if hi else "") if part
        )
        if capability is None:
            # The example is the bound itself, spelled the way its platform names devices
            # (gfx942 on ROCm, 9.0 on CUDA).
            bound = lo or hi
            example = bound.arch or f"{bound.major}.{bound.minor}"
            simulate = simulate or f"KVCORE_DEVICE_CAPABILITY={example}"
            return [
                f"device capability unknown; {cls.get_name()} needs {wanted} "
                f"(set {simulate} to simulate such a device)"
            ]
        if (lo and not capability.at_least(lo)) or (hi and not hi.at_least(capability)):
            return [f"device capability {capability} (supported: {wanted})"]
        return []

    @classmethod
    def check_non_causal_window(cls, sliding_window: int | None, causal: bool) -> None:
        """``ValueError`` with :attr:`NON_CAUSAL_WINDOW_UNSUPPORTED` when a non-causal layer
        has a sliding window and the backend declares it cannot run that. Host values only:
        an impl calls it at construction (encoder-only layers) and in ``forward``."""
        reason = cls.NON_CAUSAL_WINDOW_UNSUPPORTED
        if reason and sliding_window is not None and not causal:
            raise ValueError(f"sliding_window={sliding_window} on a non-causal layer: "
                             f"{cls.get_name()} cannot run it: {reason}")

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        """Cross-field rules a single capability attribute cannot express (override).

        E.g. "fp8 KV cache needs device capability >= 8.9". Return reasons in the same
        self-contained form as the derived ones.
        """
        return []


@runtime_checkable
class AttentionLayer(Protocol):
    """What a backend reads from the engine's attention layer: the KV quantisation scales."""

    k_scale: torch.Tensor | float
    v_scale: torch.Tensor | float


@dataclass
class LayerScales:
    """A minimal :class:`AttentionLayer` for engines without their own layer object."""

    k_scale: torch.Tensor | float = 1.0
    v_scale: torch.Tensor | float = 1.0


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by every backend.

    A batch mixes prefill requests (possibly with a cached prefix) and decode requests; their
    new tokens are packed along dim 0 of query/key/value.

    Attributes:
        query_start_loc: ``(num_seqs + 1,)`` int32, cumulative new-token counts.
        seq_lens: ``(num_seqs,)`` int32, cached + new tokens per request.
        block_table: ``(num_seqs, max_blocks_per_seq)`` int32 block ids (padding is 0).
        slot_mapping: ``(num_tokens,)`` int64 cache slot of each new token
            (``block_id * block_size + offset``; negative = padding, not written).
        max_query_len, max_seq_len: maxima of the above, on the host.
        num_actual_tokens: new tokens in the batch (rows of query beyond are padding).
        causal: whether queries are masked to earlier positions.
        query_start_loc_cpu, seq_lens_cpu: optional host (CPU) copies of ``query_start_loc``
            and ``seq_lens`` with the same values, for builders that plan on the host (e.g.
            FlashInfer's ``plan``): with them a builder needs no device read. ``None`` when
            the engine has none; :func:`build_attention_metadata` fills them.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    causal: bool = True
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def extend(self, cls: type[_M], **fields: Any) -> _M:
        """This step as ``cls``, a dataclass subclass of :class:`AttentionMetadata` that adds
        a backend's own fields (a plan, split counts, a workspace), given as ``fields``; every
        field of :class:`AttentionMetadata` is carried over. What a builder's ``build`` returns
        after ``super().build`` has checked the step."""
        return cls(**{name: getattr(self, name) for name in _BASE_FIELDS}, **fields)


_M = TypeVar("_M", bound=AttentionMetadata)
#: The fields :meth:`AttentionMetadata.extend` carries over (computed once: builders call it
#: every step).
_BASE_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionMetadata))

#: Largest block id an int32 block table holds.
_MAX_BLOCK_ID = 2**31 - 1


def _is_index(value: object) -> bool:
    """An integer in any form (int, numpy int, 0-dim integer tensor), not a float."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_block_ids(i: int, blocks: Sequence[int] | torch.Tensor) -> None:
    """Block ids must be integers that fit the int32 block table."""
    if isinstance(blocks, torch.Tensor):
        if blocks.dtype.is_floating_point or blocks.dtype.is_complex:
            raise TypeError(f"block_tables[{i}] has dtype {blocks.dtype}; block ids must be ints")
        lo, hi = (int(blocks.min()), int(blocks.max())) if blocks.numel() else (0, 0)
    else:
        for b in blocks:
            if isinstance(b, bool) or not _is_index(b):
                raise TypeError(f"block_tables[{i}] contains {b!r} ({type(b).__name__}); "
                                "block ids must be ints")
        lo = min((int(b) for b in blocks), default=0)
        hi = max((int(b) for b in blocks), default=0)
    if hi > _MAX_BLOCK_ID:
        raise ValueError(
            f"block_tables[{i}] contains block id {hi}, above {_MAX_BLOCK_ID}: the block table "
            "is int32, as the kernels read it (no cache has that many blocks)")
    if lo < -_MAX_BLOCK_ID - 1:
        raise ValueError(
            f"block_tables[{i}] contains {lo}, below {-_MAX_BLOCK_ID - 1}: the block table is "
            "int32, as the kernels read it; block ids are >= 0 (pad unused entries with 0)")


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    causal: bool = True,
    num_blocks: int | None = None,
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from per-request counts and block tables.

    The value checks happen here, once per step, on the host lists: lengths and block
    coverage, ids not negative and, with ``num_blocks``, below it, no slot given to two new
    tokens, and no new token written to a slot a request of the step reads as context (the
    write would land before attention reads it). The tensors are marked
    with the step's :class:`kvcore.ops.StepFacts` (:func:`kvcore.ops.mark_step_checked`), so
    the ops of every layer compare those facts with their cache instead of reading the
    tensors back from the device. The tensors are made outside inference mode (inference
    tensors cannot be marked).

    Args:
        query_lens: new tokens per request (1 for decode, the prompt chunk for prefill).
        context_lens: tokens already in the cache per request (the cached prefix).
        block_tables: block ids per request; must cover ``context_len + query_len`` tokens.
        block_size: tokens per block.
        device: where the tensors are placed.
        causal: forwarded to :attr:`AttentionMetadata.causal`.
        num_blocks: blocks of the KV cache, to refuse out-of-range ids here, with the
            request named (otherwise each op refuses them against its cache).
    """
    if len(query_lens) != len(context_lens) or len(query_lens) != len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and "
            f"block_tables ({len(block_tables)}) must have one entry per request"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                   or num_blocks <= 0):
        raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer or None")
    slots: list[int] = []
    seq_lens: list[int] = []
    rows: list[Sequence[int]] = []
    max_needed, max_block = 0, -1
    for i, (q_len, ctx_len, blocks) in enumerate(
        zip(query_lens, context_lens, block_tables, strict=True)
    ):
        for arg, n in (("query_lens", q_len), ("context_lens", ctx_len)):
            if isinstance(n, bool) or not _is_index(n):
                raise TypeError(f"{arg}[{i}]={n!r} must be an int (a token count), got "
                                f"{type(n).__name__}")
        _check_block_ids(i, blocks)
        if q_len < 0 or ctx_len < 0:
            raise ValueError(
                f"request {i}: query_lens={q_len} and context_lens={ctx_len} must be >= 0"
            )
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.tolist()
        rows.append(blocks)
        seq_len = ctx_len + q_len
        needed = -(-seq_len // block_size)
        if len(blocks) < needed:
            raise ValueError(
                f"block_tables[{i}] has {len(blocks)} blocks but {seq_len} tokens need "
                f"{needed} blocks of {block_size}"
            )
        if needed:
            used = blocks[:needed]
            if min(used) < 0:
                raise ValueError(f"block_tables[{i}] contains a negative block id: {list(blocks)}")
            top = max(used)
            if num_blocks is not None and top >= num_blocks:
                raise ValueError(
                    f"block_tables[{i}] refers to block id {top}, but the cache has "
                    f"{num_blocks} blocks (valid ids: 0..{num_blocks - 1})"
                )
            max_block = max(max_block, top)
            max_needed = max(max_needed, needed)
        seq_lens.append(seq_len)
        for pos in range(ctx_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    if len(set(slots)) != len(slots):  # two new tokens in one slot: which lands is a race
        seen: set[int] = set()
        repeated = sorted({s for s in slots if s in seen or seen.add(s)})
        raise ValueError(f"the block tables give slots {repeated[:8]} to more than one new "
                         "token of the step; every new token needs its own slot")
    width = max((len(b) for b in rows), default=0)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    with torch.inference_mode(False):
        table = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
        for i, blocks in enumerate(rows):
            if len(blocks):
                table[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
        starts_cpu = torch.tensor(starts, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        slots_cpu = torch.tensor(slots, dtype=torch.int64)
        ctx_lens = [int(c) for c in context_lens]
        if slots and any(ctx_lens) and overwrites_context(slots, ctx_lens, rows, block_size):
            ctx = torch.tensor(ctx_lens, dtype=torch.int64)  # the message names the first
            raise context_overwrite_error(slots_cpu, starts_cpu, ctx, table, block_size,
                                          context_overwrites(slots_cpu, ctx, table, block_size))
        metadata = AttentionMetadata(
            query_start_loc=starts_cpu.to(device, copy=True),
            seq_lens=seq_lens_cpu.to(device, copy=True),
            block_table=table.to(device),
            slot_mapping=slots_cpu.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_actual_tokens=starts[-1],
            causal=causal,
            query_start_loc_cpu=starts_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
    facts = StepFacts(num_tokens=starts[-1], num_seqs=len(rows), block_size=block_size,
                      max_blocks_per_seq=max_needed, max_block_id=max_block,
                      max_slot=max(slots, default=-1))
    mark_step_checked(facts, query_start_loc=metadata.query_start_loc,
                      seq_lens=metadata.seq_lens, block_table=metadata.block_table,
                      slot_mapping=metadata.slot_mapping)
    return metadata


def encoder_only_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A private paged cache holding only this step's tokens, for encoder-only layers.

    An encoder-only layer must not write the engine's cache (:meth:`AttentionImpl.
    writes_kv_cache`) but its kernels read K/V through a block table. This returns a fresh
    ``(num_blocks', *kv_cache.shape[1:])`` cache (contiguous, ``kv_cache``'s dtype), filled
    with ``key[:n]`` / ``value[:n]`` by ``write(key, value, cache, slot_mapping)`` (the
    backend's own cache write, so fp8 is quantised as usual), each request in its own run of
    blocks, and a copy of ``attn_metadata`` whose ``block_table`` and ``slot_mapping`` point
    into it. Reads the query lengths on the host (one sync per layer: encoder-only steps
    are not graph-captured).

    Raises:
        ValueError: a request has a cached prefix (``seq_lens`` must equal its query length).
    """
    n = attn_metadata.num_actual_tokens
    block_size = kv_cache.shape[2] if kv_cache.dim() == 5 else kv_cache.shape[1]
    starts = attn_metadata.query_start_loc.tolist()
    q_lens = [hi - lo for lo, hi in itertools.pairwise(starts)]
    seq_lens = attn_metadata.seq_lens.tolist()
    if seq_lens != q_lens:
        raise ValueError(
            f"encoder-only layers attend over the step's own tokens, but seq_lens={seq_lens} "
            f"differ from the query lengths {q_lens}; give every request context length 0"
        )
    counts = [-(-q // block_size) for q in q_lens]
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    table = torch.zeros(len(q_lens), max(max(counts, default=0), 1), dtype=torch.int32)
    slots: list[int] = []
    for i, (q_len, c) in enumerate(zip(q_lens, counts, strict=True)):
        table[i, :c] = torch.arange(first[i], first[i] + c, dtype=torch.int32)
        slots.extend(range(first[i] * block_size, first[i] * block_size + q_len))
    device = kv_cache.device
    cache = torch.zeros((max(first[-1], 1), *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                        device=device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    write(key[:n], value[:n], cache, slot_mapping)
    return cache, dataclasses.replace(attn_metadata, block_table=table.to(device),
                                      slot_mapping=slot_mapping)


class AttentionImpl(ABC):
    """Per-layer state of a backend and the two calls an engine makes every step.

    Shapes: ``query`` is ``(num_tokens, num_heads, head_size)``; ``key``/``value`` are
    ``(num_tokens, num_kv_heads, head_size)``; ``kv_cache`` is the layer's logical view from
    :func:`kvcore.allocate_kv_caches` (for K/V backends ``(num_blocks, 2, block_size,
    num_kv_heads, head_size)`` of any strides).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        attn_type: AttentionType | str = AttentionType.DECODER,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
            )
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not _is_index(sliding_window)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1 "
                             "(how many positions each query sees, itself included)")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale={scale!r} must be a finite, positive float "
                             "(usually head_size ** -0.5)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = None if sliding_window is None else operator.index(sliding_window)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = AttentionType(attn_type)

    def is_causal(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether this layer masks each query to the keys at or before its position.

        The one causal rule of every backend: the step's metadata asks for it
        (:attr:`AttentionMetadata.causal`) and the layer is a decoder; an encoder-only layer
        sees every key of its request.
        """
        return attn_metadata.causal and self.attn_type == AttentionType.DECODER

    def writes_kv_cache(self) -> bool:
        """Whether :meth:`do_kv_cache_update` writes anything: the one cache-write rule of
        every backend. An encoder-only layer keeps nothing across steps, so it never writes
        the paged cache (its ``forward`` attends over the step's own ``key``/``value``,
        e.g. through :func:`encoder_only_cache`)."""
        return self.attn_type != AttentionType.ENCODER_ONLY

    @abstractmethod
    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the new tokens' K and V into ``kv_cache`` at ``slot_mapping`` (negative: skip)."""

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over the paged cache (already updated for this step).

        Returns ``(num_tokens, num_heads, head_size)``, written into ``output`` when given.
        """


class PagedAttentionImpl(AttentionImpl):
    """An :class:`AttentionImpl` over two ops with the signatures of :mod:`kvcore.ops`.

    Subclasses set :meth:`write_kv` (``reshape_and_cache``'s signature) and :meth:`attend`
    (``paged_attention``'s) and get ``do_kv_cache_update`` / ``forward`` on the standard
    ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` cache split with ``unbind(1)``
    (override :meth:`split_kv` for another layout), output written in place, padding rows
    beyond ``num_actual_tokens`` left untouched.
    """

    def split_kv(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V ``(num_blocks, block_size, num_kv_heads, head_size)`` views."""
        key_cache, value_cache = kv_cache.unbind(1)
        return key_cache, value_cache

    @staticmethod
    @abstractmethod
    def write_kv(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                 v_scale) -> None:
        """Scatter new tokens into the K and V caches (see ``kvcore.ops.reshape_and_cache``)."""

    @staticmethod
    @abstractmethod
    def attend(query, key_cache, value_cache, **kwargs) -> torch.Tensor:
        """Paged attention with ``kvcore.ops.paged_attention``'s keyword arguments."""

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if not self.writes_kv_cache():
            return
        key_cache, value_cache = self.split_kv(kv_cache)
        self.write_kv(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
                      layer.k_scale, layer.v_scale)

    def attend_options(self, attn_metadata: AttentionMetadata) -> dict[str, Any]:
        """Extra keyword arguments of :meth:`attend` for this step: what a backend's builder
        chose for the step, e.g. split counts and workspaces. Metadata that carries such
        choices has an ``attend_options()`` method (e.g. ``kvcore.TritonAttentionMetadata``);
        other metadata adds none."""
        options = getattr(attn_metadata, "attend_options", None)
        return options() if callable(options) else {}

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.writes_kv_cache():
            def write(k, v, cache, slots):
                self.write_kv(k, v, *self.split_kv(cache), slots, self.kv_cache_dtype,
                              layer.k_scale, layer.v_scale)

            kv_cache, attn_metadata = encoder_only_cache(key, value, kv_cache, attn_metadata,
                                                         write)
        key_cache, value_cache = self.split_kv(kv_cache)
        n = attn_metadata.num_actual_tokens
        if output is None:
            output = torch.empty_like(query)
        self.attend(
            query[:n], key_cache, value_cache,
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table,
            scale=self.scale,
            causal=self.is_causal(attn_metadata),
            sliding_window=self.sliding_window,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            output=output[:n],
            **self.attend_options(attn_metadata),
        )
        return output
