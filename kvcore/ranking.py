"""Measured rankings: backend timings that ``kvcore tune`` took on this machine, which the
selector follows instead of the platform's static priority list.

The ranking file (JSON, default ``$XDG_CACHE_HOME/kvcore/ranking.json``, else
``~/.cache/kvcore/ranking.json``; ``KVCORE_RANKING_FILE`` names another, ``none`` turns
measured selection off) holds one ranking per device, each with the device it was measured
on, the library versions, the date, and per case (phase ``decode``/``prefill``/``mixed``,
shape class, selector config) the measured time of every backend. docs/tune.md has the format.

For a config, :func:`measured_order` takes the ranking of the current device (platform, device
name and capability equal) and the cases whose selector config equals the config
(``use_kv_connector`` aside: it changes which backends are valid, not their speed; head counts
the config gives narrow them to the cases measured with the same counts, where there are such
cases), and orders the measured backends by the geometric mean of their time over the fastest
one's across those cases. A ranking measured with other library versions is stale: it is
ignored, and the selector's report says so; so is a malformed file (the selector never fails
because of it; :func:`load_rankings` raises :class:`RankingFileError` for ``kvcore tune``).

The file is read once per path and modification time: a selection costs one ``os.stat``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field, replace
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Protocol

import torch

from kvcore.config import HEAD_COUNT_FIELDS, AttentionSelectorConfig
from kvcore.platform_types import PHASES, DeviceCapability, PhaseRanking

logger = logging.getLogger(__name__)

RANKING_FILE_ENV = "KVCORE_RANKING_FILE"
FORMAT = "kvcore-ranking"
FORMAT_VERSION = 1
#: Distributions whose versions a ranking records; one that differs (or is installed on one
#: side only) makes the ranking stale.
VERSIONED_DISTRIBUTIONS = ("kvcore", "kvcore-nvidia", "kvcore-rocm", "kvcore-mla", "torch",
                           "triton", "flashinfer-python", "flash-attn", "flash-attn-4",
                           "amd-aiter")
#: Config fields that do not change a backend's speed, left out of the match.
_UNMATCHED_FIELDS = ("use_kv_connector",)
_OFF = ("none", "off", "0")


class _Platform(Protocol):
    """What a ranking reads of a :class:`kvcore.Platform` (which imports this module)."""

    name: str

    @property
    def is_simulated(self) -> bool: ...

    def device_name(self, device_id: int = 0) -> str | None: ...


class RankingFileError(ValueError):
    """A ranking file that cannot be read as one; the message names the file and the fix."""


@dataclass(frozen=True)
class DeviceIdentity:
    """The device a ranking was measured on: platform, device name, capability."""

    platform: str
    name: str
    capability: str | None

    def describe(self) -> str:
        cap = f", capability {self.capability}" if self.capability else ""
        return f"{self.name} ({self.platform}{cap})"


@dataclass(frozen=True)
class MeasuredCase:
    """One timed step of one layer kind: every backend's median time in microseconds
    (``errors``: the backends that failed, with why)."""

    phase: str
    shape_class: str
    shape: str
    config: dict[str, Any]
    times_us: dict[str, float]
    preset: str = ""
    layer: str = ""
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "shape_class": self.shape_class, "shape": self.shape,
                "preset": self.preset, "layer": self.layer, "config": self.config,
                "times_us": self.times_us, "errors": self.errors}

    def step_key(self) -> tuple:
        """What makes two cases the same step measured twice: the phase, the selector
        config, the shape, the preset and the layer kind (a new measurement replaces it)."""
        return (self.phase, json.dumps(self.config, sort_keys=True), self.shape, self.preset,
                self.layer)


@dataclass(frozen=True)
class Ranking:
    """One device's measurements (one entry of the file's ``rankings``)."""

    date: str
    device: DeviceIdentity
    versions: dict[str, str | None]
    cases: tuple[MeasuredCase, ...]
    driver: str | None = None
    budget_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"date": self.date,
                "device": {"platform": self.device.platform, "name": self.device.name,
                           "capability": self.device.capability, "driver": self.driver},
                "versions": self.versions, "budget_s": self.budget_s,
                "cases": [c.to_dict() for c in self.cases]}

    def version_changes(self, current: dict[str, str | None]) -> list[str]:
        """``torch 2.10.0 -> 2.11.0`` for every recorded library whose version differs now."""
        names = sorted(set(self.versions) | set(current))
        return [f"{n} {self.versions.get(n) or 'absent'} -> {current.get(n) or 'absent'}"
                for n in names if self.versions.get(n) != current.get(n)]


def ranking_config_key(config: AttentionSelectorConfig) -> dict[str, Any]:
    """The config as the file stores it and matches it: JSON values, without the fields that
    do not change speed and without head counts that were not given."""
    out: dict[str, Any] = {}
    for key, value in config.as_kwargs().items():
        if key in _UNMATCHED_FIELDS or (key in HEAD_COUNT_FIELDS and value is None):
            continue
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[key] = getattr(value, "value", value)
    return out


def ranking_shape_class(config: AttentionSelectorConfig) -> str:
    """``D128 bfloat16 kv=auto bs16`` (plus ``mla``/``sinks`` and the head counts given,
    ``Hq=8 Hk=1``): the cases a config matches."""
    text = (f"D{config.head_size} {str(config.dtype).removeprefix('torch.')} "
            f"kv={config.kv_cache_dtype} bs{config.block_size}")
    text += (" mla" if config.use_mla else "") + (" sinks" if config.has_sink else "")
    if config.num_heads is not None:
        text += f" Hq={config.num_heads}"
    if config.num_kv_heads is not None:
        text += f" Hk={config.num_kv_heads}"
    return text


def join_shape_classes(classes: list[str] | tuple[str, ...]) -> str:
    """Shape classes in one phrase, those differing only in head counts as one:
    ``D128 bfloat16 kv=auto bs16 (Hq=32 Hk=8; Hq=8 Hk=1)``."""
    heads: dict[str, list[str]] = {}
    for name in classes:
        base, sep, counts = name.partition(" Hq=")
        heads.setdefault(base, []).append(f"Hq={counts}" if sep else "")
    parts = []
    for base, counts in heads.items():
        given = [c for c in counts if c]
        if len(counts) == 1:
            parts.append(f"{base} {given[0]}" if given else base)
        else:
            parts.append(f"{base} ({'; '.join(c or 'heads not given' for c in counts)})")
    return ", ".join(parts)


def same_heads(cases: list[MeasuredCase], config: AttentionSelectorConfig
               ) -> list[MeasuredCase]:
    """``cases`` narrowed, for each head count ``config`` gives (KV heads first: the count that
    sets a decode kernel's parallelism), to those measured with the same count, where any
    was; a count not given, or given but not measured, narrows nothing."""
    for name in ("num_kv_heads", "num_heads"):
        value = getattr(config, name)
        same = [c for c in cases if value is not None and c.config.get(name) == value]
        if same:
            cases = same
    return cases


# -- where the file is, and what this machine is ------------------------------------------------


def ranking_path() -> Path | None:
    """The ranking file: ``KVCORE_RANKING_FILE``, else ``$XDG_CACHE_HOME/kvcore/ranking.json``,
    else ``~/.cache/kvcore/ranking.json``; ``None`` when the variable is ``none`` (or ``off``,
    ``0``): measured selection off."""
    value = os.environ.get(RANKING_FILE_ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(cache) / "kvcore" / "ranking.json"


@functools.cache
def library_versions() -> dict[str, str | None]:
    """Installed versions of :data:`VERSIONED_DISTRIBUTIONS` (``None``: not installed), and
    torch's CUDA or HIP version; read once per process."""
    versions: dict[str, str | None] = {}
    for dist in VERSIONED_DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    versions["torch"] = torch.__version__  # the running one, whatever the metadata says
    versions["cuda"] = torch.version.cuda
    versions["hip"] = getattr(torch.version, "hip", None)
    return versions


def current_identity(platform: _Platform, capability: DeviceCapability | None
                     ) -> DeviceIdentity | None:
    """The device ``platform`` runs on here, or ``None`` when it is simulated (absent)."""
    if platform.is_simulated:
        return None
    name = platform.device_name()
    if name is None:
        return None
    return DeviceIdentity(platform.name, name, str(capability) if capability else None)


# -- reading and writing ------------------------------------------------------------------------


def _parse_case(raw: Any, where: str) -> MeasuredCase:
    if not isinstance(raw, dict):
        raise RankingFileError(f"{where} is {type(raw).__name__}, not an object")
    try:
        times = {str(k): float(v) for k, v in raw["times_us"].items()}
        case = MeasuredCase(phase=str(raw["phase"]), shape_class=str(raw.get("shape_class", "")),
                            shape=str(raw.get("shape", "")), config=dict(raw["config"]),
                            times_us=times, preset=str(raw.get("preset", "")),
                            layer=str(raw.get("layer", "")),
                            errors={str(k): str(v) for k, v in raw.get("errors", {}).items()})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RankingFileError(f"{where}: {type(exc).__name__}: {exc} (a case needs phase, "
                               "config and times_us)") from None
    if any(not (math.isfinite(t) and t > 0) for t in times.values()):
        raise RankingFileError(f"{where}: times_us {times} must be positive numbers")
    return case


def _parse(data: Any) -> list[Ranking]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RankingFileError(f"it is not a {FORMAT} file (no \"format\": \"{FORMAT}\")")
    if data.get("version") != FORMAT_VERSION:
        raise RankingFileError(f"format version {data.get('version')!r} is not "
                               f"{FORMAT_VERSION}, the one this kvcore reads")
    rankings = data.get("rankings")
    if not isinstance(rankings, list):
        raise RankingFileError("\"rankings\" must be a list")
    out = []
    for i, raw in enumerate(rankings):
        where = f"rankings[{i}]"
        try:
            device = raw["device"]
            identity = DeviceIdentity(str(device["platform"]), str(device["name"]),
                                      None if device.get("capability") is None
                                      else str(device["capability"]))
            cases = tuple(_parse_case(c, f"{where}.cases[{j}]")
                          for j, c in enumerate(raw["cases"]))
            out.append(Ranking(str(raw["date"]), identity, dict(raw["versions"]), cases,
                               device.get("driver"), raw.get("budget_s")))
        except RankingFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RankingFileError(f"{where}: {type(exc).__name__}: {exc} (a ranking needs "
                                   "date, device, versions and cases)") from None
    return out


def load_rankings(path: str | Path) -> list[Ranking]:
    """Every ranking in the file at ``path`` (``[]`` if there is no file).

    Raises:
        RankingFileError: the file is no JSON or not in the ranking format; the message names
            the file, what is wrong, and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RankingFileError(f"ranking file {path} cannot be read: {exc}") from None
    try:
        return _parse(json.loads(text))
    except json.JSONDecodeError as exc:
        raise RankingFileError(f"ranking file {path} is not JSON ({exc}); delete it or run "
                               "kvcore tune again to rewrite it") from None
    except RankingFileError as exc:
        raise RankingFileError(f"ranking file {path}: {exc}; delete it or run kvcore tune "
                               "again to rewrite it") from None


def merged_ranking(ranking: Ranking, earlier: Ranking | None) -> tuple[Ranking, int]:
    """``ranking`` with the cases of ``earlier`` (this device's ranking in the file) that it
    did not measure again, and how many it kept: only when ``earlier`` is of the same device
    and library versions (else ``ranking`` alone, 0). Cases are the same step when their
    :meth:`MeasuredCase.step_key` is; the new measurement wins."""
    if (earlier is None or earlier.device != ranking.device
            or earlier.version_changes(ranking.versions)):
        return ranking, 0
    measured = {case.step_key() for case in ranking.cases}
    kept = tuple(case for case in earlier.cases if case.step_key() not in measured)
    return replace(ranking, cases=kept + ranking.cases), len(kept)


def write_ranking(ranking: Ranking, path: str | Path) -> Path:
    """Write ``ranking`` into the file at ``path``, replacing the ranking of the same device
    and keeping the others (a home directory shared by machines with different GPUs), in
    one atomic rename (``kvcore tune`` passes :func:`merged_ranking`'s result, so this
    device's earlier cases stay where they still apply). Raises :class:`RankingFileError`
    when the file exists but is not a ranking file (it is left as it is)."""
    path = Path(path)
    kept = [r for r in load_rankings(path) if r.device != ranking.device]
    data = {"format": FORMAT, "version": FORMAT_VERSION,
            "rankings": [r.to_dict() for r in [*kept, ranking]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


_lock = threading.Lock()
_loaded: dict[str, tuple[tuple[int, int], list[Ranking] | str]] = {}
_warned: set[tuple] = set()


def ranking_state() -> tuple | None:
    """What selections depend on: the path and its modification time and size (``None``:
    measured selection off). One ``os.stat``; part of the selector's cache key."""
    path = ranking_path()
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return (str(path), None)
    return (str(path), st.st_mtime_ns, st.st_size)


def _cached_rankings(path: Path) -> tuple[list[Ranking], str | None]:
    """The file's rankings and ``None``, or ``[]`` and why the file is ignored; parsed once
    per modification time."""
    try:
        st = path.stat()
    except OSError:
        return [], None
    stamp = (st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _loaded.get(str(path))
        if hit is not None and hit[0] == stamp:
            value = hit[1]
            return ([], value) if isinstance(value, str) else (value, None)
    try:
        value: list[Ranking] | str = load_rankings(path)
    except RankingFileError as exc:
        value = str(exc)
    with _lock:
        _loaded[str(path)] = (stamp, value)
    return ([], value) if isinstance(value, str) else (value, None)


# -- what the selector asks ----------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredOrder:
    """The measured order of backends for a config on this device, and per phase each
    backend's speed relative to the fastest (geometric mean over the phase's cases)."""

    order: tuple[str, ...]
    speed: dict[str, dict[str, float]]  # phase -> backend -> fastest time / its time
    cases: dict[str, int]  # phase -> cases measured
    date: str
    path: str
    device: DeviceIdentity

    @classmethod
    def from_cases(cls, cases: list[MeasuredCase], date: str, path: str,
                   device: DeviceIdentity) -> MeasuredOrder:
        """The order of the backends measured in ``cases`` (see the module docstring)."""
        order, speed, counts = _order(cases)
        return cls(order, speed, counts, date, path, device)

    def phase_lines(self) -> list[str]:
        """``decode (2 cases): FLASHINFER fastest; TRITON_ATTN 0.98x of FLASHINFER`` per phase."""
        lines = []
        for phase in PHASES:
            speeds = self.speed.get(phase)
            if not speeds:
                continue
            ranked = sorted(speeds, key=lambda b: -speeds[b])
            best = ranked[0]
            rest = ", ".join(f"{b} {speeds[b]:.2f}x" for b in ranked[1:])
            n = self.cases[phase]
            lines.append(f"{phase} ({n} case{'s' if n != 1 else ''}): {best} fastest"
                         + (f"; {rest} of {best}" if rest else ""))
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "speed": self.speed, "cases": self.cases,
                "date": self.date, "path": self.path,
                "device": {"platform": self.device.platform, "name": self.device.name,
                           "capability": self.device.capability}}


def _warn_once(key: tuple, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("%s", message)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _order(cases: list[MeasuredCase]) -> tuple[tuple[str, ...], dict, dict]:
    """Backends by (cases missed, slowdown over the fastest, geometric mean), and per phase
    each backend's speed relative to the fastest."""
    relative: dict[str, list[float]] = {}
    per_phase: dict[str, dict[str, list[float]]] = {}
    counts: dict[str, int] = {}
    for case in cases:
        if not case.times_us:
            continue
        best = min(case.times_us.values())
        counts[case.phase] = counts.get(case.phase, 0) + 1
        for backend, t in case.times_us.items():
            relative.setdefault(backend, []).append(t / best)
            per_phase.setdefault(case.phase, {}).setdefault(backend, []).append(best / t)
    total = sum(counts.values())
    order = tuple(sorted(relative, key=lambda b: (total - len(relative[b]),
                                                  _geomean(relative[b]), b)))
    speed = {phase: {b: _geomean(v) for b, v in backends.items()}
             for phase, backends in per_phase.items()}
    return order, speed, counts


def _without_heads(config_key: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config_key.items() if k not in HEAD_COUNT_FIELDS}


def measured_order(config: AttentionSelectorConfig, platform: _Platform,
                   capability: DeviceCapability | None
                   ) -> tuple[MeasuredOrder | None, list[str]]:
    """The measured order for ``config`` on ``platform``'s device here, and notes on any
    ranking that exists but does not apply (another device, stale versions, a malformed
    file, no case for this config). ``(None, [])`` when there is no ranking file."""
    path = ranking_path()
    if path is None:
        return None, []
    rankings, broken = _cached_rankings(path)
    if broken is not None:
        _warn_once((str(path), "broken", broken), f"{broken}; selection uses the static order")
        return None, [f"{broken}; measured ranking ignored, static order used"]
    if not rankings:
        return None, []
    identity = current_identity(platform, capability)
    if identity is None:
        if not any(r.device.platform == platform.name for r in rankings):
            return None, []
        return None, [f"ranking file {path}: {platform.name} is simulated here, so its "
                      "measured rankings do not apply; static order used"]
    mine = [r for r in rankings if r.device == identity]
    if not mine:
        others = "; ".join(r.device.describe() for r in rankings)
        return None, [f"ranking file {path} has rankings for {others}, none for this device "
                      f"({identity.describe()}); static order used (kvcore tune measures this "
                      "one)"]
    ranking = mine[-1]
    changes = ranking.version_changes(library_versions())
    if changes:
        note = (f"ranking file {path}: the ranking measured on {ranking.date} on this device is "
                f"stale (versions changed: {', '.join(changes)}); ignored, static order used; "
                "rerun kvcore tune")
        _warn_once((str(path), ranking.date, tuple(changes)), note)
        return None, [note]
    key = _without_heads(ranking_config_key(config))
    cases = same_heads([c for c in ranking.cases
                        if _without_heads(c.config) == key and c.times_us], config)
    if not cases:
        classes = sorted({c.shape_class for c in ranking.cases})
        return None, [f"ranking file {path} (measured on {ranking.date}) has no case for this "
                      f"config ({ranking_shape_class(config)}; measured: "
                      f"{join_shape_classes(classes) or 'none'}); static order used"]
    return MeasuredOrder.from_cases(cases, ranking.date, str(path), identity), []


# -- rankings shipped with a platform -------------------------------------------------------------

#: Backends whose speeds are within this fraction of a tier's fastest share the tier.
TIER_TOLERANCE = 0.05
#: Config fields that must be equal for a shipped case to say anything about a config.
_SAME_KIND = ("use_mla", "attn_type")
#: The other fields, most telling of a backend's relative speed first: a shipped ranking's
#: cases are narrowed field by field to those equal to the config, a field skipped where no
#: case is equal (so the nearest measured cases speak for a config that was not measured).
_NEAREST_BY = ("kv_cache_dtype", "has_sink", "has_logits_soft_cap", "head_size", "block_size",
               "dtype", "use_sparse", "use_per_head_quant_scales", "use_mm_prefix",
               "use_non_causal", "use_batch_invariant")


@functools.cache
def load_shipped_rankings(package: str, name: str) -> tuple[Ranking, ...]:
    """The rankings of the ranking file ``name`` shipped inside ``package`` (package data,
    written by ``kvcore tune`` on the devices a platform ships an order for); read once.

    Raises:
        RankingFileError: the file is missing or not in the ranking format (a packaging
            fault: the message names the file).
    """
    try:
        text = (resources.files(package) / name).read_text()
        return tuple(_parse(json.loads(text)))
    except (OSError, ModuleNotFoundError, json.JSONDecodeError, RankingFileError) as exc:
        raise RankingFileError(f"shipped ranking {package}/{name} cannot be read ({exc}); "
                               "reinstall the package that provides it") from None


def nearest_cases(cases: tuple[MeasuredCase, ...] | list[MeasuredCase],
                  config: AttentionSelectorConfig) -> list[MeasuredCase]:
    """The cases that speak for ``config``: those of the same kind (MLA or not, attention
    type), narrowed by each field of ``_NEAREST_BY`` in turn to those equal to the config's
    where any is (so an unmeasured head size falls back to the measured ones), then by the
    head counts the config gives (:func:`same_heads`). ``[]`` when no case is of the config's
    kind."""
    key = ranking_config_key(config)
    chosen = [c for c in cases if c.times_us
              and all(c.config.get(f) == key[f] for f in _SAME_KIND)]
    for name in _NEAREST_BY:
        same = [c for c in chosen if c.config.get(name) == key[name]]
        if same:
            chosen = same
    return same_heads(chosen, config)


def _match(case: MeasuredCase, config: AttentionSelectorConfig) -> tuple[bool, ...]:
    """How close a case :func:`nearest_cases` chose is to ``config``: per field of
    ``_NEAREST_BY`` (most telling first), then per head count the config gives, whether they
    are equal (the chosen cases of one ranking share it: a field narrows all of them, or
    none of them is equal)."""
    key = ranking_config_key(config)
    return (*(case.config.get(name) == key[name] for name in _NEAREST_BY),
            *(case.config.get(name) == getattr(config, name)
              for name in ("num_kv_heads", "num_heads")))


def _tiers(speeds: dict[str, float]) -> tuple[tuple[str, ...], ...]:
    """Backends fastest first, grouped while within :data:`TIER_TOLERANCE` of the group's
    fastest."""
    tiers: list[list[str]] = []
    lead = 0.0
    for backend in sorted(speeds, key=lambda b: (-speeds[b], b)):
        if tiers and speeds[backend] >= lead * (1 - TIER_TOLERANCE):
            tiers[-1].append(backend)
        else:
            tiers.append([backend])
            lead = speeds[backend]
    return tuple(tuple(t) for t in tiers)


@dataclass(frozen=True)
class ShippedOrder:
    """The order a platform ships for a config: the backends of the nearest measured cases of
    a ranking file ``kvcore tune`` wrote on a device of the same capability, fastest first,
    and per phase their speed tiers (what ``kvcore select --explain`` quotes)."""

    order: tuple[str, ...]
    phases: tuple[PhaseRanking, ...]
    device: DeviceIdentity
    date: str
    shape_classes: tuple[str, ...]
    cases: int

    def describe(self) -> str:
        """``kvcore tune on NVIDIA H100 80GB HBM3 (cuda, capability 9.0) on 2026-12-06, 12
        cases of D128 bfloat16 kv=auto bs16``."""
        return (f"kvcore tune on {self.device.describe()} on {self.date}, {self.cases} "
                f"case{'s' if self.cases != 1 else ''} of "
                f"{join_shape_classes(self.shape_classes)}")

    def reorder(self, names: list[str]) -> list[str]:
        """A platform's list ``names`` with its measured backends in the measured order, in
        the slots they held; unmeasured ones keep their places, and measured ones the list
        does not name stay out (the platform decides which backends it offers)."""
        measured = iter([b for b in self.order if b in names])
        return [next(measured) if name in self.order else name for name in names]

    def to_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "date": self.date, "cases": self.cases,
                "shape_classes": list(self.shape_classes),
                "device": {"platform": self.device.platform, "name": self.device.name,
                           "capability": self.device.capability}}


def shipped_order(rankings: tuple[Ranking, ...] | list[Ranking], config: AttentionSelectorConfig,
                  capability: DeviceCapability | None, device_name: str | None = None
                  ) -> ShippedOrder | None:
    """The order ``rankings`` (a platform's shipped file) give ``config`` on a device of
    ``capability``: from a ranking of that capability, over its :func:`nearest_cases`: the
    ranking whose nearest cases are closest to the config (equal in the most telling
    fields of ``_NEAREST_BY``, then in the head counts), on a tie the one measured on
    ``device_name``, then the latest. So a device's ranking that measured some kinds of
    config leaves the others to the rankings of its capability that measured them. ``None``
    when no ranking of this capability measured the config's kind. Versions are not
    compared: a shipped order is the platform's default, not this machine's measurement."""
    if capability is None:
        return None
    best: tuple[tuple, Ranking, list[MeasuredCase]] | None = None
    for ranking in rankings:
        if ranking.device.capability != str(capability):
            continue
        cases = nearest_cases(ranking.cases, config)
        if cases:
            # The closest measurement first, then the device's own, then the latest.
            rank = (_match(cases[0], config), ranking.device.name == device_name, ranking.date)
            if best is None or rank > best[0]:
                best = (rank, ranking, cases)
    if best is None:
        return None
    _, ranking, cases = best
    order, speed, counts = _order(cases)
    classes = tuple(sorted({c.shape_class for c in cases}))
    what = (f"{ranking.device.describe()} by kvcore tune on {ranking.date} "
            f"({join_shape_classes(classes)})")
    phases = tuple(PhaseRanking(phase, _tiers(speed[phase]), what, tuple(
        (f"{c.preset} {c.layer}, {c.shape}" if c.preset else c.shape,
         tuple(sorted(c.times_us.items()))) for c in cases if c.phase == phase))
                   for phase in PHASES if speed.get(phase))
    return ShippedOrder(order, phases, ranking.device, ranking.date, classes, sum(counts.values()))
