"""``kvcore demo --disaggregated`` with two engines that disagree on the layout: the decode
engine's connector converts the prefill engine's blocks on load, and the tokens equal one
engine alone (float32)."""

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
