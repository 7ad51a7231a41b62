"""The pool's index: which host slot holds which key, in least-recently-used order."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass

import torch

__all__ = ["SlotEntry", "SlotIndex"]


@dataclass
class SlotEntry:
    """The slot of one key in the pool, and the transfers that use it."""

    slot: int
    #: Transfers in flight that use this slot; the entry is evictable only at 0.
    pins: int = 0
    #: CUDA event after which the slot holds the block (a save still running), else None.
    ready: torch.cuda.Event | None = None


class SlotIndex:
    """Key -> host slot in least-recently-used order (oldest first). Callers hold a lock.

    Free slots are handed out lowest first; when none is free, the least recently used entry
    without a transfer in flight (``pins == 0``), and not one the caller keeps, is evicted.
    """

    def __init__(self, num_slots: int, available: int | None = None) -> None:
        self.num_slots = num_slots
        #: Slots ``0 .. available - 1`` may be handed out (the rest are not ready yet, e.g.
        #: still being pinned); :meth:`grow` raises it.
        self.available = num_slots if available is None else available
        self._entries: OrderedDict[str, SlotEntry] = OrderedDict()
        # Lowest free slot first: blocks saved together land in consecutive slots and their
        # copies merge into runs.
        self._free = list(range(self.available))
        #: Entries evicted so far.
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key: str) -> SlotEntry | None:
        """The entry of ``key`` (marking it most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def allocate(self, key: str, keep: Container[str] = ()) -> SlotEntry | None:
        """A slot for ``key``: a free one, else the least recently used entry's that has no
        transfer in flight and is not in ``keep`` (e.g. the keys a save counts as stored);
        None if there is no such entry."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = next((k for k, e in self._entries.items()
                           if e.pins == 0 and k not in keep), None)
            if victim is None:
                return None
            slot = self._entries.pop(victim).slot
            self.evictions += 1
        entry = self._entries[key] = SlotEntry(slot)
        return entry

    def grow(self, available: int) -> None:
        """Make slots up to ``available`` (at most ``num_slots``) free to hand out."""
        available = min(available, self.num_slots)
        for slot in range(self.available, available):
            heapq.heappush(self._free, slot)
        self.available = max(self.available, available)

    def discard(self, key: str) -> None:
        """Remove ``key``; its slot is free again."""
        entry = self._entries.pop(key)
        heapq.heappush(self._free, entry.slot)
