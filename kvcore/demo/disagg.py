"""Disaggregated prefill/decode with the demo engine: KV moves between processes through NIXL
or Mooncake's transfer engine (``transport``: the ``nixl`` or ``mooncake`` connector).

Two engines, two processes, one model (same weights from the same seed):

1. The **prefill** process (a child) serves every request for one token. Each finished
   request publishes its full prompt blocks through the ``transport`` connector
   (``role="producer"``), which pins them until the decode engine has read them.
2. The **decode** process (the caller) connects to it (``role="consumer"``), overwrites its
   free blocks with noise (so only KV that really arrives can be right), and serves the same
   requests to their full length: at admission each request finds its prompt blocks with
   ``lookup`` and READs them straight from the prefill engine's cache with ``load``; only the
   prompt's last, partial block is computed again (the demo engine computes at least one
   prompt token to get the first token's logits).
   Both engines first run their own steps once (:meth:`~kvcore.demo.engine.Engine.warm_up`:
   the same prompts, nothing published or loaded), and the prefill engine publishes only once
   the decode engine is ready: a published block is held for ``timeout_s`` from its save, and
   a first step that builds kernels (FlashInfer's JIT modules on a cold cache: minutes) then
   costs time, not the blocks. Blocks released unread still fail the run, the result naming
   the cause and the fix (``cause``: raise ``timeout_s``, ``--timeout-s``).
3. **Check**: every token, the prefill engine's first token included, equals a one-process
   run of the *same steps* (one engine prefills the prompts for one token, computing all of
   them as the producer's engine does; a second engine on poisoned blocks loads each request's
   own copies of its blocks, as the consumer does, and decodes), and
   every eligible block was loaded rather than recomputed. The computation is then the same
   batch by batch, so any difference is the transfer's fault, in every dtype.
   The tokens are also compared with one engine alone (no connector, everything computed,
   the prompts batched differently): in ``float32`` they must match too; in ``bfloat16`` or
   ``float16`` a differently batched computation may round differently and flip a near tie,
   so there a difference is reported, not counted as a failure.

**Tensor parallelism** (``prefill_tp``, ``decode_tp``) is simulated in each process by head
slices (:mod:`kvcore.demo.tp`): an engine of degree ``T`` keeps one cache per rank, holding
that rank's KV heads, and attends each rank's query heads over its own cache. Each prefill
rank publishes through its own producer (``tp=(P, r)``), waiting for the decode ranks that
read its heads (``readers``, :func:`kvcore.connectors.reader_ranks`); each decode rank reads
through one consumer per prefill rank that holds its heads
(:func:`kvcore.connectors.source_ranks`), every consumer writing its heads into the rank's
blocks. Two layouts or tensor parallelism change the arithmetic (other kernels, other
batching of heads), so one engine alone at TP 1 is then the reference, in ``float32``.

Run it with ``kvcore demo --disaggregated`` (the demo's options apply). On a GPU both
processes use the platform's first device and their caches are VRAM regions, unless
``prefill_device`` and ``decode_device`` (``--prefill-device cuda:0 --decode-device cuda:1``)
put the two engines on two devices of the platform; the one-process references then run on
the decode engine's device.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvcore import (
    AttentionSelectorConfig,
    allocate_kv_caches,
    current_platform,
    format_supported,
    get_attn_backend,
    get_platform,
    parse_dtype,
    resolve_backend,
)
from kvcore.connectors import (
    KVConnector,
    RegisteredCaches,
    TPRank,
    TransferHandle,
    get_connector,
    get_connector_class,
    heads_of_rank,
    reader_ranks,
    source_ranks,
)
from kvcore.demo.config import MODEL_PRESETS
from kvcore.demo.engine import BatchStats, Engine, Request
from kvcore.demo.model import DemoModel
from kvcore.demo.scenario import DEMO_DTYPES
from kvcore.demo.tp import ConnectorGroup

__all__ = ["TRANSPORTS", "DisaggOptions", "DisaggResult", "default_dtype", "format_result",
           "run_disaggregated"]

#: The connectors the KV can move through (both pull blocks from the prefill engine's cache).
TRANSPORTS = ("nixl", "mooncake")

#: Allowance for the prefill process to start (Python, torch, the transfer library) on top
#: of ``timeout_s``.
_STARTUP_S = 60.0

#: Allowance for the prefill engine to build its kernels before it publishes (its first steps
#: run once ahead, see :meth:`Engine.warm_up`): a cold cache of FlashInfer's JIT modules takes
#: minutes.
_BUILD_S = 1800.0


@dataclass
class DisaggOptions:
    """Options of :func:`run_disaggregated`."""

    model: str = "tiny"
    batch: int = 4
    max_new_tokens: int = 8
    max_num_seqs: int = 4
    block_size: int = 16
    dtype: str = "float32"
    platform: str | None = None
    backend: str | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    #: Seconds the prefill engine holds its published blocks for the decode engine (the
    #: producers' ``publish_timeout_s``; the clock starts once both engines have built their
    #: kernels), and the bound of the two processes' waits for each other.
    timeout_s: float = 60.0
    #: The prefill engine's device, e.g. ``"cuda:0"`` (default: the platform's first device).
    prefill_device: str | None = None
    #: The decode engine's device, e.g. ``"cuda:1"`` (default: the platform's first device).
    decode_device: str | None = None
    #: The connector the KV moves through, one of :data:`TRANSPORTS`.
    transport: str = "nixl"
    #: The prefill engine's backend (default: ``backend``, the decode engine's).
    prefill_backend: str | None = None
    #: The prefill engine's block size (default: ``block_size``, the decode engine's); one of
    #: the two must divide the other.
    prefill_block_size: int | None = None
    #: The prefill engine's tensor-parallel degree (ranks simulated by head slices).
    prefill_tp: int = 1
    #: The decode engine's tensor-parallel degree (ranks simulated by head slices).
    decode_tp: int = 1

    @property
    def converting(self) -> bool:
        """Whether the two engines may differ in layout or run tensor-parallel (then the
        decode engine's connectors convert the prefill engine's blocks on load, and one
        engine alone is the reference)."""
        return (self.prefill_backend not in (None, self.backend)
                or self.prefill_block_size not in (None, self.block_size)
                or (self.prefill_tp, self.decode_tp) != (1, 1))

    def tp(self, role: str) -> int:
        """The tensor-parallel degree of the ``prefill`` or ``decode`` engine."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def side(self, role: str) -> tuple[str | None, int]:
        """``(backend, block_size)`` of the ``prefill`` or ``decode`` engine."""
        if role == "prefill":
            return (self.prefill_backend or self.backend,
                    self.prefill_block_size or self.block_size)
        return self.backend, self.block_size

    def validate(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} (choose from: "
                             f"{', '.join(TRANSPORTS)})")
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model={self.model!r} (choose from: {', '.join(MODEL_PRESETS)})")
        for name in ("batch", "max_new_tokens", "max_num_seqs", "block_size",
                     "prefill_block_size", "prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if value is None and name == "prefill_block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        bs_p, bs_d = self.side("prefill")[1], self.block_size
        if bs_p % bs_d and bs_d % bs_p:
            raise ValueError(f"prefill_block_size={bs_p} and block_size={bs_d}: one must divide "
                             "the other (the decode engine's connector converts between them)")
        preset = MODEL_PRESETS[self.model]
        for name in ("prefill_tp", "decode_tp"):
            tp = getattr(self, name)
            if tp > 1 and preset.is_mla:
                raise ValueError(f"{name}={tp} with model={self.model!r}: the demo simulates "
                                 "tensor parallelism by K/V head slices, and an MLA model "
                                 "has one latent; run it at TP 1")
            if preset.num_heads % tp:
                raise ValueError(f"{name}={tp} does not divide model {self.model!r}'s "
                                 f"{preset.num_heads} query heads; choose a divisor")
            try:
                heads_of_rank(preset.num_kv_heads, TPRank(tp, 0))
            except ValueError as exc:
                raise ValueError(f"{name}={tp} with model {self.model!r}: {exc}") from None
        parse_dtype(self.dtype)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a finite number of seconds "
                             "> 0 (kvcore demo's --timeout-s), e.g. 60")


def default_dtype(backend: str | None, prefill_backend: str | None) -> str:
    """The dtype the demo runs in without ``--dtype``: the first of
    :data:`~kvcore.demo.scenario.DEMO_DTYPES` (float32 first: bit-exact against one engine)
    that both engines' named backends declare;
    float32 where neither engine names one (the platform selects a backend for it).

    Raises:
        ValueError: the named backends share none of the three (a message naming each
            one's dtypes).
    """
    named = [n for n in dict.fromkeys((backend, prefill_backend)) if n]
    declared = {n: resolve_backend(n).SUPPORTED_DTYPES for n in named}
    for dtype in DEMO_DTYPES:
        if all(parse_dtype(dtype) in dtypes for dtypes in declared.values()):
            return dtype
    raise ValueError(f"the two engines' backends share no dtype the demo runs in "
                     f"({', '.join(DEMO_DTYPES)}): " + "; ".join(
                         f"{n} supports {format_supported(ds)}" for n, ds in declared.items())
                     + "; choose other backends")


@dataclass
class DisaggResult:
    """What the run did and whether its checks passed."""

    backend: str
    device: str
    layout: str
    requests: int
    generated_tokens: int
    blocks_eligible: int
    blocks_loaded: int
    loaded_bytes: int
    load_seconds: float
    seconds: float
    mismatches: list[str] = field(default_factory=list)
    #: The prefill engine's device (``device`` is the decode engine's).
    prefill_device: str = ""
    #: The connector the KV came through.
    transport: str = "nixl"
    #: Differences that are no failure (one engine alone in a low-precision dtype).
    notes: list[str] = field(default_factory=list)
    #: The prefill engine's backend, and its layout when it differs from the decode engine's.
    prefill_backend: str = ""
    prefill_layout: str = ""
    #: The two engines' tensor-parallel degrees (``layout`` and ``prefill_layout`` are
    #: rank 0's).
    prefill_tp: int = 1
    decode_tp: int = 1
    #: Why blocks did not come through, with the fix, where the run knows it (published
    #: blocks released unread after ``timeout_s``); empty otherwise.
    cause: str = ""
    #: Whether the decode engine's consumers gathered the prefill engine's blocks in place
    #: from its mapped cache (layouts differ, one GPU) rather than READing them.
    in_place: bool = False

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _requests(options: DisaggOptions, vocab: int) -> list[Request]:
    """Prompts on two shared system prompts; no prompt ends on a block boundary of the
    prefill engine (its last full block would be published, but the decode engine computes
    the last prompt token itself, so nobody would read it and the producer would hold it
    until its timeout)."""
    rng = random.Random(options.seed)
    bs = options.side("prefill")[1]
    system = [[rng.randrange(vocab) for _ in range(2 * bs)] for _ in range(2)]
    requests = []
    for i in range(options.batch):
        n = rng.randint(bs // 2 + 1, 2 * bs)
        if (len(system[i % 2]) + n) % bs == 0:
            n += 1
        user = [rng.randrange(vocab) for _ in range(n)]
        requests.append(Request(f"r{i}", system[i % 2] + user, options.max_new_tokens))
    return requests


def _device(platform: Any, name: str, value: str | None) -> torch.device:
    """The device option ``name`` (``value``, or the platform's first device when None),
    checked against the platform."""
    if value is None:
        return platform.device()
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}={value!r} is not a device name (e.g. "
                         f"{platform.device()}): {exc}") from None
    if device.type != platform.device().type:
        raise ValueError(f"{name}={value!r} is not a device of platform {platform.name}, whose "
                         f"devices are {platform.device().type}[:N]; pass e.g. "
                         f"{platform.device()}")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        device = torch.device("cuda", 0 if device.index is None else device.index)
        if device.index >= count:
            raise ValueError(f"{name}={value!r}: this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1})")
    return device


class _Setup:
    """What both engines share: backend, model, cache sizes (same on both sides), on the
    device of ``role`` (``prefill`` or ``decode``)."""

    def __init__(self, options: DisaggOptions, role: str = "decode") -> None:
        platform = get_platform(options.platform) if options.platform else current_platform()
        self.prefill_device = _device(platform, "prefill_device", options.prefill_device)
        self.decode_device = _device(platform, "decode_device", options.decode_device)
        self.device = self.prefill_device if role == "prefill" else self.decode_device
        self.tp = options.tp(role)
        self.dtype = parse_dtype(options.dtype)
        self.preset = MODEL_PRESETS[options.model]
        backend, self.block_size = options.side(role)
        config = AttentionSelectorConfig(head_size=self.preset.head_size, dtype=self.dtype,
                                         block_size=self.block_size, use_kv_connector=True)
        self.backend = get_attn_backend(config, backend, platform)
        self.cross_layer = get_connector_class(options.transport).cross_layer_for(
            self.backend, platform.name)
        self.requests = _requests(options, self.preset.vocab_size)
        longest = max(len(r.prompt) for r in self.requests) + options.max_new_tokens
        # Every request's blocks at once: the prefill engine holds them until they are read.
        self.num_blocks = len(self.requests) * -(-longest // self.block_size) + 1
        self.model = DemoModel(self.preset, seed=options.seed, dtype=self.dtype,
                               device=self.device)
        self.options = options

    def caches(self, num_kv_heads: int | None = None) -> Any:
        """A cache of every KV head (TP 1), or of ``num_kv_heads``."""
        return allocate_kv_caches(
            self.backend, num_layers=self.preset.num_layers, num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads or self.preset.num_kv_heads,
            head_size=self.preset.head_size, dtype=self.dtype, device=self.device,
            cross_layer=self.cross_layer)

    def rank_caches(self) -> list[Any]:
        """One cache per tensor-parallel rank, each of its rank's KV heads."""
        heads = self.preset.num_kv_heads
        return [self.caches(len(heads_of_rank(heads, TPRank(self.tp, r))))
                for r in range(self.tp)]

    def engine(self, connector: Any, *, on_step: Any = None, kv: Any = None) -> Engine:
        """An engine on new caches (registered with ``connector``), or on ``kv`` (already
        registered)."""
        if kv is None:
            kv = self.caches()
            if connector is not None:
                connector.register_kv_caches(kv)
        return Engine(self.model, self.backend, kv, max_num_seqs=self.options.max_num_seqs,
                      max_num_batched_tokens=4096, connector=connector,
                      key_salt=f"kvcore-disagg:{self.options.model}:{self.options.seed}",
                      on_step=on_step)


def _prefill_main(options: DisaggOptions, pipe: Any) -> None:
    """The prefill process: build its engine's kernels, wait until the decode engine is ready
    to read, publish every request's prompt blocks, report the first tokens, and stay until
    the decode engine has read them (or ``timeout_s`` releases them)."""
    try:
        torch.set_num_threads(1)
        setup = _Setup(options, "prefill")
        if setup.device.type == "cuda":  # this process's GPU is its current device
            torch.cuda.set_device(setup.device)
        requests = [Request(r.request_id, r.prompt, 1) for r in setup.requests]
        heads = setup.preset.num_kv_heads
        with contextlib.ExitStack() as stack:
            kv = setup.rank_caches()
            ports: list[int | None] = []
            producers = []
            for r in range(setup.tp):
                # The decode ranks that read this rank's heads; a rank nobody reads (its
                # replicated head is read from a lower rank) publishes nothing.
                readers = len(reader_ranks(heads, TPRank(setup.tp, r), options.decode_tp))
                if not readers:
                    ports.append(None)
                    continue
                producer = stack.enter_context(get_connector(
                    options.transport, role="producer", host=options.host, port=0,
                    publish_timeout_s=options.timeout_s, tp=(setup.tp, r),
                    num_kv_heads=heads, readers=readers))
                producer.register_kv_caches(kv[r])
                producers.append(producer)
                ports.append(producer.port)
            sent = []

            def on_step(_tokens: int) -> None:
                # Called after a step's finished requests published their blocks.
                if not sent and all(r.finished for r in requests):
                    pipe.send(("published", [r.output[0] for r in requests]))
                    sent.append(True)

            pipe.send(("port", ports))
            engine = setup.engine(ConnectorGroup(producers), on_step=on_step,
                                  kv=kv[0] if setup.tp == 1 else kv)
            # Kernels build now, not while published blocks wait (nothing is published).
            engine.warm_up(requests)
            # A published block is held for timeout_s from its save: publish only once the
            # decode engine has built its kernels too and reads at once.
            try:
                kind, _ = pipe.recv()
            except EOFError:
                return  # the decode process ended before it was ready; it says why
            if kind != "publish":
                raise RuntimeError(f"the decode process sent {kind!r}, expected 'publish'")
            engine.serve(requests)  # returns once every published block was read
            pipe.send(("done", [p.stats.to_dict() for p in producers]))
    except BaseException as exc:
        with contextlib.suppress(OSError):  # the decode process may have gone already
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _receive(pipe: Any, proc: Any, what: str, wait_s: float) -> Any:
    """The payload of the prefill process's next message, which must be ``what``."""
    if not pipe.poll(wait_s):
        raise TimeoutError(f"the prefill process sent no {what!r} message within {wait_s:g} s "
                           f"(alive: {proc.is_alive()}); --timeout-s raises the bound")
    try:
        kind, payload = pipe.recv()
    except EOFError:
        proc.join(5.0)
        raise RuntimeError(f"the prefill process ended (exit code {proc.exitcode}) before it "
                           f"sent {what!r}; its error is printed above") from None
    if kind == "error":
        raise RuntimeError(f"the prefill process failed: {payload}")
    if kind != what:
        raise RuntimeError(f"the prefill process sent {kind!r}, expected {what!r}")
    return payload


def run_disaggregated(options: DisaggOptions) -> DisaggResult:
    """Prefill in a child process, decode here, KV through ``options.transport``; see the
    module doc."""
    options.validate()
    started = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads cost more than they give on a busy CPU
    try:
        setup = _Setup(options)
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_prefill_main, args=(options, theirs), daemon=True,
                           name="kvcore-disagg-prefill")
        proc.start()
        theirs.close()  # the child's end: once the child ends, a read here sees EOF
        try:
            with (torch.cuda.device(setup.device) if setup.device.type == "cuda"
                  else contextlib.nullcontext()):
                result = _decode(setup, ours, proc, started)
        finally:
            ours.close()  # a prefill process still waiting for "publish" ends
            proc.join(options.timeout_s + _STARTUP_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
    finally:
        torch.set_num_threads(before)
    return result


def _decode(setup: _Setup, pipe: Any, proc: Any, started: float) -> DisaggResult:
    options = setup.options
    prefill = _Setup(options, "prefill") if options.converting else setup
    # The prefill process also starts Python, imports torch and the library, runs the prompts.
    wait_s = options.timeout_s + _STARTUP_S
    ports = _receive(pipe, proc, "port", wait_s)
    decode_reqs = [Request(r.request_id, r.prompt, r.max_new_tokens) for r in setup.requests]
    heads = setup.preset.num_kv_heads
    with contextlib.ExitStack() as stack:
        kv = setup.rank_caches()
        consumers = []
        for d in range(setup.tp):
            # One consumer per prefill rank holding some of this rank's heads.
            for src in source_ranks(heads, TPRank(setup.tp, d), options.prefill_tp):
                consumer = stack.enter_context(get_connector(
                    options.transport, role="consumer", host=options.host, port=ports[src],
                    timeout_s=min(10.0, options.timeout_s),
                    connect_timeout_s=options.timeout_s, tp=(setup.tp, d), num_kv_heads=heads))
                consumer.register_kv_caches(kv[d])
                consumers.append(consumer)
        group = ConnectorGroup(consumers)
        engine = setup.engine(group, kv=kv[0] if setup.tp == 1 else kv)
        # The producers hold each published block for timeout_s only: build this engine's
        # kernels (its first steps, the same shapes) before the prefill engine publishes.
        engine.warm_up(decode_reqs)
        engine.poison_free_blocks(torch.Generator().manual_seed(options.seed + 1))
        try:
            pipe.send(("publish", None))
        except OSError:  # the prefill process ended meanwhile; its last message says why
            _receive(pipe, proc, "published", 0.0)
            raise
        # The prefill engine may still be building its own kernels.
        first_tokens = _receive(pipe, proc, "published", _BUILD_S + wait_s)
        published = time.perf_counter()
        stats = engine.serve(decode_reqs)
        served_s = time.perf_counter() - published
        producer_stats = _receive(pipe, proc, "done", wait_s)
        loaded_bytes, load_seconds = group.loaded()
    # One engine alone at TP 1, computing everything (batched differently).
    single = [Request(r.request_id, r.prompt, r.max_new_tokens) for r in setup.requests]
    setup.engine(None).serve(single)
    if options.converting:
        # Two layouts (backends, block sizes) or tensor parallelism: no one-process run
        # repeats both engines' arithmetic, so one engine alone is the reference.
        same_first, same_steps = [r.output[0] for r in single], single
        same_stats = stats
    else:
        same_first, same_steps, same_stats = _same_steps_reference(setup)
    mismatches, notes = [], []
    exact_single = setup.dtype == torch.float32
    for d, ref, s, first, ref_first in zip(decode_reqs, same_steps, single, first_tokens,
                                           same_first, strict=True):
        strict = exact_single or not options.converting
        where = "one engine alone" if options.converting else "the same steps in one process"
        if d.output != ref.output and strict:
            mismatches.append(f"MISMATCH {d.request_id}: disaggregated {d.output} vs {where} "
                              f"{ref.output}")
        if first != ref_first and strict:
            mismatches.append(f"MISMATCH {d.request_id}: the prefill engine's first token "
                              f"{first} vs {where} {ref_first}")
        if d.output != s.output and not (options.converting and exact_single):
            (mismatches if exact_single else notes).append(
                f"{'MISMATCH' if exact_single else 'note'} {d.request_id}: disaggregated "
                f"{d.output} vs one engine alone {s.output}" +
                ("" if exact_single else f" ({options.dtype}: the prefill engine batches the "
                 "prompts differently and may round differently at near ties)"))
    if same_stats.prefix_blocks_hit != stats.prefix_blocks_hit:
        mismatches.append(f"the one-process reference loaded {same_stats.prefix_blocks_hit} "
                          f"prompt blocks, the disaggregated run {stats.prefix_blocks_hit}: "
                          "they did not run the same steps")
    cause = ""
    if stats.prefix_blocks_hit != stats.prefix_blocks_eligible:
        mismatches.append(f"only {stats.prefix_blocks_hit} of {stats.prefix_blocks_eligible} "
                          f"prompt blocks came through {options.transport} "
                          f"({stats.load_failures} failed)")
        # A producer's save fails only when its blocks are released unread.
        released = sum(s["failed_blocks"] for s in producer_stats)
        if released:
            cause = (f"the prefill engine released {released} published blocks unread after "
                     f"timeout_s={options.timeout_s:g} s, while the decode engine took "
                     f"{served_s:.1f} s from their publication to the end of its run; raise "
                     "--timeout-s above that")
    return DisaggResult(
        backend=setup.backend.get_name(), device=str(setup.device),
        prefill_backend=prefill.backend.get_name(),
        prefill_layout=str(prefill.rank_caches()[0].layout) if options.converting else "",
        prefill_tp=options.prefill_tp, decode_tp=options.decode_tp,
        transport=options.transport, layout=str(engine.kv_caches.layout),
        requests=len(decode_reqs),
        generated_tokens=sum(len(r.output) for r in decode_reqs),
        blocks_eligible=stats.prefix_blocks_eligible, blocks_loaded=stats.prefix_blocks_hit,
        loaded_bytes=loaded_bytes, load_seconds=load_seconds,
        seconds=time.perf_counter() - started, mismatches=mismatches, notes=notes,
        prefill_device=str(setup.prefill_device), cause=cause,
        in_place=all(getattr(c, "converts_in_place", False) for c in consumers))


class _Handover(KVConnector):
    """The pull connectors' producer/consumer semantics in one process, copies in host memory.

    The one-process reference must repeat exactly what the two engines compute, and the
    ``offload`` connector does not: its lookups also serve the prefill engine (a later prompt
    would load a shared prefix the producer's engine computes, since a producer never finds
    anything), and it keeps one copy per key (the consumer reads the copy published by the
    same request: every save publishes its own, read oldest first, once). In ``bfloat16`` a
    prefix computed in another batch may round differently, so either difference changes
    tokens. Here ``lookup`` finds nothing until :attr:`consuming` is set, every save keeps its
    own copy of the blocks, and a load takes the oldest unread copy of each key.
    """

    def __init__(self) -> None:
        super().__init__()
        self.consuming = False
        self._copies: dict[str, deque[torch.Tensor]] = {}

    def _register(self, reg: RegisteredCaches) -> None:
        pass

    def _close(self) -> None:
        self._copies.clear()

    def _lookup(self, keys: list[str]) -> int:
        if not self.consuming:
            return 0
        return next((i for i, key in enumerate(keys) if not self._copies.get(key)), len(keys))

    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        started = time.perf_counter()
        data = self._read_blocks(block_ids).cpu()
        for key, row in zip(keys, data, strict=True):
            self._copies.setdefault(key, deque()).append(row)
        return self._finished("save", block_ids, {}, data.numel(), started)

    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        started = time.perf_counter()
        if not self.consuming or any(not self._copies.get(key) for key in keys):
            return self._finished("load", [], dict.fromkeys(block_ids, "not published"),
                                  0, started)
        data = torch.stack([self._copies[key].popleft() for key in keys])
        self._write_blocks(block_ids, data, "load")
        return self._finished("load", block_ids, {}, data.numel(), started)


def _same_steps_reference(setup: _Setup) -> tuple[list[int], list[Request], BatchStats]:
    """The disaggregated run's steps in one process (see :class:`_Handover`): one engine
    prefills every prompt for one token, computing all of it and publishing its full blocks;
    a second engine on the same caches, its free blocks poisoned, serves the requests to their
    full length, loading each request's own copies of its blocks. Returns the first engine's
    tokens, the requests and the second engine's statistics."""
    options = setup.options
    kv = setup.caches()
    with _Handover() as handover:
        handover.register_kv_caches(kv)
        prefill = [Request(r.request_id, r.prompt, 1) for r in setup.requests]
        setup.engine(handover, kv=kv).serve(prefill)
        handover.consuming = True
        decode = [Request(r.request_id, r.prompt, r.max_new_tokens) for r in setup.requests]
        engine = setup.engine(handover, kv=kv)
        engine.poison_free_blocks(torch.Generator().manual_seed(options.seed + 1))
        stats = engine.serve(decode)
    return [r.output[0] for r in prefill], decode, stats


def _tp(degree: int) -> str:
    return f", TP {degree}" if degree > 1 else ""


def format_result(result: DisaggResult) -> str:
    lines = [
        f"disaggregated prefill/decode over {result.transport}: "
        + (f"{result.prefill_backend} ({result.prefill_layout}{_tp(result.prefill_tp)}) -> "
           if result.prefill_layout else "")
        + f"{result.backend}"
        + (f" (TP {result.decode_tp})" if result.decode_tp > 1 else "") + " on "
        + (f"{result.device}" if result.prefill_device in ("", result.device) else
           f"{result.prefill_device} (prefill) -> {result.device} (decode)")
        + f", layout {result.layout}",
        f"  {result.requests} requests, {result.generated_tokens} tokens decoded; "
        f"{result.blocks_loaded} of {result.blocks_eligible} prompt blocks "
        f"{'gathered in place from the mapped cache of' if result.in_place else 'READ from'} "
        f"the prefill engine ({result.loaded_bytes / 1e6:.2f} MB in "
        f"{result.load_seconds * 1e3:.1f} ms of loads)",
        ("  tokens identical to one engine alone: " if result.prefill_layout else
         f"  tokens identical to the same steps in one process"
         f"{'' if result.notes else ' and to one engine alone'}: ")
        + f"{'yes' if result.ok else 'NO'} ({result.seconds:.1f} s)",
    ]
    lines += [f"  {m}" for m in result.mismatches + result.notes]
    if result.cause:
        lines.append(f"  cause: {result.cause}")
    return "\n".join(lines)
