"""Tensor parallelism simulated in one process, for the demo engine: a rank's cache holds its
slice of the KV heads, and the connectors of every rank act as one for the engine.

With ``K`` KV heads over ``tp`` ranks, rank ``r`` holds the heads
:func:`kvcore.connectors.heads_of_rank` gives it (``K/tp`` of them, or one replicated head
when ``K < tp``) and the query heads ``r*H/tp ..`` that attend to them. The engine runs each
rank's heads over its own cache (:class:`~kvcore.demo.engine.Engine` with one cache per rank);
:class:`ConnectorGroup` fans the engine's lookups, loads and saves out to the connectors of
every rank (a decode rank has one consumer per prefill rank it reads its heads from).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvcore.connectors import KVConnector, TransferHandle, TransferResult

__all__ = ["ConnectorGroup"]


class ConnectorGroup:
    """Several connectors acting as one for :class:`~kvcore.demo.engine.Engine`: the
    connectors of a tensor-parallel engine's ranks, each registered with its rank's cache.

    All of them must agree on :attr:`key_block_size` and :meth:`blocks_for_keys`. A lookup
    finds the keys every connector finds; a save or load runs on every connector at once, and
    a block succeeds only where it succeeded on all of them (a block one rank failed is
    recomputed by every rank, as a real engine would).
    """

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        if not connectors:
            raise ValueError("connectors is empty: a ConnectorGroup passes each call to its "
                             "ranks' connectors, so give it one connector per rank (at least "
                             "one)")
        self.connectors = list(connectors)

    @property
    def key_block_size(self) -> int:
        sizes = {c.key_block_size for c in self.connectors}
        if len(sizes) != 1:
            raise ValueError(f"the group's connectors name keys of different block sizes "
                             f"{sorted(sizes)}; every rank must read the same peer layout")
        return sizes.pop()

    def blocks_for_keys(self, num_keys: int) -> int:
        return self.connectors[0].blocks_for_keys(num_keys)

    def lookup(self, keys: Sequence[str]) -> int:
        return min(c.lookup(keys) for c in self.connectors)

    def save(self, keys: Sequence[str], block_ids: Sequence[int]) -> TransferHandle:
        return self._all("save", [c.save(keys, block_ids) for c in self.connectors])

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> TransferHandle:
        return self._all("load", [c.load(keys, block_ids) for c in self.connectors])

    def _all(self, op: str, handles: list[TransferHandle]) -> TransferHandle:
        started = time.perf_counter()

        def block(timeout: float | None) -> bool:
            deadline = None if timeout is None else time.monotonic() + timeout
            for handle in handles:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    handle.wait(left)
                except TimeoutError:
                    return False
            return True

        def collect() -> TransferResult:
            results = [h.wait() for h in handles]
            failed: dict[int, str] = {}
            for i, result in enumerate(results):
                for b, why in result.failed.items():
                    failed.setdefault(b, f"connector {i} of the group: {why}")
            succeeded = [b for b in results[0].succeeded if b not in failed]
            return TransferResult(op, tuple(succeeded), failed,
                                  sum(r.num_bytes for r in results),
                                  time.perf_counter() - started)

        return TransferHandle(op, "recompute", lambda: all(h.done() for h in handles), block,
                              collect)

    def loaded(self) -> tuple[int, float]:
        """Bytes loaded and seconds spent loading, over every connector."""
        return (sum(c.stats.loaded_bytes for c in self.connectors),
                sum(c.stats.load_seconds for c in self.connectors))
