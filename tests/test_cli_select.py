"""``kvcore select`` as a newcomer meets it: simulated platforms that cannot lie, a refused
forced backend that says why first and what would run, a flag for every config field."""

from __future__ import annotations

import pytest
from cli_helpers import run_cli

import kvcore
from kvcore.cli.main import SELECT_CONFIG_FLAGS


@pytest.mark.parametrize(("args", "says"), [
    (["--platform", "cuda", "--capability", "gfx942"],
     "--capability gfx942 does not belong to --platform cuda: gfx942 is an AMD GPU "
     "architecture (platform rocm)"),
    (["--platform", "rocm", "--capability", "sm_90"],
     "--capability sm_90 does not belong to --platform rocm: 9.0 is an NVIDIA compute "
     "capability (platform cuda); ROCm devices are named by their gfx architecture"),
    (["--platform", "cpu", "--capability", "8.0"],
     "--capability 8.0 does not belong to --platform cpu: a CPU has no device capability"),
    (["--capability", "8.0"], "--capability 8.0 does not belong to platform cpu"),
    (["--capability", "9"], "--capability 9: device capability '9' is not of the form"),
], ids=["gfx-on-cuda", "sm-on-rocm", "any-on-cpu", "any-on-detected-cpu", "malformed"])
def test_a_capability_of_another_platform_is_refused_naming_both(fresh_kvcore, capsys, args,
                                                                   says):
    status, out, err = run_cli(capsys, "select", *args)
    assert (status, out) == (2, "") and says in err, err


@pytest.mark.parametrize(("env", "says"), [
    ({"KVCORE_PLATFORM": "cuda", "KVCORE_DEVICE_CAPABILITY": "gfx942"},
     "KVCORE_DEVICE_CAPABILITY=gfx942 does not belong to platform cuda: gfx942 is an AMD GPU "
     "architecture"),
    ({"KVCORE_PLATFORM": "rocm", "KVCORE_DEVICE_CAPABILITY": "sm_90"},
     "KVCORE_DEVICE_CAPABILITY=sm_90 does not belong to platform rocm"),
    ({"KVCORE_PLATFORM": "cpu", "KVCORE_DEVICE_CAPABILITY": "8.0"},
     "KVCORE_DEVICE_CAPABILITY=8.0 does not belong to platform cpu"),
    ({"KVCORE_PLATFORM": "cuda", "KVCORE_DEVICE_CAPABILITY": "9"},
     "KVCORE_DEVICE_CAPABILITY=9: device capability '9' is not of the form"),
    ({"KVCORE_PLATFORM": "tpu"}, "KVCORE_PLATFORM=tpu: unknown platform 'tpu'; valid options"),
], ids=["gfx-on-cuda", "sm-on-rocm", "any-on-cpu", "malformed", "unknown-platform"])
def test_the_environment_cannot_simulate_a_device_its_platform_lacks(fresh_kvcore, capsys,
                                                                      monkeypatch, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kvcore.clear_platform_cache()
    status, out, err = run_cli(capsys, "select")
    assert (status, out) == (2, "") and says in err, err
    with pytest.raises(ValueError, match=says.split(":")[0]):
        kvcore.explain_selection(kvcore.AttentionSelectorConfig(head_size=128))


def test_unknown_capability_lines_say_what_would_change_the_result(fresh_kvcore, capsys):
    # On the CPU the platform is the blocker: no line suggests a capability alone.
    status, out, err = run_cli(capsys, "select", "--explain", "--platform", "cpu")
    assert status == 0 and err == ""
    assert "    - platform=cpu (supported: cuda, rocm)\n" in out
    assert "(pass --capability" not in out and "note:" not in out.replace("    note:", "")
    # On ROCm, a bound written the CUDA way is simulated with a ROCm device name.
    status, out, _ = run_cli(capsys, "select", "--explain", "--platform", "rocm", "--mla")
    assert ("TRITON_MLA needs >= 8.0 (pass --capability gfx942 to simulate such a device)"
            in out)


def test_select_on_a_cpu_prints_no_note_about_a_capability(fresh_kvcore, capsys):
    assert run_cli(capsys, "select") == (0, "CPU_ATTN\n", "")


def test_a_refused_forced_backend_leads_with_its_reasons_and_names_what_runs(fresh_kvcore,
                                                                             capsys):
    status, out, err = run_cli(capsys, "select", "--backend", "CPU_ATTN", "--mla")
    assert (status, out) == (1, "")
    assert err.splitlines() == [
        "error: backend CPU_ATTN cannot run this config on cpu:",
        "  - use_mla=True but CPU_ATTN is not an MLA backend (choose an MLA backend)",
        "valid for this config on cpu: CPU_MLA",
        "pass --backend CPU_MLA, or leave out --backend for cpu's pick"]
    status, out, err = run_cli(capsys, "select", "--explain", "--backend", "CPU_ATTN", "--mla")
    assert status == 1
    assert out.splitlines()[2:6] == [
        "forced backend: CPU_ATTN",
        "CPU_ATTN cannot run this config on cpu:",
        "  - use_mla=True but CPU_ATTN is not an MLA backend (choose an MLA backend)",
        "valid for this config on cpu: CPU_MLA"]
    assert err.splitlines()[0] == "error: backend CPU_ATTN cannot run this config on cpu"


def test_a_refused_forced_backend_names_what_runs_in_the_library_error(fresh_kvcore):
    config = kvcore.AttentionSelectorConfig(head_size=576, use_mla=True)
    with pytest.raises(kvcore.BackendSelectionError,
                       match=r"CPU_ATTN is not an MLA backend \(choose an MLA backend\)\. "
                             r"Valid for this config on cpu: CPU_MLA \(config: "):
        kvcore.get_attn_backend(config, backend="CPU_ATTN", platform="cpu")


def test_every_config_field_is_a_select_flag():
    import argparse
    from dataclasses import fields

    from kvcore.cli.main import build_parser

    names = [f.name for f in fields(kvcore.AttentionSelectorConfig)]
    assert list(SELECT_CONFIG_FLAGS) == names
    commands = next(a for a in build_parser(False)._actions
                    if isinstance(a, argparse._SubParsersAction))
    dests = {a.dest for a in commands.choices["select"]._actions}
    assert set(names) <= dests


_BOOL_FIELDS = [f for f, (_, options) in SELECT_CONFIG_FLAGS.items()
                if options.get("action") == "store_true"]


@pytest.mark.parametrize("field", _BOOL_FIELDS)
def test_each_flag_reaches_the_config(fresh_kvcore, capsys, field):
    import json

    extra = ["--kv-cache-dtype", "fp8"] if field == "use_per_head_quant_scales" else []
    _, out, _ = run_cli(capsys, "select", "--format", "json", SELECT_CONFIG_FLAGS[field][0],
                     *extra)
    config = json.loads(out)["config"]
    assert [k for k in _BOOL_FIELDS if config[k]] == [field]


def test_mla_head_size_is_the_latent_size(fresh_kvcore, capsys):
    import json

    _, out, _ = run_cli(capsys, "select", "--format", "json", "--mla")
    assert json.loads(out)["config"]["head_size"] == 576
    _, out, _ = run_cli(capsys, "select", "--format", "json", "--mla", "--head-size", "256")
    assert json.loads(out)["config"]["head_size"] == 256
    _, out, _ = run_cli(capsys, "select", "--format", "json")
    assert json.loads(out)["config"]["head_size"] == 128
    _, help_text, _ = run_cli(capsys, "select", "--help")
    assert "(default: 128; with --mla 576). For MLA it is the latent size" in " ".join(
        help_text.split())


@pytest.mark.parametrize(("args", "says"), [
    (["--sliding-window", "4096"],
     "kvcore select: error: --sliding-window: a sliding window is the layer's"),
    (["--logits-soft-cap=30"], "--logits-soft-cap: the cap's value is the layer's"),
    (["--per-head-quant-scales"],
     "--per-head-quant-scales: per-head scales quantise an fp8 KV cache, and --kv-cache-dtype "
     "is auto (the model's dtype, unscaled); add --kv-cache-dtype fp8"),
    (["--mm-prefix", "--non-causal"],
     "--mm-prefix with --non-causal: a multimodal prefix is attended bidirectionally inside a "
     "causal decoder layer, and this layer is not causal at all; leave out --mm-prefix or "
     "--non-causal"),
    (["--mm-prefix", "--attn-type", "encoder_only"],
     "--mm-prefix with --attn-type encoder_only:"),
], ids=["sliding-window", "soft-cap", "per-head-scales-unquantised", "mm-prefix-non-causal",
        "mm-prefix-encoder"])
def test_impossible_or_unknown_select_options_are_refused_with_the_fix(fresh_kvcore, capsys,
                                                                       args, says):
    status, out, err = run_cli(capsys, "select", *args)
    assert (status, out) == (2, "") and says in err, err


def test_both_fp8_spellings_are_accepted_and_printed_one_way(fresh_kvcore, capsys):
    import json

    _, out, _ = run_cli(capsys, "select", "--format", "json", "--kv-cache-dtype", "float8_e4m3fn")
    assert json.loads(out)["config"]["kv_cache_dtype"] == "fp8_e4m3"
    for spelling in ("fp8_e4m3", "float8_e4m3fn"):
        status, out, _ = run_cli(capsys, "layout", "TRITON_ATTN", "--dtype", spelling,
                              "--format", "json")
        assert status == 0 and json.loads(out)["dtype"] == "float8_e4m3fn"
