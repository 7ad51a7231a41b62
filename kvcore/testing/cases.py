"""Turn a backend's declared capabilities into the list of conformance cases to run.

The numerical configurations are derived from the declarations (``SUPPORTED_DTYPES``,
``SUPPORTED_HEAD_SIZES``, ...): a base configuration, then one axis varied at a time, so every
declared dtype and KV-cache dtype runs once and a claim like "any head size" is tried on an
unusual one. Validation probes are derived the same way: for each capability, the first value
the declaration excludes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.backend import FEATURE_FLAGS, AttentionBackend, CudaGraphSupport, is_supported
from kvcore.ops.validation import KV_CACHE_DTYPES
from kvcore.platform_types import AttentionType, DeviceCapability
from kvcore.testing import checks
from kvcore.testing.adopted_orders import check_adopted_order, order_label
from kvcore.testing.batch import CaseConfig, short_dtype
from kvcore.testing.builder_checks import (
    check_builder,
    check_builder_buffers,
    check_cuda_graph_replay,
)
from kvcore.testing.engine_metadata import check_engine_metadata
from kvcore.testing.numeric_checks import (
    check_batch_invariant,
    check_cache_write,
    check_cross_layer,
    check_forward,
    check_int64_offsets,
    check_stale_bytes,
)
from kvcore.testing.step_refusals import check_overlapping_new_tokens_refused
from kvcore.testing.strided_steps import check_strided_step_tensors
from kvcore.testing.window_rules import check_window_non_causal

__all__ = ["ConformanceCase", "conformance_cases", "resolve_backend_spec"]

_DTYPE_PREFERENCE = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_HEAD_SIZE_PREFERENCE = (64, 128, 32, 96, 80, 256, 16, 8)
# The second head size: a non-power of two first, to exercise padded and masked tiles.
_SECOND_HEAD_SIZE_PREFERENCE = (80, 96, 128, 256, 32)
_BLOCK_SIZE_PREFERENCE = (16, 32, 8, 64, 128, 256, 1)
# Tried when the backend declares "any": values kernels written for powers of two get wrong.
_UNUSUAL_HEAD_SIZE = 80
_UNUSUAL_BLOCK_SIZE = 12
# Declared features that forward has no argument for: reported as skipped cases.
_UNCHECKED_FEATURES = ("use_sparse", "use_mm_prefix", "use_per_head_quant_scales")
#: The soft-cap of the conformance cases: small, so that it changes every score of the random
#: batches (about unit variance) and a kernel that skips it is far off.
CONFORMANCE_SOFT_CAP = 2.0


def resolve_backend_spec(spec: str | type[AttentionBackend]) -> type[AttentionBackend]:
    """A backend class from a class, a registered name, or a ``"module:Class"`` path.

    The path form checks a backend before it is registered (``pytest --kvcore-backend
    acme_kvcore.backend:AcmeBackend``).
    """
    if isinstance(spec, type):
        cls: Any = spec
    elif isinstance(spec, str) and ":" in spec:
        module, _, attr = spec.partition(":")
        cls = importlib.import_module(module)
        for part in attr.split("."):
            cls = getattr(cls, part)
    elif isinstance(spec, str):
        from kvcore.registry import resolve_backend

        cls = resolve_backend(spec)
    else:
        raise TypeError(f"backend must be a class, a registered name or 'module:Class', "
                        f"got {spec!r}")
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"backend {spec!r} is {cls!r}, not an AttentionBackend subclass")
    return cls


def _first_supported(preference: tuple[int, ...], supported: Any, default: int) -> int:
    """The most common declared value (``default`` when any value is declared)."""
    if supported is None:
        return default
    return next((v for v in (*preference, *range(1, 1025)) if is_supported(v, supported)),
                default)


def _second_supported(preference: tuple[int, ...], supported: Any, base: int,
                      unusual: int) -> int | None:
    """A second declared value (an unusual one when "any" is declared), or ``None``."""
    if supported is None:
        return unusual
    for value in (*preference, *range(1, 1025)):
        if value != base and is_supported(value, supported):
            return value
    return None


def _first_unsupported(supported: Any) -> int | None:
    if supported is None:
        return None
    return next((v for v in range(1, 1025) if not is_supported(v, supported)), None)


@dataclass(frozen=True)
class _Declared:
    """What the suite derives from a backend's declarations."""

    dtype: torch.dtype
    head_size: int
    block_size: int
    kv_cache_dtype: str
    attn_type: AttentionType
    capability: DeviceCapability | None

    @classmethod
    def of(cls, backend: type[AttentionBackend]) -> _Declared:
        dtypes = backend.SUPPORTED_DTYPES
        dtype = next((d for d in _DTYPE_PREFERENCE if d in dtypes), dtypes[0] if dtypes else
                     torch.bfloat16)
        kv = "auto" if "auto" in backend.SUPPORTED_KV_CACHE_DTYPES else (
            backend.SUPPORTED_KV_CACHE_DTYPES or ("auto",))[0]
        return cls(
            dtype=dtype,
            head_size=_first_supported(_HEAD_SIZE_PREFERENCE, backend.SUPPORTED_HEAD_SIZES, 64),
            block_size=_first_supported(_BLOCK_SIZE_PREFERENCE, backend.SUPPORTED_BLOCK_SIZES,
                                        16),
            kv_cache_dtype=kv,
            attn_type=(backend.SUPPORTED_ATTN_TYPES or (AttentionType.DECODER,))[0],
            capability=backend.MIN_DEVICE_CAPABILITY or backend.MAX_DEVICE_CAPABILITY,
        )

    def validate_kwargs(self, backend: type[AttentionBackend]) -> dict[str, Any]:
        """Keyword arguments of ``validate_configuration`` for the base configuration."""
        return {
            "head_size": self.head_size, "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size,
            "use_mla": backend.IS_MLA, "has_sink": False, "use_sparse": False,
            "use_mm_prefix": False, "use_per_head_quant_scales": False,
            "device_capability": self.capability, "attn_type": self.attn_type,
            "use_non_causal": False, "use_batch_invariant": False, "use_kv_connector": False,
            "has_logits_soft_cap": False,
        }

    def base_config(self) -> CaseConfig:
        return CaseConfig(self.dtype, self.head_size, self.block_size, self.kv_cache_dtype)


def _validation_probes(
    backend: type[AttentionBackend], declared: _Declared
) -> list[tuple[str, dict[str, Any]]]:
    """``(field named by the reason, change to the base kwargs)`` for each excluded value."""
    probes: list[tuple[str, dict[str, Any]]] = []
    if (head := _first_unsupported(backend.SUPPORTED_HEAD_SIZES)) is not None:
        probes.append(("head_size", {"head_size": head}))
    if (dtype := next((d for d in _DTYPE_PREFERENCE if d not in backend.SUPPORTED_DTYPES),
                      None)) is not None:
        probes.append(("dtype", {"dtype": dtype}))
    if (kv := next((k for k in KV_CACHE_DTYPES if k not in backend.SUPPORTED_KV_CACHE_DTYPES),
                   None)) is not None:
        probes.append(("kv_cache_dtype", {"kv_cache_dtype": kv}))
    if (block := _first_unsupported(backend.SUPPORTED_BLOCK_SIZES)) is not None:
        probes.append(("block_size", {"block_size": block}))
    probes.append(("use_mla", {"use_mla": not backend.IS_MLA}))
    for flag, attr, _ in FEATURE_FLAGS:
        if not getattr(backend, attr):
            probes.append((flag, {flag: True}))
    if (attn := next((t for t in AttentionType if t not in backend.SUPPORTED_ATTN_TYPES),
                     None)) is not None:
        probes.append(("attn_type", {"attn_type": attn}))
    low, high = backend.MIN_DEVICE_CAPABILITY, backend.MAX_DEVICE_CAPABILITY
    if low is not None and (low.major, low.minor) > (0, 0):
        below = (DeviceCapability(low.major, low.minor - 1) if low.minor
                 else DeviceCapability(low.major - 1, 9))
        probes.append(("capability", {"device_capability": below}))
    if high is not None:
        probes.append(("capability", {"device_capability": DeviceCapability(high.major + 1, 0)}))
    return probes


def _numeric_configs(backend: type[AttentionBackend], declared: _Declared) -> list[CaseConfig]:
    """The base configuration, then one axis varied at a time."""
    base = declared.base_config()
    configs = [base]
    for dtype in backend.SUPPORTED_DTYPES:
        configs.append(CaseConfig(dtype, base.head_size, base.block_size, base.kv_cache_dtype))
    for kv in backend.SUPPORTED_KV_CACHE_DTYPES:
        configs.append(CaseConfig(base.dtype, base.head_size, base.block_size, kv))
    head = _second_supported(_SECOND_HEAD_SIZE_PREFERENCE, backend.SUPPORTED_HEAD_SIZES,
                             base.head_size, _UNUSUAL_HEAD_SIZE)
    if head is not None:
        configs.append(CaseConfig(base.dtype, head, base.block_size, base.kv_cache_dtype))
    block = _second_supported(_BLOCK_SIZE_PREFERENCE, backend.SUPPORTED_BLOCK_SIZES,
                              base.block_size, _UNUSUAL_BLOCK_SIZE)
    if block is not None:
        configs.append(CaseConfig(base.dtype, base.head_size, block, base.kv_cache_dtype))
    return list(dict.fromkeys(configs))


def _devices(backend: type[AttentionBackend]) -> tuple[list[str], str | None]:
    """Device types of the backend's platforms present here, or why none is."""
    from kvcore.platform import get_platform

    devices: list[str] = []
    absent: list[str] = []
    for name in backend.PLATFORMS:
        try:
            platform = get_platform(name)
        except Exception as exc:
            absent.append(f"{name}: {exc}")
            continue
        why = platform.probe()
        if why is None:
            if platform.device_type not in devices:
                devices.append(platform.device_type)
        else:
            absent.append(f"{name}: {why}")
    if devices:
        return devices, None
    return [], ("no platform the backend declares is present here (" + "; ".join(absent)
                + "); run on such a machine, or pass --kvcore-device cpu to run it on CPU "
                "tensors (e.g. Triton kernels with TRITON_INTERPRET=1)")


def _present_platform(backend: type[AttentionBackend], device: str) -> str | None:
    """The name (as ``PLATFORMS`` lists it) of the backend's platform that is present here
    with ``device`` as its device type (``cuda`` devices are ROCm's on a HIP build), else
    ``None``."""
    from kvcore.platform import get_platform

    for name in backend.PLATFORMS:
        try:
            platform = get_platform(name)
        except Exception:
            continue
        if platform.device_type == device and platform.probe() is None:
            return name
    return None


def _capability(backend: type[AttentionBackend], device: str) -> DeviceCapability | None:
    """The device capability validation sees for ``device``: the present platform's."""
    from kvcore.platform import get_platform

    name = _present_platform(backend, device)
    if name is not None:
        return get_platform(name).get_device_capability()
    override = os.environ.get("KVCORE_DEVICE_CAPABILITY")
    return DeviceCapability.parse(override) if override else None


def _skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


@dataclass(frozen=True)
class ConformanceCase:
    """One check of one backend; ``run()`` raises :class:`ConformanceError` if it fails.

    Parametrise a test with these (``ids=str``) and call :meth:`run`; a case that cannot run
    here (``skip_reason``) calls ``pytest.skip``.
    """

    #: e.g. ``CPU_ATTN-cpu-forward-bf16-D64-bs16``.
    id: str
    #: The rule this case checks first (a key of :data:`kvcore.testing.RULES`).
    rule: str
    #: The check, e.g. ``forward`` or ``validation-refuses``.
    kind: str
    backend: type[AttentionBackend] = field(repr=False)
    function: Callable[[], str | None] = field(repr=False, compare=False)
    skip_reason: str | None = None

    def __str__(self) -> str:
        return self.id

    def run(self) -> None:
        if self.skip_reason:
            _skip(self.skip_reason)
        skipped = self.function()
        if skipped:
            _skip(skipped)


def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode())


def conformance_cases(
    backend: str | type[AttentionBackend], devices: list[str] | None = None
) -> list[ConformanceCase]:
    """Every conformance case for ``backend``.

    Args:
        backend: a backend class, a registered name, or a ``"module:Class"`` path.
        devices: torch device types to run the numerical checks on (``["cpu"]``). Default:
            those of the backend's ``PLATFORMS`` present on this machine; with none present,
            the numerical cases are returned skipped, with the reason.

    Case ids read ``NAME-check`` for device-free checks and ``NAME-device-check-config``
    (e.g. ``CPU_ATTN-cpu-forward-bf16-D64-bs16``) for numerical ones.
    """
    cls = resolve_backend_spec(backend)
    name = checks.backend_label(cls)
    declared = _Declared.of(cls)
    base_kwargs = declared.validate_kwargs(cls)
    cases: list[ConformanceCase] = []

    def add(kind: str, rule: str, fn: Callable[..., str | None], *args: Any,
            device: str | None = None, suffix: str = "", skip: str | None = None) -> None:
        parts = [name, *([device] if device else []), kind, *([suffix] if suffix else [])]
        bound: Callable[[], str | None] = lambda: fn(*args)  # noqa: E731
        cases.append(ConformanceCase("-".join(parts), rule, kind, cls, bound, skip))

    add("identity", "backend-identity", checks.check_backend_identity, cls)
    add("shape", "shape-blocks-first", checks.check_shape, cls, declared.block_size,
        declared.head_size)
    add("stride-order", "stride-order-permutation", checks.check_stride_order, cls)
    add("cross-layer-claim", "cross-layer-claim", checks.check_cross_layer_claim, cls)
    add("kv-connector-claim", "kv-connector-claim", checks.check_kv_connector_claim, cls,
        base_kwargs)
    unavailable = cls.unavailable_reasons()
    add("validation-accepts-declared", "validation-accepts-declared",
        checks.check_validation_accepts, cls,
        {**base_kwargs, "device_capability": _accepts_capability(cls, declared)},
        skip=f"{name} cannot run here: {'; '.join(unavailable)}" if unavailable else None)
    for field_name, change in _validation_probes(cls, declared):
        add("validation-refuses", "validation-reasons", checks.check_validation_refuses, cls,
            base_kwargs, change, field_name, suffix=next(iter(change)))
    if not cls.IS_MLA:
        for flag, attr, _, _ in checks.IMPL_FEATURES:
            if not getattr(cls, attr):
                add("undeclared-feature", "undeclared-features-refused",
                    checks.check_undeclared_feature_refused, cls, declared.head_size, flag,
                    suffix=flag)

    if devices is None:
        devices, no_device = _devices(cls)
        if no_device:
            devices = [cls.PLATFORMS[0] if cls.PLATFORMS else "none"]
    else:
        no_device = None
    skip = no_device
    configs = _numeric_configs(cls, declared)
    cross_layer = _opts_in_cross_layer(cls)
    for device in devices:
        def numeric(kind: str, rule: str, fn: Callable[..., str | None],
                    config: CaseConfig, device: str = device,
                    excuse: str | None = None) -> None:
            seed = _seed(f"{name}-{device}-{kind}-{config.label()}")
            add(kind, rule, _gated, cls, fn, config, device, seed, device=device,
                suffix=config.label(), skip=skip or excuse)

        base = declared.base_config()
        for config in configs:
            numeric("cache-write", "cache-write-reference", check_cache_write, config)
            numeric("forward", "forward-reference",
                    functools.partial(check_forward, without_output=config == base),
                    config)
        numeric("stale-bytes", "stale-bytes-masked", check_stale_bytes, base,
                excuse=cls.stale_bytes_reason(torch.device(device).type))
        numeric("strided-steps", "strided-step-tensors", check_strided_step_tensors, base)
        numeric("engine-metadata", "engine-metadata", check_engine_metadata, base)
        if cls.SUPPORTS_NON_CAUSAL:
            noncausal = CaseConfig(base.dtype, base.head_size, base.block_size,
                                   base.kv_cache_dtype, causal=False)
            numeric("forward", "forward-reference", check_forward, noncausal)
        if not cls.IS_MLA:
            # Every K/V AttentionImpl takes sliding_window; the window cuts inside a block.
            window = dataclasses.replace(base, sliding_window=base.block_size + 3)
            numeric("forward", "forward-reference", check_forward, window)
        for attn_type in cls.SUPPORTED_ATTN_TYPES:
            if attn_type is not AttentionType.DECODER:
                numeric("forward", "forward-reference", check_forward,
                        dataclasses.replace(base, attn_type=attn_type))
        if not cls.IS_MLA:
            # Non-causal layers with a window: symmetric, or refused as declared.
            window = base.block_size + 3
            noncausal_windows = [dataclasses.replace(base, attn_type=t, sliding_window=window)
                                 for t in cls.SUPPORTED_ATTN_TYPES
                                 if t is not AttentionType.DECODER]
            if cls.SUPPORTS_NON_CAUSAL:
                noncausal_windows.insert(0, dataclasses.replace(base, causal=False,
                                                                sliding_window=window))
            for config in noncausal_windows:
                numeric("window-non-causal", "window-non-causal", check_window_non_causal,
                        config)
        if not cls.IS_MLA:
            for config, excuse in _feature_configs(cls, base):
                numeric("forward", "forward-reference", check_forward, config, excuse=excuse)
        for flag, attr, feature in FEATURE_FLAGS:
            if getattr(cls, attr) and flag in _UNCHECKED_FEATURES:
                add("feature", "forward-reference", _noop, device=device, suffix=flag,
                    skip=f"{name} declares {attr}, but kvcore's AttentionImpl API has no way "
                    f"to pass {feature} to forward yet, so the suite cannot check the claim")
        if cls.SUPPORTS_BATCH_INVARIANT:
            numeric("batch-invariant", "batch-invariant", check_batch_invariant, base)
        if cross_layer:
            # Each model dtype, and one fp8 cache: strides, not values, are what is checked.
            # One of the backend's platforms where it has not verified its cross-layer order
            # allocates per layer (CROSS_LAYER_PLATFORMS, as allocate_kv_caches does): nothing
            # cross-layer to check there. Other devices (CPU for a GPU backend's Triton
            # kernels under the interpreter) keep the declared order.
            platform = _present_platform(cls, device) or device
            unverified = (cls.cross_layer_note(platform) if platform in cls.PLATFORMS
                          and not cls.supports_cross_layer(platform) else None)
            fp8 = next((c for c in configs if c.is_fp8), None)
            for config in configs:
                if ((config.head_size, config.block_size) == (base.head_size, base.block_size)
                        and (not config.is_fp8 or config is fp8)):
                    numeric("cross-layer", "cross-layer-bit-exact", check_cross_layer,
                            config, excuse=unverified)
        if not cls.IS_MLA:
            # One case per order the kernels read beyond their own (none declared: none).
            for order in cls.readable_stride_orders()[1:]:
                suffix = f"{order_label(order)}-{base.label()}"
                add("adopted-orders", "adopted-orders", _gated, cls,
                    functools.partial(check_adopted_order, order=order), base, device,
                    _seed(f"{name}-{device}-adopted-orders-{suffix}"), device=device,
                    suffix=suffix, skip=skip)
        numeric("builder", "builder-reference", check_builder, base)
        numeric("overwrites", "overlapping-new-tokens-refused",
                check_overlapping_new_tokens_refused, base)
        if cls.CUDA_GRAPH_SUPPORT is not CudaGraphSupport.NEVER:
            numeric("builder-buffers", "builder-persistent-buffers",
                    check_builder_buffers, base)
            if device == "cuda":
                numeric("cuda-graph-replay", "cuda-graph-replay",
                        check_cuda_graph_replay, base)
        if device == "cuda":
            numeric("int64-offsets", "int64-offsets", check_int64_offsets, base)
        else:
            add("int64-offsets", "int64-offsets", check_int64_offsets, cls, base,
                device, 0, device=device, suffix=base.label(),
                skip="a cache over 2**31 elements takes GiBs: checked on GPUs only")
    return cases


def _noop() -> None:
    return None


def _feature_configs(backend: type[AttentionBackend], base: CaseConfig
                     ) -> list[tuple[CaseConfig, str | None]]:
    """``forward`` cases of the features an impl takes (sinks, a logit soft-cap), alone, with
    a sliding window (gpt-oss: sinks on windowed layers; Gemma 2: a soft-cap on them) and
    together, each with the reason it is skipped when the backend does not declare it."""
    name = checks.backend_label(backend)
    configs = []
    for has_sink, soft_cap in ((True, None), (False, CONFORMANCE_SOFT_CAP),
                               (True, CONFORMANCE_SOFT_CAP)):
        missing = [f"{name} does not declare {attr}" for attr, wanted in (
            ("SUPPORTS_SINK", has_sink), ("SUPPORTS_LOGITS_SOFT_CAP", soft_cap is not None))
            if wanted and not getattr(backend, attr)]
        excuse = "; ".join(missing) + " (the case runs for backends that do)" if missing \
            else None
        for sliding_window in (None, base.block_size + 3):
            configs.append((dataclasses.replace(base, has_sink=has_sink,
                                                logits_soft_cap=soft_cap,
                                                sliding_window=sliding_window), excuse))
    return configs


def _accepts_capability(backend: type[AttentionBackend],
                        declared: _Declared) -> DeviceCapability | None:
    """The capability of the base case of ``validation-accepts-declared``: this machine's
    (a present platform of the backend's, else ``KVCORE_DEVICE_CAPABILITY``) when the
    declarations cover it, else the declared minimum. What a backend runs can depend on the
    device and on what is installed for it (e.g. one kernel library per architecture)."""
    here = next((c for c in (_capability(backend, d) for d in _devices(backend)[0])
                 if c is not None), None)
    if here is None:
        override = os.environ.get("KVCORE_DEVICE_CAPABILITY")
        here = DeviceCapability.parse(override) if override else None
    low, high = backend.MIN_DEVICE_CAPABILITY, backend.MAX_DEVICE_CAPABILITY
    if here is None or (low and not here.at_least(low)) or (high and not high.at_least(here)):
        return declared.capability
    return here


def _opts_in_cross_layer(backend: type[AttentionBackend]) -> bool:
    """Whether the backend opts in to cross-layer caches (the order's outermost dim is 1)."""
    try:
        order = tuple(backend.get_kv_cache_stride_order(True))
    except Exception:
        return False
    return bool(order) and order[0] == 1


def _gated(backend: type[AttentionBackend], fn: Callable[..., str | None], config: CaseConfig,
           device: str, seed: int) -> str | None:
    """Run a numerical check if validation accepts its configuration on ``device``.

    A refused configuration is skipped with the reasons (refusing is the backend's right);
    an accepted one must then run (rule ``validation-refuses-before-kernel``).
    """
    capability = _capability(backend, device)
    reasons = backend.validate_configuration(
        head_size=config.head_size, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size, use_mla=backend.IS_MLA, has_sink=config.has_sink,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=capability, attn_type=config.attn_type,
        use_non_causal=not config.causal,
        has_logits_soft_cap=config.logits_soft_cap is not None)
    if reasons:
        return (f"validate_configuration refuses {short_dtype(config.dtype)}/"
                f"{config.kv_cache_dtype} on {device} (capability {capability}): "
                + "; ".join(reasons))
    return fn(backend, config, torch.device(device), seed)
