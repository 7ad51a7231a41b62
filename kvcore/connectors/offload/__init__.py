"""``offload``: keep KV blocks in a bounded CPU memory pool, evicting the least recently used.

The pool is allocated once, when the KV caches are registered: ``capacity_bytes //
block_bytes`` slots, pinned when the cache is on a CUDA device so copies are asynchronous DMA.
Pinning tens of GiB takes seconds, so the pool is chunks of 256 MiB, each allocated pinned by
torch, in parallel; with ``pin_in_background=True`` registration returns once the first chunk
(64 MiB) exists and a worker thread allocates the rest, one chunk at a time, after the
connector's own CUDA set-up, the pool growing as it goes (``pinning``: pinned allocation holds
a CUDA driver lock; only allocated slots are ever handed out; ``wait_pinned()`` waits for
all). A slot holds a whole
block, every layer, layer-major (``(slots, block_bytes)`` per chunk), whatever the cache's
layout, so a run of consecutive slots within a chunk is one contiguous host region: one copy
(a run crossing a chunk boundary is one copy per chunk).

Blocks move in one of two ways, chosen per transfer:

- **direct**: cross-layer caches whose blocks and slots form long runs (e.g. contiguous block
  ids) copy each run straight between the cache and the pool, one copy per run;
- **staged** (per-layer caches, and scattered cross-layer blocks): the transfer is cut into
  chunks of at most ``chunk_bytes``; a save gathers a chunk's blocks of every layer into a
  contiguous device staging buffer with one indexed copy (``index_select`` over a
  ``(num_blocks, num_layers, page)`` view of the cache) and copies it to the pool with one copy
  per run of consecutive slots (usually one per chunk); a load copies the slots into staging
  and scatters them into the blocks with one ``index_copy_``. Two staging buffers per direction
  alternate, so the gather (or scatter) of one chunk overlaps the bus copy of the other.

On CUDA, saves and loads each own a copy stream and a kernel stream (so both directions of the
bus work at once, and gathers overlap copies), ordered after the engine's current stream with
events, and a handle completes on a CUDA event. Nothing waits on the host, nothing runs on the
engine's stream, and the staging buffers are allocated once at registration. Block ids reach
the device through a pinned ring on a stream of their own (pinning per transfer would wait for
an idle device), and every gather/scatter kernel variant is launched once at registration
(CUDA loads a kernel's module lazily on first launch, which also waits for an idle device).
On CPU the same staged logic runs synchronously on plain tensors and handles are complete when
returned.

With ``block_copier=NAME`` (a :class:`~kvcore.connectors.BlockCopier` registered by a plugin,
e.g. ``cuda_batch`` from kvcore-nvidia), transfers that would be staged go to that copier
instead, on the copy stream (one call for every layer when they lie back to back in one
storage, as in the usual per-layer layout): no staging buffers and no SM kernels, the copy
engines move each run of blocks. Direct transfers stay direct. Staging is the default because
it is faster; a copier takes less from the engine (numbers in ``benchmarks/RESULTS.md``).

A block with a transfer in flight (a save not yet complete, a load reading its slot) is never
evicted, and a save never evicts a key it holds already (such a key counts as saved, without
a copy); if no other slot is left, saving more fails for those blocks.

The package, one module per concern:

``connector``  :class:`OffloadConnector`: registration, save/load/lookup, handles
``slots``      :class:`~kvcore.connectors.offload.slots.SlotIndex`: key -> slot, LRU eviction
``planning``   which path a transfer takes, its runs and its staging chunks
``views``      word-sized and all-layers-at-once views of the cache's blocks
``cuda``       stream ordering, the pinned block-id ring, the staging buffers
``pinning``    the pool's host memory, pinned chunks allocated in the background
"""

from __future__ import annotations

from kvcore.connectors.offload.connector import OffloadConnector

__all__ = ["OffloadConnector"]
