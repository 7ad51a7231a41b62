"""The conformance checks of the engine step: the backend's builder against ``forward`` on
plain metadata, its persistent buffers, and CUDA-graph replay; each raises
:class:`ConformanceError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from kvcore.allocate import KVCaches
from kvcore.backend import AttentionBackend
from kvcore.builder import AttentionMetadataBuilder, PersistentMetadataBuilder
from kvcore.impl import AttentionImpl
from kvcore.metadata import AttentionMetadata, LayerScales, build_attention_metadata
from kvcore.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from kvcore.testing.batch import (
    NUM_HEADS,
    NUM_KV_HEADS,
    CaseConfig,
    MixedBatch,
    random_block_tables,
    random_like,
)
from kvcore.testing.runs import CaseRun, MLACaseRun, bits, case_run, shape_text

__all__ = [
    "check_builder",
    "check_builder_buffers",
    "check_cuda_graph_replay",
    "make_builder",
]


_BUILDER_MAX_SEQS = 8
_BUILDER_MAX_TOKENS = 128


def make_builder(run: CaseRun, max_model_len: int) -> AttentionMetadataBuilder:
    config = run.config
    spec: KVCacheSpec
    if isinstance(run, MLACaseRun):
        spec = MLAAttentionSpec(block_size=config.block_size, dtype=config.dtype,
                                kv_cache_dtype=config.kv_cache_dtype,
                                kv_lora_rank=run.dims.kv_lora_rank,
                                qk_rope_head_dim=run.dims.qk_rope_head_dim)
    else:
        spec = FullAttentionSpec(block_size=config.block_size, dtype=config.dtype,
                                 kv_cache_dtype=config.kv_cache_dtype,
                                 num_kv_heads=NUM_KV_HEADS, head_size=config.head_size)
    builder_cls = run.call("get_builder_cls()", run.backend.get_builder_cls)
    return run.call("constructing the builder", builder_cls, spec, num_heads=NUM_HEADS,
                    max_num_seqs=_BUILDER_MAX_SEQS, max_num_batched_tokens=_BUILDER_MAX_TOKENS,
                    max_model_len=max_model_len, device=run.device)


def _decode_batch(run: CaseRun, num_blocks: int, context_lens: list[int]) -> MixedBatch:
    """Decode requests with the given cached lengths over random distinct blocks of a cache
    of ``num_blocks``."""
    config, device = run.config, run.device
    bs = config.block_size
    tables = random_block_tables([c + 1 for c in context_lens], bs, num_blocks, run.gen)
    n = len(context_lens)
    meta = build_attention_metadata([1] * n, context_lens, tables, bs, device=device,
                                    causal=config.causal)
    query, key, value = run.tokens(n)
    return MixedBatch(
        query=query, key=key, value=value, metadata=meta, query_lens=[1] * n,
        context_lens=list(context_lens), block_tables=tables, kinds=["decode"] * n,
        num_blocks=num_blocks)


def _step_through(run: CaseRun, impl: AttentionImpl, scales: LayerScales, batch: MixedBatch,
                  layer: torch.Tensor, caches: KVCaches, meta: AttentionMetadata, what: str,
                  rule: str) -> torch.Tensor:
    """Write and attend ``batch`` with ``meta`` (a builder's); compare with the reference."""
    run.call("do_kv_cache_update", impl.do_kv_cache_update, scales, batch.key, batch.value,
             layer, meta.slot_mapping)
    ref = run.reference_forward(batch, layer, caches.layout, scales)
    n = batch.num_tokens
    rows = batch.query.shape[0]
    try:
        out = impl.forward(scales, batch.query, batch.key, batch.value, layer, meta,
                           output=random_like(run.output_shape(rows), run.config.dtype,
                                              run.device, run.gen))
    except Exception as exc:  # the same impl ran the plain metadata in the other checks
        raise run.fail(rule, f"forward with builder.build()'s metadata for {what} raised "
                             f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.shape[0] != rows:
        raise run.fail(rule, f"forward with the builder's metadata for {what} returned "
                             f"{shape_text(out)}")
    diff = run.output_diff(out[:n], ref, batch)
    if diff:
        raise run.fail(rule, f"forward with builder.build()'s metadata for {what}: {diff}")
    return out


def check_builder(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
                  seed: int) -> None:
    """Rule ``builder-reference``: one builder, three steps of different shapes (the mixed
    batch, three decodes, the mixed batch again), each through ``build()`` and ``forward``."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    bs = config.block_size
    caches, layer, scales, impl = run.setup_layer(batch.num_blocks)
    builder = make_builder(run, max_model_len=8 * bs)
    decode = _decode_batch(run, batch.num_blocks, [2 * bs + 2, bs - 3, 3])
    for what, step in (("the mixed batch", batch), ("a decode-only batch after it", decode),
                       ("the mixed batch again", batch)):
        meta = run.call("builder.build", builder.build, step.metadata)
        if not isinstance(meta, AttentionMetadata):
            raise run.fail("builder-reference", (
                f"builder.build() returned {type(meta).__name__} for {what}; it must return "
                "an AttentionMetadata (or a subclass) that every layer's forward accepts"))
        _step_through(run, impl, scales, step, layer, caches, meta, what, "builder-reference")


def _tensor_fields(value: object, prefix: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    found: dict[str, torch.Tensor] = {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            found.update(_tensor_fields(getattr(value, f.name), f"{prefix}.{f.name}"))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            found.update(_tensor_fields(v, f"{prefix}[{i}]"))
    return found


#: The graph checks' batch size and cache blocks.
_GRAPH_SIZE = 4
_GRAPH_NUM_BLOCKS = 12


def _graph_builder(run: CaseRun) -> PersistentMetadataBuilder:
    # A long max_model_len: split-KV backends then split graph steps whose requests are much
    # shorter, leaving some splits empty.
    builder = make_builder(run, max_model_len=64 * run.config.block_size)
    if not isinstance(builder, PersistentMetadataBuilder):
        raise run.fail("builder-persistent-buffers", (
            f"CUDA_GRAPH_SUPPORT = {run.backend.CUDA_GRAPH_SUPPORT.name} but get_builder_cls() "
            f"returns {type(builder).__name__}, which keeps no persistent buffers: subclass "
            "kvcore.PersistentMetadataBuilder, or declare CudaGraphSupport.NEVER"))
    return builder


def _graph_steps(run: CaseRun) -> Iterator[MixedBatch]:
    """The graph checks' two uniform-decode steps for one graph size, with other lengths and
    block tables (made one at a time, as the check consumes them)."""
    bs = run.config.block_size
    for context_lens in ([2 * bs + 2, bs - 3, 3], [5 * bs, 1]):
        yield _decode_batch(run, _GRAPH_NUM_BLOCKS, context_lens)


def check_builder_buffers(backend: type[AttentionBackend], config: CaseConfig,
                          device: torch.device, seed: int) -> None:
    """Rule ``builder-persistent-buffers``: two uniform-decode steps of different lengths and
    block tables built for one graph size give the same tensors (addresses, shapes, strides)
    and host values, and each, padded, gives the reference's rows."""
    run = case_run(backend, config, device, seed)
    builder = _graph_builder(run)
    caches, layer, scales, impl = run.setup_layer(_GRAPH_NUM_BLOCKS)
    size = _GRAPH_SIZE
    seen: list[tuple[dict[str, tuple], dict[str, object]]] = []
    for step in _graph_steps(run):
        meta = run.call(f"builder.build(common, graph_batch_size={size})", builder.build,
                        step.metadata, graph_batch_size=size)
        tensors = {name: (t.data_ptr(), tuple(t.shape), t.stride())
                   for name, t in _tensor_fields(meta, "metadata").items()}
        host = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)
                if not _tensor_fields(getattr(meta, f.name), "")}
        seen.append((tensors, host))
        padded = _pad_batch(step, size)
        _step_through(run, impl, scales, padded, layer, caches, meta,
                      f"a decode step of {len(step.context_lens)} requests padded to {size}",
                      "builder-persistent-buffers")
    (first, host1), (second, host2) = seen
    if first != second:
        moved = sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k))
        raise run.fail("builder-persistent-buffers", (
            f"two steps built for graph_batch_size={size} differ in {', '.join(moved)} "
            f"({[first.get(k) for k in moved]} vs {[second.get(k) for k in moved]}, as "
            "(address, shape, strides)): a captured graph would read stale memory"))
    if host1 != host2:
        moved = sorted(k for k in host1 if host1[k] != host2.get(k))
        raise run.fail("builder-persistent-buffers", (
            f"two steps built for graph_batch_size={size} differ in the host values "
            f"{', '.join(f'{k}={host1[k]!r} vs {host2.get(k)!r}' for k in moved)}: what a "
            "forward reads on the host is frozen into a captured graph"))


def _pad_batch(step: MixedBatch, size: int) -> MixedBatch:
    """``step`` with zero input rows up to ``size`` (the padding requests' rows); its metadata
    stays the real step's, so the reference and the comparison cover the real rows."""
    n = step.query.shape[0]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.zeros((size - n, *t.shape[1:]), dtype=t.dtype,
                                         device=t.device)])

    return MixedBatch(pad(step.query), pad(step.key), pad(step.value), step.metadata,
                      step.query_lens, step.context_lens, step.block_tables, step.kinds,
                      step.num_blocks)


def check_cuda_graph_replay(backend: type[AttentionBackend], config: CaseConfig,
                            device: torch.device, seed: int) -> None:
    """Rule ``cuda-graph-replay`` (a GPU): a layer's write + forward captured once for 4
    requests, replayed for two later steps with other lengths and block tables, equals the
    same step run eagerly (bit for bit) and the reference."""
    from kvcore.cuda_graphs import CudaGraphRunner

    run = case_run(backend, config, device, seed)
    builder = _graph_builder(run)
    caches, layer, scales, impl = run.setup_layer(_GRAPH_NUM_BLOCKS)
    size = _GRAPH_SIZE

    def step_fn(inputs: dict[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        impl.do_kv_cache_update(scales, inputs["key"], inputs["value"], layer,
                                meta.slot_mapping)
        out = inputs["query"].new_empty(run.output_shape(inputs["query"].shape[0]))
        return impl.forward(scales, inputs["query"], inputs["key"], inputs["value"], layer,
                            meta, output=out)

    runner = CudaGraphRunner(builder, step_fn, num_blocks=_GRAPH_NUM_BLOCKS,
                             batch_sizes=[size])
    examples = dict(zip(("query", "key", "value"), (t.zero_() for t in run.tokens(1)),
                        strict=True))
    run.call("capturing a decode step (CudaGraphRunner.capture)", runner.capture, examples)
    for step in _graph_steps(run):
        inputs = {"query": step.query, "key": step.key, "value": step.value}
        replayed = run.call("a replay (CudaGraphRunner.run)", runner.run, inputs,
                            step.metadata).clone()
        if runner.replayed_steps == 0:
            raise run.fail("cuda-graph-replay", "CudaGraphRunner.run did not replay a "
                                                "uniform-decode step of a captured size")
        # The same step eagerly, on the same padded metadata (the write is idempotent).
        meta = builder.build(step.metadata, graph_batch_size=size)
        padded = _pad_batch(step, size)
        n = len(step.context_lens)
        eager = _step_through(run, impl, scales, padded, layer, caches, meta,
                              f"{n} decode requests padded to {size}", "cuda-graph-replay")
        if not torch.equal(bits(replayed), bits(eager[:n])):
            worst = (replayed.double() - eager[:n].double()).abs().max().item()
            raise run.fail("cuda-graph-replay", (
                f"the step replayed from a CUDA graph captured for {size} requests differs "
                f"from the same step run eagerly (max difference {worst:.3g}) after the "
                f"builder was rebuilt for {step.describe()}: forward reads something the "
                "builder does not update in place, or decides on the host"))
