"""The side channel of the pull connectors (:mod:`kvcore.connectors.pull`): frames of a JSON
object and raw bytes after it, over a TCP socket, and the packing of a request's keys and an
answer's block numbers into those bytes."""

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
