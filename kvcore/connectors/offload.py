"""``offload``: keep KV blocks in a bounded CPU memory pool, evicting the least recently used.

The pool is allocated once, when the KV caches are registered: ``capacity_bytes //
block_bytes`` slots, pinned when the cache is on a CUDA device so copies are asynchronous DMA.
A slot holds a whole block, every layer, layer-major (``(num_slots, block_bytes)``), whatever
the cache's layout, so a run of consecutive slots is one contiguous host region: one copy.

Blocks move in one of two ways, chosen per transfer:

- **direct**: cross-layer caches whose blocks and slots form long runs (e.g. contiguous block
  ids) copy each run straight between the cache and the pool, one copy per run;
- **staged** (per-layer caches, and scattered cross-layer blocks): the transfer is cut into
  chunks of at most ``chunk_bytes``; a save gathers a chunk's blocks of every layer into a
  contiguous device staging buffer with one indexed copy (``index_select`` over a
  ``(num_blocks, num_layers, page)`` view of the cache) and copies it to the pool with one copy
  per run of consecutive slots (usually one per chunk); a load copies the slots into staging
  and scatters them into the blocks with one ``index_copy_``. Two staging buffers per direction
  alternate, so the gather (or scatter) of one chunk overlaps the bus copy of the other.

On CUDA, saves and loads each own a copy stream and a kernel stream (so both directions of the
bus work at once, and gathers overlap copies), ordered after the engine's current stream with
events, and a handle completes on a CUDA event. Nothing waits on the host, nothing runs on the
engine's stream, and the staging buffers are allocated once at registration. Block ids reach
the device through a pinned ring on a stream of their own (pinning per transfer would wait for
an idle device), and every gather/scatter kernel variant is launched once at registration
(CUDA loads a kernel's module lazily on first launch, which also waits for an idle device).
On CPU the same staged logic runs synchronously on plain tensors and handles are complete when
returned.

With ``block_copier=NAME`` (a :class:`~kvcore.connectors.BlockCopier` registered by a plugin,
e.g. ``cuda_batch`` from kvcore-nvidia), transfers that would be staged go to that copier
instead, on the copy stream (one call for every layer when they lie back to back in one
storage, as in the usual per-layer layout): no staging buffers and no SM kernels, the copy
engines move each run of blocks. Direct transfers stay direct. Staging is the default because
it is faster; a copier takes less from the engine (numbers in ``benchmarks/RESULTS.md``).

A block with a transfer in flight (a save not yet complete, a load reading its slot) is never
evicted; if every slot is in flight, saving more fails for those blocks.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from contextlib import AbstractContextManager, nullcontext
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
from kvcore.connectors.copiers import BlockCopier, get_block_copier

__all__ = ["OffloadConnector"]

#: Default staging chunk: a 64 MiB copy keeps the bus busy (per-copy overhead is microseconds)
#: while two staging buffers per direction cost 256 MiB of device memory in all.
DEFAULT_CHUNK_BYTES = 64 << 20
#: Cross-layer runs at least this large on average are copied directly (no staging kernel).
DIRECT_MIN_RUN_BYTES = 16 << 20
#: Block ids the pinned upload ring holds (512 KiB); a larger transfer uploads in pieces.
ID_RING_ENTRIES = 1 << 16


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


@dataclass(frozen=True)
class _Chunk:
    """Rows ``start:stop`` of a staged transfer (in slot order) that go through staging at
    once; each segment ``(row, slot, count)`` (row counted from ``start``) is one copy
    between staging rows ``row:row + count`` and pool slots ``slot:slot + count``."""

    start: int
    stop: int
    segments: tuple[tuple[int, int, int], ...]


def _chunks(slots: list[int], chunk_blocks: int) -> list[_Chunk]:
    """Cut a transfer whose ``i``-th row goes to or from pool slot ``slots[i]`` into chunks
    of at most ``chunk_blocks`` rows, each with its runs of consecutive slots."""
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks={chunk_blocks} must be >= 1")
    chunks: list[_Chunk] = []
    start = 0
    segments: list[list[int]] = []
    for i, slot in enumerate(slots):
        if i - start == chunk_blocks:
            chunks.append(_Chunk(start, i, tuple(map(tuple, segments))))
            start, segments = i, []
        if segments and slot == segments[-1][1] + segments[-1][2]:
            segments[-1][2] += 1
        else:
            segments.append([i - start, slot, 1])
    if segments:
        chunks.append(_Chunk(start, len(slots), tuple(map(tuple, segments))))
    return chunks


@dataclass(frozen=True)
class _Plan:
    """How one transfer moves: ``runs`` (direct), ``blocks`` + ``chunks`` (staged) or
    ``pairs`` (through the block copier)."""

    runs: list[tuple[int, int, int]] | None = None
    blocks: list[int] | None = None  # device block of each staged row, in slot order
    chunks: list[_Chunk] | None = None
    pairs: list[tuple[int, int]] | None = None  # (block, slot) for the block copier

    @property
    def path(self) -> str:
        return ("direct" if self.runs is not None else "staged" if self.chunks is not None
                else "copier")


def _word_size(row_bytes: int, views: list[torch.Tensor]) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every row, stride and address, so the
    indexed copies move words, not bytes."""
    for size in (8, 4, 2):
        if row_bytes % size == 0 and all(
            v.data_ptr() % size == 0 and all(s % size == 0 for s in v.stride()[:-1])
            for v in views
        ):
            return size
    return 1


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _stacked(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The views ``(num_blocks, W)`` as one ``(num_blocks, len(views), W)`` view when they are
    equally spaced in one storage (then one indexed copy moves every layer), else None."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(1)
    step = views[1].data_ptr() - first.data_ptr()
    size = first.element_size()
    if step <= 0 or step % size:
        return None
    for i, v in enumerate(views):
        if (v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype
                or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or v.data_ptr() - first.data_ptr() != i * step):
            return None
    n, w = first.shape
    return first.as_strided((n, len(views), w), (first.stride(0), step // size, first.stride(1)),
                            first.storage_offset())


def _on(stream: torch.cuda.Stream | None) -> AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _after(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


class _IdUploader:
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


class _Staging:
    """One direction's two device staging buffers, and when each is free again."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
        #: Event after which buffer ``i`` may be overwritten (None: now).
        self.free: list[torch.cuda.Event | None] = [None, None]
        self.next = 0

    def take(self) -> int:
        i, self.next = self.next, self.next ^ 1
        return i


class OffloadConnector(KVConnector):
    """Offload KV blocks to CPU memory and load them back (connector name ``offload``).

    Args:
        capacity_bytes: size of the CPU pool; it holds ``capacity_bytes // block_bytes``
            blocks (``block_bytes = num_layers * page_size_bytes``).
        failure_policy: ``"recompute"`` or ``"fail"`` (see :data:`FAILURE_POLICIES`).
        chunk_bytes: most bytes a staged transfer moves per bus copy (at least one block);
            each direction keeps two device staging buffers of this size.
        block_copier: name of a registered :class:`~kvcore.connectors.BlockCopier` that moves
            the transfers otherwise staged (no staging buffers are allocated then); ``None``
            stages them. See :func:`kvcore.connectors.block_copier_names`.
    """

    prefer_cross_layer_blocks = True  # a whole block is then one copy

    def __init__(self, *, capacity_bytes: int, failure_policy: str = "recompute",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_copier: str | None = None
                 ) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if block_copier is not None and not isinstance(block_copier, str):
            raise TypeError(f"block_copier must be a registered copier's name or None, got "
                            f"{type(block_copier).__name__}")
        super().__init__(failure_policy=failure_policy)
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.block_copier = block_copier
        # Resolved now, so an unknown name fails here (listing the valid ones), not at
        # registration.
        self._copier: BlockCopier | None = (None if block_copier is None
                                            else get_block_copier(block_copier))
        self._op_locks = {"save": threading.Lock(), "load": threading.Lock()}
        self._lock = threading.Lock()
        self._pending: list[TransferHandle] = []
        #: Transfers and host<->device copies issued per path, for benchmarks and tests.
        self.paths = {"direct": 0, "staged": 0, "copier": 0, "copies": 0, "chunks": 0}

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
        if self._copier is not None:
            reason = self._copier.unavailable_reason(device)
            if reason is not None:
                raise ValueError(f"block_copier={self.block_copier!r} cannot move the blocks of "
                                 f"this cache: {reason}")
        self._async = device.type == "cuda"
        row_bytes = reg.views[0].shape[1]
        word = _WORDS[_word_size(row_bytes, reg.views)]
        # The cache's rows as words, and (when the layers are equally spaced) all layers as one
        # (num_blocks, num_views, row_words) view: one indexed copy per chunk moves them all.
        self._dev_views = [v.view(word) for v in reg.views]
        self._dev3 = _stacked(self._dev_views)
        #: (device rows, host rows): every (layer, block) as row ``layer * num_blocks + block``
        #: of one device view and (slot, layer) as row ``slot * num_layers + layer`` of the
        #: pool, when the layers lie back to back (see _copy_with_copier); else None.
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None
        row_words = self._dev_views[0].shape[1]
        # Pinned host memory is what lets a device copy run asynchronously. Slot-major: a run
        # of consecutive slots is one contiguous region whatever the cache's layout.
        self._host = torch.empty((num_slots, block_bytes), dtype=torch.uint8,
                                 pin_memory=self._async)
        self._host3 = self._host.view(word).view(num_slots, len(reg.views), row_words)
        dev3 = self._dev3
        if dev3 is not None and dev3.stride(1) == dev3.shape[0] * dev3.stride(0):
            self._flat = (dev3.as_strided((dev3.shape[0] * dev3.shape[1], dev3.shape[2]),
                                          (dev3.stride(0), dev3.stride(2)),
                                          dev3.storage_offset()),
                          self._host3.view(-1, row_words))
        self._index = _SlotIndex(num_slots)
        self._chunk_blocks = max(1, min(num_slots, self.chunk_bytes // block_bytes))
        shape = (self._chunk_blocks, len(reg.views), row_words)
        self._staging = ({} if self._copier is not None else
                         {op: _Staging(shape, word, device) for op in ("save", "load")})
        self._streams: dict[str, tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]] = {
            op: (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self._async
            else (None, None)
            for op in ("save", "load")
        }
        self._ids = _IdUploader(device, ID_RING_ENTRIES) if self._async else None
        if self._async:
            self._warm_up(device)

    def _warm_up(self, device: torch.device) -> None:
        """Launch the gather and scatter kernels at registration, at every size class.

        With CUDA's lazy module loading the first launch of a kernel loads its module, which
        waits for the device to be idle: a kernel first met inside save() would block the host
        for as long as the engine's stream is busy. PyTorch picks among several kernels by
        the number of indices (at most 16 or more) and by how the shapes collapse (one row
        or several), so each of those sizes runs once here: blocks ``0..n-1`` are gathered
        and written back onto themselves. A block copier instead copies block 0 to slot 0 (free
        still) and back, which also builds or loads whatever the copier's plugin needs.
        """
        if self._copier is not None:
            self._copy_with_copier("save", [(0, 0)])
            self._copy_with_copier("load", [(0, 0)])
            torch.cuda.synchronize(device)
            return
        stream = torch.cuda.current_stream(device)
        rows = min(self._chunk_blocks, self._dev_views[0].shape[0])
        for n in sorted({min(n, rows) for n in (1, 2, 16, 17, rows)}):
            ids = self._device_ids(list(range(n)), stream)  # the upload path warms up too
            buf = self._staging["save"].buffers[0][:n]
            self._gather(ids, buf)
            self._scatter(ids, buf)
        torch.cuda.synchronize(device)

    @property
    def num_slots(self) -> int:
        """How many blocks the pool holds."""
        self._registered()
        return self._index.num_slots

    @property
    def chunk_blocks(self) -> int:
        """Blocks per staged chunk: ``chunk_bytes // block_bytes``, at least 1, at most the
        pool's slots."""
        self._registered()
        return self._chunk_blocks

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

    def _plan(self, pairs: list[tuple[int, int]]) -> _Plan:
        """Direct run copies for a cross-layer cache whose blocks and slots form long runs (no
        device kernel at all), else staged chunks."""
        if not pairs:
            return _Plan(runs=[])
        if len(self._dev_views) == 1:
            runs = _runs(pairs)
            staged_copies = -(-len(pairs) // self._chunk_blocks)  # at least one per chunk
            if (len(runs) <= staged_copies
                    or len(pairs) * self.block_bytes >= DIRECT_MIN_RUN_BYTES * len(runs)):
                return _Plan(runs=runs)
        if self._copier is not None:
            return _Plan(pairs=pairs)
        by_slot = sorted(pairs, key=lambda p: p[1])
        return _Plan(blocks=[b for b, _ in by_slot],
                     chunks=_chunks([s for _, s in by_slot], self._chunk_blocks))

    def _copy(self, op: Op, pairs: list[tuple[int, int]], after: list[torch.cuda.Event]
              ) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Copy ``(block_id, slot)`` pairs in direction ``op``; on CUDA, asynchronously on the
        op's side streams after ``after`` events, returning its (start, end) events."""
        plan = self._plan(pairs)
        copy_stream, kernel_stream = self._streams[op]
        with self._op_locks[op]:  # one transfer per direction issues its copies at a time
            start = end = None
            if copy_stream is not None:
                # Saves read what the engine's stream wrote; loads overwrite what it may still
                # read. GPU-side waits only: the host never blocks here.
                copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))
                for event in after:  # a load of a block whose save is still running
                    copy_stream.wait_event(event)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(copy_stream)
            last = copy_stream
            if plan.path == "staged":
                last = self._copy_staged(op, plan, self._staging[op], copy_stream,
                                         kernel_stream, start)
                copies = sum(len(c.segments) for c in plan.chunks)
            elif plan.path == "copier":
                with _on(copy_stream):
                    copies = self._copy_with_copier(op, plan.pairs)
            else:
                self._copy_runs(op, plan.runs, copy_stream)
                copies = len(plan.runs)
            if end is not None:
                end.record(last)
        if pairs:
            with self._stats_lock:
                self.paths[plan.path] += 1
                self.paths["copies"] += copies
                self.paths["chunks"] += len(plan.chunks or ())
        return None if start is None else (start, end)

    def _copy_with_copier(self, op: Op, pairs: list[tuple[int, int]]) -> int:
        """``(block_id, slot)`` pairs through the block copier on the current stream; returns
        the copies it issued.

        When the layers lie back to back in one storage (the usual per-layer layout) every
        ``(layer, block)`` row is a row of one flat view, so a single call moves every layer;
        otherwise one call per layer view (a cross-layer cache has one view: one call).
        """
        mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
        if self._flat is not None:
            device_rows, host_rows = self._flat
            layers = torch.arange(self._host3.shape[1])
            num_blocks = self._dev_views[0].shape[0]
            dev_ids = (layers[None, :] * num_blocks + mapping[:, :1]).reshape(-1)
            host_ids = (mapping[:, 1:] * layers.numel() + layers[None, :]).reshape(-1)
            if op == "save":
                return self._copier.copy_blocks(device_rows, host_rows,
                                                torch.stack([dev_ids, host_ids], 1))
            return self._copier.copy_blocks(host_rows, device_rows,
                                            torch.stack([host_ids, dev_ids], 1))
        if op == "load":
            mapping = mapping.flip(1).contiguous()  # (slot, block): slots are the source
        copies = 0
        for layer, view in enumerate(self._dev_views):
            host = self._host3[:, layer]
            src, dst = (view, host) if op == "save" else (host, view)
            copies += self._copier.copy_blocks(src, dst, mapping)
        return copies

    def _copy_runs(self, op: Op, runs: list[tuple[int, int, int]],
                   stream: torch.cuda.Stream | None) -> None:
        """Direct copies, one per run (single-view caches only)."""
        device_view, host_view = self._dev_views[0], self._host3[:, 0]
        with _on(stream):
            for block, slot, n in runs:
                dev, host = device_view[block:block + n], host_view[slot:slot + n]
                if op == "save":
                    host.copy_(dev, non_blocking=self._async)
                else:
                    dev.copy_(host, non_blocking=self._async)

    def _copy_staged(self, op: Op, plan: _Plan, staging: _Staging,
                     copy_stream: torch.cuda.Stream | None,
                     kernel_stream: torch.cuda.Stream | None,
                     start: torch.cuda.Event | None) -> torch.cuda.Stream | None:
        """Chunks through the two staging buffers; returns the stream that runs last.

        Save: kernel stream gathers chunk i into buffer i % 2 (after that buffer's previous
        copy), copy stream copies it to the pool. Load: copy stream fills the buffer from the
        pool (after its previous scatter), kernel stream scatters it into the blocks.
        """
        _after(kernel_stream, start)  # the gathers/scatters too follow the engine's stream
        ids = self._device_ids(plan.blocks, kernel_stream)
        for chunk in plan.chunks:
            b = staging.take()
            buf = staging.buffers[b][:chunk.stop - chunk.start]
            chunk_ids = ids[chunk.start:chunk.stop]
            if op == "save":
                with _on(kernel_stream):
                    _after(kernel_stream, staging.free[b])
                    self._gather(chunk_ids, buf)
                    gathered = _mark(kernel_stream)
                _after(copy_stream, gathered)
                with _on(copy_stream):
                    for row, slot, n in chunk.segments:
                        self._host3[slot:slot + n].copy_(buf[row:row + n],
                                                         non_blocking=self._async)
                    staging.free[b] = _mark(copy_stream)
            else:
                with _on(copy_stream):
                    _after(copy_stream, staging.free[b])
                    for row, slot, n in chunk.segments:
                        buf[row:row + n].copy_(self._host3[slot:slot + n],
                                               non_blocking=self._async)
                    copied = _mark(copy_stream)
                _after(kernel_stream, copied)
                with _on(kernel_stream):
                    self._scatter(chunk_ids, buf)
                    staging.free[b] = _mark(kernel_stream)
        if op == "save":
            return copy_stream
        return kernel_stream

    def _device_ids(self, blocks: list[int], stream: torch.cuda.Stream | None) -> torch.Tensor:
        """``blocks`` as an int64 tensor on the cache's device, ready for ``stream`` (on CPU,
        a plain tensor)."""
        if self._ids is None:
            return torch.tensor(blocks, dtype=torch.int64)
        return self._ids.upload(blocks, stream)

    def _gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = blocks ids[i]`` of every layer (``out`` is ``(n, num_views, words)``)."""
        if self._dev3 is not None:
            torch.index_select(self._dev3, 0, ids, out=out)
            return
        for layer, view in enumerate(self._dev_views):
            out[:, layer].copy_(view.index_select(0, ids))

    def _scatter(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks ``ids[i]`` of every layer ``= src[i]``."""
        if self._dev3 is not None:
            self._dev3.index_copy_(0, ids, src)
            return
        for layer, view in enumerate(self._dev_views):
            view.index_copy_(0, ids, src[:, layer])

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
            end.synchronize()  # immediate; tells stream-order checkers the host waited
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
        del self._host, self._host3, self._staging, self._dev_views, self._dev3, self._ids
        self._flat = None
