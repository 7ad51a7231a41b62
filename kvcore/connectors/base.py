"""The KV connector API: move whole KV blocks between a model's cache and somewhere else.

Worker side::

    connector = get_connector("offload", capacity_bytes=8 << 30)
    connector.register_kv_caches(kv_caches)          # from kvcore.allocate_kv_caches
    handle = connector.save(keys, block_ids)         # async; block_ids index dim 0
    ...
    result = connector.load(keys, other_block_ids).wait(timeout=5.0)
    recompute(result.failed)                         # block id -> why it failed

Scheduler side: ``connector.lookup(keys)`` says how many leading keys can be loaded.

A connector moves the bytes of whole blocks. With a cross-layer cache a block of every layer
is one contiguous run (:meth:`kvcore.KVCaches.block_view`), so it moves with one copy; with a
per-layer cache a block is ``num_layers`` runs of ``page_size_bytes``. Either way a block's
bytes are ``(num_layers, page_size_bytes)``, layer-major, so connectors never branch on the
backend that wrote the cache.

Contract with the engine: the blocks of a save must not be overwritten, and the blocks of a
load must not be read, until its handle reports done.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from kvcore import AttentionBackend, KVCacheLayout, KVCaches
from kvcore.connectors.blocks import extract_kv_from_layer, inject_kv_into_layer
from kvcore.connectors.keys import check_block_keys

if TYPE_CHECKING:
    from kvcore.connectors.convert import ConversionPlan

__all__ = [
    "FAILURE_POLICIES",
    "ConnectorStats",
    "KVConnector",
    "KVTransferError",
    "RegisteredCaches",
    "TransferHandle",
    "TransferResult",
]

logger = logging.getLogger(__name__)

#: ``"recompute"``: a load's failed blocks are reported in :attr:`TransferResult.failed` and
#: the engine recomputes them. ``"fail"``: :meth:`TransferHandle.wait` raises
#: :class:`KVTransferError` for a load with any failed block (the request is aborted).
FAILURE_POLICIES = ("recompute", "fail")
Op = Literal["save", "load"]


class KVTransferError(RuntimeError):
    """A load under ``failure_policy="fail"`` did not load every block; see :attr:`result`."""

    def __init__(self, result: TransferResult) -> None:
        self.result = result
        reasons = "; ".join(f"block {b}: {why}" for b, why in sorted(result.failed.items()))
        super().__init__(f"{result.op} failed for {len(result.failed)} of "
                         f"{len(result.failed) + len(result.succeeded)} blocks: {reasons}")


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one save or load.

    Attributes:
        op: ``"save"`` or ``"load"``.
        succeeded: block ids moved (for a save, also those already stored).
        failed: block id -> why it was not moved. A failed load leaves the block's previous
            contents in place, which the engine must treat as garbage and recompute.
        num_bytes: bytes actually copied.
        seconds: time the copy took (device time for asynchronous CUDA copies).
    """

    op: Op
    succeeded: tuple[int, ...]
    failed: Mapping[int, str]
    num_bytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (10**9 bytes per second); 0 when nothing moved."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class ConnectorStats:
    """Counters of one connector since it was created.

    ``hits``/``misses`` count keys found or not by :meth:`KVConnector.lookup`; ``evictions``
    blocks dropped to make room; bytes and seconds sum over completed saves and loads, so the
    GB/s figures are the mean bandwidth of a transfer.
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    saved_blocks: int = 0
    loaded_blocks: int = 0
    failed_blocks: int = 0
    saved_bytes: int = 0
    loaded_bytes: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def save_gbps(self) -> float:
        return self.saved_bytes / self.save_seconds / 1e9 if self.save_seconds > 0 else 0.0

    @property
    def load_gbps(self) -> float:
        return self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**self.__dict__, "save_gbps": self.save_gbps, "load_gbps": self.load_gbps}


class TransferHandle:
    """A save or load that may still be running.

    Built by connectors from three callables: ``is_done()`` polls, ``block(timeout)`` waits up
    to ``timeout`` seconds (``None``: forever) and returns whether it finished, ``collect()``
    runs once after completion, releases what the transfer held and returns its result.
    """

    def __init__(
        self,
        op: Op,
        failure_policy: str,
        is_done: Callable[[], bool],
        block: Callable[[float | None], bool],
        collect: Callable[[], TransferResult],
    ) -> None:
        self.op = op
        self._policy = failure_policy
        self._is_done = is_done
        self._block = block
        self._collect = collect
        self._result: TransferResult | None = None
        self._error: Exception | None = None  # what collect() raised, re-raised by wait()
        self._lock = threading.Lock()

    @classmethod
    def completed(cls, op: Op, failure_policy: str, result: TransferResult) -> TransferHandle:
        """A handle for a transfer that finished before it was returned (CPU copies)."""
        return cls(op, failure_policy, lambda: True, lambda _t: True, lambda: result)

    @classmethod
    def from_future(cls, op: Op, failure_policy: str,
                    future: Future[TransferResult]) -> TransferHandle:
        """A handle for a transfer running on a worker thread."""
        def block(timeout: float | None) -> bool:
            return bool(wait_futures([future], timeout).done)

        return cls(op, failure_policy, future.done, block, future.result)

    def _finish(self) -> TransferResult:
        """Run ``collect`` once; a transfer that raised raises the same error every time."""
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    self._result = self._collect()
                except Exception as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
            return self._result

    def done(self) -> bool:
        """Whether the transfer finished (never raises, never blocks); a transfer that raised
        is done, and :meth:`wait` raises its error."""
        if self._result is not None or self._error is not None:
            return True
        if not self._is_done():
            return False
        try:
            self._finish()
        except Exception:
            pass  # kept on the handle: wait() raises it
        return True

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until done (at most ``timeout`` seconds) and return the result.

        ``timeout``: seconds, ``>= 0``; ``None`` or ``math.inf`` wait without limit. Raises
        ``ValueError`` for anything else (NaN, negative, a bool or a non-number), before
        waiting. Raises ``TimeoutError`` if still running after ``timeout`` (call again to
        keep waiting), and :class:`KVTransferError` for a load with failed blocks under
        ``failure_policy="fail"``.
        """
        if timeout is not None:
            if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                    or math.isnan(timeout) or timeout < 0):
                raise ValueError(f"timeout={timeout!r} must be None (no limit), math.inf (no "
                                 "limit) or a number of seconds >= 0")
            if math.isinf(timeout):
                timeout = None
        if self._result is None and self._error is None and not self._block(timeout):
            raise TimeoutError(f"{self.op} still running after timeout={timeout} s; "
                               "call wait() again or poll done()")
        result = self._finish()
        if self._policy == "fail" and self.op == "load" and result.failed:
            raise KVTransferError(result)
        return result


@dataclass
class RegisteredCaches:
    """What :meth:`KVConnector._register` receives: the caches and their byte views."""

    kv_caches: KVCaches
    #: Byte views ``(num_blocks, row_bytes)`` whose rows, concatenated, are a whole block:
    #: the cross-layer view alone, or one view per layer.
    views: list[torch.Tensor]


def layout_block_size(layout: KVCacheLayout) -> int:
    """Tokens one block of ``layout`` holds (its ``N`` dim)."""
    return layout.logical_shape[layout.dim_names.index("N")]


class KVConnector(ABC):
    """Base class of KV connectors.

    Subclasses implement :meth:`_save`, :meth:`_load` and :meth:`_lookup` (arguments already
    validated), :meth:`_register` and :meth:`_close`. They read and write
    blocks with :meth:`_read_blocks` / :meth:`_write_blocks`, which handle both cache kinds.

    Args:
        failure_policy: ``"recompute"`` (default) or ``"fail"``, see :data:`FAILURE_POLICIES`.
    """

    #: Whether this connector gains from cross-layer caches (a whole block is one copy).
    #: Engines allocate with ``cross_layer=connector_cls.cross_layer_for(backend)``.
    prefer_cross_layer_blocks: ClassVar[bool] = False

    def __init__(self, *, failure_policy: str = "recompute") -> None:
        if failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy={failure_policy!r} must be one of "
                             f"{', '.join(map(repr, FAILURE_POLICIES))}")
        self.failure_policy = failure_policy
        self.stats = ConnectorStats()
        self._stats_lock = threading.Lock()
        self._reg: RegisteredCaches | None = None
        self._closed = False

    @classmethod
    def cross_layer_for(cls, backend: type[AttentionBackend], platform: str | None = None
                        ) -> bool:
        """The ``cross_layer`` argument of :func:`kvcore.allocate_kv_caches` this connector
        wants with ``backend``: cross-layer when both prefer and support it (on ``platform``,
        a platform name, when given: see :attr:`AttentionBackend.CROSS_LAYER_PLATFORMS`)."""
        return cls.prefer_cross_layer_blocks and backend.supports_cross_layer(platform)

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        """Attach the model's KV caches; call once, before any save or load.

        The cache must be blocks-first (a backend that is not raises ``ValueError`` naming its
        alternative). Cross-layer caches move one contiguous run per block.
        """
        self._check_open()
        if not isinstance(kv_caches, KVCaches):
            raise TypeError(f"kv_caches must be a kvcore.KVCaches (from allocate_kv_caches), "
                            f"got {type(kv_caches).__name__}")
        if self._reg is not None:
            raise ValueError(f"{type(self).__name__} already has KV caches registered "
                             "(register_kv_caches is called once per connector)")
        views = ([kv_caches.block_view()] if kv_caches.is_cross_layer
                 else kv_caches.layer_block_views())  # raises if not blocks-first
        reg = RegisteredCaches(kv_caches, views)
        self._register(reg)
        self._reg = reg

    @property
    def kv_caches(self) -> KVCaches:
        return self._registered().kv_caches

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer: ``num_layers * page_size_bytes``."""
        if self._reg is None:  # no open check: transfers finishing during close() ask too
            raise ValueError(f"{type(self).__name__} has no KV caches: call "
                             "register_kv_caches(kv_caches) first")
        kv = self._reg.kv_caches
        return kv.num_layers * kv.page_size_bytes

    def save(self, keys: Sequence[str], block_ids: Sequence[int] | torch.Tensor
             ) -> TransferHandle:
        """Start saving block ``block_ids[i]`` under ``keys[i]``; returns a handle.

        Keys must be distinct hex digests (see :func:`hash_block_tokens`). Connectors that
        store blocks (``offload``, ``storage``) count a key they hold already as saved, without
        a copy. Failures are per block, in the result.
        """
        keys, ids = self._check_transfer("save", keys, block_ids)
        if len(set(keys)) != len(keys):
            repeated = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"keys repeats {repeated}; each block is saved under its own key")
        return self._save(keys, ids)

    def load(self, keys: Sequence[str], block_ids: Sequence[int] | torch.Tensor
             ) -> TransferHandle:
        """Start loading ``keys[i]`` into block ``block_ids[i]``; returns a handle.

        Destination ids must be distinct. Each block either arrives whole and verified, or is
        listed in the result's ``failed`` with the reason (the engine recomputes it).
        """
        keys, ids = self._check_transfer("load", keys, block_ids)
        if len(set(ids)) != len(ids):
            repeated = sorted({b for b in ids if ids.count(b) > 1})
            raise ValueError(f"block_ids repeats {repeated}; a load writes each destination "
                             "block once")
        return self._load(keys, ids)

    # -- scheduler side ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` can be loaded now (stops at the first missing one)."""
        self._registered()
        keys = check_block_keys(keys)
        hits = self._lookup(keys)
        with self._stats_lock:
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
        return hits

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish or abandon transfers and release resources; idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for subclasses ---------------------------------------------------------------------

    @abstractmethod
    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle: ...

    @abstractmethod
    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle: ...

    @abstractmethod
    def _lookup(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _register(self, reg: RegisteredCaches) -> None:
        """Prepare for ``reg`` (allocate pools, connect to peers); raise to refuse it."""

    @abstractmethod
    def _close(self) -> None:
        """Release resources (called once, registered or not)."""

    def _read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Gather blocks into a new ``(len(block_ids), block_bytes)`` uint8 tensor on the
        cache's device, each row ``(num_layers, page_size_bytes)`` layer-major."""
        views = self._reg.views
        parts = [extract_kv_from_layer(v, block_ids) for v in views]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _write_blocks(self, block_ids: Sequence[int], data: torch.Tensor, request: str) -> None:
        """Scatter ``data`` (``(len(block_ids), block_bytes)`` uint8, any device) into the
        blocks; ``request`` names the transfer in errors."""
        views = self._reg.views
        offset = 0
        for view in views:
            width = view.shape[1]
            inject_kv_into_layer(view, data[:, offset:offset + width], block_ids, request)
            offset += width

    def _caller_fence(self) -> Callable[[], None]:
        """For work handed to another thread: a function that waits until what the calling
        thread queued on its CUDA stream so far (e.g. the kernels writing the blocks being
        saved) has run. A no-op for CPU caches."""
        storage = self._registered().kv_caches.storage
        if not storage.is_cuda:
            return lambda: None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(storage.device))
        return event.synchronize

    def _record(self, result: TransferResult) -> TransferResult:
        """Add a finished transfer to :attr:`stats` (call from ``collect``)."""
        with self._stats_lock:
            if result.op == "save":
                self.stats.saved_blocks += len(result.succeeded)
                self.stats.saved_bytes += result.num_bytes
                self.stats.save_seconds += result.seconds
            else:
                self.stats.loaded_blocks += len(result.succeeded)
                self.stats.loaded_bytes += result.num_bytes
                self.stats.load_seconds += result.seconds
            self.stats.failed_blocks += len(result.failed)
        if result.failed:
            logger.info("%s %s: %d blocks failed, first: %s", type(self).__name__, result.op,
                        len(result.failed), next(iter(result.failed.values())))
        return result

    def _result(self, op: Op, succeeded: Sequence[int], failed: Mapping[int, str],
                num_bytes: int, seconds: float) -> TransferResult:
        return TransferResult(op, tuple(succeeded), MappingProxyType(dict(failed)),
                              num_bytes, seconds)

    def _finished(self, op: Op, succeeded: Sequence[int], failed: Mapping[int, str],
                  num_bytes: int, started: float) -> TransferHandle:
        """A completed handle for a transfer done synchronously since ``started``."""
        result = self._record(self._result(op, succeeded, failed, num_bytes,
                                           time.perf_counter() - started))
        return TransferHandle.completed(op, self.failure_policy, result)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{type(self).__name__} is closed")

    def _registered(self) -> RegisteredCaches:
        self._check_open()
        if self._reg is None:
            raise ValueError(f"{type(self).__name__} has no KV caches: call "
                             "register_kv_caches(kv_caches) first")
        return self._reg

    def _check_transfer(self, op: Op, keys: Sequence[str],
                        block_ids: Sequence[int] | torch.Tensor) -> tuple[list[str], list[int]]:
        num_blocks = self._registered().kv_caches.num_blocks
        keys = check_block_keys(keys)
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"block_ids must be a 1-D int32/int64 tensor, got "
                                f"{block_ids.dtype} shape {tuple(block_ids.shape)}")
            block_ids = block_ids.tolist()
        elif isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise TypeError(f"block_ids must be a sequence of ints or a 1-D integer tensor, "
                            f"got {type(block_ids).__name__}")
        ids = list(block_ids)
        # Ints within the cache, checked in a few passes of C code; otherwise the loop below
        # names the first bad entry.
        if not ids or set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= num_blocks:
            for i, b in enumerate(ids):
                if isinstance(b, bool) or not isinstance(b, int):
                    raise TypeError(f"block_ids[{i}]={b!r} must be an int")
                if not 0 <= b < num_blocks:
                    raise ValueError(f"block_ids[{i}]={b} is outside the cache's {num_blocks} "
                                     f"blocks (valid: 0..{num_blocks - 1})")
        want = len(keys) if op == "save" else self._blocks_for_keys(len(keys))
        if len(ids) != want:
            if want == len(keys):
                raise ValueError(f"{op}: keys has {len(keys)} entries but block_ids has "
                                 f"{len(ids)}; pass one key per block")
            raise ValueError(f"{op}: keys has {len(keys)} entries, blocks of the peer's "
                             f"{self._key_tokens()} tokens, which fill {want} block(s) of this "
                             f"cache's {layout_block_size(self.kv_caches.layout)} tokens, but "
                             f"block_ids has {len(ids)}; pass the blocks those tokens occupy "
                             "here (see docs/connector.md, 'Block sizes that differ')")
        return keys, ids

    @property
    def key_block_size(self) -> int:
        """Tokens one key of :meth:`load` names: this cache's block size, or, for a
        connector that converts from a peer with another block size (``nixl``,
        ``mooncake``, ``p2p``), the peer's (known once registered). Compute a load's keys
        with ``hash_request_tokens(tokens, connector.key_block_size)``; its ``block_ids``
        are this cache's blocks those tokens fill (see :meth:`blocks_for_keys`)."""
        self._registered()
        return self._key_tokens()

    def blocks_for_keys(self, num_keys: int) -> int:
        """How many of this cache's blocks a :meth:`load` of ``num_keys`` keys takes (the
        last one maybe filled only in part): ``num_keys`` unless block sizes differ."""
        self._registered()
        return self._blocks_for_keys(num_keys)

    def _load_plan(self) -> ConversionPlan | None:
        """The conversion a load applies, when the keys may name a peer's blocks of another
        size (a converting connector overrides this); ``None``: one key a block."""
        return None

    def _blocks_for_keys(self, num_keys: int) -> int:
        """How many of this cache's blocks a load of ``num_keys`` keys fills."""
        plan = self._load_plan()
        return num_keys if plan is None else plan.blocks_for_keys(num_keys)

    def _key_tokens(self) -> int:
        """Tokens one key of a load names."""
        plan = self._load_plan()
        return layout_block_size(self.kv_caches.layout) if plan is None \
            else plan.src_block_size

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            "unregistered" if self._reg is None else str(self._reg.kv_caches.layout))
        return f"{type(self).__name__}({state})"

