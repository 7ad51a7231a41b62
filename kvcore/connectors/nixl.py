"""``nixl``: KV blocks read straight from another engine's cache through NIXL.

For disaggregated prefill/decode: a **producer** engine (prefill) publishes blocks with
:meth:`~NixlConnector.save`; a **consumer** engine (decode), on the same machine or another,
finds them with :meth:`~NixlConnector.lookup` and READs them with :meth:`~NixlConnector.load`
straight from the producer's cache into its own blocks through NIXL (UCX underneath: RDMA,
NVLink, CUDA IPC, shared memory or TCP, whichever the two sides share). No bytes are staged.

Memory: each side registers its cache's storage with its NIXL agent (``VRAM`` on a GPU,
``DRAM`` on the CPU). A block is one region per byte view of
:class:`~kvcore.connectors.RegisteredCaches`: one region of ``num_layers * page_size_bytes``
for a cross-layer cache, one ``page_size_bytes`` region per layer otherwise. A load issues
one NIXL transfer per run of blocks that are consecutive on both sides, with one descriptor
per region kind (per layer, or one for cross-layer): so a run succeeds or fails whole, and
blocks of other runs are not affected.

Side channel (standard library sockets, no central server): the producer listens on
``host:port``; any number of consumers connect. Frames are a 4-byte big-endian length and a
JSON object. A consumer sends ``hello`` (its :meth:`kvcore.KVCacheLayout.to_dict`); the
producer answers with its layout, its NIXL agent metadata and the addresses of its block
regions. Both sides compare the layouts (the number of blocks aside) and refuse a mismatch
with :class:`kvcore.LayoutMismatchError` before any byte moves. Then:

- ``lookup`` {keys}: how many leading keys are published and not taken by another consumer;
- ``fetch`` {keys, lease_s}: take the published ones for ``lease_s`` seconds; the answer
  names the producer's block of each key (``null``: not published yet). The consumer READs
  them with the notification ``<lease>:<first>:<end>`` per run; when the notification
  arrives the producer releases the blocks and the save reports them done;
- ``giveback`` {lease, indices}: runs whose READ NIXL reported failed go back to published
  (runs that timed out stay leased until the lease ends, see below).

Lifetimes, all bounded: a published block stays pinned until a consumer's READ of it is
notified, or ``publish_timeout_s`` after the save (then the save reports it failed, naming
the reason). A lease lasts twice the consumer's ``timeout_s``, longer than the consumer
ever waits for its READ, so a producer does not hand a block back to its engine while the
consumer may still count it as read; the producer refuses leases longer than its
``max_lease_s``, and a consumer whose connection closes (killed, or closed) loses its leases
at once: their blocks are published again. A consumer counts a READ only while its
connection is up, so a block published again is never one it still reports as read. A
consumer's load fails, within ``timeout_s``, every block it could not read whole: a producer
that died, froze or never published the key; a READ that times out is cancelled (a failure
to cancel is named in the block's reason).
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import itertools
import json
import logging
import math
import os
import reprlib
import socket
import struct
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import KVCacheLayout, LayoutMismatchError
from kvcore.connectors.base import KVConnector, RegisteredCaches, TransferHandle, TransferResult
from kvcore.connectors.keys import check_block_keys

__all__ = ["UCX_DEFAULTS", "NixlConnector", "nixl_unavailable_reason"]

logger = logging.getLogger(__name__)

_PROTOCOL = "kvcore-nixl-v1"
_MAX_FRAME_BYTES = 64 << 20  # agent metadata is the largest payload (kilobytes)
_ROLES = ("producer", "consumer")


#: Where NIXL's Python API lives: the ``nixl`` meta package, or one CUDA build's wheel alone
#: (``nixl-cu12`` installs the module ``nixl_cu12``, ``nixl-cu13`` the module ``nixl_cu13``).
_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _nixl_module_order() -> tuple[str, ...]:
    """:data:`_NIXL_MODULES`, the build matching torch's CUDA major version first: UCX's CUDA
    transport of the other build cannot load, and NIXL then refuses to register VRAM."""
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        return _NIXL_MODULES
    own = f"nixl_cu{cuda.split('.')[0]}._api"
    return tuple(sorted(_NIXL_MODULES, key=lambda name: name != own))


def _nixl_api() -> Any:
    """NIXL's ``_api`` module (with ``nixl_agent`` and ``nixl_agent_config``)."""
    errors = []
    for name in _nixl_module_order():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a broken install raising anything
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
            return module
        errors.append(f"{name}: has no nixl_agent")
    raise ImportError("; ".join(errors))


def nixl_unavailable_reason() -> str | None:
    """Why the ``nixl`` connector cannot run here, or ``None`` when it can."""
    try:
        _nixl_api()
    except ImportError as exc:
        return (f"NIXL's Python API is not importable ({exc}); install it with "
                "pip install 'kvcore[nixl]' (the nixl-cu12 wheel, Linux only; on CUDA 13, "
                "pip install nixl-cu13)")
    return None


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
    return float(value)


# -- side channel ---------------------------------------------------------------------------


class _ChannelError(ConnectionError):
    """The side channel failed (closed, timed out, malformed); the message says why."""


class _BadFrame(_ChannelError):
    """A whole frame arrived but is not a JSON object (the stream is still in step)."""


def _send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    raw = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise _ChannelError("the peer closed the connection")
        chunks += chunk
    return bytes(chunks)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    if not 0 < size <= _MAX_FRAME_BYTES:
        raise _ChannelError(f"the peer announced a {size}-byte message (limit "
                            f"{_MAX_FRAME_BYTES})")
    try:
        message = json.loads(_recv_exact(sock, size))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise _BadFrame(f"the peer sent a message that is not JSON this side reads "
                        f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    if not isinstance(message, dict):
        raise _BadFrame(f"the peer sent {reprlib.repr(message)}, not a JSON object")
    return message


# -- NIXL ----------------------------------------------------------------------------------


def _memory_kind(storage: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ``VRAM`` and the GPU, or ``DRAM``."""
    if storage.is_cuda:
        return "VRAM", storage.device.index or 0
    if storage.device.type != "cpu":
        raise ValueError(f"the nixl connector moves CPU (DRAM) or CUDA (VRAM) caches; this "
                         f"one is on {storage.device}")
    return "DRAM", 0


@dataclass(frozen=True)
class _Regions:
    """Where the blocks of a cache are: per byte view, the address of block 0, the distance
    between blocks and the bytes of one block (one row)."""

    addrs: tuple[int, ...]
    strides: tuple[int, ...]
    row_bytes: tuple[int, ...]
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int

    @classmethod
    def of(cls, reg: RegisteredCaches) -> _Regions:
        views = reg.views
        return cls(tuple(v.data_ptr() for v in views), tuple(v.stride(0) for v in views),
                   tuple(v.shape[1] for v in views), *_memory_kind(reg.kv_caches.storage))

    def to_dict(self) -> dict[str, Any]:
        return {"addrs": list(self.addrs), "strides": list(self.strides),
                "row_bytes": list(self.row_bytes), "mem_type": self.mem_type,
                "dev_id": self.dev_id}

    @classmethod
    def from_dict(cls, data: Any) -> _Regions:
        try:
            regions = cls(tuple(int(a) for a in data["addrs"]),
                          tuple(int(s) for s in data["strides"]),
                          tuple(int(r) for r in data["row_bytes"]), str(data["mem_type"]),
                          int(data["dev_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise _ChannelError(f"the producer sent unreadable block regions ({exc})") from exc
        if not len(regions.addrs) == len(regions.strides) == len(regions.row_bytes) \
                or regions.mem_type not in ("DRAM", "VRAM"):
            raise _ChannelError(f"the producer sent inconsistent block regions {data!r}")
        return regions

    def run_descs(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """NIXL descriptors ``(addr, bytes, dev_id)`` of ``count`` blocks from ``first``: one
        per view when a view's rows are back to back, else one per view and block."""
        descs = []
        for addr, stride, row in zip(self.addrs, self.strides, self.row_bytes, strict=True):
            start = addr + first * stride
            if stride == row:
                descs.append((start, count * row, self.dev_id))
            else:
                descs.extend((start + i * stride, row, self.dev_id) for i in range(count))
        return descs


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (one block at a time)."""
    if not values:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


#: UCX transports (and UCX_TLS aliases of them) that cannot handle a peer's failure, so
#: UCX's default error handling mode ('peer') refuses them for its active messages.
_NO_PEER_FAILURE_TLS = frozenset({
    "self", "sm", "shm", "sysv", "posix", "cma", "knem", "xpmem", "cuda", "cuda_ipc",
    "cuda_copy", "gdr_copy", "rocm", "rocm_ipc", "rocm_copy"})


def _no_peer_failure_handling(ucx_tls: str) -> bool:
    """Whether a ``UCX_TLS`` list allows only transports in :data:`_NO_PEER_FAILURE_TLS` (an
    exclusion list, ``all`` or a name not known here is left to UCX)."""
    names = [n.strip().lower() for n in ucx_tls.split(",") if n.strip()]
    if not names or ucx_tls.strip().startswith("^"):
        return False
    return all(n in _NO_PEER_FAILURE_TLS for n in names)


#: UCX settings applied while the UCX backend of a cache in CUDA memory is created, each
#: unless the environment sets it. UCX's cuda_ipc transport offers GET (a consumer's READ)
#: only between GPUs it finds NVLink between; two processes on one GPU, or GPUs on PCIe, then
#: READ over TCP or host memory instead, hundreds of times slower (``docs/connector.md``).
#: Set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`` to keep UCX's own rule.
UCX_DEFAULTS: Mapping[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


class _Agent:
    """One NIXL agent with the cache's storage registered; every call into NIXL goes through
    it, under one lock (the Python API is not documented as thread-safe)."""

    def __init__(self, name: str, storage: torch.Tensor, backends: tuple[str, ...],
                 backend_params: Mapping[str, Mapping[str, str]] | None = None,
                 ucx_tls: str | None = None) -> None:
        api = _nixl_api()
        self.name = name
        self.lock = threading.Lock()
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
        available = self.agent.get_plugin_list()
        missing = [b for b in backends if b not in available]
        if missing:
            raise ValueError(f"backends={list(backends)!r}: NIXL has no plugin for "
                             f"{', '.join(missing)} (available: {', '.join(available)})")
        for backend in backends:
            params = dict((backend_params or {}).get(backend, {}))
            # UCX reads its settings from the environment when the backend is created.
            tls = ucx_tls if backend == "UCX" else None
            env = {"UCX_TLS": tls} if tls else {}
            if backend == "UCX" and storage.is_cuda and torch.version.hip is None:
                # CUDA settings only for CUDA memory (UCX warns of unused variables elsewhere).
                env.update((k, v) for k, v in UCX_DEFAULTS.items() if k not in os.environ)
            with _environment(env):
                try:
                    self.agent.create_backend(backend, params)
                except Exception as exc:
                    # Every variable set for it: a default of UCX_DEFAULTS may be the cause.
                    settings = ", ".join(f"{k}={v}" for k, v in env.items())
                    raise RuntimeError(f"NIXL could not create backend {backend} with "
                                       f"parameters {params}" +
                                       (f" and {settings}" if settings else "") +
                                       f": {exc}") from exc
        self.mem_type, dev_id = _memory_kind(storage)
        nbytes = storage.numel() * storage.element_size()
        try:
            self._reg_descs = self.agent.register_memory(
                [(storage.data_ptr(), nbytes, dev_id, "")], self.mem_type)
        except Exception as exc:
            raise RuntimeError(f"NIXL could not register the KV cache ({nbytes} bytes of "
                               f"{self.mem_type} on {storage.device}) with backends "
                               f"{list(backends)}: {exc}") from exc
        self._storage = storage  # the registered memory stays alive while the agent is

    def metadata(self) -> bytes:
        with self.lock:
            return self.agent.get_agent_metadata()

    def close(self) -> None:
        with self.lock:
            if self.agent is None:
                return
            try:
                self.agent.deregister_memory(self._reg_descs)
            except Exception as exc:  # closing must go on; the agent frees it anyway
                logger.warning("nixl agent %s: deregistering memory failed: %s", self.name, exc)
            self.agent = None
            self._storage = None


# -- producer -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Publication:
    """One published block: the producer's ``block`` holds ``key`` for ``save``."""

    key: str
    block: int
    save: _SaveRecord
    deadline: float  # when it is released unread
    lease: str | None = None


@dataclass(eq=False)
class _SaveRecord:
    """The per-block outcome of one :meth:`NixlConnector.save`."""

    block_ids: list[int]
    started: float
    pending: int
    done: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


@dataclass
class _Lease:
    lease_id: str
    consumer: str
    publications: list[_Publication | None]
    deadline: float
    link: int  # the connection that took it: closing it ends the lease


class _Producer:
    """The producer's state: published blocks, leases, the listener and its threads."""

    def __init__(self, conn: NixlConnector, listener: socket.socket) -> None:
        self.conn = conn
        self.listener = listener
        self.cond = threading.Condition()
        self.published: dict[str, deque[_Publication]] = {}
        self.leases: dict[str, _Lease] = {}
        self.consumers_seen = 0
        self.connections: set[socket.socket] = set()
        self.stopping = False
        self.threads: list[threading.Thread] = []
        self.lease_ids = itertools.count()
        self.link_ids = itertools.count()
        self.agent: _Agent | None = None
        self.hello: dict[str, Any] | None = None

    # -- lifetime -------------------------------------------------------------------------

    def start(self, agent: _Agent, hello: dict[str, Any]) -> None:
        self.agent, self.hello = agent, hello
        for target, name in ((self._accept_loop, "accept"), (self._notif_loop, "notifs")):
            thread = threading.Thread(target=target, daemon=True, name=f"kvcore-nixl-{name}")
            thread.start()
            self.threads.append(thread)

    def stop(self, join_s: float) -> None:
        with self.cond:
            self.stopping = True
            connections = list(self.connections)
            self.cond.notify_all()
        _close_socket(self.listener)
        for sock in connections:
            _close_socket(sock)
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

    def publish(self, keys: list[str], block_ids: list[int], timeout_s: float) -> _SaveRecord:
        now = time.monotonic()
        record = _SaveRecord(list(block_ids), time.perf_counter(), len(block_ids))
        with self.cond:
            for key, block in zip(keys, block_ids, strict=True):
                self.published.setdefault(key, deque()).append(
                    _Publication(key, block, record, now + timeout_s))
            self.cond.notify_all()
        return record

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
        if pubs is not None:
            try:
                pubs.remove(pub)
            except ValueError:
                pass
            if not pubs:
                del self.published[pub.key]

    def _available(self, key: str) -> _Publication | None:
        for pub in self.published.get(key, ()):
            if pub.lease is None:
                return pub
        return None

    def lookup(self, keys: list[str]) -> int:
        with self.cond:
            for i, key in enumerate(keys):
                if self._available(key) is None:
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
            for key in keys:
                pub = self._available(key)  # after the previous keys took theirs
                if pub is not None:
                    pub.lease = lease_id
                blocks.append(None if pub is None else pub.block)
                taken.append(pub)
            if any(p is not None for p in taken):
                self.leases[lease_id] = _Lease(lease_id, consumer, taken,
                                               time.monotonic() + lease_s, link)
                self.cond.notify_all()
        return lease_id, blocks

    def read_done(self, consumer: str, lease_id: str, first: int, end: int) -> None:
        """A consumer's notification: it READ entries ``first..end-1`` of the lease."""
        with self.cond:
            lease = self.leases.get(lease_id)
            if lease is None or lease.consumer != consumer:
                logger.warning("nixl producer: notification for unknown lease %r from %s",
                               lease_id, consumer)
                return
            for i in range(max(0, first), min(end, len(lease.publications))):
                pub = lease.publications[i]
                if pub is not None:
                    lease.publications[i] = None
                    self._unpublish(pub)
                    self._settle(pub, None)
            self._drop_if_empty(lease)
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
                        pub.lease = None
            self._drop_if_empty(lease)
            self.cond.notify_all()

    def _drop_if_empty(self, lease: _Lease) -> None:
        if all(p is None for p in lease.publications):
            self.leases.pop(lease.lease_id, None)

    def _end_lease(self, lease: _Lease) -> None:
        """Publish a lease's unread blocks again (caller holds ``cond``)."""
        del self.leases[lease.lease_id]
        for pub in lease.publications:
            if pub is not None:
                pub.lease = None
        self.cond.notify_all()

    def release_link(self, link: int) -> None:
        """The connection ``link`` closed: its leases end now (their blocks are published
        again) instead of pinning them for the rest of the lease."""
        with self.cond:
            for lease in [le for le in self.leases.values() if le.link == link]:
                self._end_lease(lease)

    def _expire(self, now: float) -> None:
        """Release what waited too long (caller holds ``cond``)."""
        for lease in [le for le in self.leases.values() if le.deadline <= now]:
            self._end_lease(lease)
            logger.warning("nixl producer: consumer %s did not confirm lease %s in time; its "
                           "blocks are published again", lease.consumer, lease.lease_id)
        expired = [pub for pubs in self.published.values() for pub in pubs
                   if pub.lease is None and pub.deadline <= now]
        for pub in expired:
            self._unpublish(pub)
            self._settle(pub, self._unread_reason())
        if expired:
            self.cond.notify_all()

    def _unread_reason(self) -> str:
        conn = self.conn
        who = (f"none of the {self.consumers_seen} consumer(s) that connected read it"
               if self.consumers_seen else
               f"no consumer connected to {conn.host}:{conn.port}")
        return f"not read within publish_timeout_s={conn.publish_timeout_s}: {who}"

    # -- threads ---------------------------------------------------------------------------

    def _notif_loop(self) -> None:
        """Collect READ notifications and expire what waited too long; polls NIXL often while
        leases are out, rarely otherwise."""
        agent = self.agent
        while True:
            with self.cond:
                if self.stopping:
                    return
                self._expire(time.monotonic())
                busy = bool(self.leases)
                if not busy:
                    self.cond.wait(0.05)
                    continue
            with agent.lock:
                if agent.agent is None:
                    return
                notifs = agent.agent.get_new_notifs()
            for consumer, messages in notifs.items():
                for raw in messages:
                    self._on_notif(consumer, raw)
            if not notifs:
                time.sleep(0.0005)

    def _on_notif(self, consumer: str, raw: bytes) -> None:
        try:
            lease_id, first, end = raw.decode().split(":")
            self.read_done(consumer, lease_id, int(first), int(end))
        except (UnicodeDecodeError, ValueError):
            logger.warning("nixl producer: unreadable notification %r from %s", raw[:100],
                           consumer)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return  # the listener was closed
            with self.cond:
                if self.stopping:
                    _close_socket(sock)
                    return
                self.connections.add(sock)
            thread = threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                                      name=f"kvcore-nixl-peer-{addr[0]}:{addr[1]}")
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
            hello = _recv_frame(sock)
            consumer = self._answer_hello(sock, hello, addr)
            if consumer is None:
                return
            sock.settimeout(None)  # idle consumers are fine; close() shuts the socket
            while True:
                request = _recv_frame(sock)
                _send_frame(sock, self._answer(consumer, request, link))
        except (_BadFrame, RecursionError) as exc:  # answered, then the connection ends
            logger.warning("nixl producer: refused %s (%s): %s", addr,
                           consumer or "before hello", exc)
            with contextlib.suppress(OSError):
                _send_frame(sock, {"ok": False, "error": f"refused: {exc}"})
        except (OSError, _ChannelError) as exc:
            with self.cond:
                stopping = self.stopping
            if not stopping and not (isinstance(exc, _ChannelError)
                                     and "closed the connection" in str(exc)):
                logger.warning("nixl producer: connection from %s (%s) ended: %s", addr,
                               consumer or "before hello", exc)
        finally:
            with self.cond:
                self.connections.discard(sock)
            _close_socket(sock)
            self.release_link(link)

    def _answer_hello(self, sock: socket.socket, hello: dict[str, Any], addr: Any
                      ) -> str | None:
        layout = self.conn._layout
        if hello.get("op") != "hello" or hello.get("protocol") != _PROTOCOL:
            _send_frame(sock, {"ok": False, "error": f"expected a {_PROTOCOL} hello, got "
                                                     f"{reprlib.repr(hello)}"})
            return None
        try:
            theirs = KVCacheLayout.from_dict(hello.get("layout"))
            layout.check_compatible(theirs, ignore_num_blocks=True,
                                    names=("producer", f"consumer {addr[0]}"))
        except (TypeError, ValueError) as exc:  # LayoutMismatchError is a ValueError
            logger.warning("nixl producer: refused consumer %s: %s", addr, exc)
            _send_frame(sock, {"ok": False, "error": str(exc), "protocol": _PROTOCOL,
                               "layout": layout.to_dict()})
            return None
        consumer = hello.get("agent")
        if not isinstance(consumer, str) or not consumer:
            _send_frame(sock, {"ok": False, "error": "hello without an agent name"})
            return None
        _send_frame(sock, {**self.hello, "ok": True})
        with self.cond:
            self.consumers_seen += 1
        return consumer

    def _answer(self, consumer: str, request: dict[str, Any], link: int) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "lookup":
                return {"ok": True, "hits": self.lookup(_keys(request))}
            if op == "fetch":
                lease_s = _seconds("lease_s", request.get("lease_s"))
                lease, blocks = self.fetch(consumer, _keys(request), lease_s, link)
                return {"ok": True, "lease": lease, "blocks": blocks}
            if op == "giveback":
                self.give_back(consumer, str(request.get("lease")),
                               list(request.get("indices") or []))
                return {"ok": True}
        except (TypeError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"unknown request {reprlib.repr(request)}"}


def _keys(request: dict[str, Any]) -> list[str]:
    return check_block_keys(request.get("keys"))


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# -- consumer -------------------------------------------------------------------------------


class _Consumer:
    """The consumer's link to one producer: the socket, the producer's regions and agent."""

    def __init__(self, conn: NixlConnector, agent: _Agent) -> None:
        self.conn = conn
        self.agent = agent
        self.lock = threading.Lock()  # one request/answer at a time on the socket
        self.sock: socket.socket | None = None
        self.failure: str | None = None  # why the link is down
        self.remote: str = ""
        self.regions: _Regions | None = None

    def connect(self, local: _Regions) -> None:
        conn = self.conn
        deadline = time.monotonic() + conn.connect_timeout_s
        where = f"{conn.host}:{conn.port}"
        last: Exception | None = None
        sock = None
        while sock is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionError(
                    f"nixl consumer: no producer answered at {where} within connect_timeout_s="
                    f"{conn.connect_timeout_s} (last error: {last}); start the producer "
                    "first, check the address and port, and that a firewall lets TCP to that "
                    "port through")
            try:
                sock = socket.create_connection((conn.host, conn.port), timeout=min(left, 2.0))
            except OSError as exc:
                last = exc
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            _send_frame(sock, {"op": "hello", "protocol": _PROTOCOL, "agent": self.agent.name,
                               "layout": conn._layout.to_dict()})
            reply = _recv_frame(sock)
        except (OSError, _ChannelError) as exc:
            _close_socket(sock)
            raise ConnectionError(
                f"nixl consumer: the producer at {where} did not complete the handshake within "
                f"connect_timeout_s={conn.connect_timeout_s}: {exc}") from exc
        try:
            self._check_reply(reply, where)
            with self.agent.lock:
                self.remote = self.agent.agent.add_remote_agent(
                    base64.b64decode(reply["metadata"]))
                if isinstance(self.remote, bytes):
                    self.remote = self.remote.decode()
                # Connect now: the first READ would otherwise pay for the UCX wire-up.
                self.agent.agent.make_connection(self.remote)
        except BaseException:
            _close_socket(sock)
            raise
        if self.regions.mem_type != local.mem_type:
            logger.info("nixl consumer: reading %s blocks into %s", self.regions.mem_type,
                        local.mem_type)
        sock.settimeout(conn.timeout_s)
        self.sock = sock

    def _check_reply(self, reply: dict[str, Any], where: str) -> None:
        layout = self.conn._layout
        names = ("consumer", f"producer {where}")
        if "layout" in reply:
            try:
                theirs = KVCacheLayout.from_dict(reply["layout"])
            except (TypeError, ValueError) as exc:
                raise LayoutMismatchError(f"{names[1]} sent a layout this kvcore cannot read "
                                          f"({exc}); {names[0]} has {layout.describe()}"
                                          ) from exc
            layout.check_compatible(theirs, ignore_num_blocks=True, names=names)
        if not reply.get("ok"):
            raise ConnectionError(f"nixl consumer: the producer at {where} refused the "
                                  f"connection: {reply.get('error')}")
        if reply.get("protocol") != _PROTOCOL or "metadata" not in reply:
            raise ConnectionError(f"nixl consumer: {where} answered {str(reply)[:200]!r}, "
                                  f"not a {_PROTOCOL} producer")
        max_lease_s = reply.get("max_lease_s")
        if isinstance(max_lease_s, (int, float)) and 2 * self.conn.timeout_s > max_lease_s:
            raise ValueError(f"nixl consumer: timeout_s={self.conn.timeout_s} needs leases of "
                             f"{2 * self.conn.timeout_s:g} s, and the producer at {where} "
                             f"grants at most max_lease_s={max_lease_s}: lower timeout_s to "
                             f"{max_lease_s / 2:g} or raise the producer's max_lease_s")
        self.regions = _Regions.from_dict(reply.get("regions"))
        self.num_blocks = int(reply.get("num_blocks", 0))

    def request(self, message: dict[str, Any], timeout: float | None = None
                ) -> dict[str, Any]:
        """One request and its answer within ``timeout`` (default ``timeout_s``); a failure
        downs the link (a late answer would desynchronise the stream)."""
        with self.lock:
            if self.failure is not None:
                raise _ChannelError(self.failure)
            try:
                self.sock.settimeout(timeout or self.conn.timeout_s)
                _send_frame(self.sock, message)
                reply = _recv_frame(self.sock)
            except (OSError, _ChannelError) as exc:
                kind = "no answer" if isinstance(exc, TimeoutError) else "lost"
                self.failure = (f"link to the producer at {self.conn.host}:{self.conn.port} "
                                f"{kind} (timeout_s={self.conn.timeout_s}): {exc}")
                _close_socket(self.sock)
                raise _ChannelError(self.failure) from exc
        if not reply.get("ok"):
            raise _ChannelError(f"the producer refused {message.get('op')}: "
                                f"{reply.get('error')}")
        return reply

    def disconnect(self) -> None:
        """Down the link: requests in flight fail now, later ones at once."""
        if self.failure is None:
            self.failure = "the connector is closed"
        if self.sock is not None:
            _close_socket(self.sock)  # (without the lock: it wakes a request holding it)

    def forget_producer(self) -> None:
        """Drop the producer's agent (after the last READ)."""
        if self.remote:
            with self.agent.lock:
                if self.agent.agent is not None:
                    try:
                        self.agent.agent.remove_remote_agent(self.remote)
                    except Exception as exc:
                        logger.info("nixl consumer: removing the producer's agent: %s", exc)


@dataclass
class _Run:
    """Blocks ``first..end-1`` of a fetch, consecutive on both sides, read by one transfer."""

    first: int
    end: int
    src: int  # producer block of ``first``
    dst: int  # consumer block of ``first``
    handle: Any = None


def _runs(pairs: list[tuple[int, int, int]]) -> list[_Run]:
    """Group ``(fetch index, producer block, consumer block)`` into runs consecutive in all
    three."""
    runs: list[_Run] = []
    for i, src, dst in pairs:
        last = runs[-1] if runs else None
        if last is not None and i == last.end and src == last.src + (i - last.first) \
                and dst == last.dst + (i - last.first):
            last.end += 1
        else:
            runs.append(_Run(i, i + 1, src, dst))
    return runs


# -- the connector --------------------------------------------------------------------------


class NixlConnector(KVConnector):
    """Publish KV blocks to other engines, or READ them from one (connector name ``nixl``).

    Args:
        role: ``"producer"`` (publishes blocks with :meth:`save`, listens on ``host:port``)
            or ``"consumer"`` (connects to a producer at ``host:port``, :meth:`lookup` and
            :meth:`load`). A producer's ``load`` and a consumer's ``save`` fail every block
            with the reason; a producer's ``lookup`` is 0.
        host: producer: the address to listen on (``"0.0.0.0"`` for every interface);
            consumer: the producer's address.
        port: producer: the port to listen on, ``0`` for a free one (read :attr:`port`);
            consumer: the producer's port.
        connect_timeout_s: consumer: how long connecting and the handshake may take
            (registration raises ``ConnectionError`` after it); producer: how long a
            connecting consumer may take to say hello.
        timeout_s: consumer: the bound on one request to the producer and on one load
            (blocks not read whole by then fail). Keep it well below the producer's
            ``publish_timeout_s``.
        publish_timeout_s: producer: how long a saved block waits for a consumer; then it is
            released and the save reports it failed.
        max_lease_s: producer: the longest lease a consumer may take (a consumer asks for
            twice its ``timeout_s``; a longer one is refused, naming this option). It bounds
            how long a consumer that froze keeps blocks from other consumers; one whose
            connection closes loses its leases at once.
        backends: NIXL transfer backends to create (``UCX`` by default).
        backend_params: per backend, its NIXL init parameters (strings), e.g.
            ``{"UCX": {"ucx_error_handling_mode": "none"}}``; NIXL lists a plugin's with
            ``nixl_agent.get_plugin_params(name)`` (UCX: ``ucx_devices``, ``num_workers``,
            ``ucx_error_handling_mode``). Unknown backends are refused.
        ucx_tls: the UCX transports to allow (UCX's ``UCX_TLS`` syntax, e.g.
            ``"cuda_ipc,cuda_copy,tcp"`` for VRAM between processes on one host), set only
            while the UCX backend is created; ``None`` (the default): UCX's own choice, or
            ``UCX_TLS`` from the environment. A list of shared-memory and CUDA transports only
            (``"cuda_ipc,cuda_copy,sm,self"``) needs ``ucx_error_handling_mode`` ``"none"``
            (UCX's default ``peer`` mode finds no transport for its messages among them);
            it is refused otherwise. Which transports UCX picked: run with
            ``UCX_PROTO_INFO=y`` (``benchmarks/bench_nixl.py --matrix`` does); see
            ``docs/connector.md`` for what was measured.
        failure_policy: ``"recompute"`` or ``"fail"`` (see :data:`FAILURE_POLICIES`).
    """

    # Both sides must agree on the layout; cross-layer moves a whole block in one region.
    prefer_cross_layer_blocks = True

    def __init__(
        self,
        *,
        role: str,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 30.0,
        timeout_s: float = 10.0,
        publish_timeout_s: float = 60.0,
        max_lease_s: float = 120.0,
        backends: Sequence[str] = ("UCX",),
        backend_params: Mapping[str, Mapping[str, str]] | None = None,
        ucx_tls: str | None = None,
        failure_policy: str = "recompute",
    ) -> None:
        if role not in _ROLES:
            raise ValueError(f"role={role!r} must be 'producer' (publishes blocks) or "
                             "'consumer' (reads them)")
        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be an int in 0..65535")
        if role == "consumer" and port == 0:
            raise ValueError("port=0 for a consumer: pass the port the producer listens on")
        self.connect_timeout_s = _seconds("connect_timeout_s", connect_timeout_s)
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.publish_timeout_s = _seconds("publish_timeout_s", publish_timeout_s)
        self.max_lease_s = _seconds("max_lease_s", max_lease_s)
        if isinstance(backends, str) or not isinstance(backends, Sequence) or not backends \
                or not all(isinstance(b, str) and b for b in backends):
            raise TypeError(f"backends must be a non-empty list of NIXL backend names such as "
                            f"['UCX'], got {backends!r}")
        if backend_params is not None:
            if not isinstance(backend_params, Mapping) or not all(
                    isinstance(params, Mapping)
                    and all(isinstance(k, str) and isinstance(v, str)
                            for k, v in params.items())
                    for params in backend_params.values()):
                raise TypeError("backend_params must map a backend name to a dict of str "
                                f"parameters, e.g. {{'UCX': {{'num_workers': '2'}}}}, got "
                                f"{backend_params!r}")
            unknown = [b for b in backend_params if b not in backends]
            if unknown:
                raise ValueError(f"backend_params names {unknown}, which are not in "
                                 f"backends={list(backends)!r}: add them there or drop them")
        if ucx_tls is not None and (not isinstance(ucx_tls, str) or not ucx_tls.strip()
                                    or "UCX" not in backends):
            raise ValueError(f"ucx_tls={ucx_tls!r} must be a non-empty UCX_TLS string such as "
                             "'cuda_ipc,cuda_copy,tcp', with 'UCX' in backends "
                             f"(backends={list(backends)!r})")
        if ucx_tls is not None:
            given = (backend_params or {}).get("UCX", {}).get("ucx_error_handling_mode")
            mode = "peer" if given is None else given
            if mode != "none" and _no_peer_failure_handling(ucx_tls):
                raise ValueError(
                    f"ucx_tls={ucx_tls!r} lists only transports without peer failure handling "
                    "(shared memory, self, CUDA), and with ucx_error_handling_mode "
                    f"{mode!r}{' (the default)' if given is None else ''} UCX finds no "
                    "transport for its messages "
                    "and NIXL cannot create the backend: add tcp or an RDMA transport (e.g. "
                    "'cuda_ipc,cuda_copy,tcp'), or pass backend_params={'UCX': "
                    "{'ucx_error_handling_mode': 'none'}} (UCX then no longer reports a dead "
                    "peer; the connector's timeouts still bound every wait)")
        reason = nixl_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the nixl connector is unavailable: {reason}")
        super().__init__(failure_policy=failure_policy)
        self.role = role
        self.host = host
        self.port = port
        self.backends = tuple(backends)
        self.backend_params = {b: dict(p) for b, p in (backend_params or {}).items()}
        self.ucx_tls = ucx_tls
        self.agent_name = f"kvcore-{role}-{uuid.uuid4().hex[:12]}"
        self._agent: _Agent | None = None
        self._producer: _Producer | None = None
        self._consumer: _Consumer | None = None
        self._loader: ThreadPoolExecutor | None = None
        if role == "producer":
            listener = socket.create_server((host, port), backlog=64)
            self.port = listener.getsockname()[1]
            self._producer = _Producer(self, listener)
        # Close what NIXL holds even if the owner forgets to (and before interpreter exit,
        # while NIXL's library is still whole).
        self._finalizer = weakref.finalize(self, NixlConnector._release, self._producer,
                                           [None, None, None], self.timeout_s)

    # -- registration -----------------------------------------------------------------------

    def _register(self, reg: RegisteredCaches) -> None:
        self._layout = reg.kv_caches.layout
        regions = _Regions.of(reg)
        agent = _Agent(self.agent_name, reg.kv_caches.storage, self.backends,
                       self.backend_params, self.ucx_tls)
        try:
            if self.role == "producer":
                hello = {"protocol": _PROTOCOL, "layout": self._layout.to_dict(),
                         "agent": agent.name, "regions": regions.to_dict(),
                         "metadata": base64.b64encode(agent.metadata()).decode(),
                         "num_blocks": reg.kv_caches.num_blocks,
                         "max_lease_s": self.max_lease_s}
                self._producer.start(agent, hello)
            else:
                consumer = _Consumer(self, agent)
                consumer.connect(regions)
                self._consumer = consumer
                self._loader = ThreadPoolExecutor(2, thread_name_prefix="kvcore-nixl-load")
        except BaseException:
            agent.close()
            raise
        self._agent = agent
        self._regions = regions
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, NixlConnector._release, self._producer,
            [self._consumer, self._loader, agent], self.timeout_s)

    @staticmethod
    def _release(producer: _Producer | None, parts: list[Any], join_s: float) -> None:
        consumer, loader, agent = parts
        if producer is not None:
            producer.stop(join_s)
        if consumer is not None:
            consumer.disconnect()  # queued loads fail at once
        if loader is not None:
            loader.shutdown(wait=True)  # a READ in flight ends within timeout_s
        if consumer is not None:
            consumer.forget_producer()
        if agent is not None:
            agent.close()

    def _close(self) -> None:
        self._finalizer()

    # -- scheduler side ---------------------------------------------------------------------

    def _lookup(self, keys: list[str]) -> int:
        if self.role == "producer" or not keys:
            return 0
        try:
            hits = self._consumer.request({"op": "lookup", "keys": keys}).get("hits")
        except _ChannelError as exc:
            logger.warning("nixl consumer: lookup failed: %s", exc)
            return 0
        return hits if isinstance(hits, int) and 0 <= hits <= len(keys) else 0

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
        future = self._loader.submit(self._read_blocks_from_producer, keys, block_ids)
        return TransferHandle.from_future("load", self.failure_policy, future)

    def _read_blocks_from_producer(self, keys: list[str], block_ids: list[int]
                                   ) -> TransferResult:
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        todo = OrderedDict((i, None) for i in range(len(keys)))  # indices not read yet
        loaded: list[int] = []
        failed: dict[int, str] = {}
        pause = 0.002
        while todo:
            wanted = list(todo)
            try:
                reply = self._consumer.request(
                    {"op": "fetch", "keys": [keys[i] for i in wanted],
                     "lease_s": 2 * self.timeout_s},
                    timeout=max(deadline - time.monotonic(), 0.001))
            except _ChannelError as exc:
                failed.update((block_ids[i], str(exc)) for i in todo)
                break
            lease, blocks = reply.get("lease"), reply.get("blocks")
            if not isinstance(blocks, list) or len(blocks) != len(wanted):
                failed.update((block_ids[i], f"the producer answered {str(reply)[:200]!r}")
                              for i in todo)
                break
            pairs = []
            for j, (i, src) in enumerate(zip(wanted, blocks, strict=True)):
                if src is None:
                    continue
                if not (isinstance(src, int) and 0 <= src < self._consumer.num_blocks):
                    failed[block_ids[i]] = f"the producer named block {src!r}"
                    del todo[i]
                    continue
                pairs.append((j, src, block_ids[i]))
            if pairs:
                read, errors = self._read_runs(lease, _runs(pairs), deadline)
                for j in read:
                    del todo[wanted[j]]
                    loaded.append(block_ids[wanted[j]])
                for j, why in errors.items():
                    del todo[wanted[j]]
                    failed[block_ids[wanted[j]]] = why
            if not todo:
                break
            # Poll again only with time left for an answer and a READ.
            if time.monotonic() + max(pause, min(0.25, self.timeout_s / 4)) >= deadline:
                why = (f"not published by the producer at {self.host}:{self.port} within "
                       f"timeout_s={self.timeout_s}")
                failed.update((block_ids[i], why) for i in todo)
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        order = {b: n for n, b in enumerate(block_ids)}
        loaded.sort(key=order.__getitem__)
        return self._record(self._result("load", loaded, failed,
                                         len(loaded) * self.block_bytes,
                                         time.perf_counter() - started))

    def _read_runs(self, lease: str, runs: list[_Run], deadline: float
                   ) -> tuple[list[int], dict[int, str]]:
        """READ every run (one NIXL transfer each) until done, failed or ``deadline``.
        Returns the fetch indices read whole and those that failed with why."""
        agent, consumer = self._agent, self._consumer
        remote, local = consumer.regions, self._regions
        read: list[int] = []
        errors: dict[int, str] = {}
        timed_out: set[int] = set()
        active: list[_Run] = []
        with agent.lock:
            nixl = agent.agent
            for run in runs:
                n = run.end - run.first
                try:
                    local_descs = nixl.get_xfer_descs(local.run_descs(run.dst, n),
                                                      local.mem_type)
                    remote_descs = nixl.get_xfer_descs(remote.run_descs(run.src, n),
                                                       remote.mem_type)
                    run.handle = nixl.initialize_xfer(
                        "READ", local_descs, remote_descs, consumer.remote,
                        f"{lease}:{run.first}:{run.end}".encode())
                    state = nixl.transfer(run.handle)
                    if state == "ERR":
                        raise RuntimeError("NIXL transfer() returned ERR")
                    active.append(run)
                except Exception as exc:
                    errors.update((j, f"NIXL READ could not start: {exc}")
                                  for j in range(run.first, run.end))
                    self._release_handle(run)
        pause = 0.0001
        while active:
            still = []
            with agent.lock:
                for run in active:
                    try:
                        state = agent.agent.check_xfer_state(run.handle)
                    except Exception as exc:
                        state = f"ERR ({exc})"
                    if state == "DONE" and consumer.failure is not None:
                        # The producer ends the leases of a closed connection: the blocks
                        # may have been handed on and rewritten during the READ.
                        errors.update((j, f"the READ finished after the link went down "
                                          f"({consumer.failure})")
                                      for j in range(run.first, run.end))
                        self._release_handle(run)
                    elif state == "DONE":
                        read.extend(range(run.first, run.end))
                        self._release_handle(run)
                    elif state == "PROC":
                        still.append(run)
                    else:
                        errors.update((j, f"NIXL READ from the producer failed: {state}")
                                      for j in range(run.first, run.end))
                        self._release_handle(run)
            active = still
            if active and time.monotonic() >= deadline:
                for run in active:
                    why = f"NIXL READ did not finish within timeout_s={self.timeout_s}"
                    with agent.lock:
                        if not self._release_handle(run):
                            why += ("; the READ could not be cancelled, so these blocks may "
                                    "still change: do not reuse them before close()")
                    errors.update((j, why) for j in range(run.first, run.end))
                    # Not given back: the producer keeps them until the lease ends, beyond
                    # any READ that could not be cancelled.
                    timed_out.update(range(run.first, run.end))
                break
            if active:
                time.sleep(pause)
                pause = min(2 * pause, 0.005)
        finished = sorted(set(errors) - timed_out)  # failed and over: readable again
        if finished:
            try:
                consumer.request({"op": "giveback", "lease": lease, "indices": finished})
            except _ChannelError:
                pass  # the lease expires on the producer
        if read and self._regions.mem_type == "VRAM":
            torch.cuda.synchronize(self._reg.kv_caches.storage.device)
        return read, errors

    def _release_handle(self, run: _Run) -> bool:
        """Free a transfer handle (caller holds the agent lock); NIXL cancels an active one.
        Returns whether that worked (NIXL keeps a handle it could not cancel)."""
        if run.handle is None:
            return True
        handle, run.handle = run.handle, None
        try:
            self._agent.agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.warning("nixl consumer: releasing a transfer handle failed: %s", exc)
            return False
        return True

    # -- helpers ----------------------------------------------------------------------------

    def _all_failed(self, op: str, block_ids: list[int], why: str) -> TransferHandle:
        return self._finished(op, [], dict.fromkeys(block_ids, why), 0, time.perf_counter())

    def __repr__(self) -> str:
        return f"NixlConnector(role={self.role!r}, {self.host}:{self.port}, " \
               f"{super().__repr__()})"
