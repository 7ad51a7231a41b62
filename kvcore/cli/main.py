"""``kvcore``'s argument parsing: the parser and :func:`main`.

Parsing needs neither torch nor the ``kvcore[cli]`` extra, so ``kvcore --help``, ``--version``
and argument errors answer at once; :mod:`kvcore.cli.commands` (torch, kvcore's registries,
tabulate) is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from kvcore import PHASES, AttentionType, __version__
from kvcore.cli.words import in_cli_words
from kvcore.demo.config import MODEL_PRESETS

__all__ = ["BENCH_MODEL_CHOICES", "BENCH_SIZE_CHOICES", "CACHE_DTYPE_CHOICES",
           "CLI_DEPENDENCIES", "KV_CACHE_DTYPE_CHOICES", "MODEL_DTYPE_CHOICES",
           "SELECT_CONFIG_FLAGS", "build_parser", "main"]

#: ``--kv-cache-dtype`` values: kvcore's ``KV_CACHE_DTYPES`` (a test keeps the two equal),
#: spelled out here because the module that defines them imports torch.
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: Import names of the ``kvcore[cli]`` extra the commands need.
CLI_DEPENDENCIES = ("tabulate", "tqdm")


def _missing_cli_dependencies() -> list[str]:
    return [name for name in CLI_DEPENDENCIES if importlib.util.find_spec(name) is None]


#: ``--dtype`` values of ``select`` (the model's dtype) and their accepted aliases.
MODEL_DTYPE_CHOICES = ("bfloat16", "float16", "float32")
#: ``layout --dtype`` values (the cache's element type): model dtypes and fp8.
CACHE_DTYPE_CHOICES = (*MODEL_DTYPE_CHOICES, "float8_e4m3fn", "float8_e5m2")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}
#: ``bench --size`` values: the keys of :data:`kvcore.cli.bench.SIZES` (a test keeps them
#: equal; that module imports torch).
BENCH_SIZE_CHOICES = ("small", "full")
#: ``bench --model`` and ``tune --model`` values: the keys of :data:`kvcore.models.MODELS` (a
#: test keeps them equal; that module imports torch).
BENCH_MODEL_CHOICES = ("llama-3.1-8b", "llama-3.1-70b-tp8", "qwen2.5-7b", "mistral-7b",
                       "gemma-2-9b", "gpt-oss-20b", "qwen3-30b-a3b", "deepseek-v3-tp8",
                       "deepseek-v3-tp1")


def _dtype_name(text: str) -> str:
    """A dtype name with its alias and ``torch.`` prefix resolved (argparse then checks it
    against the option's choices)."""
    key = text.removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(key, key)


def _int_at_least(minimum: int):
    """An argparse ``type``: an integer ``>= minimum``; argparse names the flag on error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        return value

    parse.__name__ = "positive integer" if minimum == 1 else f"integer >= {minimum}"
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def _int_between(minimum: int, maximum: int, why: str):
    """An argparse ``type``: an integer in ``minimum..maximum``; ``why`` says what the maximum
    protects (argparse names the flag on error, before anything is allocated)."""
    at_least = _int_at_least(minimum)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is more than {maximum} ({why})")
        return value

    parse.__name__ = f"integer in {minimum}..{maximum}"
    return parse


#: Largest sizes of ``kvcore demo`` and ``kvcore layout``: far above what either shows well,
#: far below what would exhaust a machine before the memory check
#: (:func:`kvcore.demo.scenario.DemoOptions.memory_bytes`) gets to look.
_DEMO_MAX = "the demo's most; it serves small models"
_DEMO_TP_MAX = "one process simulates every rank, each with its own connectors"
_BLOCK_ID_MAX = 2**31 - 1  # block tables hold int32 ids


def _kv_cache_dtype_name(text: str) -> str:
    """A ``--kv-cache-dtype`` with torch's fp8 names read as kvcore's (``float8_e4m3fn`` is
    ``fp8_e4m3``); argparse then checks it against the choices."""
    key = text.removeprefix("torch.").lower()
    return {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(key, key)


def _cache_dtype_name(text: str) -> str:
    """A ``layout --dtype`` with kvcore's fp8 cache names read as torch's (``fp8_e4m3`` is
    ``float8_e4m3fn``), so both spellings work in every command."""
    key = _dtype_name(text)
    return {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2"}.get(key, key)


#: ``kvcore select``'s flag for each field of :class:`kvcore.AttentionSelectorConfig`, keyed by
#: the field's name (the flag's ``dest``; the command builds the config field by field, and a
#: test keeps the two in step, so a new field cannot go without a flag). Spelled out here
#: because the config's module imports torch.
SELECT_CONFIG_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "head_size": ("--head-size", dict(
        type=positive_int, default=None,
        help="size of one attention head (default: 128; with --mla 576). For MLA it is the "
             "latent size each token caches, kv_lora_rank + rope dims (DeepSeek: 512 + 64)")),
    "dtype": ("--dtype", dict(
        type=_dtype_name, default="bfloat16", choices=MODEL_DTYPE_CHOICES,
        help="the model's dtype: %(choices)s (aliases bf16, fp16, fp32; default: "
             "%(default)s)")),
    "kv_cache_dtype": ("--kv-cache-dtype", dict(
        type=_kv_cache_dtype_name, default="auto", choices=KV_CACHE_DTYPE_CHOICES,
        help="KV cache storage: auto (the model's dtype) or an fp8 format (fp8 is fp8_e4m3; "
             "torch's names float8_e4m3fn and float8_e5m2 work too; default: %(default)s)")),
    "block_size": ("--block-size", dict(
        type=positive_int, default=16,
        help="tokens per KV-cache block (default: %(default)s)")),
    "use_mla": ("--mla", dict(
        action="store_true",
        help="an MLA layer (DeepSeek-style latent attention); its head size is the latent "
             "size, so --head-size defaults to 576 with it")),
    "has_sink": ("--sink", dict(action="store_true",
                                help="attention sinks (a learned sink logit per head)")),
    "use_sparse": ("--sparse", dict(
        action="store_true", help="sparse attention (each query attends to selected keys)")),
    "use_mm_prefix": ("--mm-prefix", dict(
        action="store_true",
        help="a multimodal prefix attended bidirectionally inside an otherwise causal layer")),
    "use_per_head_quant_scales": ("--per-head-quant-scales", dict(
        action="store_true",
        help="an fp8 KV cache with a scale per KV head instead of one per layer (needs an fp8 "
             "--kv-cache-dtype)")),
    "attn_type": ("--attn-type", dict(
        default="decoder", choices=[t.value for t in AttentionType],
        help="what the layer attends over: %(choices)s (default: %(default)s)")),
    "use_non_causal": ("--non-causal", dict(
        action="store_true", help="queries also see later tokens (bidirectional attention)")),
    "use_batch_invariant": ("--batch-invariant", dict(
        action="store_true",
        help="require batch-invariant numerics: a request gets the same bits whatever else is "
             "in the batch")),
    "use_kv_connector": ("--kv-connector", dict(
        action="store_true",
        help="a KV connector is in use (offload, transfer): backends that keep a layout "
             "connectors cannot move are rejected")),
    "has_logits_soft_cap": ("--soft-cap", dict(
        action="store_true", help="logit soft-capping (scores become cap * tanh(score / cap), "
                                  "Gemma 2)")),
    "num_heads": ("--num-heads", dict(
        type=positive_int, default=None,
        help="query heads of the layer on one rank (after tensor parallelism); with "
             "--num-kv-heads it picks the measured cases of the same head counts in a ranking "
             "(it changes no backend's validity)")),
    "num_kv_heads": ("--num-kv-heads", dict(
        type=positive_int, default=None,
        help="KV heads of the layer on one rank, e.g. 1 for Llama-3-70B at TP 8")),
}

#: Options people reach for that are no part of selection, and why (argparse alone would
#: answer "unrecognized arguments").
_NOT_SELECTION_FLAGS = {
    "--sliding-window": "a sliding window is the layer's (AttentionImpl(sliding_window=N)), "
                        "not the selector's: every non-MLA backend applies one and MLA "
                        "backends refuse one, so it changes no choice; leave it out (add --mla "
                        "to see the MLA backends)",
    "--logits-soft-cap": "the cap's value is the layer's (AttentionImpl(logits_soft_cap=C)); "
                         "what selection needs is whether there is one: use --soft-cap",
}


def _model_bench_options(p: argparse.ArgumentParser, budget_default: float) -> None:
    """The options ``bench --model`` and ``tune`` share."""
    p.add_argument("--model", action="append", default=None, choices=BENCH_MODEL_CHOICES,
                   metavar="NAME",
                   help="a model preset's attention shapes per rank (repeatable): "
                        f"{', '.join(BENCH_MODEL_CHOICES)}")
    p.add_argument("--small", action="store_true",
                   help="with --model: few heads and small steps, for a CPU in seconds "
                        "(default on a CPU for tune)")
    p.add_argument("--kv-cache-dtype", action="append", default=None, dest="kv_cache_dtypes",
                   type=_kv_cache_dtype_name, choices=KV_CACHE_DTYPE_CHOICES,
                   help="with --model: KV-cache dtypes to time (repeatable; default: auto and "
                        "fp8_e4m3)")
    p.add_argument("--block-size", action="append", default=None, dest="block_sizes",
                   type=positive_int,
                   help="with --model: block sizes to time (repeatable; default: 16 and 64)")
    p.add_argument("--phase", action="append", default=None, dest="phases",
                   choices=PHASES,
                   help="with --model: steps to time (repeatable; default: all)")
    p.add_argument("--budget-s", type=float, default=budget_default,
                   help="with --model: stop starting new steps after this many seconds (0: no "
                        "limit; default: %(default)s)")


def build_parser(with_kernels_options: bool = True) -> argparse.ArgumentParser:
    """The ``kvcore`` parser; without ``with_kernels_options`` the ``kernels`` command has no
    options yet (and nothing imports torch)."""
    parser = argparse.ArgumentParser(
        prog="kvcore",
        description="Inspect kvcore's attention backends, plugins, platform selection and "
                    "KV-cache layouts; run the end-to-end demo and the benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"kvcore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_format(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--format", choices=("table", "json"), default="table",
                       help="output: a table for people (default) or JSON for programs")
        return p

    lst = with_format(sub.add_parser("list",
                                     help="registered attention backends and capabilities"))
    lst.add_argument("--wide", action="store_true",
                     help="also the plugin, cross-layer, kv-connector and cuda-graph columns")
    with_format(sub.add_parser("plugins", help="loaded plugins, versions and load errors"))
    with_format(sub.add_parser("collect-env", help="machine and installation facts"))

    sel = with_format(sub.add_parser(
        "select", help="which backend a config gets, and why the others were rejected"))
    sel.add_argument("--explain", action="store_true",
                     help="print every candidate with its rejection reasons, and why the "
                          "selected one won")
    for dest, (flag, options) in SELECT_CONFIG_FLAGS.items():
        sel.add_argument(flag, dest=dest, **options)
    sel.add_argument("--platform", default=None,
                     help="platform name, e.g. cpu, cuda, rocm (default: detected, or "
                          "KVCORE_PLATFORM); need not be present here")
    sel.add_argument("--capability", default=None,
                     help="device capability to simulate: 9.0 style on CUDA, gfx942 style on "
                          "ROCm (default: the device's, or KVCORE_DEVICE_CAPABILITY)")
    sel.add_argument("--backend", default=None,
                     help="force a backend by name (see kvcore list); it is never replaced "
                          "silently")

    demo = with_format(sub.add_parser(
        "demo", help="serve a small model end to end: select, allocate, batch, offload, "
                     "reload prefixes, and check every token"))
    demo.add_argument("--model", default="small", choices=tuple(MODEL_PRESETS),
                      help="model size (tiny/small: seconds on a CPU; medium/large: a GPU)")
    demo.add_argument("--batch", type=_int_between(1, 1024, _DEMO_MAX), default=8,
                      help="requests per batch (two batches; default: %(default)s)")
    demo.add_argument("--new-tokens", type=_int_between(1, 4096, _DEMO_MAX), default=16,
                      help="most tokens generated per request (default: %(default)s)")
    demo.add_argument("--max-num-seqs", type=_int_between(1, 1024, _DEMO_MAX), default=4,
                      help="most requests in one step (the rest wait: continuous batching; "
                           "default: %(default)s)")
    demo.add_argument("--block-size", type=_int_between(1, 1024, _DEMO_MAX), default=16,
                      help="tokens per KV-cache block (default: %(default)s)")
    demo.add_argument("--dtype", default=None, type=_dtype_name,
                      choices=MODEL_DTYPE_CHOICES,
                      help="the model's dtype: %(choices)s (default: the first of float32, "
                           "bfloat16, float16 that the selected backend supports)")
    demo.add_argument("--platform", default=None,
                      help="platform to run on (default: detected); must be present")
    demo.add_argument("--backend", default=None,
                      help="force a backend by name (default: the platform's pick)")
    demo.add_argument("--seed", type=_int_between(0, 2**32 - 1, "seeds are 32-bit"),
                      default=0,
                      help="seed of weights and prompts (default: %(default)s)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--corrupt-loaded-block", action="store_true",
                      help="self-test: overwrite a block after it is loaded back, to see the "
                           "checks fail (exit status 1)")
    demo.add_argument("--disaggregated", action="store_true",
                      help="prefill in a second process and decode here, the KV read through "
                           "the --transport connector; tokens checked against one engine alone")
    demo.add_argument("--transport", default="nixl", choices=("nixl", "mooncake"),
                      help="--disaggregated: the connector the KV moves through: nixl (needs "
                           "kvcore[nixl]) or mooncake (needs kvcore[mooncake]) (default: "
                           "%(default)s)")
    demo.add_argument("--prefill-device", default=None, metavar="DEVICE",
                      help="--disaggregated: the prefill engine's device, e.g. cuda:0 "
                           "(default: the platform's first device)")
    demo.add_argument("--decode-device", default=None, metavar="DEVICE",
                      help="--disaggregated: the decode engine's device, e.g. cuda:1 "
                           "(default: the platform's first device)")
    demo.add_argument("--prefill-backend", default=None, metavar="BACKEND",
                      help="--disaggregated: the prefill engine's backend (default: "
                           "--backend's); --backend and --block-size are the decode engine's")
    demo.add_argument("--prefill-block-size", type=_int_between(1, 1024, _DEMO_MAX),
                      default=None, metavar="N",
                      help="--disaggregated: the prefill engine's block size (default: "
                           "--block-size); the decode engine's connector converts the prefill "
                           "engine's blocks (block size, layout) on load")
    demo.add_argument("--prefill-tp", type=_int_between(1, 64, _DEMO_TP_MAX), default=1,
                      metavar="N",
                      help="--disaggregated: the prefill engine's tensor-parallel degree, "
                           "ranks simulated in its process by KV head slices (default: "
                           "%(default)s)")
    demo.add_argument("--decode-tp", type=_int_between(1, 64, _DEMO_TP_MAX), default=1,
                      metavar="N",
                      help="--disaggregated: the decode engine's tensor-parallel degree "
                           "(default: %(default)s); each decode rank reads its heads from the "
                           "prefill ranks that hold them")
    demo.add_argument("--timeout-s", type=float, default=None, metavar="SECONDS",
                      help="--disaggregated: how long the prefill engine holds its published "
                           "blocks for the decode engine (from once both engines have built "
                           "their kernels), and the bound of the two processes' waits for each "
                           "other (default: 60)")

    warm = with_format(sub.add_parser(
        "warmup", help="build ahead what the selected backend needs for a demo model's shapes "
                       "(JIT modules, kernel compiles) and say where it is cached"))
    warm.add_argument("--model", default="small", choices=tuple(MODEL_PRESETS),
                      help="the shapes: a kvcore demo model (default: %(default)s)")
    warm.add_argument("--dtype", default=None, type=_dtype_name, choices=MODEL_DTYPE_CHOICES,
                      help="the model's dtype: %(choices)s (default: the demo's choice)")
    warm.add_argument("--block-size", type=_int_between(1, 1024, _DEMO_MAX), default=16,
                      help="tokens per KV-cache block (default: %(default)s)")
    warm.add_argument("--max-num-seqs", type=_int_between(1, 1024, _DEMO_MAX), default=4,
                      help="most requests in one step (default: %(default)s)")
    warm.add_argument("--platform", default=None,
                      help="platform to build for (default: detected); must be present")
    warm.add_argument("--backend", default=None,
                      help="force a backend by name (default: the platform's pick)")

    bench = with_format(sub.add_parser(
        "bench", help="kernels, cache writes and connector throughput against ceilings "
                      "measured in the same run"))
    bench.add_argument("--size", default=None, choices=BENCH_SIZE_CHOICES,
                       help="shapes: small (default on a CPU) or full (default on a GPU)")
    bench.add_argument("--dtype", default=None, type=_dtype_name, choices=MODEL_DTYPE_CHOICES,
                       help="model dtype (default: float32 on a CPU, bfloat16 on a GPU)")
    bench.add_argument("--platform", default=None,
                       help="platform to measure (default: detected); must be present")
    bench.add_argument("--plot", metavar="FILE.png", default=None,
                       help="bar chart of achieved bandwidth against its ceiling per case")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    _model_bench_options(bench, budget_default=0.0)

    tune = with_format(sub.add_parser(
        "tune", help="time the valid backends on this machine for model presets and write the "
                     "ranking the selector follows here"))
    _model_bench_options(tune, budget_default=300.0)
    tune.add_argument("--output", metavar="PATH", default=None,
                      help="the ranking file to write (default: KVCORE_RANKING_FILE, else "
                           "~/.cache/kvcore/ranking.json); other devices' rankings in it stay")
    tune.add_argument("--platform", default=None,
                      help="platform to measure (default: detected); must be present")
    tune.add_argument("--replace", action="store_true",
                      help="drop this device's earlier cases (default: keep those this run "
                           "does not measure again, while the library versions are the same)")
    tune.add_argument("--num-heads", type=positive_int, default=None,
                      help="time an engine's own layer instead of a preset: query heads per "
                           "rank (with --num-kv-heads and --head-size)")
    tune.add_argument("--num-kv-heads", type=positive_int, default=None,
                      help="KV heads per rank of the engine's layer")
    tune.add_argument("--head-size", type=positive_int, default=None,
                      help="head size of the engine's layer")
    tune.add_argument("--sliding-window", type=positive_int, default=None,
                      help="sliding window of the engine's layer (default: none)")
    tune.add_argument("--dtype", default="bfloat16", type=_dtype_name,
                      choices=MODEL_DTYPE_CHOICES,
                      help="the engine's layer's dtype (default: %(default)s; presets keep their "
                           "own)")
    tune.add_argument("--verbose", action="store_true", help="also print every timing")

    lay = with_format(sub.add_parser(
        "layout", help="a backend's KV-cache shapes, strides and where its blocks lie"))
    lay.add_argument("backend", nargs="?",
                     help="backend name, e.g. TRITON_ATTN (see kvcore list)")
    lay.add_argument("--convert", nargs=2, metavar=("SRC", "DST"), default=None,
                     help="print the plan that converts SRC's cache into DST's instead, each "
                          "BACKEND[:key=value,...] with keys block_size, cross_layer (yes/no), "
                          "tp (DEGREE/RANK; --num-kv-heads counts all ranks) and dtype, e.g. "
                          "TRITON_ATTN:block_size=16 FLASHINFER:block_size=64,tp=2/1")
    lay.add_argument("--cross-layer", action="store_true",
                     help="the cross-layer allocation (all layers of a block contiguous); "
                          "only for backends that opt in")
    lay.add_argument("--vllm-layout", metavar="NAME", default=None,
                     help="vLLM's named layout instead of the backend's own (LBHNC, LBNHC, "
                          "LHBNC, BLHNC, BLNHC, BHLNC: what the backend adopts from vLLM); "
                          "only one the backend reads")
    lay.add_argument("--plot", metavar="FILE.png", default=None,
                     help="draw where each layer's K and V of the first blocks lie")
    lay.add_argument("--num-layers", type=_int_between(1, 1024, "models have fewer layers"),
                     default=4,
                     help="layers in the allocation (default: %(default)s)")
    lay.add_argument("--num-blocks",
                     type=_int_between(1, _BLOCK_ID_MAX, "block tables hold int32 block ids"),
                     default=8,
                     help="blocks per layer (default: %(default)s)")
    lay.add_argument("--block-size", type=positive_int, default=16,
                     help="tokens per block (default: %(default)s)")
    lay.add_argument("--num-kv-heads", type=positive_int, default=None,
                     help="KV heads (default: 2; MLA: 1)")
    lay.add_argument("--head-size", type=positive_int, default=None,
                     help="size of one head (default: 128; MLA: 576, the latent)")
    lay.add_argument("--dtype", default="bfloat16", type=_cache_dtype_name,
                     choices=CACHE_DTYPE_CHOICES,
                     help="the cache's element type: %(choices)s (select's names fp8, "
                          "fp8_e4m3 and fp8_e5m2 work too; default: %(default)s)")
    lay.add_argument("--show-layers", type=_int_between(1, 32, "a readable table or picture"),
                     default=4,
                     help="layers in the block table and the picture (default: %(default)s)")
    lay.add_argument("--show-blocks", type=_int_between(1, 32, "a readable table or picture"),
                     default=3,
                     help="blocks per layer in the block table and the picture "
                          "(default: %(default)s)")
    kernels = sub.add_parser(
        "kernels", help="compile every Triton kernel for real GPUs (sm80/90/100, gfx942/950) "
                        "and check registers, spills and shared memory")
    if with_kernels_options:
        # The compile check (kvcore.testing.compile_check) owns the options; it imports torch,
        # so they are added only when this command runs (or shows its own --help).
        from kvcore.testing import compile_check

        compile_check.add_arguments(kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvcore`` with ``argv`` (default: the process's arguments); returns the exit
    status: 0; 1 when a command's checks failed or the ``kvcore[cli]`` extra is missing; 2 for
    bad arguments or input."""
    missing = _missing_cli_dependencies()
    if missing:
        print(f"error: the kvcore command needs {', '.join(missing)}: "
              "pip install 'kvcore[cli]'", file=sys.stderr)
        return 1
    argv = sys.argv[1:] if argv is None else argv
    # The top level takes no option with a value: its first word that is no option is the
    # command.
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command == "select":
        for arg in argv:
            why = _NOT_SELECTION_FLAGS.get(arg.split("=")[0])
            if why:
                print(f"kvcore select: error: {arg.split('=')[0]}: {why}", file=sys.stderr)
                return 2
    args = build_parser(with_kernels_options=command == "kernels").parse_args(argv)
    from kvcore.cli.commands import COMMANDS

    try:
        return COMMANDS[args.command](args)
    except (ValueError, TypeError) as exc:
        print(f"error: {in_cli_words(str(exc), args.command)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away, e.g. `kvcore list | head`
        # Python flushes stdout at exit; point it at devnull so that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
