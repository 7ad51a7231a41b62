"""The attention-backend contract every backend honours.

A backend is a class whose *capabilities* are declared once, as class attributes
(``SUPPORTED_DTYPES``, ``SUPPORTED_HEAD_SIZES``, ``MIN_DEVICE_CAPABILITY``, ...). Validation,
rejection reasons, the ``kvcore list`` columns and the docs are all derived from those
declarations, so a capability is stated in exactly one place.

The KV cache of a backend is **blocks-first**: its logical shape is
``(num_blocks, 2, block_size, num_kv_heads, head_size)`` (MLA: ``(num_blocks, block_size,
head_size)``), and ``get_kv_cache_stride_order`` fixes how those logical dims are laid out in
memory. Kernels get ``kv_cache.unbind(1)`` views and must take strides from them.

The backend names its two other halves as classes: the per-layer :class:`kvcore.AttentionImpl`
(:mod:`kvcore.impl`) and the per-step :class:`kvcore.AttentionMetadataBuilder`
(:mod:`kvcore.builder`); the step's :class:`kvcore.AttentionMetadata` is :mod:`kvcore.metadata`.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from typing import Any, ClassVar

import torch

from kvcore.builder import AttentionMetadataBuilder
from kvcore.config import AttentionSelectorConfig
from kvcore.impl import AttentionImpl
from kvcore.layout_names import VLLM_LAYOUTS, vllm_layout_order
from kvcore.ops import triton_unavailable_reasons
from kvcore.platform_types import AttentionType, DeviceCapability, MultipleOf

__all__ = [
    "AttentionBackend",
    "CudaGraphSupport",
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
    ("has_logits_soft_cap", "SUPPORTS_LOGITS_SOFT_CAP", "logit soft-capping"),
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


def _declared_class(backend: type, attr: str, base: str, method: str) -> type:
    """``backend.<attr>``, which must be a class (never a name resolved later)."""
    value = getattr(backend, attr)
    if not isinstance(value, type):
        raise TypeError(f"{backend.__qualname__}.{attr}={value!r} is not a class; set it to the "
                        f"{base} subclass itself, defined above the backend (or override "
                        f"{method}())")
    return value


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
    #: The :class:`~kvcore.AttentionImpl` subclass (:meth:`get_impl_cls`), a class: define it
    #: above the backend in the backend's module, whose kernel libraries are imported inside
    #: the impl's methods (so importing the backend imports none).
    IMPL_CLS: ClassVar[type[AttentionImpl] | None] = None
    #: The per-step metadata builder (:meth:`get_builder_cls`), a class; the default checks
    #: the step once and returns it unchanged.
    BUILDER_CLS: ClassVar[type[AttentionMetadataBuilder]] = AttentionMetadataBuilder

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
    #: Attention sinks: the impl takes ``sinks`` (one learned logit per query head in the
    #: softmax denominator, no value) and applies them (:class:`kvcore.AttentionImpl`).
    SUPPORTS_SINK: ClassVar[bool] = False
    #: Logit soft-capping: the impl takes ``logits_soft_cap`` and scores with
    #: ``cap * tanh(score / cap)`` before masking and the softmax.
    SUPPORTS_LOGITS_SOFT_CAP: ClassVar[bool] = False
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
    #: The kernels or the cache write are Triton's: :meth:`unavailable_reasons` then adds
    #: :func:`kvcore.ops.triton_unavailable_reasons` (triton missing or older than
    #: :data:`kvcore.ops.MIN_TRITON_VERSION`), without importing triton.
    USES_TRITON: ClassVar[bool] = False
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
        # The impl refuses a feature its backend does not declare. The first backend that
        # names an impl class binds it; a later backend (or subclass) that reuses it with other
        # feature declarations gets a subclass bound to itself, so each backend's impl honours
        # its own declarations whatever the order the classes were created in.
        impl = cls.IMPL_CLS
        if not (isinstance(impl, type) and issubclass(impl, AttentionImpl)):
            return
        owner = impl.__dict__.get("BACKEND")
        if owner is None:
            impl.BACKEND = cls
        elif any(getattr(owner, attr) != getattr(cls, attr)
                 for attr in ("SUPPORTS_SINK", "SUPPORTS_LOGITS_SOFT_CAP")):
            cls.IMPL_CLS = type(impl.__name__, (impl,), {
                "BACKEND": cls, "__module__": impl.__module__, "__qualname__": impl.__qualname__,
                "__doc__": impl.__doc__})

    @classmethod
    def get_name(cls) -> str:
        """The registry name, e.g. ``"FLASH_ATTN"`` (upper case, stable): :attr:`NAME`."""
        if cls.NAME is None:
            raise NotImplementedError(f"{cls.__qualname__} declares no NAME; set the class "
                                      "attribute NAME (or override get_name())")
        return cls.NAME

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        """The implementation class, :attr:`IMPL_CLS`."""
        return _declared_class(cls, "IMPL_CLS", "AttentionImpl", "get_impl_cls")

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The per-step metadata builder (a :class:`kvcore.AttentionMetadataBuilder`
        subclass) the engine makes once and calls once per step: :attr:`BUILDER_CLS`.

        Default: :class:`kvcore.AttentionMetadataBuilder`, which checks the step's values
        once and returns the metadata unchanged. Declare your own for per-step work (a kernel
        library's plan, split choices, workspaces) and for CUDA-graph support.
        """
        return _declared_class(cls, "BUILDER_CLS", "AttentionMetadataBuilder", "get_builder_cls")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
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

        Derived from ``REQUIRED_PACKAGES`` and ``USES_TRITON`` without importing them.
        Backends that need a runtime check (a compiled extension, a driver feature) extend
        this.
        """
        reasons = []
        for module, requirement in cls.REQUIRED_PACKAGES:
            if importlib.util.find_spec(module) is None:
                reasons.append(f"{requirement} not installed (pip install {requirement})")
        if cls.USES_TRITON:
            reasons += triton_unavailable_reasons()
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
        has_logits_soft_cap: bool = False,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
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
            has_logits_soft_cap=has_logits_soft_cap, num_heads=num_heads,
            num_kv_heads=num_kv_heads,
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

