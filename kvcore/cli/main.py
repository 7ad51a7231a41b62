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

from kvcore import AttentionType, __version__
from kvcore.demo.config import MODEL_PRESETS

__all__ = ["CLI_DEPENDENCIES", "KV_CACHE_DTYPE_CHOICES", "build_parser", "main"]

#: ``--kv-cache-dtype`` values: kvcore's ``KV_CACHE_DTYPES`` (a test keeps the two equal),
#: spelled out here because the module that defines them imports torch.
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: Import names of the ``kvcore[cli]`` extra the commands need.
CLI_DEPENDENCIES = ("tabulate", "tqdm")


def _missing_cli_dependencies() -> list[str]:
    return [name for name in CLI_DEPENDENCIES if importlib.util.find_spec(name) is None]


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
        p.add_argument("--format", choices=("table", "json"), default="table")
        return p

    with_format(sub.add_parser("list", help="registered attention backends and capabilities"))
    with_format(sub.add_parser("plugins", help="loaded plugins, versions and load errors"))
    with_format(sub.add_parser("collect-env", help="machine and installation facts"))

    sel = with_format(sub.add_parser(
        "select", help="which backend a config gets, and why the others were rejected"))
    sel.add_argument("--explain", action="store_true",
                     help="print every candidate with its rejection reasons")
    sel.add_argument("--head-size", type=int, default=128)
    sel.add_argument("--dtype", default="bfloat16")
    sel.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    sel.add_argument("--block-size", type=int, default=16)
    sel.add_argument("--mla", action="store_true", help="an MLA layer")
    sel.add_argument("--sink", action="store_true", help="attention sinks")
    sel.add_argument("--sparse", action="store_true", help="sparse attention")
    sel.add_argument("--non-causal", action="store_true")
    sel.add_argument("--batch-invariant", action="store_true")
    sel.add_argument("--attn-type", default="decoder", choices=[t.value for t in AttentionType])
    sel.add_argument("--kv-connector", action="store_true", help="a KV connector is in use")
    sel.add_argument("--platform", default=None,
                     help="platform name (default: detected, or KVCORE_PLATFORM)")
    sel.add_argument("--capability", default=None,
                     help="device capability to simulate, e.g. 9.0 or gfx942")
    sel.add_argument("--backend", default=None, help="force a backend by name")

    demo = with_format(sub.add_parser(
        "demo", help="serve a small model end to end: select, allocate, batch, offload, "
                     "reload prefixes, and check every token"))
    demo.add_argument("--model", default="small", choices=tuple(MODEL_PRESETS),
                      help="model size (tiny/small: seconds on a CPU; medium/large: a GPU)")
    demo.add_argument("--batch", type=int, default=8, help="requests per batch (two batches)")
    demo.add_argument("--new-tokens", type=int, default=16,
                      help="most tokens generated per request")
    demo.add_argument("--max-num-seqs", type=int, default=4,
                      help="most requests in one step (the rest wait: continuous batching)")
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    demo.add_argument("--platform", default=None,
                      help="platform to run on (default: detected); must be present")
    demo.add_argument("--backend", default=None, help="force a backend by name")
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--corrupt-loaded-block", action="store_true",
                      help="self-test: overwrite a block after it is loaded back, to see the "
                           "checks fail (exit status 1)")

    bench = with_format(sub.add_parser(
        "bench", help="kernels, cache writes and connector throughput against ceilings "
                      "measured in the same run"))
    bench.add_argument("--size", default=None,
                       help="shapes: small (default on a CPU) or full (default on a GPU)")
    bench.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                       help="model dtype (default: float32 on a CPU, bfloat16 on a GPU)")
    bench.add_argument("--platform", default=None,
                       help="platform to measure (default: detected); must be present")
    bench.add_argument("--plot", metavar="FILE.png", default=None,
                       help="bar chart of achieved bandwidth against its ceiling per case")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")

    lay = with_format(sub.add_parser(
        "layout", help="a backend's KV-cache shapes, strides and where its blocks lie"))
    lay.add_argument("backend", help="backend name, e.g. TRITON_ATTN (see kvcore list)")
    lay.add_argument("--cross-layer", action="store_true",
                     help="the cross-layer allocation (all layers of a block contiguous)")
    lay.add_argument("--plot", metavar="FILE.png", default=None,
                     help="draw where each layer's K and V of the first blocks lie")
    lay.add_argument("--num-layers", type=int, default=4)
    lay.add_argument("--num-blocks", type=int, default=8)
    lay.add_argument("--block-size", type=int, default=16)
    lay.add_argument("--num-kv-heads", type=int, default=None, help="default 2 (MLA: 1)")
    lay.add_argument("--head-size", type=int, default=None, help="default 128 (MLA: 576)")
    lay.add_argument("--dtype", default="bfloat16")
    lay.add_argument("--show-layers", type=int, default=4, help="layers in the block table "
                     "and the picture")
    lay.add_argument("--show-blocks", type=int, default=3, help="blocks per layer in the "
                     "block table and the picture")
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
    args = build_parser(with_kernels_options=command == "kernels").parse_args(argv)
    from kvcore.cli.commands import COMMANDS

    try:
        return COMMANDS[args.command](args)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away, e.g. `kvcore list | head`
        # Python flushes stdout at exit; point it at devnull so that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
