"""Plugin loading: entry-point discovery, fault isolation, allowlist and autoload switch.

Every plugin, the core's own backends and platforms included, arrives through the
``kvcore.plugins`` entry-point group and registers through the hooks in
:mod:`kvcore.hookspecs`. A plugin that fails to import or register is isolated: it is recorded
with its error (shown by ``kvcore plugins`` and in selection reasons) and everything else
keeps working.

Environment:
    ``KVCORE_PLUGINS``: comma-separated entry-point or distribution names; when set, only these
        third-party plugins load (the core's own always do).
    ``KVCORE_DISABLE_PLUGIN_AUTOLOAD``: ``1`` loads no third-party plugin from entry points.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata

import pluggy

from kvcore import hookspecs

__all__ = [
    "ENTRY_POINT_GROUP",
    "CORE_DISTRIBUTION",
    "PluginInfo",
    "get_plugin_manager",
    "is_core_plugin",
    "list_plugins",
    "register_plugin",
    "unregister_plugin",
    "reset_plugins",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvcore.plugins"
CORE_DISTRIBUTION = "kvcore"
# Registered directly only when kvcore runs from a source tree without being installed (no
# entry points exist then); an installed kvcore declares the same modules as entry points.
_CORE_MODULES = {"builtin_backends": "kvcore.backends", "builtin_platforms": "kvcore.platforms",
                 "builtin_connectors": "kvcore.connectors.builtin"}


@dataclass
class PluginInfo:
    """One plugin as ``kvcore plugins`` reports it.

    ``status`` is ``"loaded"``, ``"failed"`` (``error`` says why), ``"disabled"``
    (``KVCORE_DISABLE_PLUGIN_AUTOLOAD``) or ``"not allowed"`` (not in ``KVCORE_PLUGINS``).
    """

    name: str
    distribution: str | None
    version: str | None
    module: str
    source: str  # "entry point", "core", or "runtime" (register_plugin)
    status: str
    error: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return dict(self.__dict__)


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_infos: list[PluginInfo] = []
_generation = 0


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _allowlist() -> set[str] | None:
    raw = os.environ.get("KVCORE_PLUGINS")
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _register_checked(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin`` as ``name``, or raise (leaving ``pm`` as it was) when its hooks do
    not match the specs."""
    pm.register(plugin, name=name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        pm.unregister(name=name)
        raise


def _register_module(
    pm: pluggy.PluginManager, name: str, load, info: PluginInfo
) -> None:
    """Import and register one plugin, recording any failure on ``info`` instead of raising."""
    try:
        plugin = load()
        if pm.has_plugin(name):
            other = next((i for i in _infos if i.name == name and i.status == "loaded"), None)
            raise ValueError(
                f"plugin name {name!r} is already used by "
                f"{other.distribution if other else 'another plugin'}; rename one entry point"
            )
        _register_checked(pm, plugin, name)
    except (Exception, SystemExit) as exc:  # isolate any failure of third-party code
        info.status = "failed"
        info.error = f"{type(exc).__name__}: {exc}"
        logger.warning("kvcore plugin %r (%s) failed to load: %s", name, info.module, info.error)
    _infos.append(info)


def _load(pm: pluggy.PluginManager) -> None:
    allow = _allowlist()
    autoload = not _truthy(os.environ.get("KVCORE_DISABLE_PLUGIN_AUTOLOAD"))
    seen_core = False
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.metadata["Name"] if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        is_core = dist is not None and dist.lower() == CORE_DISTRIBUTION
        seen_core |= is_core
        info = PluginInfo(ep.name, dist, version, ep.value,
                          "core" if is_core else "entry point", "loaded")
        if not is_core and not autoload:
            info.status = "disabled"
            _infos.append(info)
            continue
        if not is_core and allow is not None and ep.name not in allow and dist not in allow:
            info.status = "not allowed"
            _infos.append(info)
            continue
        _register_module(pm, ep.name, ep.load, info)
    if allow is not None and autoload:
        known = {i.name for i in _infos if i.source != "core"} | {
            i.distribution for i in _infos if i.source != "core" and i.distribution}
        unknown = sorted(allow - known)
        if unknown:
            names = ", ".join(sorted(i.name for i in _infos if i.source != "core")) or "none"
            logger.warning(
                "KVCORE_PLUGINS names %s, which no installed plugin matches (entry-point or "
                "distribution name); installed plugins: %s", ", ".join(map(repr, unknown)), names)
    if not seen_core:
        logger.debug("kvcore is not installed; registering its built-in plugins directly")
        for name, module in _CORE_MODULES.items():
            info = PluginInfo(name, CORE_DISTRIBUTION, None, module, "core", "loaded")
            _register_module(pm, name, lambda m=module: importlib.import_module(m), info)


def is_core_plugin(name: str) -> bool:
    """Whether ``name`` is one of kvcore's own plugins (whose registered names are protected)."""
    return name in _CORE_MODULES or any(
        i.name == name and i.source == "core" for i in _infos)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading plugins on first use."""
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            _infos.clear()
            _manager = pm
            _load(pm)
        return _manager


def plugin_generation() -> int:
    """Bumped whenever the set of plugins changes.

    What was built from the plugins (registries, platform instances, cached selections)
    compares it with the generation it was built under and rebuilds when it moved.
    """
    return _generation


def list_plugins() -> list[PluginInfo]:
    """Every plugin seen: loaded, failed, disabled or not allowed."""
    get_plugin_manager()
    return list(_infos)


def register_plugin(plugin: object, name: str) -> None:
    """Register a plugin object at run time (an engine's private backends, tests).

    Raises ``ValueError`` if ``name`` is taken or the plugin's hooks do not match the specs.
    """
    global _generation
    pm = get_plugin_manager()
    with _lock:
        if pm.has_plugin(name):
            raise ValueError(f"a kvcore plugin named {name!r} is already registered")
        _register_checked(pm, plugin, name)
        _infos.append(PluginInfo(name, None, None, getattr(plugin, "__name__", repr(plugin)),
                                 "runtime", "loaded"))
        _generation += 1


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with :func:`register_plugin` (or any loaded one)."""
    global _generation
    pm = get_plugin_manager()
    with _lock:
        if not pm.has_plugin(name):
            raise ValueError(f"no kvcore plugin named {name!r} is registered")
        pm.unregister(name=name)
        _infos[:] = [i for i in _infos if i.name != name]
        _generation += 1


def reset_plugins() -> None:
    """Forget every plugin; the next use reloads from entry points (honouring the env vars)."""
    global _manager, _generation
    with _lock:
        _manager = None
        _infos.clear()
        _generation += 1
