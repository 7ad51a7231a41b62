"""transformers' continuous batching (``generate_batch``) on kvcore's backends against
transformers' own paged attention, with identical batching settings.

The model is Llama-3-8B-shaped with random weights (32 layers, hidden 4096, 32 query / 8 KV
heads of 128, bfloat16; built from ``LlamaConfig``, nothing downloaded). Two workloads:

- ``decode``: 64 requests of 512-token prompts, 256 new tokens each;
- ``prefill``: 16 requests of 4096-token prompts, 16 new tokens each.

Paths: transformers' ``sdpa`` (CUDA graphs off and on), ``flash_attention_2``/``_3`` where
their package imports, and ``use_kvcore`` with kvcore's selected backend, TRITON_ATTN and
FLASHINFER (CUDA graphs off: kvcore's step reads ``cu_seq_lens_q`` on the host, which a
captured graph cannot). A path that cannot run says why in its row. Per path: output tokens/s
(wall time of ``generate_batch`` after a warm-up run), attention-module time per step (CUDA
events around every attention module, projections included, summed over layers; not measured
when graphs replay), peak memory, steps, and greedy agreement with the ``sdpa`` path (tokens
equal; a divergence is reported with the request). A table is printed last; JSON goes to
``--json`` (default ``$OUT/bench_transformers.json`` when ``$OUT`` is set).

Needs, on an offline GPU machine (torch 2.11 cu130): kvcore and kvcore-nvidia installed
(``pip install -e . -e plugins/nvidia``), ``transformers`` 5.25.x carried as a wheel (``pip
download 'transformers>=5.25,<5.26'`` elsewhere, with its dependencies huggingface-hub,
tokenizers, safetensors, regex, pyyaml, tqdm, packaging, filelock, requests), and for
FLASHINFER the ``flashinfer-python`` wheel. About 16 GiB of weights plus the caches::

    python benchmarks/bench_transformers.py                     # both workloads, every path
    python benchmarks/bench_transformers.py --workload decode --paths sdpa kvcore
    python benchmarks/bench_transformers.py --small             # CPU, seconds: a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

#: (requests, prompt tokens, new tokens) per workload; ``--small`` shrinks them.
WORKLOADS = {"decode": (64, 512, 256), "prefill": (16, 4096, 16)}
SMALL_WORKLOADS = {"decode": (4, 24, 8), "prefill": (2, 64, 2)}
#: Every path, in table order. ``kvcore`` is kvcore's selected backend.
PATHS = ("sdpa", "sdpa+graphs", "flash_attention_2", "flash_attention_3", "kvcore",
         "kvcore:TRITON_ATTN", "kvcore:FLASHINFER")


@dataclass
class Row:
    """One path on one workload."""

    workload: str
    path: str
    backend: str | None = None
    tokens_per_s: float | None = None
    wall_s: float | None = None
    steps: int | None = None
    attn_ms_per_step: float | None = None
    peak_mem_gib: float | None = None
    agreement: str | None = None
    skipped: str | None = None
    divergences: list[str] = field(default_factory=list)


def build_model(small: bool, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if small:
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, max_position_embeddings=1024, initializer_range=0.2)
        dtype = torch.float32
    else:
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                             rope_theta=500000.0)
        dtype = torch.bfloat16
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model.eval()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


class AttentionTimer:
    """CUDA events around every attention module's forward; per-step sums on request."""

    def __init__(self, model, enabled: bool) -> None:
        self.enabled = enabled
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0
        self.handles = []
        modules = [m for m in model.modules()
                   if isinstance(getattr(m, "layer_idx", None), int)
                   and type(m).__name__.endswith("Attention")]
        self.handles.append(model.register_forward_pre_hook(self._count))
        if enabled:
            for m in modules:
                # First, so the time includes kvcore's per-step metadata build (its pre-hook).
                self.handles.append(m.register_forward_pre_hook(self._start, prepend=True))
                self.handles.append(m.register_forward_hook(self._stop))
        self._open: torch.cuda.Event | None = None

    def _count(self, *_):
        self.steps += 1

    def _start(self, *_):
        if torch.cuda.is_current_stream_capturing():
            return
        self._open = torch.cuda.Event(enable_timing=True)
        self._open.record()

    def _stop(self, *_):
        if self._open is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((self._open, end))
        self._open = None

    def ms_per_step(self) -> float | None:
        if not self.enabled or not self.pairs or not self.steps:
            return None
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / self.steps

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_path(model, path: str, workload: str, shape, args, reference) -> Row:
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from kvcore.integrations.transformers import use_kvcore

    row = Row(workload, path)
    n, length, new = shape
    cuda = args.device.startswith("cuda")
    graphs = path.endswith("+graphs")
    if path.startswith("flash_attention"):
        available = getattr(transformers.utils, f"is_flash_attn_{path[-1]}_available")()
        if not available:
            row.skipped = f"{path}: its package is not importable here"
            return row
    if graphs and not cuda:
        row.skipped = "CUDA graphs need a CUDA device"
        return row
    batch = prompts(n, length, model.config.vocab_size)
    gen_config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                                  pad_token_id=None)
    cb_config = ContinuousBatchingConfig(
        page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
        use_cuda_graph=graphs, max_memory_percent=args.max_memory_percent,
        num_blocks=args.num_blocks, auto_switch_to_flash=False)
    attn = path.split("+")[0]

    def generate():
        return model.generate_batch(batch, gen_config, continuous_batching_config=cb_config,
                                    warmup=graphs)

    try:
        if attn.startswith("kvcore"):
            backend = attn.partition(":")[2] or None
            context = use_kvcore(model, backend, page_size=args.page_size)
        else:
            model.set_attn_implementation(attn)
            context = _nothing()
        with context as state:
            row.backend = state.backend.get_name() if state is not None else attn
            generate()  # warm-up: compiles, JIT builds, allocator growth
            _sync(cuda)
            timer = AttentionTimer(model, enabled=cuda and not graphs)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out = generate()
            _sync(cuda)
            row.wall_s = time.perf_counter() - start
            row.attn_ms_per_step = timer.ms_per_step()
            row.steps = None if graphs else timer.steps  # replays call no hooks
            timer.close()
    except (ValueError, RuntimeError, ImportError) as exc:
        row.skipped = f"{type(exc).__name__}: {exc}"
        return row
    finally:
        model.set_attn_implementation("sdpa")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    errors = [r.error for r in out.values() if r.error is not None]
    if errors:
        row.skipped = f"generation failed: {errors[0]}"
        return row
    if cuda:
        row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    tokens = {k: r.generated_tokens for k, r in out.items()}
    row.tokens_per_s = sum(map(len, tokens.values())) / row.wall_s
    if reference is not None:
        equal = sum(a == b for k in reference for a, b in zip(tokens[k], reference[k],
                                                              strict=False))
        total = sum(map(len, reference.values()))
        row.agreement = f"{equal}/{total}"
        for k in reference:
            if tokens[k] != reference[k]:
                i = next((j for j, (a, b) in enumerate(zip(tokens[k], reference[k],
                                                             strict=False)) if a != b), 0)
                row.divergences.append(f"{k} from token {i}")
    else:
        row.agreement = "reference"
        run_path.reference = tokens
    return row


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def table(rows: list[Row]) -> str:
    head = ("workload", "path", "backend", "tok/s", "attn ms/step", "steps", "peak GiB",
            "greedy agreement")
    lines = [head]
    for r in rows:
        if r.skipped:
            lines.append((r.workload, r.path, r.backend or "-", "skipped", r.skipped[:90], "",
                          "", ""))
            continue
        lines.append((r.workload, r.path, r.backend or "-", f"{r.tokens_per_s:.1f}",
                      "-" if r.attn_ms_per_step is None else f"{r.attn_ms_per_step:.2f}",
                      "-" if r.steps is None else str(r.steps),
                      "-" if r.peak_mem_gib is None else f"{r.peak_mem_gib:.1f}",
                      r.agreement or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                     for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--small", action="store_true",
                        help="a 2-layer float32 model and tiny workloads on the CPU (seconds)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), nargs="+",
                        default=sorted(WORKLOADS))
    parser.add_argument("--paths", nargs="+", default=list(PATHS),
                        help=f"paths to run (default: all of {', '.join(PATHS)}); sdpa is "
                             "the agreement reference and always runs first")
    parser.add_argument("--page-size", type=int, default=None,
                        help="ContinuousBatchingConfig.page_size (default: 64; 16 with --small)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens per step (default: 8192; 32 with --small)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="cache blocks (default: transformers sizes it from free memory; "
                             "256 with --small)")
    parser.add_argument("--max-memory-percent", type=float, default=0.5,
                        help="share of free GPU memory for the cache (default: %(default)s)")
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.small else "cuda")
    args.page_size = args.page_size or (16 if args.small else 64)
    args.max_batch_tokens = args.max_batch_tokens or (32 if args.small else 8192)
    if args.small and args.num_blocks is None:
        args.num_blocks = 256
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False; run with --small "
              "for the CPU smoke test", file=sys.stderr)
        return 2
    model = build_model(args.small, args.device)
    shapes = SMALL_WORKLOADS if args.small else WORKLOADS
    paths = ["sdpa"] + [p for p in args.paths if p != "sdpa"]
    rows = []
    for workload in args.workload:
        run_path.reference = None
        for path in paths:
            row = run_path(model, path, workload, shapes[workload], args,
                           None if path == "sdpa" else run_path.reference)
            rows.append(row)
            print(f"{workload:8s} {path:22s} "
                  f"{row.skipped or f'{row.tokens_per_s:.1f} tok/s'}", file=sys.stderr)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    import transformers

    result = {"device": device, "torch": torch.__version__,
              "transformers": transformers.__version__, "small": args.small,
              "page_size": args.page_size, "max_batch_tokens": args.max_batch_tokens,
              "rows": [asdict(r) for r in rows]}
    out = args.json or (str(Path(os.environ["OUT"]) / "bench_transformers.json")
                        if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
