"""``p2p``: move KV blocks between two processes over ``torch.distributed``.

Two peers pair up (disaggregated prefill and decode, or any two engines): rank 0 hosts a
``TCPStore`` rendezvous at ``host:port``, rank 1 connects to it. Each direction gets process
groups of its own (a send and a receive never queue behind each other in one communicator,
the deadlock of two NCCL peers sending at once): message headers go over gloo, block bytes
over the data path both hellos agree on (:attr:`P2PConnector.transport`, from each side's
``data_backend``, :func:`~kvcore.connectors.p2p_ipc.agree_data_backend`):

``"nccl"`` (CUDA caches on two GPUs), ``"gloo"`` (CPU caches, or CUDA caches staged through
host memory), or ``"ipc"`` (one host, :mod:`kvcore.connectors.p2p_ipc`: messages wait in
staging slots of the sender's that the receiver maps, CUDA IPC or ``/dev/shm``, and gives
back on a gloo channel of its own; ``"auto"``'s choice for CUDA caches on one GPU, where NCCL
refuses two ranks).

Every message is an int64 pair (header bytes, payload bytes), a JSON header, then the
payload. Both sizes are checked against limits *before* anything is allocated.

- ``hello``, at :meth:`~P2PConnector.register_kv_caches`: the layout
  (:meth:`kvcore.KVCacheLayout.to_dict`), dtype, block size, tensor-parallel ``(degree,
  rank)`` and the data path's facts (``data_backend``, host, GPU). Each side plans the
  conversion of the other's blocks into its own cache (:func:`~kvcore.connectors.
  plan_conversion`: block size, order, cross-layer, head slices) and refuses what cannot
  convert (MLA against K/V, another dtype, block sizes of which neither divides the other,
  head counts no TP split explains) with a :class:`kvcore.LayoutMismatchError` naming both
  sides and the field, before a single block moves. Blocks travel in the sender's layout;
  the receiver converts them at :meth:`load` with one gather. The agreement holds for the
  session: a later hello that differs breaks the link and drops the blocks received from
  that peer.
- ``slots`` (``"ipc"`` only, after the hellos): the handle of the sender's staging slots;
  registration ends once each side mapped the other's.
- ``blocks``: keys, then the bytes of those blocks ``(n, block_bytes)`` (``"ipc"``: the slot
  that holds them).
- ``bye``: the sender is closing; the receiver answers with its own ``bye``.

:meth:`save` sends blocks to the peer. A background thread receives the peer's blocks into an
inbox bounded by ``inbox_bytes`` (oldest dropped first when full); :meth:`load` takes blocks
from it, waiting up to ``timeout_s`` for keys not yet there; :meth:`lookup` counts leading
keys in it. Blocks wait in the message they came in, without a copy, until some of that
message's blocks are loaded and the inbox is over its bound: then the waiting ones are copied
out, so the bound counts the memory really held (plus one message being received). A message
that does not arrive whole within ``timeout_s``, a dead peer or a malformed message breaks the
link: waiting and later transfers fail at once with the reason, never hang. (gloo closes a
connection whose receive timed out, so there is no resuming.)

Every wait is bounded: connecting by ``connect_timeout_s``, messages (and, ``"ipc"``, a free
staging slot) by ``timeout_s``, and :meth:`close` by a few ``timeout_s`` even against a frozen
peer; close leaves no thread and no pending receive behind, and frees the staging slots.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvcore import KVCacheLayout, LayoutMismatchError
from kvcore.connectors.base import (
    KVConnector,
    RegisteredCaches,
    TransferHandle,
    TransferResult,
    layout_block_size,
)
from kvcore.connectors.blocks import _host_buffer
from kvcore.connectors.convert import (
    ConversionPlan,
    LayoutConversionError,
    TPRank,
    as_tp_rank,
    block_rows_layout,
    plan_conversion,
)
from kvcore.connectors.keys import check_block_keys
from kvcore.connectors.p2p_ipc import IpcChannel, agree_data_backend, transport_facts
from kvcore.connectors.p2p_transport import (
    IDLE,
    UNBLOCK_S,
    connect_groups,
    connect_store,
    seconds_option,
    stop_receiving_thread,
    wait_bounded,
)

__all__ = ["P2PConnector"]

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 8 << 20
_MAX_KEYS_PER_MESSAGE = 32768  # keeps a header far below _MAX_HEADER_BYTES
_MAX_PAYLOAD_BYTES = 256 << 20  # per message (or one block if larger): bounds staging memory
_OPS = ("hello", "slots", "blocks", "bye")
_DATA_BACKENDS = ("auto", "gloo", "nccl", "ipc")


class _LinkDown(Exception):
    """The link cannot carry blocks any more; the message says why."""


class _Message:
    """The blocks of one received message, ``(n, block_bytes)`` uint8; ``live`` counts its
    rows still in the inbox."""

    __slots__ = ("data", "live", "nbytes")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.live = 0
        self.nbytes = data.numel()


def _rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``rows`` (blocks' bytes, 1-D) as one ``(n, row_bytes)`` tensor: a view of their message
    when they are its consecutive rows (a message loaded whole, in order), else a copy."""
    base, start, step = rows[0]._base, rows[0].data_ptr(), rows[0].numel()
    if base is not None and all(r._base is base and r.data_ptr() == start + i * step
                                for i, r in enumerate(rows)):
        return rows[0].as_strided((len(rows), step), (step, 1))
    return torch.stack(rows)


def _block_bytes_of(hello: dict[str, Any], default: int) -> int:
    """Bytes of one of the peer's blocks (every layer), from its hello's layout."""
    try:
        layout = KVCacheLayout.from_dict(hello.get("layout"))
    except (TypeError, ValueError):
        return default  # the handshake refuses this hello
    return layout.num_layers * layout.page_size_bytes


class P2PConnector(KVConnector):
    """Send KV blocks to a peer process and load the blocks it sends (connector ``p2p``).

    Args:
        rank: 0 (hosts the rendezvous) or 1 (connects to it).
        host: rank 0's address.
        port: rank 0's port; ``0`` on rank 0 picks a free one (read it from :attr:`port`).
        connect_timeout_s: how long connecting to rank 0's rendezvous (rank 1, at
            construction) and then pairing with the peer and exchanging layouts (at
            :meth:`register_kv_caches`) may each take; a peer that does not come in time is a
            ``ConnectionError`` naming this option.
        timeout_s: how long one message may take to arrive once started, and how long a
            load waits for blocks that have not arrived. Both timeouts are finite seconds,
            at most 365 days.
        inbox_bytes: bound on the memory that received blocks not loaded yet hold (see
            :attr:`inbox_held_bytes`), and on one message.
        data_backend: how block bytes travel (both peers agree at registration:
            :attr:`transport`). ``"auto"``: NCCL for CUDA caches (``"ipc"`` on one GPU of one
            host), gloo for CPU caches; a peer's explicit choice wins. ``"gloo"`` (CUDA caches
            staged through host memory), ``"nccl"`` (CUDA caches on two GPUs) or ``"ipc"``
            (one host: 2 staging slots of one message each, up to 256 MiB, that the sender
            owns and the peer maps: CUDA IPC on the cache's GPU, which the peer must see, or
            ``/dev/shm`` for CPU caches; peers on another host are refused).
        failure_policy: ``"recompute"`` or ``"fail"`` (see :data:`FAILURE_POLICIES`).
        tp: this engine's tensor-parallel ``(degree, rank)`` (or a
            :class:`~kvcore.connectors.TPRank`; default TP 1), sent in the hello.
        num_kv_heads: the model's KV heads over all ranks, when the layouts cannot tell.

    Layouts may differ: each side plans the conversion of the peer's blocks into its own
    cache from the hellos (:func:`~kvcore.connectors.plan_conversion`; :attr:`plan`) and
    refuses at registration, naming both layouts and the field, what it cannot convert.
    Blocks travel in the sender's layout and the receiver rearranges them at :meth:`load`
    with one gather. With block sizes that differ, keys name the sender's blocks and a load's
    ``block_ids`` are this cache's blocks those tokens fill (``docs/connector.md``).
    """

    # Both peers must agree on the layout, and per-layer is the one every blocks-first
    # backend supports; cross-layer would only pair with cross-layer peers.
    prefer_cross_layer_blocks = False

    def __init__(
        self,
        *,
        rank: int,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 60.0,
        timeout_s: float = 30.0,
        inbox_bytes: int = 1 << 30,
        data_backend: str = "auto",
        failure_policy: str = "recompute",
        tp: TPRank | tuple[int, int] | None = None,
        num_kv_heads: int | None = None,
    ) -> None:
        if rank not in (0, 1) or isinstance(rank, bool):
            raise ValueError(f"rank={rank!r} must be 0 (hosts the rendezvous) or 1")
        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be an int in 0..65535")
        if rank == 1 and port == 0:
            raise ValueError("port=0 on rank 1: pass the port rank 0 listens on")
        connect_timeout_s = seconds_option("connect_timeout_s", connect_timeout_s)
        timeout_s = seconds_option("timeout_s", timeout_s)
        if isinstance(inbox_bytes, bool) or not isinstance(inbox_bytes, int) or inbox_bytes <= 0:
            raise ValueError(f"inbox_bytes={inbox_bytes!r} must be a positive int")
        if data_backend not in _DATA_BACKENDS:
            raise ValueError(f"data_backend={data_backend!r} must be one of "
                             f"{', '.join(map(repr, _DATA_BACKENDS))}")
        tp = as_tp_rank(tp)
        if num_kv_heads is not None and (isinstance(num_kv_heads, bool) or not isinstance(
                num_kv_heads, int) or num_kv_heads < 1):
            raise ValueError(f"num_kv_heads={num_kv_heads!r} must be None (from the layouts) "
                             "or the model's KV head count, a positive int")
        super().__init__(failure_policy=failure_policy)
        self.tp, self.num_kv_heads = tp, num_kv_heads
        #: The conversion of the peer's blocks into this cache (``None``: same layout).
        self.plan: ConversionPlan | None = None
        self.rank, self.peer = rank, 1 - rank
        self.host = host
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.inbox_bytes = inbox_bytes
        self._data_backend = data_backend
        if rank == 1:
            self._store = connect_store(host, port, connect_timeout_s)
        else:
            try:
                self._store = dist.TCPStore(host, port, 2, True,
                                            timeout=timedelta(seconds=connect_timeout_s),
                                            wait_for_workers=False)
            except Exception as exc:
                raise ConnectionError(f"p2p rank 0: cannot host the rendezvous at "
                                      f"{host}:{port}: {exc}") from exc
        self.port: int = self._store.port
        self._cond = threading.Condition()  # guards the state below and the inbox
        self._send_lock = threading.RLock()  # one message at a time, header with payload
        self._failure: str | None = None  # why transfers fail from now on
        self._link_ok = True
        self._bye_sent = False
        self._peer_hello: dict[str, Any] | None = None
        # key -> (message, row): rows wait in the messages they came in (no copy); what the
        # inbox holds is counted by whole message, see _compact.
        self._inbox: OrderedDict[str, tuple[_Message, int]] = OrderedDict()
        self._inbox_held = 0
        self._receiver: threading.Thread | None = None
        #: The data path agreed with the peer at registration: ``"gloo"``, ``"nccl"`` or
        #: ``"ipc"`` (``None`` before).
        self.transport: str | None = None
        self._transport_error: str | None = None
        self._ipc: IpcChannel | None = None  # the staging slots, once transport is "ipc"

    # -- connection -------------------------------------------------------------------------

    def _register(self, reg: RegisteredCaches) -> None:
        kv = reg.kv_caches
        self._layout = kv.layout
        self._block_bytes = kv.num_layers * kv.page_size_bytes
        self._peer_block_bytes = self._block_bytes  # until the peer's hello says otherwise
        if self.inbox_bytes < self._block_bytes:
            raise ValueError(f"inbox_bytes={self.inbox_bytes} holds no block: a block of this "
                             f"cache is {self._block_bytes} bytes")
        device = kv.storage.device
        requested = self._data_backend
        if requested == "nccl" and device.type != "cuda":
            raise ValueError(f"data_backend='nccl' needs a CUDA cache, this one is on {device}")
        self._cache_device, self._num_blocks = device, kv.num_blocks
        self._facts = transport_facts(requested, device)
        self._wire_device = torch.device("cpu")  # NCCL's (the cache's) once the hellos agree
        deadline = time.monotonic() + self.connect_timeout_s
        # NCCL groups only connect on first use: made now, used if the hellos pick NCCL.
        nccl = requested == "nccl" or (requested == "auto" and device.type == "cuda")
        try:
            groups = connect_groups(self._store, self.rank, device if nccl else None, deadline)
        except Exception as exc:
            raise ConnectionError(
                f"p2p rank {self.rank}: peer rank {self.peer} did not join through "
                f"{self.host}:{self.port} within connect_timeout_s={self.connect_timeout_s} "
                f"(waited for it to register its KV caches): {exc}") from exc
        # Blocks go over the control groups (gloo) until the hellos agree on another path.
        self._tx_ctrl = self._tx_data = groups[f"ctrl{self.rank}"]
        self._rx_ctrl = self._rx_data = groups[f"ctrl{self.peer}"]
        self._acks = groups[f"ack{self.peer}"], groups[f"ack{self.rank}"]  # (tx, rx)
        self._nccl = (groups[f"nccl{self.rank}"], groups[f"nccl{self.peer}"]) if nccl else None
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="kvcore-p2p-send")
        self._loader = ThreadPoolExecutor(4, thread_name_prefix="kvcore-p2p-load")
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name=f"kvcore-p2p-recv-{self.rank}")
        self._receiver.start()
        self._handshake(deadline)

    def _hello(self) -> dict[str, Any]:
        layout = self._layout
        return {
            "op": "hello",
            "layout": layout.to_dict(),
            "dtype": str(layout.dtype).removeprefix("torch."),
            "block_size": layout_block_size(layout),
            "inbox_bytes": self.inbox_bytes,
            "tp": [self.tp.degree, self.tp.rank],
            "num_kv_heads": self.num_kv_heads,
            "transport": self._facts,
        }

    def _handshake(self, deadline: float) -> None:
        """Exchange hellos; refuse a peer whose cache differs from ours."""
        try:
            self._send_message(self._hello(), None,
                               timeout=max(deadline - time.monotonic(), UNBLOCK_S))
            with self._cond:
                self._cond.wait_for(lambda: self._peer_hello is not None or not self._link_ok,
                                    timeout=max(deadline - time.monotonic(), 0.0))
                hello, failure = self._peer_hello, self._failure
            if hello is None:
                raise ConnectionError(f"p2p rank {self.rank}: peer rank {self.peer} sent no "
                                      f"layout within connect_timeout_s="
                                      f"{self.connect_timeout_s}" +
                                      (f" ({failure})" if failure else ""))
            self._blocks_per_message = self._check_peer(hello)
            if self._transport_error is not None:  # (both set with _peer_hello, see _agree)
                raise ValueError(f"p2p rank {self.rank}: {self._transport_error}")
            with self._send_lock:
                if self.transport == "nccl":
                    self._tx_data = self._nccl[0]
                self._nccl = None  # (unused NCCL groups never connected)
            if self.transport == "ipc":
                self._share_slots(deadline)
        except BaseException:
            self._shutdown_link()
            raise

    def _agree(self, hello: dict[str, Any]) -> None:
        """Pick the data path from the hellos (on the receiving thread, under ``_cond``, before
        the peer's next message); :meth:`_handshake` refuses the peer if there is none."""
        try:
            transport = agree_data_backend(self._facts, hello.get("transport"),
                                           f"local rank {self.rank}", f"remote rank {self.peer}")
        except ValueError as exc:
            self._transport_error = str(exc)
            return
        self.transport = transport
        if transport == "nccl":
            self._rx_data, self._wire_device = self._nccl[1], self._cache_device
        elif transport == "ipc":
            self._ipc = IpcChannel(
                rank=self.rank, peer=self.peer, device=self._cache_device,
                timeout_s=self.timeout_s, ack_tx=self._acks[0], ack_rx=self._acks[1],
                cond=self._cond, failure=lambda: self._failure, fail=self._fail_link)
        self._acks = None  # (the channel's now, or unused)

    def _share_slots(self, deadline: float) -> None:
        """ipc: make this side's staging slots, send their handle, and wait until each side
        mapped the other's."""
        handle = self._ipc.share(self._blocks_per_message * self._block_bytes)
        self._send_message({"op": "slots", "slots": handle}, None,
                           timeout=max(deadline - time.monotonic(), UNBLOCK_S))
        with self._cond:
            self._cond.wait_for(lambda: self._failure is not None or self._ipc.ready,
                                timeout=max(deadline - time.monotonic(), 0.0))
            failure, ready = self._failure, self._ipc.ready
        if failure is not None or not ready:
            raise ConnectionError(f"p2p rank {self.rank}: data_backend='ipc': the staging slots "
                                  "were not mapped on both sides within connect_timeout_s="
                                  f"{self.connect_timeout_s}" +
                                  (f" ({failure})" if failure else ""))

    def _check_peer(self, hello: dict[str, Any]) -> int:
        """Raise unless the peer's hello matches our cache; return how many blocks one
        message to it may carry."""
        names = (f"local rank {self.rank}", f"remote rank {self.peer}")
        try:
            theirs = KVCacheLayout.from_dict(hello.get("layout"))
        except (TypeError, ValueError) as exc:
            raise LayoutMismatchError(f"{names[1]} sent a layout this kvcore cannot read "
                                      f"({exc}); {names[0]} has {self._layout.describe()}"
                                      ) from exc
        try:
            self.plan = self._plan_from(theirs, hello)
        except (TypeError, ValueError) as exc:  # LayoutConversionError is a ValueError
            raise LayoutConversionError(f"{names[0]} cannot load from {names[1]}: {exc}"
                                        ) from None
        peer_inbox = hello.get("inbox_bytes")
        if not isinstance(peer_inbox, int) or peer_inbox < self._block_bytes:
            raise ValueError(f"{names[1]} has inbox_bytes={peer_inbox!r}, less than one block "
                             f"({self._block_bytes} bytes); raise inbox_bytes there")
        per_message = min(self._payload_limit(peer_inbox) // self._block_bytes,
                          _MAX_KEYS_PER_MESSAGE)
        with self._cond:
            ipc = self.transport == "ipc"
        # ipc: a slot holds one message, and one of more blocks than the cache has is no use.
        return min(per_message, self._num_blocks) if ipc else per_message

    def _plan_from(self, theirs: KVCacheLayout, hello: dict[str, Any]
                   ) -> ConversionPlan | None:
        """The conversion of the peer's block rows into this cache; ``None`` when they are
        this cache's own rows (same layout, same heads)."""
        heads = self.num_kv_heads if self.num_kv_heads is not None else hello.get(
            "num_kv_heads")
        peer_tp = as_tp_rank(hello.get("tp"), "the peer's tp")
        rows = block_rows_layout(theirs)
        plan = plan_conversion(rows, block_rows_layout(self._layout), src_tp=peer_tp,
                               dst_tp=self.tp,
                               num_kv_heads=heads if isinstance(heads, int) else None)
        if plan.is_identity:
            return None
        return plan_conversion(rows, self._layout, src_tp=peer_tp, dst_tp=self.tp,
                               num_kv_heads=heads if isinstance(heads, int) else None)

    def _payload_limit(self, inbox_bytes: int) -> int:
        """Largest payload of one message to a peer with ``inbox_bytes``: one block at least."""
        return min(inbox_bytes, max(_MAX_PAYLOAD_BYTES, self._block_bytes,
                                    self._peer_block_bytes))

    def _load_plan(self) -> ConversionPlan | None:
        return self.plan

    # -- messages ---------------------------------------------------------------------------

    def _fail_link(self, reason: str) -> None:
        with self._cond:
            if not self._link_ok:
                return
            self._link_ok = False
            if self._failure is None:
                self._failure = reason
            self._cond.notify_all()
        if self._ipc is not None:  # a send waiting for a slot fails now
            self._ipc.wake()
        logger.warning("p2p rank %d: link to peer rank %d is down: %s", self.rank, self.peer,
                       reason)
        with self._send_lock:  # (reentrant: a failing send calls this while holding it)
            # Releasing our sending groups closes their connections, so the peer's receive
            # fails now instead of after its timeout, or never when it is idle.
            self._tx_ctrl = self._tx_data = None

    def _send_message(self, header: dict[str, Any], payload: torch.Tensor | None,
                      timeout: float | None = None, nbytes: int = 0) -> None:
        """Send one message (``nbytes``: the payload's size when it waits in a staging slot);
        on any error the link is down and the error re-raised."""
        wait = timedelta(seconds=timeout or self.timeout_s)
        raw = json.dumps(header).encode()
        if payload is not None:
            nbytes = payload.numel() * payload.element_size()
        with self._send_lock:
            with self._cond:
                if not self._link_ok:
                    raise _LinkDown(self._failure)
            try:
                sizes = torch.tensor([len(raw), nbytes], dtype=torch.int64)
                self._tx_ctrl.send([sizes], self.peer, 0).wait(wait)
                raw_tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                self._tx_ctrl.send([raw_tensor], self.peer, 0).wait(wait)
                if payload is not None:
                    work = self._tx_data.send([payload], self.peer, 0)
                    if payload.is_cuda:
                        wait_bounded(work, self._tx_data, wait.total_seconds(),
                                     f"sending {nbytes} bytes to peer rank {self.peer}")
                    else:
                        work.wait(wait)
            except Exception as exc:
                reason = f"sending to peer rank {self.peer} failed: {exc}"
                self._fail_link(reason)
                raise _LinkDown(reason) from exc

    def _recv_message(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Receive one message, validating sizes before allocating; raises on any fault."""
        sizes = torch.empty(2, dtype=torch.int64)
        self._rx_ctrl.recv([sizes], self.peer, 0).wait(IDLE)  # idle wait, see IDLE
        header_len, payload_len = sizes.tolist()
        if not 0 < header_len <= _MAX_HEADER_BYTES:
            raise _LinkDown(f"peer announced a {header_len}-byte header (limit "
                            f"{_MAX_HEADER_BYTES})")
        limit = self._payload_limit(self.inbox_bytes)
        if not 0 <= payload_len <= limit:
            raise _LinkDown(f"peer announced a {payload_len}-byte payload (limit {limit}: "
                            f"inbox_bytes={self.inbox_bytes}, at most {_MAX_PAYLOAD_BYTES} "
                            "per message)")
        wait = timedelta(seconds=self.timeout_s)
        raw = torch.empty(header_len, dtype=torch.uint8)
        self._rx_ctrl.recv([raw], self.peer, 0).wait(wait)
        try:
            header = json.loads(bytes(_host_buffer(raw)))
        except ValueError as exc:
            raise _LinkDown(f"peer sent a header that is not JSON ({exc})") from exc
        if not isinstance(header, dict) or header.get("op") not in _OPS:
            raise _LinkDown(f"peer sent an unknown message {str(header)[:200]!r}")
        expected = 0
        if header["op"] == "blocks":
            try:
                keys = check_block_keys(header.get("keys"))
            except (TypeError, ValueError) as exc:
                raise _LinkDown(f"peer sent invalid keys ({exc})") from exc
            expected = len(keys) * self._peer_block_bytes
        if payload_len != expected:
            raise _LinkDown(f"peer's {header['op']} message carries {payload_len} bytes, "
                            f"expected {expected}")
        if not payload_len:
            return header, None
        if self.transport in (None, "ipc"):  # (set by this thread, at the hello)
            if self._ipc is None:
                raise _LinkDown("peer sent blocks before agreeing on a data path")
            return header, self._ipc.take(header.get("slot"), len(keys), self._peer_block_bytes)
        payload = torch.empty((len(keys), self._peer_block_bytes), dtype=torch.uint8,
                              device=self._wire_device)
        work = self._rx_data.recv([payload], self.peer, 0)
        if payload.is_cuda:  # NCCL: bounded by polling (see wait_bounded)
            wait_bounded(work, self._rx_data, self.timeout_s,
                         f"receiving {payload_len} bytes from peer rank {self.peer}")
        else:
            work.wait(wait)
        if payload.is_cuda:  # received on this thread's stream; loads run on others
            torch.cuda.current_stream(payload.device).synchronize()
        return header, payload

    def _receive_loop(self) -> None:
        try:
            self._receive_messages()
        finally:  # nothing receives any more: release the groups (closing connections)
            self._rx_ctrl = self._rx_data = None
            if self._ipc is not None:
                self._ipc.stopped_receiving()

    def _receive_messages(self) -> None:
        while True:
            try:
                header, payload = self._recv_message()
            except Exception as exc:
                self._fail_link(f"receiving from peer rank {self.peer} failed: {exc}")
                return
            op = header["op"]
            if op == "hello":
                with self._cond:
                    first = self._peer_hello
                    if first is None:  # checked by _handshake, on the registering thread
                        self._peer_block_bytes = _block_bytes_of(header, self._block_bytes)
                        self._peer_hello = header
                        self._agree(header)
                        self._cond.notify_all()
                if first is not None and header != first:
                    self._refuse_hello(header)
                    return
            elif op == "slots":
                try:
                    if self._ipc is None:
                        raise ConnectionError(f"peer sent staging slots, the data path is "
                                              f"{self.transport!r}")
                    self._ipc.map_peer(header.get("slots"))
                except ConnectionError as exc:
                    self._fail_link(str(exc))
                    return
            elif op == "blocks":
                self._store_blocks(header["keys"], payload)
            else:  # bye
                with self._cond:
                    if self._failure is None:
                        self._failure = f"peer rank {self.peer} closed the connection"
                    self._cond.notify_all()
                if self._ipc is not None:  # a send waiting for a slot fails now
                    self._ipc.wake()
                self._send_bye()
                return

    def _refuse_hello(self, hello: dict[str, Any]) -> None:
        """A second hello that differs from the first: the layout agreed at registration holds
        for the whole session, so the link goes down and the blocks received so far, from a
        peer that no longer agrees with them, are dropped."""
        try:
            first = KVCacheLayout.from_dict(self._peer_hello.get("layout"))
            changed = first.differences(KVCacheLayout.from_dict(hello.get("layout")))
            why = "; ".join(changed) if changed else "its options changed"
        except Exception as exc:  # a hello that cannot be read
            why = str(exc)
        with self._cond:
            dropped = len(self._inbox)
            self._inbox.clear()
            self._inbox_held = 0
        self._fail_link(f"peer rank {self.peer} announced another layout after registration, "
                        f"refused ({why}); {dropped} received blocks dropped")

    def _store_blocks(self, keys: list[str], payload: torch.Tensor | None) -> None:
        if payload is None:  # a message of no blocks
            return
        message = _Message(payload)
        rows = {key: i for i, key in enumerate(keys)}  # a repeated key: its last row counts
        with self._cond:
            for key, i in rows.items():
                self._forget(key)
                self._inbox[key] = (message, i)
            message.live = len(rows)
            self._inbox_held += message.nbytes
            dropped = 0
            while len(self._inbox) > self.inbox_bytes // self._peer_block_bytes:
                self._forget(next(iter(self._inbox)))
                dropped += 1
            if self._inbox_held > self.inbox_bytes:  # then rows wait in partly loaded messages
                self._compact()  # holds len(self._inbox) * block_bytes <= inbox_bytes
            self._cond.notify_all()
        if dropped:
            with self._stats_lock:
                self.stats.evictions += dropped
            logger.warning("p2p rank %d: inbox full (inbox_bytes=%d), dropped the %d oldest "
                           "blocks nobody loaded", self.rank, self.inbox_bytes, dropped)

    def _forget(self, key: str) -> torch.Tensor | None:
        """Take ``key`` out of the inbox (caller holds ``_cond``); returns its row, a view
        that keeps the row's message alive only as long as the caller holds it."""
        entry = self._inbox.pop(key, None)
        if entry is None:
            return None
        message, i = entry
        row = message.data[i]
        message.live -= 1
        if message.live == 0:
            self._inbox_held -= message.nbytes
        return row

    def _compact(self) -> None:
        """Copy the rows still waiting in partly loaded messages into messages of their own
        (caller holds ``_cond``), so that the inbox holds what it counts: a row is a view, and
        one unloaded row would keep its whole message alive."""
        partial: dict[int, list[str]] = {}
        for key, (message, _) in self._inbox.items():
            if message.live < message.data.shape[0]:
                partial.setdefault(id(message), []).append(key)
        for keys in partial.values():
            old = self._inbox[keys[0]][0]
            rows = torch.tensor([self._inbox[k][1] for k in keys], device=old.data.device)
            new = _Message(old.data.index_select(0, rows))
            if new.data.is_cuda:  # copied on this thread's stream; loads run on others
                torch.cuda.current_stream(new.data.device).synchronize()
            for i, key in enumerate(keys):
                self._inbox[key] = (new, i)  # (keeps the key's place in the order)
            new.live, old.live = len(keys), 0
            self._inbox_held += new.nbytes - old.nbytes

    def _send_bye(self) -> bool:
        """Tell the peer we are closing; whether the bye went out."""
        with self._cond:
            if self._bye_sent or not self._link_ok:
                return False
            self._bye_sent = True
        try:
            self._send_message({"op": "bye"}, None)
        except _LinkDown:
            return False  # the peer is gone already: nothing to say goodbye to
        return True

    def _shutdown_link(self) -> None:
        """Say bye, wait for the peer's, and stop the receiver, within ``2 * timeout_s``."""
        with self._cond:
            if self._failure is None:
                self._failure = "the connector is closed"
            self._cond.notify_all()
        if self._ipc is not None:  # a send waiting for a slot fails now
            self._ipc.wake()
        answer_expected = self._send_bye()
        receiver = self._receiver
        if receiver is None:
            return
        # No bye back means the peer is frozen, or the link broke one way only: the receiver
        # may wait forever, and a gloo receive left waiting at exit aborts the process.
        if not stop_receiving_thread(receiver, self._rx_ctrl, self.peer,
                                     self.timeout_s if answer_expected else 0.0,
                                     self.timeout_s):
            logger.warning("p2p rank %d: the receiver thread did not stop within timeout_s=%s "
                           "after close", self.rank, self.timeout_s)

    # -- transfers --------------------------------------------------------------------------

    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        future = self._sender.submit(self._send_blocks, keys, block_ids, self._caller_fence())
        return TransferHandle.from_future("save", self.failure_policy, future)

    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        future = self._loader.submit(self._take_blocks, keys, block_ids)
        return TransferHandle.from_future("load", self.failure_policy, future)

    @property
    def inbox_held_bytes(self) -> int:
        """Bytes of received blocks the inbox holds now (at most :attr:`inbox_bytes`)."""
        with self._cond:
            return self._inbox_held

    def _lookup(self, keys: list[str]) -> int:
        with self._cond:
            for i, key in enumerate(keys):
                if key not in self._inbox:
                    return i
            return len(keys)

    def _send_blocks(self, keys: list[str], block_ids: list[int],
                     blocks_written: Callable[[], None]) -> TransferResult:
        started = time.perf_counter()
        blocks_written()
        sent: list[int] = []
        failed: dict[int, str] = {}
        step = self._blocks_per_message
        for i in range(0, len(keys), step):
            ids = block_ids[i:i + step]
            with self._cond:
                failure = self._failure
            if failure is None:
                try:
                    header = {"op": "blocks", "keys": keys[i:i + step]}
                    if self._ipc is not None:
                        self._send_in_slot(header, ids)
                    else:
                        data = self._read_blocks(ids).to(self._wire_device)
                        self._send_message(header, data)
                    sent.extend(ids)
                    continue
                except _LinkDown as exc:
                    failure = str(exc)
            failed.update((b, failure) for b in ids)
        result = self._result("save", sent, failed, len(sent) * self._block_bytes,
                              time.perf_counter() - started)
        return self._record(result)

    def _send_in_slot(self, header: dict[str, Any], block_ids: list[int]) -> None:
        """ipc: wait for a free slot (outside the send lock: the peer's acknowledgements never
        wait behind it), copy the blocks there, and send the header naming it."""
        try:
            index, nbytes = self._ipc.put(self._reg.views, block_ids)
        except ConnectionError as exc:
            raise _LinkDown(str(exc)) from None
        self._send_message({**header, "slot": index}, None, nbytes=nbytes)

    def _take_blocks(self, keys: list[str], block_ids: list[int]) -> TransferResult:
        started = time.perf_counter()
        with self._cond:
            self._cond.wait_for(
                lambda: self._failure is not None or all(k in self._inbox for k in keys),
                timeout=self.timeout_s)
            rows = {k: self._forget(k) for k in keys if k in self._inbox}
            reason = self._failure or (f"not received from peer rank {self.peer} within "
                                       f"timeout_s={self.timeout_s}")
        if self.plan is not None:
            return self._take_converting(keys, block_ids, rows, reason, started)
        loaded = [b for k, b in zip(keys, block_ids, strict=True) if k in rows]
        failed = {b: reason for k, b in zip(keys, block_ids, strict=True) if k not in rows}
        if loaded:
            data = _rows([rows[k] for k in keys if k in rows])
            self._write_blocks(loaded, data, f"p2p load from rank {self.peer}")
            storage = self._reg.kv_caches.storage
            if storage.is_cuda:  # written on this worker thread's stream
                torch.cuda.current_stream(storage.device).synchronize()
        result = self._result("load", loaded, failed, len(loaded) * self._block_bytes,
                              time.perf_counter() - started)
        return self._record(result)

    def _take_converting(self, keys: list[str], block_ids: list[int],
                         rows: dict[str, torch.Tensor], reason: str, started: float
                         ) -> TransferResult:
        """Convert the received rows of ``keys`` (the peer's blocks) into ``block_ids`` with
        one gather (:meth:`ConversionPlan.apply_keys`)."""
        present = [k for k in keys if k in rows]
        slot = {k: i for i, k in enumerate(present)}
        loaded: list[int] = []
        failed: dict[int, str] = {}
        nbytes = 0
        if present:
            data = _rows([rows[k] for k in present])  # (n, peer block bytes), contiguous
            storage = self._reg.kv_caches.storage
            loaded, missing, nbytes = self.plan.apply_keys(
                data, self._reg.kv_caches, [slot.get(k, 0) for k in keys], block_ids,
                [k in slot for k in keys])
            if storage.is_cuda:  # written on this worker thread's stream
                torch.cuda.current_stream(storage.device).synchronize()
            failed = {b: f"key {keys[i][:12]}.. (the peer's block {i} of the load): {reason}"
                      for b, i in missing.items()}
        else:
            failed = dict.fromkeys(block_ids, reason)
        return self._record(self._result("load", loaded, failed, nbytes,
                                         time.perf_counter() - started))

    def _close(self) -> None:
        if self._receiver is not None:
            self._sender.shutdown(wait=True)  # queued saves leave before the bye
            self._shutdown_link()
            self._loader.shutdown(wait=True)
            if self._ipc is not None:  # the peer closes the channel at the bye, if it can
                self._ipc.stop(0.0 if self._receiver.is_alive() else self.timeout_s)
                self._ipc.close()
            with self._send_lock:
                self._tx_ctrl = self._tx_data = self._nccl = self._acks = None
        with self._cond:
            self._inbox.clear()
            self._inbox_held = 0
        self._store = None
