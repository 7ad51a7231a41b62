"""Compile every Triton kernel ahead of time for real GPUs, on a machine without one.

Triton's wheel carries both GPU backends (the NVIDIA one with ``ptxas``, the AMD one with the
LLVM AMDGPU target and an in-process linker), so ``triton.compile`` turns a kernel into a
``cubin`` for ``sm_80``/``sm_90a``/``sm_100a`` or an ``hsaco`` for ``gfx942``/``gfx950`` on
any Linux machine. This module does that for every kernel kvcore and its plugins launch, at
the launch configurations the code really picks:

- Each owner (kvcore, each plugin) registers a *case provider* through the
  ``kvcore_register_kernel_compile_cases`` hook: a function that takes a
  :class:`CompileTarget` and returns :class:`KernelCase` objects. A case calls the op's public
  function with CPU tensors of a real model's shapes, after asking the op's own config chooser
  for the launch configuration on that target (its SM/CU count, NVIDIA or AMD). The
  provider's module may define ``KERNELS_BY_NAME``, a paragraph naming the owner's kernels
  (which row runs which), that ``docs/kernels.md`` prints under "Kernels by name".
- The checker runs each case with Triton's launcher replaced by a recorder, so the kernels,
  their arguments and their ``tl.constexpr`` values are exactly those of a real call; it
  specialises them as Triton's JIT would for the target (argument types, 16-byte alignment
  and divisibility) and compiles them with ``triton.compile(ASTSource(...), target=...)``.
- From the compiled kernel it reads registers and spills (``ptxas -v`` on NVIDIA, the code
  object's metadata on AMD) and the shared memory / LDS one program needs, and fails a kernel
  that does not compile, needs more shared memory than the target has (:attr:`CompileTarget.
  shared_memory_limit`), or spills (:data:`MAX_SPILLS`, justified in ``docs/kernels.md``).

Results are cached on disk (``$KVCORE_COMPILE_CACHE``, default
``~/.cache/kvcore/kernel-compile``), keyed by the kernel's source (Triton's ``cache_key``,
which covers every ``@triton.jit`` function it calls), the specialised signature, the
constexprs, the compile options, the target and the Triton version: an unchanged kernel is
never compiled twice. ``kvcore kernels`` is the command line; :func:`run_check` the API.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib
import io
import json
import multiprocessing
import os
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcore.platform_types import DeviceCapability

__all__ = [
    "MAX_SPILLS",
    "SUMMARY_LEGEND",
    "TARGETS",
    "CompileResult",
    "CompileTarget",
    "CompiledLaunch",
    "KernelCase",
    "capture_launches",
    "case_providers",
    "compile_cache_dir",
    "compile_launches",
    "format_markdown",
    "format_summary",
    "format_table",
    "parse_amdgcn_metadata",
    "parse_ptxas_log",
    "run_check",
]

#: Bytes of registers a kernel may spill per thread (NVIDIA: ``ptxas``' spill stores; AMD:
#: spilled VGPRs x 4 bytes of scratch per lane). 512 bytes is 128 registers, half of the 255
#: a thread can address: below it the spill is a few values kept across the key loop (the
#: configs tuned by sweeps on the H200, benchmarks/RESULTS.md, spill up to a few hundred
#: bytes); above it the tile's accumulator itself usually no longer fits (the 128-row
#: head_size 256 prefill tile that ``default_config`` avoids spills 2.9 KiB on sm_90, 3.3 KiB
#: on sm_100, 15.7 KiB on sm_80). A case may set its own :attr:`KernelCase.max_spills`.
MAX_SPILLS = 512


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """A GPU to compile for.

    ``shared_memory_limit`` is what one program (CTA / workgroup) may use, in bytes: the
    per-block opt-in maximum on NVIDIA, the LDS size on AMD. ``num_sms`` is the SM / CU count
    of ``device``, the reference part whose launch configurations are compiled (the split-KV
    choosers size their grids by it).
    """

    name: str
    backend: str  # "cuda" or "hip", as triton's GPUTarget names them
    arch: int | str
    warp_size: int
    shared_memory_limit: int
    num_sms: int
    device: str

    @property
    def is_rocm(self) -> bool:
        return self.backend == "hip"

    @property
    def device_capability(self) -> DeviceCapability:
        """The capability kvcore's backends validate against (``9.0``, ``gfx942``, ...)."""
        from kvcore.platform_types import DeviceCapability

        if self.is_rocm:
            return DeviceCapability.parse(str(self.arch))
        return DeviceCapability(int(self.arch) // 10, int(self.arch) % 10)

    def gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


_KIB = 1024
#: The targets CI compiles for, by name (``kvcore kernels --target NAME``).
TARGETS: dict[str, CompileTarget] = {t.name: t for t in (
    CompileTarget("sm80", "cuda", 80, 32, 163 * _KIB, 108, "A100"),
    CompileTarget("sm90", "cuda", 90, 32, 227 * _KIB, 132, "H100/H200"),
    CompileTarget("sm100", "cuda", 100, 32, 227 * _KIB, 148, "B200"),
    CompileTarget("gfx942", "hip", "gfx942", 64, 64 * _KIB, 304, "MI300X"),
    CompileTarget("gfx950", "hip", "gfx950", 64, 160 * _KIB, 256, "MI355X"),
)}


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One real call of an op, whose Triton launches are compiled.

    ``launch`` calls the op's public function (CPU tensors of the real shapes, the config its
    chooser picks for the target); it may launch several Triton functions (an attention kernel
    and its split merge), and returns the name of the kernel it ran (a config's ``kernel``,
    e.g. ``"triton_split_kv"``), which the tables list the functions under; ``None`` lists
    them under their function names. ``max_spills`` overrides :data:`MAX_SPILLS` for this
    case. ``skip`` says why the case does not apply to the target (the backend's own
    validation reason, e.g. fp8 before sm_89): it is listed, not compiled.
    """

    name: str
    launch: Callable[[], str | None]
    max_spills: int = MAX_SPILLS
    skip: str | None = None


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One recorded ``kernel[grid](*args, **kwargs)``."""

    fn: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class CompileResult:
    """One Triton function of one case compiled for one target, with what the check found.
    ``kernel``: the function's name; ``name``: the kernel the case ran (:class:`KernelCase`)."""

    owner: str
    case: str
    kernel: str
    target: str
    config: str = ""
    name: str = "-"
    key: str = ""  # the compile's cache key: equal keys are one compile
    registers: int | None = None
    spills: int | None = None
    shared: int | None = None
    shared_limit: int | None = None
    seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    skipped: str | None = None
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), ok=self.ok)


@contextlib.contextmanager
def capture_launches() -> Iterator[list[KernelLaunch]]:
    """Record Triton launches instead of running them (nothing is compiled or launched)."""
    from triton.runtime.jit import JITFunction

    from kvcore.ops import triton_utils
    from kvcore.ops.triton_utils import interpreting

    if interpreting():
        raise RuntimeError("TRITON_INTERPRET=1 is set: kernels are interpreted, not compiled; "
                           "unset it to run the compile check")
    launches: list[KernelLaunch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(KernelLaunch(self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    token = triton_utils._RECORDING.set(True)
    try:
        yield launches
    finally:
        triton_utils._RECORDING.reset(token)
        JITFunction.run = original


def case_providers() -> list[tuple[str, str, Callable]]:
    """``(owner, "module:function", provider)`` for every registered case provider."""
    from kvcore.registry import kernel_compile_case_registry

    registry = kernel_compile_case_registry()
    return [(name, registry.get(name).target, registry.resolve(name))
            for name in registry.names()]


def _import_path(path: str, name: str = "path") -> Any:
    """The object ``"module:qualname"`` names; ``ValueError`` naming ``name`` (the option or
    argument it came from) when it is malformed, cannot be imported or does not exist."""
    module, sep, attr = path.partition(":")
    if not (sep and module and attr):
        raise ValueError(f"{name} {path!r} is not MODULE:FUNCTION, e.g. "
                         "kvcore.testing.compile_cases:compile_cases")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{name} {path!r}: cannot import {module!r} ({exc}); name a module "
                         "that is installed or on PYTHONPATH") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{name} {path!r}: {module} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class _Job:
    key: str
    kernel: str  # "module:qualname" of the JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: CompileTarget


def _kernel_path(fn: Any) -> str:
    return f"{fn.fn.__module__}:{fn.fn.__qualname__}"


# Part of every cache key: bump it when what a cached result holds changes meaning.
_METRICS_VERSION = 2


def _specialize(launch: KernelLaunch, target: CompileTarget) -> _Job:
    """What Triton's JIT would compile for this launch on ``target``: its own binder and
    argument packing (``create_function_from_signature``, ``JITFunction._pack_args``, Triton
    internals that ``test_compile_check.py``'s slow tests exercise on every Triton upgrade)."""
    import triton
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(target.gpu_target())
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                         specialization, options)
    options = dict(options.__dict__)
    key_data = json.dumps([_METRICS_VERSION, fn.cache_key, signature,
                           sorted(map(repr, constexprs.items())),
                           sorted(map(repr, attrs.items())), sorted(map(repr, options.items())),
                           dataclasses.astuple(target), triton.__version__])
    key = hashlib.sha256(key_data.encode()).hexdigest()[:32]
    return _Job(key, _kernel_path(fn), signature, constexprs, attrs, options, target)


def _config_text(fn: Any, job: _Job) -> str:
    names = fn.arg_names
    shown = [f"{names[path[0]]}={value}" for path, value in sorted(job.constexprs.items())
             if re.search(r"BLOCK|PAD|SPLITS|STAGES", names[path[0]])
             and isinstance(value, int) and not isinstance(value, bool)]
    shown.append(f"w{job.options.get('num_warps')}/s{job.options.get('num_stages')}")
    return " ".join(shown)


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> tuple[int, int]:
    """(registers, spill store bytes) per thread from ``ptxas -v`` output."""
    regs = _PTXAS_REGS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    if regs is None or spills is None:
        raise ValueError(f"no register/spill report in the ptxas log: {log[-500:]!r}")
    return int(regs.group(1)), int(spills.group(1))


def parse_amdgcn_metadata(asm: str) -> tuple[int, int]:
    """(VGPRs + AGPRs, bytes of spilled VGPRs) per lane from the code object metadata in AMDGCN
    asm. SGPR spills are left out: they go to VGPR lanes, not to memory."""
    def field(name: str) -> int:
        match = re.search(rf"^\s*-?\s*\.{name}:\s+(\d+)", asm, re.MULTILINE)
        if match is None:
            raise ValueError(f".{name} missing from the AMDGCN metadata")
        return int(match.group(1))

    return field("vgpr_count") + field("agpr_count"), 4 * field("vgpr_spill_count")


def _triton_compile(fn: Any, job: _Job, log: io.StringIO) -> Any:
    """``fn`` compiled as ``job`` says, in a private Triton cache (so ptxas runs and writes its
    register report, with Triton's other output, to ``log``)."""
    import triton
    from triton import knobs

    with tempfile.TemporaryDirectory() as cache_dir, knobs.cache.scope(), \
            knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.cache.dir = cache_dir
        knobs.nvidia.dump_ptxas_log = True
        return triton.compile(_source_class(fn)(fn, job.signature, job.constexprs, job.attrs),
                              target=job.target.gpu_target(), options=job.options)


def _compile(job: _Job) -> dict[str, Any]:
    """Compile one job (in a worker process); metrics or the error."""
    log = io.StringIO()
    start = time.perf_counter()
    try:
        compiled = _triton_compile(_import_path(job.kernel), job, log)
        if job.target.is_rocm:
            registers, spills = parse_amdgcn_metadata(compiled.asm["amdgcn"])
        else:
            registers, spills = parse_ptxas_log(log.getvalue())
    except Exception as exc:  # a compile error is a result, reported per kernel
        message = f"{type(exc).__name__}: {exc}".strip()
        return {"error": message[-2000:], "seconds": time.perf_counter() - start}
    return {"registers": registers, "spills": spills, "shared": compiled.metadata.shared,
            "seconds": time.perf_counter() - start, "error": None}


def _source_class(fn: Any) -> Any:
    """Triton's compile source for ``fn``: Gluon kernels (``gluon.jit``) have their own."""
    from triton.compiler import ASTSource

    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    except ImportError:  # a Triton without Gluon
        return ASTSource
    return GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource


@dataclasses.dataclass(frozen=True)
class CompiledLaunch:
    """One Triton launch compiled ahead of time by :func:`compile_launches`: the kernel's
    name, its text stages by name (``ttir``, ``ttgir``, ``llir``, then ``ptx`` on NVIDIA or
    ``amdgcn`` on AMD), e.g. to check the layouts the compiler chose for a tile, and the bytes
    of shared memory a program of it takes (``shared``: explicit buffers and the compiler's
    scratch), e.g. to check a shared-memory bound a config check computes."""

    kernel: str
    asm: dict[str, str]
    shared: int


def compile_launches(launch: Callable[[], None],
                     target: str | CompileTarget) -> list[CompiledLaunch]:
    """Run ``launch`` (a call of ops that launch Triton kernels, on CPU tensors) with its
    launches recorded instead of run, and compile each for ``target`` (a name of
    :data:`TARGETS` or a :class:`CompileTarget`) ahead of time, no GPU needed, as ``kvcore
    kernels`` does. Needs ``TRITON_INTERPRET`` unset (a RuntimeError says so otherwise)."""
    resolved = target if isinstance(target, CompileTarget) else _target(target)
    with capture_launches() as launches:
        launch()
    compiled = []
    for recorded in launches:
        kernel = _triton_compile(recorded.fn, _specialize(recorded, resolved), io.StringIO())
        compiled.append(CompiledLaunch(recorded.fn.fn.__name__,
                                       {k: v for k, v in kernel.asm.items()
                                        if isinstance(v, str)},
                                       int(kernel.metadata.shared)))
    return compiled


def compile_cache_dir() -> Path:
    """Where ``kvcore kernels`` keeps its results: ``$KVCORE_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/kvcore/kernel-compile`` (``~/.cache`` without it)."""
    if "KVCORE_COMPILE_CACHE" in os.environ:
        return Path(os.environ["KVCORE_COMPILE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcore" / "kernel-compile"


def _judge(result: CompileResult, target: CompileTarget, max_spills: int) -> None:
    if result.error is not None:
        result.failures.append(f"does not compile for {target.name}: {result.error}")
        return
    if result.shared is not None and result.shared > target.shared_memory_limit:
        memory = "LDS" if target.is_rocm else "shared memory"
        result.failures.append(
            f"needs {result.shared / _KIB:.1f} KiB of {memory} per program; {target.name} "
            f"({target.device}) has {target.shared_memory_limit / _KIB:.0f} KiB: use smaller "
            "tiles or fewer stages for this target")
    if result.spills is not None and result.spills > max_spills:
        result.failures.append(
            f"spills {result.spills} bytes per thread on {target.name} (allowed: {max_spills}): "
            "use smaller tiles or more warps")


def run_check(
    targets: Iterable[str | CompileTarget] = tuple(TARGETS),
    *,
    owners: Sequence[str] | None = None,
    extra_providers: Sequence[str] = (),
    jobs: int | None = None,
    use_cache: bool = True,
    compile: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[CompileResult]:
    """Compile every registered case for ``targets`` and judge the results.

    ``owners`` limits the check to those registered providers; ``extra_providers``
    (``"module:function"`` paths) checks those instead of the registered ones, or besides
    ``owners`` when both are given. ``jobs`` compiles in parallel (default: one per CPU, at
    most 4). ``compile=False`` only runs the cases and lists what they launch. Returns one
    :class:`CompileResult` per (case, kernel launch, target).
    """
    resolved = [t if isinstance(t, CompileTarget) else _target(t) for t in targets]
    registered = case_providers()
    if owners is not None:
        unknown = set(owners) - {name for name, _, _ in registered}
        if unknown:
            valid = ", ".join(name for name, _, _ in registered)
            raise ValueError(f"unknown kernel owner(s) {sorted(unknown)}; registered: {valid}")
    providers = [p for p in registered
                 if (owners is None and not extra_providers) or (owners and p[0] in owners)]
    providers += [("extra", path, _import_path(path, "--cases")) for path in extra_providers]

    results: list[CompileResult] = []
    pending: dict[str, list[tuple[CompileResult, int]]] = {}
    todo: dict[str, _Job] = {}
    for target in resolved:
        for owner, _, provider in providers:
            for case in provider(target):
                if case.skip is not None:
                    results.append(CompileResult(owner, case.name, "-", target.name,
                                                 skipped=case.skip))
                    continue
                try:
                    with capture_launches() as launches:
                        ran = case.launch()
                    if not launches:
                        raise RuntimeError("the case launched no Triton kernel")
                    specialised = [(launch, _specialize(launch, target)) for launch in launches]
                except Exception as exc:  # a broken case is reported like a broken kernel
                    result = CompileResult(owner, case.name, "-", target.name,
                                           error=f"{type(exc).__name__}: {exc}")
                    _judge(result, target, case.max_spills)
                    results.append(result)
                    continue
                for launch, job in specialised:
                    function = launch.fn.fn.__name__
                    result = CompileResult(owner, case.name, function, target.name,
                                           config=_config_text(launch.fn, job), key=job.key,
                                           shared_limit=target.shared_memory_limit,
                                           name=ran if isinstance(ran, str) else function)
                    results.append(result)
                    pending.setdefault(job.key, []).append((result, case.max_spills))
                    todo[job.key] = job

    if not compile:
        return results
    cache = compile_cache_dir()
    metrics: dict[str, dict[str, Any]] = {}
    for key in todo:
        path = cache / f"{key}.json"
        if use_cache and path.exists():
            metrics[key] = dict(json.loads(path.read_text()), cached=True)
    to_compile = [job for key, job in todo.items() if key not in metrics]
    workers = jobs or min(4, os.cpu_count() or 1)
    if to_compile:
        if workers == 1:  # in this process (e.g. one that holds a GPU context: no fork)
            finished: Iterable[tuple[_Job, dict]] = ((job, _compile(job)) for job in to_compile)
            pool = contextlib.nullcontext()
        else:  # fork: the workers inherit the imported kernels
            pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"))
            futures = {pool.submit(_compile, job): job for job in to_compile}
            finished = ((futures[f], f.result())
                        for f in concurrent.futures.as_completed(futures))
        with pool:
            for done, (job, compiled) in enumerate(finished, 1):
                metrics[job.key] = dict(compiled, cached=False)
                if progress is not None:
                    progress(f"[{done}/{len(to_compile)}] {job.kernel.split(':')[1]} "
                             f"{job.target.name} {metrics[job.key]['seconds']:.1f}s")
                if use_cache and metrics[job.key]["error"] is None:
                    cache.mkdir(parents=True, exist_ok=True)
                    tmp = cache / f"{job.key}.json.tmp{os.getpid()}"
                    tmp.write_text(json.dumps({k: v for k, v in metrics[job.key].items()
                                               if k != "cached"}))
                    tmp.replace(cache / f"{job.key}.json")

    for key, entries in pending.items():
        for result, max_spills in entries:
            m = metrics[key]
            result.registers, result.spills = m.get("registers"), m.get("spills")
            result.shared, result.error = m.get("shared"), m["error"]
            result.seconds, result.cached = m["seconds"], m["cached"]
            _judge(result, todo[key].target, max_spills)
    return results


def _target(name: str) -> CompileTarget:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown compile target {name!r}; valid targets: "
                         f"{', '.join(TARGETS)}") from None


def _kib(value: int | None) -> str:
    return "-" if value is None else f"{value / _KIB:.1f}"


def _status(result: CompileResult) -> str:
    if result.skipped:
        return f"skipped: {result.skipped}"
    return "ok" if result.ok else "FAIL: " + "; ".join(result.failures)


def format_table(results: Sequence[CompileResult]) -> str:
    """One row per (case, function, target): config, registers, spills, shared memory."""
    from tabulate import tabulate

    rows = [[r.owner, r.name, r.kernel, r.case, r.target, r.config,
             "-" if r.registers is None else r.registers, "-" if r.spills is None else r.spills,
             _kib(r.shared), _kib(r.shared_limit),
             "cached" if r.cached else f"{r.seconds:.1f}s", _status(r)]
            for r in results]
    return tabulate(rows, headers=["owner", "kernel", "function", "case", "target", "config",
                                   "regs", "spills", "shared KiB", "limit KiB", "compile",
                                   "status"])


#: What a cell of :func:`format_summary` holds, printed under it by ``kvcore kernels``.
SUMMARY_LEGEND = ("cells: registers per thread / spilled bytes per thread / shared memory KiB, "
                  "the largest over the kernel's cases for that target; FAIL: a case failed "
                  "(the table above says why)")


def format_summary(results: Sequence[CompileResult]) -> str:
    """(Kernel, function) x target: the largest registers / spills / shared memory over its
    cases."""
    from tabulate import tabulate

    targets = list(dict.fromkeys(r.target for r in results))
    kernels = sorted(dict.fromkeys((r.owner, r.name, r.kernel) for r in results))
    rows = []
    for owner, name, kernel in kernels:
        if kernel == "-":  # skipped or broken cases: listed in the full table
            continue
        row = [owner, name, kernel]
        for target in targets:
            mine = [r for r in results
                    if (r.owner, r.name, r.kernel, r.target) == (owner, name, kernel, target)]
            if not mine:
                row.append("-")
                continue
            good = [r for r in mine if r.registers is not None]
            cell = "FAIL " if any(not r.ok for r in mine) else ""
            if good:
                cell += (f"{max(r.registers for r in good)} / {max(r.spills for r in good)} / "
                         f"{max(r.shared for r in good) / _KIB:.0f}")
            row.append(cell.strip() or "FAIL")
        rows.append(row)
    return tabulate(rows, headers=["owner", "kernel", "function", *targets], tablefmt="github")


def format_markdown(results: Sequence[CompileResult]) -> str:
    """``docs/kernels.md``: the kernel x target summary and every case."""
    import triton
    from tabulate import tabulate

    lines = [
        "# Triton kernels compiled for real GPUs",
        "",
        "Generated by `kvcore kernels --format markdown > docs/kernels.md` (Triton "
        f"{triton.__version__}), on a machine without a GPU: every Triton kernel of kvcore and "
        "its plugins compiled with `triton.compile` for each target, at the launch "
        "configurations the ops' own config choosers pick for the cases below. See "
        "[CI](ci.md#kernel-compile-check) for how CI runs it.",
        "",
        "Targets (shared memory / LDS one program may use; SMs or CUs the split-KV choosers "
        "size their grids for):",
        "",
    ]
    used = list(dict.fromkeys(r.target for r in results))
    lines.append(tabulate(
        [[t.name, t.device, f"{t.backend} {t.arch}", t.warp_size,
          f"{t.shared_memory_limit // _KIB} KiB", t.num_sms]
         for t in (TARGETS[name] for name in used if name in TARGETS)],
        headers=["target", "device", "triton target", "warp", "shared / LDS", "SMs / CUs"],
        tablefmt="github"))
    from kvcore.ops import KERNELS

    lines += [
        "",
        "## Kernels by name",
        "",
        "Each row of an op's config table names the kernel it runs, with a config class that "
        "holds only that kernel's parameters; the tables below list every compiled function "
        "under the kernel a case ran. TRITON_ATTN's kernels (`kvcore.ops.KERNELS`; the tuned "
        "rows and the measurements behind them: `kvcore/ops/attention_config.py`):",
        "",
        tabulate([[f"`{name}`", f"`{cls.__name__}`",
                   " ".join(line.strip() for line in cls.__doc__.split("\n\n")[0].splitlines())]
                  for name, cls in KERNELS.items()],
                 headers=["kernel", "config", "what it takes"], tablefmt="github"),
    ]
    owners = {r.owner for r in results}
    for owner, _, provider in case_providers():
        text = getattr(sys.modules.get(provider.__module__), "KERNELS_BY_NAME", None)
        if owner in owners and text:
            lines += ["", " ".join(text.split())]
    lines += [
        "",
        "## Summary: registers / spills / shared KiB (largest over the cases)",
        "",
        "Registers per thread: NVIDIA from `ptxas -v`; AMD VGPRs + AGPRs per lane from the "
        "code object metadata. Spills in bytes per thread: NVIDIA `ptxas`' spill stores, AMD "
        "spilled VGPRs x 4. The check fails on a compile error, on shared memory / LDS above "
        f"the target's limit, and on spills above {MAX_SPILLS} bytes (128 registers, half of "
        "what a thread can address): below that a spill is a few values kept across the key "
        "loop (the configs tuned by sweeps on the H200, benchmarks/RESULTS.md, spill up to a few "
        "hundred bytes); above it the tile's accumulator usually no longer fits (the 128-row "
        "head_size 256 prefill tile that `default_config` avoids spills 2.9 KiB on sm90, 3.3 "
        "KiB on sm100, 15.7 KiB on sm80). A case may allow more (`KernelCase.max_spills`) for a "
        "tile measured to be the fastest anyway, as kvcore_mla's 128-head decode cases do for "
        "the Triton kernel's sm90 tile with key-split scores. Gluon kernels (kvcore_mla's "
        "Hopper decode kernel, TRITON_ATTN's Hopper prefill kernels: the warp-specialised one "
        "is sm90's default prefill tile) are compiled the same way, for the targets whose "
        "configs pick them (the cases that name a Gluon tile run on sm90 only).",
        "",
        format_summary(results),
        "",
        "## Every case",
        "",
        tabulate([[r.owner, r.name, r.kernel, r.case, r.target, r.config,
                   r.registers if r.registers is not None else "-",
                   r.spills if r.spills is not None else "-", _kib(r.shared),
                   _status(r)] for r in results],
                 headers=["owner", "kernel", "function", "case", "target", "config", "regs",
                          "spills", "shared KiB", "status"], tablefmt="github"),
        "",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvcore kernels``."""
    parser.add_argument("--target", action="append", choices=tuple(TARGETS), default=None,
                        help="compile for this target (repeatable; default: all)")
    parser.add_argument("--owner", action="append", default=None,
                        help="only this provider's kernels, e.g. kvcore or kvcore_mla "
                             "(repeatable)")
    parser.add_argument("--cases", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="check this case provider (repeatable) instead of the registered "
                             "ones (besides those named by --owner)")
    parser.add_argument("--list", action="store_true",
                        help="run the cases and list the kernel launches, compile nothing")
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel compiles (default: one per CPU, at most 4)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile everything again (the cache is $KVCORE_COMPILE_CACHE, "
                             "default ~/.cache/kvcore/kernel-compile)")
    parser.add_argument("--format", choices=("table", "json", "markdown"), default="table",
                        help="output: a table (default), JSON, or a Markdown table")


def cmd_kernels(args: argparse.Namespace) -> int:
    """``kvcore kernels``: print the table; exit status 1 when any kernel fails the check."""
    start = time.perf_counter()
    results = run_check(args.target or tuple(TARGETS), owners=args.owner,
                        extra_providers=args.cases, jobs=args.jobs, use_cache=not args.no_cache,
                        compile=not args.list,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    failed = [r for r in results if not r.ok]
    if args.format == "json":
        print(json.dumps([r.to_dict() for r in results], indent=2))
    elif args.list:
        from tabulate import tabulate

        print(tabulate([[r.owner, r.name, r.kernel, r.case, r.target, r.config,
                         f"skipped: {r.skipped}" if r.skipped else "; ".join(r.failures)]
                        for r in results],
                       headers=["owner", "kernel", "function", "case", "target", "config",
                                "note"]))
    elif args.format == "markdown":
        print(format_markdown(results))
    else:
        print(format_table(results))
        print()
        print(format_summary(results))
        print(SUMMARY_LEGEND)
    distinct = {r.key: r.cached for r in results if r.key}
    if args.list:
        print(f"{len(results)} kernel launches, {len(distinct)} distinct compiles (--list: "
              f"none run); {len(failed)} cases failed to launch", file=sys.stderr)
        return 1 if failed else 0
    new = sum(not cached for cached in distinct.values())
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the compile workers and ptxas
    print(f"{len(results)} kernel launches, {len(distinct)} distinct compiles "
          f"({new} compiled, {len(distinct) - new} from the cache) in "
          f"{time.perf_counter() - start:.0f}s ({usage.ru_utime + usage.ru_stime:.0f} CPU-s "
          f"in compile workers); {len(failed)} failed", file=sys.stderr)
    return 1 if failed else 0
