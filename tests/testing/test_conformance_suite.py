"""The conformance suite catches real contract violations, and stays out of unrelated runs.

Each broken backend of ``broken_backends.py`` is run through ``pytest --kvcore-backend`` in a
pytester session; the test checks which rules the failures name and that each failure points
at its documentation.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import torch

# pytester drops, when a test ends, every module imported since it began; kvcore's registries
# outlive the test and cache the platform classes, whose base class must stay the one in
# sys.modules. So the platform modules are imported with this module, before any test.
import kvcore
import kvcore.platform
import kvcore.platforms.cpu
from kvcore.testing import RULES, ConformanceError, conformance_cases
from kvcore.testing.checks import check_validation_accepts

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent
RULE_IN_MESSAGE = re.compile(r"broke conformance rule '([a-z0-9-]+)' \(documented in "
                             r"docs/conformance\.md#\1\)")


def run_suite(pytester: pytest.Pytester, *args: str) -> pytest.HookRecorder:
    pytester.syspathinsert(HERE)
    # hypothesis re-imports itself in every in-process run (1.5 s); the suite does not use it.
    return pytester.inline_run(*args, "-p", "no:cacheprovider", "-p", "no:hypothesispytest")


def failed_rules(recorder: pytest.HookRecorder) -> dict[str, str]:
    """Case id -> the rule its failure message names."""
    rules = {}
    for report in recorder.getfailures():
        match = RULE_IN_MESSAGE.search(report.longreprtext)
        assert match, f"{report.nodeid} failed without naming a rule:\n{report.longreprtext}"
        rules[report.nodeid.split("[", 1)[1].rstrip("]")] = match.group(1)
    return rules


def test_correct_reference_backend_passes(pytester):
    recorder = run_suite(pytester, "--kvcore-backend", "broken_backends:CorrectBackend")
    passed, skipped, failed = recorder.listoutcomes()
    assert not failed
    assert len(passed) >= 20
    skipped_ids = [r.nodeid.split("[")[1] for r in skipped]
    # The feature cases of what it does not declare (sinks, soft-cap) skip, saying so.
    features = [i for i in skipped_ids if "-sinks" in i or "-softcap" in i]
    assert len(features) == 6
    assert [i for i in skipped_ids if i not in features] == [
        "CORRECT-cpu-int64-offsets-fp32-D64-bs16]"]


@pytest.mark.parametrize(("backend", "rule", "failing_checks", "says"), [
    pytest.param("StrideOrderNotPermutation", "stride-order-permutation",
                 {"stride-order", "cross-layer-claim", "cache-write", "forward", "stale-bytes",
                  "cross-layer", "builder", "strided-steps", "engine-metadata", "overwrites"},
                 ["get_kv_cache_stride_order(False) = (0, 1, 3, 3, 4) is not a permutation of "
                  "(0, 1, 2, 3, 4)"],
                 id="stride-order-not-a-permutation"),
    pytest.param("CrossLayerOrderSplitsPages", "cross-layer-claim",
                 {"cross-layer-claim", "cache-write", "forward", "stale-bytes", "cross-layer",
                  "builder", "strided-steps", "engine-metadata", "overwrites"},
                 ["get_kv_cache_stride_order(True) = (1, 2, 0, 3, 4, 5) claims cross-layer, so "
                  "with the per-layer order (0, 1, 2, 3, 4) it must be (1, 0, 2, 3, 4, 5)"],
                 id="cross-layer-order-splits-pages"),
    pytest.param("IgnoresPageStride", "cross-layer-bit-exact", {"cross-layer"},
                 ["forward on layer 1 of a 3-layer cross-layer cache (layout B,L,2,N,H,D, page "
                  "stride 12288 elements) differs from forward on a contiguous cache (page "
                  "stride 4096)"],
                 id="kernel-ignores-page-stride"),
    pytest.param("WritesIntoNeighbourLayer", "cross-layer-untouched-neighbours", {"cross-layer"},
                 ["after do_kv_cache_update on layer 1 of a 3-layer cross-layer cache",
                  "config: dtype=fp32, head_size=64, block_size=16"],
                 id="writes-into-neighbour-layer"),
    pytest.param("ClaimsAnyHeadSize", "validation-refuses-before-kernel", {"forward"},
                 ["validate_configuration accepted this configuration, but forward raised "
                  "RuntimeError: tile size 80 is not a power of two"],
                 id="kernel-crashes-on-accepted-head-size"),
    pytest.param("GraphClaimWithoutBuffers", "builder-persistent-buffers", {"builder-buffers"},
                 ["CUDA_GRAPH_SUPPORT = UNIFORM_DECODE but get_builder_cls() returns "
                  "AttentionMetadataBuilder, which keeps no persistent buffers"],
                 id="graph-claim-without-buffers"),
    pytest.param("BuilderAllocatesPerStep", "builder-persistent-buffers", {"builder-buffers"},
                 ["two steps built for graph_batch_size=4 differ in metadata.seq_lens"],
                 id="builder-allocates-per-step"),
    pytest.param("BuilderDropsAToken", "builder-reference", {"builder"},
                 ["forward with builder.build()'s metadata for the mixed batch raised "
                  "ValueError: seq_lens[3]=16 is shorter than its 17 query tokens"],
                 id="builder-changes-the-step"),
    pytest.param("BuilderSkipsStepChecks", "overlapping-new-tokens-refused", {"overwrites"},
                 ["builder.build() accepted a step where request 1's new token is written to "
                  "slot 16, the first token of request 0's cached block 1"],
                 id="builder-skips-the-step-checks"),
    pytest.param("DropsNonCausalWindow", "window-non-causal", {"window-non-causal"},
                 ["forward on a non-causal layer with sliding_window=19 does not match the "
                  "symmetric window |q_pos - k_pos| < sliding_window"],
                 id="drops-the-window-on-non-causal-layers"),
    pytest.param("DeclaresABlockSizeItRefuses", "validation-accepts-declared",
                 {"validation-accepts-declared"},
                 ["with 'block_size=16 with dtype=float32: the kernel tiles 64 tokens': "
                  "block_size=16 is refused with every other declared value of dtype too "
                  "(dtype: no other declared value)"],
                 id="declares-a-block-size-it-refuses"),
    # The engine's strided tensors (engine-metadata) catch it too.
    pytest.param("ReadsStepTensorsDensely", {"strided-step-tensors", "engine-metadata"},
                 {"strided-steps", "engine-metadata"},
                 ["do_kv_cache_update with slot_mapping a view at stride 2"],
                 id="reads-step-tensors-densely"),
    pytest.param("ReadsAdoptedOrderAsItsOwn", "adopted-orders", {"adopted-orders"},
                 ["do_kv_cache_update on a cache adopted in the per-layer order (0, 2, 3, 1, 4) "
                  "(physical B,N,H,2,D; vLLM LBNHC), strides (4096, 64, 256, 128, 1), against a "
                  "cache in READS_ADOPTED_ORDER_AS_ITS_OWN's own order (0, 1, 2, 3, 4)"],
                 id="reads-an-adopted-order-as-its-own"),
    pytest.param("MasksStaleSlotsByMultiplying", "stale-bytes-masked", {"stale-bytes"},
                 ["output elements changed from this backend's output before the poisoning",
                  "non-finite): forward read slots it does not own"],
                 id="masks-stale-slots-by-multiplying"),
    pytest.param("VagueReasons", "validation-reasons", {"validation-refuses"},
                 ["for dtype=bfloat16, no reason names 'dtype': ['not supported']"],
                 id="reasons-name-no-field"),
    # The builder check runs forward too and catches it as well; the stale-bytes check sees
    # the same output with and without the poison, so it is not a stale read; the scaling
    # also changes the output's padding rows (engine-metadata).
    pytest.param("MLAOnePercentOff", {"forward-reference", "builder-reference",
                                      "engine-metadata"},
                 {"forward", "builder", "engine-metadata"},
                 ["tokens have a relative error norm over their heads above 0.007",
                  "MLA latent 64 = kv_lora_rank 48 + rope 16"],
                 id="mla-output-one-percent-off"),
    pytest.param("MLAIgnoresPageStride", "cross-layer-bit-exact", {"cross-layer"},
                 ["forward on layer 1 of a 3-layer cross-layer cache (layout B,L,N,D, page "
                  "stride 3072 elements) differs from forward on a contiguous cache (page "
                  "stride 1024)"],
                 id="mla-kernel-ignores-page-stride"),
    pytest.param("MLAWritesIntoNeighbourLayer", "cross-layer-untouched-neighbours",
                 {"cross-layer"}, ["after do_kv_cache_update on layer 1 of a 3-layer "
                                   "cross-layer cache (layout B,L,N,D"],
                 id="mla-writes-into-neighbour-layer"),
])
def test_suite_fails_broken_backend_with_the_rule_it_breaks(pytester, monkeypatch, backend,
                                                            rule, failing_checks, says):
    spec = f"broken_backends:{backend}"
    recorder = run_suite(pytester, "--kvcore-backend", spec)
    rules = failed_rules(recorder)
    assert set(rules.values()) == ({rule} if isinstance(rule, str) else rule)
    monkeypatch.syspath_prepend(HERE)
    kinds = {case.id: case.kind for case in conformance_cases(spec)}
    assert {kinds[case_id] for case_id in rules} == failing_checks
    messages = "\n".join(r.longreprtext for r in recorder.getfailures())
    for text in says:
        assert text in messages
    passed, _, _ = recorder.listoutcomes()
    assert any(r.nodeid.endswith("-identity]") for r in passed)  # the rest still holds


def test_correct_mla_backend_passes_every_numerical_check(pytester):
    recorder = run_suite(pytester, "--kvcore-backend", "broken_backends:CorrectMLABackend")
    passed, skipped, failed = recorder.listoutcomes()
    assert not failed, "\n\n".join(r.longreprtext for r in failed)
    ran = {r.nodeid.split("[")[1].split("-")[2] for r in passed if "-cpu-" in r.nodeid}
    assert {"cache", "forward", "cross"} <= ran
    assert [r.nodeid.split("[")[1] for r in skipped] == [
        "CORRECT_MLA-cpu-int64-offsets-fp32-D64-bs16]"]


def test_every_case_names_a_documented_rule():
    cases = conformance_cases("CPU_ATTN")
    assert {c.rule for c in cases} <= set(RULES)
    assert len({c.id for c in cases}) == len(cases)


def test_plugin_is_registered_through_the_pytest11_entry_point(pytester):
    (entry,) = [e for e in metadata.entry_points(group="pytest11") if e.name == "kvcore"]
    assert entry.value == "kvcore_pytest"
    config = pytester.parseconfig()
    assert config.pluginmanager.get_plugin("kvcore") is entry.load()


def test_loading_the_pytest_plugin_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, kvcore_pytest; print('torch' in sys.modules, kvcore_pytest.SUITE.is_file())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]


def test_plugin_adds_no_tests_without_the_option(pytester):
    pytester.makepyfile(test_unrelated="def test_one():\n    pass\n")
    recorder = run_suite(pytester)
    recorder.assertoutcome(passed=1)


@pytest.mark.slow
def test_fixtures_skip_without_the_option_and_parametrise_with_it(pytester):
    pytester.makepyfile(test_vendor=(
        "def test_name(kvcore_backend):\n"
        "    assert kvcore_backend.get_name() == 'CPU_ATTN'\n"))
    skipped = run_suite(pytester).getreports("pytest_runtest_logreport")
    (report,) = [r for r in skipped if r.when == "setup"]
    assert report.skipped and "pass --kvcore-backend NAME" in report.longreprtext
    recorder = run_suite(pytester, "--kvcore-backend", "CPU_ATTN", "test_vendor.py")
    passed, _, failed = recorder.listoutcomes()
    assert not failed
    ids = {r.nodeid for r in passed}
    assert "test_vendor.py::test_name[CPU_ATTN]" in ids
    assert "kvcore/testing/suite.py::test_conformance[CPU_ATTN-identity]" in ids


def test_unknown_backend_is_a_usage_error_listing_valid_names(pytester):
    result = pytester.runpytest("--kvcore-backend", "NOPE", "-p", "no:hypothesispytest")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--kvcore-backend NOPE: unknown attention backend 'NOPE'; valid options are: *CPU_ATTN*"])


def _refusing_backend(combination=lambda config, capability: [], derived: list[str] = ()
                      ) -> type:
    """A backend of float32 and float16 on devices >= 8.0 whose check_combination returns
    ``combination(config, capability)`` and whose validation adds ``derived`` (a refusal the
    declarations do not explain)."""
    class Refusing(kvcore.AttentionBackend):
        SUPPORTED_DTYPES = (torch.float32, torch.float16)
        MIN_DEVICE_CAPABILITY = kvcore.DeviceCapability(8, 0)
        NAME = "REFUSING"  # no IMPL_CLS: get_impl_cls raises NotImplementedError

        @classmethod
        def check_combination(cls, config, device_capability):
            return combination(config, device_capability)

        @classmethod
        def validate_configuration(cls, **kwargs):
            return [*super().validate_configuration(**kwargs), *derived]

    return Refusing


BASE = {"head_size": 64, "dtype": torch.float32, "kv_cache_dtype": "auto", "block_size": 16,
        "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
        "use_per_head_quant_scales": False, "attn_type": "decoder",
        "device_capability": None}


def _dtype(config) -> str:
    return str(config.dtype).removeprefix("torch.")


@pytest.mark.parametrize(("combination", "derived", "fails_with"), [
    pytest.param(lambda c, cap: [], [], None, id="accepted"),
    # Blocks of 256 run on 8.0: the capability is fine alone (a block size clashing with the
    # device need not be shown to run on another one: its library may not be installed here).
    pytest.param(lambda c, cap: [f"block_size={c.block_size} with device_capability={cap}: "
                                 "this library takes multiples of 256 there"]
                 if c.block_size % 256 else [], [], None, id="a-clash-with-the-device"),
    # Block 16 runs in float16, float32 with other blocks: each value is fine alone.
    pytest.param(lambda c, cap: [f"block_size=16 with dtype={_dtype(c)}: the float32 kernel "
                                 "tiles 32 tokens"]
                 if c.block_size == 16 and c.dtype == torch.float32 else [], [], None,
                 id="a-clash-of-two-declared-values"),
    pytest.param(lambda c, cap: ["block_size=16: this library takes multiples of 256"]
                 if c.block_size == 16 else [], [],
                 "with reasons that name each clashing field", id="a-reason-naming-one-field"),
    pytest.param(lambda c, cap: ["block_size=160 with device_capability=9.0: other values"]
                 if c.block_size == 16 else [], [],
                 "with reasons that name each clashing field", id="a-reason-naming-other-values"),
    pytest.param(lambda c, cap: [], ["block_size=16 with head_size=64 are not supported"],
                 "only check_combination may refuse it", id="not-from-check-combination"),
    # THE FAULT the rule exists for: block 16 is declared (any block size) but refused with
    # every declared dtype, dressed up as a clash of two fields.
    pytest.param(lambda c, cap: [f"block_size=16 with dtype={_dtype(c)}: the kernel tiles "
                                 "32 tokens"] if c.block_size == 16 else [], [],
                 "block_size=16 is refused with every other declared value of dtype too "
                 "(dtype: float16)", id="a-declared-value-refused-everywhere"),
    pytest.param(lambda c, cap: [f"block_size={c.block_size} with device_capability={cap}: "
                                 "nothing runs there"], [],
                 "device_capability=8.0 is refused with every other declared value of "
                 "block_size too", id="a-declared-device-refused-everywhere"),
])
def test_validation_accepts_declared_allows_only_a_clash_of_values_each_fine_alone(
        combination, derived, fails_with):
    """The base case may be refused only by a cross-field rule that names the fields with
    their values, each of which is accepted with another declared value of the others."""
    backend = _refusing_backend(combination, derived)
    base = {**BASE, "device_capability": kvcore.DeviceCapability(8, 0)}
    if fails_with is None:
        check_validation_accepts(backend, base)
        return
    with pytest.raises(ConformanceError, match="validation-accepts-declared") as info:
        check_validation_accepts(backend, base)
    assert fails_with in str(info.value)


def test_validation_accepts_declared_runs_on_this_machines_capability(monkeypatch):
    """With a device capability here (simulated), the base case is built for it when the
    declarations cover it, else for the declared minimum."""
    backend = _refusing_backend()
    seen = []
    monkeypatch.setattr(backend, "check_combination", classmethod(
        lambda cls, config, capability: seen.append(capability) or []))
    for here, used in (("9.0", "9.0"), ("7.5", "8.0")):
        monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", here)
        (case,) = [c for c in conformance_cases(backend, ["cpu"])
                   if c.kind == "validation-accepts-declared"]
        seen.clear()
        case.run()
        assert seen == [kvcore.DeviceCapability.parse(used)]
