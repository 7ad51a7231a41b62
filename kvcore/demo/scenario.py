"""``kvcore demo``: serve a small model end to end over kvcore, and check every token.

What it does, in the order an engine does it:

1. **Select** an attention backend for the model's config on this platform (with a KV
   connector in use) and print why, including why every other backend was passed over.
2. **Allocate** the KV cache in the backend's layout, cross-layer when the ``offload``
   connector prefers it and the backend opts in; register it with the connector.
3. **Batch 1**: serve a batch of requests (two shared system prompts, distinct user turns)
   with continuous batching; each finished request offloads its full blocks to CPU memory.
4. **Evict**: free every device block and overwrite it with noise, so nothing of batch 1 is
   left on the device.
5. **Batch 2**: follow-up turns of batch-1 conversations and new conversations on the same
   system prompts; their shared prefixes are loaded back through the connector (prefix hits)
   instead of being recomputed.
6. **Check**: every generated token equals (a) the same requests served by the same engine
   without a connector, which recomputes everything, and (b) a non-paged reference: each
   finished sequence recomputed in float64 with plain causal attention over contiguous K/V,
   where every generated token must be the greedy choice. Both allow only near ties that
   rounding in the model dtype may decide either way (:func:`tie_tolerance`; float32 leaves
   essentially none).

Any mismatch is printed and makes :func:`run_demo_cli`'s exit status 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvcore import (
    AttentionBackend,
    AttentionSelectorConfig,
    Platform,
    SelectionReport,
    allocate_kv_caches,
    backend_platforms,
    explain_selection,
    format_supported,
    get_attn_backend,
    parse_dtype,
    require_present_platform,
    resolve_backend,
    set_progress,
)
from kvcore.connectors import KVConnector, get_connector, get_connector_class
from kvcore.demo.config import MODEL_PRESETS
from kvcore.demo.engine import BatchStats, Engine, Request
from kvcore.demo.model import DemoModel, contiguous_attention
from kvcore.testing import contiguous_mla_ref

__all__ = ["DEMO_DTYPES", "TIE_EPS", "TIE_FLOAT32", "DemoOptions", "DemoResult", "DtypeChoice",
           "TokenCheck", "check_against_reference", "choose_dtype", "compare_runs",
           "demo_selector_config", "format_summary", "reference_logits", "run_demo",
           "run_demo_cli", "tie_tolerance"]

#: Largest gap between the float64 reference logits of two tokens, in standard deviations of
#: that position's logits, for them to count as a tie that rounding in float32 may decide
#: either way: float32's logit error (~3e-6 std on the presets, from long sums rather than
#: per-op rounding) is 30x below it, so float32 ties are vanishingly rare. The 16-bit dtypes:
#: :func:`tie_tolerance`.
TIE_FLOAT32 = 1e-4
#: A near tie in a 16-bit dtype is a float64 gap of at most ``TIE_EPS * eps * sqrt(layers)``
#: standard deviations of the position's logits (``eps`` the dtype's machine epsilon). Measured
#: on the CPU (every non-MLA preset in bf16 and fp16 against float64, 96 positions each), the
#: largest error of one logit is 2.6 ``eps * sqrt(layers)`` in both dtypes, from 2 layers to
#: 16, so rounding may swap two tokens up to twice that apart (5.2); 6.4 leaves a quarter of
#: headroom for kernels that round differently (0.1 std for bf16 on the 4-layer small model).
TIE_EPS = 6.4


def tie_tolerance(dtype: torch.dtype, num_layers: int) -> float:
    """The near-tie gap of :data:`TIE_FLOAT32` (float32) or :data:`TIE_EPS` (16-bit), in
    standard deviations of a position's logits, for a model of ``num_layers`` layers."""
    if dtype == torch.float32:
        return TIE_FLOAT32
    return TIE_EPS * torch.finfo(dtype).eps * num_layers ** 0.5


#: The demo's dtypes, in the order it tries them when none is given: float32 first (its
#: checks against the float64 reference then leave essentially no ties), then the 16-bit
#: dtypes, which many GPU backends declare alone.
DEMO_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class DemoOptions:
    """Options of :func:`run_demo` (the ``kvcore demo`` flags)."""

    model: str = "small"
    batch: int = 8
    max_new_tokens: int = 16
    max_num_seqs: int = 4
    block_size: int = 16
    #: ``None``: the first of :data:`DEMO_DTYPES` the selected backend supports
    #: (:func:`choose_dtype`).
    dtype: str | None = None
    platform: str | None = None
    backend: str | None = None
    seed: int = 0
    progress: bool = True
    corrupt_loaded_block: bool = False

    def validate(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model={self.model!r} (choose from: {', '.join(MODEL_PRESETS)})")
        for name in ("batch", "max_new_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.dtype is not None and _dtype_str(self.dtype) not in DEMO_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} (supported: float32, bfloat16, float16)")


@dataclass
class DemoResult:
    """Everything the summary prints, as data (``kvcore demo --format json``)."""

    platform: str
    device: str
    model: str
    model_description: str
    dtype: str
    #: How the dtype was chosen (:attr:`DtypeChoice.note`).
    dtype_choice: str
    backend: str
    selection: dict[str, Any]
    layout: str
    layout_description: str
    cross_layer: bool
    cross_layer_reason: str
    num_blocks: int
    block_bytes: int
    batches: list[dict[str, Any]]
    offload: dict[str, Any]
    evicted_blocks: int
    checks: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: ``support`` (the backend's CUDA_GRAPH_SUPPORT), ``replayed_steps`` and ``steps`` of
    #: the engine with offload (decode-only steps replay from CUDA graphs on a GPU).
    cuda_graphs: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _selection_summary(report: SelectionReport) -> dict[str, Any]:
    """The pick and why; for every other candidate its reasons (``others``), and separately
    the names of backends registered for other platforms only (``other_platforms``)."""
    pick = report.selected
    assert pick is not None  # get_attn_backend raised otherwise
    why = ("forced with --backend (or KVCORE_ATTENTION_BACKEND) and valid" if report.forced
           else report.why_selected())
    others: dict[str, str] = {}
    other_platforms: list[str] = []
    for c in report.candidates:
        if c.selected:
            continue
        try:
            elsewhere = report.platform not in backend_platforms(c.name)  # imports nothing
        except Exception:  # a broken plugin: show its reasons, which say what failed
            elsewhere = False
        if elsewhere:
            other_platforms.append(c.name)
        else:
            others[c.name] = "valid, lower priority" if c.valid else "; ".join(c.reasons)
    return {"selected": pick.name, "why": why, "others": others,
            "other_platforms": other_platforms, "config": report.config.describe(),
            "report": report.to_dict()}


def demo_selector_config(model: str, dtype: str, block_size: int) -> AttentionSelectorConfig:
    """The selector config of the demo's ``model`` preset in ``dtype`` (a KV connector is in
    use: the demo offloads)."""
    preset = MODEL_PRESETS[model]
    return AttentionSelectorConfig(head_size=preset.cache_head_size, dtype=parse_dtype(dtype),
                                   block_size=block_size, use_mla=preset.is_mla,
                                   use_kv_connector=True)


@dataclass(frozen=True)
class DtypeChoice:
    """The demo's dtype and why: ``picked`` when the options gave none, with ``note`` (one
    line, the summary's ``dtype`` line) saying how it was chosen."""

    dtype: str
    picked: bool
    note: str


def _dtype_str(name: str) -> str:
    """``name`` (an alias such as ``bf16`` too) as :data:`DEMO_DTYPES` spells dtypes."""
    return str(parse_dtype(name)).removeprefix("torch.")


def _names(dtypes: list[str] | tuple[str, ...]) -> str:
    return ", ".join(dtypes)


def choose_dtype(options: DemoOptions, platform: Platform) -> DtypeChoice:
    """The dtype the demo runs in on ``platform`` (which may be simulated: only declarations
    and selection are consulted, no kernel runs).

    Without ``options.dtype``: with a forced backend, the first of :data:`DEMO_DTYPES` that
    its ``SUPPORTED_DTYPES`` declares and that passes its validation (else the first it
    declares, so that selection reports the other reasons); otherwise the first of
    :data:`DEMO_DTYPES` for which the platform selects a backend.

    Raises:
        ValueError: ``options.dtype`` is one the forced backend does not declare, or one no
            backend of the platform runs while another dtype would: a first line naming
            ``--dtype`` and the values that work, then the selection's full report.
    """
    def report(dtype: str) -> SelectionReport:
        return explain_selection(demo_selector_config(options.model, dtype, options.block_size),
                                 platform, options.backend)

    forced = resolve_backend(options.backend) if options.backend else None
    candidates = list(DEMO_DTYPES)
    if forced is not None:
        candidates = [d for d in DEMO_DTYPES if parse_dtype(d) in forced.SUPPORTED_DTYPES]
        if not candidates:
            raise ValueError(
                f"backend={options.backend}: it supports the dtypes "
                f"{format_supported(forced.SUPPORTED_DTYPES)} and the demo runs in "
                f"{_names(DEMO_DTYPES)} only; choose another --backend")
    if options.dtype is not None:
        dtype = _dtype_str(options.dtype)
        if forced is not None and dtype not in candidates:
            works = candidates
        elif report(dtype).selected is None:
            works = [d for d in candidates if d != dtype and report(d).selected is not None]
        else:
            return DtypeChoice(dtype, False, f"{dtype} (--dtype)")
        if works:
            who = (f"{options.backend} supports" if forced is not None
                   else f"no backend on {platform.name} runs this model in {dtype}; it runs in")
            try:
                get_attn_backend(demo_selector_config(options.model, dtype, options.block_size),
                                 options.backend, platform)
                full = ""
            except ValueError as exc:
                full = f"\n{exc}"
            raise ValueError(f"--dtype {dtype}: {who} {_names(works)}; pass --dtype {works[0]} "
                             f"(or leave out --dtype and the demo picks one){full}")
        return DtypeChoice(dtype, False, f"{dtype} (--dtype)")
    for dtype in candidates:
        pick = report(dtype).selected
        if pick is not None:
            break
    else:  # nothing runs: the first dtype, whose selection error gives every reason
        who = f"{options.backend} runs" if forced is not None else "no backend runs"
        return DtypeChoice(candidates[0], True, f"{candidates[0]} (no --dtype given; {who} the "
                           f"{options.model} model on {platform.name} in none of "
                           f"{_names(candidates)})")
    declared = format_supported(resolve_backend(pick.name).SUPPORTED_DTYPES)
    which = (f"{pick.name} supports ({declared})" if forced is not None else
             f"a backend on {platform.name} runs this model in ({pick.name}: {declared})")
    return DtypeChoice(dtype, True, f"{dtype} (no --dtype given: the first of "
                       f"{_names(DEMO_DTYPES)} that {which})")


def _conversations(rng: random.Random, vocab: int, n: int, block_size: int,
                   max_new_tokens: int, system_prompts: list[list[int]]) -> list[Request]:
    """Batch 1: each request is a system prompt (shared by every other request) plus its own
    user turn; output lengths vary so requests finish at different steps."""
    requests = []
    for i in range(n):
        user = [rng.randrange(vocab) for _ in range(rng.randint(block_size // 2 + 1,
                                                               2 * block_size))]
        requests.append(Request(f"b1-{i}", system_prompts[i % len(system_prompts)] + user,
                                rng.randint(max(1, max_new_tokens // 2), max_new_tokens)))
    return requests


def _follow_ups(rng: random.Random, vocab: int, first: list[Request], block_size: int,
                max_new_tokens: int, system_prompts: list[list[int]]) -> list[Request]:
    """Batch 2: even requests continue a batch-1 conversation (its prompt and answer, then a
    new turn); odd ones start a new conversation on a batch-1 system prompt."""
    requests = []
    for i, prev in enumerate(first):
        turn = [rng.randrange(vocab) for _ in range(rng.randint(2, block_size))]
        prefix = prev.prompt + prev.output if i % 2 == 0 else system_prompts[i % 2]
        requests.append(Request(f"b2-{i}", prefix + turn,
                                rng.randint(max(1, max_new_tokens // 2), max_new_tokens)))
    return requests


def _fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt), r.max_new_tokens) for r in requests]


def _batch_dict(name: str, stats: BatchStats) -> dict[str, Any]:
    return {"name": name, **asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate,
            "tokens_per_second": stats.generated_tokens / stats.seconds if stats.seconds else 0.0}


@dataclass
class TokenCheck:
    """Outcome of comparing generated tokens with something: ``agreed`` of ``checked`` tokens
    were equal, ``ties`` more differed only by a near tie (see :func:`tie_tolerance`), and
    ``problems`` has one ``MISMATCH`` line per request that really differs."""

    agreed: int = 0
    ties: int = 0
    checked: int = 0
    problems: list[str] = field(default_factory=list)


def _is_tie(logits: torch.Tensor, a: int, b: int, dtype: torch.dtype, num_layers: int) -> bool:
    """Whether tokens ``a`` and ``b`` are within rounding of ``dtype`` of each other."""
    gap = abs(float(logits[a] - logits[b]))
    return gap <= tie_tolerance(dtype, num_layers) * float(logits.std())


@torch.inference_mode()
def reference_logits(model: DemoModel, requests: list[Request]) -> list[torch.Tensor]:
    """Per request, the float64 logits that chose each generated token: ``(len(output),
    vocab_size)``, from one causal pass over the request's tokens with plain attention over
    contiguous K/V (no paging) and the model's weights in float64; MLA unabsorbed (every latent
    expanded to per-head K and V, :func:`kvcore.testing.contiguous_mla_ref`)."""
    ref = model.to(torch.float64)
    c = model.config
    scale = c.attn_scale if c.is_mla else c.head_size ** -0.5

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if c.is_mla:
            return contiguous_mla_ref(q, k, v, ref.layers[layer]["kv_b_proj"], scale,
                                      qk_nope_head_dim=c.head_size, v_head_dim=c.v_head_dim)
        return contiguous_attention(q, k, v, scale)

    out = []
    for req in requests:
        fed = req.tokens[:-1]  # the last sampled token is never fed back
        ids = torch.tensor(fed, dtype=torch.int64, device=model.device)
        positions = torch.arange(len(fed), dtype=torch.int64, device=model.device)
        out.append(ref.logits(ref.forward(ids, positions, attend))[len(req.prompt) - 1:])
    return out


def check_against_reference(requests: list[Request], logits: list[torch.Tensor],
                            dtype: torch.dtype, *, num_layers: int = 4) -> TokenCheck:
    """Every generated token must be the reference's greedy choice, or a near tie with it.
    Checking a request stops at its first real mismatch: later tokens follow from it."""
    check = TokenCheck()
    for req, z in zip(requests, logits, strict=True):
        for i, tok in enumerate(req.output):
            best = int(z[i].argmax())
            check.checked += 1
            if best == tok:
                check.agreed += 1
            elif _is_tie(z[i], best, tok, dtype, num_layers):
                check.ties += 1
            else:
                gap = float(z[i][best] - z[i][tok])
                check.problems.append(
                    f"MISMATCH {req.request_id}: token {i} is {tok} but the float64 reference "
                    f"picks {best} (logit gap {gap:.3g}, more than a tie)")
                break
    return check


def compare_runs(main: list[Request], baseline: list[Request], logits: list[torch.Tensor],
                 dtype: torch.dtype, *, num_layers: int = 4) -> TokenCheck:
    """Tokens of ``main`` against the same requests served by ``baseline``, up to each
    request's first difference. A difference where the reference ``logits`` (of ``main``)
    call the two tokens a near tie is counted in ``ties`` (the runs batch differently, so
    reduced precision may round such a tie either way); any other is a problem."""
    check = TokenCheck()
    for a, b, z in zip(main, baseline, logits, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a.output, b.output, strict=True))
                      if x != y), None)
        if first is None:
            check.agreed += len(a.output)
            check.checked += len(a.output)
            continue
        check.agreed += first
        check.checked += first + 1
        if _is_tie(z[first], a.output[first], b.output[first], dtype, num_layers):
            check.ties += 1
        else:
            check.problems.append(
                f"MISMATCH {a.request_id}: token {first} is {a.output[first]} with offload "
                f"but {b.output[first]} in the run without offload")
    return check


def _cross_layer_reason(backend: type[AttentionBackend], cross_layer: bool,
                        platform: str) -> str:
    name = backend.get_name()
    if cross_layer:
        return (f"the offload connector copies a block of every layer in one run, and {name} "
                "opts in")
    if not backend.supports_cross_layer():
        order = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
        return f"{name} keeps layers outermost (get_kv_cache_stride_order(True) = {order})"
    if not backend.supports_cross_layer(platform):
        return backend.cross_layer_note(platform)
    return "the offload connector does not prefer cross-layer blocks"


def _available_bytes(device: torch.device) -> int | None:
    """Free memory for new allocations on ``device``: MemAvailable on the host (Linux), the
    free device memory on a CUDA device; ``None`` where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(options: DemoOptions, platform: Platform, dtype: torch.dtype, *, longest: int,
                  pools_bytes: int, capacity_bytes: int) -> None:
    """Refuse, before allocating, sizes whose memory the machine does not have: the device
    pools of both engines and the model on the device; the offload pool, the float64 model,
    its logits and one request's attention scores on the host (the same memory on a CPU)."""
    preset = MODEL_PRESETS[options.model]
    # An upper bound of the weights: embeddings and head, an MLP and four attention
    # projections of the widest head per layer.
    head = max(preset.head_size + preset.qk_rope_head_dim, preset.cache_head_size)
    params = 2 * preset.vocab_size * preset.hidden_size + preset.num_layers * (
        3 * preset.hidden_size * preset.intermediate_size
        + 4 * preset.hidden_size * preset.num_heads * head)
    device_bytes = pools_bytes + params * dtype.itemsize
    requests = 2 * options.batch
    host_bytes = (capacity_bytes + params * 8
                  + requests * options.max_new_tokens * preset.vocab_size * 8
                  + 3 * longest * longest * preset.num_heads * 8)
    device = platform.device()
    checks = ([("device and host", device, device_bytes + host_bytes)] if device.type == "cpu"
              else [("device", device, device_bytes),
                    ("host", torch.device("cpu"), host_bytes)])
    for where, dev, need in checks:
        free = _available_bytes(dev)
        if free is not None and need > free:
            raise ValueError(
                f"--batch {options.batch} --new-tokens {options.max_new_tokens} --max-num-seqs "
                f"{options.max_num_seqs} --block-size {options.block_size}: the demo would need "
                f"about {need / 1e9:.1f} GB of {where} memory for the {options.model} model but "
                f"{free / 1e9:.1f} GB is free; lower --batch or --new-tokens (the reference "
                "logits and the offload pool grow with both), or --max-num-seqs and "
                "--block-size (the device pools)")


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run CPU ops on one thread. The demo's ops are tiny: intra-op threads cost more in
    synchronisation than they save, and on a machine busy with other work OpenMP's waiting
    threads made the demo 5-40x slower in our measurements."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_demo(options: DemoOptions) -> DemoResult:
    """Run the demo (see the module docstring) and return its result.

    Prints nothing but a progress bar on ``sys.stderr`` (when ``options.progress`` is set and
    stderr is a terminal). Raises ``ValueError`` naming the option for bad options, an absent
    platform, or a backend that cannot run the model (with its reasons).
    """
    options.validate()
    platform = require_present_platform(options.platform)
    # Without progress output, the notices of long first-use steps are silent too.
    previous = None if options.progress else set_progress(False)
    try:
        with _one_cpu_thread(platform.device()):
            return _run(options, platform)
    finally:
        if not options.progress:
            set_progress(previous)


def _run(options: DemoOptions, platform: Platform) -> DemoResult:
    started = time.perf_counter()
    choice = choose_dtype(options, platform)
    dtype = parse_dtype(choice.dtype)
    preset = MODEL_PRESETS[options.model]
    device = platform.device()
    bs = options.block_size

    config = demo_selector_config(options.model, choice.dtype, bs)
    backend = get_attn_backend(config, options.backend, platform)
    selection = _selection_summary(explain_selection(config, platform, options.backend))
    cross_layer = get_connector_class("offload").cross_layer_for(backend, platform.name)

    rng = random.Random(options.seed)
    system_prompts = [[rng.randrange(preset.vocab_size) for _ in range(2 * bs)]
                      for _ in range(2)]
    batch1 = _conversations(rng, preset.vocab_size, options.batch, bs, options.max_new_tokens,
                            system_prompts)
    # The longest batch-2 request continues the longest conversation: size the device pool
    # for max_num_seqs of those at once.
    longest = max(len(r.prompt) for r in batch1) + 2 * options.max_new_tokens + bs
    num_blocks = options.max_num_seqs * -(-longest // bs) + 1
    per_token = preset.cache_head_size if preset.is_mla \
        else 2 * preset.num_kv_heads * preset.head_size
    block_bytes = preset.num_layers * bs * per_token * dtype.itemsize
    # Room for every full block batch 1 writes, twice over: the demo needs no CPU eviction.
    capacity_bytes = 2 * sum(-(-r.max_len // bs) for r in batch1) * block_bytes
    _check_memory(options, platform, dtype, longest=longest,
                  pools_bytes=2 * num_blocks * block_bytes, capacity_bytes=capacity_bytes)
    model = DemoModel(preset, seed=options.seed, dtype=dtype, device=device)
    key_salt = f"kvcore-demo:{options.model}:seed={options.seed}:{choice.dtype}"

    def noise() -> torch.Generator:
        return torch.Generator().manual_seed(options.seed + 1)

    def new_engine(connector: KVConnector | None, on_step: Callable[[int], None]) -> Engine:
        kv = allocate_kv_caches(
            backend, num_layers=preset.num_layers, num_blocks=num_blocks, block_size=bs,
            num_kv_heads=preset.num_kv_heads, head_size=preset.cache_head_size, dtype=dtype,
            device=device, cross_layer=cross_layer)
        on_loaded = None
        if connector is not None:
            connector.register_kv_caches(kv)
            if options.corrupt_loaded_block:
                def on_loaded(block_ids: list[int]) -> None:
                    # Self-test: damage the first loaded block of every layer after its load.
                    for layer in kv.layers:
                        damage = torch.randn(layer.shape[1:], generator=noise())
                        layer[block_ids[0]].copy_(damage)
        return Engine(model, backend, kv, max_num_seqs=options.max_num_seqs,
                      max_num_batched_tokens=max(256, longest), connector=connector,
                      key_salt=key_salt, on_loaded=on_loaded, on_step=on_step)

    with tqdm(total=4 * options.batch * options.max_new_tokens, desc="kvcore demo", unit="tok",
              file=sys.stderr, disable=None if options.progress else True, leave=False) as bar:
        with get_connector("offload", capacity_bytes=capacity_bytes) as connector:
            engine = new_engine(connector, bar.update)
            stats1 = engine.serve(batch1)
            evicted = engine.poison_free_blocks(noise())
            batch2 = _follow_ups(rng, preset.vocab_size, batch1, bs, options.max_new_tokens,
                                 system_prompts)
            bar.total = 2 * sum(r.max_new_tokens for r in batch1 + batch2)
            bar.refresh()
            stats2 = engine.serve(batch2)
            offload = {**connector.stats.to_dict(), "capacity_bytes": capacity_bytes,
                       "copied_save_blocks": connector.stats.saved_bytes // block_bytes}
        # The same engine without a connector: batch 2 recomputes every prefix.
        baseline = new_engine(None, bar.update)
        base1, base2 = _fresh(batch1), _fresh(batch2)
        baseline.serve(base1)
        baseline.poison_free_blocks(noise())
        baseline.serve(base2)

    served = batch1 + batch2
    logits = reference_logits(model, served)
    layers = preset.num_layers
    vs_baseline = compare_runs(served, base1 + base2, logits, dtype, num_layers=layers)
    vs_reference = check_against_reference(served, logits, dtype, num_layers=layers)
    layout = engine.kv_caches.layout
    return DemoResult(
        platform=platform.name,
        device=str(device),
        model=options.model,
        model_description=preset.describe(),
        dtype=choice.dtype,
        dtype_choice=choice.note,
        backend=backend.get_name(),
        selection=selection,
        layout=str(layout),
        layout_description=layout.describe(),
        cross_layer=layout.is_cross_layer,
        cross_layer_reason=_cross_layer_reason(backend, cross_layer, platform.name),
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        batches=[_batch_dict("batch 1", stats1), _batch_dict("batch 2", stats2)],
        offload=offload,
        evicted_blocks=len(evicted),
        checks={
            "without_offload": asdict(vs_baseline), "reference": asdict(vs_reference),
            "generated_tokens": sum(len(r.output) for r in served),
            "tie_tolerance_std": tie_tolerance(dtype, layers),
        },
        mismatches=vs_baseline.problems + vs_reference.problems,
        seconds=time.perf_counter() - started,
        cuda_graphs={"support": backend.CUDA_GRAPH_SUPPORT.value,
                     "replayed_steps": stats1.graph_steps + stats2.graph_steps,
                     "steps": stats1.steps + stats2.steps},
    )


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.2f} MB"


def format_summary(result: DemoResult) -> str:
    """The human-readable summary ``kvcore demo`` prints."""
    from tabulate import tabulate

    sel = result.selection
    lines = [
        f"kvcore demo: {result.model} model ({result.model_description}), {result.dtype}, "
        f"on {result.platform} ({result.device})",
        "",
        f"dtype     {result.dtype_choice}",
        f"backend   {result.backend}: {sel['why']}",
    ]
    lines += [f"          - {name}: {why}" for name, why in sel["others"].items()]
    if sel["other_platforms"]:
        lines.append(f"          - not for {result.platform}: {', '.join(sel['other_platforms'])}")
    lines += [
        f"layout    {result.layout}  ({result.layout_description})",
        f"          cross-layer: {'yes' if result.cross_layer else 'no'}, "
        f"{result.cross_layer_reason}",
        f"          device pool {result.num_blocks} blocks of {result.block_bytes} B "
        "(all layers)",
        "",
    ]
    rows = []
    for b in result.batches:
        hit = (f"{b['prefix_blocks_hit']}/{b['prefix_blocks_eligible']} "
               f"({100 * b['prefix_hit_rate']:.0f}%)")
        rows.append([b["name"], b["requests"], b["prompt_tokens"], b["computed_prompt_tokens"],
                     hit, b["generated_tokens"], b["steps"], b["mixed_steps"], b["max_running"],
                     f"{b['tokens_per_second']:.0f}"])
    lines.append(tabulate(rows, headers=["", "requests", "prompt tokens", "computed",
                                         "prefix hits (blocks)", "generated", "steps",
                                         "mixed steps", "max batch", "tok/s"]))
    graphs = result.cuda_graphs
    if graphs:
        lines.append(f"\ngraphs    {graphs['replayed_steps']} of {graphs['steps']} steps replayed "
                     f"from CUDA graphs ({result.backend}: CUDA_GRAPH_SUPPORT="
                     f"{graphs['support']}; decode-only steps on a CUDA device replay)")
    off = result.offload
    lines += [
        "",
        f"offload   saved {off['saved_blocks']} blocks ({off['copied_save_blocks']} copied, "
        f"{_mb(off['saved_bytes'])}, the others already in the pool) at "
        f"{off['save_gbps']:.2f} GB/s; "
        f"loaded {off['loaded_blocks']} blocks ({_mb(off['loaded_bytes'])}) at "
        f"{off['load_gbps']:.2f} GB/s",
        f"          evicted {result.evicted_blocks} device blocks between the batches (freed "
        "and overwritten with noise)",
    ]
    failures = sum(b["load_failures"] for b in result.batches)
    if failures:
        lines.append(f"          {failures} blocks failed to load and were recomputed")
    c = result.checks
    lines.append("")
    for what, key, tie_note in (
            ("a run without offload", "without_offload",
             "requests diverged at a near tie, not compared after it"),
            ("the non-paged float64 reference", "reference", "near ties")):
        check = c[key]
        ties = f" ({check['ties']} {tie_note})" if check["ties"] else ""
        lines.append(f"check     tokens equal to {what}: {check['agreed']}/"
                     f"{c['generated_tokens']}{ties}")
    lines += result.mismatches
    verdict = "PASS" if result.ok else f"FAIL ({len(result.mismatches)} mismatches)"
    lines.append(f"result    {verdict} in {result.seconds:.1f} s")
    return "\n".join(lines)


def run_demo_cli(options: DemoOptions, output_format: str = "table") -> int:
    """Run the demo, print the summary (or JSON); 0 if every check passed, else 1."""
    result = run_demo(options)
    if output_format == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_summary(result))
    return 0 if result.ok else 1
