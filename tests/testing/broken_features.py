"""Backends that get sinks or the logit soft-cap wrong, built on CPU_ATTN:
``test_conformance_features.py`` checks that the conformance suite fails each one on exactly
the cases of the feature it breaks.
"""

from __future__ import annotations

from kvcore.backends.cpu_attn import CpuAttentionBackend, CpuAttentionImpl
from kvcore.ops import paged_attention_ref


def dropping_sinks(query, key_cache, value_cache, *, sinks=None, **kwargs):
    """THE BUG: the sinks are accepted and never reach the softmax."""
    return paged_attention_ref(query, key_cache, value_cache, **kwargs)


def dropping_soft_cap(query, key_cache, value_cache, *, logits_soft_cap=None, **kwargs):
    """THE BUG: the soft-cap is accepted and never applied."""
    return paged_attention_ref(query, key_cache, value_cache, **kwargs)


def sinks_twice(query, key_cache, value_cache, *, sinks=None, **kwargs):
    """THE BUG: the sink enters the denominator twice (e.g. once per split and again in the
    merge): ``exp(sink) * 2`` is ``exp(sink + ln 2)``."""
    if sinks is not None:
        sinks = sinks + 0.6931471805599453
    return paged_attention_ref(query, key_cache, value_cache, sinks=sinks, **kwargs)


class DropsSinksImpl(CpuAttentionImpl):
    paged_attention = staticmethod(dropping_sinks)


class DropsSinks(CpuAttentionBackend):
    """Declares SUPPORTS_SINK, runs without them."""

    NAME = "BROKEN_DROPS_SINKS"
    IMPL_CLS = DropsSinksImpl


class DropsSoftCapImpl(CpuAttentionImpl):
    paged_attention = staticmethod(dropping_soft_cap)


class DropsSoftCap(CpuAttentionBackend):
    """Declares SUPPORTS_LOGITS_SOFT_CAP, runs without it."""

    NAME = "BROKEN_DROPS_SOFT_CAP"
    IMPL_CLS = DropsSoftCapImpl


class SinksTwiceImpl(CpuAttentionImpl):
    paged_attention = staticmethod(sinks_twice)


class SinksTwice(CpuAttentionBackend):
    """Counts every sink twice."""

    NAME = "BROKEN_SINKS_TWICE"
    IMPL_CLS = SinksTwiceImpl


class SwallowsFeaturesImpl(CpuAttentionImpl):
    def __init__(self, *args, sinks=None, logits_soft_cap=None, **kwargs):
        """THE BUG: the features are taken and dropped before the base class sees them."""
        super().__init__(*args, **kwargs)


class SwallowsFeatures(CpuAttentionBackend):
    """Declares neither feature, and its impl silently runs without them."""

    NAME = "BROKEN_SWALLOWS_FEATURES"
    IMPL_CLS = SwallowsFeaturesImpl
    SUPPORTS_SINK = False
    SUPPORTS_LOGITS_SOFT_CAP = False
