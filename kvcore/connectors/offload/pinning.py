"""The pool's host memory: separately pinned chunks, allocated in the background.

Pinning is what makes host<->device copies asynchronous DMA, and it is slow: the kernel faults
in and locks every page (seconds for tens of GiB). Allocating the pool as one
``torch.empty(..., pin_memory=True)`` does all of it at once, on the registering thread, before
the engine can start. :class:`HostPool` instead allocates the pool as chunks of whole slots,
each its own ``torch.empty(..., pin_memory=True)`` (torch's pinned host allocator, the memory
every torch copy path recognises as pinned): the first one before the constructor returns, the
rest on worker threads.

**Background pinning waits for the caller's CUDA set-up.** ``cudaHostAlloc`` (what torch's
pinned allocator calls) holds a lock of the CUDA driver for the whole allocation, and most
other driver calls of the process (stream and event creation, device allocations, kernel
launches, copies, synchronisation) wait for it. Workers allocating back to back therefore
starve the registering thread: its own set-up (staging buffers, streams, kernel warm-up)
finished only once (nearly) every chunk was pinned, so registration did not return early.
So with ``background=True`` the constructor allocates the first chunk only, and the workers
start when the caller says its set-up is done (:meth:`HostPool.start`). They then allocate one
chunk at a time, smaller chunks (:data:`PIN_BACKGROUND_CHUNK_BYTES`), pausing between them so a
waiting driver call of the engine gets the lock: an engine call waits for at most about one
chunk's allocation. ``background=False`` allocates with :data:`PIN_WORKERS` threads and waits.

**Only pinned slots are used.** :meth:`HostPool.ready_slots` counts the slots of the chunks
allocated so far, in order (chunks may finish out of order; a later chunk counts once every
earlier one is done). The connector hands out only those slots, so no transfer ever touches a
chunk that does not exist yet: the pool grows under the engine instead of blocking its start.
A run of consecutive slots may span two chunks; :meth:`HostPool.pieces` cuts it at chunk
boundaries (one copy per piece).

torch's pinned allocator rounds every allocation up to a power of two, so a chunk is sized to
fill one (``chunk_bytes``, a power of two, holds ``chunk_bytes // slot_bytes`` slots, losing
less than a slot) and more is lost only in the last chunk: it is rounded up too, so up to
half of ``chunk_bytes`` there. :meth:`HostPool.close` returns the memory to the system (torch
would otherwise keep it pinned in its cache).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from kvcore.progress import long_step

__all__ = ["PIN_BACKGROUND_CHUNK_BYTES", "PIN_CHUNK_BYTES", "PIN_PAUSE_S", "PIN_WORKERS",
           "HostPool", "pinned_rows"]

logger = logging.getLogger(__name__)

#: Bytes of one chunk (a power of two, see the module docstring; at least one slot).
PIN_CHUNK_BYTES = 256 << 20
#: Bytes of one chunk when pinning in the background: smaller, so an engine's driver call
#: waiting behind one allocation waits less.
PIN_BACKGROUND_CHUNK_BYTES = 64 << 20
#: Worker threads allocating chunks at once (``background=False``; in the background one).
PIN_WORKERS = 2
#: Seconds a background worker pauses between chunks, leaving the driver lock to the engine.
PIN_PAUSE_S = 0.002

#: ``(rows, row_bytes)`` -> a uint8 ``(rows, row_bytes)`` host tensor; raises on failure.
AllocFn = Callable[[int, int], torch.Tensor]


def pinned_rows(rows: int, row_bytes: int) -> torch.Tensor:
    """``(rows, row_bytes)`` uint8 memory from torch's pinned host allocator."""
    return torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=True)


def _plain_rows(rows: int, row_bytes: int) -> torch.Tensor:
    return torch.empty((rows, row_bytes), dtype=torch.uint8)


class HostPool:
    """``num_slots`` host slots of ``slot_bytes`` bytes in chunks that become usable as they
    are allocated.

    Args:
        num_slots, slot_bytes: the pool's shape.
        pin: allocate pinned memory (``False``: plain memory, one chunk, every slot ready at
            once).
        background: return once the first chunk is allocated; the others follow on a worker
            thread once :meth:`start` is called (after the caller's own CUDA set-up, see the
            module docstring), one at a time. ``False``: every chunk before returning, on
            ``workers`` threads.
        chunk_bytes: chunk size (whole slots, at least one); default
            :data:`PIN_BACKGROUND_CHUNK_BYTES` in the background, else :data:`PIN_CHUNK_BYTES`.
        workers: threads allocating at once when ``background=False``.
        alloc_fn: how a chunk is allocated (default: :func:`pinned_rows`; tests pass
            stand-ins).

    Attributes:
        startup_seconds: time the constructor blocked (the first chunk, or all of them).
        pinned_seconds: time until every chunk was allocated (``None`` while that goes on).
        error: the first allocation failure (the slots from that chunk on stay unusable), else
            ``None``.
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, pin: bool, background: bool = True,
                 chunk_bytes: int | None = None, workers: int = PIN_WORKERS,
                 alloc_fn: AllocFn | None = None) -> None:
        started = time.perf_counter()
        if chunk_bytes is None:
            chunk_bytes = PIN_BACKGROUND_CHUNK_BYTES if background else PIN_CHUNK_BYTES
        self._lock = threading.Lock()
        self._closed = False
        self._finished = threading.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._started = started
        self._background = background
        self._workers = max(1, workers)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.error: str | None = None
        self.pinned_seconds: float | None = None
        self._pinned = pin
        self._alloc = alloc_fn or (pinned_rows if pin else _plain_rows)
        #: Slots per chunk (every chunk but the last holds exactly this many).
        self.chunk_slots = (num_slots if not pin and alloc_fn is None
                            else max(1, min(num_slots, chunk_bytes // slot_bytes)))
        count = -(-num_slots // self.chunk_slots)
        self._chunks: list[torch.Tensor | None] = [None] * count
        self._pending = count  # chunks not yet allocated (nor failed nor skipped)
        self._ready = 0  # chunks 0 .. _ready - 1 are allocated
        # What the caller waits for here: the first chunk, or (not in the background) all.
        waited = num_slots if not background else min(num_slots, self.chunk_slots)
        step = (long_step(f"offload: pinning {waited * slot_bytes / 2**30:.2f} GiB of host "
                          "memory for the CPU pool", estimate="seconds per tens of GiB")
                if pin else contextlib.nullcontext())
        with step:
            self._allocate(0)  # usable at once
            if count > 1 and self.error is not None:  # the first chunk failed: no more
                self._pending = 0
                self._finish()
            elif not background:
                self.start()
                self._finished.wait()
        self.startup_seconds = time.perf_counter() - started

    def start(self) -> None:
        """Start allocating the other chunks (``background=True``: call it once the caller's
        own CUDA set-up is done; with ``background=False`` the constructor did). Calling it
        again does nothing."""
        with self._lock:
            if self._executor is not None or self._closed or not self._pending:
                return
            pause = PIN_PAUSE_S if self._background and self._pinned else 0.0
            self._executor = ThreadPoolExecutor(1 if self._background else self._workers,
                                                thread_name_prefix="kvcore-pin")
            for i in range(1, len(self._chunks)):
                self._executor.submit(self._allocate, i, pause)

    def ready_slots(self) -> int:
        """Slots ``0 .. ready_slots() - 1`` are usable (all of them once allocation is over)."""
        with self._lock:
            return min(self.num_slots, self._ready * self.chunk_slots)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until allocation is over (every chunk done, or one failed); False on
        timeout (also before :meth:`start` of a background pool)."""
        return self._finished.wait(timeout)

    def is_pinned(self) -> bool:
        """Whether every chunk allocated so far is pinned memory (as torch sees it)."""
        with self._lock:
            chunks = self._chunks[:self._ready]  # allocated, all of them
        return bool(chunks) and all(c.is_pinned() for c in chunks)

    def pieces(self, slot: int, count: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Slots ``slot .. slot + count - 1`` (all ready) as ``(offset, rows)`` pieces, one per
        chunk they touch: ``rows`` is the ``(n, slot_bytes)`` uint8 view of slots
        ``slot + offset ..``."""
        offset = 0
        while offset < count:
            index, first = divmod(slot + offset, self.chunk_slots)
            chunk = self._chunks[index]
            n = min(count - offset, self.chunk_slots - first)
            yield offset, chunk[first:first + n]
            offset += n

    def chunk_of(self, slot: int) -> tuple[int, int]:
        """``(chunk index, row in that chunk)`` of ``slot``."""
        return divmod(slot, self.chunk_slots)

    def chunk(self, index: int) -> torch.Tensor:
        """Chunk ``index`` (allocated), ``(slots in it, slot_bytes)`` uint8."""
        chunk = self._chunks[index]
        if chunk is None:
            raise RuntimeError(f"chunk {index} of the CPU pool is not allocated")
        return chunk

    def rows(self, slots: list[int]) -> torch.Tensor:
        """A copy of ``slots`` (all ready), ``(len(slots), slot_bytes)``: for inspection."""
        out = torch.empty((len(slots), self.slot_bytes), dtype=torch.uint8)
        for i, slot in enumerate(slots):
            index, row = self.chunk_of(slot)
            out[i] = self.chunk(index)[row]
        return out

    def _allocate(self, i: int, pause: float = 0.0) -> None:
        if pause:
            time.sleep(pause)
        with self._lock:
            if self._closed or self.error is not None:
                self._mark()
                return
        rows = min(self.chunk_slots, self.num_slots - i * self.chunk_slots)
        try:
            chunk = self._alloc(rows, self.slot_bytes)
        except Exception as exc:  # reported; the pool just stays smaller
            with self._lock:
                if self.error is None:
                    self.error = (f"allocating {'pinned ' if self._pinned else ''}slots from "
                                  f"{i * self.chunk_slots} on of the CPU pool failed: "
                                  f"{type(exc).__name__}: {exc}; the pool keeps the "
                                  f"{min(self.num_slots, self._ready * self.chunk_slots)}"
                                  " slots allocated before them")
                    logger.warning("offload: %s", self.error)
                self._mark()
            return
        with self._lock:
            if self._closed:
                chunk = None
            self._chunks[i] = chunk
            self._mark()

    def _mark(self) -> None:
        """Record one more chunk as finished (lock held) and advance the ready prefix over the
        chunks allocated in order."""
        self._pending -= 1
        while self._ready < len(self._chunks) and self._chunks[self._ready] is not None:
            self._ready += 1
        if not self._pending:
            self._finish()

    def _finish(self) -> None:
        self.pinned_seconds = time.perf_counter() - self._started
        self._finished.set()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def close(self) -> None:
        """Stop allocating, wait for the workers, free the chunks. Call once no transfer uses
        the pool any more; calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._chunks = [None] * len(self._chunks)
            self._ready = 0
        if self._pinned and torch.cuda.is_initialized():
            # torch keeps freed pinned blocks cached (still locked); give them back. (The public
            # call is torch.accelerator.empty_host_cache where it exists; older torch only
            # has the private binding.)
            empty = (getattr(torch.accelerator, "empty_host_cache", None)
                     or getattr(torch._C, "_host_emptyCache", None))
            if empty is not None:
                empty()
        self._finished.set()
