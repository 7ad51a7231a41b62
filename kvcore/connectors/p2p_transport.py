"""The ``torch.distributed`` plumbing of the ``p2p`` connector (:mod:`kvcore.connectors.p2p`):
rank 1's client of rank 0's rendezvous, connected within a hard deadline, the process groups
of a pair, the bounded wait on a transfer of a data group, and the end of a receive that
would wait forever.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["IDLE", "connect_groups", "connect_store", "seconds_option", "stop_receiving_thread",
           "unblock_receive",
           "wait_bounded"]

# The connector's logger: what goes wrong here is the connector's to report.
logger = logging.getLogger("kvcore.connectors.p2p")

#: How often a bounded wait on a data-group transfer polls for completion.
_POLL_S = 1e-3
#: Waiting for the next message is not a timeout: an idle peer is normal and a dead one
#: closes the connection. (A finite gloo timeout would close an idle link.) gloo waits
#: without an explicit timeout use the group's, which is the connect timeout: every wait
#: passes one.
IDLE = timedelta(days=365)
#: A tag no message uses: a send on it that times out closes the gloo pair, which is how a
#: receive blocked on a frozen peer is woken (gloo has no way to cancel a receive).
_UNBLOCK_TAG = 1
UNBLOCK_S = 0.05


def seconds_option(name: str, value: Any) -> float:
    """A timeout option as float seconds: finite, > 0 and at most 365 days (:data:`IDLE`)."""
    most = IDLE.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= most):
        raise ValueError(f"{name}={value!r} must be a positive finite number of seconds, at "
                         f"most {most:.0f} (365 days)")
    return float(value)


def connect_groups(store: dist.Store, rank: int, nccl: torch.device | None,
                   deadline: float) -> dict[str, Any]:
    """The process groups of a pair, per direction ``src`` (rank ``src`` sends):
    ``ctrl{src}`` (gloo: headers, and gloo's block bytes), ``ack{src}`` (gloo: the receiver
    gives ``src``'s ipc staging slots back on it, so that no acknowledgement waits behind a
    message) and, when ``nccl`` names a CUDA device, ``nccl{src}`` (NCCL groups connect on
    first use: unused ones cost nothing). Same order on both sides: each gloo group is a
    rendezvous, which waits for the peer at most until ``deadline`` (``time.monotonic()``);
    ``TimeoutError`` past it."""
    groups: dict[str, Any] = {}
    for src in (0, 1):
        name = f"kvcore-p2p/{src}to{1 - src}"
        for kind in ("ctrl", "ack"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no time left")
            prefix = f"{name}/gloo" if kind == "ctrl" else f"{name}/ack"
            groups[f"{kind}{src}"] = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=left))
        if nccl is not None:
            with torch.cuda.device(nccl):
                groups[f"nccl{src}"] = dist.ProcessGroupNCCL(
                    dist.PrefixStore(f"{name}/nccl", store), rank, 2)
    return groups


def unblock_receive(group: Any, peer: int) -> None:
    """End a receive on ``group`` from ``peer`` that would wait forever: a send on a tag the
    peer never receives times out at once, and gloo then closes the connection, failing the
    receive too."""
    if group is None:
        return
    try:
        group.send([torch.zeros(1, dtype=torch.uint8)], peer,
                   _UNBLOCK_TAG).wait(timedelta(seconds=UNBLOCK_S))
    except Exception:
        pass  # the expected outcome: the timeout closed the connection


def stop_receiving_thread(thread: threading.Thread, group: Any, peer: int, wait_s: float,
                          timeout_s: float) -> bool:
    """Join ``thread``, which receives from ``peer`` on ``group``: wait ``wait_s`` for it to
    end by itself (the peer closing its end), then end its receive
    (:func:`unblock_receive`) and wait at most ``timeout_s`` more; returns whether it ended."""
    thread.join(wait_s)
    if thread.is_alive():
        unblock_receive(group, peer)
        thread.join(timeout_s)
    return not thread.is_alive()


def wait_bounded(work: Any, group: Any, timeout_s: float, what: str) -> None:
    """Wait for ``work`` (a send or receive on ``group``) at most ``timeout_s`` seconds by
    polling its completion on the host; past that, abort ``group`` (so the transfer never
    completes into memory reused later, and nothing is left to NCCL's watchdog, which would
    take the process down) and raise ``TimeoutError``.

    NCCL's ``Work.wait`` only orders the current stream after the transfer unless blocking
    wait is enabled process-wide, so a receive from a peer that never sends would hang the
    next synchronisation (or the watchdog would abort the process); polling bounds it.
    """
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() >= deadline:
            abort = getattr(group, "abort", None) or getattr(group, "_abort", None)
            if abort is not None:
                try:
                    abort()
                except Exception as exc:  # still failing the transfer below
                    logger.warning("p2p: aborting the data group failed: %s", exc)
            raise TimeoutError(f"{what} did not complete within timeout_s={timeout_s}")
        time.sleep(_POLL_S)
    work.wait()  # completed: orders the current stream after it (and raises its error)


def _sockets() -> dict[str, int]:
    """This process's sockets, ``"socket:[inode]"`` -> fd (Linux; empty where there is no
    ``/proc``)."""
    found: dict[str, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            found[target] = int(name)
    return found


def _shut_down_socket_read_by(thread_id: int, port: int, existing: dict[str, int]) -> bool:
    """Shut down the socket that thread ``thread_id`` (a native id) is blocked on, if it is
    one that appeared after ``existing`` was taken and is connected to ``port``: that wakes
    the thread (the fd stays its owner's to close). Other sockets of the process, to the same
    host and port or not, are left alone. Linux only (``/proc``); elsewhere nothing happens.
    Returns whether it shut one down (something at ``port`` accepted the connection)."""
    try:
        with open(f"/proc/self/task/{thread_id}/syscall") as f:
            # "<nr> <arg0> ...": a thread in recv/read/connect on a socket has its fd as arg0
            # ("running" when it is not in a system call).
            fields = f.read().split()
        fd = int(fields[1], 16)
        inode = os.readlink(f"/proc/self/fd/{fd}")
    except (OSError, IndexError, ValueError):
        return False
    if not inode.startswith("socket:") or inode in existing:
        return False
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        peer = sock.getpeername()
        same = inode == f"socket:[{os.fstat(sock.fileno()).st_ino}]"  # fd not reused meanwhile
        if same and isinstance(peer, tuple) and peer[1] == port:
            sock.shutdown(socket.SHUT_RDWR)
            return True
    except OSError:
        pass  # not connected, or closed meanwhile
    finally:
        sock.close()
    return False


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """Rank 1's client of rank 0's ``TCPStore``, within ``timeout_s`` in every case.

    torch's client waits for the server's answer to its handshake without a timeout, so a port
    whose server accepts but never answers would hang it: it connects on a helper thread,
    and when that thread is still waiting at the deadline the socket it is blocked on (that
    one only) is shut down, which ends the wait (with an error) and the thread.
    """
    existing = _sockets()
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, 2, False,
                                         timeout=timedelta(seconds=timeout_s),
                                         wait_for_workers=False)
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=connect, daemon=True, name="kvcore-p2p-connect")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        answered = False  # whether something at the port accepted the connection
        for _ in range(5):  # again if the client, still inside its own timeout, reconnected
            answered |= _shut_down_socket_read_by(thread.native_id, port, existing)
            thread.join(0.2)
            if not thread.is_alive():
                break
        if answered:
            raise ConnectionError(
                f"p2p rank 1: {host}:{port} accepted the connection but did not answer the "
                f"rendezvous handshake within connect_timeout_s={timeout_s} (is it rank 0's "
                "p2p port?)")
        raise ConnectionError(
            f"p2p rank 1: nothing accepted a connection at {host}:{port} within "
            f"connect_timeout_s={timeout_s}; start rank 0 first (it listens on that port), "
            "check the host and port, or raise connect_timeout_s")
    if "error" in box:
        raise ConnectionError(f"p2p rank 1: no rendezvous at {host}:{port} within "
                              f"connect_timeout_s={timeout_s}: {box['error']}") from box["error"]
    return box["store"]
