"""A backend declaring ``PLATFORMS = None``."""

import kvcore


class NoPlatformsBackend(kvcore.AttentionBackend):
    NAME = "NO_PLATFORMS"
    PLATFORMS = None
    IMPL_CLS = "kvcore.backends.cpu_attn:CpuAttentionImpl"
