"""Small value types shared by backends, platforms and the selector.

Kept apart from :mod:`kvcore.platform` so that :mod:`kvcore.backend` can use them without
pulling in platform detection.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["PHASES", "AttentionType", "DeviceCapability", "MultipleOf", "PhaseRanking"]

#: The phases of a step that benchmarks time and rankings order backends by: a decode step
#: (one new token per request), a prefill step and a mixed (chunked-prefill) step.
PHASES = ("decode", "prefill", "mixed")


class AttentionType(str, Enum):
    """What an attention layer attends over."""

    DECODER = "decoder"  # causal self-attention over the paged KV cache
    ENCODER_ONLY = "encoder_only"  # bidirectional self-attention, no cache reuse across steps
    ENCODER = "encoder"  # encoder of an encoder-decoder model
    ENCODER_DECODER = "encoder_decoder"  # cross-attention from decoder to encoder states

    def __str__(self) -> str:
        return self.value


# gfx architecture names -> (major, minor) in the ordering ROCm's own tools use.
_GFX_TO_VERSION = {
    "gfx90a": (9, 0),
    "gfx940": (9, 4),
    "gfx941": (9, 4),
    "gfx942": (9, 4),
    "gfx950": (9, 5),
    "gfx1100": (11, 0),
    "gfx1101": (11, 0),
    "gfx1200": (12, 0),
    "gfx1201": (12, 0),
}


@dataclass(frozen=True, order=True)
class DeviceCapability:
    """A GPU's compute capability (CUDA ``major.minor``; ROCm carries its gfx name too).

    Ordered by ``(major, minor)`` so backends can declare ``MIN_DEVICE_CAPABILITY``.
    """

    major: int
    minor: int
    # e.g. "gfx942"; None on CUDA. Not compared: ordering is by (major, minor) alone.
    arch: str | None = field(default=None, compare=False)

    def as_int(self) -> int:
        """``90`` for 9.0, ``100`` for 10.0 (the form CUDA's ``sm_`` targets use)."""
        return self.major * 10 + self.minor

    def __str__(self) -> str:
        base = f"{self.major}.{self.minor}"
        return f"{self.arch} ({base})" if self.arch else base

    @classmethod
    def parse(cls, text: str) -> DeviceCapability:
        """Parse ``"9.0"``, ``"90"``, ``"sm_90"`` or a ROCm gfx name such as ``"gfx942"``."""
        value = text.strip().lower()
        if value.startswith("gfx"):
            if value not in _GFX_TO_VERSION:
                known = ", ".join(sorted(_GFX_TO_VERSION))
                raise ValueError(f"device capability {text!r} is not a known gfx name ({known})")
            major, minor = _GFX_TO_VERSION[value]
            return cls(major, minor, value)
        match = re.fullmatch(r"(?:sm_?)?(\d+)\.(\d+)", value) or re.fullmatch(
            r"(?:sm_?)?(\d+)(\d)", value
        )
        if not match:
            raise ValueError(
                f"device capability {text!r} is not of the form '9.0', '90', 'sm_90' or 'gfx942'"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def at_least(self, other: DeviceCapability) -> bool:
        return (self.major, self.minor) >= (other.major, other.minor)


@dataclass(frozen=True)
class MultipleOf:
    """A capability value meaning "any positive multiple of ``base``", optionally ``<= max``."""

    base: int
    max: int | None = None

    def __contains__(self, value: object) -> bool:
        return (isinstance(value, int) and value > 0 and value % self.base == 0
                and (self.max is None or value <= self.max))

    def __str__(self) -> str:
        return f"multiples of {self.base}" + (f" up to {self.max}" if self.max else "")


@dataclass(frozen=True)
class PhaseRanking:
    """How fast backends were measured in one phase of a step on a platform's devices.

    Declared by a platform (:meth:`kvcore.Platform.phase_rankings`) from benchmarks, so that
    ``kvcore select --explain`` can say when the fastest backend differs between decode and
    prefill: the priority list picks one backend for both.

    Attributes:
        phase: the phase, e.g. ``"decode"`` or ``"prefill"``.
        tiers: backend names in groups, fastest group first; the backends of one group were
            within a few percent of each other.
        measured: what was measured, for the reader of the note (device, dtype, shapes).
        cases: the measured cases behind the tiers, each ``(what, ((backend, µs), ...))``
            (``what``: the model and shape, e.g. ``"llama-3.1-70b-tp8 full, decode 64x4096,
            Hq=8 Hk=1 D=128"``); ``()`` when only the tiers are declared. The tiers average
            over the cases; :meth:`faster_cases` finds those where the average misleads.
    """

    phase: str
    tiers: tuple[tuple[str, ...], ...]
    measured: str
    cases: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        if not self.tiers or not all(self.tiers):
            raise ValueError(f"tiers={self.tiers!r}: give at least one non-empty group of "
                             "backend names, fastest first")

    @property
    def fastest(self) -> tuple[str, ...]:
        """The fastest group."""
        return self.tiers[0]

    def rank(self, backend: str) -> int | None:
        """0 for the fastest group, 1 for the next, ...; ``None``: not measured."""
        return next((i for i, tier in enumerate(self.tiers) if backend in tier), None)

    def describe(self) -> str:
        """``TRITON_ATTN = FLASHINFER > FLASH_ATTN``."""
        return " > ".join(" = ".join(tier) for tier in self.tiers)

    def faster_cases(self, backend: str, others: Collection[str], tolerance: float
                     ) -> list[tuple[str, str, float]]:
        """The cases where one of ``others`` was measured more than ``tolerance`` (a
        fraction) faster than ``backend``: ``(what, the fastest of them, its speed-up)``, the
        largest speed-up first. A ranking's tiers average over a phase's shapes (and over
        every head count when the config gives none), so these say where another backend is
        the better choice."""
        found = []
        for what, times in self.cases:
            timed = dict(times)
            mine = timed.get(backend)
            rivals = {b: t for b, t in timed.items() if b in others and b != backend}
            if mine is None or not rivals:
                continue
            best = min(rivals, key=rivals.__getitem__)
            if rivals[best] * (1 + tolerance) < mine:
                found.append((what, best, mine / rivals[best]))
        return sorted(found, key=lambda f: -f[2])
