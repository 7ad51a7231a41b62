"""The side channel of the pull connectors (:mod:`kvcore.connectors.pull`): frames of a JSON
object and raw bytes after it, over a TCP socket, and the packing of a request's keys and an
answer's block numbers into those bytes.

The producer listens on ``host:port``; any number of consumers connect. A frame is an 8-byte
header (two big-endian lengths), a JSON object and raw bytes after it: a request's keys, their
hex digits back to back (:func:`pack_keys`; JSON took as long to write them as the producer
takes to find their blocks). A consumer sends ``hello`` (its
:meth:`kvcore.KVCacheLayout.to_dict` and its engine's name); the producer answers with its
layout, what the library needs to reach it and the addresses of its block regions. Both sides
compare the layouts (the number of blocks aside) and refuse a mismatch with
:class:`kvcore.LayoutMismatchError` before any byte moves. Then:

- ``lookup`` {keys}: how many leading keys are published and open to this consumer, and (the
  tail, :func:`pack_blocks`) their blocks and the serials of those publications (a serial is
  never reused);
- ``fetch`` {keys, lease_s}: take the published ones for ``lease_s`` seconds; the answer names
  the producer's block of each key and its publication's serial (``-1``: not published yet).
  The consumer READs them and confirms each run read whole, ``<lease>:<first>:<end>``:
  through the library's notification where it has one (NIXL), else with ``done`` {lease,
  first, end} on the side channel
  (:attr:`~kvcore.connectors.pull.PullConnector.confirms_over_channel`; a gather in place
  sends it ``quiet``, unanswered). The producer then releases the blocks and the save reports
  them done (it counts notifications right after answering a fetch, when the consumer READs
  and waits for nothing from it, or :data:`~kvcore.connectors.pull_producer.SETTLE_AFTER_S`
  after they arrived when no fetch comes; always before a lease ends or the producer closes);
- ``giveback`` {lease, indices}: runs whose READ failed go back to published (runs that timed
  out stay leased until the lease ends: the lifetimes in :mod:`kvcore.connectors.pull`).
"""

from __future__ import annotations

import json
import reprlib
import socket
import struct
import sys
from array import array
from typing import Any

__all__ = ["BadFrame", "ChannelError", "close_socket", "pack_blocks", "pack_keys",
           "recv_frame", "send_frame", "unpack_blocks"]

_MAX_FRAME_BYTES = 64 << 20  # engine metadata is the largest payload (kilobytes)


class ChannelError(ConnectionError):
    """The side channel failed (closed, timed out, malformed); the message says why."""


class BadFrame(ChannelError):
    """A whole frame arrived but is not a JSON object (the stream is still in step)."""


def send_frame(sock: socket.socket, message: dict[str, Any], tail: bytes = b"") -> None:
    """Send ``message`` (a JSON object) and ``tail``, raw bytes it carries besides (a
    request's keys, :func:`pack_keys`): an 8-byte header (the JSON's length and the tail's,
    big-endian), the JSON, the tail."""
    raw = json.dumps(message).encode()
    sock.sendall(struct.pack(">II", len(raw), len(tail)) + raw + tail)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ChannelError("the peer closed the connection")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """One frame of :func:`send_frame`: the JSON object, with its tail (if any) as
    ``"tail"`` (bytes)."""
    size, tail_size = struct.unpack(">II", _recv_exact(sock, 8))
    if not 0 < size <= _MAX_FRAME_BYTES or tail_size > _MAX_FRAME_BYTES:
        raise ChannelError(f"the peer announced a message of {size} bytes and {tail_size} "
                           f"more (limit {_MAX_FRAME_BYTES} each)")
    raw = _recv_exact(sock, size)
    tail = _recv_exact(sock, tail_size) if tail_size else b""  # (the stream stays in step)
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise BadFrame(f"the peer sent a message that is not JSON this side reads "
                       f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    if not isinstance(message, dict):
        raise BadFrame(f"the peer sent {reprlib.repr(message)}, not a JSON object")
    message.pop("tail", None)
    if tail:
        message["tail"] = tail
    return message


def pack_keys(keys: list[str]) -> bytes:
    """Block keys (64 lowercase hex digits each, checked already) as a frame's tail: their
    characters back to back. JSON would spend about as long on a load's hundreds of keys as
    the producer spends finding their blocks."""
    return "".join(keys).encode("ascii")


def pack_blocks(blocks: list[int]) -> bytes:
    """Integers of a lookup's or a fetch's answer (per key its block, then per key its
    publication's serial; ``-1``: not published) as a frame's tail: little-endian int64s
    (JSON took as long to write and read a load's hundreds of them as the consumer takes to
    start its READ)."""
    packed = array("q", blocks)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_blocks(tail: bytes) -> list[int]:
    """:func:`pack_blocks`' list from its bytes (a ``ValueError`` unless whole int64s)."""
    blocks = array("q")
    blocks.frombytes(tail)
    if sys.byteorder == "big":
        blocks.byteswap()
    return blocks.tolist()


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
