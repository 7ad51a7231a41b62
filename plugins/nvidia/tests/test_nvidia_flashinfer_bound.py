"""BoundRun's recording on CPU stand-ins shaped like FlashInfer's wrappers (the GPU test
``test_recorded_runs_equal_flashinfer_run_bit_for_bit`` checks it on FlashInfer itself): the
recorded call equals ``run`` on other layers' tensors, a new plan is recorded again, and what
cannot be recorded faithfully goes through ``run``."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends.flashinfer_bound import BoundRun


class _Module:
    """A compiled module's stand-in: out = q * sm_scale + k.sum + v.sum + plan bias."""

    def __init__(self) -> None:
        self.calls = 0

    def paged_run(self, workspace, plan_info, q, k_cache, v_cache, out, sm_scale, bias):
        self.calls += 1
        out.copy_(q * sm_scale + k_cache.sum() + v_cache.sum() + bias[0])


class _Wrapper:
    """FlashInfer's wrapper shape: ``plan`` makes a new ``_plan_info``; ``run`` derives the
    module's arguments from the plan and the call."""

    def __init__(self, *, copy_cache: bool = False, calls: int = 1) -> None:
        self._cached_module = _Module()
        self._copy_cache, self._calls = copy_cache, calls
        self.runs = 0
        self.plan(0.0)

    def plan(self, bias: float) -> None:
        self._plan_info = [bias]
        self._bias = torch.tensor([bias])

    def run(self, q, kv, *, out, k_scale=None, v_scale=None):
        self.runs += 1
        k, v = kv
        if self._copy_cache:
            k = k.clone()
        sm_scale = 0.5 * (1.0 if k_scale is None else k_scale)
        for _ in range(self._calls):
            self._cached_module.paged_run(torch.empty(1), self._plan_info, q, k, v, out,
                                          sm_scale, self._bias)
        if v_scale is not None and v_scale != 1.0:
            out *= v_scale
        return out


def _layer(seed: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 2, 8, generator=gen)
    kv = (torch.randn(3, 4, 2, 8, generator=gen), torch.randn(3, 4, 2, 8, generator=gen))
    return q, kv, torch.full_like(q, float("nan"))


def _run(wrapper, q, kv, scales) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    wrapper.run(q, kv, out=out, **scales)
    return out


@pytest.mark.parametrize("scales", [{}, {"k_scale": 0.25, "v_scale": 1.0}],
                         ids=["no-scales", "k-scale"])
def test_recorded_calls_equal_run_on_other_layers(scales):
    wrapper = _Wrapper()
    first = _layer(0)
    bound = BoundRun(wrapper, *first, scales)
    assert bound.bound and wrapper._cached_module.calls == 0  # recording launches nothing
    for seed in (0, 1, 2):
        q, kv, out = _layer(seed)
        bound(q, kv, out)
        assert torch.equal(out, _run(wrapper, q, kv, scales))
    runs = wrapper.runs
    bound(*_layer(3))
    assert wrapper.runs == runs  # the call did not go through run
    assert all(a is None for a in (bound._args[i] for i in bound._slots))  # holds no layer


def test_a_new_plan_is_not_current():
    wrapper = _Wrapper()
    bound = BoundRun(wrapper, *_layer(0), {})
    assert bound.current(wrapper) and not bound.current(_Wrapper())
    wrapper.plan(1.0)
    assert not bound.current(wrapper)
    rebound = BoundRun(wrapper, *_layer(0), {})
    q, kv, out = _layer(1)
    rebound(q, kv, out)
    assert torch.equal(out, _run(wrapper, q, kv, {}))


@pytest.mark.parametrize("case", ["value-scale", "copied-cache", "two-calls", "no-module"])
def test_what_cannot_be_recorded_goes_through_run(case):
    scales = {"k_scale": 1.0, "v_scale": 2.0} if case == "value-scale" else {}
    wrapper = _Wrapper(copy_cache=case == "copied-cache", calls=2 if case == "two-calls" else 1)
    if case == "no-module":
        del wrapper._cached_module
        wrapper.run = lambda q, kv, *, out, **kw: out.copy_(q)
    bound = BoundRun(wrapper, *_layer(0), scales)
    assert not bound.bound
    assert wrapper.__dict__.get("_cached_module", None) is not None or case == "no-module"
    q, kv, out = _layer(1)
    bound(q, kv, out)
    if case == "no-module":
        assert torch.equal(out, q)
    else:
        assert torch.equal(out, _run(wrapper, q, kv, scales))
