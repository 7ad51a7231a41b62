"""Rule ``window-non-causal`` on a backend that declares it cannot run a window on
non-causal layers: refusing with the declared reason passes, running it anyway fails."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.ops import paged_attention_ref, reshape_and_cache_ref
from kvcore.testing import ConformanceError, conformance_cases


class _Impl(kvcore.PagedAttentionImpl):
    reshape_and_cache = staticmethod(reshape_and_cache_ref)
    paged_attention = staticmethod(paged_attention_ref)


class _RefusingImpl(_Impl):
    def check_forward(self, query, kv_cache, attn_metadata, output):
        _Declares.check_non_causal_window(self.sliding_window, self.is_causal(attn_metadata))


class _Declares(kvcore.AttentionBackend):
    NAME = "DECLARES_NO_NONCAUSAL_WINDOW"
    SUPPORTED_DTYPES = (torch.float32,)
    SUPPORTS_NON_CAUSAL = True
    NON_CAUSAL_WINDOW_UNSUPPORTED = "its kernel has a left window only; use CPU_ATTN"
    PLATFORMS = ("cpu",)
    IMPL_CLS = _RefusingImpl


class _DeclaresButRuns(_Declares):
    NAME = "DECLARES_BUT_RUNS"
    IMPL_CLS = _Impl


def _window_cases(backend):
    cases = [c for c in conformance_cases(backend, devices=["cpu"])
             if c.kind == "window-non-causal"]
    assert [c.id.split("-cpu-")[1] for c in cases] == [
        "window-non-causal-fp32-D64-bs16-noncausal-window19"]
    return cases


def test_a_declared_refusal_passes():
    for case in _window_cases(_Declares):
        case.run()


def test_a_declared_refusal_that_runs_anyway_fails():
    (case,) = _window_cases(_DeclaresButRuns)
    with pytest.raises(ConformanceError, match="declares NON_CAUSAL_WINDOW_UNSUPPORTED .* but "
                                               "ran sliding_window=19 on a non-causal layer"):
        case.run()
