"""Capture an engine's decode step in CUDA graphs, one per batch size, and replay it.

A decode step of a whole model launches a few kernels per layer; launched one by one from
Python, the host time between them can exceed the kernels' own time. :class:`CudaGraphRunner`
captures the step once per batch size and replays it, so a step costs one replay plus the
builder's copies of the step into its persistent buffers. It works with any backend whose
``CUDA_GRAPH_SUPPORT`` is not ``NEVER`` (its builder is a
:class:`kvcore.PersistentMetadataBuilder`)::

    builder = backend.get_builder_cls()(spec, num_heads=32, max_num_seqs=64,
                                        max_num_batched_tokens=2048, max_model_len=8192,
                                        device=device)
    runner = kvcore.CudaGraphRunner(builder, step_fn, num_blocks=caches.num_blocks)
    runner.capture({"token_ids": torch.zeros(1, dtype=torch.int64, device=device)})
    out = runner.run({"token_ids": ids}, common)   # replayed when common is uniform decode

An engine that writes each step's inputs into ``runner.input_buffers(n)`` (after capture) and
passes those views saves the runner's input copy, as one that writes the step's metadata into
``builder.buffers()`` saves the builder's.

``step_fn(inputs, attn_metadata)`` runs the model for one step: every input and the output
have one row per token. It must work on the device only (no host sync, no decision taken on
tensor values, no random numbers) and pass ``attn_metadata`` to every layer's ``forward``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping

import torch

from kvcore.builder import PersistentMetadataBuilder, graph_batch_sizes
from kvcore.metadata import AttentionMetadata, build_attention_metadata, is_uniform_decode
from kvcore.ops.validation import checked_step_facts, value_checks_enabled

__all__ = ["CudaGraphRunner", "StepFn"]

#: ``step_fn(inputs, attn_metadata) -> output``: one model step, rows = tokens.
StepFn = Callable[[dict[str, torch.Tensor], AttentionMetadata], torch.Tensor]


#: Host values a signature keeps as they are (no tensors inside).
_SCALARS = (int, float, bool, str, type(None))


def _tensors(value: object, found: list[torch.Tensor]) -> bool:
    """Append every tensor of a metadata value (dataclass fields, tuples, lists), in order, to
    ``found``; returns whether the value is immutable (tensors, host values, tuples and frozen
    dataclasses of such, objects that are neither dataclasses nor containers): while the
    object lives, it holds these very tensor objects."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return True
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (tuple, list)):
        fixed = isinstance(value, tuple)
        for v in value:
            fixed = _tensors(v, found) and fixed
        return fixed
    params = getattr(type(value), "__dataclass_params__", None)
    if params is None or isinstance(value, type):
        return True
    fixed = params.frozen
    for name in _field_names(type(value)):
        fixed = _tensors(getattr(value, name), found) and fixed
    return fixed


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names (looked up once per class: a replay reads them every step)."""
    return tuple(f.name for f in dataclasses.fields(cls))


class _Signatures:
    """What a captured graph depends on: the metadata's host values (its own fields that are
    ints, floats, bools, strings or ``None``) and every tensor's address, shape and strides
    (nested ones too: a plan's workspace).

    A builder returns the same objects step after step (its buffers' views, one plan object
    per choice), so the tensors of an immutable field value (a tuple, a frozen dataclass) are
    found once per object and kept with it (the signature still reads each tensor's address,
    shape and strides every step); mutable ones are walked every step.
    """

    _MAX_PARTS = 256

    def __init__(self) -> None:
        # id(value) -> (value, its tensors): the value is kept, so its id is not reused.
        self._parts: dict[int, tuple[object, tuple[torch.Tensor, ...]]] = {}

    def __call__(self, meta: AttentionMetadata) -> tuple:
        scalars: list[tuple[str, object]] = []
        tensors: list[torch.Tensor] = []
        for name in _field_names(type(meta)):
            value = getattr(meta, name)
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, _SCALARS):
                scalars.append((name, value))
            else:
                tensors.extend(self._part(value))
        return (*scalars, *((t.data_ptr(), t.shape, t.stride()) for t in tensors))

    def _part(self, value: object) -> tuple[torch.Tensor, ...] | list[torch.Tensor]:
        if not isinstance(value, (tuple, list)) and (
                isinstance(value, type) or not hasattr(type(value), "__dataclass_params__")):
            return ()  # neither a container nor a dataclass: no tensors to look for
        known = self._parts.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        found: list[torch.Tensor] = []
        if _tensors(value, found):
            if len(self._parts) >= self._MAX_PARTS:
                self._parts.clear()
            self._parts[id(value)] = (value, tuple(found))
        return found


def _is_buffer_view(name: str, t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``t`` is the buffer's leading rows as :meth:`CudaGraphRunner.input_buffers`
    gives them (same memory, dtype and strides); a tensor at the buffer's address in another
    layout is refused (copying it onto the buffer would read what it overwrites)."""
    if t.data_ptr() != buf.data_ptr() or t.device != buf.device:
        return False
    if t.dtype != buf.dtype or t.stride() != buf.stride():
        raise ValueError(
            f"inputs[{name!r}] starts at its captured buffer's address but as "
            f"{t.dtype} with strides {t.stride()}, not the buffer's {buf.dtype} with "
            f"{buf.stride()}: pass runner.input_buffers(n)[{name!r}] as it is, or a tensor "
            "of its own")
    return True


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    signature: tuple


class CudaGraphRunner:
    """Capture one uniform-decode step per batch size; replay it for later steps, padded.

    Args:
        builder: the backend's builder; it must keep persistent buffers
            (:class:`kvcore.PersistentMetadataBuilder`, i.e. the backend declares
            ``CUDA_GRAPH_SUPPORT`` other than ``NEVER``).
        step_fn: one step of the model (see the module docstring).
        num_blocks: blocks of the KV caches the step reads. A replay launches no op, so no op
            compares the step's ids with the cache: the runner does, from the step's checked
            facts (on the host), before every replay.
        batch_sizes: request counts to capture (default:
            :func:`kvcore.builder.graph_batch_sizes` of ``builder.max_num_seqs``); a step of
            ``n`` requests replays the smallest captured size ``>= n``, padded.

    Attributes:
        replayed_steps, eager_steps: how the steps given to :meth:`run` ran.
    """

    def __init__(self, builder: PersistentMetadataBuilder, step_fn: StepFn, *,
                 num_blocks: int, batch_sizes: Iterable[int] | None = None) -> None:
        if not isinstance(builder, PersistentMetadataBuilder):
            raise TypeError(
                f"builder is a {type(builder).__name__}, which keeps no persistent buffers: "
                "its backend declares CUDA_GRAPH_SUPPORT = NEVER, so run its steps eagerly")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer")
        sizes = sorted(set(graph_batch_sizes(builder.max_num_seqs) if batch_sizes is None
                           else batch_sizes))
        bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int)
               or not 1 <= s <= builder.max_num_seqs]
        if bad or not sizes:
            raise ValueError(f"batch_sizes={sizes} must be integers in 1..max_num_seqs="
                             f"{builder.max_num_seqs}")
        self.builder = builder
        self.step_fn = step_fn
        self.num_blocks = num_blocks
        self.batch_sizes = sizes
        self.replayed_steps = 0
        self.eager_steps = 0
        self._inputs: dict[str, torch.Tensor] = {}
        self._graphs: dict[int, _Graph] = {}
        self._signature = _Signatures()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture(self, example_inputs: Mapping[str, torch.Tensor]) -> None:
        """Capture the step for every batch size, largest first (they share one memory pool).

        ``example_inputs`` gives each input's name, dtype, device and per-token shape
        (``shape[1:]``); the runner keeps one zero-filled buffer per input with a row per
        request of the largest size (padding requests read these rows: zeros, then whatever
        an earlier step left, so they must be valid inputs of any value). Each size runs
        once eagerly first (kernel compilation) on a padding-only step, which writes nothing
        into the KV cache.
        """
        if self._graphs:
            raise RuntimeError("capture() was already called on this runner")
        if self.builder.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the builder's is "
                             f"{self.builder.device}")
        largest = self.batch_sizes[-1]
        for name, example in example_inputs.items():
            if not isinstance(example, torch.Tensor) or example.dim() < 1:
                raise ValueError(f"example_inputs[{name!r}] must be a tensor with a token dim "
                                 "first")
            self._inputs[name] = torch.zeros((largest, *example.shape[1:]), dtype=example.dtype,
                                             device=example.device)
        empty = build_attention_metadata([], [], [], self.builder.spec.block_size,
                                         device=self.builder.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            meta = self.builder.build(empty, graph_batch_size=size)
            if value_checks_enabled() and checked_step_facts(
                    meta.query_start_loc, meta.seq_lens, meta.block_table,
                    meta.slot_mapping) is None:
                # The ops would read the tensors back to check them: a sync, which a capture
                # cannot contain.
                raise ValueError(
                    f"{type(self.builder).__name__}.build(graph_batch_size={size}) returned "
                    "metadata tensors not marked with the step's facts, so every op would read "
                    "them back from the device, which a CUDA graph cannot capture: mark them "
                    "(kvcore.ops.mark_step_checked) as PersistentMetadataBuilder.build does")
            inputs = {name: buf[:size] for name, buf in self._inputs.items()}
            side = torch.cuda.Stream(self.builder.device)
            side.wait_stream(torch.cuda.current_stream(self.builder.device))
            with torch.cuda.stream(side):
                self.step_fn(inputs, meta)
            torch.cuda.current_stream(self.builder.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the engine (a connector's copies) may keep
            # using CUDA while this thread captures.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                output = self.step_fn(inputs, meta)
            if not isinstance(output, torch.Tensor) or output.shape[0] != size:
                raise ValueError(f"step_fn must return a tensor with one row per token "
                                 f"({size}), got {getattr(output, 'shape', type(output))}")
            self._graphs[size] = _Graph(graph, output, self._signature(meta))
        torch.cuda.synchronize(self.builder.device)

    def input_buffers(self, num_seqs: int) -> dict[str, torch.Tensor]:
        """Views of the captured input buffers for a step of ``num_seqs`` requests (their
        first ``num_seqs`` rows), by input name. An engine that writes a step's inputs there
        and passes these views to :meth:`run` saves the step's input copy (a launch: what
        a synchronous step exposes); other tensors are copied as always.

        Raises:
            RuntimeError: nothing was captured yet.
            ValueError: ``num_seqs`` is not in ``1..`` the largest captured size.
        """
        if not self._graphs:
            raise RuntimeError("input_buffers() needs capture() first: the buffers are made "
                               "there")
        largest = self.batch_sizes[-1]
        if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) \
                or not 1 <= num_seqs <= largest:
            raise ValueError(f"num_seqs={num_seqs!r} must be an integer in 1..{largest} (the "
                             "largest captured batch size)")
        return {name: buf[:num_seqs] for name, buf in self._inputs.items()}

    def replayable(self, common: AttentionMetadata) -> bool:
        """Whether a step like ``common`` replays once captured: uniform decode (one new token
        per request, no padding rows) of at most the largest batch size."""
        return (is_uniform_decode(common) and common.slot_mapping.shape[0] == common.num_seqs
                and common.num_seqs <= self.batch_sizes[-1])

    def graph_size(self, common: AttentionMetadata) -> int | None:
        """The captured size that replays ``common``, or ``None`` (run eagerly)."""
        if not self._graphs or not self.replayable(common):
            return None
        return next(s for s in self.batch_sizes if s >= common.num_seqs)

    def run(self, inputs: Mapping[str, torch.Tensor], common: AttentionMetadata
            ) -> torch.Tensor:
        """Run one step: replayed when a captured size fits (uniform decode, at most the
        largest size), else eagerly (``step_fn`` with ``builder.build(common)``).

        Returns the step's output rows for the real tokens. A replayed step's output is a view
        of the graph's output buffer, valid until that graph replays again: copy what you
        keep.
        """
        size = self.graph_size(common)
        if size is None:
            self.eager_steps += 1
            return self.step_fn(dict(inputs), self.builder.build(common))
        n = common.num_seqs
        if set(inputs) != set(self._inputs):
            raise ValueError(f"inputs has {sorted(inputs)} but the graphs were captured with "
                             f"{sorted(self._inputs)}")
        for name, t in inputs.items():
            buf = self._inputs[name]
            if t.shape[0] != n or t.shape[1:] != buf.shape[1:]:
                raise ValueError(f"inputs[{name!r}] has shape {tuple(t.shape)}; expected "
                                 f"{(n, *buf.shape[1:])} (one row per request)")
        meta = self.builder.build(common, graph_batch_size=size)
        facts = checked_step_facts(meta.query_start_loc, meta.seq_lens, meta.block_table,
                                   meta.slot_mapping)
        if facts is not None:
            block_size = self.builder.spec.block_size
            if facts.max_block_id >= self.num_blocks:
                raise ValueError(f"block_table refers to block id {facts.max_block_id}, but "
                                 f"the cache has {self.num_blocks} blocks (valid ids: "
                                 f"0..{self.num_blocks - 1})")
            if facts.max_slot >= self.num_blocks * block_size:
                raise ValueError(f"slot_mapping contains slot {facts.max_slot}, but the cache "
                                 f"holds only {self.num_blocks} blocks x {block_size} tokens")
        entry = self._graphs[size]
        if self._signature(meta) != entry.signature:
            raise RuntimeError(
                f"{type(self.builder).__name__}.build(graph_batch_size={size}) returned other "
                "tensors or host values than at capture: a replay would read stale memory "
                "(builders of graph-capable backends must reuse their buffers)")
        # One foreach copy for the inputs not already in the buffers (input_buffers' views:
        # nothing to move), each slow-pathed as copy_ if need be.
        moved = [(self._inputs[name], t) for name, t in inputs.items()
                 if not _is_buffer_view(name, t, self._inputs[name])]
        if moved:
            torch._foreach_copy_([buf[:n] for buf, _ in moved], [t for _, t in moved])
        entry.graph.replay()
        self.replayed_steps += 1
        return entry.output[:n]
