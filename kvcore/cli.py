"""The ``kvcore`` command: what is installed, what would be picked and why; and the
end-to-end demo, the benchmarks and the layout view (``demo``, ``bench``, ``layout``), whose
code lives in :mod:`kvcore.demo`, :mod:`kvcore.bench` and :mod:`kvcore.layout_view` and is
imported only when those commands run.

Every listing prints a flat, greppable table by default and JSON with ``--format json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as py_platform
import sys
from importlib import metadata
from typing import Any

from tabulate import tabulate

import kvcore
from kvcore.config import AttentionSelectorConfig
from kvcore.demo_model import MODEL_PRESETS
from kvcore.ops.validation import KV_CACHE_DTYPES
from kvcore.platform_types import AttentionType, DeviceCapability


def _emit(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        print(table)


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


def cmd_list(args: argparse.Namespace) -> int:
    registry = kvcore.backend_registry()
    rows = []
    for name in registry.names():
        reg = registry.get(name)
        entry: dict[str, Any] = {"name": name, "plugin": reg.plugin, "target": reg.target}
        try:
            entry.update(kvcore.resolve_backend(name).capabilities())
            entry["error"] = None
        except Exception as exc:
            entry["error"] = str(exc)
        rows.append(entry)
    table = tabulate(
        [
            [r["name"], r["plugin"], ",".join(r.get("platforms", [])) or "-",
             _yes_no(r.get("cross_layer", False)), _yes_no(r.get("kv_connector", False)),
             _yes_no(r.get("mla", False)), r.get("cuda_graphs", "-"),
             ",".join(r.get("dtypes", [])), r.get("head_sizes", "-"), r["error"] or ""]
            for r in rows
        ],
        headers=["backend", "plugin", "platforms", "cross-layer", "kv-connector", "mla",
                 "cuda graphs", "dtypes", "head sizes", "error"],
    )
    _emit(args, rows, table)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    infos = kvcore.list_plugins()
    registration_errors = [
        {"registry": registry.kind, "plugin": plugin, "error": error}
        for registry in (kvcore.backend_registry(), kvcore.platform_registry(),
                         kvcore.connector_registry(), kvcore.block_copier_registry())
        for plugin, error in registry.errors
    ]
    table = tabulate(
        [[i.name, i.distribution or "-", i.version or "-", i.module, i.source, i.status,
          i.error or ""] for i in infos],
        headers=["plugin", "distribution", "version", "module", "source", "status", "error"],
    )
    if registration_errors:
        table += "\n\nregistration errors:\n" + "\n".join(
            f"  {e['plugin']} ({e['registry']}): {e['error']}" for e in registration_errors
        )
    _emit(args, {"plugins": [i.to_dict() for i in infos],
                 "registration_errors": registration_errors}, table)
    return 0


def _config_from_args(args: argparse.Namespace) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(
        head_size=args.head_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        use_mla=args.mla,
        has_sink=args.sink,
        use_sparse=args.sparse,
        attn_type=AttentionType(args.attn_type),
        use_non_causal=args.non_causal,
        use_batch_invariant=args.batch_invariant,
        use_kv_connector=args.kv_connector,
    )


def cmd_select(args: argparse.Namespace) -> int:
    if not args.capability:
        return _select(args)
    DeviceCapability.parse(args.capability)  # fail early with a clear message
    # The platform reads the capability from the environment; restore it afterwards so an
    # in-process caller of main() is not left simulating this device.
    previous = os.environ.get("KVCORE_DEVICE_CAPABILITY")
    os.environ["KVCORE_DEVICE_CAPABILITY"] = args.capability
    try:
        return _select(args)
    finally:
        if previous is None:
            os.environ.pop("KVCORE_DEVICE_CAPABILITY", None)
        else:
            os.environ["KVCORE_DEVICE_CAPABILITY"] = previous


def _select(args: argparse.Namespace) -> int:
    config = _config_from_args(args)
    report = kvcore.explain_selection(config, args.platform, args.backend)
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2))
    elif args.explain:
        print(report.format())
    elif report.selected:
        print(report.selected.name)
    if report.selected is None:
        if args.format != "json":
            reasons = report.format() if not args.explain else ""
            what = f"backend {report.forced} cannot" if report.forced else "no backend can"
            print(f"error: {what} run this config on {report.platform}" +
                  (f"\n{reasons}" if reasons else ""), file=sys.stderr)
        return 1
    return 0


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_env() -> dict[str, Any]:
    """Facts about this machine and installation, for bug reports."""
    import torch

    try:
        current = kvcore.current_platform()
        current_desc = current.describe()
    except Exception as exc:
        current_desc = f"error: {exc}"
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "kvcore": kvcore.__version__,
        "python": sys.version.split()[0],
        "os": py_platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "gpus": gpus,
        "packages": {name: _version(name) for name in
                     ("triton", "pluggy", "flash-attn", "flashinfer-python", "amd-aiter",
                      "numpy")},
        "platforms": {name: (reason or "present") for name, reason in
                      kvcore.available_platforms()},
        "current_platform": current_desc,
        "plugins": {i.name: i.status for i in kvcore.list_plugins()},
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("KVCORE_", "TRITON_INTERPRET", "CUDA_VISIBLE"))},
    }


def cmd_collect_env(args: argparse.Namespace) -> int:
    env = collect_env()
    lines = []
    for key, value in env.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            lines.append(f"{key}: {', '.join(value) or 'none'}")
        else:
            lines.append(f"{key}: {value}")
    _emit(args, env, "\n".join(lines))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvcore.demo import DemoOptions, run_demo_cli

    options = DemoOptions(
        model=args.model, batch=args.batch, max_new_tokens=args.new_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, dtype=args.dtype,
        platform=args.platform, backend=args.backend, seed=args.seed,
        progress=not args.no_progress, corrupt_loaded_block=args.corrupt_loaded_block,
    )
    return run_demo_cli(options, args.format)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvcore.bench import BenchOptions, run_bench_cli

    options = BenchOptions(size=args.size, dtype=args.dtype, platform=args.platform,
                           progress=not args.no_progress)
    return run_bench_cli(options, args.format, args.plot)


def cmd_layout(args: argparse.Namespace) -> int:
    from kvcore.layout_view import describe_layout, format_layout, plot_layout

    if args.plot:
        from kvcore.plotting import check_plot_path

        check_plot_path(args.plot)
    backend = kvcore.resolve_backend(args.backend)
    # MLA caches hold one latent vector per token: one "head" of kv_lora_rank + rope dims.
    heads = args.num_kv_heads or (1 if backend.IS_MLA else 2)
    head_size = args.head_size or (576 if backend.IS_MLA else 128)
    view = describe_layout(
        backend, num_layers=args.num_layers, num_blocks=args.num_blocks,
        block_size=args.block_size, num_kv_heads=heads, head_size=head_size,
        dtype=args.dtype, cross_layer=args.cross_layer, show_layers=args.show_layers,
        show_blocks=args.show_blocks)
    _emit(args, view.to_dict(), format_layout(view))
    if args.plot:
        path = plot_layout(view, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcore",
        description="Inspect kvcore's attention backends, plugins, platform selection and "
                    "KV-cache layouts; run the end-to-end demo and the benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"kvcore {kvcore.__version__}")
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
    sel.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
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
    # The Triton compile check; its options and command live in kvcore.testing.compile_check.
    from kvcore.testing import compile_check

    compile_check.add_arguments(sub.add_parser(
        "kernels", help="compile every Triton kernel for real GPUs (sm80/90/100, gfx942/950) "
                        "and check registers, spills and shared memory"))
    return parser


def cmd_kernels(args: argparse.Namespace) -> int:
    from kvcore.testing.compile_check import cmd_kernels as run

    return run(args)


_COMMANDS = {
    "list": cmd_list,
    "plugins": cmd_plugins,
    "select": cmd_select,
    "collect-env": cmd_collect_env,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "layout": cmd_layout,
    "kernels": cmd_kernels,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away, e.g. `kvcore list | head`
        # Python flushes stdout at exit; point it at devnull so that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
