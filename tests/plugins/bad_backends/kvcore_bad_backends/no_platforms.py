"""A backend declaring ``PLATFORMS = None``."""

import kvcore
import kvcore.ops


class ReferenceImpl(kvcore.PagedAttentionImpl):
    reshape_and_cache = staticmethod(kvcore.ops.reshape_and_cache_ref)
    paged_attention = staticmethod(kvcore.ops.paged_attention_torch)


class NoPlatformsBackend(kvcore.AttentionBackend):
    NAME = "NO_PLATFORMS"
    PLATFORMS = None
    IMPL_CLS = ReferenceImpl
