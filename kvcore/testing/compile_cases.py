"""kvcore's Triton kernels for the compile check (:mod:`kvcore.testing.compile_check`).

Each case calls :func:`kvcore.ops.triton_attention.paged_attention` or
:func:`kvcore.ops.triton_cache.reshape_and_cache` on CPU tensors of a real model's shapes, in
caches allocated by the backends that use them (TRITON_ATTN, TRITON_ATTN_HND; cross-layer
where the backend opts in), with the launch config
:func:`kvcore.ops.attention_dispatch.call_config` picks for the target (its SM count and
architecture), and returns the name of the kernel that config runs. Only the allocation's
block count is small: it is not part of any kernel signature. Registered by
``kvcore.backends``' ``kvcore_register_kernel_compile_cases``.
"""

from __future__ import annotations

import torch

from kvcore.allocate import allocate_kv_caches
from kvcore.config import AttentionSelectorConfig
from kvcore.registry import resolve_backend
from kvcore.testing.compile_check import CompileTarget, KernelCase

__all__ = ["compile_cases"]

_BLOCK_SIZE = 16
_NUM_BLOCKS = 64  # the block table's ids wrap around these: only shapes and strides matter


def _caches(backend: str, num_kv_heads: int, head_size: int, dtype: torch.dtype,
            kv_cache_dtype: str, num_blocks: int = _NUM_BLOCKS):
    kv = allocate_kv_caches(backend, num_layers=2, num_blocks=num_blocks,
                            block_size=_BLOCK_SIZE, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype, device="cpu",
                            kv_cache_dtype=kv_cache_dtype)
    return kv.layers[1].unbind(1)  # the second layer: a view into the pool, like a real one


def _skip(backend: str, target: CompileTarget, head_size: int, dtype: torch.dtype,
          kv_cache_dtype: str) -> str | None:
    """The backend's own reasons against the config on the target (e.g. fp8 before 8.9)."""
    config = AttentionSelectorConfig(head_size=head_size, dtype=dtype,
                                     kv_cache_dtype=kv_cache_dtype, block_size=_BLOCK_SIZE)
    reasons = resolve_backend(backend).validate_configuration(
        **config.as_kwargs(), device_capability=target.device_capability)
    return f"{backend}: {'; '.join(reasons)}" if reasons else None


def _attention_case(target: CompileTarget, name: str, *, q_lens: list[int],
                    context: int, num_heads: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype, kv_cache_dtype: str = "auto",
                    backend: str = "TRITON_ATTN",
                    sliding_window: int | None = None) -> KernelCase:
    def launch() -> str:
        from kvcore.ops import TritonAttentionPlan
        from kvcore.ops.attention_dispatch import call_config
        from kvcore.ops.triton_attention import paged_attention

        fp8 = kv_cache_dtype != "auto"
        k_cache, v_cache = _caches(backend, num_kv_heads, head_size, dtype, kv_cache_dtype)
        num_tokens, num_seqs = sum(q_lens), len(q_lens)
        seq_lens = torch.tensor([context + n for n in q_lens], dtype=torch.int32)
        query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).int()
        pages = -(-int(seq_lens.max()) // _BLOCK_SIZE)
        block_table = (torch.arange(num_seqs * pages, dtype=torch.int32)
                       % _NUM_BLOCKS).reshape(num_seqs, pages)
        query = torch.empty(num_tokens, num_heads, head_size, dtype=dtype)
        config = call_config(query, k_cache, v_cache, kv_cache_dtype, num_seqs,
                             pages * _BLOCK_SIZE, num_sms=target.num_sms, rocm=target.is_rocm,
                             arch=target.name)
        scale = torch.ones(1) if fp8 else None
        paged_attention(query, k_cache, v_cache, query_start_loc=query_start_loc,
                        seq_lens=seq_lens, block_table=block_table, scale=head_size ** -0.5,
                        sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype,
                        k_scale=scale, v_scale=scale, plan=TritonAttentionPlan(config=config))
        return config.kernel

    return KernelCase(name, launch,
                      skip=_skip(backend, target, head_size, dtype, kv_cache_dtype))


def _cache_write_case(target: CompileTarget, name: str, *, num_tokens: int, num_kv_heads: int,
                      head_size: int, dtype: torch.dtype,
                      kv_cache_dtype: str = "auto") -> KernelCase:
    def launch() -> str:
        from kvcore.ops.triton_cache import reshape_and_cache

        fp8 = kv_cache_dtype != "auto"
        # One slot per token: a slot written twice in one call is refused.
        k_cache, v_cache = _caches("TRITON_ATTN", num_kv_heads, head_size, dtype,
                                   kv_cache_dtype,
                                   max(_NUM_BLOCKS, -(-num_tokens // _BLOCK_SIZE)))
        key = torch.empty(num_tokens, num_kv_heads, head_size, dtype=dtype)
        value = torch.empty_like(key)
        slots = torch.arange(num_tokens)
        scale = torch.ones(1) if fp8 else None
        reshape_and_cache(key, value, k_cache, v_cache, slots, kv_cache_dtype, scale, scale)
        return "triton_cache_write"

    return KernelCase(name, launch,
                      skip=_skip("TRITON_ATTN", target, head_size, dtype, kv_cache_dtype))


def _convert_case(target: CompileTarget, name: str, *, dst_dtype: torch.dtype) -> KernelCase:
    """A connector's layout conversion: 256 tokens of 2 layers from NHD blocks of 16 into HND
    blocks of 64 (8 K/V heads of 128), bf16 bytes as they are or quantised to ``dst_dtype``."""
    def launch() -> str:
        from kvcore.ops.triton_convert import convert_blocks

        layers, heads, dim, tokens = 2, 8, 128, 256
        src_bs, dst_bs = 16, 64
        page = 2 * heads * dim  # K and V of one token of one layer
        src = torch.empty(tokens * layers * page, dtype=torch.bfloat16)
        dst = torch.empty(tokens * layers * page, dtype=dst_dtype)
        quantize = dst_dtype != torch.bfloat16
        convert_blocks(
            src, dst, list(range(tokens // src_bs)), list(range(tokens // dst_bs)),
            num_tokens=tokens, src_block_size=src_bs, dst_block_size=dst_bs,
            src_strides=(layers * src_bs * page, src_bs * page, src_bs * heads * dim,
                         heads * dim, dim, 1),
            dst_strides=(layers * dst_bs * page, dst_bs * page, dst_bs * heads * dim,
                         dim, dst_bs * dim, 1),
            num_layers=layers, num_kv=2, head_pairs=[(h, h) for h in range(heads)],
            head_size=dim, scales=torch.ones(layers * 2) if quantize else None)
        return "triton_convert"

    fp8 = "fp8_e4m3" if dst_dtype != torch.bfloat16 else "auto"
    return KernelCase(name, launch,
                      skip=_skip("TRITON_ATTN", target, 128, torch.bfloat16, fp8))


def compile_cases(target: CompileTarget) -> list[KernelCase]:
    """kvcore's cases: decode (with and without split-KV), mixed prefill+decode, fp8 caches
    (head sizes 64, 128 and 256), head size 256 with a sliding window, the HND layout, the
    cache writes and the connectors' layout conversion."""
    bf16, fp16 = torch.bfloat16, torch.float16
    llama8b = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128}  # Llama-3-8B
    mixed = [2048, 2048] + [1] * 62  # two 2,048-token prefills among 62 decodes
    cases = []
    for dtype, tag in ((bf16, "bf16"), (fp16, "fp16")):
        cases += [
            _attention_case(target, f"decode 64x4096 Hq32/Hk8 D128 {tag}", q_lens=[1] * 64,
                            context=4095, dtype=dtype, **llama8b),
            _attention_case(target, f"mixed 2x2048+62x1 ctx2048 Hq32/Hk8 D128 {tag}",
                            q_lens=mixed, context=2048, dtype=dtype, **llama8b),
            _cache_write_case(target, f"cache write 2048 tok Hk8 D128 {tag}", num_tokens=2048,
                              num_kv_heads=8, head_size=128, dtype=dtype),
        ]
    cases += [
        _attention_case(target, "decode 8x32768 Hq32/Hk8 D128 bf16 (split-KV)",
                        q_lens=[1] * 8, context=32767, dtype=bf16, **llama8b),
        _attention_case(target, "decode 64x4096 Hq64/Hk8 D128 bf16", q_lens=[1] * 64,
                        context=4095, num_heads=64, num_kv_heads=8, head_size=128, dtype=bf16),
        _attention_case(target, "decode 64x4096 Hq32/Hk8 D128 bf16 HND", q_lens=[1] * 64,
                        context=4095, dtype=bf16, backend="TRITON_ATTN_HND", **llama8b),
        _attention_case(target, "decode 64x4096 Hq32/Hk8 D128 bf16 fp8-e4m3 KV",
                        q_lens=[1] * 64, context=4095, dtype=bf16, kv_cache_dtype="fp8_e4m3",
                        **llama8b),
        _attention_case(target, "mixed 2x2048+62x1 Hq32/Hk8 D128 bf16 fp8-e4m3 KV",
                        q_lens=mixed, context=2048, dtype=bf16, kv_cache_dtype="fp8_e4m3",
                        **llama8b),
        _attention_case(target, "mixed 2x2048+62x1 Hq16/Hk8 D256 bf16 window 4096",
                        q_lens=mixed, context=2048, num_heads=16, num_kv_heads=8,
                        head_size=256, dtype=bf16, sliding_window=4096),
        _attention_case(target, "decode 64x4096 Hq16/Hk8 D256 bf16 fp8-e4m3 KV window 4096",
                        q_lens=[1] * 64, context=4095, num_heads=16, num_kv_heads=8,
                        head_size=256, dtype=bf16, kv_cache_dtype="fp8_e4m3",
                        sliding_window=4096),
        _attention_case(target, "decode 64x4096 Hq64/Hk8 D64 bf16 fp8-e4m3 KV",
                        q_lens=[1] * 64, context=4095, num_heads=64, num_kv_heads=8,
                        head_size=64, dtype=bf16, kv_cache_dtype="fp8_e4m3"),
        _cache_write_case(target, "cache write 2048 tok Hk8 D128 bf16 -> fp8-e4m3", num_tokens=2048,
                          num_kv_heads=8, head_size=128, dtype=bf16, kv_cache_dtype="fp8_e4m3"),
        _cache_write_case(target, "cache write 2048 tok Hk8 D256 bf16", num_tokens=2048,
                          num_kv_heads=8, head_size=256, dtype=bf16),
        _convert_case(target, "convert 256 tok NHD/16 -> HND/64 bf16", dst_dtype=bf16),
        _convert_case(target, "convert 256 tok NHD/16 -> HND/64 bf16 -> fp8-e4m3",
                      dst_dtype=torch.float8_e4m3fn),
    ]
    return cases
