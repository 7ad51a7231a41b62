"""The kvcore command, end to end in a subprocess (as an operator runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


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
    assert [c["name"] for c in data["candidates"]][:2] == ["FLASH_ATTN", "FLASHINFER"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["select", "--backend", "NOPE"], "unknown attention backend 'NOPE'; valid options are"),
     (["select", "--capability", "ampere"], "device capability 'ampere' is not of the form"),
     (["select", "--platform", "tpu"], "unknown platform 'tpu'; valid options are: cpu")],
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


def test_collect_env():
    data = json.loads(kvcore_cmd("collect-env", "--format", "json").stdout)
    assert data["python"] == sys.version.split()[0]
    assert data["platforms"]["cpu"] == "present"
    assert data["plugins"]["builtin_backends"] == "loaded"
    assert "torch:" in kvcore_cmd("collect-env").stdout


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
