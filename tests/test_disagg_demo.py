"""``kvcore demo --disaggregated``: prefill in one process, decode in another, KV through
``nixl`` (or ``mooncake``); the tokens match one engine alone, and the check catches KV that
did not arrive."""

from __future__ import annotations

import time

import pytest
import torch

from kvcore.connectors.mooncake import mooncake_unavailable_reason
from kvcore.connectors.nixl import nixl_unavailable_reason
from kvcore.demo.disagg import (
    DisaggOptions,
    DisaggResult,
    _Handover,
    _Setup,
    default_dtype,
    format_result,
    run_disaggregated,
)
from kvcore.demo.engine import Engine

pytestmark = pytest.mark.skipif(nixl_unavailable_reason() is not None,
                                reason=str(nixl_unavailable_reason()))


def options(**overrides) -> DisaggOptions:
    return DisaggOptions(**{"model": "tiny", "batch": 3, "max_new_tokens": 4,
                            "platform": "cpu", "timeout_s": 60.0, **overrides})


def test_disaggregated_tokens_match_one_engine():
    result = run_disaggregated(options())
    assert result.ok, result.mismatches
    assert result.blocks_loaded == result.blocks_eligible > 0
    assert result.loaded_bytes > 0
    assert ("tokens identical to the same steps in one process and to one engine alone: yes"
            in format_result(result))


def test_bfloat16_is_checked_against_the_same_steps_and_one_engine_is_a_note():
    """In bfloat16 the tokens must equal the same steps run in one process (the transfer is
    all that differs); against one engine alone (batched differently) a difference is a
    note, never a failure."""
    result = run_disaggregated(options(dtype="bfloat16"))
    assert result.ok, result.mismatches
    assert all(n.startswith("note ") and "near ties" in n for n in result.notes)
    assert "tokens identical to the same steps in one process" in format_result(result)


def test_bfloat16_with_shared_prefixes_across_prefill_steps_matches_the_same_steps():
    """Two requests per step: later prompts share a system prompt with earlier, finished ones.
    The producer's engine computes them anyway (a producer finds nothing) and the consumer
    reads each request's own copy; the one-process reference must do the same (with the
    offload connector it loaded the earlier copy, and bfloat16 tokens differed on the H200)."""
    result = run_disaggregated(options(dtype="bfloat16", batch=6, max_num_seqs=2))
    assert result.ok, result.mismatches
    assert result.blocks_loaded == result.blocks_eligible > 0


def test_the_one_process_reference_publishes_a_copy_per_save_and_reads_them_in_order():
    kv = _Setup(options()).caches()
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(1)))
    with _Handover() as handover:
        handover.register_kv_caches(kv)
        first, second = handover._read_blocks([0]), handover._read_blocks([1])
        assert not torch.equal(first, second)
        assert handover.save(["a" * 64], [0]).wait().ok
        assert handover.save(["a" * 64], [1]).wait().ok
        assert handover.lookup(["a" * 64]) == 0  # the prefill side finds nothing
        handover.consuming = True
        assert handover.lookup(["a" * 64, "b" * 64]) == 1
        assert handover.load(["a" * 64], [2]).wait().ok
        assert torch.equal(handover._read_blocks([2]), first)
        assert handover.load(["a" * 64], [3]).wait().ok
        assert torch.equal(handover._read_blocks([3]), second)
        assert handover.lookup(["a" * 64]) == 0  # each copy is read once
        assert not handover.load(["a" * 64], [2]).wait().ok


def test_blocks_reported_loaded_but_never_read_are_caught(monkeypatch):
    """NIXL that reports every READ done and moves nothing (READs from a lease or from the
    blocks a lookup named alike): the demo's token check catches the blocks it loaded."""
    from kvcore.connectors import nixl

    def pretend_to_start(self, run, lease, local, remote_regions, remote):
        run.handle = None

    monkeypatch.setattr(nixl._Agent, "start_read", pretend_to_start)
    monkeypatch.setattr(nixl._Agent, "poll", lambda self, run: "DONE")
    result = run_disaggregated(options(timeout_s=3.0))  # the producer releases after 3 s
    assert not result.ok
    assert any(m.startswith("MISMATCH") for m in result.mismatches)


def _slow_first(monkeypatch, method: str, seconds: float) -> None:
    """The decode process's first call of ``Engine.<method>`` takes ``seconds`` longer, as a
    cold kernel cache makes an engine's start (its builder's ``warmup()``) or first step
    (FlashInfer's JIT modules: a minute or more); the prefill process is spawned, so it is not
    patched."""
    original, slow = getattr(Engine, method), [seconds]

    def first_call_slow(self, *args, **kwargs):
        if slow:
            time.sleep(slow.pop())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, method, first_call_slow)


def test_a_decode_engine_that_builds_kernels_first_still_reads_every_block(monkeypatch):
    """The decode engine starts and runs its first steps before the prefill engine publishes,
    so builds longer than the producer's hold (``timeout_s``) cost time, not the blocks.
    Requests join while others decode (``max_num_seqs=2``), so later loads follow a step."""
    _slow_first(monkeypatch, "__init__", 5.0)
    _slow_first(monkeypatch, "_step", 5.0)
    result = run_disaggregated(options(timeout_s=3.0, batch=4, max_num_seqs=2))
    assert result.ok, result.mismatches
    assert result.blocks_loaded == result.blocks_eligible > 0
    assert not result.cause


def test_blocks_released_unread_fail_the_run_naming_the_cause_and_the_fix(monkeypatch):
    """Without its warm-up, the decode engine's slow first step outlasts the producer's hold
    on the blocks of the requests admitted after it: the run fails and says why, and what to
    raise."""
    monkeypatch.setattr(Engine, "warm_up", lambda self, requests: 0.0)
    _slow_first(monkeypatch, "_step", 5.0)
    result = run_disaggregated(options(timeout_s=3.0, batch=4, max_num_seqs=2))
    assert not result.ok
    assert result.blocks_loaded < result.blocks_eligible
    assert result.cause.startswith("the prefill engine released ")
    assert "published blocks unread after timeout_s=3 s" in result.cause
    assert result.cause.endswith("raise --timeout-s above that")
    assert format_result(result).splitlines()[-1] == f"  cause: {result.cause}"


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="batch=0 must be a positive integer"):
        run_disaggregated(options(batch=0))
    with pytest.raises(ValueError, match=r"transport='ucx' \(choose from: nixl, mooncake\)"):
        run_disaggregated(options(transport="ucx"))
    with pytest.raises(ValueError, match="timeout_s=nan"):
        run_disaggregated(options(timeout_s=float("nan")))


def test_without_dtype_the_demo_runs_in_a_dtype_both_named_backends_declare():
    """float32 (bit-exact against one engine) unless a named backend lacks it, as the
    --dtype help says; FLASHINFER declares only 16-bit dtypes."""
    assert default_dtype(None, None) == "float32"
    assert default_dtype("TRITON_ATTN", "TRITON_ATTN_HND") == "float32"
    assert default_dtype("FLASHINFER", "TRITON_ATTN") == "bfloat16"
    assert default_dtype(None, "FLASHINFER") == "bfloat16"


def test_backends_that_share_no_demo_dtype_are_named(monkeypatch):
    import kvcore.demo.disagg as disagg

    declared = {"A": (torch.float32,), "B": (torch.float16,)}
    monkeypatch.setattr(disagg, "resolve_backend",
                        lambda name: type(name, (), {"SUPPORTED_DTYPES": declared[name]}))
    with pytest.raises(ValueError, match=r"share no dtype .*: A supports float32; B supports "
                                         r"float16; choose other backends"):
        default_dtype("A", "B")


def test_the_demo_command_runs_disaggregated(capsys):
    from kvcore.cli import main as kvcore_cli

    status = kvcore_cli(["demo", "--disaggregated", "--model", "tiny", "--batch", "2",
                         "--new-tokens", "3", "--platform", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "disaggregated prefill/decode over nixl" in out
    assert "tokens identical to the same steps in one process" in out and ": yes" in out


@pytest.mark.skipif(mooncake_unavailable_reason() is not None,
                    reason=str(mooncake_unavailable_reason()))
def test_the_demo_command_runs_disaggregated_over_mooncake(capsys):
    from kvcore.cli import main as kvcore_cli

    status = kvcore_cli(["demo", "--disaggregated", "--transport", "mooncake", "--model",
                         "tiny", "--batch", "2", "--new-tokens", "3", "--platform", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "disaggregated prefill/decode over mooncake" in out
    assert "tokens identical to the same steps in one process" in out and ": yes" in out


def test_the_engines_take_the_devices_they_are_given():
    result = run_disaggregated(options(prefill_device="cpu", decode_device="cpu"))
    assert result.ok, result.mismatches
    assert result.prefill_device == result.device == "cpu"
    assert result.blocks_loaded == result.blocks_eligible > 0


@pytest.mark.parametrize(("overrides", "message"), [
    ({"decode_device": "cuda:1"},
     "decode_device='cuda:1' is not a device of platform cpu, whose devices are cpu"),
    ({"prefill_device": "not a device"}, "prefill_device='not a device' is not a device name"),
], ids=["other-platform", "not-a-device"])
def test_bad_devices_are_named_before_anything_starts(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_disaggregated(options(**overrides))


def test_devices_without_disaggregated_are_refused(capsys):
    from kvcore.cli import main as kvcore_cli

    assert kvcore_cli(["demo", "--platform", "cpu", "--decode-device", "cpu"]) == 2
    assert "add --disaggregated" in capsys.readouterr().err


def test_two_devices_are_shown_in_the_summary():
    result = DisaggResult(backend="TRITON_ATTN", device="cpu", layout="B,2,N,H,D", requests=1,
                          generated_tokens=2, blocks_eligible=1, blocks_loaded=1,
                          loaded_bytes=1, load_seconds=0.1, seconds=1.0, prefill_device="cpu")
    assert "TRITON_ATTN on cpu, layout" in format_result(result)
    result.prefill_device, result.device = "cuda:0", "cuda:1"
    assert "on cuda:0 (prefill) -> cuda:1 (decode)," in format_result(result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_on_one_gpu_and_decode_on_another_give_the_same_tokens(dtype):
    result = run_disaggregated(options(platform="cuda", dtype=dtype, prefill_device="cuda:0",
                                       decode_device="cuda:1"))
    assert result.ok, result.mismatches
    assert (result.prefill_device, result.device) == ("cuda:0", "cuda:1")
    assert result.blocks_loaded == result.blocks_eligible > 0
    print(format_result(result))
