"""Pick an attention backend for a platform and config, and explain every rejection.

:func:`get_attn_backend` returns the first valid backend of the platform's priority list (then
any other backend registered for the platform); where ``kvcore tune`` measured this device
for the config (:mod:`kvcore.ranking`), the measured backends come first, fastest first. A
forced backend (argument or ``KVCORE_ATTENTION_BACKEND``) that is unknown or invalid raises
with its reasons: never a silent fallback. :func:`explain_selection` returns every candidate
with its reasons, and :class:`NoValidBackendError` carries the same report in one message.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from kvcore import plugins, ranking
from kvcore.backend import AttentionBackend
from kvcore.config import AttentionSelectorConfig
from kvcore.platform import Platform, current_platform, get_platform
from kvcore.platform_types import DeviceCapability, PhaseRanking
from kvcore.registry import (
    RegistryError,
    UnknownNameError,
    backend_platforms,
    backend_registry,
    resolve_backend,
)

__all__ = [
    "AttentionSelectorConfig",
    "BackendSelectionError",
    "CandidateReport",
    "NoValidBackendError",
    "SelectionReport",
    "clear_selection_cache",
    "explain_selection",
    "get_attn_backend",
]

logger = logging.getLogger(__name__)

#: Measured cases :meth:`SelectionReport.phase_lines` names where another backend was faster.
_FASTER_SHOWN = 4


@dataclass
class CandidateReport:
    """One backend considered for a config: valid, or the reasons it is not."""

    name: str
    plugin: str | None
    reasons: list[str]
    in_priority_list: bool
    selected: bool = False
    #: The backend's ``CUDA_GRAPH_SUPPORT`` value (``None``: the class could not be loaded).
    cuda_graphs: str | None = None
    #: Facts about how the backend runs here that are not rejections (e.g. no cross-layer).
    notes: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "plugin": self.plugin, "valid": self.valid,
                "selected": self.selected, "in_priority_list": self.in_priority_list,
                "cuda_graphs": self.cuda_graphs, "reasons": list(self.reasons),
                "notes": list(self.notes)}


@dataclass
class SelectionReport:
    """Every candidate for a config on a platform, in the order they were tried."""

    config: AttentionSelectorConfig
    platform: str
    simulated: bool
    device_capability: DeviceCapability | None
    candidates: list[CandidateReport] = field(default_factory=list)
    forced: str | None = None
    #: The platform's measured speed per phase for this config (:meth:`Platform.phase_rankings`).
    phase_rankings: tuple[PhaseRanking, ...] = ()
    #: The order the platform ships for this config (:meth:`Platform.shipped_order`), if any.
    shipped: ranking.ShippedOrder | None = None
    #: The order measured on this device by ``kvcore tune`` that the candidates follow, if any.
    measured: ranking.MeasuredOrder | None = None
    #: Why a ranking file that exists does not apply (another device, stale, malformed, ...).
    ranking_notes: list[str] = field(default_factory=list)

    @property
    def selected(self) -> CandidateReport | None:
        return next((c for c in self.candidates if c.selected), None)

    def why_selected(self) -> str | None:
        """Why the selected backend won over the other valid ones (``None`` if none won)."""
        pick = self.selected
        if pick is None:
            return None
        if self.forced:
            return "forced by name (backend argument or KVCORE_ATTENTION_BACKEND), and valid"
        order = ", ".join(c.name for c in self.candidates if c.in_priority_list)
        if self.measured is not None and pick.name in self.measured.order:
            return (f"fastest valid backend measured on this machine on {self.measured.date} "
                    f"(order {', '.join(self.measured.order)}; ranking file "
                    f"{self.measured.path}), ahead of {self.platform}'s static order")
        if pick.in_priority_list:
            if self.shipped is not None and pick.name in self.shipped.order:
                return (f"first valid backend in {self.platform}'s priority list ({order}), "
                        f"in the order measured by {self.shipped.describe()}")
            return f"first valid backend in {self.platform}'s priority list ({order})"
        return (f"no backend in {self.platform}'s priority list ({order}) is valid; first valid "
                f"of the other backends registered for {self.platform}")

    def alternatives(self) -> list[str]:
        """The backends valid for the config here other than the forced one, best first: what
        a refused forced backend could be replaced with."""
        return [c.name for c in self.candidates if c.valid and c.name != self.forced]

    def refusal_lines(self) -> list[str]:
        """A forced backend that cannot run the config: its reasons, then the backends that
        can (``[]`` when nothing was forced or the forced one runs)."""
        if not self.forced or self.selected is not None:
            return []
        forced = next(c for c in self.candidates if c.name == self.forced)
        others = self.alternatives()
        return [f"{self.forced} cannot run this config on {self.platform}:",
                *(f"  - {r}" for r in forced.reasons),
                f"valid for this config on {self.platform}: {', '.join(others)}" if others
                else f"no other backend can run this config on {self.platform} either"]

    def measured_lines(self) -> list[str]:
        """What ``kvcore tune`` measured on this device for this config, per phase, or why a
        ranking file does not apply (``[]``: no ranking file)."""
        lines = [f"note: {n}" for n in self.ranking_notes]
        if self.measured is not None:
            m = self.measured
            lines.append(f"measured on this machine on {m.date} ({m.device.name}; {m.path}):")
            lines.extend(f"  {line}" for line in m.phase_lines())
        return lines

    def phase_lines(self) -> list[str]:
        """The measured order per phase, where the selected backend stands in it, and a note
        when the fastest backends differ between phases (``[]``: nothing measured). A ranking
        measured on this machine (:meth:`measured_lines`) replaces the platform's."""
        if not self.phase_rankings or self.measured is not None:
            return []
        pick = self.selected
        lines = []
        for phase in self.phase_rankings:
            line = f"{phase.phase} (measured): {phase.describe()}"
            if pick is not None:
                rank = phase.rank(pick.name)
                where = ("not measured" if rank is None else "among the fastest" if rank == 0
                         else f"in group {rank + 1} of {len(phase.tiers)}")
                line += f"; selected {pick.name} is {where}"
            lines.append(line)
            if pick is not None:
                lines.extend(self._faster_lines(phase))
        if len({frozenset(r.fastest) for r in self.phase_rankings}) > 1:
            phases = " and ".join(r.phase for r in self.phase_rankings)
            both = set.intersection(*(set(r.fastest) for r in self.phase_rankings))
            lines.append(
                f"note: the fastest backend differs between {phases}"
                + (f" ({', '.join(sorted(both))} among the fastest in each)" if both else "")
                + "; the priority list picks one for every step. Measured on "
                + "; ".join(dict.fromkeys(r.measured for r in self.phase_rankings)))
        return lines

    def _faster(self, phase: PhaseRanking) -> list[dict[str, Any]]:
        """The measured cases of ``phase`` where another valid backend beat the selected one
        by more than a tier's tolerance, the largest gap first (``[]``: none selected)."""
        if self.selected is None:
            return []
        valid = {c.name for c in self.candidates if c.valid}
        return [{"case": what, "backend": backend, "speedup": gain} for what, backend, gain
                in phase.faster_cases(self.selected.name, valid, ranking.TIER_TOLERANCE)]

    def _faster_lines(self, phase: PhaseRanking) -> list[str]:
        """:meth:`_faster` as text (at most :data:`_FASTER_SHOWN` cases)."""
        found = self._faster(phase)
        lines = [f"  {f['backend']} {f['speedup']:.2f}x faster than {self.selected.name} on "
                 f"{f['case']}" for f in found[:_FASTER_SHOWN]]
        if len(found) > _FASTER_SHOWN:
            lines.append(f"  ... and {len(found) - _FASTER_SHOWN} more such "
                         f"case{'s' if len(found) - _FASTER_SHOWN != 1 else ''}")
        if lines and self.config.num_kv_heads is None:
            lines.append("  (the order averages over every head count measured; "
                         "--num-heads/--num-kv-heads narrow it to the model's, --backend "
                         "picks another where those shapes are the model's)")
        elif lines:
            lines.append("  (the order averages over the phase's shapes; --backend picks "
                         "another where those shapes are the model's)")
        return lines

    def format(self) -> str:
        """Flat, greppable text: the pick and why, then each candidate with its reasons."""
        capability = self.device_capability or "n/a"
        header = f"platform: {self.platform} (device capability {capability})"
        if self.simulated:
            header += " [simulated]"
        lines = [header, f"config: {self.config.describe()}"]
        if self.forced:
            lines.append(f"forced backend: {self.forced}")
            lines.extend(self.refusal_lines())  # a refused one's reasons lead
        pick = self.selected
        lines.append(f"selected: {pick.name if pick else 'none'}")
        if pick:
            lines.append(f"why: {self.why_selected()}")
        if pick is not None and pick.cuda_graphs is not None:
            lines.append(f"cuda graphs: {pick.cuda_graphs} (the selected backend's "
                         "CUDA_GRAPH_SUPPORT)")
        lines.extend(self.measured_lines())
        lines.extend(self.phase_lines())
        for c in self.candidates:
            status = ("SELECTED" if c.selected else "rejected" if not c.valid
                      else "valid, not forced" if self.forced
                      else "valid, lower priority" if pick else "valid")
            origin = f" [plugin {c.plugin}]" if c.plugin else ""
            lines.append(f"  {c.name}: {status}{origin}")
            lines.extend(f"    - {r}" for r in c.reasons)
            lines.extend(f"    note: {n}" for n in c.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "simulated": self.simulated,
            "device_capability": str(self.device_capability) if self.device_capability else None,
            "config": {k: (str(v).removeprefix("torch.") if k == "dtype" else
                           getattr(v, "value", v))
                       for k, v in self.config.as_kwargs().items()},
            "forced": self.forced,
            "selected": self.selected.name if self.selected else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "phase_rankings": [{"phase": r.phase, "tiers": [list(t) for t in r.tiers],
                                "measured": r.measured,
                                "faster_than_selected": self._faster(r)}
                               for r in self.phase_rankings],
            "measured_ranking": self.measured.to_dict() if self.measured else None,
            "shipped_ranking": self.shipped.to_dict() if self.shipped else None,
            "ranking_notes": list(self.ranking_notes),
        }


class NoValidBackendError(ValueError):
    """No candidate can run the config; the message lists the config and every reason."""

    def __init__(self, report: SelectionReport) -> None:
        self.report = report
        super().__init__(
            f"no valid attention backend for this config on {report.platform}.\n"
            + report.format()
        )


class BackendSelectionError(ValueError):
    """A forced backend is unknown or cannot run the config; the message says why."""

    def __init__(self, message: str, report: SelectionReport | None = None) -> None:
        self.report = report
        super().__init__(message)


def _resolve_platform(platform: Platform | str | None) -> Platform:
    if platform is None:
        return current_platform()
    if isinstance(platform, Platform):
        return platform
    if isinstance(platform, str):
        return get_platform(platform)
    raise TypeError(f"platform must be a Platform, a platform name or None, got {platform!r}")


def _evaluate(
    name: str,
    config: AttentionSelectorConfig,
    platform: Platform,
    capability: DeviceCapability | None,
    in_priority_list: bool,
) -> tuple[CandidateReport, type[AttentionBackend] | None]:
    registry = backend_registry()
    if name not in registry:
        provider = platform.BACKEND_PROVIDERS.get(name)
        hint = f"; it ships in {provider}" if provider else ""
        return CandidateReport(
            name, None, [f"{name} is not registered by any installed plugin{hint}"],
            in_priority_list,
        ), None
    reg = registry.get(name)
    if reg.platforms is not None and platform.name not in reg.platforms:
        # Decided from the registration: a backend for other platforms is not imported.
        return CandidateReport(name, reg.plugin, [_platform_reason(platform, reg.platforms)],
                               in_priority_list), None
    plugin = reg.plugin
    try:
        cls = resolve_backend(name)
    except RegistryError as exc:
        return CandidateReport(name, plugin, [str(exc)], in_priority_list), None
    reasons: list[str] = []
    if platform.name not in cls.PLATFORMS:
        reasons.append(_platform_reason(platform, cls.PLATFORMS))
    try:
        reasons.extend(
            cls.validate_configuration(**config.as_kwargs(), device_capability=capability)
        )
    except ImportError as exc:
        reasons.append(f"{name} could not check the config: {type(exc).__name__}: {exc}")
    except Exception as exc:  # a plugin's bug must not break selection of the others
        reasons.append(f"{name}.validate_configuration raised {type(exc).__name__}: {exc}")
    if capability is None:
        # The backend's "capability unknown" line cannot know the platform: say what would
        # change the result here (this platform's spelling, or the backend's own platform).
        generic = cls._capability_reasons(None)
        if generic and generic[0] in reasons:
            here = cls._capability_reasons(None, _how_to_simulate(cls, platform))[0]
            reasons = [here if r == generic[0] else r for r in reasons]
    notes = []
    if platform.name in cls.PLATFORMS and cls.supports_cross_layer() and not (
            cls.supports_cross_layer(platform.name)):
        notes.append(cls.cross_layer_note(platform.name))
    graphs = getattr(cls, "CUDA_GRAPH_SUPPORT", None)
    return CandidateReport(name, plugin, reasons, in_priority_list,
                           cuda_graphs=getattr(graphs, "value", None), notes=notes), cls


def _platform_reason(platform: Platform, supported: tuple[str, ...]) -> str:
    return f"platform={platform.name} (supported: {', '.join(supported) or 'none declared'})"


def _how_to_simulate(cls: type[AttentionBackend], platform: Platform) -> str:
    """The settings that simulate a device ``cls`` accepts, seen from ``platform``: its
    ``KVCORE_DEVICE_CAPABILITY`` spelled as ``platform`` names devices, and, when ``cls`` does
    not run on ``platform``, the ``KVCORE_PLATFORM`` of one it runs on."""
    bound = cls.MIN_DEVICE_CAPABILITY or cls.MAX_DEVICE_CAPABILITY
    example = bound.arch or f"{bound.major}.{bound.minor}"
    if platform.name in cls.PLATFORMS:
        if platform.check_device_capability(bound) is None or not platform.CAPABILITY_EXAMPLE:
            return f"KVCORE_DEVICE_CAPABILITY={example}"
        return f"KVCORE_DEVICE_CAPABILITY={platform.CAPABILITY_EXAMPLE}"
    for name in cls.PLATFORMS:
        try:
            other = get_platform(name)
        except RegistryError:
            continue
        if other.check_device_capability(bound) is None:
            return f"KVCORE_PLATFORM={name} KVCORE_DEVICE_CAPABILITY={example}"
    return f"KVCORE_DEVICE_CAPABILITY={example}"


def _importable(candidate: CandidateReport) -> bool:
    """Import the packages of a valid candidate about to be picked; a package that fails to
    import becomes its reason (see :meth:`AttentionBackend.import_reasons`), and so does a
    probe that raises (a plugin's override)."""
    try:
        candidate.reasons.extend(resolve_backend(candidate.name).import_reasons())
    except (Exception, SystemExit) as exc:  # a plugin's probe must not break selection
        candidate.reasons.append(f"{candidate.name}.import_reasons raised "
                                 f"{type(exc).__name__}: {exc}")
    return candidate.valid


def _candidate_names(
    config: AttentionSelectorConfig, platform: Platform, capability: DeviceCapability | None,
    measured: ranking.MeasuredOrder | None = None,
) -> tuple[list[str], set[str]]:
    """The platform's priority list, then backends registered for the platform that it does
    not know of (third-party ones). A backend the platform knows but left out of its list for
    this config (e.g. ROCM_ATTN with a KV connector) stays out. With a ``measured`` order, the
    measured candidates come first in that order (they join the priority list), then the
    others in the static order."""
    registry = backend_registry()
    # dict.fromkeys: a name listed twice is one candidate, tried at its first position.
    preferred = list(dict.fromkeys(
        registry.normalize(n) for n in platform.get_backend_priorities(config, capability)
    ))
    extra = []
    for name in registry.names():
        if name in preferred or name in platform.BACKEND_PROVIDERS:
            continue
        try:  # from the registration when declared there: nothing imported
            platforms = backend_platforms(name)
        except RegistryError:
            continue
        if platform.name in platforms:
            extra.append(name)
    names = preferred + extra
    if measured is None:
        return names, set(preferred)
    first = [n for n in (registry.normalize(m) for m in measured.order if m in registry)
             if n in names]
    return first + [n for n in names if n not in first], set(preferred) | set(first)


def _forced_name(backend: str | type[AttentionBackend] | None) -> tuple[str | None, str]:
    if backend is not None:
        if isinstance(backend, str):
            return backend, "the backend argument"
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise TypeError(f"backend={backend!r} must be a backend name (e.g. 'CPU_ATTN'), an "
                            f"AttentionBackend subclass or None, got {type(backend).__name__}")
        return backend.get_name(), "the backend argument"
    env = os.environ.get("KVCORE_ATTENTION_BACKEND", "").strip()
    return (env or None), f"KVCORE_ATTENTION_BACKEND={env}"


def explain_selection(
    config: AttentionSelectorConfig,
    platform: Platform | str | None = None,
    backend: str | type[AttentionBackend] | None = None,
) -> SelectionReport:
    """Evaluate every candidate for ``config`` and mark the one that would be selected.

    Candidates are the platform's priority list, then other backends registered for the
    platform, then (so an operator sees everything installed) the remaining registered
    backends with the reason they do not apply. A forced ``backend`` (or
    ``KVCORE_ATTENTION_BACKEND``) is evaluated first and selected only if valid.
    """
    if not isinstance(config, AttentionSelectorConfig):
        raise TypeError(f"config must be an AttentionSelectorConfig, got {type(config).__name__}")
    plat = _resolve_platform(platform)
    capability = plat.get_device_capability()
    forced, source = _forced_name(backend)
    registry = backend_registry()
    if forced is not None:
        try:
            registry.get(forced)
        except UnknownNameError as exc:
            raise BackendSelectionError(f"{source}: {exc}") from None
    measured, notes = ranking.measured_order(config, plat, capability)
    report = SelectionReport(config, plat.name, plat.is_simulated, capability,
                             forced=registry.normalize(forced) if forced else None,
                             phase_rankings=tuple(plat.phase_rankings(config, capability)),
                             shipped=plat.shipped_order(config, capability),
                             measured=measured, ranking_notes=notes)
    names, preferred = _candidate_names(config, plat, capability, measured)
    rest = [n for n in registry.names() if n not in names]
    for name in names + rest:
        candidate, _ = _evaluate(name, config, plat, capability, name in preferred)
        report.candidates.append(candidate)
    if report.forced:
        chosen = next(c for c in report.candidates if c.name == report.forced)
        chosen.selected = chosen.valid and _importable(chosen)
    else:
        for c in report.candidates[: len(names)]:
            if c.valid and _importable(c):
                c.selected = True
                break
    return report


_cache: dict[tuple, type[AttentionBackend]] = {}
_cache_lock = threading.RLock()
# The plugin generation the cache was filled under: selections from other plugins are stale.
_cache_generation = -1


def _current_cache_generation() -> int:
    """The plugin generation, after forgetting selections made under an older one."""
    global _cache_generation
    with _cache_lock:
        generation = plugins.plugin_generation()
        if generation != _cache_generation:
            _cache.clear()
            _cache_generation = generation
        return generation


def clear_selection_cache() -> None:
    """Forget cached selections (after the environment changed; new plugins are noticed)."""
    with _cache_lock:
        _cache.clear()


def get_attn_backend(
    config: AttentionSelectorConfig,
    backend: str | type[AttentionBackend] | None = None,
    platform: Platform | str | None = None,
) -> type[AttentionBackend]:
    """The backend class to use for ``config`` on ``platform`` (default: the current one).

    Raises:
        BackendSelectionError: the forced backend (``backend`` or ``KVCORE_ATTENTION_BACKEND``)
            is unknown (the message lists valid names) or cannot run the config (its reasons).
        NoValidBackendError: no candidate is valid (the message lists every reason).
    """
    if not isinstance(config, AttentionSelectorConfig):
        raise TypeError(f"config must be an AttentionSelectorConfig, got {type(config).__name__}")
    plat = _resolve_platform(platform)
    forced, source = _forced_name(backend)
    key = (config, forced, plat.name, plat.get_device_capability(), type(plat),
           ranking.ranking_state())
    with _cache_lock:
        generation = _current_cache_generation()
        if key in _cache:
            return _cache[key]
    report = explain_selection(config, plat, backend)
    pick = report.selected
    if forced is not None and pick is None:
        candidate = next(c for c in report.candidates if c.name == report.forced)
        others = report.alternatives()
        raise BackendSelectionError(
            f"attention backend {candidate.name} was requested by {source} but cannot run "
            f"this config on {plat.name}: " + "; ".join(candidate.reasons)
            + (f". Valid for this config on {plat.name}: {', '.join(others)}" if others
               else f". No other backend can run this config on {plat.name} either")
            + f" (config: {config.describe()})",
            report,
        )
    if pick is None:
        raise NoValidBackendError(report)
    cls = resolve_backend(pick.name)
    rejected = [f"{c.name} ({'; '.join(c.reasons)})" for c in report.candidates
                if c.in_priority_list and not c.valid]
    logger.info("using attention backend %s on %s%s", pick.name, plat.name,
                f"; rejected: {', '.join(rejected)}" if rejected else "")
    with _cache_lock:
        if _current_cache_generation() == generation:  # else the plugins changed meanwhile
            _cache[key] = cls
    return cls
