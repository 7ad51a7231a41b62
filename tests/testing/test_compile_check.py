"""The Triton compile check (``kvcore kernels``, :mod:`kvcore.testing.compile_check`).

The fast tests cover the metric parsers and the verdicts. The slow ones run ``kvcore kernels``
in a subprocess (this test session interprets Triton kernels, ``TRITON_INTERPRET=1``; the
check needs the compiled ones): every ``@triton.jit`` kernel of kvcore and the plugins is
launched by some case, a deliberately broken config fails the check on gfx942's LDS and the
command exits 1, and a good kernel passes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.testing.compile_check import (
    TARGETS,
    CompileResult,
    _judge,
    capture_launches,
    parse_amdgcn_metadata,
    parse_ptxas_log,
)

REPO = Path(__file__).resolve().parents[2]

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_paged_attention_kernel' for 'sm_90a'
ptxas info    : Function properties for _paged_attention_kernel
    96 bytes stack frame, 40 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""

AMDGCN_METADATA = """\
    .amdhsa_next_free_vgpr 120
amdhsa.kernels:
  - .agpr_count:     4
    .group_segment_fixed_size: 0
    .sgpr_count:     104
    .sgpr_spill_count: 2
    .vgpr_count:     116
    .vgpr_spill_count: 12
"""


def test_ops_can_tell_that_launches_are_being_recorded(monkeypatch):
    """Ops skip checks of their tensors' device while launches are recorded for an
    ahead-of-time compile (the tensors are CPU stand-ins), and only then."""
    from kvcore.ops.triton_utils import recording_launches

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not recording_launches()
    with capture_launches():
        assert recording_launches()
    assert not recording_launches()


def test_ptxas_log_gives_registers_and_spill_store_bytes():
    assert parse_ptxas_log(PTXAS_LOG) == (255, 40)


def test_ptxas_log_without_a_report_is_an_error():
    with pytest.raises(ValueError, match="no register/spill report"):
        parse_ptxas_log("ptxas info    : 0 bytes gmem\n")


def test_amdgcn_metadata_gives_vector_registers_and_spilled_vgpr_bytes():
    assert parse_amdgcn_metadata(AMDGCN_METADATA) == (116 + 4, 12 * 4)


@pytest.mark.parametrize(("name", "kib"), [("gfx942", 64), ("gfx950", 160), ("sm80", 163),
                                           ("sm90", 227), ("sm100", 227)])
def test_shared_memory_limits_are_the_targets(name, kib):
    assert TARGETS[name].shared_memory_limit == kib * 1024


@pytest.mark.parametrize(("name", "capability"), [("sm80", "8.0"), ("sm90", "9.0"),
                                                  ("sm100", "10.0"), ("gfx942", "gfx942 (9.4)"),
                                                  ("gfx950", "gfx950 (9.5)")])
def test_targets_have_the_capability_backends_validate_against(name, capability):
    assert str(TARGETS[name].device_capability) == capability


def _result(**metrics) -> CompileResult:
    return CompileResult("kvcore", "case", "_kernel", "gfx942", **metrics)


def test_lds_over_the_limit_fails_naming_target_and_sizes():
    result = _result(registers=100, spills=0, shared=68 * 1024)
    _judge(result, TARGETS["gfx942"], max_spills=0)
    assert not result.ok
    assert result.failures == [
        "needs 68.0 KiB of LDS per program; gfx942 (MI300X) has 64 KiB: use smaller tiles or "
        "fewer stages for this target"]
    fits = _result(registers=100, spills=0, shared=68 * 1024)
    _judge(fits, TARGETS["gfx950"], max_spills=0)
    assert fits.ok


def test_spills_over_the_allowance_fail():
    result = _result(registers=255, spills=84, shared=0)
    _judge(result, TARGETS["sm90"], max_spills=64)
    assert result.failures == ["spills 84 bytes per thread on sm90 (allowed: 64): use smaller "
                               "tiles or more warps"]
    allowed = _result(registers=255, spills=84, shared=0)
    _judge(allowed, TARGETS["sm90"], max_spills=128)
    assert allowed.ok


def test_a_compile_error_fails():
    result = _result(error="CompilationError: at 12:4: boom")
    _judge(result, TARGETS["sm80"], max_spills=0)
    assert result.failures == ["does not compile for sm80: CompilationError: at 12:4: boom"]


def _kvcore_kernels(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVCORE_COMPILE_CACHE"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvcore.cli", "kernels", *args],
                          capture_output=True, text=True, env=env, timeout=900)


def _triton_kernels_in_source() -> set[str]:
    """Every launched ``@triton.jit`` or ``@gluon.jit`` kernel (named ``*_kernel``) of kvcore
    and the plugins."""
    names = set()
    for root in (REPO / "kvcore", REPO / "plugins"):
        for path in root.rglob("*.py"):
            if "tests" in path.parts:
                continue
            names |= set(re.findall(r"@(?:triton|gluon)\.jit\s*\ndef (\w+_kernel)\(",
                                    path.read_text()))
    return names


def test_every_triton_kernel_is_launched_by_a_case_on_some_target(tmp_path):
    proc = _kvcore_kernels("--list", "--format", "json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and all(row["ok"] for row in rows), [r for r in rows if not r["ok"]]
    launched = {row["kernel"] for row in rows if not row["skipped"]}
    assert _triton_kernels_in_source() == launched
    assert {row["target"] for row in rows} == set(TARGETS)


def test_a_tile_that_needs_more_lds_than_gfx942_has_fails_the_check(tmp_path):
    proc = _kvcore_kernels("--target", "gfx942", "--format", "json",
                           "--cases", "broken_compile_cases:too_much_lds",
                           "--cases", "broken_compile_cases:fits", cache=tmp_path)
    assert proc.returncode == 1, proc.stderr
    rows = {(r["case"], r["target"]): r for r in json.loads(proc.stdout)}
    broken = rows["prefill 128x64 tile D256 3 stages", "gfx942"]
    assert broken["kernel"] == "prefill_attention_kernel"
    assert broken["shared"] > 64 * 1024
    assert any("KiB of LDS per program; gfx942 (MI300X) has 64 KiB" in failure
               for failure in broken["failures"])
    good = rows["cache write bf16", "gfx942"]
    assert good["ok"] and good["registers"] > 0 and good["spills"] == 0

    # Cached: the second run compiles nothing and gives the same verdicts.
    again = _kvcore_kernels("--target", "gfx942", "--format", "json",
                            "--cases", "broken_compile_cases:too_much_lds", cache=tmp_path)
    assert again.returncode == 1
    (row,) = json.loads(again.stdout)
    assert row["cached"] and row["shared"] == broken["shared"]


@pytest.mark.gpu
def test_the_ahead_of_time_compile_matches_the_jit_on_this_gpu():
    """On a real GPU: Triton's JIT, given the same launches on device tensors of the same
    strides, builds kernels with exactly the registers and shared memory the check reports."""
    import torch

    from kvcore.testing.compile_cases import compile_cases
    from kvcore.testing.compile_check import capture_launches, run_check

    major, minor = torch.cuda.get_device_capability()
    if torch.version.hip is not None:
        name = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    else:
        name = f"sm{major}{minor}"
    if name not in TARGETS:
        pytest.skip(f"{name} is not a compile-check target ({', '.join(TARGETS)})")
    target = TARGETS[name]
    expected = {(r.case, r.kernel): r for r in run_check([name], owners=["kvcore"], jobs=1)}
    assert all(r.ok for r in expected.values())

    def on_device(value):
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                       device="cuda")
        return value

    checked = 0
    for case in compile_cases(target):
        if case.skip:
            continue
        with capture_launches() as launches:
            case.launch()
        for launch in launches:
            kernel = launch.fn.warmup(*map(on_device, launch.args), grid=(1,),
                                      **{k: on_device(v) for k, v in launch.kwargs.items()})
            kernel._init_handles()
            aot = expected[case.name, launch.fn.fn.__name__]
            assert kernel.metadata.shared == aot.shared, case.name
            if not target.is_rocm:  # the HIP driver counts registers differently
                assert kernel.n_regs == aot.registers, case.name
            checked += 1
    assert checked >= 10


def test_compile_launches_refuses_the_interpreter(monkeypatch):
    from kvcore.testing import compile_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 is set"):
        compile_launches(lambda: None, "sm90")


_COMPILE_CACHE_WRITE = """
import json, sys, torch
from kvcore.ops.triton_cache import reshape_and_cache
from kvcore.testing import compile_launches
key = torch.empty(64, 8, 128, dtype=torch.bfloat16)
k_cache = torch.empty(16, 16, 8, 128, dtype=torch.bfloat16)
v_cache = torch.empty_like(k_cache)
slots = torch.arange(64)
out = compile_launches(lambda: reshape_and_cache(key, key, k_cache, v_cache, slots),
                       sys.argv[1])
print(json.dumps([[c.kernel, sorted(c.asm), "ttg.nvidia_mma" in c.asm.get("ttgir", "")]
                  for c in out]))
"""


def test_compile_launches_gives_each_launch_its_stages():
    """A cache write (no dot) compiled for sm90 and gfx942 in a subprocess (the interpreter
    stays off there): one launch, its text stages named as Triton names them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for target, final in (("sm90", "ptx"), ("gfx942", "amdgcn")):
        proc = subprocess.run([sys.executable, "-c", _COMPILE_CACHE_WRITE, target],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        ((kernel, stages, has_mma),) = json.loads(proc.stdout.strip().splitlines()[-1])
        assert kernel.endswith("_kernel") and not has_mma
        assert {"ttir", "ttgir", "llir", final} <= set(stages)


@pytest.mark.parametrize(("path", "message"), [
    ("nonexistent:fn", "--cases 'nonexistent:fn': cannot import 'nonexistent'"),
    ("kvcore.testing.compile_cases:nope",
     "--cases 'kvcore.testing.compile_cases:nope': kvcore.testing.compile_cases has no "
     "attribute 'nope'"),
    ("compile_cases", "--cases 'compile_cases' is not MODULE:FUNCTION"),
], ids=["no-module", "no-function", "no-colon"])
def test_kernels_names_a_bad_cases_path_without_a_traceback(path, message, capsys):
    from kvcore.cli.main import main

    assert main(["kernels", "--cases", path, "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
