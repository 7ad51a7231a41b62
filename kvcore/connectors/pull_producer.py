"""The producer's side of the pull connectors (:mod:`kvcore.connectors.pull`): the side
channel's frames, the published blocks, the leases consumers take on them, and the threads
that answer consumers and expire what waited too long."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import reprlib
import socket
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore import KVCacheLayout
from kvcore.connectors.convert import TPRank, as_tp_rank, plan_conversion

__all__ = ["CLOSED_LINK_GRACE_S", "BadFrame", "ChannelError", "Notifier", "Producer",
           "ProducerSide", "SaveRecord", "check_seconds", "close_socket", "recv_frame",
           "send_frame"]

logger = logging.getLogger(__name__)

_MAX_FRAME_BYTES = 64 << 20  # engine metadata is the largest payload (kilobytes)
#: Seconds a closed connection's leases outlive it where the engine notifies READs itself
#: (NIXL): the consumer's last notifications may arrive after the close (they do over
#: loopback within milliseconds); the blocks not confirmed by then are published again.
CLOSED_LINK_GRACE_S = 2.0


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a float, or a ``ValueError`` naming ``name`` unless finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
    return float(value)


# -- side channel ---------------------------------------------------------------------------


class ChannelError(ConnectionError):
    """The side channel failed (closed, timed out, malformed); the message says why."""


class BadFrame(ChannelError):
    """A whole frame arrived but is not a JSON object (the stream is still in step)."""


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    raw = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ChannelError("the peer closed the connection")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    if not 0 < size <= _MAX_FRAME_BYTES:
        raise ChannelError(f"the peer announced a {size}-byte message (limit "
                            f"{_MAX_FRAME_BYTES})")
    try:
        message = json.loads(_recv_exact(sock, size))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise BadFrame(f"the peer sent a message that is not JSON this side reads "
                       f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    if not isinstance(message, dict):
        raise BadFrame(f"the peer sent {reprlib.repr(message)}, not a JSON object")
    return message


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# -- producer -------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Publication:
    """One published block: the producer's ``block`` holds ``key`` for ``save``, until
    ``readers`` different consumers READ it whole."""

    key: str
    block: int
    save: SaveRecord
    deadline: float  # when it is released, read by fewer consumers than it waits for
    leases: set[str] = field(default_factory=set)  # the leases that hold it now
    takers: set[str] = field(default_factory=set)  # consumers that hold or read it
    reads: int = 0  # READs confirmed


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
        # Held while notifications are fetched and applied, and while a closed connection's
        # leases end: a READ confirmed before the close is never read after its lease ended.
        self.notif_lock = threading.Lock()
        self.published: dict[str, deque[_Publication]] = {}
        self.leases: dict[str, _Lease] = {}
        self.consumers_seen = 0
        self.connections: set[socket.socket] = set()
        self.stopping = False
        self.threads: list[threading.Thread] = []
        self.lease_ids = itertools.count()
        self.link_ids = itertools.count()
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
        with self.cond:
            for pubs in self.published.values():
                for pub in pubs:
                    self._settle(pub, "the producer was closed before a consumer read it")
            self.published.clear()
            self.leases.clear()
            self.cond.notify_all()

    # -- publishing ------------------------------------------------------------------------

    def publish(self, keys: list[str], block_ids: list[int], timeout_s: float) -> SaveRecord:
        now = time.monotonic()
        record = SaveRecord(list(block_ids), time.perf_counter(), len(block_ids))
        with self.cond:
            for key, block in zip(keys, block_ids, strict=True):
                self.published.setdefault(key, deque()).append(
                    _Publication(key, block, record, now + timeout_s))
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
        pubs = self.published.get(pub.key)
        if pubs is None:
            return
        if len(pubs) == 1:  # the common case: one publication of the key
            if pubs[0] is pub:
                del self.published[pub.key]
            return
        with contextlib.suppress(ValueError):
            pubs.remove(pub)

    def _available(self, key: str, consumer: str) -> _Publication | None:
        """The oldest publication of ``key`` that ``consumer`` may take: one it neither holds
        nor read, with fewer READs done and in flight than the ``readers`` it waits for."""
        readers = self.conn.readers
        for pub in self.published.get(key, ()):
            if consumer not in pub.takers and pub.reads + len(pub.leases) < readers:
                return pub
        return None

    def lookup(self, keys: list[str], consumer: str) -> int:
        with self.cond:
            for i, key in enumerate(keys):
                if self._available(key, consumer) is None:
                    return i
            return len(keys)

    def fetch(self, consumer: str, keys: list[str], lease_s: float, link: int = -1
              ) -> tuple[str, list[Any]]:
        """Lease the published blocks of ``keys`` to ``consumer`` (on connection ``link``)
        for ``lease_s`` seconds, at most ``max_lease_s``."""
        max_lease_s = self.conn.max_lease_s
        if lease_s > max_lease_s:
            raise ValueError(f"lease_s={lease_s} is longer than this producer's max_lease_s="
                             f"{max_lease_s}: give the consumer a timeout_s of at most "
                             f"{max_lease_s / 2:g} (a lease is twice it), or raise the "
                             "producer's max_lease_s")
        lease_id = f"{next(self.lease_ids)}-{uuid.uuid4().hex[:8]}"
        with self.cond:
            blocks: list[Any] = []
            taken: list[_Publication | None] = []
            published, readers = self.published, self.conn.readers
            for key in keys:  # (_available inlined: this loop runs per key of every load)
                pub = None
                for candidate in published.get(key, ()):  # after the previous keys took theirs
                    if consumer not in candidate.takers \
                            and candidate.reads + len(candidate.leases) < readers:
                        pub = candidate
                        pub.leases.add(lease_id)
                        pub.takers.add(consumer)
                        break
                blocks.append(None if pub is None else pub.block)
                taken.append(pub)
            held = len(taken) - taken.count(None)
            if held:
                deadline = time.monotonic() + lease_s
                self.leases[lease_id] = _Lease(lease_id, consumer, taken, deadline, link, held)
                self._due(deadline)
                self.cond.notify_all()
        return lease_id, blocks

    def read_done(self, consumer: str, lease_id: str, first: int, end: int) -> None:
        """A consumer's notification: it READ entries ``first..end-1`` of the lease."""
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
            pubs, readers = lease.publications, self.conn.readers
            for i in range(max(0, first), min(end, len(pubs))):
                pub = pubs[i]
                if pub is not None:
                    pubs[i] = None
                    pub.leases.discard(lease_id)
                    pub.reads += 1
                    if pub.reads >= readers:  # no other lease holds it then
                        self._unpublish(pub)
                        complete.append(pub)
                    else:
                        partial.append(pub)
                        self._due(pub.deadline)  # it may expire once no lease holds it
            lease.held -= len(complete) + len(partial)
            self._drop_if_empty(lease)
            return complete, partial

    def _uncount_read(self, consumer: str, partial: list[_Publication]) -> None:
        """READs counted by :meth:`_take_read` that the consumer does not count (its
        confirmation's answer was lost): the blocks wait for another consumer instead."""
        with self.cond:
            for pub in partial:
                pub.reads -= 1
                pub.takers.discard(consumer)
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
                        pub.leases.discard(lease_id)
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
                pub.leases.discard(lease.lease_id)
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
        expired = [pub for pubs in self.published.values() for pub in pubs
                   if not pub.leases and pub.deadline <= now]
        for pub in expired:
            self._unpublish(pub)
            self._settle(pub, self._unread_reason(pub))
        if expired:
            self.cond.notify_all()
        # What may expire next: a lease, or a publication no lease holds (one that a lease
        # holds is looked at again when that lease lets it go, see _due).
        self.next_expiry = min(
            itertools.chain((le.deadline for le in self.leases.values()),
                            (pub.deadline for pubs in self.published.values() for pub in pubs
                             if not pub.leases)), default=math.inf)

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
        them); polls the engine often while leases are out, rarely otherwise."""
        notifying = not self.conn.confirms_over_channel
        while True:
            with self.cond:
                if self.stopping:
                    return
                self._expire(time.monotonic())
                if not (notifying and self.leases):
                    self.cond.wait(0.05)
                    continue
            with self.notif_lock:
                applied = self._apply_notifications()
            if not applied:
                time.sleep(0.0005)

    def _apply_notifications(self) -> int:
        """Fetch the engine's READ notifications and settle them (caller holds
        ``notif_lock``); returns how many arrived."""
        notifs = self.engine.notifications()
        for consumer, raw in notifs:
            self._on_notif(consumer, raw)
        return len(notifs)

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
                if request.get("op") == "done" and self.conn.confirms_over_channel:
                    self._answer_done(sock, consumer, request)
                else:
                    send_frame(sock, self._answer(consumer, request, link))
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
            plan_conversion(layout, theirs, src_tp=self.conn.tp,
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
        send_frame(sock, {**self.hello, "ok": True})
        with self.cond:
            self.consumers_seen += 1
        return consumer

    def _answer(self, consumer: str, request: dict[str, Any], link: int) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "lookup":
                return {"ok": True, "hits": self.lookup(_keys(request), consumer)}
            if op == "fetch":
                lease_s = check_seconds("lease_s", request.get("lease_s"))
                lease, blocks = self.fetch(consumer, _keys(request), lease_s, link)
                return {"ok": True, "lease": lease, "blocks": blocks}
            if op == "giveback":
                self.give_back(consumer, str(request.get("lease")),
                               list(request.get("indices") or []))
                return {"ok": True}
        except (TypeError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"unknown request {reprlib.repr(request)}"}


    def _answer_done(self, sock: socket.socket, consumer: str, request: dict[str, Any]
                     ) -> None:
        """A consumer's confirmation on the side channel, ``done`` {lease, first, end}. The
        blocks count as read (their save as done) only once the answer is sent: a producer
        that closes when its saves are done must not cut off the answer the consumer counts
        its READ by."""
        lease, first, end = str(request.get("lease")), request.get("first"), request.get("end")
        if isinstance(first, bool) or isinstance(end, bool) \
                or not (isinstance(first, int) and isinstance(end, int)):
            send_frame(sock, {"ok": False, "error": f"done needs int first and end, got "
                                                    f"{first!r}, {end!r}"})
            return
        taken = self._take_read(consumer, lease, first, end)
        if taken is None:
            send_frame(sock, {"ok": False, "error": f"lease {lease!r} has ended (it expired "
                                                    "or its connection closed)"})
            return
        complete, partial = taken
        try:
            send_frame(sock, {"ok": True})
        except OSError:
            self._settle_read(complete, "the consumer read it, but its confirmation could not "
                                        "be answered (the link broke), so it does not count it")
            self._uncount_read(consumer, partial)
            raise
        self._settle_read(complete, None)


def _keys(request: dict[str, Any]) -> list[str]:
    """A request's keys: a list of str. Only looked up among the published keys (which
    ``save`` checked), so one that is no key is simply not published; its format is not
    checked again here, per key of every load."""
    keys = request.get("keys")
    if not isinstance(keys, list) or not all(type(k) is str for k in keys):
        raise TypeError(f"keys must be a list of hex-digest strings, got "
                        f"{reprlib.repr(keys)}")
    return keys
