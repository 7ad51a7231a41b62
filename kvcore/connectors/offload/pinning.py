"""The pool's host memory, pinned in slot-aligned chunks by worker threads, in the background.

Pinning is what makes host<->device copies asynchronous DMA, and it is slow: the kernel faults
in and locks every page (seconds for tens of GiB). Allocating the pool with
``torch.empty(..., pin_memory=True)`` does all of it at once, on the registering thread, before
the engine can start. :class:`HostPool` instead allocates pageable memory and pins it in chunks
of whole slots with ``cudaHostRegister``, several chunks at a time on worker threads (page
faulting and locking scale with threads). The first chunk is pinned before the constructor
returns, the rest in the background (or before it returns, with ``background=False``).

**Only pinned slots are used.** :meth:`HostPool.ready_slots` is the length of the pinned
*prefix* of the pool (chunks finish out of order; a later chunk counts once every earlier one
is done). The connector hands out only slots below it, so no transfer ever touches memory that
is not pinned yet: the pool grows under the engine instead of blocking its start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["PIN_CHUNK_BYTES", "PIN_WORKERS", "HostPool"]

logger = logging.getLogger(__name__)

#: Bytes one worker pins per call (rounded down to whole slots, at least one slot).
PIN_CHUNK_BYTES = 256 << 20
#: Worker threads pinning at once.
PIN_WORKERS = 4

#: ``(data_ptr, nbytes)``: pin (page-lock) host memory for the device; raise on failure.
PinFn = Callable[[int, int], None]
#: ``data_ptr``: undo :data:`PinFn` for the region starting there.
UnpinFn = Callable[[int], None]


def cuda_pin(data_ptr: int, nbytes: int) -> None:
    """``cudaHostRegister`` (portable), raising ``RuntimeError`` with CUDA's error."""
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(data_ptr, nbytes, 1)))


def cuda_unpin(data_ptr: int) -> None:
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(data_ptr)))


class HostPool:
    """``(num_slots, slot_bytes)`` uint8 host memory whose slots become usable as they are
    pinned.

    Args:
        num_slots, slot_bytes: the pool's shape.
        pin: page-lock the memory (``False``: plain memory, every slot ready at once).
        background: pin the chunks after the first one on worker threads after returning
            (``False``: before returning, still in parallel).
        chunk_bytes, workers: pinning granularity and parallelism.
        pin_fn, unpin_fn: how to pin and unpin a region (default: ``cudaHostRegister`` /
            ``cudaHostUnregister``; tests pass stand-ins).

    Attributes:
        tensor: the memory.
        startup_seconds: time the constructor blocked (allocation and the first chunk).
        pinned_seconds: time until every chunk was pinned (``None`` while pinning goes on).
        error: the first pinning failure (the slots from that chunk on stay unusable), else
            ``None``.
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, pin: bool, background: bool = True,
                 chunk_bytes: int = PIN_CHUNK_BYTES, workers: int = PIN_WORKERS,
                 pin_fn: PinFn | None = None, unpin_fn: UnpinFn | None = None) -> None:
        started = time.perf_counter()
        self.tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8)
        self.num_slots = num_slots
        self.error: str | None = None
        self.pinned_seconds: float | None = None
        self._pin = pin_fn or cuda_pin
        self._unpin = unpin_fn or cuda_unpin
        self._lock = threading.Lock()
        self._closed = False
        per_chunk = max(1, chunk_bytes // slot_bytes)
        self._chunks = [(s, min(s + per_chunk, num_slots)) for s in range(0, num_slots, per_chunk)]
        self._done = [not pin] * len(self._chunks)
        self._pinned: list[int] = []  # chunk indices whose memory is registered
        self._ready = num_slots if not pin else 0
        self._executor: ThreadPoolExecutor | None = None
        self._finished = threading.Event()
        if not pin:
            self._finished.set()
            self.pinned_seconds = 0.0
        else:
            self._pin_chunk(0, started)  # usable at once
            rest = range(1, len(self._chunks))
            if rest:
                self._executor = ThreadPoolExecutor(max(1, workers),
                                                    thread_name_prefix="kvcore-pin")
                for i in rest:
                    self._executor.submit(self._pin_chunk, i, started)
                if not background:
                    self._finished.wait()
        self.startup_seconds = time.perf_counter() - started

    def ready_slots(self) -> int:
        """Slots ``0 .. ready_slots() - 1`` are pinned (all of them once pinning is done)."""
        with self._lock:
            return self._ready

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning is over (every chunk pinned, or one failed); False on timeout."""
        return self._finished.wait(timeout)

    def _pin_chunk(self, i: int, started: float) -> None:
        first, stop = self._chunks[i]
        with self._lock:
            if self._closed or self.error is not None:
                self._mark(i, started, failed=True)
                return
        region = self.tensor[first:stop]
        try:
            self._pin(region.data_ptr(), region.numel())
        except Exception as exc:
            with self._lock:
                if self.error is None:
                    self.error = (f"pinning slots {first}..{stop - 1} of the CPU pool failed: "
                                  f"{type(exc).__name__}: {exc}; the pool keeps the "
                                  f"{self._ready} slots pinned before them")
                    logger.warning("offload: %s", self.error)
                self._mark(i, started, failed=True)
            return
        with self._lock:
            self._pinned.append(i)
            self._mark(i, started, failed=False)

    def _mark(self, i: int, started: float, *, failed: bool) -> None:
        """Record chunk ``i`` as finished (lock held) and advance the ready prefix."""
        self._done[i] = True
        if not failed and self.error is None:
            j = next((k for k, (s, _) in enumerate(self._chunks) if s >= self._ready), None)
            while j is not None and j < len(self._chunks) and self._done[j] and j in self._pinned:
                self._ready = self._chunks[j][1]
                j += 1
        if all(self._done):
            self.pinned_seconds = time.perf_counter() - started
            self._finished.set()

    def close(self) -> None:
        """Stop pinning, wait for the workers, unpin what was pinned. Call once no transfer
        uses the pool any more."""
        with self._lock:
            self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pinned, self._pinned = self._pinned, []
            self._ready = 0
        for i in pinned:
            try:
                self._unpin(self.tensor[self._chunks[i][0]].data_ptr())
            except Exception as exc:
                logger.warning("offload: unpinning CPU pool chunk %d failed: %s", i, exc)
        self._finished.set()
