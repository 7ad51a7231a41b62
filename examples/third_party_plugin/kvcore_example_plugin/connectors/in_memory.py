"""``example_memory``: a KV connector that keeps saved blocks in this process's memory.

The smallest useful connector on kvcore's connector API: the base class validates keys and
block ids, registers the caches and moves block bytes (``_read_blocks`` / ``_write_blocks``
handle per-layer and cross-layer caches alike); this class only decides where the bytes live.
Copies are synchronous, so every handle is complete when returned.
"""

from __future__ import annotations

import time

import torch

from kvcore.connectors import KVConnector, TransferHandle


class InMemoryConnector(KVConnector):
    """Saved blocks in a dict, key -> ``(block_bytes,)`` uint8 tensor on the CPU.

    Args:
        max_blocks: how many blocks it holds; a save beyond that fails for the blocks that do
            not fit (no eviction: the simplest policy that never drops a block silently).
        failure_policy: see :data:`kvcore.connectors.FAILURE_POLICIES`.
    """

    # A cross-layer cache turns each saved block into one copy instead of one per layer.
    prefer_cross_layer_blocks = True

    def __init__(self, *, max_blocks: int = 1024, failure_policy: str = "recompute") -> None:
        super().__init__(failure_policy=failure_policy)
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks={max_blocks!r} must be a positive integer")
        self.max_blocks = max_blocks
        self._store: dict[str, torch.Tensor] = {}

    def _register(self, reg) -> None:
        """Nothing to prepare: blocks are stored as they arrive."""

    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        started = time.perf_counter()
        new = [(k, b) for k, b in zip(keys, block_ids, strict=True) if k not in self._store]
        room = max(self.max_blocks - len(self._store), 0)
        stored, full = new[:room], new[room:]
        if stored:
            rows = self._read_blocks([b for _, b in stored]).cpu()
            for (key, _), row in zip(stored, rows, strict=True):
                self._store[key] = row
        failed = {b: f"store full ({self.max_blocks} blocks)" for _, b in full}
        succeeded = [b for b in block_ids if b not in failed]
        return self._finished("save", succeeded, failed, len(stored) * self.block_bytes,
                              started)

    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        started = time.perf_counter()
        found = [(k, b) for k, b in zip(keys, block_ids, strict=True) if k in self._store]
        failed = {b: f"key {k[:12]}... was never saved here"
                  for k, b in zip(keys, block_ids, strict=True) if k not in self._store}
        if found:
            data = torch.stack([self._store[k] for k, _ in found])
            self._write_blocks([b for _, b in found], data, request="example_memory load")
        return self._finished("load", [b for _, b in found], failed,
                              len(found) * self.block_bytes, started)

    def _lookup(self, keys: list[str]) -> int:
        hits = 0
        while hits < len(keys) and keys[hits] in self._store:
            hits += 1
        return hits

    def _close(self) -> None:
        self._store.clear()
