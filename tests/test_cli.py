"""The kvcore command, end to end in a subprocess (as an operator runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_helpers import run_cli

import kvcore


def kvcore_cmd(*args, env=None, plugins_dir=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    if plugins_dir is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(plugins_dir), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvcore.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=120)


def test_list_table_and_json():
    table = kvcore_cmd("list")
    assert table.returncode == 0
    assert "CPU_ATTN" in table.stdout and "cross-layer" in table.stdout
    rows = json.loads(kvcore_cmd("list", "--format", "json").stdout)
    cpu = next(r for r in rows if r["name"] == "CPU_ATTN")
    assert cpu["platforms"] == ["cpu"] and cpu["cross_layer"] and cpu["error"] is None


def test_select_on_cpu_prints_the_pick():
    result = kvcore_cmd("select", "--head-size", "64")
    assert result.returncode == 0 and result.stdout.strip() == "CPU_ATTN"


def test_select_explain_rocm_with_connector_excludes_rocm_attn(fixture_plugins_dir):
    result = kvcore_cmd("select", "--explain", "--platform", "rocm", "--capability", "gfx942",
                        "--kv-connector", plugins_dir=fixture_plugins_dir,
                        env={"KVCORE_PLUGINS": "testfixture_standin_rocm"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "platform: rocm (device capability gfx942 (9.4))" in out
    assert "selected: ROCM_AITER_UNIFIED_ATTN" in out
    assert ("  ROCM_ATTN: rejected [plugin testfixture_standin_rocm]\n"
            "    - KV connector not supported: ROCM_ATTN keeps the legacy (2, num_blocks, ...) "
            "layout; use ROCM_AITER_UNIFIED_ATTN") in out


def test_select_nothing_valid_exits_nonzero_with_reasons():
    result = kvcore_cmd("select", "--explain", "--mla", "--sink", "--platform", "cpu")
    assert result.returncode == 1
    assert "use_mla=True but CPU_ATTN is not an MLA backend" in result.stdout
    assert "has_sink=True: CPU_MLA does not support attention sinks" in result.stdout
    assert "error: no backend can run this config on cpu" in result.stderr


def test_select_json_is_machine_readable():
    data = json.loads(kvcore_cmd("select", "--format", "json", "--platform", "cuda",
                                 "--capability", "9.0").stdout)
    assert data["platform"] == "cuda" and data["device_capability"] == "9.0"
    cuda, nine = kvcore.get_platform("cuda"), kvcore.DeviceCapability(9, 0)
    config = kvcore.AttentionSelectorConfig(head_size=128)
    order = cuda.get_backend_priorities(config, nine)
    assert [c["name"] for c in data["candidates"]][:len(order)] == order
    shipped = cuda.shipped_order(config, nine)
    assert data["shipped_ranking"]["order"] == list(shipped.order)
    assert [r["phase"] for r in data["phase_rankings"]] == [p.phase for p in shipped.phases]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["select", "--backend", "NOPE"],
      "--backend NOPE: unknown attention backend; valid names: CPU_ATTN, "),
     (["select", "--capability", "ampere"], "device capability 'ampere' is not of the form"),
     (["select", "--platform", "tpu"],
      "--platform tpu: unknown platform 'tpu'; valid options are: cpu")],
    ids=["unknown-backend", "bad-capability", "unknown-platform"],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
    result = kvcore_cmd(*args)
    assert result.returncode == 2 and message in result.stderr


def test_plugins_reports_load_errors(fixture_plugins_dir):
    result = kvcore_cmd("plugins", "--format", "json", plugins_dir=fixture_plugins_dir,
                        env={"KVCORE_PLUGINS": "testfixture_broken_import,"
                                               "testfixture_broken_register"})
    data = json.loads(result.stdout)
    status = {p["name"]: (p["status"], p["error"]) for p in data["plugins"]}
    assert status["testfixture_broken_import"][0] == "failed"
    assert "needs libacme.so" in status["testfixture_broken_import"][1]
    assert status["testfixture_standin_rocm"] == ("not allowed", None)
    assert {"registry": "attention backend", "plugin": "testfixture_broken_register",
            "error": "RuntimeError: acme driver handshake failed"} in data["registration_errors"]
    table = kvcore_cmd("plugins", plugins_dir=fixture_plugins_dir,
                       env={"KVCORE_PLUGINS": "testfixture_broken_import"}).stdout
    assert "testfixture_broken_import" in table and "failed" in table


def test_plugins_lists_backends_that_fail_to_load(fixture_plugins_dir):
    result = kvcore_cmd("plugins", "--format", "json", plugins_dir=fixture_plugins_dir,
                        env={"KVCORE_PLUGINS": "testfixture_bad_backends"})
    errors = [e["error"] for e in json.loads(result.stdout)["registration_errors"]
              if e["plugin"] == "testfixture_bad_backends"]
    assert result.returncode == 0 and len(errors) == 4  # every backend is loaded here
    assert any("'NO_PLATFORMS'" in e and "invalid PLATFORMS" in e for e in errors)
    assert any("'PLATFORMS_DISAGREE'" in e and "make the two agree" in e for e in errors)
    for name in ("EXIT_ANYWHERE", "EXIT_ON_CUDA"):
        assert any(f"'{name}'" in e and "SystemExit: 7" in e for e in errors)


def test_collect_env():
    data = json.loads(kvcore_cmd("collect-env", "--format", "json").stdout)
    assert data["python"] == sys.version.split()[0]
    assert data["platforms"]["cpu"] == "present"
    assert data["plugins"]["builtin_backends"] == "loaded"
    table = kvcore_cmd("collect-env").stdout
    assert "torch:" in table and not table.rstrip().endswith(":")
    assert "environment: (none set)" in table or "\n  KVCORE_" in table or "\n  TRITON" in table


def test_select_capability_does_not_leak_into_the_environment(fresh_kvcore, monkeypatch, capsys):
    from kvcore.cli import main

    monkeypatch.delenv("KVCORE_DEVICE_CAPABILITY", raising=False)
    main(["select", "--platform", "cuda", "--capability", "9.0", "--format", "json"])
    assert json.loads(capsys.readouterr().out)["device_capability"] == "9.0"
    assert "KVCORE_DEVICE_CAPABILITY" not in os.environ
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "8.0")
    main(["select", "--platform", "cuda", "--capability", "9.0", "--format", "json"])
    assert os.environ["KVCORE_DEVICE_CAPABILITY"] == "8.0"


def test_output_cut_short_by_the_reader_is_not_a_traceback():
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "list"], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything is written: EPIPE on write
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


_TORCH_AFTER = """
import sys
from kvcore.cli import main
try:
    status = main({args!r})
except SystemExit as exc:
    status = exc.code
print("torch imported:", "torch" in sys.modules, "status:", status)
"""


@pytest.mark.parametrize(("args", "status"), [
    (["--help"], 0), (["--version"], 0), (["demo", "--help"], 0), (["select", "--help"], 0),
    (["select", "--head-size", "x"], 2), (["nope"], 2), ([], 2)],
    ids=["help", "version", "demo-help", "select-help", "bad-int", "bad-command", "no-command"])
def test_help_version_and_argument_errors_do_not_import_torch(args, status):
    result = subprocess.run([sys.executable, "-c", _TORCH_AFTER.format(args=args)],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == f"torch imported: False status: {status}", \
        result.stdout + result.stderr


def test_version_is_the_distribution_version():
    from importlib import metadata

    result = kvcore_cmd("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvcore {metadata.version('kvcore')}"


def test_missing_cli_extra_is_one_line_naming_the_extra(monkeypatch, capsys):
    from kvcore.cli import main

    monkeypatch.setitem(sys.modules, "tabulate", None)  # as if not installed
    assert main(["list"]) == 1
    err = capsys.readouterr().err
    assert err == "error: the kvcore command needs tabulate: pip install 'kvcore[cli]'\n"


def test_kv_cache_dtype_choices_are_kvcores():
    import kvcore.ops
    from kvcore.cli.main import KV_CACHE_DTYPE_CHOICES

    assert KV_CACHE_DTYPE_CHOICES == kvcore.ops.KV_CACHE_DTYPES




@pytest.mark.parametrize(("args", "says", "not_says"), [
    (["demo", "--new-tokens", "-1"], "argument --new-tokens: -1 is not a positive integer",
     "max_new_tokens"),
    (["layout", "TRITON_ATTN", "--num-blocks", "-1"],
     "argument --num-blocks: -1 is not a positive integer", "logical_shape"),
    (["layout", "TRITON_ATTN", "--head-size", "0"],
     "argument --head-size: 0 is not a positive integer", "B,"),
    (["layout", "ROCM_ATTN", "--cross-layer"],
     "--cross-layer: ROCM_ATTN does not opt in to cross-layer KV caches", "cross_layer="),
    (["layout", "TRITON_MLA", "--num-kv-heads", "2"],
     "--num-kv-heads 2: TRITON_MLA is an MLA backend", "num_kv_heads="),
    (["layout", "NOPE"], "layout NOPE: unknown attention backend; valid names: CPU_ATTN, ",
     "argument"),
    (["demo", "--backend", "NOPE"], "--backend NOPE: unknown attention backend", "argument"),
    (["demo", "--backend", "TRITON_MLA", "--model", "tiny"],
     "TRITON_MLA was requested by --backend but cannot run", "the backend argument"),
    (["demo", "--platform", "cuda"], "--platform cuda: not present on this machine",
     "platform="),
    (["bench", "--size", "huge"], "argument --size: invalid choice: 'huge'", "size="),
    (["select", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'", "dtype="),
], ids=["demo-new-tokens", "layout-num-blocks", "layout-head-size-zero", "layout-cross-layer",
        "layout-mla-heads", "layout-unknown-backend", "demo-unknown-backend",
        "demo-invalid-backend", "demo-absent-platform", "bench-size", "select-dtype"])
def test_errors_name_the_flags_the_user_typed(fresh_kvcore, capsys, args, says, not_says):
    status, _, err = run_cli(capsys, *args)
    assert status == 2 and says in err and not_says not in err, err


def test_dtype_aliases_are_accepted(fresh_kvcore, capsys):
    assert run_cli(capsys, "select", "--dtype", "bf16", "--format", "json")[0] == 0


def test_select_explain_says_why_the_winner_beat_the_other_valid_backends(fresh_kvcore,
                                                                           capsys):
    status, out, _ = run_cli(capsys, "select", "--explain", "--platform", "cpu")
    assert status == 0
    assert ("selected: CPU_ATTN\nwhy: first valid backend in cpu's priority list (CPU_ATTN)"
            in out)
    assert "  SDPA_GATHER: valid, lower priority [plugin example]" in out


def test_select_without_capability_suggests_the_flag_with_the_platforms_spelling(
        fresh_kvcore, capsys, monkeypatch):
    monkeypatch.delenv("KVCORE_DEVICE_CAPABILITY", raising=False)
    status, out, _ = run_cli(capsys, "select", "--explain", "--platform", "rocm", "--kv-connector")
    assert status == 0 and "KVCORE_DEVICE_CAPABILITY" not in out
    assert ("ROCM_AITER_UNIFIED_ATTN needs >= gfx942 (9.4) and <= gfx950 (9.5) (pass "
            "--capability gfx942 to simulate such a device)") in out
    # Valid without a capability (pure torch, any ROCm GPU), and the why says so.
    assert ("selected: SDPA_GATHER\nwhy: no backend in rocm's priority list "
            "(ROCM_AITER_UNIFIED_ATTN, ROCM_AITER_FA, TRITON_ATTN) is valid; first valid of the "
            "other backends registered for rocm") in out
    assert out.rstrip().endswith("pass --capability to simulate a device, e.g. --capability "
                                 "gfx942")
    _, out, err = run_cli(capsys, "select", "--platform", "cuda")
    assert "e.g. --capability 9.0" in err
    status, out, _ = run_cli(capsys, "select", "--explain", "--platform", "rocm", "--kv-connector",
                          "--capability", "gfx942")
    assert "selected: ROCM_AITER_UNIFIED_ATTN\nwhy: first valid backend" in out
    assert "pass --capability" not in out


def test_every_option_of_every_command_has_help():
    import argparse

    from kvcore.cli.main import build_parser

    parser = build_parser(with_kernels_options=True)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in commands.choices.items() for action in sub._actions
               if not action.help or action.help == argparse.SUPPRESS]
    assert len(commands.choices) >= 8 and missing == []


def test_choices_spelled_out_in_the_parser_are_kvcores():
    import kvcore
    from kvcore.cli.bench import SIZES
    from kvcore.cli.main import BENCH_SIZE_CHOICES, CACHE_DTYPE_CHOICES

    assert BENCH_SIZE_CHOICES == tuple(SIZES)
    for name in CACHE_DTYPE_CHOICES:
        assert str(kvcore.parse_dtype(name)) == f"torch.{name}"
