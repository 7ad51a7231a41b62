"""FLASHINFER's layer call holds its host-path promises (on the CPU: Triton's real launch path
for the cache write with a stand-in driver and stand-in FlashInfer wrappers, in a process of
its own, see ``flashinfer_host_path_checks.py``): once a layer's cache passed the full checks,
its calls split no cache, build no full signature, repeat no full check, leave FlashInfer's
``run`` (its argument work) to the plan's recorded call and dispatch no torch op; a new or
changed cache is checked in full again; nothing is allocated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("flashinfer_host_path_checks.py")
pytest.importorskip("kvcore_nvidia")
#: Counted calls: the layer's full check, the write's full signature, the attention's full
#: checks and FlashInfer's ``run`` (its argument work; a recorded run calls the compiled
#: module straight).
NONE = {"validate_paged_attention": 0, "_write_key": 0, "_checked_attend": 0, "run": 0}


@pytest.fixture(scope="module")
def found() -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_layer_call_splits_nothing_checks_nothing_again_and_dispatches_no_op(found):
    # 100 rounds of write + forward and update_and_forward, then 100 on the next step.
    assert found["steady"] == {"counts": NONE, "ops": []}
    assert found["steady_next_step"] == {"counts": NONE, "ops": []}


def test_a_new_or_changed_cache_is_checked_in_full_once(found):
    # A new cache object: split once, the write's signature built for its new checks (a
    # look-up and the checks' key), the layer's full checks once; then the short path.
    new = {"validate_paged_attention": 1, "_write_key": 2, "_checked_attend": 1, "run": 1}
    assert found["new_cache"]["counts"] == new
    assert "aten.unbind.int" in found["new_cache"]["ops"]
    # The same object made smaller in place: its blocks are checked against the step again.
    assert found["changed_cache"]["counts"] == new


def test_a_layer_call_allocates_no_tensor(found):
    allocated = found["allocated"]
    assert allocated.pop("torch.empty_like")  # the counter sees allocations
    assert allocated == {"write + forward": [], "update_and_forward": []}
