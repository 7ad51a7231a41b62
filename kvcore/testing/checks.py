"""The contract and validation checks of the conformance suite, one function per check, each
raising :class:`ConformanceError`; they need no device.

The numerical checks are :mod:`kvcore.testing.numeric_checks` (allocating through
:func:`kvcore.allocate_kv_caches`, comparing with the float64 references or, for layout
equivalence, with the backend itself bit for bit) and :mod:`kvcore.testing.builder_checks`
(the builder and CUDA-graph promises); :mod:`kvcore.testing.runs` runs a case.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import torch

from kvcore.backend import FEATURE_FLAGS, AttentionBackend, is_supported
from kvcore.config import AttentionSelectorConfig
from kvcore.impl import AttentionImpl
from kvcore.platform_types import AttentionType
from kvcore.testing.rules import ConformanceError

__all__ = [
    "backend_label",
    "check_backend_identity",
    "check_cross_layer_claim",
    "check_kv_connector_claim",
    "check_shape",
    "check_stride_order",
    "check_undeclared_feature_refused",
    "check_validation_accepts",
    "check_validation_refuses",
    "fail",
]


def backend_label(backend: type[AttentionBackend]) -> str:
    """``get_name()``, or the class name when ``get_name`` itself is broken."""
    try:
        name = backend.get_name()
    except Exception:
        return backend.__name__
    return name if isinstance(name, str) and name else backend.__name__


def fail(backend: type[AttentionBackend], rule: str, detail: str) -> ConformanceError:
    return ConformanceError(backend_label(backend), rule, detail)


_WORD = re.compile(r"[A-Za-z_]+")


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
        raise fail(backend, "backend-identity", "\n".join(problems))


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
                raise fail(backend, "shape-blocks-first", (
                    f"get_kv_cache_shape({nb}, {block_size}, {h}, {head_size}) = {shape} is the "
                    "legacy (2, num_blocks, ...) shape, but supports_kv_connector() is True: "
                    "connectors index dim 0 as the block and would move half-blocks. Return "
                    "the blocks-first shape, or return False from supports_kv_connector()"))
            continue
        raise fail(backend, "shape-blocks-first", (
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
            raise fail(backend, "stride-order-permutation", (
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
        raise fail(backend, "cross-layer-claim", (
            f"get_kv_cache_stride_order(True) = {with_layers} puts logical dim "
            f"{with_layers[0]} outermost; it must start with 0 (layers outermost) or with 1, 0 "
            "(block outermost, then layer)"))
    if with_layers != expected:
        raise fail(backend, "cross-layer-claim", (
            f"get_kv_cache_stride_order(True) = {with_layers} claims {kind}, so with the "
            f"per-layer order {per_layer} it must be {expected}"))
    claimed = backend.supports_cross_layer()
    if claimed != (with_layers[0] == 1):
        raise fail(backend, "cross-layer-claim", (
            f"supports_cross_layer() is {claimed} but get_kv_cache_stride_order(True) = "
            f"{with_layers} says {kind}; derive one from the other"))


def check_kv_connector_claim(backend: type[AttentionBackend], base: dict[str, Any]) -> None:
    """Rule ``kv-connector-claim``; ``base`` holds valid validate_configuration kwargs."""
    per_layer, _, _ = _orders(backend)
    if backend.supports_kv_connector():
        if per_layer[0] != 0:
            raise fail(backend, "kv-connector-claim", (
                f"supports_kv_connector() is True but get_kv_cache_stride_order(False) = "
                f"{per_layer} puts logical dim {per_layer[0]} outermost in memory, so a block "
                "is not one contiguous page; keep the block dim first or opt out of connectors"))
        return
    reason = backend.kv_connector_unsupported_reason()
    if not _is_sentence(reason):
        raise fail(backend, "kv-connector-claim", (
            f"supports_kv_connector() is False but kv_connector_unsupported_reason() returned "
            f"{reason!r}; say why, and which backend to use instead"))
    reasons = backend.validate_configuration(**{**base, "use_kv_connector": True})
    if not any("connector" in r.lower() for r in reasons if isinstance(r, str)):
        raise fail(backend, "kv-connector-claim", (
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
        raise fail(backend, "validation-reasons", (
            f"validate_configuration({_kwargs_text(kwargs)}) raised {type(exc).__name__}: {exc}; "
            "it must return reasons, never raise (a missing kernel library is a reason too)"
        )) from exc
    if not isinstance(reasons, list):
        raise fail(backend, "validation-reasons", (
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
        raise fail(backend, "validation-reasons", (
            f"validate_configuration accepted {what}, which the declared capabilities exclude "
            f"(full call: {_kwargs_text(kwargs)}); derive validation from the declarations"))
    bad = [r for r in reasons if not _is_sentence(r)]
    if bad:
        raise fail(backend, "validation-reasons", (
            f"for {what}, validate_configuration returned reasons that are not one-line "
            f"sentences: {bad!r}"))
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])")
    if not any(pattern.search(r) for r in reasons):
        raise fail(backend, "validation-reasons", (
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
        raise fail(backend, "validation-accepts-declared", (
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
                raise fail(backend, "validation-accepts-declared", (
                    f"validate_configuration({_kwargs_text(base)}) refused a configuration "
                    f"built from the declared capabilities with {reason!r}: {why}; narrow the "
                    "declaration or fix check_combination"))


#: The impl arguments of each feature an impl must refuse unless its backend declares it:
#: ``(config field, capability, AttentionImpl keyword, a value for it given num_heads)``.
IMPL_FEATURES: tuple[tuple[str, str, str, Any], ...] = (
    ("has_sink", "SUPPORTS_SINK", "sinks", lambda heads: torch.zeros(heads)),
    ("has_logits_soft_cap", "SUPPORTS_LOGITS_SOFT_CAP", "logits_soft_cap", lambda heads: 30.0),
)


def check_undeclared_feature_refused(backend: type[AttentionBackend], head_size: int,
                                     flag: str) -> None:
    """Rule ``undeclared-features-refused``: the impl, given the feature of config field
    ``flag`` (sinks, a logit soft-cap) that the backend does not declare, raises at
    construction instead of running without it."""
    _, attr, keyword, value = next(f for f in IMPL_FEATURES if f[0] == flag)
    impl_cls = backend.get_impl_cls()
    try:
        impl_cls(num_heads=8, head_size=head_size, scale=head_size**-0.5, num_kv_heads=2,
                 **{keyword: value(8)})
    except (NotImplementedError, ValueError, TypeError) as exc:
        if not _is_sentence(str(exc)):
            raise fail(backend, "undeclared-features-refused", (
                f"{impl_cls.__name__}({keyword}=...) raised {type(exc).__name__} without a "
                f"message; say that {backend_label(backend)} does not support it")) from exc
        return
    raise fail(backend, "undeclared-features-refused", (
        f"{backend_label(backend)} does not declare {attr}, but {impl_cls.__name__}"
        f"({keyword}=...) was constructed: it would run without the feature and give wrong "
        f"results; refuse it (kvcore.AttentionImpl.__init__ does, for an impl that passes "
        "the keyword on to it) or declare and implement it"))
