"""Shared by the connector tests and the p2p peer process: caches with random contents, the
bytes of blocks for bit-exact comparison, and small backends with other layouts."""

from __future__ import annotations

import torch

import kvcore
from kvcore import AttentionBackend, KVCaches
from kvcore.connectors import hash_request_tokens

#: Cache dtypes every connector must move bit-exactly: (model dtype, kv_cache_dtype).
DTYPES = {
    "fp32": (torch.float32, "auto"),
    "bf16": (torch.bfloat16, "auto"),
    "fp16": (torch.float16, "auto"),
    "fp8": (torch.bfloat16, "fp8"),
}
SIZES = {"num_layers": 3, "num_blocks": 12, "block_size": 4, "num_kv_heads": 2, "head_size": 8}
#: A 64 MiB bf16 cache (4 layers of 256 blocks of 16 tokens, 8 heads of 128), for the CUDA
#: transfer tests: large enough that a copy is still running when the host checks.
CUDA_SIZES = {"num_layers": 4, "num_blocks": 256, "block_size": 16, "num_kv_heads": 8,
              "head_size": 128}


class HndBackend(AttentionBackend):
    """K/V backend whose pages are HND (``B,2,H,N,D``), cross-layer capable."""

    SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8")
    PLATFORMS = ("cpu",)

    @staticmethod
    def get_name() -> str:
        return "TEST_HND"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("layout-only test backend")

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 4, 3, 5) if include_num_layers_dimension else (0, 1, 3, 2, 4)


class InterleavedBackend(HndBackend):
    """K and V interleaved per token (``B,N,2,H,D``; cross-layer ``B,L,N,2,H,D``): the stride
    orders FLASH_ATTN and FLEX_ATTENTION declare."""

    @staticmethod
    def get_name() -> str:
        return "TEST_INTERLEAVED"

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 3, 2, 4, 5) if include_num_layers_dimension else (0, 2, 1, 3, 4)


class MlaBackend(HndBackend):
    """MLA: one latent per token, ``(num_blocks, block_size, head_size)``."""

    IS_MLA = True

    @staticmethod
    def get_name() -> str:
        return "TEST_MLA"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)


class LegacyBackend(HndBackend):
    """The legacy ``(2, num_blocks, ...)`` layout, which opts out of connectors."""

    @staticmethod
    def get_name() -> str:
        return "TEST_LEGACY"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    get_kv_cache_stride_order = AttentionBackend.get_kv_cache_stride_order  # the identity

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


BACKENDS = {"nhd": "CPU_ATTN", "hnd": HndBackend, "interleaved": InterleavedBackend,
            "mla": MlaBackend, "legacy": LegacyBackend}


def make_caches(*, cross_layer: bool, dtype: str = "bf16", layout: str = "nhd",
                seed: int | None = None, device: str = "cpu", **sizes: int) -> KVCaches:
    """A cache filled with random values (``seed`` makes them reproducible in another
    process, on any device; ``None`` draws fresh ones)."""
    model_dtype, kv_cache_dtype = DTYPES[dtype]
    kv = kvcore.allocate_kv_caches(
        BACKENDS[layout], **{**SIZES, **sizes}, dtype=model_dtype, kv_cache_dtype=kv_cache_dtype,
        device=device, cross_layer=cross_layer)
    randomize(kv, seed)
    return kv


def randomize(kv: KVCaches, seed: int | None = None) -> None:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    values = torch.randn(kv.storage.shape, generator=gen) * 4  # on the CPU: same per seed
    kv.storage.copy_(values.to(kv.storage.dtype))


def block_bytes(kv: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """``(len(block_ids), num_layers, page_size_bytes)`` uint8 copy of those blocks, read
    through the per-layer logical views (independently of the connectors' byte views)."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=kv.storage.device)
    return torch.stack(
        [layer.index_select(0, idx).contiguous().view(torch.uint8).flatten(1)
         for layer in kv.layers], dim=1)


def keys_for(seed: int, num_blocks: int, block_size: int = SIZES["block_size"]) -> list[str]:
    """Chained keys of ``num_blocks`` blocks of a token sequence drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (num_blocks * block_size,), generator=gen)
    return hash_request_tokens(tokens, block_size)
