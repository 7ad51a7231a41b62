"""A CPU backend whose ``import_reasons`` raises, and one whose platforms disagree with its
registration."""

import torch

import kvcore
import kvcore.ops


class ReferenceImpl(kvcore.PagedAttentionImpl):
    reshape_and_cache = staticmethod(kvcore.ops.reshape_and_cache_ref)
    paged_attention = staticmethod(kvcore.ops.paged_attention_torch)


class RaisingProbeBackend(kvcore.AttentionBackend):
    NAME = "RAISING_PROBE"
    PLATFORMS = ("cpu",)
    SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    IMPL_CLS = ReferenceImpl

    @classmethod
    def import_reasons(cls) -> list[str]:
        raise RuntimeError("acme probe crashed")


class DisagreeingBackend(kvcore.AttentionBackend):
    NAME = "PLATFORMS_DISAGREE"
    PLATFORMS = ("cuda",)
    IMPL_CLS = ReferenceImpl
