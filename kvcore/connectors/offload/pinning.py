"""The pool's host memory, pinned in page-aligned chunks by worker threads, in the background.

Pinning is what makes host<->device copies asynchronous DMA, and it is slow: the kernel faults
in and locks every page (seconds for tens of GiB). Allocating the pool with
``torch.empty(..., pin_memory=True)`` does all of it at once, on the registering thread, before
the engine can start. :class:`HostPool` instead allocates pageable memory and pins it in
chunks of whole pages with ``cudaHostRegister``, several chunks at a time on worker threads.
The runtime is called through ctypes when its library is found, which releases the GIL for
the call, so pinning runs beside the engine's Python (torch's own binding, the fallback,
holds it). The first chunk is pinned before the constructor returns, the rest in the
background (or before it returns, with ``background=False``).

**Only pinned slots are used.** :meth:`HostPool.ready_slots` counts the slots lying wholly in
the pinned *prefix* of the pool (chunks finish out of order; a later chunk counts once every
earlier one is done). The connector hands out only those slots, so no transfer ever touches
memory that is not pinned yet: the pool grows under the engine instead of blocking its start.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import mmap
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


@functools.cache
def _runtime_calls() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """``(register, unregister)`` of the CUDA (or HIP) runtime library torch loaded, called
    through ctypes, which releases the GIL for the call: pinning threads then run beside the
    engine's Python. ``None`` when the library is not found (a static runtime)."""
    torch.cuda.init()
    hip = getattr(torch.version, "hip", None) is not None
    stem, prefix = ("libamdhip64.so", "hip") if hip else ("libcudart.so", "cuda")
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if stem in line})
    except OSError:
        return None
    if not paths:
        return None
    lib = ctypes.CDLL(paths[0])
    register = getattr(lib, f"{prefix}HostRegister")
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    register.restype = ctypes.c_int
    unregister = getattr(lib, f"{prefix}HostUnregister")
    unregister.argtypes = [ctypes.c_void_p]
    unregister.restype = ctypes.c_int
    return register, unregister


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with runtime error {code}")


def cuda_pin(data_ptr: int, nbytes: int) -> None:
    """``cudaHostRegister`` (portable) of ``[data_ptr, data_ptr + nbytes)``; ``RuntimeError``
    with the runtime's error code on failure."""
    calls = _runtime_calls()
    if calls is not None:
        _check(calls[0](data_ptr, nbytes, 1), "cudaHostRegister")
    else:  # torch's binding (holds the GIL while the pages are locked)
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(data_ptr, nbytes, 1))


def cuda_unpin(data_ptr: int) -> None:
    calls = _runtime_calls()
    if calls is not None:
        _check(calls[1](data_ptr), "cudaHostUnregister")
    else:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(data_ptr))


class HostPool:
    """``(num_slots, slot_bytes)`` uint8 host memory whose slots become usable as they are
    pinned.

    The memory starts on a page boundary and the chunks are whole pages (a page registered
    twice is an error), so a chunk boundary may cut a slot: a slot is ready once every byte
    of it lies in the pinned prefix.

    Args:
        num_slots, slot_bytes: the pool's shape.
        pin: page-lock the memory (``False``: plain memory, every slot ready at once).
        background: allocate pageable memory and pin it in chunks with ``cudaHostRegister``,
            the chunks after the first one on worker threads after returning. ``False`` (with
            the default ``pin_fn``): torch's pinned allocation, all of it before returning.
            The chunked path failed on the H200 (cudaErrorInvalidValue at the first transfer,
            2026-12-01; ``benchmarks/RESULTS.md``) and is opt-in until that is understood.
        chunk_bytes, workers: pinning granularity (rounded up to whole pages; the first chunk
            holds at least one slot) and parallelism.
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
        total = num_slots * slot_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._finished = threading.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._pinned: list[int] = []  # chunk indices whose memory is registered
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.error: str | None = None
        if pin and not background and pin_fn is None:
            # torch's own pinned allocation, at once: the path the offload benchmarks verified
            # on the H200. The chunked ``cudaHostRegister`` path below failed there (the
            # first transfer raised cudaErrorInvalidValue, 2026-12-01), so it is opt-in.
            self.tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8,
                                      pin_memory=True)
            self._chunks: list[tuple[int, int]] = []
            self._ready_bytes = total
            self._finished.set()
            self.pinned_seconds = self.startup_seconds = time.perf_counter() - started
            return
        page = mmap.PAGESIZE
        # Room to start on a page and to round the last chunk up to a whole page.
        self._raw = torch.empty(total + 2 * page, dtype=torch.uint8)
        offset = -self._raw.data_ptr() % page
        self.tensor = self._raw[offset:offset + total].view(num_slots, slot_bytes)
        self.pinned_seconds: float | None = None
        self._pin = pin_fn or cuda_pin
        self._unpin = unpin_fn or cuda_unpin
        step = _round_up(max(chunk_bytes, 1), page)
        first = _round_up(max(step, slot_bytes), page)
        end = _round_up(total, page)
        bounds = [0, *range(first, end, step), end] if total else [0]
        #: ``[start, stop)`` byte ranges from the pool's start, whole pages each.
        self._chunks = list(itertools.pairwise(bounds))
        self._done = [not pin] * len(self._chunks)
        self._ready_bytes = end if not pin else 0
        self._base = self.tensor.data_ptr()
        if not pin or not self._chunks:
            self._finished.set()
            self.pinned_seconds = 0.0
        else:
            self._pin_chunk(0, started)  # usable at once
            if len(self._chunks) > 1:
                self._executor = ThreadPoolExecutor(max(1, workers),
                                                    thread_name_prefix="kvcore-pin")
                for i in range(1, len(self._chunks)):
                    self._executor.submit(self._pin_chunk, i, started)
                if not background:
                    self._finished.wait()
        self.startup_seconds = time.perf_counter() - started

    def ready_slots(self) -> int:
        """Slots ``0 .. ready_slots() - 1`` are pinned (all of them once pinning is done)."""
        with self._lock:
            return min(self.num_slots, self._ready_bytes // self.slot_bytes)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning is over (every chunk pinned, or one failed); False on timeout."""
        return self._finished.wait(timeout)

    def _pin_chunk(self, i: int, started: float) -> None:
        start, stop = self._chunks[i]
        with self._lock:
            if self._closed or self.error is not None:
                self._mark(i, started)
                return
        try:
            self._pin(self._base + start, stop - start)
        except Exception as exc:  # reported; the pool just stays smaller
            with self._lock:
                if self.error is None:
                    first_slot = start // self.slot_bytes
                    self.error = (f"pinning slots from {first_slot} on of the CPU pool failed: "
                                  f"{type(exc).__name__}: {exc}; the pool keeps the "
                                  f"{min(self.num_slots, self._ready_bytes // self.slot_bytes)}"
                                  " slots pinned before them")
                    logger.warning("offload: %s", self.error)
                self._mark(i, started)
            return
        with self._lock:
            self._pinned.append(i)
            self._mark(i, started)

    def _mark(self, i: int, started: float) -> None:
        """Record chunk ``i`` as finished (lock held) and advance the pinned prefix over the
        chunks pinned in order."""
        self._done[i] = True
        pinned = set(self._pinned)
        for j, (start, stop) in enumerate(self._chunks):
            if start == self._ready_bytes and j in pinned:
                self._ready_bytes = stop
        if all(self._done):
            self.pinned_seconds = time.perf_counter() - started
            self._finished.set()

    def __del__(self) -> None:
        # Memory freed while still registered would stay locked, and a later registration
        # overlapping it would fail: unpin whatever the owner forgot to close.
        if not getattr(self, "_closed", True):
            self.close()

    def close(self) -> None:
        """Stop pinning, wait for the workers, unpin what was pinned. Call once no transfer
        uses the pool any more; calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pinned, self._pinned = self._pinned, []
            self._ready_bytes = 0
        for i in pinned:
            try:
                self._unpin(self._base + self._chunks[i][0])
            except Exception as exc:  # at teardown: say so and go on
                logger.warning("offload: unpinning CPU pool chunk %d failed: %s", i, exc)
        self._finished.set()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
