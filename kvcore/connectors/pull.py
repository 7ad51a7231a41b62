"""Connectors whose consumers pull published blocks straight from a producer's cache.

The machinery shared by the ``nixl`` and ``mooncake`` connectors (disaggregated
prefill/decode): a **producer** engine publishes blocks with ``save``; a **consumer** engine
finds them with ``lookup`` and READs them with ``load`` from the producer's registered cache
into its own blocks through a transfer library. :class:`PullConnector` holds everything but
the library: the side channel, the producer's publications and leases, the consumer's link,
runs of blocks and the bounded read loop (the producer's side in
:mod:`~kvcore.connectors.pull_producer`, the consumer's link in
:mod:`~kvcore.connectors.pull_consumer`, its READs in flight in
:mod:`~kvcore.connectors.pull_reads`, a converting load in
:mod:`~kvcore.connectors.pull_convert`). A subclass supplies the library's engine (memory
registration, starting, polling and cancelling a READ, its notifications:
:class:`~kvcore.connectors.pull_engine.Engine`).

Memory: a block is one region per byte view of :class:`~kvcore.connectors.RegisteredCaches`:
one region of ``num_layers * page_size_bytes`` for a cross-layer cache, one
``page_size_bytes`` region per layer otherwise. A load issues one READ per run of blocks that
are consecutive on both sides (a descriptor per region kind), so a run succeeds or fails
whole, and blocks of other runs are not affected.

Side channel: standard library sockets, no central server; its frames and requests
(``hello``, ``lookup``, ``fetch``, ``done``, ``giveback``) are in
:mod:`~kvcore.connectors.pull_channel`.

Readers: a published block waits for ``readers`` different consumers (default 1), e.g. the
tensor-parallel decode ranks that read one prefill rank's heads
(:func:`~kvcore.connectors.reader_ranks`). It is open to a consumer that neither holds nor
read it while fewer READs are done or in flight than ``readers``, so no consumer reads it
twice and no more than ``readers`` do.

Lifetimes, all bounded: a published block stays pinned until ``readers`` consumers' READs of
it are confirmed, or ``publish_timeout_s`` after the save (then the save reports it failed,
naming the reason). A lease lasts twice the consumer's ``timeout_s``, longer than the consumer ever
waits for its READ, so a producer does not hand a block back to its engine while the consumer
may still count it as read; the producer refuses leases longer than its ``max_lease_s``, and
a consumer whose connection closes (killed, or closed) loses its leases at once: their blocks
are published again (after the READ notifications that arrived are applied). A consumer
counts a READ only while its connection is up (and, where it confirms over the side
channel, only once the producer took the confirmation), so a block published again is never
one it still reports as read. A consumer's load fails, within
``timeout_s``, every block it could not read whole: a producer that died, froze or never
published the key; a READ that times out is cancelled where the library can (a failure to
cancel is named in the block's reason).

Per load, a consumer makes one ``fetch`` round trip (a converting load too: it leases all its
keys at once and READs them chunk by chunk), more only for keys the producer had not published
yet (asked again with pauses of 2 ms doubling to 50 ms), plus a ``done`` per run where READs
are confirmed over the side channel. A load whose keys a lookup found (as an engine's
scheduler looks them up before it asks for the load) does not wait for the fetch's answer to
READ: it starts the READs from the blocks the lookup named (kept for the last
:data:`GUESSES_KEPT` keys, each for one load) right after sending the fetch, without
notification, so the round trip runs under the data's time. A key whose leased block and
serial are the ones the lookup named was published, so unchanged, from the lookup's answer
until the lease held it: its bytes count once read, confirmed by a notification sent then
(``<lease>:<first>:<end>``, as a READ carries it) or ``done``. Any other key of the load (a
block published again elsewhere) is READ from the lease after those READs ended, over what
they wrote; one the producer no longer publishes fails as any other. A
converting load fetches first (its READs land in the shared staging buffer); one whose
consumer maps the producer's cache (the producer's hello carries its handle,
:mod:`~kvcore.connectors.shared_memory`) gathers from the leased blocks in place and
confirms them with ``done`` (:func:`~kvcore.connectors.pull_convert.gather_in_place`).
While READs are in flight it polls the library, pausing between polls as :func:`poll_pause`
says: an eighth of the time they have taken so far, between 20 us and 5 ms (a READ is seen
finished about an eighth of its time late at most, and a long one costs few polls).
A load runs on the connector's loader thread, or on the caller's when it waits for the load
(long enough for any load) before that thread took it; ``close`` waits for both.
:attr:`PullConnector.timing` reports where a load's time goes (:data:`PHASES`).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import uuid
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch

from kvcore import KVCacheLayout
from kvcore.connectors.base import KVConnector, RegisteredCaches, TransferHandle, TransferResult
from kvcore.connectors.convert import ConversionPlan, TPRank, as_tp_rank, plan_conversion
from kvcore.connectors.pull_channel import ChannelError, unpack_blocks
from kvcore.connectors.pull_consumer import Consumer
from kvcore.connectors.pull_convert import gather_in_place, read_converting
from kvcore.connectors.pull_engine import (
    Engine,
    Regions,
    Run,
    all_published,
    memory_kind,
    read_runs,
    spans,
)
from kvcore.connectors.pull_producer import Producer, check_seconds
from kvcore.connectors.pull_reads import (
    POLL_PAUSE_MAX_S,
    POLL_PAUSE_MIN_S,
    LoadTask,
    Reads,
    poll_pause,
)
from kvcore.connectors.shared_memory import map_allocation

__all__ = ["DEFAULT_STAGING_BYTES", "GUESSES_KEPT", "PHASES", "POLL_PAUSE_MAX_S",
           "POLL_PAUSE_MIN_S", "Engine", "PullConnector", "Regions", "Run", "memory_kind",
           "poll_pause"]

logger = logging.getLogger(__name__)

_ROLES = ("producer", "consumer")

#: Keys whose producer blocks a consumer keeps from its lookups for the loads that follow.
GUESSES_KEPT = 1 << 16
_NO_GUESS = (-1, -1)  # (block, serial) of a key no lookup named

#: A converting consumer's staging buffer (``staging_bytes``): READs of the producer's blocks
#: land there in the producer's layout, then one gather converts them into the cache.
DEFAULT_STAGING_BYTES = 512 << 20

#: What :attr:`PullConnector.timing` is told of: a request on the side channel (one round
#: trip each, named by its op: ``lookup``, ``fetch``, ``giveback``, ``done``), the library's
#: ``start_read`` (descriptors, the request and its post), ``poll`` and ``release``,
#: ``pause`` (the connector's sleeps between polls, and between fetches of keys not published
#: yet), and for a converting load ``prepare`` (its gathers' checks and ids, while the fetch's
#: answer is on the way: not counted in ``fetch``), ``gather`` (launching one; on the CPU, the
#: gather itself) and ``wait`` (the host waiting for the device: a staging part's last
#: gather, the gathers at the end), and ``notify`` (confirming, through the library's
#: notification, READs started before their lease: the module's "Per load").
PHASES = ("lookup", "fetch", "giveback", "done", "start_read", "poll", "release", "pause",
          "prepare", "gather", "wait", "notify")


# -- the connector --------------------------------------------------------------------------


class PullConnector(KVConnector):
    """Publish KV blocks to other engines, or READ them from one, through a transfer library.

    Subclasses name the library (:attr:`transport`, :attr:`label`), say whether READs are
    confirmed over the side channel (:attr:`confirms_over_channel`) and what the producer's
    hello carries for it (:attr:`hello_fields`), and implement :meth:`unavailable_reason`
    and :meth:`_open_engine` (an :class:`Engine`). They check their own arguments, call
    ``PullConnector.__init__`` with the common ones (see
    :class:`~kvcore.connectors.nixl.NixlConnector` for their meaning), then :meth:`_start`.
    """

    #: The connector's name: in messages, thread names and the side channel's protocol tag.
    transport: ClassVar[str]
    #: The library's name in a block's failure reason ("NIXL READ ...").
    label: ClassVar[str]
    #: Whether a consumer confirms a READ with ``done`` on the side channel (the library has
    #: no notification that arrives with the data).
    confirms_over_channel: ClassVar[bool] = False
    #: Keys the producer's hello carries besides the common ones (what reaches its engine).
    hello_fields: ClassVar[tuple[str, ...]] = ()

    # Both sides must agree on the layout; cross-layer moves a whole block in one region.
    prefer_cross_layer_blocks = True

    #: Consumer: called as ``timing(phase, seconds)`` after each step of a load or lookup
    #: named in :data:`PHASES`, on the thread that ran it (a load's: the connector's loader
    #: thread); ``None`` (the default): not timed. For benchmarks and tests
    #: (``benchmarks/bench_nixl.py --phases``); it must be quick and must not raise.
    timing: Callable[[str, float], None] | None = None

    def __init__(self, *, role: str, host: str, port: int, connect_timeout_s: float,
                 timeout_s: float, publish_timeout_s: float, max_lease_s: float,
                 failure_policy: str, tp: TPRank | tuple[int, int] | None = None,
                 num_kv_heads: int | None = None, kv_scales: Any = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, staging_buffers: int = 2,
                 map_producer: bool = True, readers: int = 1) -> None:
        if role not in _ROLES:
            raise ValueError(f"role={role!r} must be 'producer' (publishes blocks) or "
                             "'consumer' (reads them)")
        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be an int in 0..65535")
        if role == "consumer" and port == 0:
            raise ValueError("port=0 for a consumer: pass the port the producer listens on")
        self.connect_timeout_s = check_seconds("connect_timeout_s", connect_timeout_s)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self.publish_timeout_s = check_seconds("publish_timeout_s", publish_timeout_s)
        self.max_lease_s = check_seconds("max_lease_s", max_lease_s)
        self.tp = as_tp_rank(tp)
        if num_kv_heads is not None and (isinstance(num_kv_heads, bool) or not isinstance(
                num_kv_heads, int) or num_kv_heads < 1):
            raise ValueError(f"num_kv_heads={num_kv_heads!r} must be None (from the layouts) "
                             "or the model's KV head count, a positive int")
        self.num_kv_heads = num_kv_heads
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) \
                or staging_bytes <= 0:
            raise ValueError(f"staging_bytes={staging_bytes!r} must be a positive int (bytes "
                             "of the consumer's buffer for READs it converts)")
        self.staging_bytes = staging_bytes
        if staging_buffers not in (1, 2) or isinstance(staging_buffers, bool):
            raise ValueError(f"staging_buffers={staging_buffers!r} must be 2 (the READ of one "
                             "chunk overlaps the gather of the previous one) or 1 (READ, then "
                             "gather, in turn)")
        self.staging_buffers = staging_buffers
        if not isinstance(map_producer, bool):
            raise TypeError(f"map_producer={map_producer!r} must be a bool: True converts in "
                            "place from the producer's cache where this process can map it, "
                            "False always READs into the staging buffer")
        self.map_producer = map_producer
        #: Consumer, once registered with a producer of another layout: whether each load
        #: gathers straight from the producer's cache, mapped into this process
        #: (``map_producer``), rather than READing into the staging buffer first.
        self.converts_in_place = False
        #: Why a converting consumer does not convert in place (``None`` where it does, or
        #: before registration).
        self.in_place_reason: str | None = None
        self._source: torch.Tensor | None = None  # the producer's cache, mapped
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise ValueError(f"readers={readers!r} must be a positive int (how many consumers "
                             "READ each published block; kvcore.connectors.reader_ranks gives "
                             "it for tensor-parallel consumers)")
        self.readers = readers
        self._kv_scales = kv_scales
        self._plan: ConversionPlan | None = None
        # Consumer: per key, the producer's block and its publication's serial as the last
        # lookup that found it named them (a load READs from there while its fetch is on the
        # way); the first looked up go first past GUESSES_KEPT.
        self._guesses: dict[str, tuple[int, int]] = {}
        self._guesses_lock = threading.Lock()

    def _start(self, role: str, host: str, port: int, failure_policy: str) -> None:
        """The rest of ``__init__``, after the subclass checked its own arguments: refuse a
        missing library, then listen (a producer)."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the {self.transport} connector is unavailable: {reason}")
        super().__init__(failure_policy=failure_policy)
        self.channel_protocol = f"kvcore-{self.transport}-v3"
        self.role = role
        self.host = host
        self.port = port
        self.agent_name = f"kvcore-{role}-{uuid.uuid4().hex[:12]}"
        self._engine: Engine | None = None
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._loads: set[LoadTask] = set()  # not finished yet
        if role == "producer":
            listener = socket.create_server((host, port), backlog=64)
            self.port = listener.getsockname()[1]
            self._producer = Producer(self, listener)
        # Close what the engine holds even if the owner forgets to (and before interpreter
        # exit, while the library is still whole).
        self._finalizer = weakref.finalize(self, PullConnector._release, self._producer,
                                           [None, None, None, None], self.timeout_s)

    # -- what a library supplies ------------------------------------------------------------

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """Why the library cannot run here (with how to install it), or ``None``."""

    @abstractmethod
    def _open_engine(self, reg: RegisteredCaches, regions: Regions) -> Engine:
        """Create this side's :class:`Engine`, named :attr:`agent_name`, with the cache's
        storage registered; raise with the reason (the library's own error in it)."""

    # -- registration -----------------------------------------------------------------------

    def _register(self, reg: RegisteredCaches) -> None:
        self._layout = reg.kv_caches.layout
        regions = Regions.of(reg, self.transport)
        engine = self._open_engine(reg, regions)
        try:
            if self.role == "producer":
                # What converting consumers that can map it read in place (each is sent a
                # handle of it made for that consumer: Producer._mapping).
                self._shared = reg.kv_caches.storage.view(-1).view(torch.uint8)
                hello = {"protocol": self.channel_protocol, "layout": self._layout.to_dict(),
                         "tp": [self.tp.degree, self.tp.rank],
                         "num_kv_heads": self.num_kv_heads,
                         "agent": engine.name, "regions": regions.to_dict(),
                         "num_blocks": reg.kv_caches.num_blocks,
                         "max_lease_s": self.max_lease_s,
                         **engine.hello()}
                self._producer.start(engine, hello)
            else:
                consumer = Consumer(self, engine)
                consumer.connect(regions)
                self._consumer = consumer
                if consumer.plan is not None and not consumer.plan.is_identity:
                    self._plan = consumer.plan
                    self._map_source(reg, consumer)
                    if self._source is None:
                        self._stage(reg, consumer.regions, engine)
                self._loader = ThreadPoolExecutor(
                    2, thread_name_prefix=f"kvcore-{self.transport}-load")
        except BaseException:
            engine.close()
            raise
        self._engine = engine
        self._regions = regions
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, PullConnector._release, self._producer,
            [self._consumer, self._loader, engine, self._loads], self.timeout_s)

    def _map_source(self, reg: RegisteredCaches, consumer: Consumer) -> None:
        """Consumer of another layout: map the producer's cache (the handle its hello's
        answer made for this consumer) when ``map_producer`` and it lies on this cache's
        device, so each load gathers from it in place; else say why not
        (:attr:`in_place_reason`)."""
        device = reg.kv_caches.storage.device
        why = None
        if not self.map_producer:
            why = "map_producer=False"
        elif consumer.allocation is None:
            why = consumer.unmappable or "the producer did not share its cache"
        else:
            try:
                source = map_allocation(consumer.allocation)
            except ValueError as exc:
                why = str(exc)
            else:
                if source.device != device:
                    why = (f"the producer's cache is on {source.device}, this cache on "
                           f"{device}: a gather reads the producer's blocks in place only on "
                           "one device")
                else:
                    self._source = source
        self.in_place_reason = why
        self.converts_in_place = why is None
        if why is None:
            self._gather_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            logger.info("%s consumer: converting on load in place from the producer's cache, "
                        "mapped into this process:\n%s", self.transport, self._plan)
        else:
            logger.info("%s consumer: converting on load through a staging buffer (the "
                        "producer's cache is not read in place: %s)", self.transport, why)

    def _stage(self, reg: RegisteredCaches, remote: Regions, engine: Engine) -> None:
        """Allocate and register the buffer that converting READs land in: blocks of the
        producer's layout, as many whole groups of the plan as ``staging_bytes`` holds (one
        group at least), laid out like the producer's regions (one per layer, or one)."""
        plan = self._plan
        block_bytes = sum(remote.row_bytes)
        per_group = plan.group_tokens // plan.src_block_size
        groups = max(1, self.staging_bytes // (block_bytes * per_group))
        count = groups * per_group
        storage = reg.kv_caches.storage
        self._staging = torch.empty(count * block_bytes, dtype=torch.uint8,
                                    device=storage.device)
        self._staging_blocks = count
        base = self._staging.data_ptr()
        if len(remote.row_bytes) == 1:  # cross-layer: a block is one row of every layer
            addrs, strides = (base,), (block_bytes,)
        else:  # per layer: layer l's blocks are one run, rows back to back
            addrs = tuple(base + sum(remote.row_bytes[:i]) * count
                          for i in range(len(remote.row_bytes)))
            strides = remote.row_bytes
        self._staging_regions = Regions(addrs, strides, remote.row_bytes,
                                        *memory_kind(storage, self.transport))
        engine.register_staging(self._staging)
        # One converting load at a time owns the buffer (the loader runs two loads at once).
        self._staging_lock = threading.Lock()
        # Two halves when the buffer holds two groups or more: a chunk's READ lands in one
        # while the previous chunk's gather reads the other.
        self._halves = 2 if self.staging_buffers == 2 and groups >= 2 else 1
        self._gather_stream = (torch.cuda.Stream(storage.device) if storage.is_cuda
                               else None)
        logger.info("%s consumer: converting on load with a %d-block staging buffer in %d "
                    "part(s):\n%s", self.transport, count, self._halves, plan)

    def _load_plan(self) -> ConversionPlan | None:
        return self._plan

    @property
    def plan(self) -> ConversionPlan | None:
        """Consumer: the conversion agreed with the producer at registration (``None``
        before, and for a producer); :attr:`ConversionPlan.is_identity` when the layouts
        match and blocks are READ straight into the cache."""
        return self._plan if self._plan is not None or self._consumer is None \
            else self._consumer.plan

    @staticmethod
    def _release(producer: Producer | None, parts: list[Any], join_s: float) -> None:
        consumer, loader, engine, loads = parts
        if producer is not None:
            producer.stop(join_s)
        if consumer is not None:
            consumer.disconnect()  # queued loads fail at once
        if loader is not None:
            loader.shutdown(wait=True)  # a READ in flight ends within timeout_s
        for task in list(loads or ()):  # and those that callers run themselves
            task.finished.wait(join_s)
        if consumer is not None and consumer.remote is not None:
            engine.forget(consumer.remote)
        if engine is not None:
            engine.close()

    def _close(self) -> None:
        self._finalizer()
        self._source = None  # (no load runs any more) the mapping goes

    def _plan_from(self, producer: KVCacheLayout, producer_tp: TPRank,
                   producer_heads: Any) -> ConversionPlan:
        """The conversion from the producer's cache into this consumer's (raises
        :class:`LayoutConversionError` naming both layouts and the field)."""
        heads = self.num_kv_heads if self.num_kv_heads is not None else producer_heads
        return plan_conversion(producer, self._layout, src_tp=producer_tp, dst_tp=self.tp,
                               num_kv_heads=heads if isinstance(heads, int) else None,
                               quantize=self._kv_scales is not None)

    # -- scheduler side ---------------------------------------------------------------------

    def _lookup(self, keys: list[str]) -> int:
        if self.role == "producer" or not keys:
            return 0
        try:
            reply = self._request({"op": "lookup"}, keys=keys)
        except ChannelError as exc:
            logger.warning("%s consumer: lookup failed: %s", self.transport, exc)
            return 0
        hits, tail = reply.get("hits"), reply.get("tail", b"")
        if not (isinstance(hits, int) and 0 <= hits <= len(keys) and len(tail) == 16 * hits):
            return 0
        if hits:
            found = unpack_blocks(tail)
            with self._guesses_lock:
                guesses = self._guesses
                guesses.update(zip(keys[:hits], zip(found[:hits], found[hits:], strict=True),
                                   strict=True))
                if len(guesses) > GUESSES_KEPT:  # the oldest go first
                    for key in list(itertools.islice(guesses, len(guesses) - GUESSES_KEPT)):
                        del guesses[key]
        return hits

    def _take_guesses(self, keys: list[str]) -> tuple[list[int], list[int]] | None:
        """The blocks and serials the lookups named for ``keys`` (each taken out: a guess
        serves one load), ``-1`` both for a key none named; ``None`` when none did."""
        with self._guesses_lock:
            if not self._guesses:
                return None
            found = list(map(self._guesses.pop, keys, itertools.repeat(_NO_GUESS)))
        if found.count(_NO_GUESS) == len(found):
            return None
        blocks, serials = zip(*found, strict=True)
        return list(blocks), list(serials)

    # -- producer ---------------------------------------------------------------------------

    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        if self.role != "producer":
            return self._all_failed("save", block_ids, "role='consumer' only loads; blocks "
                                    "are published by a producer (role='producer')")
        self._caller_fence()()  # what the engine queued into these blocks has landed
        producer = self._producer
        record = producer.publish(keys, block_ids, self.publish_timeout_s)

        def block(timeout: float | None) -> bool:
            with producer.cond:
                return producer.cond.wait_for(lambda: record.pending == 0, timeout)

        def collect() -> TransferResult:
            with producer.cond:
                done, failed = set(record.done), dict(record.failed)
            seconds = time.perf_counter() - record.started
            return self._record(self._result("save", [b for b in block_ids if b in done],
                                             failed, len(done) * self.block_bytes, seconds))

        return TransferHandle("save", self.failure_policy, lambda: record.pending == 0, block,
                              collect)

    # -- consumer ---------------------------------------------------------------------------

    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        if self.role != "consumer":
            return self._all_failed("load", block_ids, "role='producer' only publishes; a "
                                    "consumer (role='consumer') loads")
        task = LoadTask(self._loads, self._read_blocks_from_producer, keys, block_ids)
        self._loader.submit(task.run)
        # A caller that waits for the load before the loader thread took it runs it itself
        # (no hand-off to the thread and back), when it waits at least as long as a load may
        # take.
        inline_from = self.timeout_s + 1.0
        return TransferHandle(
            "load", self.failure_policy, task.finished.is_set,
            lambda timeout: task.wait(timeout, timeout is None or timeout >= inline_from),
            task.result)

    def _read_blocks_from_producer(self, keys: list[str], block_ids: list[int]
                                   ) -> TransferResult:
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        if self._plan is None:
            # No device synchronisation: a READ the library reports done has landed (UCX's
            # CUDA transports report a copy done once its stream event completed).
            read, errors = self._pull(keys, block_ids, self._regions, deadline)
            if len(read) == len(block_ids):  # all of them, in order
                loaded = block_ids
            else:
                loaded = [block_ids[i] for i in sorted(read)]
            failed = {block_ids[i]: why for i, why in errors.items()}
            nbytes = len(loaded) * self.block_bytes
        else:
            convert = gather_in_place if self._source is not None else read_converting
            loaded, failed, nbytes = convert(self, keys, block_ids, deadline)
            order = {b: n for n, b in enumerate(block_ids)}
            loaded.sort(key=order.__getitem__)
        return self._record(self._result("load", loaded, failed, nbytes,
                                         time.perf_counter() - started))

    def _fetch(self, keys: list[str], deadline: float,
               while_waiting: Callable[[], None] | None = None, *,
               meanwhile_phase: str | None = "prepare") -> tuple[str, list[Any], list[int]]:
        """Lease the producer's published blocks of ``keys`` (one round trip): the lease and,
        per key, the producer's block or ``None`` (not published yet), and its publication's
        serial (``-1``: not published). ``while_waiting()`` runs while the answer is on the
        way (timed as ``meanwhile_phase``, ``None``: not timed apart from its own steps; it
        must not raise). Raises :class:`ChannelError` when the link fails or the answer is
        malformed."""
        reply = self._request({"op": "fetch", "lease_s": 2 * self.timeout_s},
                              timeout=max(deadline - time.monotonic(), 0.001), keys=keys,
                              while_waiting=while_waiting, meanwhile_phase=meanwhile_phase)
        lease, tail = reply.get("lease"), reply.get("tail", b"")
        if not isinstance(lease, str) or len(tail) != 16 * len(keys):
            raise ChannelError(f"the producer answered {str(reply)[:200]!r}")
        found = unpack_blocks(tail)
        blocks: list[Any] = found[:len(keys)]
        if blocks and min(blocks) < 0:  # some not published yet
            blocks = [None if b < 0 else b for b in blocks]
        return lease, blocks, found[len(keys):]

    def _pull(self, keys: list[str], local_ids: list[int], local: Regions, deadline: float,
              fetched: tuple[str, list[Any], int] | None = None
              ) -> tuple[set[int], dict[int, str]]:
        """READ the producer's blocks of ``keys`` into blocks ``local_ids`` of ``local``
        (this cache, or the staging buffer); returns the indices read whole and why the
        others failed. ``fetched``: ``(lease, blocks, first)``, a fetch made already whose
        entries ``first ..`` are ``keys``' (else the first fetch is made here)."""
        todo: Any = range(len(keys))  # indices not read yet
        loaded: set[int] = set()
        failed: dict[int, str] = {}
        pause = 0.002
        guesses = self._take_guesses(keys) if fetched is None else None
        while True:
            if guesses is not None:  # READ from the lookups' blocks while the fetch is out
                todo = self._pull_guessed(keys, local_ids, local, deadline, guesses, loaded,
                                          failed)
                guesses = None
            else:
                if fetched is not None:
                    lease, blocks, first = fetched
                    fetched = None
                else:
                    try:
                        lease, blocks, _ = self._fetch([keys[i] for i in todo], deadline)
                    except ChannelError as exc:
                        failed.update((i, str(exc)) for i in todo)
                        break
                    first = 0
                todo = self._read_fetched(todo, len(keys), lease, blocks, first, local_ids,
                                          local, deadline, loaded, failed)
            if not todo:
                break
            # Poll again only with time left for an answer and a READ.
            if time.monotonic() + max(pause, min(0.25, self.timeout_s / 4)) >= deadline:
                why = (f"not published by the producer at {self.host}:{self.port} within "
                       f"timeout_s={self.timeout_s}")
                failed.update((i, why) for i in todo)
                break
            self._pause(pause)
            pause = min(2 * pause, 0.05)
        return loaded, failed

    def _read_fetched(self, todo: Any, num_keys: int, lease: str, blocks: list[Any],
                      first: int, local_ids: list[int], local: Regions, deadline: float,
                      loaded: set[int], failed: dict[int, str]) -> list[int]:
        """READ the keys ``todo`` (indices among ``num_keys``) from ``lease``, whose entry
        ``j`` names key ``todo[j - first]`` with producer block ``blocks[j - first]``, into
        ``local_ids`` of ``local``; adds to ``loaded`` and ``failed``, returns the keys the
        producer had not published."""
        num_blocks = self._consumer.num_blocks
        later = []
        if len(todo) == num_keys and all_published(blocks, num_blocks):
            # The common case: every key, each published.
            runs = spans(first, blocks, local_ids)
        else:
            later, pairs = self._sort_entries(
                ((j, i, src) for j, (i, src) in enumerate(zip(todo, blocks, strict=True), first)),
                local_ids, failed)
            runs = read_runs(pairs)
        if runs:
            read, errors = self._read_runs(lease, runs, deadline, local)
            if len(read) == len(todo) == num_keys:
                loaded.update(todo)  # the common case: all of them at once
            else:
                loaded.update(todo[j - first] for j in read)
                failed.update((todo[j - first], why) for j, why in errors.items())
        return later

    def _sort_entries(self, entries: Iterable[tuple[int, int, Any]], local_ids: list[int],
                      failed: dict[int, str]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Fetch entries ``(lease entry, key index, producer block)`` sorted: the keys the
        producer had not published (block ``None``), and ``(lease entry, producer block,
        this cache's block)`` to READ; a block the producer cannot have fails its key."""
        num_blocks = self._consumer.num_blocks
        later, pairs = [], []
        for j, i, src in entries:
            if src is None:
                later.append(i)
            elif type(src) is int and 0 <= src < num_blocks:
                pairs.append((j, src, local_ids[i]))
            else:
                failed[i] = f"the producer named block {src!r}"
        return later, pairs

    def _pull_guessed(self, keys: list[str], local_ids: list[int], local: Regions,
                      deadline: float, guesses: tuple[list[int], list[int]],
                      loaded: set[int], failed: dict[int, str]) -> list[int]:
        """:meth:`_pull`'s first fetch where lookups named the producer's blocks of some
        ``keys`` (``guesses``: per key the block and the serial, ``-1`` both where none
        did): their READs start while the fetch is on the way, without notification. Entries
        the lease holds with the same block and serial were published, so unchanged, from
        the lookup's answer on: once read they count and are confirmed (a READ of them that
        fails fails them, as any READ). The rest (no guess, another block or serial) are READ
        from the lease once those READs ended, over what they wrote. Adds to ``loaded`` and
        ``failed``; returns the keys the producer had not published."""
        n, num_blocks = len(keys), self._consumer.num_blocks
        guessed_blocks, guessed_serials = guesses
        guessed: set[int] | None = None  # the keys READ from a guess (None: every key)
        if min(guessed_blocks) >= 0 and max(guessed_blocks) < num_blocks:  # (passes of C)
            runs = spans(0, guessed_blocks, local_ids)
        else:
            pairs = [(i, src, local_ids[i]) for i, src in enumerate(guessed_blocks)
                     if 0 <= src < num_blocks]
            runs = read_runs(pairs)
            guessed = {i for i, _, _ in pairs}
        reads = Reads(self, None, deadline)
        try:
            lease, blocks, serials = self._fetch(
                keys, deadline, while_waiting=lambda: reads.start(runs, local),
                meanwhile_phase=None)
        except ChannelError as exc:
            # Nothing counts without a lease; no READ may still write when the load ends.
            reads.expire(str(exc))
            failed.update((i, str(exc)) for i in range(n))
            return []
        redo = sorted(reads.errors)  # READs that could not start: from the lease instead
        reads.errors.clear()
        reads.lease = lease
        if blocks == guessed_blocks and serials == guessed_serials:  # the common case
            reads.trusted = range(n)
        else:
            reads.trusted = {i for i in range(n) if guessed_blocks[i] >= 0
                             and blocks[i] == guessed_blocks[i]
                             and serials[i] == guessed_serials[i]}
        reads.wait()
        loaded.update(reads.read)
        failed.update(reads.errors)
        if redo or reads.redo or guessed is not None:
            unguessed = () if guessed is None else (i for i in range(n) if i not in guessed)
            redo = sorted({*redo, *reads.redo, *unguessed})
        # (the lease's entry i is key i)
        later, again = self._sort_entries(((i, i, blocks[i]) for i in redo), local_ids, failed)
        if again:
            read, errors = self._read_runs(lease, read_runs(again), deadline, local)
            loaded.update(read)
            failed.update(errors)
        reads.give_back()
        return later

    def _read_runs(self, lease: str, runs: list[Run], deadline: float, local: Regions
                   ) -> tuple[list[int], dict[int, str]]:
        """READ every run (one READ each) until done, failed or ``deadline``, polling as
        :func:`poll_pause` says. Returns the fetch indices read whole and those that failed
        with why."""
        reads = Reads(self, lease, deadline)
        reads.start(runs, local)
        reads.wait()
        reads.give_back()
        return reads.read, reads.errors

    def _give_back(self, lease: str, indices: list[int]) -> None:
        """Hand entries of ``lease`` that were not read back to the producer (published
        again); without a link they go back when the lease ends."""
        try:
            self._request({"op": "giveback", "lease": lease, "indices": indices})
        except ChannelError:
            pass  # the lease expires on the producer

    def _confirm_entries(self, lease: str, first: int, end: int) -> str | None:
        """Confirm entries ``first..end-1`` of ``lease``, read by a READ that carried no
        notification (started before the lease): over the side channel where READs are
        confirmed there, else through the library's notification (the message the READ would
        have carried). Returns why that failed, or ``None``."""
        if self.confirms_over_channel:
            return self._done(lease, first, end)
        try:
            self._timed("notify", self._engine.notify, self._consumer.remote,
                        f"{lease}:{first}:{end}".encode())
        except Exception as exc:
            return f"{self.label} notification could not be sent: {exc}"
        return None

    def _confirm(self, lease: str, run: Run) -> str | None:
        """Tell the producer that ``run`` was read, where the library's notification does not
        (:attr:`confirms_over_channel`); ``None`` where it does."""
        if not self.confirms_over_channel:
            return None
        return self._done(lease, run.first, run.end)

    def _done(self, lease: str, first: int, end: int, *, quiet: bool = False) -> str | None:
        """``done``: entries ``first..end-1`` of ``lease`` were read, on the side channel.
        Returns why the producer did not take it, or ``None``: a run the producer no longer
        leased (expired, or released with a lost link) may have been handed to another
        consumer and reused. ``quiet`` (a gather in place): not answered, as a READ's
        notification is not; it counts while the link is up."""
        message = {"op": "done", "lease": lease, "first": first, "end": end}
        try:
            if quiet:
                self._timed("done", self._consumer.send, {**message, "quiet": True})
            else:
                self._request(message)
        except ChannelError as exc:
            return str(exc)
        return None

    def _request(self, message: dict[str, Any], timeout: float | None = None,
                 keys: list[str] | None = None,
                 while_waiting: Callable[[], None] | None = None,
                 meanwhile_phase: str | None = "prepare") -> dict[str, Any]:
        """One request to the producer and its answer (see :meth:`Consumer.request`); its
        time less ``while_waiting``'s is the request's phase, ``while_waiting``'s is
        ``meanwhile_phase`` (``None``: not reported; its steps report themselves)."""
        timing = self.timing
        if timing is None:
            return self._consumer.request(message, timeout, keys, while_waiting)
        meanwhile = 0.0

        def timed_while_waiting() -> None:
            nonlocal meanwhile
            started = time.perf_counter()
            try:
                while_waiting()
            finally:
                meanwhile = time.perf_counter() - started
                if meanwhile_phase is not None:
                    timing(meanwhile_phase, meanwhile)

        started = time.perf_counter()
        try:
            return self._consumer.request(message, timeout, keys, while_waiting
                                          and timed_while_waiting)
        finally:
            timing(message["op"], time.perf_counter() - started - meanwhile)

    def _timed(self, phase: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, its time reported to :attr:`timing` as ``phase``."""
        timing = self.timing
        if timing is None:
            return call(*args)
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            timing(phase, time.perf_counter() - started)

    def _pause(self, seconds: float) -> None:
        self._timed("pause", time.sleep, seconds)

    # -- helpers ----------------------------------------------------------------------------

    def _all_failed(self, op: str, block_ids: list[int], why: str) -> TransferHandle:
        return self._finished(op, [], dict.fromkeys(block_ids, why), 0, time.perf_counter())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, {self.host}:{self.port}, " \
               f"{super().__repr__()})"
