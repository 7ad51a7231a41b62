"""Test fixture backends. Their impls are the CPU reference: they exist to be selected."""

import kvcore


def _reference_impl():
    return kvcore.resolve_backend("CPU_ATTN").get_impl_cls()


class StandInRocmAttnBackend(kvcore.AttentionBackend):
    """Like ROCM_ATTN: legacy (2, num_blocks, ...) layout, so no KV connector."""

    PLATFORMS = ("rocm",)
    SUPPORTED_HEAD_SIZES = (64, 128)

    @staticmethod
    def get_name():
        return "ROCM_ATTN"

    @staticmethod
    def get_impl_cls():
        return _reference_impl()

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_kv_connector(cls):
        return False

    @classmethod
    def kv_connector_unsupported_reason(cls):
        return ("ROCM_ATTN keeps the legacy (2, num_blocks, ...) layout; "
                "use ROCM_AITER_UNIFIED_ATTN")


class StandInAiterUnifiedBackend(kvcore.AttentionBackend):
    """Like ROCM_AITER_UNIFIED_ATTN: blocks-first, needs gfx942 or newer."""

    PLATFORMS = ("rocm",)
    SUPPORTED_HEAD_SIZES = (64, 128)
    MIN_DEVICE_CAPABILITY = kvcore.DeviceCapability(9, 4)

    @staticmethod
    def get_name():
        return "ROCM_AITER_UNIFIED_ATTN"

    @staticmethod
    def get_impl_cls():
        return _reference_impl()
