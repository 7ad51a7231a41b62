"""The producer's side of the pull connectors (:mod:`kvcore.connectors.pull`): the published
blocks, the leases consumers take on them, and the threads that answer consumers on the side
channel (:mod:`~kvcore.connectors.pull_channel`) and expire what waited too long."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import reprlib
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore import KVCacheLayout
from kvcore.connectors.convert import TPRank, as_tp_rank, plan_conversion
from kvcore.connectors.pull_channel import (
    BadFrame,
    ChannelError,
    close_socket,
    pack_blocks,
    recv_frame,
    send_frame,
)
from kvcore.connectors.shared_memory import host_identity, share_allocation, shareable_with

__all__ = ["CLOSED_LINK_GRACE_S", "SETTLE_AFTER_S", "Notifier", "Producer", "ProducerSide",
           "SaveRecord", "check_seconds"]

logger = logging.getLogger(__name__)

_KEY_CHARS = 64  # a block key: a SHA-256 digest in hex (kvcore.connectors.keys)
#: Seconds a closed connection's leases outlive it where the engine notifies READs itself
#: (NIXL): the consumer's last notifications may arrive after the close (they do over
#: loopback within milliseconds); the blocks not confirmed by then are published again.
CLOSED_LINK_GRACE_S = 2.0
#: Seconds READ notifications (NIXL) wait to be counted when no consumer asks for more. A
#: producer counts them right after it answers a fetch (the consumer is READing then, and
#: waits for nothing from the producer), not when they arrive: that is when the consumer's
#: next fetch comes, and counting a load's hundreds of blocks in Python held it up. They are
#: counted before any lease can end, and before a connection's leases or the producer close.
SETTLE_AFTER_S = 0.002
#: The notification loop's pauses while leases are out and nothing arrives: from the first,
#: doubling up to the last (seconds). A consumer's next fetch collects the notifications that
#: arrived itself, so the loop only serves the end of a burst (its last load's READs); polling
#: the engine at a steady 2 kHz took most of a core and the producer's GIL from the engine's
#: own threads (and the channel's answers: a fetch round trip 0.85 -> 0.63 ms on 2 cores).
#: A lease or publication expires up to the longest pause late.
NOTIF_PAUSES_S = (0.0005, 0.005)


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a float, or a ``ValueError`` naming ``name`` unless finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
    return float(value)


# -- producer -------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Publication:
    """One published block: the producer's ``block`` holds ``key`` for ``save``, until
    ``readers`` different consumers READ it whole.

    Counters rather than sets of leases, and a chain rather than a container per key: a
    fetch looks at one of these per key of every load, and touching fewer objects keeps it
    quick."""

    key: str
    block: int
    save: SaveRecord
    deadline: float  # when it is released, read by fewer consumers than it waits for
    # Unique among the producer's publications: a consumer that READ ``block`` before its
    # lease trusts the bytes only if the lease names the same serial (the block was
    # published, so unchanged, from the lookup that named it until the lease held it).
    serial: int
    held: int = 0  # leases that hold it now (a lease holds a publication once at most)
    reads: int = 0  # READs confirmed
    # Consumers that hold or read it; only where several consumers read each block
    # (readers > 1: none reads it twice), None until the first takes it.
    takers: set[str] | None = None
    later: _Publication | None = None  # the next publication of the same key


def _open_to(pub: _Publication | None, consumer: str, readers: int) -> _Publication | None:
    """The first publication from ``pub`` on along its key's chain that ``consumer`` may
    take: one it neither holds nor read, with fewer READs done and in flight than
    ``readers``."""
    while pub is not None and (pub.reads + pub.held >= readers
                               or (pub.takers is not None and consumer in pub.takers)):
        pub = pub.later
    return pub


@dataclass(eq=False)
class SaveRecord:
    """The per-block outcome of one ``save``."""

    block_ids: list[int]
    started: float
    pending: int
    done: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


class ProducerSide(Protocol):
    """What the producer reads of its connector (a
    :class:`~kvcore.connectors.pull.PullConnector`, which imports this module)."""

    transport: str
    confirms_over_channel: bool
    channel_protocol: str
    host: str
    port: int
    connect_timeout_s: float
    publish_timeout_s: float
    max_lease_s: float
    tp: TPRank
    num_kv_heads: int | None
    readers: int
    _layout: KVCacheLayout
    _shared: Any  # the cache as flat bytes (a torch.Tensor), what converting consumers map


class Notifier(Protocol):
    """What the producer calls of its engine (a :class:`~kvcore.connectors.pull.Engine`)."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """The READ notifications that arrived, as ``(consumer, message)``."""


@dataclass
class _Lease:
    lease_id: str
    consumer: str
    publications: list[_Publication | None]
    deadline: float
    link: int  # the connection that took it: closing it ends the lease
    held: int  # entries of publications not None (read, given back or not taken: None)
    closed: bool = False  # that connection closed; the lease ends at its (shortened) deadline


class Producer:
    """The producer's state: published blocks, leases, the listener and its threads."""

    def __init__(self, conn: ProducerSide, listener: socket.socket) -> None:
        self.conn = conn
        self.who = f"{conn.transport} producer"
        self.listener = listener
        self.cond = threading.Condition()
        # Held while notifications are fetched and counted, and while leases end (closed
        # connections, expiry): a READ confirmed before that is never read after its lease
        # ended.
        self.notif_lock = threading.Lock()
        # Notifications fetched from the engine and not counted yet (SETTLE_AFTER_S), and
        # since when the oldest waits (monotonic seconds); both under notif_lock.
        self.unsettled: list[tuple[str, bytes]] = []
        self.unsettled_since = 0.0
        # Per key its oldest publication (later ones chained from it).
        self.published: dict[str, _Publication] = {}
        self.leases: dict[str, _Lease] = {}
        self.consumers_seen = 0
        self.connections: set[socket.socket] = set()
        self.stopping = False
        self.threads: list[threading.Thread] = []
        self.lease_ids = itertools.count()
        self.link_ids = itertools.count()
        self.serials = itertools.count(1)
        self.engine: Notifier | None = None
        self.hello: dict[str, Any] | None = None
        # No lease ends and no publication expires before this (monotonic seconds): the notif
        # loop looks for what expired only then, not over every publication each turn.
        self.next_expiry = math.inf

    # -- lifetime -------------------------------------------------------------------------

    def start(self, engine: Notifier, hello: dict[str, Any]) -> None:
        self.engine, self.hello = engine, hello
        for target, name in ((self._accept_loop, "accept"), (self._notif_loop, "notifs")):
            thread = threading.Thread(target=target, daemon=True,
                                      name=f"kvcore-{self.conn.transport}-{name}")
            thread.start()
            self.threads.append(thread)

    def stop(self, join_s: float) -> None:
        with self.cond:
            self.stopping = True
            connections = list(self.connections)
            self.cond.notify_all()
        close_socket(self.listener)
        for sock in connections:
            close_socket(sock)
        deadline = time.monotonic() + join_s
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.engine is not None and not self.conn.confirms_over_channel:
            with self.notif_lock:  # READs that were notified count as read
                self._apply_notifications()
        with self.cond:
            for pub in self._publications():
                self._settle(pub, "the producer was closed before a consumer read it")
            self.published.clear()
            self.leases.clear()
            self.cond.notify_all()

    # -- publishing ------------------------------------------------------------------------

    def publish(self, keys: list[str], block_ids: list[int], timeout_s: float) -> SaveRecord:
        now = time.monotonic()
        record = SaveRecord(list(block_ids), time.perf_counter(), len(block_ids))
        with self.cond:
            published, serials = self.published, self.serials
            for key, block in zip(keys, block_ids, strict=True):
                pub = _Publication(key, block, record, now + timeout_s, next(serials))
                last = published.setdefault(key, pub)
                if last is not pub:  # the key is published already: chain it after
                    while last.later is not None:
                        last = last.later
                    last.later = pub
            self._due(now + timeout_s)
            self.cond.notify_all()
        return record

    def _due(self, deadline: float) -> None:
        """Something may expire at ``deadline`` (caller holds ``cond``)."""
        if deadline < self.next_expiry:
            self.next_expiry = deadline

    def _settle(self, pub: _Publication, failure: str | None) -> None:
        """Record ``pub``'s outcome (caller holds ``cond``)."""
        record = pub.save
        if failure is None:
            record.done.append(pub.block)
        else:
            record.failed[pub.block] = failure
        record.pending -= 1

    def _unpublish(self, pub: _Publication) -> None:
        """Take ``pub`` out of its key's chain (caller holds ``cond``)."""
        first = self.published.get(pub.key)
        if first is pub:
            if pub.later is None:
                del self.published[pub.key]
            else:
                self.published[pub.key] = pub.later
            return
        while first is not None and first.later is not pub:
            first = first.later
        if first is not None:
            first.later = pub.later

    def _publications(self) -> list[_Publication]:
        """Every publication (caller holds ``cond``)."""
        out = []
        for pub in self.published.values():
            while pub is not None:
                out.append(pub)
                pub = pub.later
        return out

    def _available(self, key: str, consumer: str) -> _Publication | None:
        """The oldest publication of ``key`` that ``consumer`` may take: one it neither holds
        nor read, with fewer READs done and in flight than the ``readers`` it waits for."""
        return _open_to(self.published.get(key), consumer, self.conn.readers)

    def lookup(self, keys: list[str], consumer: str) -> tuple[list[int], list[int]]:
        """The leading ``keys`` published and open to ``consumer``: their blocks and their
        publications' serials (as long as each other: the number of hits)."""
        blocks, serials = [], []
        with self.cond:
            for key in keys:
                pub = self._available(key, consumer)
                if pub is None:
                    break
                blocks.append(pub.block)
                serials.append(pub.serial)
        return blocks, serials

    def fetch(self, consumer: str, keys: list[str], lease_s: float, link: int = -1
              ) -> tuple[str, list[int], list[int]]:
        """Lease the published blocks of ``keys`` to ``consumer`` (on connection ``link``)
        for ``lease_s`` seconds, at most ``max_lease_s``: the lease and, per key, the block
        leased and its publication's serial (``-1`` both: none published that ``consumer``
        may take)."""
        max_lease_s = self.conn.max_lease_s
        if lease_s > max_lease_s:
            raise ValueError(f"lease_s={lease_s} is longer than this producer's max_lease_s="
                             f"{max_lease_s}: give the consumer a timeout_s of at most "
                             f"{max_lease_s / 2:g} (a lease is twice it), or raise the "
                             "producer's max_lease_s")
        lease_id = f"{next(self.lease_ids)}-{uuid.uuid4().hex[:8]}"
        with self.cond:
            readers = self.conn.readers
            taken: list[_Publication | None] = list(map(self.published.get, keys))
            blocks = [-1] * len(keys)
            serials = [-1] * len(keys)
            for i, pub in enumerate(taken):  # (this loop runs per key of every load)
                # (_open_to inlined for the common case: the key's first publication is open)
                if pub is not None and (pub.reads + pub.held >= readers or (
                        pub.takers is not None and consumer in pub.takers)):
                    pub = taken[i] = _open_to(pub.later, consumer, readers)
                if pub is not None:  # after the previous keys took theirs
                    pub.held += 1
                    blocks[i] = pub.block
                    serials[i] = pub.serial
                    if readers > 1:
                        if pub.takers is None:
                            pub.takers = set()
                        pub.takers.add(consumer)
            held = len(taken) - taken.count(None)
            if held:
                deadline = time.monotonic() + lease_s
                self.leases[lease_id] = _Lease(lease_id, consumer, taken, deadline, link, held)
                self._due(deadline)
                self.cond.notify_all()
        return lease_id, blocks, serials

    def read_done(self, consumer: str, lease_id: str, first: int, end: int) -> None:
        """A consumer's notification: it READ entries ``first..end-1`` of the lease (the
        blocks read by every consumer they wait for are released and their saves told)."""
        with self.cond:
            taken = self._take_read(consumer, lease_id, first, end)
            if taken is not None and taken[0]:
                self._settle_read(taken[0], None)

    def _take_read(self, consumer: str, lease_id: str, first: int, end: int
                   ) -> tuple[list[_Publication], list[_Publication]] | None:
        """Count the READ of entries ``first..end-1`` of the lease by ``consumer``; returns
        ``(read by every consumer they wait for: unpublished, to settle; still waiting for
        others)``, or ``None`` when the lease has ended (its blocks may have changed
        meanwhile)."""
        with self.cond:
            lease = self.leases.get(lease_id)
            if lease is None or lease.consumer != consumer:
                logger.warning("%s: confirmation for unknown lease %r from %s", self.who,
                               lease_id, consumer)
                return None
            complete, partial = [], []
            pubs, readers, published = lease.publications, self.conn.readers, self.published
            first, end = max(0, first), min(end, len(pubs))
            for pub in pubs[first:end]:  # (this loop runs per block of every load)
                if pub is None:
                    continue
                pub.held -= 1
                pub.reads += 1
                if pub.reads >= readers:  # no other lease holds it then
                    # (_unpublish inlined for the common case: the key's one publication)
                    if pub.later is None and published.get(pub.key) is pub:
                        del published[pub.key]
                    else:
                        self._unpublish(pub)
                    complete.append(pub)
                else:
                    partial.append(pub)
                    self._due(pub.deadline)  # it may expire once no lease holds it
            if end > first:
                pubs[first:end] = [None] * (end - first)
            lease.held -= len(complete) + len(partial)
            self._drop_if_empty(lease)
            return complete, partial

    def _uncount_read(self, consumer: str, partial: list[_Publication]) -> None:
        """READs counted by :meth:`_take_read` that the consumer does not count (its
        confirmation's answer was lost): the blocks wait for another consumer instead."""
        with self.cond:
            for pub in partial:
                pub.reads -= 1
                pub.takers.discard(consumer)  # (partial: readers > 1, so it has takers)
            self.cond.notify_all()

    def _settle_read(self, taken: list[_Publication], failure: str | None) -> None:
        with self.cond:
            if failure is None:  # (_settle inlined: a READ settles every block of a load)
                for pub in taken:
                    pub.save.done.append(pub.block)
                    pub.save.pending -= 1
            else:
                for pub in taken:
                    self._settle(pub, failure)
            self.cond.notify_all()

    def give_back(self, consumer: str, lease_id: str, indices: list[int]) -> None:
        """Entries a consumer could not read: published again (until their deadline)."""
        with self.cond:
            lease = self.leases.get(lease_id)
            if lease is None or lease.consumer != consumer:
                return
            for i in indices:
                if isinstance(i, int) and 0 <= i < len(lease.publications):
                    pub = lease.publications[i]
                    if pub is not None:
                        lease.publications[i] = None
                        lease.held -= 1
                        pub.held -= 1
                        if pub.takers is not None:
                            pub.takers.discard(consumer)  # it may try again
                        self._due(pub.deadline)
            self._drop_if_empty(lease)
            self.cond.notify_all()

    def _drop_if_empty(self, lease: _Lease) -> None:
        if not lease.held:
            self.leases.pop(lease.lease_id, None)

    def _end_lease(self, lease: _Lease) -> None:
        """Publish a lease's unread blocks again (caller holds ``cond``)."""
        del self.leases[lease.lease_id]
        for pub in lease.publications:
            if pub is not None:
                pub.held -= 1
                if pub.takers is not None:
                    pub.takers.discard(lease.consumer)
                self._due(pub.deadline)
        self.cond.notify_all()

    def release_link(self, link: int) -> None:
        """The connection ``link`` closed: its leases end (their blocks are published again)
        instead of pinning them for the rest of the lease.

        Where confirmations travel on that connection, nothing can confirm them any more:
        they end now. Where the engine notifies READs itself, a consumer that closes right
        after its last load sent those notifications before it closed, but they may reach this
        side after the close: its leases end :data:`CLOSED_LINK_GRACE_S` later, the
        notifications that arrive meanwhile counting as usual."""
        with self.notif_lock:
            notifying = not self.conn.confirms_over_channel
            if notifying:
                self._apply_notifications()
            with self.cond:
                grace_end = time.monotonic() + CLOSED_LINK_GRACE_S
                for lease in [le for le in self.leases.values() if le.link == link]:
                    if notifying:
                        lease.closed = True
                        lease.deadline = min(lease.deadline, grace_end)
                        self._due(lease.deadline)
                    else:
                        self._end_lease(lease)
                self.cond.notify_all()

    def _expire(self, now: float) -> None:
        """Release what waited too long (caller holds ``cond``); nothing to look at before
        :attr:`next_expiry`."""
        if now < self.next_expiry:
            return
        for lease in [le for le in self.leases.values() if le.deadline <= now]:
            self._end_lease(lease)
            if lease.closed:
                logger.info("%s: consumer %s closed its connection without reading all of "
                            "lease %s; the rest is published again", self.who, lease.consumer,
                            lease.lease_id)
            else:
                logger.warning("%s: consumer %s did not confirm lease %s in time; its blocks "
                               "are published again", self.who, lease.consumer, lease.lease_id)
        expired = [pub for pub in self._publications() if not pub.held and pub.deadline <= now]
        for pub in expired:
            self._unpublish(pub)
            self._settle(pub, self._unread_reason(pub))
        if expired:
            self.cond.notify_all()
        # What may expire next: a lease, or a publication no lease holds (one that a lease
        # holds is looked at again when that lease lets it go, see _due).
        self.next_expiry = min(
            itertools.chain((le.deadline for le in self.leases.values()),
                            (pub.deadline for pub in self._publications() if not pub.held)),
            default=math.inf)

    def _unread_reason(self, pub: _Publication) -> str:
        conn = self.conn
        if pub.reads:
            return (f"read by {pub.reads} of the readers={conn.readers} consumers it waits for "
                    f"within publish_timeout_s={conn.publish_timeout_s}")
        who = (f"none of the {self.consumers_seen} consumer(s) that connected read it"
               if self.consumers_seen else
               f"no consumer connected to {conn.host}:{conn.port}")
        return f"not read within publish_timeout_s={conn.publish_timeout_s}: {who}"

    # -- threads ---------------------------------------------------------------------------

    def _notif_loop(self) -> None:
        """Expire what waited too long and collect READ notifications (where the engine sends
        them); polls the engine often while leases are out, rarely otherwise. Collected
        notifications are counted :data:`SETTLE_AFTER_S` later unless a fetch's answer or a
        lease's end counts them first."""
        notifying = not self.conn.confirms_over_channel
        first, most = NOTIF_PAUSES_S
        pause = first
        while True:
            with self.cond:
                if self.stopping:
                    return
                if not (notifying and (self.leases or self.unsettled)):
                    self._expire(time.monotonic())
                    self.cond.wait(0.05)
                    pause = first
                    continue
            with self.notif_lock:
                arrived = self._collect()
                now = time.monotonic()
                if self.unsettled and (now >= self.next_expiry
                                       or now - self.unsettled_since >= SETTLE_AFTER_S):
                    self._count_collected()  # (before any lease ends)
                with self.cond:
                    self._expire(now)
            if arrived:
                pause = first
            else:
                # Not past a collected notification's settling time.
                wait = pause
                if self.unsettled:
                    wait = min(wait, max(0.0, self.unsettled_since + SETTLE_AFTER_S - now))
                time.sleep(max(wait, first / 10))
                pause = min(2 * pause, most)

    def settle_after_answer(self) -> None:
        """Count the READ notifications that arrived: called after a fetch was answered, when
        its consumer READs and nothing waits for this producer (the previous load's
        notification has arrived by then, often before the notification loop fetched it).
        The loop holds the lock for a poll of the engine (microseconds); should the engine
        hold it up, the connection's next request waits for it 50 ms at most (the loop counts
        them within SETTLE_AFTER_S then)."""
        if not self.conn.confirms_over_channel and self.notif_lock.acquire(timeout=0.05):
            try:
                self._apply_notifications()
            finally:
                self.notif_lock.release()

    def _collect(self) -> int:
        """Fetch the engine's READ notifications, to count later (caller holds
        ``notif_lock``); returns how many arrived."""
        notifs = self.engine.notifications()
        if notifs:
            if not self.unsettled:
                self.unsettled_since = time.monotonic()
            self.unsettled.extend(notifs)
        return len(notifs)

    def _count_collected(self) -> None:
        """Count the READs of the collected notifications (caller holds ``notif_lock``)."""
        notifs, self.unsettled = self.unsettled, []
        for consumer, raw in notifs:
            self._on_notif(consumer, raw)

    def _apply_notifications(self) -> int:
        """Fetch the engine's READ notifications and count them with those collected before
        (caller holds ``notif_lock``); returns how many arrived now."""
        arrived = self._collect()
        self._count_collected()
        return arrived

    def _on_notif(self, consumer: str, raw: bytes) -> None:
        try:
            lease_id, first, end = raw.decode().split(":")
            self.read_done(consumer, lease_id, int(first), int(end))
        except (UnicodeDecodeError, ValueError):
            logger.warning("%s: unreadable notification %r from %s", self.who, raw[:100],
                           consumer)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return  # the listener was closed
            # Answers are single frames a consumer waits for: send them at once (Nagle's
            # algorithm would hold a frame's last segment until the previous ones are acked).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cond:
                if self.stopping:
                    close_socket(sock)
                    return
                self.connections.add(sock)
            thread = threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                                      name=f"kvcore-{self.conn.transport}-peer-"
                                           f"{addr[0]}:{addr[1]}")
            with self.cond:
                self.threads = [t for t in self.threads if t.is_alive()]
                self.threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        """Answer one consumer until it disconnects; then its leases end."""
        consumer = None
        link = next(self.link_ids)
        try:
            sock.settimeout(self.conn.connect_timeout_s)
            hello = recv_frame(sock)
            consumer = self._answer_hello(sock, hello, addr)
            if consumer is None:
                return
            sock.settimeout(None)  # idle consumers are fine; close() shuts the socket
            while True:
                request = recv_frame(sock)
                op = request.get("op")
                if op == "done":  # (every consumer's gathers in place confirm this way)
                    self._answer_done(sock, consumer, request)
                else:
                    answer = self._answer(consumer, request, link)
                    send_frame(sock, answer, answer.pop("tail", b""))
                    if op == "fetch":
                        self.settle_after_answer()
        except (BadFrame, RecursionError) as exc:  # answered, then the connection ends
            logger.warning("%s: refused %s (%s): %s", self.who, addr,
                           consumer or "before hello", exc)
            with contextlib.suppress(OSError):
                send_frame(sock, {"ok": False, "error": f"refused: {exc}"})
        except (OSError, ChannelError) as exc:
            with self.cond:
                stopping = self.stopping
            if not stopping and not (isinstance(exc, ChannelError)
                                     and "closed the connection" in str(exc)):
                logger.warning("%s: connection from %s (%s) ended: %s", self.who, addr,
                               consumer or "before hello", exc)
        finally:
            with self.cond:
                self.connections.discard(sock)
            close_socket(sock)
            self.release_link(link)

    def _answer_hello(self, sock: socket.socket, hello: dict[str, Any], addr: Any
                      ) -> str | None:
        layout = self.conn._layout
        protocol = self.conn.channel_protocol
        if hello.get("op") != "hello" or hello.get("protocol") != protocol:
            send_frame(sock, {"ok": False, "error": f"expected a {protocol} hello, got "
                                                     f"{reprlib.repr(hello)}"})
            return None
        try:
            theirs = KVCacheLayout.from_dict(hello.get("layout"))
            heads = hello.get("num_kv_heads")
            heads = heads if isinstance(heads, int) else self.conn.num_kv_heads
            # The consumer converts on load; refuse here what it could not convert.
            plan = plan_conversion(layout, theirs, src_tp=self.conn.tp,
                                   dst_tp=as_tp_rank(hello.get("tp"), "the consumer's tp"),
                                   num_kv_heads=heads, quantize=hello.get("quantize") is True)
        except (TypeError, ValueError) as exc:  # LayoutConversionError is a ValueError
            logger.warning("%s: refused consumer %s: %s", self.who, addr, exc)
            send_frame(sock, {"ok": False, "error": str(exc), "protocol": protocol,
                               "layout": layout.to_dict()})
            return None
        consumer = hello.get("agent")
        if not isinstance(consumer, str) or not consumer:
            send_frame(sock, {"ok": False, "error": "hello without an agent name"})
            return None
        send_frame(sock, {**self.hello, "ok": True,
                          **self._mapping(hello.get("map"), plan.is_identity)})
        with self.cond:
            self.consumers_seen += 1
        return consumer

    def _mapping(self, peer: Any, identity: bool) -> dict[str, Any]:
        """The hello's answer to a converting consumer that asks to map this cache (its
        :func:`~kvcore.connectors.shared_memory.peer_facts`): a handle of it made for that
        consumer alone (``allocation``), or why it cannot map it (``unmappable``)."""
        if peer is None or identity:  # (same layouts: READ straight into its cache)
            return {}
        shared = self.conn._shared
        why = shareable_with(shared, peer)
        if why is None:
            try:
                other = peer["pid"] != os.getpid() or peer["host"] != host_identity()
                return {"allocation": share_allocation(shared, other_processes=other)}
            except (RuntimeError, ValueError) as exc:
                why = f"the producer could not share its cache: {exc}"
        return {"unmappable": why}

    def _answer(self, consumer: str, request: dict[str, Any], link: int) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "lookup":
                blocks, serials = self.lookup(_keys(request), consumer)
                return {"ok": True, "hits": len(blocks), "tail": pack_blocks(blocks + serials)}
            if op == "fetch":
                lease_s = check_seconds("lease_s", request.get("lease_s"))
                lease, blocks, serials = self.fetch(consumer, _keys(request), lease_s, link)
                return {"ok": True, "lease": lease, "tail": pack_blocks(blocks + serials)}
            if op == "giveback":
                self.give_back(consumer, str(request.get("lease")),
                               list(request.get("indices") or []))
                return {"ok": True}
        except (TypeError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"unknown request {reprlib.repr(request)}"}


    def _answer_done(self, sock: socket.socket, consumer: str, request: dict[str, Any]
                     ) -> None:
        """A consumer's confirmation on the side channel, ``done`` {lease, first, end,
        quiet}. Answered (``quiet`` false), the blocks count as read (their save as done)
        only once the answer is sent: a producer that closes when its saves are done must not
        cut off the answer the consumer counts its READ by. ``quiet`` (a gather in place,
        which counts its blocks as a READ with a notification does, while its link is up):
        no answer, and the blocks count when it arrives."""
        lease, first, end = str(request.get("lease")), request.get("first"), request.get("end")
        quiet = request.get("quiet") is True
        if isinstance(first, bool) or isinstance(end, bool) \
                or not (isinstance(first, int) and isinstance(end, int)):
            why = f"done needs int first and end, got {first!r}, {end!r}"
            if quiet:  # (nothing may be sent: the consumer reads no answer)
                raise BadFrame(why)
            send_frame(sock, {"ok": False, "error": why})
            return
        taken = self._take_read(consumer, lease, first, end)
        if taken is None:
            if not quiet:
                send_frame(sock, {"ok": False, "error": f"lease {lease!r} has ended (it "
                                                        "expired or its connection closed)"})
            return
        complete, partial = taken
        try:
            if not quiet:
                send_frame(sock, {"ok": True})
        except OSError:
            self._settle_read(complete, "the consumer read it, but its confirmation could not "
                                        "be answered (the link broke), so it does not count it")
            self._uncount_read(consumer, partial)
            raise
        self._settle_read(complete, None)


def _keys(request: dict[str, Any]) -> list[str]:
    """A request's keys: the frame's tail (:func:`pack_keys`), or a JSON list of str. Only
    looked up among the published keys (which ``save`` checked), so one that is no key is
    simply not published; its format is not checked again here, per key of every load."""
    tail = request.get("tail")
    if tail is not None:
        if len(tail) % _KEY_CHARS:
            raise ValueError(f"a request's keys are {_KEY_CHARS} characters each; its tail "
                             f"has {len(tail)} bytes")
        text = tail.decode("ascii")  # (a UnicodeDecodeError is a ValueError)
        return [text[i:i + _KEY_CHARS] for i in range(0, len(text), _KEY_CHARS)]
    keys = request.get("keys")
    if not isinstance(keys, list) or not all(type(k) is str for k in keys):
        raise TypeError(f"keys must be a list of hex-digest strings, got "
                        f"{reprlib.repr(keys)}")
    return keys
