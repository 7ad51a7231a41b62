"""The ``ipc`` data path of the ``p2p`` connector (:mod:`kvcore.connectors.p2p`): block bytes
through memory both processes of one host map, headers over gloo.

Each side owns :data:`SLOTS` staging slots, one allocation ``(SLOTS, slot_bytes)`` uint8 that
its peer maps (:class:`SlotPool`, :func:`map_slots`): on the GPU of a CUDA cache, shared
through CUDA IPC (the handle torch's ``reduce_tensor`` makes of the allocation, opened by the
peer on that GPU); for a CPU cache, a file under ``/dev/shm`` mapped by both (created with its
pages reserved, so a full ``/dev/shm`` is an error at registration, not a ``SIGBUS`` later,
and unlinked as soon as the peer mapped it). A sender takes a free slot, copies a message's
blocks into it (:func:`fill_slot`, the layout the other data paths send), waits for the copy,
then sends the header naming the slot; the receiver copies the slot into a payload of its
own, waits for that copy and gives the slot back on a channel of its own (an int64: the slot,
or :data:`ACK_MAPPED` / :data:`ACK_UNMAPPABLE` once, after mapping the slots).

:func:`agree_data_backend` is the rule both peers apply to their hellos' facts
(:func:`transport_facts`) to pick one data path, or to refuse the pair with the same reason
on both sides.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from kvcore.connectors.p2p_transport import IDLE, stop_receiving_thread
from kvcore.connectors.shared_memory import (
    host_identity,
    map_allocation,
    share_allocation,
    visible_gpus,
)

__all__ = ["ACK_MAPPED", "ACK_UNMAPPABLE", "SLOTS", "IpcChannel", "SlotPool",
           "agree_data_backend", "fill_slot", "map_slots", "transport_facts"]

# The connector's logger: what goes wrong here is the connector's to report.
logger = logging.getLogger("kvcore.connectors.p2p")

#: Staging slots per sender: one is filled while the peer copies the other out.
SLOTS = 2
#: Acknowledgements other than a slot given back: the peer mapped this side's slots, or not.
ACK_MAPPED = -1
ACK_UNMAPPABLE = -2
#: Where a CPU cache's slots live: memory-backed files both processes can open.
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
#: A message's blocks are copied run by run (a slice copy per run of consecutive ids and
#: view) up to this many copies; beyond, one gather per view.
_MAX_RUN_COPIES = 64
_FIX = "pass data_backend='nccl' (CUDA caches on two GPUs) or 'gloo' to both peers"


def transport_facts(requested: str, device: torch.device) -> dict[str, Any]:
    """What a hello says about this side's data path: the ``data_backend`` asked for, the
    host, the cache's device type and GPU, and the GPUs this process could map a peer's slots
    on (listed when the cache is on a GPU or ``"ipc"`` was asked for)."""
    gpus = visible_gpus() if device.type == "cuda" or requested == "ipc" else []
    gpu = None
    if device.type == "cuda":
        gpu = str(torch.cuda.get_device_properties(device).uuid)
    return {"data_backend": requested, "host": host_identity(), "device": device.type,
            "gpu": gpu, "gpus": gpus}


def agree_data_backend(mine: dict[str, Any], theirs: Any, here: str, there: str) -> str:
    """The data path both peers use, from their hellos' :func:`transport_facts`; the same on
    both sides (the rule is symmetric), or a ``ValueError`` with the same reason on both.

    ``here`` and ``there`` name the two sides in messages. ``"auto"`` on both: ``"ipc"`` for
    CUDA caches on one GPU of one host (NCCL refuses two ranks on one device), ``"nccl"`` for
    CUDA caches otherwise, ``"gloo"`` for CPU caches; one explicit choice wins over ``"auto"``.
    """
    keys = ("data_backend", "host", "device", "gpu", "gpus")
    if not isinstance(theirs, dict) or any(k not in theirs for k in keys):
        raise ValueError(f"{there} sent no data path facts in its hello (got {theirs!r}); "
                         "both peers must run the same kvcore")
    ours, their = mine["data_backend"], theirs["data_backend"]
    if "auto" not in (ours, their) and ours != their:
        raise ValueError(f"data_backend={ours!r} on {here} but {their!r} on {there}: pass the "
                         "same data_backend to both peers, or 'auto' to one of them")
    same_host = mine["host"] == theirs["host"]
    cuda = mine["device"] == theirs["device"] == "cuda"
    if ours == their == "auto":
        if mine["device"] != theirs["device"]:
            raise ValueError(
                f"data_backend='auto' on both peers, with the cache on {mine['device']} on "
                f"{here} and on {theirs['device']} on {there}: 'auto' picks NCCL for CUDA caches "
                "and gloo for CPU ones; pass data_backend='gloo' to both (CUDA blocks staged "
                "through host memory)" + (" or 'ipc'" if same_host else ""))
        chosen = ("ipc" if cuda and same_host and mine["gpu"] == theirs["gpu"] else
                  "nccl" if cuda else "gloo")
    else:
        chosen = ours if ours != "auto" else their
    if chosen == "nccl":
        if not cuda:
            raise ValueError(f"data_backend='nccl' needs CUDA caches on both peers; the cache "
                             f"is on {mine['device']} on {here} and on {theirs['device']} on "
                             f"{there}: pass data_backend='gloo' to both")
        if same_host and mine["gpu"] == theirs["gpu"]:
            raise ValueError(f"data_backend='nccl' with both caches on GPU {mine['gpu']}: NCCL "
                             "refuses two ranks on one device; pass data_backend='ipc' (or "
                             "'auto') to both peers")
    if chosen == "ipc":
        _check_ipc(mine, theirs, here, there)
    return chosen


def _check_ipc(mine: dict[str, Any], theirs: dict[str, Any], here: str, there: str) -> None:
    if mine["host"] != theirs["host"]:
        raise ValueError(f"data_backend='ipc' maps the peer's memory, which needs both "
                         f"processes on one host: {here} runs on {mine['host']!r}, {there} on "
                         f"{theirs['host']!r}; {_FIX}")
    for sender, receiver, names in ((mine, theirs, (here, there)),
                                    (theirs, mine, (there, here))):
        if sender["gpu"] is not None and sender["gpu"] not in receiver["gpus"]:
            raise ValueError(f"data_backend='ipc': the cache of {names[0]} is on GPU "
                             f"{sender['gpu']}, which {names[1]} does not see (its visible GPUs: "
                             f"{receiver['gpus'] or 'none'}), so it cannot map the slots there; "
                             f"make that GPU visible to both processes (CUDA_VISIBLE_DEVICES) or "
                             f"{_FIX}")


def _reserve(path: str, nbytes: int) -> None:
    """Create ``path`` (only this user may open it) with ``nbytes`` of pages reserved, so
    that a full file system fails here (``OSError``) rather than a later write with
    ``SIGBUS``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # (no reservation: macOS)
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SlotPool:
    """A sender's staging slots, ``slots`` ``(count, slot_bytes)`` uint8 on ``device`` (a
    CUDA device, or the CPU: a shared-memory file), and which of them are free.

    :meth:`acquire` waits for a free slot, :meth:`release` gives one back (the peer's
    acknowledgement), :meth:`fail` wakes every waiter with a reason, :meth:`close` frees the
    memory (the file, if still there, is unlinked; at interpreter exit too).
    """

    def __init__(self, count: int, slot_bytes: int, device: torch.device) -> None:
        self.count, self.slot_bytes, self.device = count, slot_bytes, device
        self._cond = threading.Condition()
        self._free = list(range(count))
        self._failure: str | None = None
        self._path: str | None = None
        total = count * slot_bytes
        if device.type == "cuda":
            try:
                self.slots = torch.empty((count, slot_bytes), dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError as exc:
                raise RuntimeError(f"data_backend='ipc': no room for {count} staging slots of "
                                   f"{slot_bytes} bytes on {device} ({exc}); lower inbox_bytes "
                                   "on the peer (a slot holds one message)") from exc
            try:
                self._flat = self.slots.view(-1)  # (what a peer in this process gets)
                shared = share_allocation(self._flat)
            except RuntimeError as exc:
                raise RuntimeError(f"data_backend='ipc' cannot share its staging slots: {exc}; "
                                   f"{_FIX}") from None
            self.handle: dict[str, Any] = {"kind": "cuda", "count": count,
                                           "slot_bytes": slot_bytes, "allocation": shared}
        elif device.type == "cpu":
            self._path = os.path.join(_SHM_DIR,
                                      f"kvcore-p2p-{os.getpid()}-{secrets.token_hex(8)}")
            self._finalizer = weakref.finalize(self, _unlink, self._path)
            try:
                _reserve(self._path, total)
                data = torch.from_file(self._path, shared=True, size=total, dtype=torch.uint8)
            except OSError as exc:
                self._finalizer()
                free = os.statvfs(_SHM_DIR)
                raise RuntimeError(
                    f"data_backend='ipc': {total} bytes of shared memory for the staging slots "
                    f"do not fit in {_SHM_DIR} ({free.f_bavail * free.f_frsize} bytes free; "
                    f"{exc}); enlarge it (docker run --shm-size) or lower inbox_bytes on the "
                    "peer (a slot holds one message)") from exc
            self.slots = data.view(count, slot_bytes)
            self.handle = {"kind": "shm", "path": self._path, "count": count,
                           "slot_bytes": slot_bytes}
        else:
            raise ValueError(f"data_backend='ipc' moves blocks of CPU and CUDA caches; this "
                             f"cache is on {device}: {_FIX}")

    def acquire(self, timeout_s: float) -> int:
        """A free slot's index, waiting at most ``timeout_s``; ``TimeoutError`` past that,
        ``ConnectionError`` (the reason) once :meth:`fail` was called."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._free and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no staging slot came back within timeout_s={timeout_s} "
                                       f"(all {self.count} hold messages the peer has not "
                                       "copied out)")
                self._cond.wait(left)
            if self._failure is not None:
                raise ConnectionError(self._failure)
            return self._free.pop(0)

    def release(self, index: int) -> None:
        """The peer copied slot ``index`` out; ``ValueError`` if it holds no message."""
        with self._cond:
            if not 0 <= index < self.count or index in self._free:
                raise ValueError(f"slot {index} holds no message (slots 0..{self.count - 1})")
            self._free.append(index)
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """Wake every waiter: no slot comes back any more."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._cond.notify_all()

    def unlink(self) -> None:
        """The peer mapped the slots: their file (CPU) need not have a name any more, so
        nothing is left in ``/dev/shm`` whichever process dies."""
        if self._path is not None:
            self._finalizer()

    def close(self) -> None:
        self.fail("the connector is closed")
        self.unlink()
        self.slots = self._flat = None


def map_slots(handle: Any, device: torch.device) -> torch.Tensor:
    """Map a peer's slots (its :attr:`SlotPool.handle`) into this process: ``(count,
    slot_bytes)`` uint8, on the peer's GPU (this process's index of it) or in shared memory.
    Raises ``ValueError`` with the reason when they cannot be mapped here."""
    try:
        kind, count, slot_bytes = handle["kind"], handle["count"], handle["slot_bytes"]
    except (TypeError, KeyError) as exc:
        raise ValueError(f"the staging slots' handle {str(handle)[:200]!r} lacks {exc}") from None
    if not all(isinstance(v, int) and v > 0 for v in (count, slot_bytes)):
        raise ValueError(f"staging slots of count={count!r}, slot_bytes={slot_bytes!r}")
    total = count * slot_bytes
    if kind == "shm":
        path = handle.get("path")
        if not isinstance(path, str) or not os.path.basename(path).startswith("kvcore-p2p-"):
            raise ValueError(f"the staging slots' path {path!r} is not a kvcore-p2p file")
        try:
            fd = os.open(path, os.O_RDWR)  # never creates: a file this host lacks is an error
        except OSError as exc:
            raise ValueError(f"the peer's staging slots {path} cannot be opened here ({exc}): "
                             "data_backend='ipc' needs both processes to share "
                             f"{os.path.dirname(path)} (one host, one container or IPC "
                             f"namespace); {_FIX}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise ValueError(f"the peer's staging slots {path} hold {size} bytes, its hello "
                                 f"says {total}")
            # Through the descriptor: the file may be unlinked by its owner meanwhile.
            where = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path
            data = torch.from_file(where, shared=True, size=total, dtype=torch.uint8)
        finally:
            os.close(fd)
        return data.view(count, slot_bytes)
    if kind == "cuda":
        try:
            data = map_allocation(handle.get("allocation"))
        except ValueError as exc:
            raise ValueError(f"the peer's staging slots cannot be mapped here: {exc}; "
                             f"{_FIX}") from None
        if data.numel() != total:
            raise ValueError(f"the peer's staging slots map as {data.numel()} bytes, its hello "
                             f"says ({count}, {slot_bytes})")
        return data.view(count, slot_bytes)
    raise ValueError(f"staging slots of kind {kind!r}: this kvcore maps 'shm' and 'cuda' ones")


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first id, length)`` of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    position = 0
    for _, group in itertools.groupby(enumerate(block_ids), lambda p: p[1] - p[0]):
        ids = [b for _, b in group]
        runs.append((position, ids[0], len(ids)))
        position += len(ids)
    return runs


def fill_slot(slot: torch.Tensor, views: list[torch.Tensor], block_ids: list[int]) -> int:
    """Copy blocks ``block_ids`` of a cache into ``slot`` (1-D uint8): ``len(block_ids)`` rows,
    each the block's bytes of every view in turn (``views``: the cache's ``(num_blocks,
    row_bytes)`` byte views, as :meth:`KVConnector._read_blocks` reads them). Queued on the
    current stream for a GPU; returns the bytes written."""
    width = sum(v.shape[1] for v in views)
    rows = slot[:len(block_ids) * width].view(len(block_ids), width)
    runs = _runs(block_ids)
    offset = 0
    for view in views:
        part = rows[:, offset:offset + view.shape[1]]
        if len(runs) * len(views) <= _MAX_RUN_COPIES:
            for at, first, length in runs:
                part[at:at + length].copy_(view[first:first + length])
        else:
            part.copy_(view.index_select(0, torch.tensor(block_ids, device=view.device)))
        offset += view.shape[1]
    return rows.numel()


class IpcChannel:
    """One connector's ``ipc`` state: its staging slots and the thread that receives the
    peer's acknowledgements of them (sending), the peer's slots mapped here and the gloo
    group ``ack_tx`` that gives them back (receiving).

    ``cond`` is the connector's condition, notified when :attr:`ready` may have changed;
    ``failure()`` is the link's failure so far (``None``: up), ``fail(reason)`` takes it
    down. Errors raise ``ConnectionError`` with the reason.
    """

    def __init__(self, *, rank: int, peer: int, device: torch.device, timeout_s: float,
                 ack_tx: Any, ack_rx: Any, cond: threading.Condition,
                 failure: Callable[[], str | None], fail: Callable[[str], None]) -> None:
        self.rank, self.peer, self.device, self.timeout_s = rank, peer, device, timeout_s
        self._ack_tx, self._ack_rx = ack_tx, ack_rx
        self._cond, self._failure, self._fail = cond, failure, fail
        self.pool: SlotPool | None = None
        self.peer_slots: torch.Tensor | None = None
        self._mapped = False  # the peer mapped this side's slots
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        """Each side mapped the other's slots (read under ``cond``)."""
        return self._mapped and self.peer_slots is not None

    def share(self, slot_bytes: int) -> dict[str, Any]:
        """Make this side's slots of ``slot_bytes`` each; returns their handle for the peer."""
        self.pool = SlotPool(SLOTS, slot_bytes, self.device)
        self._thread = threading.Thread(target=self._ack_loop, args=(self.pool,), daemon=True,
                                        name=f"kvcore-p2p-ack-{self.rank}")
        self._thread.start()
        return self.pool.handle

    def map_peer(self, handle: Any) -> None:
        """Map the peer's slots (its :meth:`share`'s handle) and say whether they mapped."""
        if self.peer_slots is not None:
            raise ConnectionError("peer shared its staging slots twice")
        try:
            slots = map_slots(handle, self.device)
        except Exception as exc:
            with contextlib.suppress(ConnectionError):
                self._ack(ACK_UNMAPPABLE)
            raise ConnectionError(f"cannot map the staging slots of peer rank {self.peer} "
                                  f"(data_backend='ipc'): {exc}") from exc
        with self._cond:
            self.peer_slots = slots
            self._cond.notify_all()
        self._ack(ACK_MAPPED)

    def put(self, views: list[torch.Tensor], block_ids: list[int]) -> tuple[int, int]:
        """Copy blocks ``block_ids`` of the cache's ``views`` (see :func:`fill_slot`) into a
        free slot, waiting for one at most ``timeout_s``, and for the copy; returns ``(slot,
        bytes)`` for the header. No slot in time takes the link down."""
        try:
            index = self.pool.acquire(self.timeout_s)
        except TimeoutError as exc:
            reason = f"sending to peer rank {self.peer} failed: {exc}"
            self._fail(reason)
            raise ConnectionError(reason) from None
        try:
            slot = self.pool.slots[index]
            nbytes = fill_slot(slot, views, block_ids)
            if slot.is_cuda:  # the peer copies the slot out once the header is there
                torch.cuda.current_stream(slot.device).synchronize()
        except BaseException:
            self.pool.release(index)
            raise
        return index, nbytes

    def take(self, index: Any, rows: int, row_bytes: int) -> torch.Tensor:
        """Copy ``rows`` blocks of ``row_bytes`` out of the peer's slot ``index`` into a new
        ``(rows, row_bytes)`` uint8 tensor on this cache's device, then give the slot back."""
        slots, nbytes = self.peer_slots, rows * row_bytes
        if slots is None:
            raise ConnectionError("peer sent blocks in a staging slot before sharing its slots")
        if (isinstance(index, bool) or not isinstance(index, int)
                or not 0 <= index < slots.shape[0] or nbytes > slots.shape[1]):
            raise ConnectionError(f"peer sent {nbytes} bytes in staging slot {index!r} (it "
                                  f"shared {slots.shape[0]} slots of {slots.shape[1]} bytes)")
        payload = torch.empty((rows, row_bytes), dtype=torch.uint8, device=self.device)
        payload.view(-1).copy_(slots[index, :nbytes])
        for device in {payload.device, slots.device}:  # copied before the slot is reused
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        self._ack(index)
        return payload

    def _ack(self, value: int) -> None:
        group = self._ack_tx
        try:
            if group is None:
                raise RuntimeError("the channel is closed")
            group.send([torch.tensor([value], dtype=torch.int64)], self.peer, 0).wait(
                timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise ConnectionError(f"acknowledging to peer rank {self.peer} failed: {exc}"
                                  ) from exc

    def _ack_loop(self, pool: SlotPool) -> None:
        """Receive the peer's acknowledgements until the channel closes (the peer's receiver
        stopped) or carries nonsense."""
        value = torch.empty(1, dtype=torch.int64)
        try:
            while True:
                self._ack_rx.recv([value], self.peer, 0).wait(IDLE)  # idle wait, see IDLE
                ack = int(value.item())
                if ack == ACK_MAPPED:
                    pool.unlink()
                    with self._cond:
                        self._mapped = True
                        self._cond.notify_all()
                elif ack == ACK_UNMAPPABLE:
                    raise ConnectionError(f"peer rank {self.peer} cannot map this side's staging "
                                          "slots (data_backend='ipc'; its error says why)")
                else:
                    pool.release(ack)
        except (ConnectionError, ValueError) as exc:  # the peer's slots, or nonsense
            reason = (str(exc) if isinstance(exc, ConnectionError) else
                      f"peer rank {self.peer} acknowledged nonsense: {exc}")
            self._fail(reason)
            pool.fail(self._failure() or reason)
        except Exception as exc:  # the channel closed: the receiver reports why, if it was
            pool.fail(self._failure() or  # not closing
                      f"acknowledgements from peer rank {self.peer} stopped: {exc}")
        finally:
            self._ack_rx = None

    def stopped_receiving(self) -> None:
        """The connector's receiver stopped: nothing is acknowledged any more, and releasing
        the group closes the peer's end of it (which ends its acknowledgement thread)."""
        self._ack_tx = None

    def wake(self) -> None:
        """The link failed (or is closing): a send waiting for a slot fails with the reason."""
        failure = self._failure()
        if self.pool is not None and failure is not None:
            self.pool.fail(failure)

    def stop(self, wait_s: float) -> None:
        """End the acknowledgement thread: wait ``wait_s`` for the peer to close the channel,
        then end the receive (at most ``timeout_s`` more)."""
        thread = self._thread
        if thread is None:
            return
        if not stop_receiving_thread(thread, self._ack_rx, self.peer, wait_s, self.timeout_s):
            logger.warning("p2p rank %d: the acknowledgement thread did not stop within "
                           "timeout_s=%s after close", self.rank, self.timeout_s)

    def close(self) -> None:
        """Free this side's slots (after :meth:`stop`) and unmap the peer's."""
        if self.pool is not None:
            self.pool.close()
        self.peer_slots = None
