"""``kvcore warmup``: build ahead what a backend needs for a model's shapes, and say where it
is cached.

A backend's first steps pay for builds that later runs load from disk: FlashInfer's JIT modules
(the builder's :meth:`~kvcore.AttentionMetadataBuilder.warmup`), the Triton kernels every
step compiles on its first launch, a plugin's C++ extension. :func:`run_warmup` selects the
backend exactly as ``kvcore demo`` does for a ``--model`` preset, makes the demo's engine
(whose builder runs its ``warmup()``) and serves two short requests through it, so that a
prefill, a step mixing prefill and decode, and decode-only steps all run once; long steps
announce themselves (:func:`kvcore.long_step`). The next run of the same shapes (``kvcore
demo``, or an engine with them) loads everything from the caches listed in the result.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcore import (
    allocate_kv_caches,
    get_attn_backend,
    parse_dtype,
    plugin_status_reports,
    require_present_platform,
)
from kvcore.demo.config import MODEL_PRESETS
from kvcore.demo.engine import Engine, Request, triton_cache_dir
from kvcore.demo.model import DemoModel
from kvcore.demo.scenario import DemoOptions, choose_dtype, demo_selector_config

__all__ = ["WarmupOptions", "WarmupResult", "cache_locations", "format_warmup", "run_warmup"]


@dataclass
class WarmupOptions:
    """Options of :func:`run_warmup` (the ``kvcore warmup`` flags): the demo's model preset,
    dtype (``None``: the demo's choice), block size, platform and forced backend."""

    model: str = "small"
    dtype: str | None = None
    block_size: int = 16
    max_num_seqs: int = 4
    platform: str | None = None
    backend: str | None = None


@dataclass
class WarmupResult:
    """What :func:`run_warmup` built, how long each part took and where it is cached."""

    platform: str
    device: str
    model: str
    dtype: str
    dtype_choice: str
    backend: str
    #: Seconds per part: ``builder`` (the builder's ``warmup()``, its parts in
    #: ``builder_parts``) and ``steps`` (the first prefill, mixed and decode steps).
    seconds: dict[str, float] = field(default_factory=dict)
    builder_parts: dict[str, float] = field(default_factory=dict)
    caches: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_locations() -> dict[str, str]:
    """Where first-use builds are kept, by name: Triton's kernel cache (``triton``;
    ``TRITON_CACHE_DIR`` moves it), ``kvcore kernels``' compile results
    (``kvcore_compile_check``; ``KVCORE_COMPILE_CACHE``), and every directory a plugin reports
    as a status fact named ``*_cache`` (e.g. ``nvidia.flashinfer_jit_cache``)."""
    from kvcore.testing.compile_check import compile_cache_dir

    caches = {}
    triton_dir = triton_cache_dir()
    if triton_dir is not None:
        caches["triton"] = triton_dir
    caches["kvcore_compile_check"] = str(compile_cache_dir())
    for plugin, facts in plugin_status_reports().items():
        for fact, value in facts.items():
            if fact.endswith("_cache"):
                caches[f"{plugin}.{fact}"] = str(value)
    return caches


def run_warmup(options: WarmupOptions) -> WarmupResult:
    """Select the backend for ``options.model`` on the (present) platform, run its builder's
    ``warmup()`` and the first steps of each kind once; see the module docstring.

    Raises:
        ValueError: a bad option, an absent platform, or a backend that cannot run the model
            (with its reasons), as ``kvcore demo`` would.
    """
    demo = DemoOptions(model=options.model, dtype=options.dtype, block_size=options.block_size,
                       max_num_seqs=options.max_num_seqs, platform=options.platform,
                       backend=options.backend, progress=False)
    demo.validate()
    platform = require_present_platform(options.platform)
    choice = choose_dtype(demo, platform)
    preset = MODEL_PRESETS[options.model]
    dtype = parse_dtype(choice.dtype)
    bs = options.block_size
    backend = get_attn_backend(demo_selector_config(options.model, choice.dtype, bs),
                               options.backend, platform)
    device = platform.device()
    # Two requests of three blocks each, one joining while the other decodes.
    prompt = 2 * bs + bs // 2 + 1
    num_blocks = options.max_num_seqs * -(-(prompt + 4) // bs) + 1
    kv = allocate_kv_caches(backend, num_layers=preset.num_layers, num_blocks=num_blocks,
                            block_size=bs, num_kv_heads=preset.num_kv_heads,
                            head_size=preset.cache_head_size, dtype=dtype, device=device)
    model = DemoModel(preset, seed=0, dtype=dtype, device=device)
    started = time.perf_counter()
    # A token budget of one prompt and a decode: the second request joins the first's decode.
    engine = Engine(model, backend, kv, max_num_seqs=options.max_num_seqs,
                    max_num_batched_tokens=prompt + 1)
    builder_seconds = time.perf_counter() - started
    started = time.perf_counter()
    # The engine announces each kind of step's first, compiling run (kvcore.long_step).
    engine.serve([Request("warmup-0", list(range(prompt)), 4),
                  Request("warmup-1", list(range(1, prompt + 1)), 4)])
    steps_seconds = time.perf_counter() - started
    return WarmupResult(
        platform=platform.name, device=str(device), model=options.model, dtype=choice.dtype,
        dtype_choice=choice.note, backend=backend.get_name(),
        seconds={"builder": builder_seconds, "steps": steps_seconds},
        builder_parts=dict(engine.warmup_seconds), caches=cache_locations())


def format_warmup(result: WarmupResult) -> str:
    """The lines ``kvcore warmup`` prints."""
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in result.builder_parts.items())
    lines = [
        f"kvcore warmup: {result.model} model on {result.platform} ({result.device})",
        f"dtype     {result.dtype_choice}",
        f"backend   {result.backend}",
        f"builder   warmup() {result.seconds['builder']:.1f} s" + (f" ({parts})" if parts else ""),
        f"steps     first prefill, mixed and decode steps {result.seconds['steps']:.1f} s",
        "caches    (later runs of these shapes load from them; delete one to rebuild)",
    ]
    width = max((len(k) for k in result.caches), default=0)
    lines += [f"          {name.ljust(width)}  {where}" for name, where in result.caches.items()]
    lines.append(f"result    warm: kvcore demo --model {result.model} (same dtype, backend and "
                 "block size) starts without these builds; run warmup again to see it")
    return "\n".join(lines)

