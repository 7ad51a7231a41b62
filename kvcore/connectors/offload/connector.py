"""The ``offload`` connector: the pool, its transfers and their handles (see the package's
docstring for how blocks move)."""

from __future__ import annotations

import threading
import time

import torch

from kvcore import KVCaches
from kvcore.connectors.base import (
    KVConnector,
    KVTransferError,
    Op,
    RegisteredCaches,
    TransferHandle,
    TransferResult,
)
from kvcore.connectors.convert import ConversionPlan, block_rows_layout, plan_conversion
from kvcore.connectors.copiers import BlockCopier, get_block_copier
from kvcore.connectors.offload.cuda import (
    IdUploader,
    Staging,
    on_stream,
    record_event,
    wait_for_event,
)
from kvcore.connectors.offload.pinning import HostPool
from kvcore.connectors.offload.planning import TransferPlan, plan_transfer
from kvcore.connectors.offload.slots import SlotEntry, SlotIndex
from kvcore.connectors.offload.views import WORD_DTYPES, stacked_layers, word_size

__all__ = ["OffloadConnector"]

#: Default staging chunk: a 64 MiB copy keeps the bus busy (per-copy overhead is microseconds)
#: while two staging buffers per direction cost 256 MiB of device memory in all.
DEFAULT_CHUNK_BYTES = 64 << 20
#: Block ids the pinned upload ring holds (512 KiB); a larger transfer uploads in pieces.
ID_RING_ENTRIES = 1 << 16


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
        pin_in_background: on CUDA, return from registration once the first chunk of the
            pool is allocated (pinned) and allocate the rest on a worker thread started after
            the connector's own set-up, the pool growing as it goes
            (:mod:`~kvcore.connectors.offload.pinning`; saves use only the slots allocated so
            far, ``wait_pinned()`` waits for all). Each chunk's allocation holds a CUDA
            driver lock, so an engine's CUDA call may wait for up to one chunk meanwhile.
            ``False`` (the default, so a caller finds the whole pool usable): every chunk,
            allocated in parallel, before registration returns.
    """

    prefer_cross_layer_blocks = True  # a whole block is then one copy

    def __init__(self, *, capacity_bytes: int, failure_policy: str = "recompute",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, block_copier: str | None = None,
                 pin_in_background: bool = False) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if block_copier is not None and not isinstance(block_copier, str):
            raise TypeError(f"block_copier must be a registered copier's name or None, got "
                            f"{type(block_copier).__name__}")
        if not isinstance(pin_in_background, bool):
            raise TypeError(f"pin_in_background must be a bool, got {pin_in_background!r}")
        super().__init__(failure_policy=failure_policy)
        self.pin_in_background = pin_in_background
        #: Seconds :meth:`register_kv_caches` blocked (allocation, first pinned chunk,
        #: staging, warm-up): what an engine's start-up pays.
        self.register_seconds = 0.0
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
        #: Keys whose slots hold blocks of caches registered before (reregister_kv_caches),
        #: with the plan that converts them on load.
        self._foreign: dict[str, ConversionPlan] = {}
        started = time.perf_counter()
        self._pool = HostPool(num_slots, block_bytes, pin=self._async,
                              background=self.pin_in_background)
        if self._pool.ready_slots() == 0:
            error = self._pool.error
            self._pool.close()
            raise RuntimeError(f"the CPU pool could not be allocated: {error}")
        self._index = SlotIndex(num_slots, available=self._pool.ready_slots())
        self._setup_device(reg)
        # Only now the rest of the pool: pinning holds a CUDA driver lock that the set-up
        # above would otherwise wait behind (pinning.py).
        self._pool.start()
        self.register_seconds = time.perf_counter() - started

    def _setup_device(self, reg: RegisteredCaches) -> None:
        """The device side of a registration: word views of the cache, staging, streams,
        the id ring, kernels warmed up."""
        kv = reg.kv_caches
        device = kv.storage.device
        num_slots = self._index.num_slots
        block_bytes = kv.num_layers * kv.page_size_bytes
        row_bytes = reg.views[0].shape[1]
        word = WORD_DTYPES[word_size(row_bytes, reg.views)]
        # The cache's rows as words, and (when the layers are equally spaced) all layers as one
        # (num_blocks, num_views, row_words) view: one indexed copy per chunk moves them all.
        self._dev_views = [v.view(word) for v in reg.views]
        self._dev3 = stacked_layers(self._dev_views)
        #: Every (layer, block) as row ``layer * num_blocks + block`` of one device view, when
        #: the layers lie back to back (see _copy_with_copier); else None.
        self._flat: torch.Tensor | None = None
        row_words = self._dev_views[0].shape[1]
        self._word = word
        self._row_words = row_words
        dev3 = self._dev3
        if dev3 is not None and dev3.stride(1) == dev3.shape[0] * dev3.stride(0):
            self._flat = dev3.as_strided((dev3.shape[0] * dev3.shape[1], dev3.shape[2]),
                                         (dev3.stride(0), dev3.stride(2)),
                                         dev3.storage_offset())
        self._chunk_blocks = max(1, min(num_slots, self.chunk_bytes // block_bytes))
        shape = (self._chunk_blocks, len(reg.views), row_words)
        self._staging = ({} if self._copier is not None else
                         {op: Staging(shape, word, device) for op in ("save", "load")})
        self._streams: dict[str, tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]] = {
            op: (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self._async
            else (None, None)
            for op in ("save", "load")
        }
        self._ids = IdUploader(device, ID_RING_ENTRIES) if self._async else None
        if self._async:
            self._warm_up(device)

    def reregister_kv_caches(self, kv_caches: KVCaches) -> None:
        """Attach caches re-allocated in place of the registered ones (another backend, or
        per-layer instead of cross-layer), keeping the pool: blocks saved before load into the
        new caches converted (:func:`~kvcore.connectors.plan_conversion`), new saves store the
        new layout.

        Waits for every transfer in flight first. The new caches must be on the same device
        with blocks of the same bytes (same block size, heads, head size, layers and dtype):
        another stride order or allocation only.

        Raises:
            ValueError: the new caches' blocks have another size, or their layout does not
                convert from the old one (nothing changes then).
        """
        old = self._registered()
        if not isinstance(kv_caches, KVCaches):
            raise TypeError(f"kv_caches must be a kvcore.KVCaches, got "
                            f"{type(kv_caches).__name__}")
        if kv_caches.storage.device != old.kv_caches.storage.device:
            raise ValueError(f"the new caches are on {kv_caches.storage.device}, the pool was "
                             f"set up for {old.kv_caches.storage.device}; make a new connector")
        old_rows = block_rows_layout(old.kv_caches.layout)
        plan = plan_conversion(old_rows, kv_caches.layout)
        if plan.src_block_size != plan.dst_block_size or (
                kv_caches.num_layers * kv_caches.page_size_bytes != self.block_bytes):
            raise ValueError(f"the new caches' blocks ({kv_caches.layout.describe()}) differ "
                             f"in size from the pool's ({old.kv_caches.layout.describe()}); "
                             "re-registering keeps the block size, heads and dtype (another "
                             "order or allocation only): make a new connector")
        views = ([kv_caches.block_view()] if kv_caches.is_cross_layer
                 else kv_caches.layer_block_views())
        with self._lock:
            pending, self._pending = self._pending, []
        for handle in pending:
            try:
                handle.wait()
            except KVTransferError:
                pass
        reg = RegisteredCaches(kv_caches, views)
        with self._lock:
            for key in self._index.keys():
                previous = self._foreign.get(key)
                # A block converted before keeps its first layout: plan from that one.
                self._foreign[key] = plan if previous is None else plan_conversion(
                    previous.src, kv_caches.layout)
            self._setup_device(reg)
            self._reg = reg

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until the whole pool is pinned (see ``pin_in_background``); False on
        timeout. Saves before then use the slots pinned so far."""
        self._registered()
        done = self._pool.wait(timeout)
        with self._lock:
            self._grow()
        return done

    @property
    def pinned_seconds(self) -> float | None:
        """Seconds from registration until the whole pool was pinned (``None`` while it
        still is being pinned)."""
        self._registered()
        return self._pool.pinned_seconds

    @property
    def ready_slots(self) -> int:
        """Slots usable now: all of them once pinning is over."""
        self._registered()
        return self._pool.ready_slots()

    def _grow(self) -> None:
        """Hand out the slots pinned since the last call (``self._lock`` held)."""
        ready = self._pool.ready_slots()
        if ready > self._index.available:
            self._index.grow(ready)

    def _warm_up(self, device: torch.device) -> None:
        """Launch the gather and scatter kernels at registration, at every size class.

        Also one direct copy per direction when the cache is one view (cross-layer), so the
        direct path's first transfer pays nothing either. With CUDA's lazy module loading the
        first launch of a kernel loads its module, which waits for the device to be idle: a
        kernel first met inside save() would block the host for as long as the engine's
        stream is busy. PyTorch picks among several kernels by
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
        # The direct path's first host<->device copy in each direction (block 0 <-> slot 0,
        # still free; the block is written back onto itself), on the streams transfers use.
        if len(self._dev_views) == 1:
            for op in ("save", "load"):
                copy_stream = self._streams[op][0]
                copy_stream.wait_stream(stream)
                self._copy_runs(op, [(0, 0, 1)], copy_stream)
                stream.wait_stream(copy_stream)
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
        todo: list[tuple[int, str, SlotEntry]] = []
        # The copies are issued under the lock: a load that finds a new entry must also find
        # the event its data waits for (or, on CPU, the data).
        with self._lock:
            self._grow()
            evictions = self._index.evictions
            # Keys held already count as saved, without a copy: so the new blocks must not
            # evict them (a held key evicted here would be copied again, or lost, while the
            # result says it is stored). Touched first, they are also the last LRU victims.
            held = {key for key in keys if self._index.get(key) is not None}
            for key, block in zip(keys, block_ids, strict=True):
                if key in held:
                    present.append(block)
                    continue
                entry = self._index.allocate(key, keep=held)
                if entry is None:
                    failed[block] = (f"CPU pool full: all {self._index.available} usable "
                                     "slots hold blocks with transfers in flight"
                                     + (" or blocks this save keeps" if held else "")
                                     + (f" ({self._index.num_slots - self._index.available} "
                                        "more are still being pinned)"
                                        if self._index.available < self._index.num_slots
                                        else ""))
                    continue
                entry.pins += 1
                self._foreign.pop(key, None)  # this save writes the current layout
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
        todo: list[tuple[int, SlotEntry]] = []
        converted: list[tuple[int, SlotEntry, ConversionPlan]] = []
        with self._lock:
            for key, block in zip(keys, block_ids, strict=True):
                entry = self._index.get(key)
                if entry is None:
                    failed[block] = (f"key {key} is not in the CPU pool (never saved, or "
                                     "evicted)")
                    continue
                entry.pins += 1
                plan = self._foreign.get(key)
                if plan is not None:
                    converted.append((block, entry, plan))
                    continue
                todo.append((block, entry))
            saves = list({id(e.ready): e.ready for _, e in todo if e.ready is not None}.values())
        done = [(b, e) for b, e, _ in converted]
        try:
            if converted:
                self._load_converted(converted)
            event = self._copy("load", [(b, e.slot) for b, e in todo], saves)
        except BaseException:
            with self._lock:
                for _, entry in todo + done:
                    entry.pins -= 1
            raise
        todo += done  # counted and released with the copied ones
        return self._handle("load", [b for b, _ in todo], failed, [e for _, e in todo], event,
                            started)

    def _load_converted(self, converted: list[tuple[int, SlotEntry, ConversionPlan]]) -> None:
        """Blocks saved under a previous registration, converted into the current caches now,
        synchronously (their saves finished before re-registration; the entries are pinned)."""
        kv = self._reg.kv_caches
        if self._async:  # the engine's stream may still use the blocks being overwritten
            torch.cuda.current_stream(kv.storage.device).synchronize()
        by_plan: dict[int, tuple[ConversionPlan, list[int], list[int]]] = {}
        for block, entry, plan in converted:
            group = by_plan.setdefault(id(plan), (plan, [], []))
            group[1].append(entry.slot)
            group[2].append(block)
        for plan, slots, blocks in by_plan.values():
            plan.apply(self._pool.rows(slots), kv, list(range(len(slots))), blocks)
        if self._async:
            torch.cuda.current_stream(kv.storage.device).synchronize()

    def _lookup(self, keys: list[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if self._index.get(key) is None:
                    return i
            return len(keys)

    def _plan(self, pairs: list[tuple[int, int]]) -> TransferPlan:
        """Direct run copies for a cross-layer cache whose blocks and slots form long runs (no
        device kernel at all), else the block copier or staged chunks."""
        return plan_transfer(pairs, single_view=len(self._dev_views) == 1,
                             chunk_blocks=self._chunk_blocks, block_bytes=self.block_bytes,
                             copier=self._copier is not None)

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
                last, copies = self._copy_staged(op, plan, self._staging[op], copy_stream,
                                                 kernel_stream, start)
            elif plan.path == "copier":
                with on_stream(copy_stream):
                    copies = self._copy_with_copier(op, plan.pairs)
            else:
                copies = self._copy_runs(op, plan.runs, copy_stream)
            if end is not None:
                end.record(last)
        if pairs:
            with self._stats_lock:
                self.paths[plan.path] += 1
                self.paths["copies"] += copies
                self.paths["chunks"] += len(plan.chunks or ())
        return None if start is None else (start, end)

    def _words(self, rows: torch.Tensor) -> torch.Tensor:
        """Pool rows ``(n, slot_bytes)`` as their ``(n, num_views, row_words)`` word view."""
        return rows.view(self._word).view(rows.shape[0], -1, self._row_words)

    def _host_rows(self, slot: int, count: int) -> list[tuple[int, torch.Tensor]]:
        """Slots ``slot .. slot + count - 1`` as ``(offset, (n, num_views, row_words))`` word
        views, one per pool chunk they touch (one copy each)."""
        return [(offset, self._words(rows)) for offset, rows in self._pool.pieces(slot, count)]

    def _copy_with_copier(self, op: Op, pairs: list[tuple[int, int]]) -> int:
        """``(block_id, slot)`` pairs through the block copier on the current stream; returns
        the copies it issued.

        One call per pool chunk the slots lie in. When the layers lie back to back in one
        storage (the usual per-layer layout) every ``(layer, block)`` row is a row of one flat
        view, so a single call moves every layer; otherwise one call per layer view (a
        cross-layer cache has one view: one call).
        """
        mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
        chunk = mapping[:, 1].div(self._pool.chunk_slots, rounding_mode="floor")
        row = mapping[:, 1] - chunk * self._pool.chunk_slots
        copies = 0
        for index in chunk.unique().tolist():
            mine = chunk == index
            local = torch.stack([mapping[mine, 0], row[mine]], 1)
            copies += self._copier_call(op, local, self._words(self._pool.chunk(index)))
        return copies

    def _copier_call(self, op: Op, mapping: torch.Tensor, host3: torch.Tensor) -> int:
        """``(block_id, row)`` pairs between the cache and the ``(rows, num_views, words)``
        host view ``host3`` (one pool chunk) through the block copier."""
        if self._flat is not None:
            layers = torch.arange(host3.shape[1])
            num_blocks = self._dev_views[0].shape[0]
            dev_ids = (layers[None, :] * num_blocks + mapping[:, :1]).reshape(-1)
            host_ids = (mapping[:, 1:] * layers.numel() + layers[None, :]).reshape(-1)
            host_rows = host3.reshape(-1, host3.shape[2])
            if op == "save":
                return self._copier.copy_blocks(self._flat, host_rows,
                                                torch.stack([dev_ids, host_ids], 1))
            return self._copier.copy_blocks(host_rows, self._flat,
                                            torch.stack([host_ids, dev_ids], 1))
        if op == "load":
            mapping = mapping.flip(1).contiguous()  # (row, block): the pool is the source
        copies = 0
        for layer, view in enumerate(self._dev_views):
            host = host3[:, layer]
            src, dst = (view, host) if op == "save" else (host, view)
            copies += self._copier.copy_blocks(src, dst, mapping)
        return copies

    def _copy_runs(self, op: Op, runs: list[tuple[int, int, int]],
                   stream: torch.cuda.Stream | None) -> int:
        """Direct copies, one per run and pool chunk (single-view caches only); returns the
        copies issued."""
        device_view = self._dev_views[0]
        copies = 0
        with on_stream(stream):
            for block, slot, n in runs:
                for offset, rows in self._host_rows(slot, n):
                    host = rows[:, 0]
                    dev = device_view[block + offset:block + offset + host.shape[0]]
                    if op == "save":
                        host.copy_(dev, non_blocking=self._async)
                    else:
                        dev.copy_(host, non_blocking=self._async)
                    copies += 1
        return copies

    def _copy_staged(self, op: Op, plan: TransferPlan, staging: Staging,
                     copy_stream: torch.cuda.Stream | None,
                     kernel_stream: torch.cuda.Stream | None,
                     start: torch.cuda.Event | None) -> tuple[torch.cuda.Stream | None, int]:
        """Chunks through the two staging buffers; returns the stream that runs last and the
        host<->device copies issued.

        Save: kernel stream gathers chunk i into buffer i % 2 (after that buffer's previous
        copy), copy stream copies it to the pool. Load: copy stream fills the buffer from the
        pool (after its previous scatter), kernel stream scatters it into the blocks.
        """
        # The gathers/scatters too follow the engine's stream.
        wait_for_event(kernel_stream, start)
        ids = self._device_ids(plan.blocks, kernel_stream)
        copies = 0
        for chunk in plan.chunks:
            b = staging.take()
            buf = staging.buffers[b][:chunk.stop - chunk.start]
            chunk_ids = ids[chunk.start:chunk.stop]
            if op == "save":
                with on_stream(kernel_stream):
                    wait_for_event(kernel_stream, staging.free[b])
                    self._gather(chunk_ids, buf)
                    gathered = record_event(kernel_stream)
                wait_for_event(copy_stream, gathered)
                with on_stream(copy_stream):
                    for row, slot, n in chunk.segments:
                        for offset, host in self._host_rows(slot, n):
                            start_row = row + offset
                            host.copy_(buf[start_row:start_row + host.shape[0]],
                                       non_blocking=self._async)
                            copies += 1
                    staging.free[b] = record_event(copy_stream)
            else:
                with on_stream(copy_stream):
                    wait_for_event(copy_stream, staging.free[b])
                    for row, slot, n in chunk.segments:
                        for offset, host in self._host_rows(slot, n):
                            start_row = row + offset
                            buf[start_row:start_row + host.shape[0]].copy_(
                                host, non_blocking=self._async)
                            copies += 1
                    copied = record_event(copy_stream)
                wait_for_event(kernel_stream, copied)
                with on_stream(kernel_stream):
                    self._scatter(chunk_ids, buf)
                    staging.free[b] = record_event(kernel_stream)
        return (copy_stream if op == "save" else kernel_stream), copies

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
                entries: list[SlotEntry],
                events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
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
        self._pool.close()
        del self._staging, self._dev_views, self._dev3, self._ids
        del self._pool
        self._flat = None
