"""TRITON_ATTN's and TRITON_MLA's host paths hold their promises (on the CPU: Triton's real
launch path with a stand-in driver, in a process of its own, see ``host_path_checks.py``): a
direct launch runs the kernel Triton would pick with the arguments Triton would pass, nothing
is compiled or bound again over many calls of one shape, a layer's calls find their checks
without building the full signature and dispatch no torch op, and they allocate no tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("host_path_checks.py")


@pytest.fixture(scope="module")
def found() -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_direct_launches_run_the_kernel_triton_picks_with_its_arguments(found: dict) -> None:
    # Aligned and unaligned queries, 1 and 17 requests, a split step: each call twice.
    assert all(found["same_kernel"]) and all(found["same_args"]), found
    assert found["direct_runs"] >= 12  # every second call (write, attention, merge)


def test_many_calls_of_one_shape_compile_and_bind_nothing_more(found: dict) -> None:
    # 200 steps (a build each) of update_and_forward and write + forward, then 50 more.
    assert found["flat"] == {"compiles": 0, "bound": 0, "triton": 0, "direct": 900}


def test_a_layer_call_builds_no_full_signature_and_dispatches_no_torch_op(found: dict) -> None:
    # 100 rounds of update_and_forward and write + forward, then 100 more on the next step:
    # the ops find their checks by the impl's cache views, the impl keeps its views.
    none = {"full_keys": {"_layer_key": 0, "_write_key": 0}, "ops": []}
    assert found["steady"] == none
    assert found["steady_next_step"] == none
    # A new cache object for the layer: one unbind, and each op's full signature looked up
    # and built for the new checks once (two calls each), then by the views again.
    assert found["new_cache"] == {"full_keys": {"_layer_key": 2, "_write_key": 2},
                                  "ops": ["aten.unbind.int"]}


def test_mla_direct_launches_run_the_kernel_triton_picks_with_its_arguments(found: dict) -> None:
    # The latent cache write, decode (two kernels, one and two splits) and mixed batches
    # (one and two splits), aligned and unaligned queries: each call twice, as above.
    pytest.importorskip("kvcore_mla")
    assert found["mla_cases"] == 13, found
    assert all(found["same_kernel"][-2 * 13:]) and all(found["same_args"][-2 * 13:]), found


def test_mla_many_calls_compile_and_bind_nothing_more(found: dict) -> None:
    # Each of the 13 calls 100 times more: 19 launches a round (six merges), all direct.
    pytest.importorskip("kvcore_mla")
    assert found["mla_flat"] == {"compiles": 0, "bound": 0, "triton": 0, "direct": 1900}


def test_an_engine_step_derives_its_metadata_once_for_all_its_layers(found: dict) -> None:
    # 20 steps of 8 layers (each its own impl and cache), metadata built anew per step: each
    # op looks the step's facts up and checks its values once per step (by the first layer);
    # 2 launches a layer, all direct.
    assert found["engine_step"] == {
        "checked_step_facts": 40, "check_paged_attention_values": 20,
        "check_reshape_and_cache_values": 20, "compiles": 0, "bound": 0, "triton": 0,
        "direct": 320}


def test_inference_mode_metadata_runs_checked_per_call(found: dict) -> None:
    assert found["inference_metadata"] == {"direct": 6, "kept": False}


def test_a_layer_call_allocates_no_tensor(found: dict) -> None:
    allocated = found["allocated"]
    assert allocated.pop("torch.empty_like")  # the counter sees allocations
    assert allocated == {"update_and_forward": [], "write + forward": []}
