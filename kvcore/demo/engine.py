"""A minimal serving engine over kvcore, for ``kvcore demo``: what an engine does every step.

- A **block pool** hands out device block ids; a request owns a *block table* of them.
- **Continuous batching**: every step runs one new token of each running request (decode)
  plus the prompts of newly admitted requests (prefill), packed into one batch; a request
  that finishes leaves the batch and a waiting one takes its place in the next step.
- **Attention** goes through the selected backend: the backend's builder builds the step
  once (:func:`kvcore.build_attention_metadata`, then ``builder.build``), then per layer
  ``do_kv_cache_update`` writes the step's K/V and ``forward`` attends over the paged cache.
  On a GPU, with a backend that supports CUDA graphs, decode-only steps are replayed from
  graphs captured per batch size (:class:`kvcore.CudaGraphRunner`).
- **Prefix reuse through a KV connector**: a finished request saves its full blocks under
  content keys (:func:`kvcore.connectors.hash_request_tokens`); a new request whose prompt
  starts with saved blocks loads them instead of computing them.

Simplifications a real engine does not make: a request reserves the blocks of its whole
length when admitted (so nothing is ever preempted), prompts are never chunked, and loads are
waited for at admission instead of overlapping the next step.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvcore import (
    AttentionBackend,
    AttentionMetadata,
    CudaGraphRunner,
    CudaGraphSupport,
    FullAttentionSpec,
    KVCaches,
    KVCacheSpec,
    LayerScales,
    MLAAttentionSpec,
    build_attention_metadata,
    long_step,
)
from kvcore.connectors import (
    KVConnector,
    TPRank,
    TransferHandle,
    hash_request_tokens,
    heads_of_rank,
)
from kvcore.demo.config import DemoModelConfig
from kvcore.demo.model import DemoModel
from kvcore.demo.tp import ConnectorGroup

__all__ = ["BatchStats", "BlockPool", "Engine", "Request"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_cache_dir() -> str | None:
    """Where Triton keeps the kernels it compiled (``TRITON_CACHE_DIR`` moves it); ``None``
    without Triton."""
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return str(knobs.cache.dir)
    from triton.runtime.cache import default_cache_dir  # Triton before knobs

    return str(default_cache_dir())


def _rank_heads(c: DemoModelConfig, tp: int) -> list[tuple[slice, tuple[int, ...]]]:
    """Per tensor-parallel rank: the slice of the query heads it attends with and its KV
    heads (MLA: every rank holds the latent; only TP 1 is simulated)."""
    if tp == 1:
        return [(slice(0, c.num_heads), tuple(range(c.num_kv_heads)))]
    if c.is_mla:
        raise ValueError(f"{tp} caches (tensor-parallel ranks) for an MLA model: the demo "
                         "simulates tensor parallelism by K/V head slices; run MLA at TP 1")
    if c.num_heads % tp:
        raise ValueError(f"{tp} caches (tensor-parallel ranks) for {c.num_heads} query heads: "
                         "the degree must divide the query head count")
    per = c.num_heads // tp
    return [(slice(r * per, (r + 1) * per), heads_of_rank(c.num_kv_heads, TPRank(tp, r)))
            for r in range(tp)]


@dataclass
class Request:
    """One generation request and its state in the engine.

    ``num_computed`` tokens of :attr:`tokens` have their K/V in the cache (computed, or
    loaded through the connector); the others are fed in the next step.
    """

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: prompt must not be empty")
        if self.max_new_tokens <= 0:
            raise ValueError(f"request {self.request_id}: max_new_tokens="
                             f"{self.max_new_tokens} must be >= 1")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def max_len(self) -> int:
        """Tokens whose K/V this request will have written when it finishes (the last
        sampled token is never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1


class BlockPool:
    """The free device block ids, lowest first so a request's blocks tend to be consecutive
    (and a connector copies them as one run)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return sorted(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"block pool exhausted: {n} blocks wanted, {len(self._free)} of "
                               f"{self.num_blocks} free")
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def release(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)


@dataclass
class BatchStats:
    """What one :meth:`Engine.serve` call did.

    ``prefix_blocks_eligible`` counts the prompt blocks a cache hit could have replaced (full
    blocks, leaving at least one prompt token to compute for the first logits);
    ``prefix_blocks_hit`` those loaded through the connector.
    """

    requests: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    mixed_steps: int = 0
    graph_steps: int = 0
    max_running: int = 0
    prefix_blocks_eligible: int = 0
    prefix_blocks_hit: int = 0
    load_failures: int = 0
    saved_blocks: int = 0
    seconds: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_blocks_eligible:
            return 0.0
        return self.prefix_blocks_hit / self.prefix_blocks_eligible


class Engine:
    """Serve :class:`Request` s with a :class:`DemoModel` over a paged KV cache.

    Args:
        model: the model; its sizes must match ``kv_caches``.
        backend: the selected attention backend (one ``AttentionImpl`` per layer is built).
        kv_caches: from :func:`kvcore.allocate_kv_caches`, one layer per model layer; or one
            such cache per tensor-parallel rank (tensor parallelism simulated in one process,
            see :mod:`kvcore.demo.tp`): rank ``r``'s holds the KV heads
            :func:`kvcore.connectors.heads_of_rank` gives it, and attends with the query heads
            of its slice. :attr:`kv_caches` is then rank 0's, :attr:`rank_caches` all of them.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of a step (a prompt longer than the budget runs
            alone).
        connector: a KV connector with ``kv_caches`` registered, a
            :class:`~kvcore.demo.tp.ConnectorGroup` (the connectors of every rank's cache), or
            ``None`` (no reuse).
        key_salt: mixed into every block key (``extra`` of the key hash): the model's
            identity, so KV of another model or dtype never matches.
        on_loaded: called with the block ids of each successful load, before the blocks are
            read (``kvcore demo --corrupt-loaded-block`` uses it to damage one).
        on_step: called after every step with the number of tokens it generated.
        cuda_graphs: replay decode-only steps from CUDA graphs when the cache is on a CUDA
            device and the backend declares graph support (captured at the first such step).
    """

    def __init__(
        self,
        model: DemoModel,
        backend: type[AttentionBackend],
        kv_caches: KVCaches | Sequence[KVCaches],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        connector: KVConnector | ConnectorGroup | None = None,
        key_salt: str | None = None,
        on_loaded: Callable[[list[int]], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        c = model.config
        self.rank_caches = [kv_caches] if isinstance(kv_caches, KVCaches) else list(kv_caches)
        tp = len(self.rank_caches)
        self._heads = _rank_heads(c, tp)
        for r, kv in enumerate(self.rank_caches):
            name = "kv_caches" if tp == 1 else f"kv_caches[{r}]"
            if kv.num_layers != c.num_layers:
                raise ValueError(f"{name} has {kv.num_layers} layers but the model has "
                                 f"{c.num_layers}")
            layer_shape = kv.layout.layer_shape
            # Blocks-first: (blocks, 2, block_size, kv heads, head size); MLA (blocks,
            # block_size, latent).
            entry = ((c.cache_head_size,) if c.is_mla else
                     (len(self._heads[r][1]), c.head_size))
            if layer_shape[-len(entry):] != entry:
                raise ValueError(f"{name} layer shape {layer_shape} does not hold "
                                 f"{' x '.join(map(str, entry))} channels per token")
            if (kv.num_blocks, layer_shape[-len(entry) - 1]) != (
                    self.rank_caches[0].num_blocks, self.rank_caches[0].layout.layer_shape[
                        -len(entry) - 1]):
                raise ValueError(f"{name} has {kv.num_blocks} blocks of "
                                 f"{layer_shape[-len(entry) - 1]} tokens, rank 0's cache "
                                 f"{self.rank_caches[0].num_blocks}: every rank's cache has "
                                 "the same blocks")
        kv_caches = self.rank_caches[0]
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = kv_caches.layout.layer_shape[-len(entry) - 1]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.key_salt = key_salt
        self.on_loaded = on_loaded
        self.on_step = on_step
        impl_cls = backend.get_impl_cls()
        q_heads, kv_heads = c.num_heads // tp, len(self._heads[0][1])
        if c.is_mla:  # the MLA impl interface: model dims and the layer's kv_b_proj weight
            self.rank_impls = [[impl_cls(
                num_heads=c.num_heads, head_size=c.cache_head_size, scale=c.attn_scale,
                kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.head_size,
                qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                kv_b_proj_weight=w["kv_b_proj"]) for w in model.layers]]
        else:  # one impl per rank and layer, each over its rank's heads
            self.rank_impls = [[impl_cls(num_heads=q_heads, head_size=c.head_size,
                                         scale=c.head_size ** -0.5, num_kv_heads=kv_heads)
                                for _ in range(c.num_layers)] for _ in range(tp)]
        # The demo cache is unquantised: unit scales.
        self.scales = LayerScales()
        device = kv_caches.storage.device
        # A prompt longer than the token budget runs alone; no request outgrows the pool.
        max_model_len = kv_caches.num_blocks * self.block_size
        spec: KVCacheSpec = (
            MLAAttentionSpec(block_size=self.block_size, dtype=model.dtype,
                             kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim)
            if c.is_mla else
            FullAttentionSpec(block_size=self.block_size, dtype=model.dtype,
                              num_kv_heads=kv_heads, head_size=c.head_size))
        # One builder for every rank: ranks differ in heads, not in the step's metadata.
        self.builder = backend.get_builder_cls()(
            spec,
            num_heads=q_heads, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len, max_num_seqs),
            max_model_len=max_model_len, device=device)
        #: Seconds the builder's start-up preparation took, by part (JIT builds, say).
        self.warmup_seconds = self.builder.warmup()
        self.graphs: CudaGraphRunner | None = None
        if (cuda_graphs and device.type == "cuda"
                and backend.CUDA_GRAPH_SUPPORT is not CudaGraphSupport.NEVER):
            self.graphs = CudaGraphRunner(self.builder, self._graph_step,
                                          num_blocks=kv_caches.num_blocks)
        self.pool = BlockPool(kv_caches.num_blocks)
        self._pending_saves: list[tuple[TransferHandle, list[int]]] = []
        dtype = str(model.dtype).removeprefix("torch.")
        self._compiles = (f"{backend.get_name()}'s kernels ({dtype}, {q_heads} heads, head size "
                          f"{c.head_size}, block {self.block_size})")
        self._step_kinds_run: set[str] = set()  # the first of each kind may compile kernels

    # -- public -----------------------------------------------------------------------------

    def serve(self, requests: Sequence[Request]) -> BatchStats:
        """Run ``requests`` to completion with continuous batching; returns the statistics.

        Outputs are written into the requests. Blocks of finished requests are saved through
        the connector (if any) and returned to the pool once their save completed.
        """
        stats = BatchStats(requests=len(requests))
        for req in requests:
            need = _cdiv(req.max_len, self.block_size)
            if need > self.pool.num_blocks:
                raise ValueError(f"request {req.request_id} needs {need} blocks of "
                                 f"{self.block_size} tokens but the pool has "
                                 f"{self.pool.num_blocks}; raise num_blocks")
        started = time.perf_counter()
        waiting = deque(requests)
        running: list[Request] = []
        while waiting or running:
            decodes = list(running)
            prefills = self._admit(waiting, len(decodes), stats)
            batch = decodes + prefills
            if not batch:
                raise RuntimeError("no request could be scheduled although none is running "
                                   "(a bug in the demo engine's admission)")
            stats.graph_steps += self._step(batch)
            stats.steps += 1
            stats.mixed_steps += bool(decodes and prefills)
            stats.max_running = max(stats.max_running, len(batch))
            stats.generated_tokens += len(batch)
            running = []
            for req in batch:
                if req.finished:
                    stats.saved_blocks += self._finish(req)
                else:
                    running.append(req)
            if self.on_step is not None:
                self.on_step(len(batch))
        self.wait_for_saves()
        if self.kv_caches.storage.is_cuda:
            torch.cuda.synchronize(self.kv_caches.storage.device)
        stats.seconds = time.perf_counter() - started
        return stats

    def warm_up(self, requests: Sequence[Request]) -> float:
        """Serve copies of ``requests`` (same prompts and lengths) once, so that the first
        step of each kind (a prefill, a step mixing prefill and decode, decode steps, the
        CUDA-graph capture) has built its kernels before the real run; returns the seconds.

        An engine that must keep a deadline once it starts serving calls it first: the decode
        engine of ``kvcore demo --disaggregated``, whose producer holds the published blocks
        for ``timeout_s`` only, while a cold cache makes a first step build for a minute or
        more (FlashInfer's JIT modules). The copies run without the connector (nothing is
        looked up, loaded or saved) and without ``on_step``, later requests joining while
        earlier ones decode; their blocks go back to the pool, their tokens are dropped.
        """
        copies = [Request(f"warm-up:{r.request_id}", r.prompt, r.max_new_tokens)
                  for r in requests]
        if not copies:
            return 0.0
        saved = self.connector, self.on_step, self.max_num_batched_tokens
        # A budget of the longest prompt and a decode: prompts join steps in which earlier
        # requests decode (mixed steps), unless two fit in one step together.
        self.max_num_batched_tokens = max(len(r.prompt) for r in copies) + 1
        self.connector, self.on_step = None, None
        try:
            return self.serve(copies).seconds
        finally:
            self.connector, self.on_step, self.max_num_batched_tokens = saved

    def wait_for_saves(self) -> None:
        """Wait for every save in flight, then return its blocks to the pool."""
        for handle, blocks in self._pending_saves:
            handle.wait()
            self.pool.release(blocks)
        self._pending_saves.clear()

    def poison_free_blocks(self, generator: torch.Generator | None = None) -> list[int]:
        """Overwrite every free block with random K/V, as if other requests had reused them.

        After this, a request that reads a block it did not write or load gets wrong tokens,
        so the demo's checks prove that reused prefixes came back through the connector.
        Returns the ids overwritten.
        """
        self.wait_for_saves()
        ids = self.pool.free_ids()
        if ids:
            index = torch.tensor(ids, dtype=torch.int64, device=self.kv_caches.storage.device)
            for layer in (layer for kv in self.rank_caches for layer in kv.layers):
                noise = torch.randn((len(ids), *layer.shape[1:]), generator=generator)
                layer.index_copy_(0, index, noise.to(device=layer.device, dtype=layer.dtype))
        return ids

    # -- scheduling -------------------------------------------------------------------------

    def _keys(self, tokens: Sequence[int]) -> list[str]:
        return hash_request_tokens(list(tokens), self.block_size, self.key_salt)

    def _admit(self, waiting: deque[Request], num_decodes: int, stats: BatchStats
               ) -> list[Request]:
        """Move waiting requests into the batch while sequences, tokens and blocks allow."""
        admitted: list[Request] = []
        budget = self.max_num_batched_tokens - num_decodes
        self._reap_saves()
        while waiting and num_decodes + len(admitted) < self.max_num_seqs:
            req = waiting[0]
            need = _cdiv(req.max_len, self.block_size)
            if need > self.pool.num_free:
                self.wait_for_saves()  # blocks still held by saves in flight come back
                if need > self.pool.num_free:
                    break
            # At least one prompt token is computed: its logits give the first output token.
            # Keys name blocks of the connector's key block size (a producer's other block
            # size when the connector converts), loaded into this cache's blocks.
            key_bs = self.connector.key_block_size if self.connector else self.block_size
            eligible = (len(req.prompt) - 1) // key_bs
            keys = hash_request_tokens(req.prompt, key_bs, self.key_salt)[:eligible]
            hits = self.connector.lookup(keys) if (self.connector and keys) else 0
            to_compute = len(req.prompt) - hits * key_bs
            if to_compute > budget and (admitted or num_decodes):
                break
            waiting.popleft()
            req.block_ids = self.pool.allocate(need)
            if hits:
                wanted, hits = hits, self._load(req, keys[:hits])
                stats.load_failures += wanted - hits
            req.num_computed = hits * key_bs
            budget -= len(req.prompt) - req.num_computed
            stats.prompt_tokens += len(req.prompt)
            stats.computed_prompt_tokens += len(req.prompt) - req.num_computed
            stats.prefix_blocks_eligible += eligible
            stats.prefix_blocks_hit += hits
            admitted.append(req)
        return admitted

    def _load(self, req: Request, keys: list[str]) -> int:
        """Load ``keys`` into the request's first blocks; returns how many leading blocks
        arrived (a failed block and everything after it is recomputed instead)."""
        assert self.connector is not None
        targets = req.block_ids[:self.connector.blocks_for_keys(len(keys))]
        result = self.connector.load(keys, targets).wait()
        failed = next((i for i, block in enumerate(targets) if block in result.failed), None)
        if failed is None:
            loaded, whole = len(keys), len(targets)
        else:  # the keys whose tokens all lie before the first failed block
            loaded = failed * self.block_size // self.connector.key_block_size
            whole = loaded * self.connector.key_block_size // self.block_size
        if whole and self.on_loaded is not None:
            self.on_loaded(targets[:whole])
        return loaded

    def _finish(self, req: Request) -> int:
        """Save the request's full blocks (if a connector is set) and free its blocks; returns
        the number of blocks saved."""
        keys = self._keys(req.tokens[:req.num_computed]) if self.connector else []
        blocks = req.block_ids
        req.block_ids = []
        if not keys:
            self.pool.release(blocks)
            return 0
        handle = self.connector.save(keys, blocks[:len(keys)])
        # Blocks being saved stay out of the pool until the copy is done.
        self.pool.release(blocks[len(keys):])
        self._pending_saves.append((handle, blocks[:len(keys)]))
        return len(keys)

    def _reap_saves(self) -> None:
        still = []
        for handle, blocks in self._pending_saves:
            if handle.done():
                handle.wait()
                self.pool.release(blocks)
            else:
                still.append((handle, blocks))
        self._pending_saves = still

    # -- execution --------------------------------------------------------------------------

    def _step(self, batch: list[Request]) -> bool:
        """One forward pass over the batch's new tokens; appends one token to each request.
        Returns whether the step was replayed from a CUDA graph."""
        device = self.kv_caches.storage.device
        new_tokens = [req.tokens[req.num_computed:] for req in batch]
        ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64)
        positions = torch.tensor(
            [p for req, toks in zip(batch, new_tokens, strict=True)
             for p in range(req.num_computed, req.num_computed + len(toks))],
            dtype=torch.int64)
        meta = build_attention_metadata(
            query_lens=[len(t) for t in new_tokens],
            context_lens=[req.num_computed for req in batch],
            block_tables=[req.block_ids for req in batch],
            block_size=self.block_size,
            device=device,
        )
        ids, positions = ids.to(device), positions.to(device)
        replayed = self.graphs is not None and self.graphs.replayable(meta)
        kind = ("decode" if all(len(t) == 1 for t in new_tokens) else
                "prefill" if all(req.num_computed == 0 for req in batch) else "mixed")
        kind += " (CUDA-graph capture)" if replayed and not self.graphs.captured else ""
        with self._first_of_kind(kind):
            if replayed:
                if not self.graphs.captured:
                    self.graphs.capture({"ids": ids[:1], "positions": positions[:1]})
                logits = self.graphs.run({"ids": ids, "positions": positions}, meta)
            else:
                hidden = self.model.forward(ids, positions,
                                            self._attend(self.builder.build(meta)))
                last = meta.query_start_loc[1:].to(torch.int64) - 1
                logits = self.model.logits(hidden[last])
            next_tokens = logits.argmax(dim=-1).tolist()
        for req, toks, tok in zip(batch, new_tokens, next_tokens, strict=True):
            req.num_computed += len(toks)
            req.output.append(int(tok))
        return replayed

    def _first_of_kind(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """The first step of each kind (prefill, mixed, decode, the graph capture) compiles
        the kernels it launches unless a cache has them: it says so when it takes long."""
        if kind in self._step_kinds_run:
            return contextlib.nullcontext()
        self._step_kinds_run.add(kind)
        return long_step(f"compiling {self._compiles} for the first {kind} step",
                         estimate="seconds to a minute", cache=triton_cache_dir())

    def _graph_step(self, inputs: dict[str, torch.Tensor], meta: AttentionMetadata
                    ) -> torch.Tensor:
        """A decode step for :class:`~kvcore.CudaGraphRunner`: one token per request, so
        every row's logits are wanted."""
        hidden = self.model.forward(inputs["ids"], inputs["positions"], self._attend(meta))
        return self.model.logits(hidden)

    def _attend(self, meta: AttentionMetadata):
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            if len(self.rank_caches) == 1:
                cache = self.kv_caches.layers[layer]
                impl = self.rank_impls[0][layer]
                impl.do_kv_cache_update(self.scales, k, v, cache, meta.slot_mapping)
                return impl.forward(self.scales, q, k, v, cache, meta)
            out = []
            for kv, impls, (q_heads, kv_heads) in zip(self.rank_caches, self.rank_impls,
                                                      self._heads, strict=True):
                # The rank's KV heads are consecutive (one head when replicated).
                h = slice(kv_heads[0], kv_heads[-1] + 1)
                q_r, k_r, v_r = (q[:, q_heads].contiguous(), k[:, h].contiguous(),
                                 v[:, h].contiguous())
                cache, impl = kv.layers[layer], impls[layer]
                impl.do_kv_cache_update(self.scales, k_r, v_r, cache, meta.slot_mapping)
                out.append(impl.forward(self.scales, q_r, k_r, v_r, cache, meta))
            return torch.cat(out, dim=1)

        return attend
