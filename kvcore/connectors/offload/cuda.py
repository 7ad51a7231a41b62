"""CUDA side of the pool: stream ordering helpers, the pinned block-id ring, staging buffers.

The stream helpers take ``None`` for a stream or event and then do nothing, so the connector's
staged path runs the same code synchronously on CPU tensors; the id ring is CUDA only.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["IdUploader", "Staging", "on_stream", "record_event", "wait_for_event"]


def on_stream(stream: torch.cuda.Stream | None) -> AbstractContextManager:
    """``torch.cuda.stream(stream)``, or nothing when ``stream`` is None."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` now, or None when ``stream`` is None."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_for_event(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    """Make ``stream`` wait for ``event`` (on the device); nothing if either is None."""
    if stream is not None and event is not None:
        stream.wait_event(event)


class IdUploader:
    """Block ids to the device without ever blocking the host (CUDA only).

    Pinning host memory per transfer calls ``cudaHostAlloc``, which waits until the device
    is idle: a save issued behind a busy engine stream would return only once that stream
    drained. Instead, ids are written into a pinned ring allocated once and copied on a
    stream of their own that waits for nothing, so each copy finishes within microseconds
    even while the engine's stream is busy, and a region of the ring is free again almost at
    once. (Copied on the kernel stream, behind the engine's work, a region would stay in use
    until the engine drained; writing it again before that would change the ids of a gather
    not yet run.) Reusing a region whose copy has not finished waits for that copy, which
    depends on nothing but the bus. The device tensor is allocated on the upload stream and
    recorded on the consuming stream, so the caching allocator hands its memory out again
    only after the consumer's kernels have run.
    """

    def __init__(self, device: torch.device, entries: int) -> None:
        self._host = torch.empty(entries, dtype=torch.int64, pin_memory=True)
        self._stream = torch.cuda.Stream(device)
        self._device = device
        self._next = 0
        #: ``(start, stop, event)`` of ring regions whose copies may still run, oldest first.
        self._busy: deque[tuple[int, int, torch.cuda.Event]] = deque()
        self._lock = threading.Lock()

    def upload(self, ids: list[int], consumer: torch.cuda.Stream) -> torch.Tensor:
        """``ids`` as an int64 device tensor that ``consumer`` may use from now on."""
        entries = self._host.numel()
        values = torch.tensor(ids, dtype=torch.int64)
        with self._lock, torch.cuda.stream(self._stream):
            out = torch.empty(len(ids), dtype=torch.int64, device=self._device)
            for first in range(0, len(ids), entries):
                piece = values[first:first + entries]
                start, stop = self._region(piece.numel())
                self._host[start:stop].copy_(piece)
                out[first:first + piece.numel()].copy_(self._host[start:stop],
                                                      non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
                self._busy.append((start, stop, copied))
        consumer.wait_stream(self._stream)
        out.record_stream(consumer)
        return out

    def _region(self, n: int) -> tuple[int, int]:
        """A free ``[start, stop)`` of the ring for ``n`` ids (``n`` <= its size)."""
        start = self._next if self._next + n <= self._host.numel() else 0
        stop = start + n
        overlapping = [i for i, (a, b, _) in enumerate(self._busy) if a < stop and start < b]
        if overlapping:
            # One stream: once the newest overlapping copy is done, so are all older ones.
            last = overlapping[-1]
            self._busy[last][2].synchronize()
            for _ in range(last + 1):
                self._busy.popleft()
        while self._busy and self._busy[0][2].query():
            self._busy.popleft()
        self._next = stop
        return start, stop


class Staging:
    """One direction's two device staging buffers, and when each is free again."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
        #: Event after which buffer ``i`` may be overwritten (None: now).
        self.free: list[torch.cuda.Event | None] = [None, None]
        self.next = 0

    def take(self) -> int:
        """The index of the buffer to use next (the two alternate)."""
        i, self.next = self.next, self.next ^ 1
        return i
