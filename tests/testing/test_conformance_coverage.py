"""Every capability a backend declares gets at least one conformance case.

A meta-test over the declarations: for each registered backend, and for one that declares
everything, each declared dtype, KV-cache dtype, feature flag, attention type, the sliding
window every K/V ``AttentionImpl`` takes, cross-layer support, each extra stride order and a
device-capability range maps to a case. A declaration without a case is a claim nobody checks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kvcore
from kvcore.backend import FEATURE_FLAGS
from kvcore.ops.validation import FP8_KV_CACHE_DTYPES
from kvcore.testing import ConformanceCase, conformance_cases
from kvcore.testing.adopted_orders import order_label
from kvcore.testing.batch import short_dtype


class DeclaresEverything(kvcore.AttentionBackend):
    SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    MIN_DEVICE_CAPABILITY = kvcore.DeviceCapability(8, 0)
    MAX_DEVICE_CAPABILITY = kvcore.DeviceCapability(12, 0)
    SUPPORTED_ATTN_TYPES = tuple(kvcore.AttentionType)
    PLATFORMS = ("cpu",)
    EXTRA_STRIDE_ORDERS = ((0, 1, 3, 2, 4),
                           kvcore.vllm_layout_order("LBNHC", include_num_layers_dimension=False))
    locals().update({attr: True for _, attr, _ in FEATURE_FLAGS})

    @staticmethod
    def get_name():
        return "DECLARES_EVERYTHING"

    @staticmethod
    def get_impl_cls():
        return kvcore.resolve_backend("CPU_ATTN").get_impl_cls()

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


Predicate = Callable[[ConformanceCase], bool]


def forward_with(*tokens: str) -> Predicate:
    """A forward case whose config label has every token (``bf16``, ``window19``, ...)."""
    def predicate(case: ConformanceCase) -> bool:
        parts = case.id.split("-")
        return case.kind == "forward" and all(
            any(p == t or (t.endswith("*") and p.startswith(t[:-1])) for p in parts)
            for t in tokens)
    return predicate


def kind(name: str, suffix: str = "") -> Predicate:
    return lambda case: case.kind == name and case.id.endswith(suffix)


def adopted_in(label: str) -> Predicate:
    """An ``adopted-orders`` case of the order labelled ``label`` (``LBNHC``, ``B2HND``)."""
    return lambda case: case.kind == "adopted-orders" and f"-{label}-" in case.id


def declarations(backend: type[kvcore.AttentionBackend]) -> dict[str, Predicate]:
    """What ``backend`` declares -> which case checks it."""
    found: dict[str, Predicate] = {}
    for dtype in backend.SUPPORTED_DTYPES:
        found[f"SUPPORTED_DTYPES: {dtype}"] = forward_with(short_dtype(dtype))
    for kv in backend.SUPPORTED_KV_CACHE_DTYPES:
        found[f"SUPPORTED_KV_CACHE_DTYPES: {kv}"] = (
            forward_with(kv) if kv != "auto" else
            lambda c: forward_with()(c) and not set(c.id.split("-")) & set(FP8_KV_CACHE_DTYPES))
    if backend.SUPPORTED_HEAD_SIZES is None:
        found["SUPPORTED_HEAD_SIZES: any"] = forward_with("D80")
    if backend.SUPPORTED_BLOCK_SIZES is None:
        found["SUPPORTED_BLOCK_SIZES: any"] = forward_with("bs12")
    special = {"use_non_causal": forward_with("noncausal"),
               "use_batch_invariant": kind("batch-invariant"),
               "has_sink": forward_with("sinks"), "has_logits_soft_cap": forward_with("softcap2")}
    for flag, attr, _ in FEATURE_FLAGS:
        if getattr(backend, attr):
            found[attr] = special.get(flag, kind("feature", f"-{flag}"))
    for attn_type in backend.SUPPORTED_ATTN_TYPES:
        found[f"SUPPORTED_ATTN_TYPES: {attn_type.value}"] = (
            forward_with() if attn_type is kvcore.AttentionType.DECODER
            else forward_with(attn_type.value))
    if not backend.IS_MLA:
        found["sliding_window (every K/V AttentionImpl takes one)"] = forward_with("window*")
    if backend.supports_cross_layer():
        found["cross-layer stride order"] = kind("cross-layer")
    for order in backend.readable_stride_orders()[1:]:
        found[f"EXTRA_STRIDE_ORDERS: {order}"] = adopted_in(order_label(order))
    if backend.MIN_DEVICE_CAPABILITY or backend.MAX_DEVICE_CAPABILITY:
        found["device capability range"] = kind("validation-refuses", "-device_capability")
    return found


BACKENDS = [*kvcore.backend_registry().names(), DeclaresEverything]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b if isinstance(b, str) else
                         b.get_name())
def test_every_declaration_has_a_case(backend):
    cls = kvcore.resolve_backend(backend) if isinstance(backend, str) else backend
    cases = conformance_cases(cls, devices=["cpu"])
    uncovered = [what for what, checked in declarations(cls).items()
                 if not any(checked(case) for case in cases)]
    assert not uncovered, f"{cls.get_name()} declares {uncovered} but no case checks it"


def test_the_everything_backend_declares_every_kind_of_capability():
    found = declarations(DeclaresEverything)
    assert {attr for _, attr, _ in FEATURE_FLAGS} <= set(found)
    assert len([k for k in found if k.startswith("SUPPORTED_ATTN_TYPES")]) == len(
        kvcore.AttentionType)
    assert len([k for k in found if k.startswith("EXTRA_STRIDE_ORDERS")]) == 2


def test_a_feature_forward_cannot_receive_is_a_skipped_case_saying_so():
    (case,) = [c for c in conformance_cases(DeclaresEverything, devices=["cpu"])
               if c.id == "DECLARES_EVERYTHING-cpu-feature-use_sparse"]
    assert case.skip_reason == (
        "DECLARES_EVERYTHING declares SUPPORTS_SPARSE, but kvcore's AttentionImpl API has no "
        "way to pass sparse attention to forward yet, so the suite cannot check the claim")
