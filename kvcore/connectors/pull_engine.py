"""What a pull connector (:mod:`kvcore.connectors.pull`) reads through its transfer library:
the memory regions of a cache's blocks, the runs of blocks one READ moves, and the
:class:`Engine` a library supplies to register memory and start, poll and release READs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvcore.connectors.base import RegisteredCaches
from kvcore.connectors.pull_channel import ChannelError

__all__ = ["Engine", "Regions", "Run", "all_published", "memory_kind", "read_runs", "spans"]


def memory_kind(storage: torch.Tensor, transport: str) -> tuple[str, int]:
    """The memory type and device id of a tensor: ``VRAM`` and the GPU, or ``DRAM``."""
    if storage.is_cuda:
        return "VRAM", storage.device.index or 0
    if storage.device.type != "cpu":
        raise ValueError(f"the {transport} connector moves CPU (DRAM) or CUDA (VRAM) caches; "
                         f"this one is on {storage.device}")
    return "DRAM", 0


@dataclass(frozen=True)
class Regions:
    """Where the blocks of a cache are: per byte view, the address of block 0, the distance
    between blocks and the bytes of one block (one row)."""

    addrs: tuple[int, ...]
    strides: tuple[int, ...]
    row_bytes: tuple[int, ...]
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int

    @classmethod
    def of(cls, reg: RegisteredCaches, transport: str) -> Regions:
        views = reg.views
        return cls(tuple(v.data_ptr() for v in views), tuple(v.stride(0) for v in views),
                   tuple(v.shape[1] for v in views),
                   *memory_kind(reg.kv_caches.storage, transport))

    def to_dict(self) -> dict[str, Any]:
        return {"addrs": list(self.addrs), "strides": list(self.strides),
                "row_bytes": list(self.row_bytes), "mem_type": self.mem_type,
                "dev_id": self.dev_id}

    @classmethod
    def from_dict(cls, data: Any) -> Regions:
        try:
            regions = cls(tuple(int(a) for a in data["addrs"]),
                          tuple(int(s) for s in data["strides"]),
                          tuple(int(r) for r in data["row_bytes"]), str(data["mem_type"]),
                          int(data["dev_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"the producer sent unreadable block regions ({exc})") from exc
        if not len(regions.addrs) == len(regions.strides) == len(regions.row_bytes) \
                or regions.mem_type not in ("DRAM", "VRAM"):
            raise ChannelError(f"the producer sent inconsistent block regions {data!r}")
        return regions

    def run_descs(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """Descriptors ``(addr, bytes, dev_id)`` of ``count`` blocks from ``first``: one per
        view when a view's rows are back to back, else one per view and block."""
        descs = []
        for addr, stride, row in zip(self.addrs, self.strides, self.row_bytes, strict=True):
            start = addr + first * stride
            if stride == row:
                descs.append((start, count * row, self.dev_id))
            else:
                descs.extend((start + i * stride, row, self.dev_id) for i in range(count))
        return descs


class Engine(Protocol):
    """One side's transfer engine, with the cache's storage registered (what
    :meth:`~kvcore.connectors.pull.PullConnector._open_engine` returns). Every call into the
    library goes through it; it serialises them where the library is not thread-safe."""

    #: How the peer names this engine: the consumer's name in a producer's leases and
    #: notifications.
    name: str

    def hello(self) -> dict[str, Any]:
        """Producer: the :attr:`~kvcore.connectors.pull.PullConnector.hello_fields` consumers
        need to reach it."""

    def connect(self, reply: dict[str, Any]) -> Any:
        """Consumer: reach the producer's engine from its hello; returns what
        :meth:`start_read` and :meth:`forget` call it."""

    def forget(self, remote: Any) -> None:
        """Consumer: drop the producer's engine (after the last READ)."""

    def start_read(self, run: Run, lease: str | None, local: Regions, remote_regions: Regions,
                   remote: Any) -> None:
        """Start the READ of ``run`` (set ``run.handle``); raise with the reason if it cannot
        start (then :meth:`release` releases what was set). Where READs notify the producer,
        the READ carries ``<lease>:<run.first>:<run.end>``; none when ``lease`` is ``None``
        (a READ started before its lease, confirmed later with :meth:`notify`)."""

    def notify(self, remote: Any, message: bytes) -> None:
        """Consumer, where READs notify the producer: send it ``message`` as a READ's
        notification would carry it (raise if it cannot be sent). Not called where READs
        are confirmed over the side channel."""

    def poll(self, run: Run) -> str:
        """``"DONE"``, ``"PROC"`` (in flight) or why the READ failed."""

    def release(self, run: Run) -> bool:
        """Release ``run.handle`` (cancelling a READ in flight, where the library can);
        ``False`` if the READ may still write the blocks."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Producer: the READ notifications that arrived, as ``(consumer, message)``;
        ``[]`` where READs are confirmed over the side channel."""

    def register_staging(self, staging: torch.Tensor) -> None:
        """Consumer: register ``staging`` (local READs may land in it) beside the cache;
        released by :meth:`close`."""

    def close(self) -> None:
        """Deregister the memory and let the engine go (idempotent)."""



@dataclass
class Run:
    """Blocks ``first..end-1`` of a fetch, consecutive on both sides, read by one READ."""

    first: int
    end: int
    src: int  # producer block of ``first``
    dst: int  # consumer block of ``first``
    handle: Any = None  # the engine's, while the READ is in flight


def all_published(blocks: list[Any], num_blocks: int) -> bool:
    """Whether every entry of a fetch's (or lookups') answer names a block of the producer's
    cache, an int in ``0..num_blocks - 1`` (none is ``None``: not published), checked in
    passes of C code: the common case, which then needs no per-key work."""
    return bool(blocks) and set(map(type, blocks)) == {int} and min(blocks) >= 0 \
        and max(blocks) < num_blocks


def read_runs(pairs: list[tuple[int, int, int]]) -> list[Run]:
    """Group ``(fetch index, producer block, consumer block)`` into runs consecutive in all
    three (:func:`spans` does it for a whole fetch at once)."""
    runs: list[Run] = []
    for i, src, dst in pairs:
        last = runs[-1] if runs else None
        if last is not None and i == last.end and src == last.src + (i - last.first) \
                and dst == last.dst + (i - last.first):
            last.end += 1
        else:
            runs.append(Run(i, i + 1, src, dst))
    return runs


def spans(first: int, src: list[int], dst: list[int]) -> list[Run]:
    """:func:`read_runs` of fetch indices ``first, first + 1, ..`` with producer blocks
    ``src`` and consumer blocks ``dst`` (as long): one comparison of C code when both are
    ranges (the common case, one READ), the loop over pairs otherwise."""
    n = len(src)
    if n and src == list(range(src[0], src[0] + n)) and dst == list(range(dst[0], dst[0] + n)):
        return [Run(first, first + n, src[0], dst[0])]
    return read_runs(list(zip(range(first, first + n), src, dst, strict=True)))
