"""Selection and validation of FLASHINFER, FLASH_ATTN and FLEX_ATTENTION on a simulated CUDA
platform (capabilities 8.0, 9.0, 10.0), with the exact reasons an operator reads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvcore

NVIDIA = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
FLASHINFER_MISSING = "flashinfer-python not installed (pip install flashinfer-python)"
FLASH_ATTN_MISSING = ("neither flash-attn-4 (Hopper/Blackwell: pip install "
                      "'kvcore-nvidia[flash-attn]') nor flash-attn 2 (Ampere: pip install "
                      "flash-attn) is installed")


def fa2_block(block_size: int, capability: str) -> str:
    return (f"block_size={block_size} with device_capability={capability}: flash-attn 2 (the "
            "kernels there, devices >= 8.0) supports multiples of 256; flash-attn-4 takes any "
            "block size on Hopper and Blackwell (9.x-11.x)")


def _config(**kw) -> kvcore.AttentionSelectorConfig:
    return kvcore.AttentionSelectorConfig(**{"head_size": 128, "dtype": torch.bfloat16, **kw})


def _reasons(name: str, config: kvcore.AttentionSelectorConfig) -> list[str]:
    report = kvcore.explain_selection(config)
    return next(c for c in report.candidates if c.name == name).reasons


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """``installed("FLASHINFER", ...)``: pretend those backends' kernel libraries are there.

    Patches the class the registry resolves (another test may have re-imported the module)."""

    def install(*names: str) -> None:
        for name in names:
            if name == "FLASH_ATTN":
                _install_flash_attn(monkeypatch, "flash-attn-4", "flash-attn 2")
            else:
                monkeypatch.setattr(kvcore.resolve_backend(name), "REQUIRED_PACKAGES", ())
        kvcore.clear_selection_cache()

    return install


def _install_flash_attn(monkeypatch: pytest.MonkeyPatch, *libraries: str) -> None:
    """Pretend these FlashAttention libraries (``"flash-attn-4"``, ``"flash-attn 2"``) and no
    other are installed, in the module the registry resolves FLASH_ATTN from."""
    backend = kvcore.resolve_backend("FLASH_ATTN")
    modules = {k.module for k in backend.KERNELS if k.library in libraries}
    monkeypatch.setattr(sys.modules[backend.__module__], "module_installed",
                        lambda name: name in modules)
    monkeypatch.setattr(backend, "import_reasons", classmethod(lambda cls: []))
    kvcore.clear_selection_cache()


# CUDA's order for these configs on every capability (on 9.0 its shipped ranking keeps it).
CUDA_ORDER = ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]


@pytest.mark.parametrize(("capability", "order", "flash_attn"), [
    ("8.0", CUDA_ORDER, [fa2_block(16, "8.0"), FLASH_ATTN_MISSING]),
    ("9.0", CUDA_ORDER, [FLASH_ATTN_MISSING]),
    ("10.0", CUDA_ORDER, [FLASH_ATTN_MISSING]),
])
def test_priority_order_and_reasons_without_vendor_libraries(cuda, capability, order,
                                                             flash_attn):
    cuda(capability)
    report = kvcore.explain_selection(_config())
    names = [c.name for c in report.candidates]
    assert [n for n in names if n in NVIDIA] == order
    assert names[:4] == order  # the platform's list comes first, in its order
    by_name = {c.name: c for c in report.candidates}
    assert by_name["FLASHINFER"].reasons == [FLASHINFER_MISSING]
    assert by_name["FLASH_ATTN"].reasons == flash_attn
    assert by_name["FLEX_ATTENTION"].valid
    for name in ("FLASHINFER", "FLASH_ATTN", "FLEX_ATTENTION"):
        assert by_name[name].plugin == "nvidia"
    assert report.selected.name == "TRITON_ATTN"
    assert kvcore.get_attn_backend(_config()).get_name() == "TRITON_ATTN"


@pytest.mark.parametrize(("capability", "block_size", "expected"), [
    ("8.0", 16, "FLASHINFER"),
    ("8.0", 256, "FLASH_ATTN"),   # FLASHINFER first, but declares blocks of 16, 32, 64
    ("9.0", 16, "FLASHINFER"),
    ("9.0", 100, "FLASH_ATTN"),   # flash-attn-4: any block size
    ("10.0", 16, "FLASHINFER"),
    ("10.0", 256, "FLASH_ATTN"),
])
def test_vendor_backends_win_when_installed(cuda, installed, capability, block_size, expected):
    cuda(capability)
    installed("FLASHINFER", "FLASH_ATTN")
    for use_kv_connector in (False, True):  # all are blocks-first: connectors change nothing
        config = _config(block_size=block_size, use_kv_connector=use_kv_connector)
        chosen = kvcore.get_attn_backend(config)
        assert chosen.get_name() == expected
        assert chosen.supports_kv_connector()


def test_flex_attention_is_the_fallback_of_last_resort(cuda):
    cuda("9.0")
    config = _config(dtype=torch.float32, head_size=64)  # fp32: no vendor kernel declares it
    assert _reasons("FLASHINFER", config) == [
        "dtype=float32 (supported: float16, bfloat16)", FLASHINFER_MISSING]
    assert kvcore.get_attn_backend(config).get_name() == "TRITON_ATTN"
    assert _reasons("FLEX_ATTENTION", config) == []


def test_exact_reasons_for_unsupported_configurations(cuda):
    cuda("9.0")
    assert _reasons("FLASHINFER", _config(head_size=80, kv_cache_dtype="fp8")) == [
        "head_size=80 (supported: 64, 128, 256)", FLASHINFER_MISSING]
    assert _reasons("FLASH_ATTN", _config(head_size=260, block_size=512,
                                          kv_cache_dtype="fp8")) == [
        "head_size=260 (supported: multiples of 8 up to 256)",
        "kv_cache_dtype=fp8 (supported: auto)", FLASH_ATTN_MISSING]
    assert _reasons("FLEX_ATTENTION", _config(head_size=80, block_size=24)) == [
        "head_size=80 (supported: 32, 64, 128, 256)",
        "block_size=24 (supported: 16, 32, 64, 128)"]
    assert _reasons("FLASHINFER", _config(has_sink=True)) == [
        "has_sink=True: FLASHINFER does not support attention sinks", FLASHINFER_MISSING]
    assert _reasons("FLASHINFER", _config(attn_type="encoder")) == [
        "attn_type=encoder (supported: decoder, encoder_only)", FLASHINFER_MISSING]


def test_capability_below_ampere(cuda):
    cuda("7.5")
    assert _reasons("FLASHINFER", _config()) == [
        "device capability 7.5 (supported: >= 8.0)", FLASHINFER_MISSING]
    assert _reasons("FLASH_ATTN", _config(block_size=256)) == [
        "device capability 7.5 (supported: >= 8.0)", FLASH_ATTN_MISSING]
    assert _reasons("FLEX_ATTENTION", _config()) == [
        "dtype=bfloat16 needs device capability >= 8.0 (got 7.5); use dtype=float16"]
    assert _reasons("FLEX_ATTENTION", _config(dtype=torch.float16)) == []


def test_forced_backend_that_cannot_run_raises_with_its_reasons(cuda, monkeypatch):
    cuda("9.0")
    with pytest.raises(kvcore.BackendSelectionError) as err:
        kvcore.get_attn_backend(_config(), backend="FLASH_ATTN")
    assert str(err.value).startswith(
        "attention backend FLASH_ATTN was requested by the backend argument but cannot run "
        f"this config on cuda: {FLASH_ATTN_MISSING}. Valid for this config on cuda: "
        "TRITON_ATTN, ")
    monkeypatch.setenv("KVCORE_ATTENTION_BACKEND", "FLASHINFER")
    kvcore.clear_selection_cache()
    with pytest.raises(kvcore.BackendSelectionError, match="pip install flashinfer-python"):
        kvcore.get_attn_backend(_config())


def test_without_the_plugin_the_platform_names_the_package(cuda, monkeypatch):
    cuda("9.0")
    monkeypatch.setenv("KVCORE_PLUGINS", "rocm")  # an allowlist without nvidia
    kvcore.reset_plugins()
    assert _reasons("FLASHINFER", _config()) == [
        "FLASHINFER is not registered by any installed plugin; it ships in kvcore-nvidia "
        "(pip install -e plugins/nvidia)"]


def test_cli_explain_shows_the_cuda_order_and_reasons():
    env = {**os.environ, "KVCORE_PLUGINS": "nvidia"}
    for var in ("KVCORE_PLATFORM", "KVCORE_DEVICE_CAPABILITY", "KVCORE_ATTENTION_BACKEND"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "select", "--explain", "--platform", "cuda",
         "--capability", "9.0", "--kv-connector"],
        capture_output=True, text=True, env=env, check=True).stdout
    lines = out.splitlines()
    # Without FlashInfer and flash-attn here, the first of CUDA's order that runs is selected.
    config = _config(use_kv_connector=True)
    order = kvcore.get_platform("cuda").get_backend_priorities(config,
                                                               kvcore.DeviceCapability(9, 0))
    assert sorted(order) == sorted(NVIDIA)
    runs = [n for n in order if n in ("TRITON_ATTN", "FLEX_ATTENTION")]
    assert f"selected: {runs[0]}" in lines
    rows = [line for line in lines if line.startswith("  ") and not line.startswith("    ")]
    status = {"FLASHINFER": "rejected", "FLASH_ATTN": "rejected", runs[0]: "SELECTED",
              runs[1]: "valid, lower priority"}
    plugin = {"TRITON_ATTN": "builtin_backends"}
    assert rows[:4] == [f"  {n}: {status[n]} [plugin {plugin.get(n, 'nvidia')}]" for n in order]
    phases = kvcore.get_platform("cuda").phase_rankings(config, kvcore.DeviceCapability(9, 0))
    assert phases
    for phase in phases:  # the measured tiers, and where the pick stands
        assert any(line.startswith(f"{phase.phase} (measured): {phase.describe()}; selected "
                                   f"{runs[0]} is ") for line in lines), phase
    fa = lines.index("  FLASH_ATTN: rejected [plugin nvidia]")
    assert lines[fa + 1:fa + 2] == [f"    - {FLASH_ATTN_MISSING}"]
    fi = lines.index("  FLASHINFER: rejected [plugin nvidia]")
    assert lines[fi + 1] == f"    - {FLASHINFER_MISSING}"


# -- FLASH_ATTN: flash-attn-4 on Hopper/Blackwell, flash-attn 2 on Ampere ----------------------

FA4_ONLY_ON_AMPERE = ("device_capability=8.0: flash-attn-4 is installed but its paged kernels "
                      "run on device capability 9.0-9.x, 10.0-11.x only; there FLASH_ATTN "
                      "needs flash-attn 2 (pip install flash-attn)")


@pytest.mark.parametrize(("capability", "libraries", "config", "reasons"), [
    ("9.0", ("flash-attn-4",), {}, []),
    ("9.0", ("flash-attn-4",), {"head_size": 256, "block_size": 64}, []),
    ("9.0", ("flash-attn-4",), {"head_size": 192, "block_size": 1}, []),
    ("10.0", ("flash-attn-4",), {"head_size": 256}, []),
    ("10.0", ("flash-attn-4",), {"head_size": 192}, [
        "head_size=192 with device_capability=10.0: flash-attn-4 (the kernels there, devices "
        "10.0-11.x) supports multiples of 8 up to 128, 256"]),
    ("9.0", ("flash-attn-4",), {"head_size": 100}, [
        "head_size=100 (supported: multiples of 8 up to 256)"]),
    ("9.0", ("flash-attn-4",), {"dtype": torch.float32}, [
        "dtype=float32 (supported: float16, bfloat16)"]),
    ("9.0", ("flash-attn-4",), {"kv_cache_dtype": "fp8"}, [
        "kv_cache_dtype=fp8 (supported: auto)"]),
    ("8.0", ("flash-attn-4",), {}, [fa2_block(16, "8.0"), FA4_ONLY_ON_AMPERE]),
    ("8.0", ("flash-attn-4",), {"block_size": 256}, [FA4_ONLY_ON_AMPERE]),
    ("8.0", ("flash-attn 2",), {"block_size": 512}, []),
    ("8.0", ("flash-attn 2",), {}, [fa2_block(16, "8.0")]),
    ("9.0", ("flash-attn 2",), {}, [fa2_block(16, "9.0")]),  # only flash-attn 2 here
    ("9.0", ("flash-attn 2",), {"block_size": 256}, []),
    ("9.0", ("flash-attn-4", "flash-attn 2"), {}, []),  # flash-attn-4 preferred
    ("12.0", ("flash-attn-4",), {"block_size": 256}, [
        "device_capability=12.0: flash-attn-4 is installed but its paged kernels run on device "
        "capability 9.0-9.x, 10.0-11.x only; there FLASH_ATTN needs flash-attn 2 (pip install "
        "flash-attn)"]),
    ("7.5", ("flash-attn-4", "flash-attn 2"), {"block_size": 256}, [
        "device capability 7.5 (supported: >= 8.0)"]),
], ids=["h-fa4", "h-fa4-d256-b64", "h-fa4-d192-b1", "b-fa4-d256", "b-fa4-d192",
        "h-fa4-d100", "h-fa4-fp32", "h-fa4-fp8", "a-fa4-b16", "a-fa4-b256", "a-fa2-b512",
        "a-fa2-b16", "h-fa2-b16", "h-fa2-b256", "h-both", "sm120-fa4", "turing"])
def test_flash_attn_reasons_follow_the_library_of_the_device(cuda, monkeypatch, capability,
                                                             libraries, config, reasons):
    cuda(capability)
    _install_flash_attn(monkeypatch, *libraries)
    assert _reasons("FLASH_ATTN", _config(**config)) == reasons


@pytest.mark.parametrize(("capability", "libraries", "library"), [
    ("9.0", ("flash-attn-4", "flash-attn 2"), "flash-attn-4"),
    ("10.0", ("flash-attn-4",), "flash-attn-4"),
    ("9.0", ("flash-attn 2",), "flash-attn 2"),
    ("8.0", ("flash-attn-4", "flash-attn 2"), "flash-attn 2"),
    ("8.0", (), "flash-attn 2"),  # none installed: the one that would run
])
def test_flash_attn_runs_the_first_installed_library_that_covers_the_device(
        monkeypatch, capability, libraries, library):
    _install_flash_attn(monkeypatch, *libraries)
    backend = kvcore.resolve_backend("FLASH_ATTN")
    assert backend.kernels_for(kvcore.DeviceCapability.parse(capability)).library == library


def test_flash_attn_declared_envelope_covers_every_library():
    """The class attributes allocation and ``kvcore list`` read hold what any library takes."""
    backend = kvcore.resolve_backend("FLASH_ATTN")
    for kernels in backend.KERNELS:
        assert kernels.min_capability.at_least(backend.MIN_DEVICE_CAPABILITY)
        for head_size in range(1, 513):
            if kvcore.is_supported(head_size, kernels.head_sizes):
                assert kvcore.is_supported(head_size, backend.SUPPORTED_HEAD_SIZES), head_size
    assert backend.SUPPORTED_BLOCK_SIZES is None  # flash-attn-4 takes any


def test_flash_attn_wins_on_hopper_at_block_16_with_flash_attn_4(cuda, monkeypatch):
    cuda("9.0")
    _install_flash_attn(monkeypatch, "flash-attn-4")
    assert kvcore.get_attn_backend(_config()).get_name() == "FLASH_ATTN"
    cuda("8.0")
    _install_flash_attn(monkeypatch, "flash-attn-4")
    assert kvcore.get_attn_backend(_config()).get_name() == "TRITON_ATTN"


def test_module_installed_finds_submodules_without_importing_them(tmp_path, monkeypatch):
    from kvcore_nvidia.backends.flash_attn import module_installed

    # A namespace package (no __init__.py), as flash-attn-4 installs flash_attn/cute.
    (tmp_path / "nspkg_fa" / "cute").mkdir(parents=True)
    (tmp_path / "nspkg_fa" / "cute" / "__init__.py").write_text("raise ImportError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_installed("nspkg_fa.cute")
    assert not module_installed("nspkg_fa.flash_attn_interface")
    assert not module_installed("nspkg_missing.cute")
    assert "nspkg_fa.cute" not in sys.modules


# -- the conformance suite's device-free cases on simulated devices ---------------------------

@pytest.mark.parametrize(("capability", "libraries"), [
    ("9.0", ("flash-attn-4",)),  # H100/H200: the base case is built for 9.0, not the 8.0 minimum
    ("10.0", ("flash-attn-4",)),
    ("8.0", ("flash-attn 2",)),  # block 16 clashes with 8.0: a reason naming both fields
    ("9.0", ("flash-attn 2",)),
    ("9.0", ("flash-attn-4", "flash-attn 2")),
])
def test_flash_attn_passes_the_device_free_conformance_cases(cuda, monkeypatch, capability,
                                                              libraries):
    from kvcore.testing import conformance_cases

    cuda(capability)
    _install_flash_attn(monkeypatch, *libraries)
    backend = kvcore.resolve_backend("FLASH_ATTN")
    cases = [c for c in conformance_cases(backend, ["cuda"]) if c.kind in (
        "identity", "shape", "stride-order", "cross-layer-claim", "kv-connector-claim",
        "validation-accepts-declared", "validation-refuses")]
    assert any(c.kind == "validation-accepts-declared" for c in cases)
    for case in cases:
        case.run()


def test_flash_attn_base_case_refused_by_one_field_breaks_the_rule(cuda, monkeypatch):
    """The rule still bites FLASH_ATTN: flash-attn-4 alone on an Ampere device cannot run the
    base case, and that reason is not a clash of two fields."""
    from kvcore.testing import ConformanceError, conformance_cases

    cuda("8.0")
    _install_flash_attn(monkeypatch, "flash-attn-4")
    backend = kvcore.resolve_backend("FLASH_ATTN")
    (case,) = [c for c in conformance_cases(backend, ["cuda"])
               if c.kind == "validation-accepts-declared"]
    with pytest.raises(ConformanceError, match="flash-attn-4 is installed but"):
        case.run()


# -- per-phase measurements in select --explain -----------------------------------------------

def _ship_hopper_ranking(ship) -> None:
    """CUDA ships a ranking of one K/V config on 9.0: TRITON_ATTN and FLASHINFER decode within
    5%, FLASH_ATTN 30% slower; FLASHINFER and FLASH_ATTN prefill within 5%, TRITON_ATTN 80%
    slower."""
    config = kvcore.ranking_config_key(_config())
    shape_class = kvcore.ranking_shape_class(_config())
    cases = (kvcore.MeasuredCase("decode", shape_class, "decode 64x4096", config,
                                 {"TRITON_ATTN": 100.0, "FLASHINFER": 101.0,
                                  "FLASH_ATTN": 130.0}),
             kvcore.MeasuredCase("prefill", shape_class, "prefill 4x2048", config,
                                 {"FLASHINFER": 100.0, "FLASH_ATTN": 102.0,
                                  "TRITON_ATTN": 180.0}))
    device = kvcore.DeviceIdentity("cuda", "NVIDIA H200", "9.0")
    ship("cuda", kvcore.Ranking("2026-01-02", device, {}, cases))


def test_explain_says_the_fastest_backend_differs_between_decode_and_prefill(
        cuda, installed, kvcore_shipped_ranking):
    cuda("9.0")
    _ship_hopper_ranking(kvcore_shipped_ranking)
    installed("FLASHINFER", "FLASH_ATTN")
    report = kvcore.explain_selection(_config())
    assert report.selected.name == "FLASHINFER"
    assert report.why_selected().endswith(
        "in the order measured by kvcore tune on NVIDIA H200 (cuda, capability 9.0) on "
        "2026-01-02, 2 cases of D128 bfloat16 kv=auto bs16")
    assert [(r.phase, r.tiers) for r in report.phase_rankings] == [
        ("decode", (("TRITON_ATTN", "FLASHINFER"), ("FLASH_ATTN",))),
        ("prefill", (("FLASHINFER", "FLASH_ATTN"), ("TRITON_ATTN",)))]
    lines = report.phase_lines()
    assert lines[:2] == [
        "decode (measured): TRITON_ATTN = FLASHINFER > FLASH_ATTN; selected FLASHINFER is "
        "among the fastest",
        "prefill (measured): FLASHINFER = FLASH_ATTN > TRITON_ATTN; selected FLASHINFER is "
        "among the fastest"]
    assert lines[2].startswith("note: the fastest backend differs between decode and prefill "
                               "(FLASHINFER among the fastest in each); the priority list "
                               "picks one for every step. Measured on NVIDIA H200 (cuda, "
                               "capability 9.0) by kvcore tune on 2026-01-02 (D128 bfloat16 "
                               "kv=auto bs16)")
    assert "\n".join(lines) in report.format()
    assert report.to_dict()["phase_rankings"][0]["tiers"] == [["TRITON_ATTN", "FLASHINFER"],
                                                              ["FLASH_ATTN"]]


def test_explain_places_a_forced_backend_in_each_phase(cuda, installed, kvcore_shipped_ranking):
    cuda("9.0")
    _ship_hopper_ranking(kvcore_shipped_ranking)
    installed("FLASHINFER", "FLASH_ATTN")
    lines = kvcore.explain_selection(_config(), backend="FLASH_ATTN").phase_lines()
    decode, prefill = (line for line in lines if "(measured)" in line)
    assert decode.endswith("selected FLASH_ATTN is in group 2 of 2")
    assert prefill.endswith("selected FLASH_ATTN is among the fastest")
    # Under the decode line: the measured case where a valid backend beat the forced one.
    assert lines[lines.index(decode) + 1] == (
        "  TRITON_ATTN 1.30x faster than FLASH_ATTN on decode 64x4096")


@pytest.mark.parametrize(("capability", "config"), [
    ("8.0", {}), ("10.0", {}),  # not measured there
    ("9.0", {"use_mla": True, "head_size": 576}),  # measured without MLA
])
def test_no_phase_note_where_nothing_was_measured(cuda, kvcore_shipped_ranking, capability,
                                                  config):
    cuda(capability)
    _ship_hopper_ranking(kvcore_shipped_ranking)
    report = kvcore.explain_selection(_config(**config))
    assert report.phase_rankings == () and report.phase_lines() == []
    assert "(measured)" not in report.format()
