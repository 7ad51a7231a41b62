"""``kvcore.long_step``: a long first-use step says what it builds, its estimate and its cache;
a quick one (a warm cache) and a run off the terminal say nothing."""

from __future__ import annotations

import logging
import time

import pytest

import kvcore


@pytest.fixture(autouse=True)
def _no_override():
    previous = kvcore.set_progress(None)
    yield
    kvcore.set_progress(previous)


def test_a_long_step_prints_what_its_estimate_and_its_cache_then_its_time(capsys):
    kvcore.set_progress(True)
    with kvcore.long_step("compiling ACME's kernels", estimate="about a minute",
                          cache="/tmp/acme-cache", after_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("kvcore: compiling ACME's kernels -- first use only, about a minute; "
                        "cached in /tmp/acme-cache, reused by later runs ...")
    assert lines[1].startswith("kvcore: compiling ACME's kernels: done in ")
    assert len(lines) == 2


def test_a_quick_step_prints_nothing(capsys):
    kvcore.set_progress(True)
    with kvcore.long_step("loading ACME's kernels", after_s=5):
        pass
    time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_off_the_terminal_or_switched_off_it_only_logs(capsys, caplog, monkeypatch):
    monkeypatch.setenv("KVCORE_PROGRESS", "auto")  # capsys' stderr is no terminal
    with caplog.at_level(logging.INFO, logger="kvcore.progress"):
        with kvcore.long_step("pinning 1 GiB", after_s=0):
            pass
    assert capsys.readouterr().err == ""
    assert caplog.records[0].getMessage().startswith("pinning 1 GiB ...")
    monkeypatch.setenv("KVCORE_PROGRESS", "1")
    assert kvcore.progress_enabled()
    kvcore.set_progress(False)  # kvcore demo --no-progress
    assert not kvcore.progress_enabled()


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVCORE_PROGRESS", "loud")
    with pytest.raises(ValueError, match=r"KVCORE_PROGRESS='loud' \(supported: 1, 0, auto\)"):
        kvcore.progress_enabled()
