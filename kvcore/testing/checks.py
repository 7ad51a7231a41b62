"""The conformance checks: one function per check, each raising :class:`ConformanceError`.

Contract and validation checks need no device. Numerical checks allocate through
:func:`kvcore.allocate_kv_caches` (the backend's declared layout), fill the whole cache with
random data, and compare the backend against :mod:`kvcore.ops.reference` (float64) or, for
layout equivalence, against itself on a contiguous cache, bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvcore.allocate import KVCaches, allocate_kv_caches
from kvcore.backend import (
    FEATURE_FLAGS,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    LayerScales,
    build_attention_metadata,
    is_supported,
)
from kvcore.builder import AttentionMetadataBuilder, PersistentMetadataBuilder
from kvcore.config import AttentionSelectorConfig
from kvcore.layout import KVCacheLayout
from kvcore.ops.mla_reference import concat_and_cache_mla_ref
from kvcore.ops.reference import paged_attention_ref, reshape_and_cache_ref, scale_value
from kvcore.ops.validation import FP8_KV_CACHE_DTYPES
from kvcore.platform_types import AttentionType
from kvcore.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from kvcore.testing.batch import (
    NUM_HEADS,
    NUM_KV_HEADS,
    CaseConfig,
    MixedBatch,
    make_mixed_batch,
    mla_dims,
    random_block_tables,
    random_like,
    short_dtype,
)
from kvcore.testing.reference import contiguous_attention_ref, contiguous_mla_ref
from kvcore.testing.rules import ConformanceError

__all__ = [
    "DEFAULT_TOLERANCES",
    "MLA_NORM_TOLERANCES",
    "NORM_TOLERANCES",
    "backend_label",
    "check_backend_identity",
    "check_batch_invariant",
    "check_builder",
    "check_builder_buffers",
    "check_cache_write",
    "check_cross_layer",
    "check_cross_layer_claim",
    "check_cuda_graph_replay",
    "check_forward",
    "check_int64_offsets",
    "check_kv_connector_claim",
    "check_shape",
    "check_stale_bytes",
    "check_stride_order",
    "check_validation_accepts",
    "check_validation_refuses",
    "tolerance_for",
]

#: ``(atol, rtol)`` per key. A model dtype bounds ``forward`` against the float64 reference; an
#: fp8 ``kv_cache_dtype`` name bounds a cache write against the reference quantisation,
#: compared as stored values (one fp8 step: e4m3 has 3 mantissa bits, e5m2 two). Writes of
#: ``"auto"`` caches are copies and are always compared bit for bit. A backend narrows or
#: widens an entry with a ``CONFORMANCE_TOLERANCES`` class attribute of the same form.
DEFAULT_TOLERANCES: dict[torch.dtype | str, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    # TF32 tensor-core products (Triton's default for fp32 dot) round inputs to 10 bits.
    torch.float32: (2e-3, 2e-3),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
    "fp8": (2.0**-9, 2.0**-3),
    "fp8_e4m3": (2.0**-9, 2.0**-3),
    "fp8_e5m2": (2.0**-16, 2.0**-2),
}

#: Largest relative error norm of one token's output (all heads and dims) per model dtype:
#: ``||out - round(ref)|| / ||round(ref)||`` with ``round(ref)`` the float64 reference rounded
#: to the model dtype, what a correct kernel's last rounding gives. A correct kernel with fp32
#: accumulation that rounds the probabilities to the model dtype before the P.V product (as
#: flash-style kernels do) stays well below (bf16 about 3e-3, fp16 and TF32 about 5e-4); a
#: systematic 1% error gives 1e-2 in every dtype. Unlike the element-wise bound, this one
#: does not grow with the cancellation in an output element near zero.
NORM_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-3,  # TF32 dots (Triton's default for fp32) round inputs to 10 bits
    torch.float16: 2e-3,
    torch.bfloat16: 5e-3,
}

#: :data:`NORM_TOLERANCES` for MLA backends (``_MLARun.norm_tolerances``). Below 1%, so a 1%
#: error fails; above what a correct absorbed kernel's extra roundings (``q_latent`` and the
#: latent output in the model dtype) give, which in bf16 is near 4e-3.
MLA_NORM_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    # TF32 dots (Triton's default for fp32) round inputs to 10 bits.
    torch.float32: 2e-3,
    torch.float16: 2e-3,
    torch.bfloat16: 7e-3,
}

_DIM_WORDS = {"B": "block", "2": "K/V", "N": "token", "H": "head", "D": "dim", "L": "layer"}
_WORD = re.compile(r"[A-Za-z_]+")


def backend_label(backend: type[AttentionBackend]) -> str:
    """``get_name()``, or the class name when ``get_name`` itself is broken."""
    try:
        name = backend.get_name()
    except Exception:
        return backend.__name__
    return name if isinstance(name, str) and name else backend.__name__


def _fail(backend: type[AttentionBackend], rule: str, detail: str) -> ConformanceError:
    return ConformanceError(backend_label(backend), rule, detail)


def tolerance_for(
    backend: type[AttentionBackend], key: torch.dtype | str
) -> tuple[tuple[float, float], str]:
    """``((atol, rtol), source)`` for ``key``: the backend's declaration or the default table."""
    declared = backend.CONFORMANCE_TOLERANCES
    if key in declared:
        return tuple(declared[key]), f"{backend_label(backend)}.CONFORMANCE_TOLERANCES"
    return DEFAULT_TOLERANCES[key], "kvcore.testing.DEFAULT_TOLERANCES"


# -- contract ------------------------------------------------------------------------------


def check_backend_identity(backend: type[AttentionBackend]) -> None:
    """Rule ``backend-identity``."""
    problems = []
    try:
        name = backend.get_name()
    except Exception as exc:
        problems.append(f"get_name() raised {type(exc).__name__}: {exc}")
    else:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            problems.append(f"get_name() returned {name!r}; use an upper-case name like "
                            "'ACME_ATTN'")
    try:
        impl = backend.get_impl_cls()
    except ImportError as exc:
        if not backend.unavailable_reasons():
            problems.append(
                f"get_impl_cls() raised {type(exc).__name__}: {exc}, but unavailable_reasons() "
                "is empty; declare the package in REQUIRED_PACKAGES so a missing kernel "
                "library is a reason, not an import error")
    else:
        if not (isinstance(impl, type) and issubclass(impl, AttentionImpl)):
            problems.append(f"get_impl_cls() returned {impl!r}, not an AttentionImpl subclass")
    platforms = backend.PLATFORMS
    if not platforms or not all(isinstance(p, str) and p == p.lower() for p in platforms):
        problems.append(f"PLATFORMS={platforms!r}; declare the lower-case platform names the "
                        "backend runs on, e.g. ('cuda',), or no selector ever picks it")
    try:
        backend.capabilities()
    except Exception as exc:
        problems.append(f"capabilities() (what `kvcore list` shows) raised "
                        f"{type(exc).__name__}: {exc}")
    if problems:
        raise _fail(backend, "backend-identity", "\n".join(problems))


def check_shape(backend: type[AttentionBackend], block_size: int, head_size: int) -> None:
    """Rule ``shape-blocks-first``, at two size sets whose values are all distinct.

    MLA caches hold one latent per token, shared by the heads: ``num_kv_heads`` is 1 there.
    """
    for nb, h in ((13, 1), (29, 1)) if backend.IS_MLA else ((13, 3), (29, 5)):
        shape = tuple(backend.get_kv_cache_shape(nb, block_size, h, head_size))
        if backend.IS_MLA:
            expected = (nb, block_size, head_size)
        else:
            expected = (nb, 2, block_size, h, head_size)
        if shape == expected:
            continue
        legacy = (2, nb, block_size, h, head_size)
        if shape == legacy and not backend.IS_MLA:
            if backend.supports_kv_connector():
                raise _fail(backend, "shape-blocks-first", (
                    f"get_kv_cache_shape({nb}, {block_size}, {h}, {head_size}) = {shape} is the "
                    "legacy (2, num_blocks, ...) shape, but supports_kv_connector() is True: "
                    "connectors index dim 0 as the block and would move half-blocks. Return "
                    "the blocks-first shape, or return False from supports_kv_connector()"))
            continue
        raise _fail(backend, "shape-blocks-first", (
            f"get_kv_cache_shape(num_blocks={nb}, block_size={block_size}, num_kv_heads={h}, "
            f"head_size={head_size}) returned {shape}, expected {expected}"))


def _orders(backend: type[AttentionBackend]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    ndim = 3 if backend.IS_MLA else 5
    per_layer = tuple(backend.get_kv_cache_stride_order(False))
    with_layers = tuple(backend.get_kv_cache_stride_order(True))
    return per_layer, with_layers, ndim


def check_stride_order(backend: type[AttentionBackend]) -> None:
    """Rule ``stride-order-permutation``."""
    per_layer, with_layers, ndim = _orders(backend)
    for label, order, n in (("get_kv_cache_stride_order(False)", per_layer, ndim),
                            ("get_kv_cache_stride_order(True)", with_layers, ndim + 1)):
        if sorted(order) != list(range(n)):
            raise _fail(backend, "stride-order-permutation", (
                f"{label} = {order} is not a permutation of {tuple(range(n))}: it must name "
                f"each of the {n} logical dims exactly once, outermost first"))


def check_cross_layer_claim(backend: type[AttentionBackend]) -> None:
    """Rule ``cross-layer-claim``."""
    check_stride_order(backend)
    per_layer, with_layers, _ = _orders(backend)
    shifted = tuple(d + 1 for d in per_layer)
    if with_layers[0] == 0:
        expected, kind = (0, *shifted), "no cross-layer (layer dim outermost)"
    elif with_layers[0] == 1:
        # A layer's page inside a cross-layer block must be laid out as the per-layer order
        # says, or a connector copying pages between the two allocations scrambles them.
        expected, kind = (1, 0, *(d for d in shifted if d != 1)), "cross-layer"
    else:
        raise _fail(backend, "cross-layer-claim", (
            f"get_kv_cache_stride_order(True) = {with_layers} puts logical dim "
            f"{with_layers[0]} outermost; it must start with 0 (layers outermost) or with 1, 0 "
            "(block outermost, then layer)"))
    if with_layers != expected:
        raise _fail(backend, "cross-layer-claim", (
            f"get_kv_cache_stride_order(True) = {with_layers} claims {kind}, so with the "
            f"per-layer order {per_layer} it must be {expected}"))
    claimed = backend.supports_cross_layer()
    if claimed != (with_layers[0] == 1):
        raise _fail(backend, "cross-layer-claim", (
            f"supports_cross_layer() is {claimed} but get_kv_cache_stride_order(True) = "
            f"{with_layers} says {kind}; derive one from the other"))


def check_kv_connector_claim(backend: type[AttentionBackend], base: dict[str, Any]) -> None:
    """Rule ``kv-connector-claim``; ``base`` holds valid validate_configuration kwargs."""
    per_layer, _, _ = _orders(backend)
    if backend.supports_kv_connector():
        if per_layer[0] != 0:
            raise _fail(backend, "kv-connector-claim", (
                f"supports_kv_connector() is True but get_kv_cache_stride_order(False) = "
                f"{per_layer} puts logical dim {per_layer[0]} outermost in memory, so a block "
                "is not one contiguous page; keep the block dim first or opt out of connectors"))
        return
    reason = backend.kv_connector_unsupported_reason()
    if not _is_sentence(reason):
        raise _fail(backend, "kv-connector-claim", (
            f"supports_kv_connector() is False but kv_connector_unsupported_reason() returned "
            f"{reason!r}; say why, and which backend to use instead"))
    reasons = backend.validate_configuration(**{**base, "use_kv_connector": True})
    if not any("connector" in r.lower() for r in reasons if isinstance(r, str)):
        raise _fail(backend, "kv-connector-claim", (
            f"supports_kv_connector() is False but validate_configuration(use_kv_connector="
            f"True) returned {reasons!r}, with no reason naming the KV connector"))


# -- validation ------------------------------------------------------------------------------


def _is_sentence(text: object) -> bool:
    return isinstance(text, str) and bool(text.strip()) and "\n" not in text and len(
        _WORD.findall(text)) >= 2


def _validate(backend: type[AttentionBackend], kwargs: dict[str, Any]) -> list[str]:
    try:
        reasons = backend.validate_configuration(**kwargs)
    except Exception as exc:
        raise _fail(backend, "validation-reasons", (
            f"validate_configuration({_kwargs_text(kwargs)}) raised {type(exc).__name__}: {exc}; "
            "it must return reasons, never raise (a missing kernel library is a reason too)"
        )) from exc
    if not isinstance(reasons, list):
        raise _fail(backend, "validation-reasons", (
            f"validate_configuration({_kwargs_text(kwargs)}) returned {reasons!r}, not a list "
            "of reasons"))
    return reasons


def _show(value: Any) -> str:
    """A validate_configuration argument as reasons write it (``dtype=bfloat16``)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, AttentionType):
        return value.value
    return str(value)


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_show(v)}" for k, v in kwargs.items())


def check_validation_refuses(
    backend: type[AttentionBackend], base: dict[str, Any], change: dict[str, Any], field: str
) -> None:
    """Rule ``validation-reasons``: ``base`` with ``change`` applied is outside the declared
    capabilities, so it must be refused with a one-line reason naming ``field``."""
    kwargs = {**base, **change}
    reasons = _validate(backend, kwargs)
    what = _kwargs_text(change)
    if not reasons:
        raise _fail(backend, "validation-reasons", (
            f"validate_configuration accepted {what}, which the declared capabilities exclude "
            f"(full call: {_kwargs_text(kwargs)}); derive validation from the declarations"))
    bad = [r for r in reasons if not _is_sentence(r)]
    if bad:
        raise _fail(backend, "validation-reasons", (
            f"for {what}, validate_configuration returned reasons that are not one-line "
            f"sentences: {bad!r}"))
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])")
    if not any(pattern.search(r) for r in reasons):
        raise _fail(backend, "validation-reasons", (
            f"for {what}, no reason names {field!r}: {reasons!r}; a user must see which "
            f"setting to change, e.g. \"{field}=... (supported: ...)\""))


def _named_fields(reason: str, kwargs: dict[str, Any]) -> list[str]:
    """The fields of ``kwargs`` that ``reason`` names with their value, as ``field=value``
    (``block_size=16``, not ``block_size=160``; ``dtype=bfloat16`` or ``torch.bfloat16``)."""
    return [k for k, v in kwargs.items() if re.search(
        rf"(?<![A-Za-z0-9_]){re.escape(k)}=(torch\.)?{re.escape(_show(v))}(?![A-Za-z0-9_]|\.\d)",
        reason)]


#: Sizes tried for another declared head or block size (those the declaration includes).
_COMMON_SIZES = (16, 32, 64, 128, 256, 8, 96, 80, 512, 576, 1)


def _declared_values(backend: type[AttentionBackend], field: str) -> tuple[Any, ...]:
    """The values of the validate_configuration argument ``field`` that the backend's
    capability attributes declare (the common sizes among declared head and block sizes;
    nothing for an argument no attribute declares, e.g. ``device_capability``)."""
    sizes = {"head_size": backend.SUPPORTED_HEAD_SIZES,
             "block_size": backend.SUPPORTED_BLOCK_SIZES}
    if field in sizes:
        supported = sizes[field]
        listed = () if supported is None else tuple(v for v in supported if isinstance(v, int))
        return tuple(v for v in dict.fromkeys((*listed, *_COMMON_SIZES))
                     if is_supported(v, supported))
    features = {flag: attr for flag, attr, _ in FEATURE_FLAGS}
    if field in features:
        return (False, True) if getattr(backend, features[field]) else (False,)
    return {"dtype": backend.SUPPORTED_DTYPES,
            "kv_cache_dtype": backend.SUPPORTED_KV_CACHE_DTYPES,
            "attn_type": backend.SUPPORTED_ATTN_TYPES}.get(field, ())


def _refused_everywhere(backend: type[AttentionBackend], base: dict[str, Any], field: str,
                        partners: list[str]) -> str | None:
    """Why ``base[field]`` is not fine alone (refused with every declared value of the
    ``partners`` it clashes with), or ``None`` when some such configuration is accepted."""
    choices = [[v for v in _declared_values(backend, p) if v != base[p]] for p in partners]
    for values in itertools.product(*choices):
        if not _validate(backend, {**base, **dict(zip(partners, values, strict=True))}):
            return None
    tried = "; ".join(f"{p}: {', '.join(map(_show, c)) or 'no other declared value'}"
                      for p, c in zip(partners, choices, strict=True))
    return (f"{field}={_show(base[field])} is refused with every other declared value of "
            f"{', '.join(partners)} too ({tried}), so it is not a clash of values each fine "
            "alone: the declarations promise a value the validation takes back everywhere")


def check_validation_accepts(backend: type[AttentionBackend], base: dict[str, Any]) -> None:
    """Rule ``validation-accepts-declared``.

    The one refusal allowed is a clash between declared values that are each fine alone (e.g.
    a block size one library takes and the minimum device capability, where another library
    runs): a reason from ``check_combination`` that names at least two fields with their
    values as ``field=value``, where each named value is accepted with some other declared
    value of the fields it clashes with. A value that clashes with ``device_capability`` is
    exempt from that search (what runs on another device may need a library that is not
    installed here); the capability itself is not.
    """
    reasons = _validate(backend, base)
    if not reasons:
        return
    config_fields = {k: v for k, v in base.items() if k != "device_capability"}
    try:
        combination = backend.check_combination(AttentionSelectorConfig(**config_fields),
                                                 base["device_capability"])
    except Exception:  # an override of validate_configuration need not call it
        combination = []
    unexplained = [r for r in reasons if r not in combination
                   or len(_named_fields(r, base)) < 2]
    if unexplained:
        raise _fail(backend, "validation-accepts-declared", (
            f"validate_configuration({_kwargs_text(base)}) refused a configuration built from "
            f"the declared capabilities: {unexplained!r}; only check_combination may refuse it, "
            "with reasons that name each clashing field with its value as field=value"))
    for reason in reasons:
        named = _named_fields(reason, base)
        for field in named:
            partners = [p for p in named if p != field]
            if field != "device_capability" and "device_capability" in partners:
                continue
            why = _refused_everywhere(backend, base, field, partners)
            if why:
                raise _fail(backend, "validation-accepts-declared", (
                    f"validate_configuration({_kwargs_text(base)}) refused a configuration "
                    f"built from the declared capabilities with {reason!r}: {why}; narrow the "
                    "declaration or fix check_combination"))


# -- numerical checks ----------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers of the same width (NaN-safe, exact comparison)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _split_kv(kv_cache: torch.Tensor, layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``(num_blocks, block_size, num_kv_heads, head_size)`` of one layer."""
    key_cache, value_cache = kv_cache.unbind(layout.layer_dim_names.index("2"))
    return key_cache, value_cache


class _Run:
    """One numerical case: the backend, its config and device, and the helpers to call it."""

    #: What the last dim of the output is, for messages.
    OUTPUT_DIM = "head_size"
    #: ``num_kv_heads`` of the caches this kind of attention allocates.
    CACHE_KV_HEADS = NUM_KV_HEADS
    #: Per-token error norm bounds of :meth:`output_diff` (a kind of attention whose correct
    #: kernels round more, e.g. MLA's absorbed path, sets its own) and their name in messages.
    norm_tolerances: dict[torch.dtype, float] = NORM_TOLERANCES
    norm_source = "kvcore.testing.NORM_TOLERANCES"

    def __init__(self, backend: type[AttentionBackend], config: CaseConfig,
                 device: torch.device, seed: int) -> None:
        self.backend = backend
        self.config = config
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        # The numerical checks only make sense once the layout contract holds.
        check_shape(backend, config.block_size, config.head_size)
        check_cross_layer_claim(backend)

    def where(self) -> str:
        return (f"config: {self.config.describe(self.backend.IS_MLA)}; device {self.device}; "
                f"seed {self.seed}")

    def make_batch(self) -> MixedBatch:
        return make_mixed_batch(self.config, self.device, self.gen)

    def tokens(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random ``(query, key, value)`` for ``rows`` new tokens."""
        d, dtype = self.config.head_size, self.config.dtype
        return (random_like((rows, NUM_HEADS, d), dtype, self.device, self.gen),
                random_like((rows, NUM_KV_HEADS, d), dtype, self.device, self.gen),
                random_like((rows, NUM_KV_HEADS, d), dtype, self.device, self.gen))

    def page_elements(self) -> int:
        """Elements of one block of one layer."""
        return 2 * self.config.block_size * NUM_KV_HEADS * self.config.head_size

    def output_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, NUM_HEADS, self.config.head_size)

    def reference_write(self, batch: MixedBatch, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        scales: LayerScales, slot_mapping: torch.Tensor) -> None:
        """What ``do_kv_cache_update`` must do, done by the reference on ``kv_cache``."""
        key_cache, value_cache = _split_kv(kv_cache, layout)
        reshape_and_cache_ref(batch.key, batch.value, key_cache, value_cache, slot_mapping,
                              self.config.kv_cache_dtype, scales.k_scale, scales.v_scale)

    def fail(self, rule: str, detail: str) -> ConformanceError:
        return _fail(self.backend, rule, f"{detail}\n{self.where()}")

    def allocate(self, num_blocks: int, num_layers: int = 1, cross_layer: bool = False,
                 fill: bool = True) -> KVCaches:
        caches = allocate_kv_caches(
            self.backend, num_layers=num_layers, num_blocks=num_blocks,
            block_size=self.config.block_size, num_kv_heads=self.CACHE_KV_HEADS,
            head_size=self.config.head_size, dtype=self.config.dtype, device=self.device,
            cross_layer=cross_layer, kv_cache_dtype=self.config.kv_cache_dtype)
        if fill:  # random everywhere, so stray writes and reads of stale data show
            caches.storage.copy_(random_like(caches.storage.shape, caches.storage.dtype,
                                             self.device, self.gen))
        return caches

    def scales(self) -> LayerScales:
        if not self.config.is_fp8:
            return LayerScales()
        # Non-trivial per-tensor scales, as fp8 engines pass them: 1-element float32 tensors.
        return LayerScales(torch.tensor([0.5], device=self.device),
                           torch.tensor([0.25], device=self.device))

    def impl_kwargs(self) -> dict[str, Any]:
        """What the case's ``AttentionImpl`` is constructed with."""
        d = self.config.head_size
        return dict(num_heads=NUM_HEADS, head_size=d, scale=d**-0.5, num_kv_heads=NUM_KV_HEADS,
                    sliding_window=self.config.sliding_window,
                    kv_cache_dtype=self.config.kv_cache_dtype, attn_type=self.config.attn_type)

    def impl(self) -> AttentionImpl:
        return self.call("constructing the AttentionImpl", self.backend.get_impl_cls(),
                         **self.impl_kwargs())

    def setup_layer(self, num_blocks: int, fill: bool = True
                    ) -> tuple[KVCaches, torch.Tensor, LayerScales, AttentionImpl]:
        """What most checks start from: a one-layer allocation of ``num_blocks`` (random
        unless ``fill=False``), its layer view, the case's scales and a fresh impl."""
        caches = self.allocate(num_blocks, fill=fill)
        return caches, caches.layers[0], self.scales(), self.impl()

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self.fail("validation-refuses-before-kernel", (
                f"validate_configuration accepted this configuration, but {what} raised "
                f"{type(exc).__name__}: {exc}")) from exc

    def write(self, impl: AttentionImpl, scales: LayerScales, batch: MixedBatch,
              kv_cache: torch.Tensor) -> None:
        self.call("do_kv_cache_update", impl.do_kv_cache_update, scales, batch.key,
                  batch.value, kv_cache, batch.metadata.slot_mapping)

    def forward(self, impl: AttentionImpl, scales: LayerScales, batch: MixedBatch,
                kv_cache: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        result = self.call("forward", impl.forward, scales, batch.query, batch.key, batch.value,
                           kv_cache, batch.metadata, output=output)
        rows = self.output_shape(batch.query.shape[0])
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(rows):
            raise self.fail("forward-reference", (
                f"forward returned {_shape_text(result)}; it must return the output, shape "
                f"{tuple(rows)} (num_tokens, num_heads, {self.OUTPUT_DIM})"))
        return result

    def reference_forward(self, batch: MixedBatch, kv_cache: torch.Tensor,
                          layout: KVCacheLayout, scales: LayerScales) -> torch.Tensor:
        """float64 attention of the real tokens over ``kv_cache`` as it is now.

        A layer that is not a decoder (fresh prefills only, see :func:`make_mixed_batch`)
        attends over its own step's keys without the causal mask: computed from the tokens,
        not the cache, so it holds whether or not such a layer writes the cache.
        """
        m = batch.metadata
        n = m.num_actual_tokens
        scale = self.config.head_size**-0.5
        if self.config.attn_type is not AttentionType.DECODER:
            starts = m.query_start_loc.tolist()
            return torch.cat([
                contiguous_attention_ref(batch.query[a:b], batch.key[a:b], batch.value[a:b],
                                         scale, causal=False,
                                         sliding_window=self.config.sliding_window)
                for a, b in itertools.pairwise(starts)])
        key_cache, value_cache = _split_kv(kv_cache, layout)
        if not self.config.is_fp8:
            key_cache, value_cache = key_cache.double(), value_cache.double()
        return paged_attention_ref(
            batch.query[:n].double(), key_cache, value_cache,
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table,
            scale=scale, causal=m.causal, sliding_window=self.config.sliding_window,
            kv_cache_dtype=self.config.kv_cache_dtype, k_scale=scales.k_scale,
            v_scale=scales.v_scale)

    def output_diff(self, out: torch.Tensor, ref: torch.Tensor, batch: MixedBatch) -> str | None:
        """Where ``out`` misses the float64 ``ref``, or ``None``.

        Two bounds: element-wise ``|out - ref| <= atol + rtol * |ref|`` (a wrong element, NaN),
        then each token's relative error norm against ``ref`` rounded to the model dtype (a
        small error on every element, which the element-wise bound lets through in bf16).
        """
        (atol, rtol), source = tolerance_for(self.backend, self.config.dtype)
        err = (out.double() - ref).abs()
        bad = ~(err <= atol + rtol * ref.abs())  # NaN counts as bad
        if bad.any():
            token, head, dim = bad.nonzero()[0].tolist()
            finite = torch.isfinite(out)
            worst = err[finite.to(err.device)].max().item() if finite.any() else float("nan")
            return (
                f"{int(bad.sum())} of {bad.numel()} output elements exceed atol={atol:g}, "
                f"rtol={rtol:g} (from {source}); largest finite error {worst:.3g}; "
                f"{int((~finite).sum())} non-finite. First at {batch.locate(token)}, head {head}, "
                f"dim {dim}: got {out[token, head, dim].item():.6g}, expected "
                f"{ref[token, head, dim].item():.6g}.\n{batch.describe()}")
        limit = self.norm_tolerances[self.config.dtype]
        rounded = ref.to(self.config.dtype).double()
        rel = ((out.double() - rounded).flatten(1).norm(dim=1)
               / rounded.flatten(1).norm(dim=1).clamp_min(1e-30))
        if not (rel > limit).any():
            return None
        token = int(rel.argmax())
        return (
            f"{int((rel > limit).sum())} of {rel.numel()} tokens have a relative error norm "
            f"over their heads above {limit:g} ({self.norm_source}, against the "
            f"reference rounded to {short_dtype(self.config.dtype)}): worst {rel[token]:.3g} "
            f"at {batch.locate(token)}, median {rel.median():.3g}; a correct kernel stays "
            f"near the dtype's rounding, a systematic 1% error gives 0.01.\n"
            f"{batch.describe()}")


class _MLARun(_Run):
    """A numerical case of an MLA backend: latent cache, ``kv_b_proj`` weight, model dims.

    ``head_size`` is the latent size; :func:`mla_dims` splits it. ``key`` / ``value`` of a
    batch are ``kv_c`` ``(rows, kv_lora_rank)`` / ``k_pe`` ``(rows, rope_dim)``.
    """

    OUTPUT_DIM = "v_head_dim"
    CACHE_KV_HEADS = 1
    norm_tolerances = MLA_NORM_TOLERANCES
    norm_source = "kvcore.testing.MLA_NORM_TOLERANCES"

    def __init__(self, backend: type[AttentionBackend], config: CaseConfig,
                 device: torch.device, seed: int) -> None:
        super().__init__(backend, config, device, seed)
        self.dims = mla_dims(config.head_size)
        d = self.dims
        # Scaled so that k = W_UK c and v = W_UV c have unit variance, as in a trained model.
        self.weight = (torch.randn(NUM_HEADS * (d.qk_nope_head_dim + d.v_head_dim),
                                   d.kv_lora_rank, generator=self.gen)
                       * d.kv_lora_rank**-0.5).to(config.dtype).to(device)
        self.scale = (d.qk_nope_head_dim + d.qk_rope_head_dim) ** -0.5

    def make_batch(self) -> MixedBatch:
        batch = make_mixed_batch(self.config, self.device, self.gen)
        query, kv_c, k_pe = self.tokens(batch.query.shape[0])
        return dataclasses.replace(batch, query=query, key=kv_c, value=k_pe)

    def tokens(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, dtype, device = self.dims, self.config.dtype, self.device
        return (random_like((rows, NUM_HEADS, d.qk_nope_head_dim + d.qk_rope_head_dim), dtype,
                            device, self.gen),
                random_like((rows, d.kv_lora_rank), dtype, device, self.gen),
                random_like((rows, d.qk_rope_head_dim), dtype, device, self.gen))

    def page_elements(self) -> int:
        return self.config.block_size * self.config.head_size

    def output_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, NUM_HEADS, self.dims.v_head_dim)

    def impl_kwargs(self) -> dict[str, Any]:
        d = self.dims
        return dict(num_heads=NUM_HEADS, head_size=self.config.head_size, scale=self.scale,
                    num_kv_heads=1, sliding_window=None,
                    kv_cache_dtype=self.config.kv_cache_dtype, attn_type=AttentionType.DECODER,
                    kv_lora_rank=d.kv_lora_rank, qk_nope_head_dim=d.qk_nope_head_dim,
                    qk_rope_head_dim=d.qk_rope_head_dim, v_head_dim=d.v_head_dim,
                    kv_b_proj_weight=self.weight)

    def reference_write(self, batch: MixedBatch, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        scales: LayerScales, slot_mapping: torch.Tensor) -> None:
        concat_and_cache_mla_ref(batch.key, batch.value, kv_cache, slot_mapping,
                                 self.config.kv_cache_dtype, scales.k_scale)

    def reference_forward(self, batch: MixedBatch, kv_cache: torch.Tensor,
                          layout: KVCacheLayout, scales: LayerScales) -> torch.Tensor:
        """float64, unabsorbed MLA of the real tokens over each request's latents, read from
        ``kv_cache`` as it is now and laid out contiguously (fp8 dequantised)."""
        m = batch.metadata
        starts, lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        scale = scale_value(scales.k_scale) if self.config.is_fp8 else 1.0
        rank = self.dims.kv_lora_rank
        block_size = self.config.block_size
        outs = []
        for i, seq_len in enumerate(lens):
            pos = torch.arange(seq_len, device=kv_cache.device)
            table = torch.tensor(batch.block_tables[i], device=kv_cache.device, dtype=torch.int64)
            latents = kv_cache[table[pos // block_size], pos % block_size].double() * scale
            outs.append(contiguous_mla_ref(
                batch.query[starts[i]:starts[i + 1]], latents[:, :rank], latents[:, rank:],
                self.weight, self.scale, qk_nope_head_dim=self.dims.qk_nope_head_dim,
                v_head_dim=self.dims.v_head_dim))
        return torch.cat(outs)

    def output_diff(self, out: torch.Tensor, ref: torch.Tensor, batch: MixedBatch) -> str | None:
        """The element-wise bound too against the reference rounded to the model dtype: the
        absorbed path rounds more than a last rounding can, element by element."""
        return super().output_diff(out, ref.to(self.config.dtype).double(), batch)


def _run(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
         seed: int) -> _Run:
    return (_MLARun if backend.IS_MLA else _Run)(backend, config, device, seed)


def _shape_text(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def _cache_diff(got: torch.Tensor, expected: torch.Tensor, layout: KVCacheLayout,
                batch: MixedBatch, block_size: int, tol: tuple[float, float] | None) -> str | None:
    """Where a written cache differs from the expected one, or ``None`` if it does not."""
    if tol is None:
        bad = _bits(got) != _bits(expected)
    else:
        g, e = got.float(), expected.float()
        bad = ~((g - e).abs() <= tol[0] + tol[1] * e.abs())
    if not bad.any():
        return None
    names = layout.layer_dim_names
    idx = bad.nonzero().cpu()
    slots = idx[:, names.index("B")] * block_size + idx[:, names.index("N")]
    targets = batch.metadata.slot_mapping.cpu()
    in_target = torch.isin(slots, targets[targets >= 0])
    first = idx[0].tolist()
    where = ", ".join(f"{_DIM_WORDS[n]} {v}" for n, v in zip(names, first, strict=True))
    tolerance = "bit-exact" if tol is None else f"atol={tol[0]:g}, rtol={tol[1]:g}"
    return (
        f"{int(bad.sum())} of {bad.numel()} cache elements differ ({tolerance}): "
        f"{int(in_target.sum())} in slots slot_mapping names (wrong values), "
        f"{int((~in_target).sum())} in slots it does not name (written where nothing should "
        f"be). First at {where}: got {got[tuple(first)].float().item():.6g}, expected "
        f"{expected[tuple(first)].float().item():.6g}.\n{batch.describe()}")


def check_cache_write(backend: type[AttentionBackend], config: CaseConfig,
                      device: torch.device, seed: int) -> None:
    """Rule ``cache-write-reference``, on a per-layer (not cross-layer) allocation."""
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    expected = layer.clone()
    run.reference_write(batch, expected, caches.layout, scales, batch.metadata.slot_mapping)
    run.write(impl, scales, batch, layer)
    tol = None
    if config.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        tol, _ = tolerance_for(backend, config.kv_cache_dtype)
    diff = _cache_diff(layer, expected, caches.layout, batch, config.block_size, tol)
    if diff:
        raise run.fail("cache-write-reference", diff)


def check_forward(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
                  seed: int, without_output: bool = False) -> None:
    """Rule ``forward-reference``, leaving the cache unchanged; ``without_output`` also checks
    the ``output=None`` path (once per backend is enough: it only allocates)."""
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    run.write(impl, scales, batch, layer)
    before = _bits(layer).clone()
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    n = batch.num_tokens
    output = random_like(run.output_shape(batch.query.shape[0]), config.dtype, device, run.gen)
    result = run.forward(impl, scales, batch, layer, output)
    diff = run.output_diff(output[:n], ref, batch)
    if diff:
        raise run.fail("forward-reference", f"forward(..., output=output): {diff}")
    if not torch.equal(_bits(result[:n]), _bits(output[:n])):
        raise run.fail("forward-reference", (
            "forward(..., output=output) returned a tensor whose rows differ from output; "
            "write the result into output and return it"))
    if without_output:
        diff = run.output_diff(run.forward(impl, scales, batch, layer, None)[:n], ref, batch)
        if diff:
            raise run.fail("forward-reference", f"forward(..., output=None): {diff}")
    if not torch.equal(_bits(layer), before):
        changed = int((_bits(layer) != before).sum())
        raise run.fail("forward-reference", (
            f"forward changed {changed} elements of the KV cache; it must only read it"))


def _poison_unowned(kv_cache: torch.Tensor, layout: KVCacheLayout, batch: MixedBatch,
                    block_size: int) -> None:
    """NaN in every slot of ``kv_cache`` outside the requests' first ``seq_len`` tokens: the
    tail of each last block and every block no request owns. An MLA cache has no K/V dim."""
    caches = _split_kv(kv_cache, layout) if "2" in layout.layer_dim_names else (kv_cache,)
    owned = torch.zeros(caches[0].shape[:2], dtype=torch.bool)
    for blocks, q_len, ctx in zip(batch.block_tables, batch.query_lens, batch.context_lens,
                                  strict=True):
        for pos in range(ctx + q_len):
            owned[int(blocks[pos // block_size]), pos % block_size] = True
    stale = ~owned.to(kv_cache.device)
    for cache in caches:
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            cache.view(torch.uint8)[stale] = 0x7F  # NaN in both fp8 formats
        else:
            cache[stale] = float("nan")


def check_stale_bytes(backend: type[AttentionBackend], config: CaseConfig,
                      device: torch.device, seed: int) -> None:
    """Rule ``stale-bytes-masked``: ``forward`` over a cache whose unowned slots hold NaN
    gives the output it gave before they were poisoned (or, for a kernel whose bits vary
    between runs, one that still matches the reference). A plain numeric error is
    ``forward-reference``'s: it gives the same output with and without the poison."""
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    run.write(impl, scales, batch, layer)
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    n = batch.num_tokens
    clean = run.forward(impl, scales, batch, layer, None)[:n].clone()
    _poison_unowned(layer, caches.layout, batch, config.block_size)
    out = run.forward(impl, scales, batch, layer, None)[:n]
    changed = _bits(out) != _bits(clean)
    if not changed.any() or run.output_diff(out, ref, batch) is None:
        return
    token, head, dim = changed.nonzero()[0].tolist()
    raise run.fail("stale-bytes-masked", (
        "with NaN in every cache slot the batch does not own (the tail of each request's last "
        f"block, blocks no request owns), {int(changed.sum())} of {changed.numel()} output "
        f"elements changed from this backend's output before the poisoning "
        f"({int((~torch.isfinite(out)).sum())} non-finite): forward read slots it does not "
        f"own. First at {batch.locate(token)}, head {head}, dim {dim}: got "
        f"{out[token, head, dim].item():.6g}, {clean[token, head, dim].item():.6g} before"
        f"\n{batch.describe()}"))


def check_batch_invariant(backend: type[AttentionBackend], config: CaseConfig,
                          device: torch.device, seed: int) -> None:
    """Rule ``batch-invariant``: each request alone gives the bits it gets in the batch."""
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    _, layer, scales, impl = run.setup_layer(batch.num_blocks)
    run.write(impl, scales, batch, layer)
    together = run.forward(impl, scales, batch, layer, None)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        alone = MixedBatch(
            query=batch.query[start:start + q_len], key=batch.key[start:start + q_len],
            value=batch.value[start:start + q_len],
            metadata=build_attention_metadata([q_len], [ctx], [batch.block_tables[i]],
                                              config.block_size, device=device,
                                              causal=config.causal),
            query_lens=[q_len], context_lens=[ctx], block_tables=[batch.block_tables[i]],
            kinds=[batch.kinds[i]], num_blocks=batch.num_blocks)
        single = run.forward(impl, scales, alone, layer, None)
        if not torch.equal(_bits(single), _bits(together[start:start + q_len])):
            raise run.fail("batch-invariant", (
                f"request {i} ({batch.kinds[i]}) alone differs from the same request in the "
                f"batch (max difference "
                f"{(single.double() - together[start:start + q_len].double()).abs().max():.3g})"
                f"\n{batch.describe()}"))
        start += q_len


def check_cross_layer(backend: type[AttentionBackend], config: CaseConfig,
                      device: torch.device, seed: int) -> None:
    """Rules ``cross-layer-untouched-neighbours`` and ``cross-layer-bit-exact``.

    The middle layer of a 3-layer cross-layer allocation (its pages strided by three pages,
    non-zero storage offset, random neighbours) against a contiguous single-layer copy.
    """
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    cross = run.allocate(batch.num_blocks, num_layers=3, cross_layer=True)
    plain = run.allocate(batch.num_blocks, fill=False)
    layer, contiguous = cross.layers[1], plain.layers[0]
    contiguous.copy_(layer)
    neighbours = {i: cross.block_view(i).clone() for i in (0, 2)}
    scales, impl = run.scales(), run.impl()

    def check_neighbours(after: str) -> None:
        for i, snapshot in neighbours.items():
            changed = (cross.block_view(i) != snapshot).any(dim=1).nonzero().flatten().tolist()
            if changed:
                raise run.fail("cross-layer-untouched-neighbours", (
                    f"after {after} on layer 1 of a 3-layer cross-layer cache (layout "
                    f"{cross.layout}, per-layer view strides {tuple(layer.stride())}), layer {i} "
                    f"changed in blocks {changed[:10]}{' ...' if len(changed) > 10 else ''}: "
                    "the kernel computed addresses from the sizes instead of the view's strides"
                    f"\n{batch.describe()}"))

    run.write(impl, scales, batch, layer)
    run.write(impl, scales, batch, contiguous)
    check_neighbours("do_kv_cache_update")
    if not torch.equal(_bits(layer), _bits(contiguous)):
        changed = int((_bits(layer) != _bits(contiguous)).sum())
        raise run.fail("cross-layer-bit-exact", (
            f"do_kv_cache_update wrote {changed} elements differently on layer 1 of a 3-layer "
            f"cross-layer cache (layout {cross.layout}, strides {tuple(layer.stride())}) than "
            f"on a contiguous cache (strides {tuple(contiguous.stride())})\n{batch.describe()}"))
    n = batch.num_tokens
    out_cross = run.forward(impl, scales, batch, layer, None)[:n]
    out_plain = run.forward(impl, scales, batch, contiguous, None)[:n]
    check_neighbours("forward")
    if not torch.equal(_bits(out_cross), _bits(out_plain)):
        bad = (_bits(out_cross) != _bits(out_plain)).nonzero()[0].tolist()
        raise run.fail("cross-layer-bit-exact", (
            f"forward on layer 1 of a 3-layer cross-layer cache (layout {cross.layout}, page "
            f"stride {layer.stride(0)} elements) differs from forward on a contiguous cache "
            f"(page stride {contiguous.stride(0)}), first at {batch.locate(bad[0])}, head "
            f"{bad[1]}: got {out_cross[tuple(bad)].item():.6g}, contiguous gives "
            f"{out_plain[tuple(bad)].item():.6g}; the kernel must take the page stride from "
            f"the tensor\n{batch.describe()}"))


#: Element count the int64 check's cache exceeds.
INT32_LIMIT = 2**31


def check_int64_offsets(backend: type[AttentionBackend], config: CaseConfig,
                        device: torch.device, seed: int) -> str | None:
    """Rule ``int64-offsets`` on a GPU. Returns a reason to skip (too little memory) or ``None``.

    One layer of more than 2**31 elements; one request in the last blocks, one in the first.
    """
    limit = backend.MAX_KV_CACHE_SPAN
    if limit is not None and limit <= INT32_LIMIT:
        return (f"{backend_label(backend)} declares MAX_KV_CACHE_SPAN={limit}: "
                "kvcore.allocate_kv_caches refuses larger caches instead of addressing them")
    run = _run(backend, config, device, seed)
    bs = config.block_size
    page = run.page_elements()
    num_blocks = INT32_LIMIT // page + 4
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    need = num_blocks * page * (1 if config.is_fp8 else itemsize)
    free, _ = torch.cuda.mem_get_info(device)
    if need * 1.25 > free:
        return f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free"
    high = [num_blocks - 3, num_blocks - 2, num_blocks - 1]
    low = [0, 1]
    q_lens, tables = [2 * bs + 3, bs + 1], [high, low]
    meta = build_attention_metadata(q_lens, [0, 0], tables, bs, device=device)
    query, key, value = run.tokens(meta.num_actual_tokens)
    batch = MixedBatch(
        query=query, key=key, value=value, metadata=meta, query_lens=q_lens,
        context_lens=[0, 0], block_tables=tables,
        kinds=["prefill in the last blocks", "prefill in the first blocks"],
        num_blocks=num_blocks)
    caches, layer, scales, impl = run.setup_layer(num_blocks, fill=False)
    run.write(impl, scales, batch, layer)
    out = run.forward(impl, scales, batch, layer, None)
    # The same requests on a compact cache holding only the five used blocks, renumbered.
    used = torch.tensor(high + low, device=device)
    block_dim = caches.layout.layer_dim_names.index("B")
    compact_meta = build_attention_metadata(q_lens, [0, 0], [[0, 1, 2], [3, 4]], bs,
                                            device=device)
    compact = torch.zeros_like(layer.index_select(block_dim, used))
    run.reference_write(batch, compact, caches.layout, scales, compact_meta.slot_mapping)
    if not torch.equal(_bits(layer.index_select(block_dim, used)), _bits(compact)):
        raise run.fail("int64-offsets", (
            f"do_kv_cache_update into blocks {high} of a {num_blocks}-block cache "
            f"({num_blocks * page} elements > 2**31) did not store what the reference stores; "
            "some offset was computed in int32"))
    ref_batch = dataclasses.replace(batch, metadata=compact_meta,
                                    block_tables=[[0, 1, 2], [3, 4]], num_blocks=5)
    ref = run.reference_forward(ref_batch, compact, caches.layout, scales)
    diff = run.output_diff(out, ref, batch)
    if diff:
        raise run.fail("int64-offsets", (
            f"forward over blocks {high} of a {num_blocks}-block cache ({num_blocks * page} "
            f"elements > 2**31) is wrong: {diff}"))
    return None


# -- the engine step: builders and CUDA graphs ------------------------------------------------

#: Maxima the conformance builders are made with (the steps below stay within them).
_BUILDER_MAX_SEQS = 8
_BUILDER_MAX_TOKENS = 128


def _make_builder(run: _Run, max_model_len: int) -> AttentionMetadataBuilder:
    config = run.config
    spec: KVCacheSpec
    if isinstance(run, _MLARun):
        spec = MLAAttentionSpec(block_size=config.block_size, dtype=config.dtype,
                                kv_cache_dtype=config.kv_cache_dtype,
                                kv_lora_rank=run.dims.kv_lora_rank,
                                qk_rope_head_dim=run.dims.qk_rope_head_dim)
    else:
        spec = FullAttentionSpec(block_size=config.block_size, dtype=config.dtype,
                                 kv_cache_dtype=config.kv_cache_dtype,
                                 num_kv_heads=NUM_KV_HEADS, head_size=config.head_size)
    builder_cls = run.call("get_builder_cls()", run.backend.get_builder_cls)
    return run.call("constructing the builder", builder_cls, spec, num_heads=NUM_HEADS,
                    max_num_seqs=_BUILDER_MAX_SEQS, max_num_batched_tokens=_BUILDER_MAX_TOKENS,
                    max_model_len=max_model_len, device=run.device)


def _decode_batch(run: _Run, num_blocks: int, context_lens: list[int]) -> MixedBatch:
    """Decode requests with the given cached lengths over random distinct blocks of a cache
    of ``num_blocks``."""
    config, device = run.config, run.device
    bs = config.block_size
    tables = random_block_tables([c + 1 for c in context_lens], bs, num_blocks, run.gen)
    n = len(context_lens)
    meta = build_attention_metadata([1] * n, context_lens, tables, bs, device=device,
                                    causal=config.causal)
    query, key, value = run.tokens(n)
    return MixedBatch(
        query=query, key=key, value=value, metadata=meta, query_lens=[1] * n,
        context_lens=list(context_lens), block_tables=tables, kinds=["decode"] * n,
        num_blocks=num_blocks)


def _step_through(run: _Run, impl: AttentionImpl, scales: LayerScales, batch: MixedBatch,
                  layer: torch.Tensor, caches: KVCaches, meta: AttentionMetadata, what: str,
                  rule: str) -> torch.Tensor:
    """Write and attend ``batch`` with ``meta`` (a builder's); compare with the reference."""
    run.call("do_kv_cache_update", impl.do_kv_cache_update, scales, batch.key, batch.value,
             layer, meta.slot_mapping)
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    n = batch.num_tokens
    rows = batch.query.shape[0]
    try:
        out = impl.forward(scales, batch.query, batch.key, batch.value, layer, meta,
                           output=random_like(run.output_shape(rows), run.config.dtype,
                                              run.device, run.gen))
    except Exception as exc:  # the same impl ran the plain metadata in the other checks
        raise run.fail(rule, f"forward with builder.build()'s metadata for {what} raised "
                             f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.shape[0] != rows:
        raise run.fail(rule, f"forward with the builder's metadata for {what} returned "
                             f"{_shape_text(out)}")
    diff = run.output_diff(out[:n], ref, batch)
    if diff:
        raise run.fail(rule, f"forward with builder.build()'s metadata for {what}: {diff}")
    return out


def check_builder(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
                  seed: int) -> None:
    """Rule ``builder-reference``: one builder, three steps of different shapes (the mixed
    batch, three decodes, the mixed batch again), each through ``build()`` and ``forward``."""
    run = _run(backend, config, device, seed)
    batch = run.make_batch()
    bs = config.block_size
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    builder = _make_builder(run, max_model_len=8 * bs)
    decode = _decode_batch(run, batch.num_blocks, [2 * bs + 2, bs - 3, 3])
    for what, step in (("the mixed batch", batch), ("a decode-only batch after it", decode),
                       ("the mixed batch again", batch)):
        meta = run.call("builder.build", builder.build, step.metadata)
        if not isinstance(meta, AttentionMetadata):
            raise run.fail("builder-reference", (
                f"builder.build() returned {type(meta).__name__} for {what}; it must return "
                "an AttentionMetadata (or a subclass) that every layer's forward accepts"))
        _step_through(run, impl, scales, step, layer, caches, meta, what, "builder-reference")


def _tensor_fields(value: object, prefix: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    found: dict[str, torch.Tensor] = {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            found.update(_tensor_fields(getattr(value, f.name), f"{prefix}.{f.name}"))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            found.update(_tensor_fields(v, f"{prefix}[{i}]"))
    return found


#: The graph checks' batch size and cache blocks.
_GRAPH_SIZE = 4
_GRAPH_NUM_BLOCKS = 12


def _graph_builder(run: _Run) -> PersistentMetadataBuilder:
    # A long max_model_len: split-KV backends then split graph steps whose requests are much
    # shorter, leaving some splits empty.
    builder = _make_builder(run, max_model_len=64 * run.config.block_size)
    if not isinstance(builder, PersistentMetadataBuilder):
        raise run.fail("builder-persistent-buffers", (
            f"CUDA_GRAPH_SUPPORT = {run.backend.CUDA_GRAPH_SUPPORT.name} but get_builder_cls() "
            f"returns {type(builder).__name__}, which keeps no persistent buffers: subclass "
            "kvcore.PersistentMetadataBuilder, or declare CudaGraphSupport.NEVER"))
    return builder


def _graph_steps(run: _Run) -> Iterator[MixedBatch]:
    """The graph checks' two uniform-decode steps for one graph size, with other lengths and
    block tables (made one at a time, as the check consumes them)."""
    bs = run.config.block_size
    for context_lens in ([2 * bs + 2, bs - 3, 3], [5 * bs, 1]):
        yield _decode_batch(run, _GRAPH_NUM_BLOCKS, context_lens)


def check_builder_buffers(backend: type[AttentionBackend], config: CaseConfig,
                          device: torch.device, seed: int) -> None:
    """Rule ``builder-persistent-buffers``: two uniform-decode steps of different lengths and
    block tables built for one graph size give the same tensors (addresses, shapes, strides)
    and host values, and each, padded, gives the reference's rows."""
    run = _run(backend, config, device, seed)
    builder = _graph_builder(run)
    caches, layer, scales, impl = run.setup_layer(_GRAPH_NUM_BLOCKS)
    size = _GRAPH_SIZE
    seen: list[tuple[dict[str, tuple], dict[str, object]]] = []
    for step in _graph_steps(run):
        meta = run.call(f"builder.build(common, graph_batch_size={size})", builder.build,
                        step.metadata, graph_batch_size=size)
        tensors = {name: (t.data_ptr(), tuple(t.shape), t.stride())
                   for name, t in _tensor_fields(meta, "metadata").items()}
        host = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)
                if not _tensor_fields(getattr(meta, f.name), "")}
        seen.append((tensors, host))
        padded = _pad_batch(step, size)
        _step_through(run, impl, scales, padded, layer, caches, meta,
                      f"a decode step of {len(step.context_lens)} requests padded to {size}",
                      "builder-persistent-buffers")
    (first, host1), (second, host2) = seen
    if first != second:
        moved = sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k))
        raise run.fail("builder-persistent-buffers", (
            f"two steps built for graph_batch_size={size} differ in {', '.join(moved)} "
            f"({[first.get(k) for k in moved]} vs {[second.get(k) for k in moved]}, as "
            "(address, shape, strides)): a captured graph would read stale memory"))
    if host1 != host2:
        moved = sorted(k for k in host1 if host1[k] != host2.get(k))
        raise run.fail("builder-persistent-buffers", (
            f"two steps built for graph_batch_size={size} differ in the host values "
            f"{', '.join(f'{k}={host1[k]!r} vs {host2.get(k)!r}' for k in moved)}: what a "
            "forward reads on the host is frozen into a captured graph"))


def _pad_batch(step: MixedBatch, size: int) -> MixedBatch:
    """``step`` with zero input rows up to ``size`` (the padding requests' rows); its metadata
    stays the real step's, so the reference and the comparison cover the real rows."""
    n = step.query.shape[0]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.zeros((size - n, *t.shape[1:]), dtype=t.dtype,
                                         device=t.device)])

    return MixedBatch(pad(step.query), pad(step.key), pad(step.value), step.metadata,
                      step.query_lens, step.context_lens, step.block_tables, step.kinds,
                      step.num_blocks)


def check_cuda_graph_replay(backend: type[AttentionBackend], config: CaseConfig,
                            device: torch.device, seed: int) -> None:
    """Rule ``cuda-graph-replay`` (a GPU): a layer's write + forward captured once for 4
    requests, replayed for two later steps with other lengths and block tables, equals the
    same step run eagerly (bit for bit) and the reference."""
    from kvcore.cuda_graphs import CudaGraphRunner

    run = _run(backend, config, device, seed)
    builder = _graph_builder(run)
    caches, layer, scales, impl = run.setup_layer(_GRAPH_NUM_BLOCKS)
    size = _GRAPH_SIZE

    def step_fn(inputs: dict[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        impl.do_kv_cache_update(scales, inputs["key"], inputs["value"], layer,
                                meta.slot_mapping)
        out = inputs["query"].new_empty(run.output_shape(inputs["query"].shape[0]))
        return impl.forward(scales, inputs["query"], inputs["key"], inputs["value"], layer,
                            meta, output=out)

    runner = CudaGraphRunner(builder, step_fn, num_blocks=_GRAPH_NUM_BLOCKS,
                             batch_sizes=[size])
    examples = dict(zip(("query", "key", "value"), (t.zero_() for t in run.tokens(1)),
                        strict=True))
    run.call("capturing a decode step (CudaGraphRunner.capture)", runner.capture, examples)
    for step in _graph_steps(run):
        inputs = {"query": step.query, "key": step.key, "value": step.value}
        replayed = run.call("a replay (CudaGraphRunner.run)", runner.run, inputs,
                            step.metadata).clone()
        if runner.replayed_steps == 0:
            raise run.fail("cuda-graph-replay", "CudaGraphRunner.run did not replay a "
                                                "uniform-decode step of a captured size")
        # The same step eagerly, on the same padded metadata (the write is idempotent).
        meta = builder.build(step.metadata, graph_batch_size=size)
        padded = _pad_batch(step, size)
        n = len(step.context_lens)
        eager = _step_through(run, impl, scales, padded, layer, caches, meta,
                              f"{n} decode requests padded to {size}", "cuda-graph-replay")
        if not torch.equal(_bits(replayed), _bits(eager[:n])):
            worst = (replayed.double() - eager[:n].double()).abs().max().item()
            raise run.fail("cuda-graph-replay", (
                f"the step replayed from a CUDA graph captured for {size} requests differs "
                f"from the same step run eagerly (max difference {worst:.3g}) after the "
                f"builder was rebuilt for {step.describe()}: forward reads something the "
                "builder does not update in place, or decides on the host"))
