"""``offload``: keep KV blocks in a bounded CPU memory pool, evicting the least recently used.

The pool is allocated once, when the KV caches are registered: ``capacity_bytes //
block_bytes`` slots, pinned when the cache is on a CUDA device so copies are asynchronous DMA.
It is laid out like the cache so that runs of consecutive blocks copy as one run:

- cross-layer cache: ``(1, num_slots, num_layers * page_size_bytes)``; a block is one copy
  (and consecutive blocks in consecutive slots merge into one copy);
- per-layer cache: ``(num_layers, num_slots, page_size_bytes)``; each layer copies each run
  of consecutive blocks with one copy.

On CUDA, saves run on one side stream and loads on another (so both directions of the bus work
at once), ordered after the engine's current stream, and a handle completes on a CUDA event.
On CPU, copies are synchronous and handles are complete when returned.

A block with a transfer in flight (a save not yet complete, a load reading its slot) is never
evicted; if every slot is in flight, saving more fails for those blocks.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvcore.connectors.base import (
    KVConnector,
    KVTransferError,
    Op,
    RegisteredCaches,
    TransferHandle,
    TransferResult,
)

__all__ = ["OffloadConnector"]


@dataclass
class _Entry:
    slot: int
    #: Transfers in flight that use this slot; the entry is evictable only at 0.
    pins: int = 0
    #: CUDA event after which the slot holds the block (a save still running), else None.
    ready: torch.cuda.Event | None = None


class _SlotIndex:
    """Key -> host slot in least-recently-used order (oldest first). Callers hold a lock."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # Lowest free slot first: blocks saved together land in consecutive slots and their
        # copies merge into runs.
        self._free = list(range(num_slots))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key: str) -> _Entry | None:
        """The entry of ``key`` (marking it most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def allocate(self, key: str) -> _Entry | None:
        """A slot for ``key``: a free one, else the least recently used entry's that has no
        transfer in flight; None if every slot is in flight."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = next((k for k, e in self._entries.items() if e.pins == 0), None)
            if victim is None:
                return None
            slot = self._entries.pop(victim).slot
            self.evictions += 1
        entry = self._entries[key] = _Entry(slot)
        return entry

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key)
        heapq.heappush(self._free, entry.slot)


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(block_id, slot)`` pairs as ``(first_block, first_slot, count)`` runs where both
    advance by one, so each run is a single copy."""
    runs: list[list[int]] = []
    for block, slot in sorted(pairs):
        if runs and block == runs[-1][0] + runs[-1][2] and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([block, slot, 1])
    return [(b, s, n) for b, s, n in runs]


class OffloadConnector(KVConnector):
    """Offload KV blocks to CPU memory and load them back (connector name ``offload``).

    Args:
        capacity_bytes: size of the CPU pool; it holds ``capacity_bytes // block_bytes``
            blocks (``block_bytes = num_layers * page_size_bytes``).
        failure_policy: ``"recompute"`` or ``"fail"`` (see :data:`FAILURE_POLICIES`).
    """

    prefer_cross_layer_blocks = True  # a whole block is then one copy

    def __init__(self, *, capacity_bytes: int, failure_policy: str = "recompute") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be a positive integer")
        super().__init__(failure_policy=failure_policy)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._pending: list[TransferHandle] = []

    def _register(self, reg: RegisteredCaches) -> None:
        kv = reg.kv_caches
        block_bytes = kv.num_layers * kv.page_size_bytes
        num_slots = self.capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"capacity_bytes={self.capacity_bytes} holds no block: a block of this cache "
                f"is {block_bytes} bytes ({kv.num_layers} layers x {kv.page_size_bytes})"
            )
        device = kv.storage.device
        self._async = device.type == "cuda"
        # Pinned host memory is what lets a device copy run asynchronously.
        self._host = torch.empty((len(reg.views), num_slots, reg.views[0].shape[1]),
                                 dtype=torch.uint8, pin_memory=self._async)
        self._host_views = list(self._host.unbind(0))
        self._index = _SlotIndex(num_slots)
        if self._async:
            self._streams = {"save": torch.cuda.Stream(device), "load": torch.cuda.Stream(device)}

    @property
    def num_slots(self) -> int:
        """How many blocks the pool holds."""
        self._registered()
        return self._index.num_slots

    def cached_keys(self) -> list[str]:
        """Keys in the pool, least recently used first (the next eviction candidate first)."""
        self._registered()
        with self._lock:
            return self._index.keys()

    # -- transfers --------------------------------------------------------------------------

    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        self._reap()
        started = time.perf_counter()
        present: list[int] = []
        failed: dict[int, str] = {}
        todo: list[tuple[int, str, _Entry]] = []
        # The copies are issued under the lock: a load that finds a new entry must also find
        # the event its data waits for (or, on CPU, the data).
        with self._lock:
            evictions = self._index.evictions
            for key, block in zip(keys, block_ids, strict=True):
                if self._index.get(key) is not None:
                    present.append(block)
                    continue
                entry = self._index.allocate(key)
                if entry is None:
                    failed[block] = (f"CPU pool full: all {self._index.num_slots} slots hold "
                                     "blocks with transfers in flight")
                    continue
                entry.pins += 1
                todo.append((block, key, entry))
            evicted = self._index.evictions - evictions
            try:
                events = self._copy("save", [(b, e.slot) for b, _, e in todo], [])
            except BaseException:
                for _, key, _ in todo:
                    self._index.discard(key)
                raise
            if events is not None:
                for _, _, entry in todo:
                    entry.ready = events[1]
        with self._stats_lock:
            self.stats.evictions += evicted
        return self._handle("save", present + [b for b, _, _ in todo], failed,
                            [e for _, _, e in todo], events, started)

    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        self._reap()
        started = time.perf_counter()
        failed: dict[int, str] = {}
        todo: list[tuple[int, _Entry]] = []
        with self._lock:
            for key, block in zip(keys, block_ids, strict=True):
                entry = self._index.get(key)
                if entry is None:
                    failed[block] = (f"key {key} is not in the CPU pool (never saved, or "
                                     "evicted)")
                    continue
                entry.pins += 1
                todo.append((block, entry))
            saves = list({id(e.ready): e.ready for _, e in todo if e.ready is not None}.values())
        try:
            event = self._copy("load", [(b, e.slot) for b, e in todo], saves)
        except BaseException:
            with self._lock:
                for _, entry in todo:
                    entry.pins -= 1
            raise
        return self._handle("load", [b for b, _ in todo], failed, [e for _, e in todo], event,
                            started)

    def _lookup(self, keys: list[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if self._index.get(key) is None:
                    return i
            return len(keys)

    def _copy(self, op: Op, pairs: list[tuple[int, int]], after: list[torch.cuda.Event]
              ) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Copy ``(block_id, slot)`` pairs in direction ``op``; on CUDA, asynchronously on the
        op's side stream after ``after`` events, returning its (start, end) events."""
        runs = _runs(pairs)
        views = self._registered().views

        def copy_runs() -> None:
            for device_view, host_view in zip(views, self._host_views, strict=True):
                for block, slot, n in runs:
                    dev, host = device_view[block:block + n], host_view[slot:slot + n]
                    if op == "save":
                        host.copy_(dev, non_blocking=self._async)
                    else:
                        dev.copy_(host, non_blocking=self._async)

        if not self._async:
            copy_runs()
            return None
        stream = self._streams[op]
        # Saves read what the engine's stream wrote; loads overwrite what it may still read.
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        for event in after:  # a load of a block whose save is still running
            stream.wait_event(event)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            copy_runs()
            end.record(stream)
        return start, end

    def _handle(self, op: Op, succeeded: list[int], failed: dict[int, str],
                entries: list[_Entry], events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
                started: float) -> TransferHandle:
        num_bytes = len(entries) * self.block_bytes

        def release() -> None:
            with self._lock:
                for entry in entries:
                    entry.pins -= 1
                    if events is not None and entry.ready is events[1]:
                        entry.ready = None

        if events is None:
            release()
            return self._finished(op, succeeded, failed, num_bytes, started)
        start, end = events

        def block(timeout: float | None) -> bool:
            if timeout is None:
                end.synchronize()
                return True
            deadline = time.monotonic() + timeout
            while not end.query():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(50e-6)
            return True

        def collect() -> TransferResult:
            release()
            seconds = start.elapsed_time(end) / 1e3 if entries else 0.0
            return self._record(self._result(op, succeeded, failed, num_bytes, seconds))

        handle = TransferHandle(op, self.failure_policy, end.query, block, collect)
        with self._lock:
            self._pending.append(handle)
        return handle

    def _reap(self) -> None:
        """Collect finished transfers nobody waited for, so their slots become evictable."""
        with self._lock:
            pending, self._pending = self._pending, []
        running = [h for h in pending if not h.done()]
        with self._lock:
            self._pending.extend(running)

    def _close(self) -> None:
        if self._reg is None:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for handle in pending:  # the pool must outlive every copy into or out of it
            try:
                handle.wait()
            except KVTransferError:  # nobody waits for this result any more
                pass
        del self._host, self._host_views
