"""Helpers shared by the NVIDIA backends: metadata conversions, the kernel hooks of the K/V
backends (:class:`PagedCacheImpl`), host staging and the per-step cache."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from kvcore import AttentionImpl, AttentionLayer, AttentionMetadata, KVSplit
from kvcore.ops import checked_step_facts, validate_paged_attention, value_checks_enabled

T = TypeVar("T")

#: A block id no cache reaches: a step whose block range was not checked on the host never
#: takes the layers' short path (they validate their tensors instead).
UNCHECKED_BLOCKS = 2**62


def launch_block_bound(meta: AttentionMetadata, graph_batch_size: int | None) -> int:
    """The largest block id a layer's short path (no per-layer checks) may assume the step
    reads: the step's checked facts for an eager step; :data:`UNCHECKED_BLOCKS` (the layers
    check in full) when they are unknown, and for a step built for a captured graph, whose host
    values must not depend on its block table (a replay reuses what the capture saw;
    ``CudaGraphRunner`` checks each replay's block ids); ``-1`` with value checks off."""
    if not value_checks_enabled():
        return -1
    if graph_batch_size is None:
        facts = checked_step_facts(meta.query_start_loc, meta.seq_lens, meta.block_table)
        if facts is not None:
            return facts.max_block_id
    return UNCHECKED_BLOCKS


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """``(n,)`` lengths -> ``(n + 1,)`` int32 offsets starting at 0 (``cu_seqlens``)."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def pages_per_request(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """``ceil(seq_lens / block_size)``: the block-table entries each request uses."""
    return (seq_lens.to(torch.int32) + block_size - 1) // block_size


def used_blocks(seq_lens: torch.Tensor, block_table: torch.Tensor,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, indices)``: :func:`pages_per_request` and the block-table entries those pages
    are, request after request (``(pages.sum(),)`` int32 on the block table's device; this
    reads the page count back to size it)."""
    pages = pages_per_request(seq_lens, block_size)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages[:, None]
    return pages, block_table.to(torch.int32)[used]


@functools.cache
def _cache_write() -> Callable[..., None]:
    """:func:`kvcore_nvidia.ops.write_kv_cache`, imported on the first write (validating a
    backend loads none of the extension's build machinery), then looked up once."""
    from kvcore_nvidia.ops.cache_write import write_kv_cache

    return write_kv_cache


class PagedCacheImpl(AttentionImpl):
    """The kernel hooks the plugin's K/V backends share: the cache write on the
    ``kv_cache.unbind(1)`` halves (:meth:`split_kv`), and those halves checked against the
    step before a vendor kernel reads them (:meth:`checked_halves`, first thing in each
    backend's ``attend``)."""

    @functools.cached_property
    def split_kv(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``split_kv(kv_cache)``: the ``kv_cache.unbind(1)`` halves, ``(num_blocks,
        block_size, num_kv_heads, head_size)`` each, kept per layer by a
        :class:`kvcore.KVSplit`: the same tuple of the same views while the layer's cache is
        the same, so the cache write finds its checks by these view objects
        (``kvcore.ops.reshape_and_cache``'s look-up by identity), a backend its own by the
        tuple."""
        return KVSplit().split

    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The plugin's stride-aware cache write.

        On GPU tensors the CUDA C++ kernel where the extension builds, else kvcore's Triton
        kernel (:func:`kvcore_nvidia.ops.write_kv_cache` says which and why); the reference
        on CPU tensors. All use int64 offsets and the view's strides, so every stride order
        the backends declare (per layer and cross-layer) is written in place.
        """
        key_cache, value_cache = self.split_kv(kv_cache)
        _cache_write()(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
                       layer.k_scale, layer.v_scale)

    def checked_halves(self, query: torch.Tensor, kv_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata,
                       output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)``, the :meth:`split_kv` halves, once
        :func:`kvcore.ops.validate_paged_attention` accepts them with this step's ``query``
        and ``output`` rows (no device read: the step's tensors carry their checked facts)."""
        halves = self.split_kv(kv_cache)
        validate_paged_attention(
            query, *halves, attn_metadata.query_start_loc, attn_metadata.seq_lens,
            attn_metadata.block_table, kv_cache_dtype=self.kv_cache_dtype,
            sliding_window=self.sliding_window, output=output, scale=self.scale)
        return halves


@dataclasses.dataclass(frozen=True)
class StagingSlot:
    """One slot of :class:`HostStaging`: its views by name, as tensors and as numpy arrays
    (the same memory: a write through either is seen by both)."""

    tensors: dict[str, torch.Tensor]
    arrays: dict[str, np.ndarray]


class HostStaging:
    """Host memory a builder stages its host-to-device copies in, one slot per step in turn.

    A build takes the next slot (:meth:`acquire`), writes the step's host lists into it,
    enqueues its copies from it (``non_blocking``: from page-locked memory a copy runs while
    the host goes on) and calls :meth:`release`, which records an event on the current
    stream. The slot comes round again ``slots`` builds later, and :meth:`acquire` first waits
    for that event: the host never overwrites memory a pending copy still reads, and it waits
    only when it runs ``slots`` builds ahead of the device. Allocated once (no allocation, no
    growing of torch's pinned cache per step).

    Args:
        fields: ``name -> (numel, dtype)``: the views each slot holds, laid out in one
            allocation per slot (each view 64-byte aligned).
        slots: how many slots are used in turn (at least 1).
        pin: page-locked memory (for copies to a CUDA device).
        new_event: makes a slot's event (``torch.cuda.Event``; anything with ``record()`` and
            ``synchronize()``), once per slot; ``None`` where copies are synchronous (a CPU
            device): nothing to wait for.
        stream: returns the stream :meth:`release` records the event on (the current one,
            e.g. :func:`current_cuda_stream`); ``None``: the event's ``record()`` default.
    """

    _ALIGN = 64

    def __init__(self, fields: dict[str, tuple[int, torch.dtype]], *, slots: int = 2,
                 pin: bool = False, new_event: Callable[[], Any] | None = None,
                 stream: Callable[[], Any] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        offsets, nbytes = {}, 0
        for name, (numel, dtype) in fields.items():
            offsets[name] = nbytes
            size = numel * dtype.itemsize
            nbytes += -(-size // self._ALIGN) * self._ALIGN
        self.slots: list[StagingSlot] = []
        for _ in range(slots):
            raw = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            tensors = {name: raw[offsets[name]:offsets[name] + numel * dtype.itemsize]
                       .view(dtype) for name, (numel, dtype) in fields.items()}
            self.slots.append(StagingSlot(tensors, {k: v.numpy() for k, v in tensors.items()}))
        self._new_event = new_event
        self._stream = stream
        self._events: list[Any] = [None] * slots
        self._next = 0
        self._held: int | None = None

    def acquire(self) -> StagingSlot:
        """The next slot, once the copies enqueued from it by its last use have run."""
        if self._held is not None:
            raise RuntimeError("HostStaging.acquire() called twice without release(): "
                               "release the slot after enqueuing its copies")
        index = self._next
        event = self._events[index]
        if event is not None:
            event.synchronize()
        self._held = index
        return self.slots[index]

    def release(self) -> None:
        """Every copy from the held slot is enqueued: record its event, move to the next."""
        index = self._held
        if index is None:
            raise RuntimeError("HostStaging.release() without acquire()")
        if self._new_event is not None:
            if self._events[index] is None:
                self._events[index] = self._new_event()
            if self._stream is None:
                self._events[index].record()
            else:
                self._events[index].record(self._stream())
        self._held = None
        self._next = (index + 1) % len(self.slots)


# (device index, raw stream) -> the torch.cuda.Stream of that stream.
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_cuda_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, its Python object made once per stream (a
    builder records an event on it every step; ``current_stream`` builds a new object each
    call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream(index)
    stream = _STREAMS.get((index, raw))
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[index, raw] = torch.cuda.current_stream(index)
    return stream


class StepCache:
    """Reuses what one step's :class:`kvcore.AttentionMetadata` costs to prepare (a FlashInfer
    plan, a flex block mask) across the layers of that step.

    An engine calls every layer's ``forward`` with the same metadata object. The key is that
    object's identity (a reference is kept, so the identity cannot be recycled), its scalar
    fields, each of its tensors' data pointer and shape, and the caller's ``extra`` (layer
    parameters, device); the tensors' contents are checked too: a metadata object refilled in
    place for the next step, or a layer with another sliding window, misses. Contents are
    checked through torch's version counter (bumped by every in-place write) or, for
    inference tensors (made under ``torch.inference_mode()``, which have no version counter),
    by comparing them with a copy taken when the entry was built. Writes that bypass torch (a
    raw-pointer kernel filling ordinary tensors) are not seen: build a new
    ``AttentionMetadata`` per step, as :func:`kvcore.build_attention_metadata` does.
    One entry: a miss replaces it. Not thread-safe (engines run layers one after another).
    """

    def __init__(self) -> None:
        self._metadata: AttentionMetadata | None = None
        self._key: tuple | None = None
        self._snapshots: tuple[torch.Tensor | None, ...] = ()
        self._value: object = None

    @staticmethod
    def _tensors(attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        return (attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table)

    @classmethod
    def _key_of(cls, attn_metadata: AttentionMetadata, extra: tuple) -> tuple:
        # An inference tensor has no version counter (reading it raises): its snapshot stands in.
        return (id(attn_metadata), attn_metadata.max_query_len, attn_metadata.max_seq_len,
                attn_metadata.num_actual_tokens, attn_metadata.causal,
                *((t.data_ptr(), tuple(t.shape), None if t.is_inference() else t._version)
                  for t in cls._tensors(attn_metadata)), extra)

    def _unchanged(self, attn_metadata: AttentionMetadata) -> bool:
        return all(snap is None or torch.equal(snap, t)
                   for snap, t in zip(self._snapshots, self._tensors(attn_metadata),
                                      strict=True))

    def get(self, attn_metadata: AttentionMetadata, extra: tuple,
            build: Callable[[], T]) -> T:
        """The value cached for this metadata and ``extra``, or ``build()`` (then cached)."""
        key = self._key_of(attn_metadata, extra)
        if (self._metadata is not attn_metadata or self._key != key
                or not self._unchanged(attn_metadata)):
            self._value = build()
            self._metadata, self._key = attn_metadata, key
            self._snapshots = tuple(t.clone() if t.is_inference() else None
                                    for t in self._tensors(attn_metadata))
        return self._value  # type: ignore[return-value]
