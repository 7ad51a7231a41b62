"""Platforms: what hardware runs attention here, its capability, and its backend priorities.

A platform (``cpu``, ``cuda``, ``rocm``, or a plugin's) is registered through
``kvcore_register_platforms``. The *current* platform is detected lazily: the first registered
platform whose :meth:`Platform.probe` finds its device, by :attr:`Platform.detection_priority`.

Environment overrides (so CUDA and ROCm selection logic is testable on a CPU machine):
    ``KVCORE_PLATFORM``: force a platform by name, present or not (a platform used while its
        device is absent is *simulated*: selection works, kernels do not).
    ``KVCORE_DEVICE_CAPABILITY``: force the device capability (``9.0``, ``90``, ``gfx942``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvcore import plugins, ranking
from kvcore.blocks import check_block_mapping
from kvcore.config import AttentionSelectorConfig
from kvcore.layout import KVCacheLayout
from kvcore.platform_types import DeviceCapability, PhaseRanking
from kvcore.registry import ResolveError, platform_registry

__all__ = [
    "Platform",
    "DeviceCapability",
    "current_platform",
    "get_platform",
    "require_present_platform",
    "available_platforms",
    "clear_platform_cache",
]

logger = logging.getLogger(__name__)


def _check_block_copy_args(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    src_block_indices: torch.Tensor,
    dst_block_indices: torch.Tensor,
    layout: KVCacheLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout check, then :func:`kvcore.blocks.check_block_mapping`: int64 CPU ids."""
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(
            f"layout must be the caches' KVCacheLayout (KVCaches.layout), got "
            f"{type(layout).__name__}: block movement indexes dim 0, which is the block only "
            "in a blocks-first layout, so the layout is required to refuse any other"
        )
    if not layout.is_blocks_first:
        raise ValueError(
            f"the cache layout {layout} is not blocks-first (its block dim is not outermost); "
            "block movement indexes dim 0 and would move the wrong data. Use a backend with "
            "the blocks-first layout"
        )
    page = tuple(layout.layer_shape[1:])
    for name, cache in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        if isinstance(cache, torch.Tensor) and tuple(cache.shape[1:]) != page:
            raise ValueError(
                f"{name} has shape {tuple(cache.shape)}, which is not a cache of the given "
                f"layout {layout} (pages of shape {page}); pass the layout of these caches"
            )
    return check_block_mapping(
        src_cache, dst_cache, src_block_indices, dst_block_indices,
        names=("src_cache", "dst_cache", "src_block_indices", "dst_block_indices"),
    )


@functools.cache
def _warn_broken_shipped_ranking(message: str) -> None:
    logger.warning("%s; the platform's unmeasured order is used", message)


@functools.cache
def _cpu_model_name() -> str:
    """The processor's model name (``/proc/cpuinfo``'s ``model name``), else its
    architecture."""
    import platform as py_platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {py_platform.processor() or py_platform.machine()}"


class Platform(ABC):
    """A kind of hardware kvcore can run attention on.

    Subclasses set :attr:`name` and :attr:`device_type`, implement :meth:`probe` and
    :meth:`get_backend_priorities`, and override :meth:`query_device_capability` if the
    device has one.
    """

    #: Registry name, lower case (``"cuda"``); the value of ``KVCORE_PLATFORM``.
    name: ClassVar[str]
    #: The ``torch.device`` type tensors of this platform live on.
    device_type: ClassVar[str]
    #: Higher probes first during detection; the CPU fallback is lowest.
    detection_priority: ClassVar[int] = 50
    #: Backends this platform prefers that ship in separate distributions: name -> package,
    #: so an uninstalled one is reported with what to install.
    BACKEND_PROVIDERS: ClassVar[dict[str, str]] = {}
    #: A device capability as this platform spells it (``"9.0"``, ``"gfx942"``), for
    #: messages that tell a user how to simulate a device; ``None``: no capabilities.
    CAPABILITY_EXAMPLE: ClassVar[str | None] = None
    #: The ranking file ``kvcore tune`` wrote on this platform's devices, shipped as package
    #: data: ``(package, file name)``, or ``None``. Where it has a ranking for a device's
    #: capability, :meth:`shipped_order` orders the backends for a config from it
    #: (``get_backend_priorities`` applies it with ``ShippedOrder.reorder``) and
    #: :meth:`phase_rankings` reports its speeds.
    SHIPPED_RANKING: ClassVar[tuple[str, str] | None] = None

    @abstractmethod
    def probe(self) -> str | None:
        """``None`` if this platform's device is present, else a sentence saying why not."""

    def query_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        """The device's capability as the hardware reports it (``None``: not applicable)."""
        return None

    def check_device_capability(self, capability: DeviceCapability) -> str | None:
        """``None`` if ``capability`` names a device of this platform, else a sentence saying
        why not (a gfx name on CUDA, a CUDA compute capability on ROCm, any on the CPU), so
        a simulated device cannot be one no such platform has. Accepts anything by default."""
        return None

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        """``KVCORE_DEVICE_CAPABILITY`` if set, else the hardware's (``None`` if absent).

        The variable simulates the current platform's device: with ``KVCORE_PLATFORM`` naming
        another platform it is that platform's, and this one reports its own hardware (a CUDA
        simulation does not give the CPU platform a capability).

        Raises ``ValueError`` naming the variable when its value is not a capability or not
        one of this platform's (:meth:`check_device_capability`).
        """
        override = os.environ.get("KVCORE_DEVICE_CAPABILITY")
        forced = os.environ.get("KVCORE_PLATFORM", "").strip().lower()
        if override and forced and forced != self.name:
            override = None
        if override:
            try:
                capability = DeviceCapability.parse(override)
            except ValueError as exc:
                raise ValueError(f"KVCORE_DEVICE_CAPABILITY={override}: {exc}") from None
            why_not = self.check_device_capability(capability)
            if why_not is not None:
                raise ValueError(
                    f"KVCORE_DEVICE_CAPABILITY={override} does not belong to platform "
                    f"{self.name}: {why_not}; unset it or set another KVCORE_PLATFORM")
            return capability
        if self.probe() is not None:
            return None
        return self.query_device_capability(device_id)

    def device_name(self, device_id: int = 0) -> str | None:
        """The device's name as its driver reports it (``NVIDIA H200``; on the CPU the
        processor's model name), or ``None`` when the device is absent. Measured rankings
        (:mod:`kvcore.ranking`) are kept per device name."""
        if self.probe() is not None:
            return None
        if self.device_type == "cpu":
            return _cpu_model_name()
        module = getattr(torch, self.device_type, None)
        get_name = getattr(module, "get_device_name", None)
        return get_name(device_id) if get_name is not None else None

    @property
    def is_simulated(self) -> bool:
        """Used although its device is absent (forced by name): selection works, kernels not."""
        return self.probe() is not None

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" \
            else torch.device("cpu")

    @abstractmethod
    def get_backend_priorities(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        """Backend names to try for ``config``, best first.

        Names need not be installed: the selector reports a missing one with the package that
        provides it (:attr:`BACKEND_PROVIDERS`). Backends registered for this platform but not
        listed here are tried after these.
        """

    def phase_rankings(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> tuple[PhaseRanking, ...]:
        """Measured speed of the backends per phase of a step (decode, prefill) for ``config``
        on ``device_capability``, or ``()`` where nothing was measured.

        :func:`kvcore.explain_selection` reports them (``kvcore select --explain``), and says
        so when the fastest backends differ between phases: the priority list picks one
        backend for both. By default the speed tiers of :meth:`shipped_order`.
        """
        shipped = self.shipped_order(config, device_capability)
        return shipped.phases if shipped is not None else ()

    def shipped_order(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> ranking.ShippedOrder | None:
        """The order :attr:`SHIPPED_RANKING` gives ``config`` on ``device_capability``
        (:func:`kvcore.ranking.shipped_order`: the ranking of that capability that measured
        the closest cases, this very device's on a tie), or ``None``: no file, or nothing
        measured for this capability and kind of config. A file that cannot be read is logged
        once and treated as absent."""
        if self.SHIPPED_RANKING is None:
            return None
        try:
            rankings = ranking.load_shipped_rankings(*self.SHIPPED_RANKING)
        except ranking.RankingFileError as exc:  # a packaging fault must not break selection
            _warn_broken_shipped_ranking(str(exc))
            return None
        name = None if self.is_simulated else self.device_name()
        # Selection asks several times per config (priorities, phase tiers, explain): the
        # answer is computed once per loaded file, config, capability and device name.
        key = (id(rankings), config, device_capability, name)
        memo = self.__dict__.setdefault("_shipped_orders", {})
        hit = memo.get(key)
        if hit is None or hit[0] is not rankings:  # (an id is reused only by another tuple)
            if len(memo) >= 256:
                memo.clear()
            hit = memo[key] = (rankings,
                               ranking.shipped_order(rankings, config, device_capability, name))
        return hit[1]

    def _copy_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                     src_block_indices: torch.Tensor, dst_block_indices: torch.Tensor,
                     layout: KVCacheLayout) -> None:
        src_idx, dst_idx = _check_block_copy_args(
            src_cache, dst_cache, src_block_indices, dst_block_indices, layout
        )
        if src_idx.numel() == 0:
            return
        blocks = src_cache.index_select(0, src_idx.to(src_cache.device))
        non_blocking = blocks.device.type == "cpu" and blocks.is_pinned()
        dst_cache.index_copy_(
            0, dst_idx.to(dst_cache.device), blocks.to(dst_cache.device, non_blocking=non_blocking)
        )

    def insert_blocks_to_device(self, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                                src_block_indices: torch.Tensor, dst_block_indices: torch.Tensor,
                                *, layout: KVCacheLayout) -> None:
        """Copy host blocks ``src_cache[src_block_indices]`` into ``dst_cache[dst_block_indices]``.

        ``layout`` (required, keyword-only) is the caches' :class:`~kvcore.KVCacheLayout`
        (``KVCaches.layout``): both caches must be blocks-first pages of it (dim 0 the block);
        a legacy ``(2, num_blocks, ...)`` cache is refused instead of moving K halves. Indices
        are validated (1-D, integer, equal length, in range) before anything moves.
        """
        self._copy_blocks(src_cache, dst_cache, src_block_indices, dst_block_indices, layout)

    def swap_out_blocks_to_host(self, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                                src_block_indices: torch.Tensor, dst_block_indices: torch.Tensor,
                                *, layout: KVCacheLayout) -> None:
        """Copy device blocks ``src_cache[src_block_indices]`` to host ``dst_cache[...]``.

        Same contract as :meth:`insert_blocks_to_device`, in the other direction.
        """
        self._copy_blocks(src_cache, dst_cache, src_block_indices, dst_block_indices, layout)

    def describe(self) -> str:
        capability = self.get_device_capability()
        text = self.name
        if capability is not None:
            text += f" (capability {capability})"
        if self.is_simulated:
            text += f" [simulated: {self.probe()}]"
        return text


_platform_lock = threading.RLock()
_current: Platform | None = None
_instances: dict[str, Platform] = {}
# The plugin generation the two caches above were filled under (see _check_generation).
_generation = -1


def _check_generation() -> None:
    """Forget the cached platforms when the plugins changed since they were made."""
    global _generation
    with _platform_lock:
        generation = plugins.plugin_generation()
        if generation != _generation:
            clear_platform_cache()
            _generation = generation


def clear_platform_cache() -> None:
    """Forget the detected platform (after changing ``KVCORE_PLATFORM``).

    A change of plugins (:func:`kvcore.register_plugin`, ...) is noticed without this call.
    """
    global _current
    with _platform_lock:
        _current = None
        _instances.clear()


def get_platform(name: str) -> Platform:
    """The platform registered as ``name`` (``ValueError`` listing the valid names if none)."""
    with _platform_lock:
        _check_generation()
        registry = platform_registry()
        key = registry.normalize(name)
        if key not in _instances:
            cls = registry.resolve(key)
            if not (isinstance(cls, type) and issubclass(cls, Platform)):
                raise ResolveError(
                    f"platform {key!r} resolves to {cls!r}, not a Platform subclass"
                )
            _instances[key] = cls()
        return _instances[key]


def available_platforms() -> list[tuple[str, str | None]]:
    """Every registered platform with ``None`` if present or the reason it is absent."""
    result = []
    for name in platform_registry().names():
        try:
            result.append((name, get_platform(name).probe()))
        except Exception as exc:
            result.append((name, f"failed to load: {exc}"))
    return result


def current_platform() -> Platform:
    """The platform this process runs on: ``KVCORE_PLATFORM`` if set, else detected."""
    global _current
    with _platform_lock:
        _check_generation()
        if _current is not None:
            return _current
        forced = os.environ.get("KVCORE_PLATFORM", "").strip()
        if forced:
            try:
                _current = get_platform(forced)
            except ValueError as exc:  # an unknown name: say which setting holds it
                raise type(exc)(f"KVCORE_PLATFORM={forced}: {exc}") from None
            if _current.is_simulated:
                logger.info("KVCORE_PLATFORM=%s: simulating (%s)", forced, _current.probe())
            return _current
        platforms = []
        for name in platform_registry().names():
            try:
                platforms.append(get_platform(name))
            except Exception as exc:
                logger.warning("platform %r could not be loaded: %s", name, exc)
        platforms.sort(key=lambda p: -p.detection_priority)
        absent = []
        for platform in platforms:
            try:
                why_absent = platform.probe()
            except Exception as exc:  # one platform's broken probe must not hide the others
                why_absent = f"probe failed: {type(exc).__name__}: {exc}"
                logger.warning("platform %r: %s", platform.name, why_absent)
            if why_absent is None:
                _current = platform
                return platform
            absent.append(f"{platform.name}: {why_absent}")
        raise RuntimeError("no kvcore platform is available: " + "; ".join(absent))


def require_present_platform(name: str | None = None) -> Platform:
    """The platform ``name`` (default: the current one), which must be present here.

    For code that runs real kernels: a simulated platform (forced by name while its device is
    absent) is a ``ValueError`` naming the platform and why it is absent.
    """
    platform = current_platform() if name is None else get_platform(name)
    why_absent = platform.probe()
    if why_absent is not None:
        raise ValueError(f"platform={platform.name} is not present on this machine "
                         f"({why_absent}); this command runs real kernels, so choose a "
                         "platform that is present (kvcore collect-env lists them)")
    return platform
