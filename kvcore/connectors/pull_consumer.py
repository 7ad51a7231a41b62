"""The consumer's side of the pull connectors (:mod:`kvcore.connectors.pull`): its link to one
producer over the side channel, the handshake that checks the producer's layout and plans the
conversion of its blocks, and the requests that follow."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvcore import KVCacheLayout, LayoutMismatchError
from kvcore.connectors.convert import ConversionPlan, LayoutConversionError, TPRank, as_tp_rank
from kvcore.connectors.pull_channel import (
    ChannelError,
    close_socket,
    pack_keys,
    recv_frame,
    send_frame,
)
from kvcore.connectors.pull_engine import Engine, Regions
from kvcore.connectors.shared_memory import peer_facts

__all__ = ["Consumer", "ConsumerSide"]

# The connector's logger: what happens here is the connector's to report.
logger = logging.getLogger("kvcore.connectors.pull")


class ConsumerSide(Protocol):
    """What the consumer reads of its connector (a
    :class:`~kvcore.connectors.pull.PullConnector`, which imports this module)."""

    transport: str
    channel_protocol: str
    hello_fields: tuple[str, ...]
    host: str
    port: int
    connect_timeout_s: float
    timeout_s: float
    tp: TPRank
    num_kv_heads: int | None
    map_producer: bool
    _layout: KVCacheLayout
    _kv_scales: Any

    def _plan_from(self, producer: KVCacheLayout, producer_tp: TPRank,
                   producer_heads: Any) -> ConversionPlan:
        """The conversion from the producer's cache into this consumer's."""


class Consumer:
    """The consumer's link to one producer: the socket, the producer's regions and engine."""

    def __init__(self, conn: ConsumerSide, engine: Engine) -> None:
        self.conn = conn
        self.engine = engine
        self.who = f"{conn.transport} consumer"
        self.lock = threading.Lock()  # one request/answer at a time on the socket
        self.sock: socket.socket | None = None
        self.failure: str | None = None  # why the link is down
        self.remote: Any = None  # what the engine calls the producer
        self.regions: Regions | None = None
        self.num_blocks = 0
        self.plan: ConversionPlan | None = None  # producer's layout -> this cache's
        self.allocation: Any = None  # the producer's cache, shared for this consumer
        self.unmappable: str | None = None  # why the producer did not share it

    def connect(self, local: Regions) -> None:
        conn = self.conn
        deadline = time.monotonic() + conn.connect_timeout_s
        where = f"{conn.host}:{conn.port}"
        last: Exception | None = None
        sock = None
        while sock is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionError(
                    f"{self.who}: no producer answered at {where} within connect_timeout_s="
                    f"{conn.connect_timeout_s} (last error: {last}); start the producer "
                    "first, check the address and port, and that a firewall lets TCP to that "
                    "port through")
            try:
                sock = socket.create_connection((conn.host, conn.port), timeout=min(left, 2.0))
            except OSError as exc:
                last = exc
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        try:
            # Requests and answers are single frames, each waited for: send them at once.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            send_frame(sock, {"op": "hello", "protocol": conn.channel_protocol,
                               "agent": self.engine.name, "layout": conn._layout.to_dict(),
                               "tp": [conn.tp.degree, conn.tp.rank],
                               "num_kv_heads": conn.num_kv_heads,
                               "quantize": conn._kv_scales is not None,
                               # (asks a handle of the producer's cache, to convert in place)
                               **({"map": peer_facts()} if conn.map_producer else {})})
            reply = recv_frame(sock)
        except (OSError, ChannelError) as exc:
            close_socket(sock)
            raise ConnectionError(
                f"{self.who}: the producer at {where} did not complete the handshake within "
                f"connect_timeout_s={conn.connect_timeout_s}: {exc}") from exc
        try:
            self._check_reply(reply, where)
            self.remote = self.engine.connect(reply)
        except BaseException:
            close_socket(sock)
            raise
        if self.regions.mem_type != local.mem_type:
            logger.info("%s: reading %s blocks into %s", self.who, self.regions.mem_type,
                        local.mem_type)
        sock.settimeout(conn.timeout_s)
        self.sock = sock

    def _check_reply(self, reply: dict[str, Any], where: str) -> None:
        layout = self.conn._layout
        names = ("consumer", f"producer {where}")
        if "layout" in reply:
            try:
                theirs = KVCacheLayout.from_dict(reply["layout"])
                src_tp = as_tp_rank(reply.get("tp"), "the producer's tp")
            except (TypeError, ValueError) as exc:
                raise LayoutMismatchError(f"{names[1]} sent a layout this kvcore cannot read "
                                          f"({exc}); {names[0]} has {layout.describe()}"
                                          ) from exc
            # The same plan the producer agreed to (or refused, naming the field).
            try:
                self.plan = self.conn._plan_from(theirs, src_tp, reply.get("num_kv_heads"))
            except LayoutConversionError as exc:
                raise LayoutConversionError(f"{names[0]} cannot load from {names[1]}: {exc}"
                                            ) from None
        if not reply.get("ok"):
            raise ConnectionError(f"{self.who}: the producer at {where} refused the "
                                  f"connection: {reply.get('error')}")
        missing = [k for k in self.conn.hello_fields if k not in reply]
        if reply.get("protocol") != self.conn.channel_protocol or missing:
            raise ConnectionError(f"{self.who}: {where} answered {str(reply)[:200]!r}, "
                                  f"not a {self.conn.channel_protocol} producer")
        self.regions = Regions.from_dict(reply.get("regions"))
        self.num_blocks = int(reply.get("num_blocks", 0))
        self.allocation = reply.get("allocation")
        self.unmappable = reply.get("unmappable")
        max_lease_s = reply.get("max_lease_s")
        if isinstance(max_lease_s, (int, float)) and 2 * self.conn.timeout_s > max_lease_s:
            raise ValueError(f"{self.who}: timeout_s={self.conn.timeout_s} needs leases of "
                             f"{2 * self.conn.timeout_s:g} s, and the producer at {where} "
                             f"grants at most max_lease_s={max_lease_s}: lower timeout_s to "
                             f"{max_lease_s / 2:g} or raise the producer's max_lease_s")

    def request(self, message: dict[str, Any], timeout: float | None = None,
                keys: list[str] | None = None,
                while_waiting: Callable[[], None] | None = None) -> dict[str, Any]:
        """One request and its answer within ``timeout`` (default ``timeout_s``); a failure
        downs the link (a late answer would desynchronise the stream). ``keys``: the
        request's block keys, sent as the frame's tail. ``while_waiting()``: called once the
        request is sent, before the answer is read (it must not raise)."""
        tail = b"" if keys is None else pack_keys(keys)
        with self.lock:
            if self.failure is not None:
                raise ChannelError(self.failure)
            try:
                self.sock.settimeout(timeout or self.conn.timeout_s)
                send_frame(self.sock, message, tail)
                if while_waiting is not None:
                    while_waiting()
                reply = recv_frame(self.sock)
            except (OSError, ChannelError) as exc:
                kind = "no answer" if isinstance(exc, TimeoutError) else "lost"
                self.failure = (f"link to the producer at {self.conn.host}:{self.conn.port} "
                                f"{kind} (timeout_s={self.conn.timeout_s}): {exc}")
                close_socket(self.sock)
                raise ChannelError(self.failure) from exc
        if not reply.get("ok"):
            raise ChannelError(f"the producer refused {message.get('op')}: "
                                f"{reply.get('error')}")
        return reply

    def send(self, message: dict[str, Any]) -> None:
        """Send a message the producer does not answer (a quiet ``done``); a failure downs
        the link."""
        with self.lock:
            if self.failure is not None:
                raise ChannelError(self.failure)
            try:
                send_frame(self.sock, message)
            except OSError as exc:
                self.failure = (f"link to the producer at {self.conn.host}:{self.conn.port} "
                                f"lost (timeout_s={self.conn.timeout_s}): {exc}")
                close_socket(self.sock)
                raise ChannelError(self.failure) from exc

    def disconnect(self) -> None:
        """Down the link: requests in flight fail now, later ones at once."""
        if self.failure is None:
            self.failure = "the connector is closed"
        if self.sock is not None:
            close_socket(self.sock)  # (without the lock: it wakes a request holding it)
