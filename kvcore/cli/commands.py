"""The ``kvcore`` subcommands: what is installed, what would be picked and why; and the
end-to-end demo, the benchmarks and the layout view (``demo``, ``bench``, ``layout``), whose
code lives in :mod:`kvcore.demo`, :mod:`kvcore.cli.bench` and :mod:`kvcore.cli.layout_view`
and is imported only when those commands run. :mod:`kvcore.cli.main` parses the arguments and
imports this module (and with it torch) only once a command runs.

Every listing prints a flat, greppable table by default and JSON with ``--format json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as py_platform
import sys
from dataclasses import fields
from importlib import metadata
from typing import Any

from tabulate import tabulate

import kvcore
from kvcore import AttentionSelectorConfig, DeviceCapability
from kvcore.cli.words import in_cli_words


def _emit(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        print(table)


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


def _check_backend_name(name: str, flag: str) -> str:
    """``name`` if a plugin registered that backend, else a ``ValueError`` naming ``flag``
    (what the user typed) and the valid names."""
    registry = kvcore.backend_registry()
    if name not in registry:
        raise ValueError(f"{flag} {name}: unknown attention backend; valid names: "
                         f"{', '.join(registry.names())} (kvcore list describes them)")
    return name


def _check_platform_name(name: str, *, present: bool) -> str:
    """``--platform name`` checked: registered, and present here when the command runs real
    kernels; else a ``ValueError`` naming the flag."""
    registry = kvcore.platform_registry()
    if name not in registry:
        raise ValueError(f"--platform {name}: unknown platform {name!r}; valid options are: "
                         f"{', '.join(registry.names())}")
    if present:
        why_absent = kvcore.get_platform(name).probe()
        if why_absent is not None:
            raise ValueError(f"--platform {name}: not present on this machine ({why_absent}); "
                             "this command runs real kernels, so choose a platform that is "
                             "present (kvcore collect-env lists them)")
    return name


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
    _emit(args, rows, _list_table(rows, args.wide))
    return 0


#: Short dtype names for ``kvcore list``'s narrow table.
_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _list_table(rows: list[dict[str, Any]], wide: bool) -> str:
    """``kvcore list``'s table: what selection turns on, in about 100 columns; ``wide`` adds
    the plugin, cross-layer, connector and CUDA-graph columns and full dtype names. Backends
    that failed to load are listed under the table."""
    def dtypes(r: dict[str, Any]) -> str:
        names = r.get("dtypes", [])
        return ", ".join(names if wide else [_SHORT_DTYPES.get(n, n) for n in names]) or "-"

    # (header, cell, the narrow table's most characters a line; longer cells wrap)
    columns: list[tuple[str, Any, int | None]] = [
        ("backend", lambda r: r["name"], None),
        *([("plugin", lambda r: r["plugin"], None)] if wide else []),
        ("platforms", lambda r: ",".join(r.get("platforms", [])) or "-", None),
        ("mla", lambda r: _yes_no(r.get("mla", False)), None),
        ("dtypes", dtypes, 10),
        ("kv-cache dtypes", lambda r: ", ".join(r.get("kv_cache_dtypes", [])) or "-", 15),
        ("head sizes", lambda r: r.get("head_sizes", "-"), 20),
        ("block sizes", lambda r: r.get("block_sizes", "-"), 15),
        *([("cross-layer", lambda r: _yes_no(r.get("cross_layer", False)), None),
           ("kv-connector", lambda r: _yes_no(r.get("kv_connector", False)), None),
           ("cuda graphs", lambda r: r.get("cuda_graphs", "-"), None)] if wide else []),
    ]
    table = tabulate([[cell(r) for _, cell, _ in columns] for r in rows],
                     headers=[name for name, _, _ in columns],
                     maxcolwidths=None if wide else [width for _, _, width in columns])
    errors = [f"  {r['name']}: {r['error']}" for r in rows if r["error"]]
    if errors:
        table += "\n\nfailed to load:\n" + "\n".join(errors)
    if not wide:
        table += ("\n\n--wide adds the plugin, cross-layer, kv-connector and cuda-graph "
                  "columns; --format json has every capability")
    return table


def cmd_plugins(args: argparse.Namespace) -> int:
    infos = kvcore.list_plugins()
    for name in kvcore.backend_registry().names():  # a class that fails to load (import or
        try:                                       # declarations) becomes its plugin's error
            kvcore.resolve_backend(name)
        except (kvcore.ResolveError, kvcore.DuplicateRegistrationError):
            pass
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
    status = kvcore.plugin_status_reports()
    if status:
        table += "\n\nstatus:\n" + "\n".join(
            f"  {name}.{fact}: {value}" for name, facts in status.items()
            for fact, value in facts.items())
    if registration_errors:
        table += "\n\nregistration errors:\n" + "\n".join(
            f"  {e['plugin']} ({e['registry']}): {e['error']}" for e in registration_errors
        )
    _emit(args, {"plugins": [i.to_dict() for i in infos], "status": status,
                 "registration_errors": registration_errors}, table)
    return 0


def _config_from_args(args: argparse.Namespace) -> AttentionSelectorConfig:
    """The config from ``select``'s flags, one per field (``SELECT_CONFIG_FLAGS``); combinations
    no layer can have are a ``ValueError`` naming the flags and the fix."""
    values = {f.name: getattr(args, f.name) for f in fields(AttentionSelectorConfig)}
    if values["head_size"] is None:  # an MLA layer's head is its latent: kv_lora_rank + rope
        values["head_size"] = 576 if values["use_mla"] else 128
    if values["use_per_head_quant_scales"] and values["kv_cache_dtype"] == "auto":
        raise ValueError(
            "--per-head-quant-scales: per-head scales quantise an fp8 KV cache, and "
            "--kv-cache-dtype is auto (the model's dtype, unscaled); add --kv-cache-dtype fp8 "
            "(or fp8_e4m3, fp8_e5m2), or leave out --per-head-quant-scales")
    bidirectional = ("--non-causal" if values["use_non_causal"] else
                     f"--attn-type {values['attn_type']}" if values["attn_type"] != "decoder"
                     else None)
    if values["use_mm_prefix"] and bidirectional:
        raise ValueError(
            f"--mm-prefix with {bidirectional}: a multimodal prefix is attended "
            "bidirectionally inside a causal decoder layer, and this layer is not causal at "
            f"all; leave out --mm-prefix or {bidirectional}")
    return AttentionSelectorConfig(**values)


def cmd_select(args: argparse.Namespace) -> int:
    if args.backend:
        _check_backend_name(args.backend, "--backend")
    if args.platform:
        _check_platform_name(args.platform, present=False)
    if not args.capability:
        return _select(args)
    _check_capability(args.capability, args.platform)
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


def _check_capability(text: str, platform_name: str | None) -> None:
    """``--capability text`` parsed and checked against the platform it simulates (a gfx name
    on cuda, a CUDA capability on rocm or any on cpu is a ``ValueError`` naming both)."""
    try:
        capability = DeviceCapability.parse(text)
    except ValueError as exc:
        raise ValueError(f"--capability {text}: {exc}") from None
    platform = (kvcore.get_platform(platform_name) if platform_name
                else kvcore.current_platform())
    why_not = platform.check_device_capability(capability)
    if why_not is None:
        return
    where = f"--platform {platform.name}" if platform_name else f"platform {platform.name}"
    fix = (f"give one of {platform.name}'s, e.g. --capability {platform.CAPABILITY_EXAMPLE}, "
           "or the --platform it belongs to" if platform.CAPABILITY_EXAMPLE
           else "leave out --capability, or simulate a GPU with --platform cuda or rocm")
    raise ValueError(f"--capability {text} does not belong to {where}: {why_not}; {fix}")


def _capability_note(report: kvcore.SelectionReport) -> str | None:
    """When backends were rejected only for want of a device capability: how to give one
    (nothing on a platform without capabilities, such as the CPU)."""
    example = kvcore.get_platform(report.platform).CAPABILITY_EXAMPLE
    if example is None or report.device_capability is not None or not any(
            r.startswith("device capability unknown") for c in report.candidates
            for r in c.reasons):
        return None
    return (f"note: {report.platform}'s device capability is unknown (no {report.platform} "
            "device here to ask), so backends that need one are rejected; pass --capability "
            f"to simulate a device, e.g. --capability {example}")


def _select(args: argparse.Namespace) -> int:
    config = _config_from_args(args)
    report = kvcore.explain_selection(config, args.platform, args.backend)
    note = _capability_note(report)
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2))
    elif args.explain:
        print(in_cli_words(report.format(), "select"))
        if note:
            print(note)
    elif report.selected:
        print(report.selected.name)
        if note:
            print(note, file=sys.stderr)
    if report.selected is None:
        if args.format != "json" and report.forced:
            # The forced backend's own reasons and what would run instead; --explain has
            # printed them at the top of the report already.
            refusal = "" if args.explain else "\n".join(report.refusal_lines()[1:])
            others = report.alternatives()
            fix = (f"pass --backend {others[0]}, or leave out --backend for "
                   f"{report.platform}'s pick" if others else
                   "kvcore select --explain without --backend lists every backend's reasons")
            print(f"error: backend {report.forced} cannot run this config on "
                  f"{report.platform}" + (f":\n{in_cli_words(refusal, 'select')}" if refusal
                                          else "") + f"\n{fix}", file=sys.stderr)
        elif args.format != "json":
            reasons = in_cli_words(report.format(), "select") if not args.explain else ""
            print(f"error: no backend can run this config on {report.platform}" +
                  (f"\n{reasons}" if reasons else "") +
                  (f"\n{note}" if note and not args.explain else ""), file=sys.stderr)
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
        # What plugins say about themselves (compiled extensions, kernel choices), flattened.
        "plugin_status": {f"{name}.{fact}": value for name, facts in
                          kvcore.plugin_status_reports().items() for fact, value in facts.items()},
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("KVCORE_", "TRITON_INTERPRET", "CUDA_VISIBLE"))},
    }


def cmd_collect_env(args: argparse.Namespace) -> int:
    env = collect_env()
    lines = []
    for key, value in env.items():
        if isinstance(value, dict) and not value:
            lines.append(f"{key}: (none set)")
        elif isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            lines.append(f"{key}: {', '.join(value) or 'none'}")
        else:
            lines.append(f"{key}: {value}")
    _emit(args, env, "\n".join(lines))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.disaggregated:
        return _demo_disaggregated(args)
    if args.prefill_device or args.decode_device or args.prefill_backend \
            or args.prefill_block_size or args.prefill_tp != 1 or args.decode_tp != 1 \
            or args.timeout_s is not None:
        raise ValueError("--prefill-device, --decode-device, --prefill-backend, "
                         "--prefill-block-size, --prefill-tp and --decode-tp set up the two "
                         "engines of --disaggregated, and --timeout-s bounds their waits for "
                         "each other; add --disaggregated or drop them")
    from kvcore.demo.scenario import DemoOptions, run_demo_cli

    if args.backend:
        _check_backend_name(args.backend, "--backend")
    if args.platform:
        _check_platform_name(args.platform, present=True)
    options = DemoOptions(
        model=args.model, batch=args.batch, max_new_tokens=args.new_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, dtype=args.dtype,
        platform=args.platform, backend=args.backend, seed=args.seed,
        progress=not args.no_progress, corrupt_loaded_block=args.corrupt_loaded_block,
    )
    return run_demo_cli(options, args.format)


def _demo_disaggregated(args: argparse.Namespace) -> int:
    from kvcore.demo.disagg import DisaggOptions, default_dtype, format_result, run_disaggregated

    for name, value in (("--backend", args.backend), ("--prefill-backend", args.prefill_backend)):
        if value:
            _check_backend_name(value, name)

    result = run_disaggregated(DisaggOptions(
        model=args.model, batch=args.batch, max_new_tokens=args.new_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size,
        dtype=args.dtype or default_dtype(args.backend, args.prefill_backend),
        platform=args.platform, backend=args.backend, seed=args.seed,
        prefill_device=args.prefill_device, decode_device=args.decode_device,
        transport=args.transport, prefill_backend=args.prefill_backend,
        prefill_block_size=args.prefill_block_size, prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        timeout_s=DisaggOptions.timeout_s if args.timeout_s is None else args.timeout_s))
    _emit(args, result.to_dict(), format_result(result))
    return 0 if result.ok else 1


def cmd_warmup(args: argparse.Namespace) -> int:
    from kvcore.demo.warmup import WarmupOptions, format_warmup, run_warmup

    if args.backend:
        _check_backend_name(args.backend, "--backend")
    if args.platform:
        _check_platform_name(args.platform, present=True)
    result = run_warmup(WarmupOptions(
        model=args.model, dtype=args.dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, platform=args.platform, backend=args.backend))
    _emit(args, result.to_dict(), format_warmup(result))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvcore.cli.bench import BenchOptions, run_bench_cli

    if args.platform:
        _check_platform_name(args.platform, present=True)
    if args.model:
        return _bench_models(args)
    used = [flag for flag, value in (("--small", args.small), ("--phase", args.phases),
                                     ("--kv-cache-dtype", args.kv_cache_dtypes),
                                     ("--block-size", args.block_sizes),
                                     ("--budget-s", args.budget_s)) if value]
    if used:
        raise ValueError(f"{', '.join(used)} choose what bench --model times; add --model NAME "
                         "or leave them out")
    options = BenchOptions(size=args.size, dtype=args.dtype, platform=args.platform,
                           progress=not args.no_progress)
    return run_bench_cli(options, args.format, args.plot)


def _bench_models(args: argparse.Namespace) -> int:
    from kvcore.cli.model_bench import ModelBenchOptions, format_model_report, run_model_bench

    if args.plot or args.size:
        raise ValueError("--plot and --size are for the bench without --model; leave them out")
    log = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_model_bench(ModelBenchOptions(
        models=args.model, small=args.small, dtype=args.dtype, platform=args.platform,
        kv_cache_dtypes=args.kv_cache_dtypes or ModelBenchOptions.kv_cache_dtypes,
        block_sizes=args.block_sizes or ModelBenchOptions.block_sizes,
        phases=args.phases or ModelBenchOptions.phases, budget_s=args.budget_s,
        log=log))
    _emit(args, report.to_dict(), format_model_report(report))
    return 1 if any(r.error for r in report.rows) else 0


def cmd_tune(args: argparse.Namespace) -> int:
    from kvcore.cli.tune import TuneOptions, custom_preset, format_tune, run_tune

    if args.platform:
        _check_platform_name(args.platform, present=True)
    custom = (args.num_heads, args.num_kv_heads, args.head_size)
    models: list = list(args.model or [])
    if any(v is not None for v in custom):
        if None in custom:
            raise ValueError("--num-heads, --num-kv-heads and --head-size describe the engine's "
                             "own layer together; give all three (or --model NAME instead)")
        models.append(custom_preset(*custom, sliding_window=args.sliding_window,
                                    dtype=args.dtype))
    elif args.sliding_window is not None:
        raise ValueError("--sliding-window belongs to the engine's own layer; add --num-heads, "
                         "--num-kv-heads and --head-size, or leave it out")
    result = run_tune(TuneOptions(
        models=models, small=args.small or None, platform=args.platform, output=args.output,
        replace=args.replace,
        kv_cache_dtypes=args.kv_cache_dtypes or TuneOptions.kv_cache_dtypes,
        block_sizes=args.block_sizes or TuneOptions.block_sizes,
        phases=args.phases or TuneOptions.phases, budget_s=args.budget_s,
        progress=args.verbose))
    _emit(args, result.to_dict(), format_tune(result, verbose=args.verbose))
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    from kvcore.cli.layout_view import describe_layout, format_layout, plot_layout

    if args.convert:
        if args.backend or args.plot or args.cross_layer:
            raise ValueError("--convert SRC DST names both backends (cross_layer=yes inside "
                             "a side); leave out the BACKEND argument, --cross-layer and --plot")
        from kvcore.cli.convert_view import conversion_plan

        plan = conversion_plan(args)
        _emit(args, plan.to_dict(), str(plan))
        return 0
    if args.backend is None:
        raise ValueError("kvcore layout needs a BACKEND (e.g. TRITON_ATTN; see kvcore list), "
                         "or --convert SRC DST")
    if args.plot:
        from kvcore.cli.plotting import check_plot_path

        check_plot_path(args.plot)
    backend = kvcore.resolve_backend(_check_backend_name(args.backend, "layout"))
    if args.vllm_layout is not None:
        name = args.vllm_layout.upper()
        kvcore.vllm_layout_order(name)  # a ValueError listing the names for an unknown one
        if args.cross_layer:
            raise ValueError(f"--vllm-layout {name} fixes where the layers lie; leave out "
                             "--cross-layer")
        if name not in backend.supported_vllm_layouts():
            raise ValueError(
                f"--vllm-layout {name}: {backend.get_name()} does not read it; it reads "
                f"{', '.join(backend.supported_vllm_layouts()) or 'no vLLM layout'}")
        args.vllm_layout = name
    if args.cross_layer and not backend.supports_cross_layer():
        raise ValueError(
            f"--cross-layer: {backend.get_name()} does not opt in to cross-layer KV caches "
            f"(its get_kv_cache_stride_order(True) = "
            f"{tuple(backend.get_kv_cache_stride_order(True))} keeps layers outermost: its "
            "kernels are not declared safe on pages strided across layers); leave out "
            "--cross-layer for its per-layer layout")
    # MLA caches hold one latent vector per token: one "head" of kv_lora_rank + rope dims.
    if backend.IS_MLA and args.num_kv_heads not in (None, 1):
        raise ValueError(
            f"--num-kv-heads {args.num_kv_heads}: {backend.get_name()} is an MLA backend, whose "
            "cache holds one latent vector per token shared by all heads; leave out "
            "--num-kv-heads and give the latent size (kv_lora_rank + rope dims, e.g. 576) as "
            "--head-size")
    heads = args.num_kv_heads or (1 if backend.IS_MLA else 2)
    head_size = args.head_size or (576 if backend.IS_MLA else 128)
    if not kvcore.is_supported(head_size, backend.SUPPORTED_HEAD_SIZES):
        raise ValueError(
            f"--head-size {head_size}: {backend.get_name()} supports head sizes "
            f"{kvcore.format_supported(backend.SUPPORTED_HEAD_SIZES)}; pass one of those")
    view = describe_layout(
        backend, num_layers=args.num_layers, num_blocks=args.num_blocks,
        block_size=args.block_size, num_kv_heads=heads, head_size=head_size,
        dtype=args.dtype, cross_layer=args.cross_layer, show_layers=args.show_layers,
        show_blocks=args.show_blocks, vllm_layout=args.vllm_layout)
    _emit(args, view.to_dict(), format_layout(view))
    if args.plot:
        path = plot_layout(view, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    from kvcore.testing.compile_check import cmd_kernels as run

    return run(args)


#: ``kvcore <command>`` -> its function; each returns the exit status.
COMMANDS = {
    "list": cmd_list,
    "plugins": cmd_plugins,
    "select": cmd_select,
    "collect-env": cmd_collect_env,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "layout": cmd_layout,
    "kernels": cmd_kernels,
    "warmup": cmd_warmup,
    "tune": cmd_tune,
}
