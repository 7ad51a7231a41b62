"""The conformance suite holds a backend that declares sinks or the logit soft-cap to the
float64 reference with them (a dropped or doubled feature fails exactly its cases), skips
those cases with the reason for a backend that does not declare them, and fails an impl that
accepts an undeclared feature and runs without it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_conformance_numerics import failures

import kvcore
from kvcore.testing import conformance_cases

pytest_plugins = ["pytester"]
kvcore.get_platform("cpu")  # see test_conformance_numerics

HERE = Path(__file__).parent


FEATURE_CASES = ("-sinks", "-softcap2")


def is_feature_case(nodeid: str) -> bool:
    """Whether a conformance case runs with sinks or a soft-cap (skipped, with the reason, for
    a backend that declares neither)."""
    return any(label in nodeid for label in FEATURE_CASES)


def _feature_forwards(spec: str, monkeypatch: pytest.MonkeyPatch, label: str) -> set[str]:
    monkeypatch.syspath_prepend(HERE)
    return {c.id for c in conformance_cases(spec) if c.kind == "forward" and label in c.id}


@pytest.mark.parametrize(("spec", "label"), [
    ("broken_features:DropsSinks", "-sinks"),
    ("broken_features:SinksTwice", "-sinks"),
    ("broken_features:DropsSoftCap", "-softcap2"),
], ids=["drops-sinks", "sinks-twice", "drops-soft-cap"])
def test_a_wrong_feature_fails_exactly_its_forward_cases(pytester, monkeypatch, spec, label):
    failed, messages, passed = failures(pytester, spec)
    expected = _feature_forwards(spec, monkeypatch, label)
    assert len(expected) == 4  # alone and with the other feature, each with and without window
    assert failed == dict.fromkeys(expected, "forward-reference")
    assert any(case.endswith("-forward-bf16-D64-bs16") for case in passed)
    assert "sinks (one logit per query head)" in messages or "logits_soft_cap=2" in messages


def test_an_impl_that_swallows_undeclared_features_fails(pytester):
    failed, messages, _ = failures(pytester, "broken_features:SwallowsFeatures")
    assert failed == {"BROKEN_SWALLOWS_FEATURES-undeclared-feature-has_sink":
                      "undeclared-features-refused",
                      "BROKEN_SWALLOWS_FEATURES-undeclared-feature-has_logits_soft_cap":
                      "undeclared-features-refused"}
    assert "does not declare SUPPORTS_SINK, but SwallowsFeaturesImpl(sinks=...)" in messages


def test_feature_cases_are_skipped_with_the_reason_where_undeclared(monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    cases = {c.id: c for c in conformance_cases("broken_features:SwallowsFeatures")}
    feature = [c for i, c in cases.items() if any(label in i for label in FEATURE_CASES)]
    assert len(feature) == 6
    assert all("does not declare" in c.skip_reason for c in feature)
    both = cases["BROKEN_SWALLOWS_FEATURES-cpu-forward-bf16-D64-bs16-softcap2-sinks"]
    assert both.skip_reason.startswith(
        "BROKEN_SWALLOWS_FEATURES does not declare SUPPORTS_SINK; BROKEN_SWALLOWS_FEATURES does "
        "not declare SUPPORTS_LOGITS_SOFT_CAP")


@pytest.mark.parametrize("name", ["CPU_ATTN", "TRITON_ATTN"])
def test_builtin_backends_declare_both_features_and_get_their_cases(name):
    cases = [c for c in conformance_cases(name, devices=["cpu"])
             if c.kind == "forward" and any(label in c.id for label in FEATURE_CASES)]
    assert len(cases) == 6 and not any(c.skip_reason for c in cases)
    assert not [c for c in conformance_cases(name, devices=["cpu"])
                if c.kind == "undeclared-feature"]
