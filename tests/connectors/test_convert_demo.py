"""``kvcore demo --disaggregated`` with two engines that disagree on the layout or the
tensor-parallel degree: the decode engine's connectors convert the prefill engine's blocks on
load, and the tokens equal one engine alone at TP 1 (float32)."""

from __future__ import annotations

import pytest
from pull_cases import MOONCAKE, NIXL

from kvcore.demo.disagg import DisaggOptions, format_result, run_disaggregated


@pytest.mark.engine
@pytest.mark.parametrize("transport, prefill, decode", [
    pytest.param("nixl", ("CPU_ATTN", 16), ("SDPA_GATHER", 64), marks=NIXL.needs,
                 id="nixl-CPU_ATTN16-nhd->SDPA_GATHER64-hnd"),
    pytest.param("nixl", ("CPU_ATTN", 16), ("CPU_ATTN", 64), marks=NIXL.needs,
                 id="nixl-CPU_ATTN16->CPU_ATTN64"),
    pytest.param("mooncake", ("SDPA_GATHER", 64), ("FLEX_ATTENTION", 16),
                 marks=MOONCAKE.needs, id="mooncake-SDPA_GATHER64-hnd->FLEX16-interleaved"),
])
def test_disaggregated_demo_converts_between_engines(transport, prefill, decode):
    options = DisaggOptions(model="tiny", batch=3, max_new_tokens=4, transport=transport,
                            prefill_backend=prefill[0], prefill_block_size=prefill[1],
                            backend=decode[0], block_size=decode[1], timeout_s=30.0)
    result = run_disaggregated(options)
    assert result.ok, format_result(result)
    assert result.blocks_loaded == result.blocks_eligible > 0
    assert result.prefill_backend == prefill[0] and result.backend == decode[0]
    assert "tokens identical to one engine alone: yes" in format_result(result)


def test_disaggregated_options_refuse_block_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match=r"prefill_block_size=24 and block_size=16: one must "
                                         r"divide the other"):
        DisaggOptions(prefill_block_size=24, block_size=16).validate()


@pytest.mark.engine
@pytest.mark.parametrize("transport, prefill, decode", [
    pytest.param("nixl", ("CPU_ATTN", 16, 2), ("CPU_ATTN", 16, 1), marks=NIXL.needs,
                 id="nixl-tp2->tp1"),
    pytest.param("nixl", ("CPU_ATTN", 16, 1), ("CPU_ATTN", 16, 2), marks=NIXL.needs,
                 id="nixl-tp1->tp2"),
    pytest.param("nixl", ("CPU_ATTN", 16, 1), ("SDPA_GATHER", 64, 4), marks=NIXL.needs,
                 id="nixl-tp1->tp4-2-kv-heads-replicated-16-nhd->64-hnd"),
    pytest.param("mooncake", ("SDPA_GATHER", 64, 4), ("CPU_ATTN", 16, 2),
                 marks=MOONCAKE.needs, id="mooncake-tp4-replicated->tp2-64-hnd->16-nhd"),
])
def test_disaggregated_demo_across_tensor_parallel_degrees(transport, prefill, decode):
    """Ranks simulated by head slices: each decode rank reads its heads from the prefill
    ranks that hold them; a prefill rank read by several decode ranks publishes for that many
    readers (``tiny`` has 2 KV heads, so TP 4 replicates each over two ranks)."""
    options = DisaggOptions(model="tiny", batch=3, max_new_tokens=4, transport=transport,
                            prefill_backend=prefill[0], prefill_block_size=prefill[1],
                            prefill_tp=prefill[2], backend=decode[0], block_size=decode[1],
                            decode_tp=decode[2], timeout_s=30.0)
    result = run_disaggregated(options)
    assert result.ok, format_result(result)
    assert result.blocks_loaded == result.blocks_eligible > 0
    assert (result.prefill_tp, result.decode_tp) == (prefill[2], decode[2])
    assert "tokens identical to one engine alone: yes" in format_result(result)


@pytest.mark.engine
@NIXL.needs
def test_the_demo_command_takes_tensor_parallel_degrees(capsys):
    from kvcore.cli import main as kvcore_cli

    status = kvcore_cli(["demo", "--disaggregated", "--model", "tiny", "--batch", "2",
                         "--new-tokens", "3", "--platform", "cpu", "--prefill-tp", "1",
                         "--decode-tp", "2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(TP 2) on cpu" in out
    assert "tokens identical to one engine alone: yes" in out


@pytest.mark.parametrize(("overrides", "message"), [
    ({"decode_tp": 3}, r"decode_tp=3 does not divide model 'tiny''s 4 query heads"),
    ({"prefill_tp": 0}, "prefill_tp=0 must be a positive integer"),
    ({"model": "mla-small", "decode_tp": 2},
     "decode_tp=2 with model='mla-small': the demo simulates tensor parallelism by K/V head "
     "slices"),
], ids=["not-dividing", "zero", "mla"])
def test_disaggregated_options_refuse_tensor_parallel_degrees_that_do_not_fit(overrides,
                                                                               message):
    with pytest.raises(ValueError, match=message):
        DisaggOptions(**overrides).validate()


def test_tensor_parallel_degrees_without_disaggregated_are_refused(capsys):
    from kvcore.cli import main as kvcore_cli

    assert kvcore_cli(["demo", "--platform", "cpu", "--decode-tp", "2"]) == 2
    assert "--prefill-tp and --decode-tp set up the two engines" in capsys.readouterr().err
