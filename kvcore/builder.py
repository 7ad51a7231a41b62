"""The engine step: per-step metadata builders and the CUDA-graph support they declare.

An engine's step builds the batch's :class:`~kvcore.AttentionMetadata` once, then for every
layer writes the new K/V and runs attention. A backend's *builder* is the per-step half of
the backend contract: the engine makes one per backend at start-up
(``backend.get_builder_cls()(spec, num_heads=..., max_num_seqs=..., max_num_batched_tokens=...,
max_model_len=..., device=...)``) and calls :meth:`AttentionMetadataBuilder.build` once per
step, before the layers; what it returns is passed to every layer's ``forward``. Per-step work
(the value checks, a kernel library's plan, split-KV choices, workspaces) happens there, never
per layer.

:class:`kvcore.CudaGraphSupport` is what a backend declares as ``CUDA_GRAPH_SUPPORT``. A backend
that supports graphs has a builder that keeps the step's device tensors in persistent buffers
(:class:`PersistentMetadataBuilder`), so a step captured once for a batch size replays for
any later step of that size; :class:`kvcore.CudaGraphRunner` does the capture and the replays.
"""

from __future__ import annotations

import torch

from kvcore.metadata import AttentionMetadata, is_uniform_decode
from kvcore.ops.validation import (
    StepFacts,
    checked_step_facts,
    step_facts_from_tensors,
    value_checks_enabled,
)
from kvcore.spec import KVCacheSpec
from kvcore.step_facts import mark_views_checked, window_covers

__all__ = ["AttentionMetadataBuilder", "PersistentMetadataBuilder", "graph_batch_sizes"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


class AttentionMetadataBuilder:
    """Builds what one backend's layers need for a step, once per step (the default builder).

    Args:
        spec: the layers' KV cache spec (block size, dtypes, heads and head size).
        num_heads: query heads per layer.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most query tokens (rows) in one step, padding rows included.
        max_model_len: longest request (cached + new tokens).
        device: where the layers run.

    :meth:`build` checks the step's values once (see :mod:`kvcore.ops.validation`): for
    tensors from :func:`kvcore.build_attention_metadata` that is free (they carry the facts
    checked on the host); for tensors an engine made itself it is one device read per step.
    Either way the tensors end up marked, and the ops of every layer skip reading them back.
    It also refuses a step beyond the maxima given here. The default returns ``common``
    itself; subclasses add per-step work and return a subclass of
    :class:`~kvcore.AttentionMetadata` that their ``forward`` understands.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_heads: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device | str,
    ) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a kvcore.KVCacheSpec, got {type(spec).__name__}")
        self.spec = spec
        self.num_heads = _positive("num_heads", num_heads)
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive("max_num_batched_tokens",
                                                max_num_batched_tokens)
        self.max_model_len = _positive("max_model_len", max_model_len)
        self.device = torch.device(device)

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table columns a request of ``max_model_len`` tokens needs."""
        return -(-self.max_model_len // self.spec.block_size)

    def spec_kv_heads(self) -> int:
        """The spec's K/V heads per layer, for a builder that plans by head counts.

        Raises:
            TypeError: the spec declares no K/V heads (an MLA spec's latent has none).
        """
        num_kv_heads = getattr(self.spec, "num_kv_heads", None)
        if num_kv_heads is None:
            raise TypeError(f"spec must be a kvcore.FullAttentionSpec (K/V heads), got "
                            f"{type(self.spec).__name__}: {type(self).__name__} plans by K/V "
                            "heads; give it the layers' FullAttentionSpec, or use an MLA "
                            "backend for latent caches")
        return num_kv_heads

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> AttentionMetadata:
        """The metadata every layer's ``forward`` gets for this step.

        Args:
            common: the step, e.g. from :func:`kvcore.build_attention_metadata`.
            graph_batch_size: build for replay in a CUDA graph captured for this many
                requests (see :class:`PersistentMetadataBuilder`); the default builder keeps
                no persistent buffers and refuses it.

        Raises:
            ValueError: a value check fails, the step exceeds the maxima given at
                construction, or ``graph_batch_size`` is given to a builder without graphs.
        """
        if graph_batch_size is not None:
            raise ValueError(
                f"graph_batch_size={graph_batch_size}: {type(self).__name__} keeps no "
                "persistent buffers, so its steps cannot be replayed from a CUDA graph (the "
                "backend declares CUDA_GRAPH_SUPPORT = NEVER); call build(common)")
        self.check(common)
        return common

    def warmup(self) -> dict[str, float]:
        """Prepare at start-up what the first steps would otherwise pay for (a kernel
        library's JIT compilation, say): an engine calls it once after making the builder.

        Returns the seconds each part took, by name (the default prepares nothing: ``{}``).
        """
        return {}

    def check(self, common: AttentionMetadata) -> StepFacts | None:
        """The step's value checks, once: the facts its tensors are marked with, or one device
        read that establishes and marks them; then the maxima of this builder. The same-step
        overwrite check allows for the spec's ``sliding_window`` (a marked step checked for a
        narrower window is checked again for this one).

        Returns the facts (``None`` when value checks are off, see
        :func:`kvcore.ops.set_value_checks`).
        """
        if not isinstance(common, AttentionMetadata):
            raise TypeError(f"common must be a kvcore.AttentionMetadata, got "
                            f"{type(common).__name__}")
        if common.num_seqs > self.max_num_seqs:
            raise ValueError(f"the step has {common.num_seqs} requests but the builder was "
                             f"made for max_num_seqs={self.max_num_seqs}")
        rows = common.slot_mapping.shape[0]
        if rows > self.max_num_batched_tokens:
            raise ValueError(f"the step has {rows} token rows but the builder was made for "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")
        if common.max_seq_len > self.max_model_len:
            raise ValueError(f"the step has a request of {common.max_seq_len} tokens but the "
                             f"builder was made for max_model_len={self.max_model_len}")
        if not value_checks_enabled():
            lens = common.seq_lens_cpu  # a host copy: its maximum costs no device read
            longest = int(lens.max()) if lens is not None and lens.numel() else None
            if longest is not None and longest > common.max_seq_len:
                raise _understated(common.max_seq_len, f"seq_lens_cpu has a request of "
                                                       f"{longest} tokens")
            return None
        window = getattr(self.spec, "sliding_window", None)
        facts = checked_step_facts(common.query_start_loc, common.seq_lens, common.block_table,
                                   common.slot_mapping)
        if facts is None or not window_covers(facts.sliding_window, window):
            # Unchecked, or checked for a narrower window than this builder's layers see.
            facts = step_facts_from_tensors(common.query_start_loc, common.seq_lens,
                                            common.block_table, common.slot_mapping,
                                            self.spec.block_size, sliding_window=window)
        if facts.block_size != self.spec.block_size:
            raise ValueError(f"the step's metadata was built for block_size={facts.block_size} "
                             f"but the builder's spec has block_size={self.spec.block_size}")
        if facts.max_blocks_per_seq > -(-common.max_seq_len // facts.block_size):
            raise _understated(common.max_seq_len, f"a request uses {facts.max_blocks_per_seq} "
                                                   f"blocks of {facts.block_size} tokens")
        if facts.num_tokens != common.num_actual_tokens:
            raise ValueError(f"query_start_loc ends at {facts.num_tokens} but "
                             f"num_actual_tokens={common.num_actual_tokens}")
        return facts


class PersistentMetadataBuilder(AttentionMetadataBuilder):
    """A builder whose steps live in device buffers allocated once, sized by the maxima.

    :meth:`build` copies the step into the buffers in place and returns views of them: the
    same memory every step, no new tensors. With ``graph_batch_size`` the views have the
    shapes of that batch size, whatever the step's size, the host values are the captured
    size's (``max_query_len`` 1, ``max_seq_len`` = ``max_model_len``, an upper bound), and a
    uniform-decode step smaller than it is padded with harmless requests (one token at slot
    -1, which writes nothing, attending to the first slot of block 0); so a step captured in
    a CUDA graph for that size replays correctly for every later step of at most that size.
    Graph-capable backends subclass this and add their own per-step choices (stable for a
    ``graph_batch_size``).

    The metadata :meth:`build` returns is valid until the next :meth:`build`, which
    overwrites the buffers.

    An engine may write a step straight into the buffers (:meth:`buffers`) and pass views of
    them as the step's tensors (``seq_lens[:n]``, ``block_table[:n]``, ...): :meth:`build`
    copies nothing that is already where it belongs, so such a step costs no device copies.

    Buffers: ``query_start_loc`` ``(max_num_seqs + 1,)`` and ``seq_lens`` ``(max_num_seqs,)``
    int32, ``block_table`` ``(max_num_seqs, ceil(max_model_len / block_size))`` int32,
    ``slot_mapping`` ``(max_num_batched_tokens,)`` int64.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_heads: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device | str,
    ) -> None:
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= "
                             f"max_num_seqs={max_num_seqs} (a decode step has a token per "
                             "request)")
        dev = self.device
        # Normal tensors even when made inside inference mode: marks need version counters.
        with torch.inference_mode(False):
            self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=dev)
            self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=dev)
            self.block_table = torch.zeros(max_num_seqs, self.max_blocks_per_seq,
                                           dtype=torch.int32, device=dev)
            self.slot_mapping = torch.full((max_num_batched_tokens,), -1, dtype=torch.int64,
                                           device=dev)
            # Source of the padding requests' query_start_loc entries (one token each).
            self._arange = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        # A graph step's query_start_loc is 0, 1, ..., size (a token per request, padding
        # included): once the buffer holds that, a step whose host copy shows it needs no copy.
        # How many leading entries hold 0, 1, 2, ..., as of the buffer's version counter then
        # (a write by anyone else bumps it).
        self._arange_cpu = torch.arange(max_num_seqs + 1, dtype=torch.int32)
        self._qsl_arange = (0, -1)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers by name (what a captured graph reads)."""
        return {"query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                "block_table": self.block_table, "slot_mapping": self.slot_mapping}

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> AttentionMetadata:
        """Copy the step into the buffers; see the class docstring.

        Raises:
            ValueError: as :meth:`AttentionMetadataBuilder.build`; with ``graph_batch_size``
                also for a step that is not uniform decode (one new token per request) or
                larger than it.
        """
        facts = self.check(common)
        n = common.num_seqs
        rows = common.slot_mapping.shape[0]
        if graph_batch_size is None:
            size, total = n, rows
        else:
            size = _positive("graph_batch_size", graph_batch_size)
            if size > self.max_num_seqs:
                raise ValueError(f"graph_batch_size={size} exceeds max_num_seqs="
                                 f"{self.max_num_seqs}")
            if not is_uniform_decode(common) or rows != n:
                raise ValueError(
                    f"graph_batch_size={size} needs a uniform-decode step (one new token per "
                    f"request, no padding rows); this step has {common.num_actual_tokens} "
                    f"tokens in {rows} rows for {n} requests (max_query_len="
                    f"{common.max_query_len}): run it eagerly")
            if n > size:
                raise ValueError(f"the step has {n} requests, more than "
                                 f"graph_batch_size={size}")
            total = size
        views = self._views.get((size, total))
        if views is None:  # the same view objects every step of this size (graph signatures)
            if len(self._views) >= 1024:
                self._views.clear()
            views = self._views[size, total] = (
                self.query_start_loc[:size + 1], self.seq_lens[:size], self.block_table[:size],
                self.slot_mapping[:total])
        qsl, seq_lens, table, slots = views
        if (facts is None and common.seq_lens_cpu is None
                and common.block_table.shape[1] > table.shape[1]):
            # Value checks off and no host lengths: the columns beyond the buffer cannot be
            # shown unused without a device read, and copying would cut them silently.
            raise ValueError(
                f"block_table has {common.block_table.shape[1]} columns but the builder's "
                f"buffer holds {table.shape[1]} (max_model_len={self.max_model_len}, "
                f"block_size={self.spec.block_size}); with value checks off the columns "
                "beyond cannot be checked unused, so they would be dropped. Make the block "
                "table at most that wide, pass seq_lens_cpu, or turn value checks on")
        width = min(common.block_table.shape[1], table.shape[1])
        padded = size > n
        self._copy_query_start_loc(common, qsl, n, graph_batch_size is not None)
        _copy_into(seq_lens[:n] if padded else seq_lens, common.seq_lens)
        if n:
            source, dest = common.block_table, table[:n] if padded else table
            dest = dest if dest.shape[1] == width else dest[:, :width]
            _copy_into(dest, source if source.shape[1] == width else source[:, :width])
        _copy_into(slots[:rows] if total > rows else slots, common.slot_mapping)
        if size > n:  # padding requests (uniform decode: token i is request i)
            seq_lens[n:].fill_(1)
            table[n:, :1].fill_(0)
            slots[rows:].fill_(-1)
        if graph_batch_size is None:
            max_query_len, max_seq_len = common.max_query_len, common.max_seq_len
        else:  # host values of the captured size, the same for every step replayed
            max_query_len, max_seq_len = 1, self.max_model_len
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            num_actual_tokens=common.num_actual_tokens + (size - n), causal=common.causal,
        )
        if facts is not None:
            # The views have the facts' shapes by construction: marked without re-checking.
            # Unpadded, they hold the step's own values: its facts, as they are.
            if padded:
                facts = StepFacts(num_tokens=meta.num_actual_tokens, num_seqs=size,
                                  block_size=facts.block_size,
                                  max_blocks_per_seq=max(facts.max_blocks_per_seq, 1),
                                  max_block_id=max(facts.max_block_id, 0),
                                  max_slot=facts.max_slot, sliding_window=facts.sliding_window)
            mark_views_checked(facts, views)
        return meta

    def _copy_query_start_loc(self, common: AttentionMetadata, qsl: torch.Tensor, n: int,
                              graph: bool) -> None:
        """``common.query_start_loc`` into ``qsl[:n + 1]`` and, for a graph step, the padding
        requests' entries ``n + 1, ..., size``; skipped for a graph step whose host copy
        (``query_start_loc_cpu``) is ``0, 1, ..., n`` when the buffer already holds that up to
        ``size`` (the buffer's version counter shows it has not been written since)."""
        size = qsl.shape[0] - 1
        buffer = self.query_start_loc
        upto, version = self._qsl_arange
        if buffer._version != version:
            upto = 0
        host = common.query_start_loc_cpu
        counting = (graph and host is not None and host.shape == (n + 1,)
                    and host.dtype == torch.int32 and torch.equal(host, self._arange_cpu[:n + 1]))
        if counting and upto > size:
            return
        if graph:
            _copy_into(qsl[:n + 1] if size > n else qsl, common.query_start_loc)
            if size > n:
                qsl[n + 1:].copy_(self._arange[n + 1:size + 1])
        else:
            _copy_into(qsl, common.query_start_loc)
        # Here the buffer held 0..k for some k <= size at most, so entries beyond size are
        # not known to count on.
        self._qsl_arange = (size + 1 if counting else 0, buffer._version)


def _copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)``, skipped when ``source`` is ``dest`` itself (an engine that
    wrote the step straight into the builder's buffers): a launch saved per tensor."""
    if (source.data_ptr() == dest.data_ptr() and source.shape == dest.shape
            and source.stride() == dest.stride() and source.dtype == dest.dtype
            and source.device == dest.device):
        return
    dest.copy_(source)


def _understated(max_seq_len: int, what: str) -> ValueError:
    return ValueError(f"max_seq_len={max_seq_len} understates the step: {what}. Pass the "
                      "longest request's length (cached plus new tokens): builders size "
                      "buffers and choose kernels from it")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes worth capturing up to ``max_num_seqs``: 1, 2, 4, the multiples of 8 below
    it, and ``max_num_seqs`` itself (a padded step wastes at most 7 requests' work)."""
    _positive("max_num_seqs", max_num_seqs)
    sizes = {1, 2, 4, *range(8, max_num_seqs, 8), max_num_seqs}
    return sorted(s for s in sizes if s <= max_num_seqs)
