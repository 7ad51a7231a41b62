"""Backends whose numbers are slightly or partly wrong, built on CPU_ATTN (every dtype, fp8
caches, non-causal, encoder-only, cross-layer): ``test_conformance_numerics.py`` checks that
the conformance suite fails them in every dtype, bf16 included.
"""

from __future__ import annotations

from kvcore.backends.cpu_attn import CpuAttentionBackend, CpuAttentionImpl
from kvcore.ops import paged_attention_ref


def scaled_by_1_01(query, key_cache, value_cache, *, output, **kwargs):
    """THE BUG: a 1% systematic error, e.g. a softmax denominator off by 1%."""
    paged_attention_ref(query, key_cache, value_cache, output=output, **kwargs)
    output.copy_((output.double() * 1.01).to(output.dtype))
    return output


def ignoring_the_window(query, key_cache, value_cache, *, sliding_window, **kwargs):
    """THE BUG: the window is accepted and dropped, so old keys still count."""
    return paged_attention_ref(query, key_cache, value_cache, **kwargs)


class ScaledOutputImpl(CpuAttentionImpl):
    paged_attention = staticmethod(scaled_by_1_01)


class ScaledOutput(CpuAttentionBackend):
    """Every output 1% too large: within bf16's element-wise tolerance, not its rounding."""

    @staticmethod
    def get_name():
        return "BROKEN_SCALED_OUTPUT"

    @staticmethod
    def get_impl_cls():
        return ScaledOutputImpl


class IgnoresWindowImpl(CpuAttentionImpl):
    paged_attention = staticmethod(ignoring_the_window)


class IgnoresSlidingWindow(CpuAttentionBackend):
    """Right everywhere except on a layer with a sliding window."""

    @staticmethod
    def get_name():
        return "BROKEN_SLIDING_WINDOW"

    @staticmethod
    def get_impl_cls():
        return IgnoresWindowImpl
