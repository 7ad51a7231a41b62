"""Lazy ``"module:Class"`` registries of backends, platforms and connectors.

Plugins register names and import paths through the hooks; a class is imported only when it
is resolved (chosen, listed in detail, or forced). A backend may also register the platforms
it runs on (``register(NAME, "module:Class", platforms=("cuda",))``): the selector then
decides platform fit without importing it, so selection on another platform never imports
the module. Each plugin's registration hook runs on its own, so one plugin that raises loses
only its own entries. Two plugins registering one name is a conflict: the name then resolves
to an error naming both plugins. A class that fails to load (its import raises, even
``SystemExit``, or its declarations are invalid) is an error of that name only, recorded in
:attr:`Registry.errors` for ``kvcore plugins``.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import plugins
from kvcore.backend import AttentionBackend
from kvcore.layout import KVCacheLayout

__all__ = [
    "Registration",
    "Registry",
    "RegistryError",
    "UnknownNameError",
    "DuplicateRegistrationError",
    "ResolveError",
    "backend_registry",
    "platform_registry",
    "connector_registry",
    "plugin_status_reports",
    "resolve_backend",
    "backend_platforms",
]

logger = logging.getLogger(__name__)

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RegistryError(ValueError):
    """Base of the registry's errors."""


class UnknownNameError(RegistryError):
    """A name no plugin registered; the message lists the valid options."""


class DuplicateRegistrationError(RegistryError):
    """Two plugins registered the same name; the message names both."""


class ResolveError(RegistryError):
    """A registered ``module:Class`` could not be imported or is not the right kind of class."""


@dataclass(frozen=True)
class Registration:
    """One registered name: where its class lives and which plugin registered it."""

    kind: str
    name: str
    target: str
    plugin: str
    conflicts_with: tuple[str, ...] = ()
    #: A backend's platforms as registered (``None``: not declared, known only after import).
    platforms: tuple[str, ...] | None = None


@dataclass
class Registry:
    """Names of one kind (backend, platform, connector) mapped to lazy class paths."""

    kind: str
    hook_name: str
    upper_case: bool
    entries: dict[str, Registration] = field(default_factory=dict)
    #: (plugin, error) for registration hooks that raised or registered something invalid,
    #: and for registered classes that failed to load (import or declarations).
    errors: list[tuple[str, str]] = field(default_factory=list)
    _classes: dict[str, Any] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def normalize(self, name: str) -> str:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"{self.kind} name must be a non-empty string, got {name!r}")
        name = name.strip()
        return name.upper() if self.upper_case else name.lower()

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(name.strip()) and self.normalize(name) in self.entries

    def get(self, name: str) -> Registration:
        """The registration of ``name``; :class:`UnknownNameError` listing valid names if none."""
        key = self.normalize(name)
        if key not in self.entries:
            valid = ", ".join(self.names()) or "(none registered)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid options are: {valid}")
        return self.entries[key]

    def resolve(self, name: str) -> Any:
        """Import and return the class registered as ``name`` (cached)."""
        reg = self.get(name)
        if reg.conflicts_with:
            plugins_ = ", ".join(repr(p) for p in (reg.plugin, *reg.conflicts_with))
            raise DuplicateRegistrationError(
                f"{self.kind} {reg.name!r} is registered by more than one plugin ({plugins_}); "
                f"uninstall one or exclude it with KVCORE_PLUGINS"
            )
        with self._lock:
            if reg.name in self._classes:
                return self._classes[reg.name]
            module_name, _, attr = reg.target.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except (Exception, SystemExit) as exc:  # a plugin module may even sys.exit()
                raise self.load_error(reg, ResolveError(
                    f"{self.kind} {reg.name!r} (plugin {reg.plugin!r}) failed to import from "
                    f"{reg.target!r}: {type(exc).__name__}: {exc}"
                )) from exc
            self._classes[reg.name] = obj
            return obj

    def load_error(self, reg: Registration, error: ResolveError) -> ResolveError:
        """Record ``error`` (a class of ``reg`` that cannot be used) once in :attr:`errors`,
        for ``kvcore plugins``, and return it."""
        with self._lock:
            entry = (reg.plugin, str(error))
            if entry not in self.errors:
                self.errors.append(entry)
        return error

    def _add(self, name: str, target: str, plugin: str, pending: dict[str, Registration],
             platforms: Any = None) -> None:
        key = self.normalize(name)
        if not isinstance(target, str) or not _TARGET.match(target):
            raise ValueError(
                f"{self.kind} {name!r}: target {target!r} must be a 'package.module:ClassName' "
                "string (registration is lazy: pass the path, not the class)"
            )
        if platforms is not None:
            if self.kind != "attention backend":
                raise ValueError(f"{self.kind} {name!r}: platforms= is declared by attention "
                                 "backends only; leave it out")
            platforms = _platform_names(platforms, f"{self.kind} {name!r}: platforms",
                                        empty=False)
        if key in pending:
            raise ValueError(f"{self.kind} {key!r} is registered twice by plugin {plugin!r}")
        pending[key] = Registration(self.kind, key, target, plugin, platforms=platforms)

    def _collect(self, pm) -> None:
        hook = getattr(pm.hook, self.hook_name)
        for impl in hook.get_hookimpls():  # registration order
            pending: dict[str, Registration] = {}

            def register(name: str, target: str, *, platforms: Any = None,
                         _p=impl.plugin_name, _pending=pending) -> None:
                self._add(name, target, _p, _pending, platforms)

            try:
                impl.function(register=register)
            except Exception as exc:  # isolate a failing plugin
                message = f"{type(exc).__name__}: {exc}"
                self.errors.append((impl.plugin_name, message))
                logger.warning("plugin %r failed in %s: %s", impl.plugin_name, self.hook_name,
                               message)
                continue
            for key, reg in pending.items():
                existing = self.entries.get(key)
                if existing is None:
                    self.entries[key] = reg
                    continue
                new_core, old_core = plugins.is_core_plugin(reg.plugin), plugins.is_core_plugin(
                    existing.plugin)
                if new_core != old_core:
                    # A core name is protected: the other plugin's registration is the error,
                    # whichever ran first, and the core's entry stays usable.
                    core, other = (reg, existing) if new_core else (existing, reg)
                    self.entries[key] = core
                    self.errors.append((
                        other.plugin,
                        f"{self.kind} {key!r} is a built-in name of kvcore (plugin "
                        f"{core.plugin!r}); plugin {other.plugin!r} may not register it again: "
                        "register the backend under another name",
                    ))
                    logger.warning("plugin %r: %s", other.plugin, self.errors[-1][1])
                    continue
                self.entries[key] = Registration(
                    existing.kind, key, existing.target, existing.plugin,
                    (*existing.conflicts_with, reg.plugin), existing.platforms,
                )
                self.errors.append((
                    reg.plugin,
                    f"{self.kind} {key!r} is also registered by plugin {existing.plugin!r}",
                ))


def _platform_names(value: Any, what: str, *, empty: bool = True) -> tuple[str, ...]:
    """``value`` as a tuple of platform names, or a ``ValueError`` saying what it must be."""
    if not isinstance(value, (tuple, list)) or not (value or empty) or not all(
            isinstance(p, str) and p and p == p.strip().lower() for p in value):
        raise ValueError(f"{what}={value!r} must be a {'' if empty else 'non-empty '}tuple of "
                         "lower-case platform names, e.g. ('cuda', 'rocm')")
    return tuple(value)


_KINDS = {
    "backend": ("attention backend", "kvcore_register_backends", True),
    "platform": ("platform", "kvcore_register_platforms", False),
    "connector": ("KV connector", "kvcore_register_connectors", False),
    "block_copier": ("block copier", "kvcore_register_block_copiers", False),
    "kernel_compile_cases": ("kernel compile cases", "kvcore_register_kernel_compile_cases",
                             False),
    "status_report": ("status report", "kvcore_register_status_reports", False),
}
_registries: dict[str, Registry] = {}
_registries_generation = -1
_build_lock = threading.RLock()


def _registry(kind: str) -> Registry:
    global _registries_generation
    with _build_lock:
        # Generation first: a plugin change between the two reads then only causes a
        # rebuild on the next call, never a registry from the old manager kept as current.
        generation = plugins.plugin_generation()
        pm = plugins.get_plugin_manager()
        if generation != _registries_generation:
            _registries.clear()
            _registries_generation = generation
        if kind not in _registries:
            label, hook_name, upper = _KINDS[kind]
            registry = Registry(label, hook_name, upper)
            registry._collect(pm)
            _registries[kind] = registry
        return _registries[kind]


def backend_registry() -> Registry:
    return _registry("backend")


def platform_registry() -> Registry:
    return _registry("platform")


def connector_registry() -> Registry:
    return _registry("connector")


def block_copier_registry() -> Registry:
    return _registry("block_copier")


def kernel_compile_case_registry() -> Registry:
    """Case providers of the Triton compile check (:mod:`kvcore.testing.compile_check`)."""
    return _registry("kernel_compile_cases")


def status_report_registry() -> Registry:
    """Plugins' self-reports for ``kvcore plugins`` / ``kvcore collect-env``."""
    return _registry("status_report")


def plugin_status_reports() -> dict[str, dict[str, str]]:
    """Every registered status report, ``{name: {fact: value}}``, in name order.

    A report that fails to import or raises becomes ``{"error": "..."}``: one plugin's fault
    never hides the others'.
    """
    registry = status_report_registry()
    reports: dict[str, dict[str, str]] = {}
    for name in registry.names():
        try:
            facts = registry.resolve(name)()
            reports[name] = {str(k): str(v) for k, v in dict(facts).items()}
        except Exception as exc:  # isolate a failing plugin
            reports[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return reports


def resolve_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` (case-insensitive)."""
    registry = backend_registry()
    cls = registry.resolve(name)
    reg = registry.get(name)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise registry.load_error(reg, ResolveError(
            f"attention backend {reg.name!r} (plugin {reg.plugin!r}) resolves to {cls!r}, "
            "which is not an AttentionBackend subclass"
        ))
    if (cls, reg) in _valid_declarations:
        return cls
    try:
        own_name = cls.get_name()
    except Exception as exc:  # a plugin's code, whatever it raises
        own_name = f"<get_name() raised {type(exc).__name__}: {exc}>"
    if own_name != registry.normalize(name):
        raise registry.load_error(reg, ResolveError(
            f"attention backend registered as {registry.normalize(name)!r} reports "
            f"get_name() == {own_name!r}; the two must match"
        ))
    problem = _declaration_problem(cls, reg) or _layout_problem(cls)
    if problem:
        raise registry.load_error(reg, ResolveError(
            f"attention backend {reg.name!r} (plugin {reg.plugin!r}) declares {problem}"
        ))
    _valid_declarations.add((cls, reg))
    return cls


def backend_platforms(name: str) -> tuple[str, ...]:
    """The platforms backend ``name`` runs on: as registered when the plugin declared them
    (nothing is imported), else its class's ``PLATFORMS`` (imported and checked:
    :class:`RegistryError` if it cannot be loaded)."""
    reg = backend_registry().get(name)
    if reg.platforms is not None:
        return reg.platforms
    return tuple(resolve_backend(name).PLATFORMS)


def _declaration_problem(cls: type[AttentionBackend], reg: Registration) -> str:
    """What is wrong with the declarations selection reads before anything else ("" if
    nothing): the platform lists, which must agree with the registration's."""
    for attr, optional in (("PLATFORMS", False), ("CROSS_LAYER_PLATFORMS", True)):
        value = getattr(cls, attr, None)
        if optional and value is None:
            continue
        try:
            _platform_names(value, attr)
        except ValueError as exc:
            return f"an invalid {attr}: {exc}"
    if reg.platforms is not None and set(reg.platforms) != set(cls.PLATFORMS):
        return (f"PLATFORMS={tuple(cls.PLATFORMS)!r} but was registered with "
                f"platforms={reg.platforms!r}: make the two agree")
    return ""


def _smallest(supported: tuple | None, default: int) -> int:
    """A size the declaration allows: its first int or first ``MultipleOf`` base."""
    if not supported:
        return default
    first = supported[0]
    return first if isinstance(first, int) else first.base


# (class, registration) pairs whose declarations passed the checks (checked once each).
_valid_declarations: set[tuple[type, Registration]] = set()


def _layout_problem(cls: type[AttentionBackend]) -> str:
    """Why ``cls``'s declared shapes and stride orders cannot lay out a cache ("" if they can).

    Builds the per-layer layout, and the cross-layer one when the backend opts in, for small
    sizes it declares: what :func:`kvcore.allocate_kv_caches` would do, so an invalid backend
    is rejected when first resolved instead of selected and then failing at allocation.
    """
    try:
        head_size, block_size = (_smallest(cls.SUPPORTED_HEAD_SIZES, 64),
                                 _smallest(cls.SUPPORTED_BLOCK_SIZES, 16))
        dtype = (cls.SUPPORTED_DTYPES or (torch.bfloat16,))[0]
        for cross in (False, True) if cls.supports_cross_layer() else (False,):
            KVCacheLayout.from_backend(cls, num_blocks=3, block_size=block_size,
                                       num_kv_heads=1, head_size=head_size, dtype=dtype,
                                       num_layers=2, cross_layer=cross)
    except Exception as exc:  # a plugin's declaration, whatever it raises
        return f"an invalid KV cache layout: {type(exc).__name__}: {exc}"
    return ""

