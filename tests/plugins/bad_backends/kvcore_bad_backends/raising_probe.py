"""A CPU backend whose ``import_reasons`` raises, and one whose platforms disagree with its
registration."""

import torch

import kvcore


class RaisingProbeBackend(kvcore.AttentionBackend):
    NAME = "RAISING_PROBE"
    PLATFORMS = ("cpu",)
    SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    IMPL_CLS = "kvcore.backends.cpu_attn:CpuAttentionImpl"

    @classmethod
    def import_reasons(cls) -> list[str]:
        raise RuntimeError("acme probe crashed")


class DisagreeingBackend(kvcore.AttentionBackend):
    NAME = "PLATFORMS_DISAGREE"
    PLATFORMS = ("cuda",)
    IMPL_CLS = "kvcore.backends.cpu_attn:CpuAttentionImpl"
