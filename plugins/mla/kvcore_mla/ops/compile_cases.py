"""kvcore-mla's Triton kernels for kvcore's compile check (``kvcore kernels``).

Each case calls an op of :mod:`kvcore_mla.ops` on CPU tensors of DeepSeek-V3/V3.2 shapes
(``kv_lora_rank`` 512, rope 64; 128 query heads on one GPU, 16 with 8-way tensor parallelism;
the indexer's 128-dim keys), with the kernel configuration and split count the ops' choosers
pick for the target (its vendor, capability and SM/CU count): for MLA decode the table row
(:func:`~kvcore_mla.ops.mla_configs.mla_decode_config`) and
:func:`~kvcore_mla.ops.mla_configs.mla_decode_num_splits`, as TRITON_MLA's builder does;
:func:`~kvcore_mla.ops.mla_configs.mixed_config` for mixed batches. Each attention case's
launch returns the name of the kernel it ran. Registered by :mod:`kvcore_mla.plugin`.
"""

from __future__ import annotations

import dataclasses

import torch

import kvcore
from kvcore.testing import CompileTarget, KernelCase

__all__ = ["KERNELS_BY_NAME", "compile_cases"]

#: Printed under "Kernels by name" in ``docs/kernels.md`` (``kvcore kernels``).
KERNELS_BY_NAME = """
kvcore_mla's kernels by name: `triton_mla_decode` (pointer loads, whole latent: the default and
sm80/ROCm rows, sm90 below 64 heads), `triton_mla_decode_halves` (the latent in two halves:
sm90's 64+ head row for caches TMA cannot serve, fp8 included), `triton_mla_decode_tma_keysplit`
(TMA loads, key-split scores: sm90's 64+ head Triton row; its 128-head case may spill up to 896
bytes, 856 with Triton 3.9), `gluon_mla_ws` (warp-specialised Gluon, Hopper, sm90's first row at
64+ heads), `triton_mla_mixed` (prefill+decode batches). The numbers behind the rows:
plugins/mla/kvcore_mla/ops/MEASUREMENTS.md.
"""

_KV_LORA_RANK = 512
_ROPE_DIM = 64
_BLOCK_SIZE = 64  # the latent cache's page size (a constexpr of the attention kernel), as
# benchmarks/bench_mla.py measures it
_INDEXER_BLOCK_SIZE = 64
_NUM_BLOCKS = 64  # block ids wrap around these: only shapes and strides reach the kernels


def _block_table(num_seqs: int, max_len: int, block_size: int) -> torch.Tensor:
    pages = -(-max_len // block_size)
    return (torch.arange(num_seqs * pages, dtype=torch.int32) % _NUM_BLOCKS).reshape(
        num_seqs, pages)


def _skip(backend: str, target: CompileTarget, dtype: torch.dtype,
          kv_cache_dtype: str = "auto") -> str | None:
    """The backend's own reasons against the config on the target (e.g. fp8 before 8.9)."""
    if backend == "DEEPSEEK_V32_INDEXER":  # a layout (not registered): its capability only
        from kvcore_mla.backends.indexer import DeepseekV32IndexerBackend

        need = DeepseekV32IndexerBackend.MIN_DEVICE_CAPABILITY
        if need is not None and not target.device_capability.at_least(need):
            return (f"{backend}: device capability {target.device_capability} (needs >= {need} "
                    "for fp8 e4m3 conversions)")
        return None
    cls = kvcore.resolve_backend(backend)
    config = kvcore.AttentionSelectorConfig(
        head_size=_KV_LORA_RANK + _ROPE_DIM, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        block_size=_BLOCK_SIZE, use_mla=True)
    reasons = cls.validate_configuration(**config.as_kwargs(),
                                         device_capability=target.device_capability)
    return f"{backend}: {'; '.join(reasons)}" if reasons else None


def _mla_case(target: CompileTarget, name: str, *, q_lens: list[int], context: int,
              num_heads: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
              max_spills: int | None = None, gluon: bool = True,
              fp8_fp16: bool | None = None) -> KernelCase:
    """``fp8_fp16``: the decode row's switch replaced (None: the row's own)."""

    def launch() -> str:
        from kvcore_mla.ops.mla_configs import (
            TritonMLAPlan,
            family_of,
            mixed_config,
            mla_decode_config,
            mla_decode_num_splits,
        )
        from kvcore_mla.ops.triton_mla_attention import mla_attention

        fp8 = kv_cache_dtype != "auto"
        head_dim = _KV_LORA_RANK + _ROPE_DIM
        kv_cache = torch.empty(_NUM_BLOCKS, _BLOCK_SIZE, head_dim,
                               dtype=torch.float8_e4m3fn if fp8 else dtype)
        num_tokens, num_seqs = sum(q_lens), len(q_lens)
        seq_lens = torch.tensor([context + n for n in q_lens], dtype=torch.int32)
        query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).int()
        max_seq_len = int(seq_lens.max())
        if max(q_lens) == 1:  # as TRITON_MLA's builder does, with the target's row and SMs
            cap = target.device_capability
            config = mla_decode_config(num_heads, family_of((cap.major, cap.minor),
                                                            rocm=target.is_rocm),
                                       page_size=_BLOCK_SIZE, fp8_cache=fp8, gluon=gluon)
            if fp8_fp16 is not None:
                config = dataclasses.replace(config, fp8_fp16=fp8_fp16)
            plan = TritonMLAPlan(config, mla_decode_num_splits(num_seqs, num_heads, max_seq_len,
                                                               config, target.num_sms))
        else:
            plan = TritonMLAPlan(mixed_config(num_heads, _KV_LORA_RANK, rocm=target.is_rocm))
        q = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
        mla_attention(q, kv_cache, kv_lora_rank=_KV_LORA_RANK, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, block_table=_block_table(num_seqs, max_seq_len,
                                                                  _BLOCK_SIZE),
                      scale=head_dim ** -0.5, kv_cache_dtype=kv_cache_dtype,
                      k_scale=torch.ones(1) if fp8 else None, max_query_len=max(q_lens),
                      max_seq_len=max_seq_len, plan=plan)
        return plan.config.kernel

    allowance = {} if max_spills is None else {"max_spills": max_spills}
    skip = _skip("TRITON_MLA", target, dtype, kv_cache_dtype)
    if skip is None and fp8_fp16 and target.is_rocm:
        skip = "TRITON_MLA: fp8_fp16 is NVIDIA's fp8 path (a PTX move)"
    return KernelCase(name, launch, skip=skip, **allowance)


def _latent_write_case(target: CompileTarget, name: str, *, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> KernelCase:
    def launch() -> None:
        from kvcore_mla.ops.triton_cache import concat_and_cache_mla

        fp8 = kv_cache_dtype != "auto"
        num_tokens = 2048
        kv_cache = torch.empty(_NUM_BLOCKS, _BLOCK_SIZE, _KV_LORA_RANK + _ROPE_DIM,
                               dtype=torch.float8_e4m3fn if fp8 else dtype)
        kv_c = torch.empty(num_tokens, _KV_LORA_RANK, dtype=dtype)
        k_pe = torch.empty(num_tokens, 1, _ROPE_DIM, dtype=dtype)
        slots = torch.arange(num_tokens) % (_NUM_BLOCKS * _BLOCK_SIZE)
        concat_and_cache_mla(kv_c, k_pe, kv_cache, slots, kv_cache_dtype,
                             torch.ones(1) if fp8 else None)

    return KernelCase(name, launch, skip=_skip("TRITON_MLA", target, dtype, kv_cache_dtype))


def _indexer_write_case(target: CompileTarget, name: str, *, dtype: torch.dtype,
                        scale_fmt: str | None) -> KernelCase:
    def launch() -> None:
        from kvcore_mla.ops import indexer_cache_head_size
        from kvcore_mla.ops.triton_cache import indexer_k_quant_and_cache

        num_tokens, head_dim, quant_block = 2048, 128, 128
        width = indexer_cache_head_size(head_dim, quant_block)
        kv_cache = torch.empty(_NUM_BLOCKS, _INDEXER_BLOCK_SIZE, width, dtype=torch.uint8)
        k = torch.empty(num_tokens, head_dim, dtype=dtype)
        slots = torch.arange(num_tokens) % (_NUM_BLOCKS * _INDEXER_BLOCK_SIZE)
        indexer_k_quant_and_cache(k, kv_cache, slots, quant_block, scale_fmt)

    return KernelCase(name, launch, skip=_skip("DEEPSEEK_V32_INDEXER", target, dtype))


def compile_cases(target: CompileTarget) -> list[KernelCase]:
    """MLA decode (128 and 16 heads, split-KV as chosen for the target), mixed prefill+decode,
    fp8 latent caches, the latent and indexer cache writes."""
    bf16, fp16 = torch.bfloat16, torch.float16
    mixed = [2048, 2048] + [1] * 62
    return [
        # On sm90 the first case runs gluon_mla_ws (its table row); the second the row that
        # follows it, triton_mla_decode_tma_keysplit, which spills 856 bytes a thread with
        # Triton 3.9 (300 with 3.6) and is still the fastest Triton kernel at 128 heads
        # (MEASUREMENTS.md); spilling more than that is a regression. (Without Gluon, Triton
        # before 3.6, the first case runs that row too.)
        _mla_case(target, "MLA decode 64x4096 H128 bf16", q_lens=[1] * 64, context=4095,
                  num_heads=128, dtype=bf16, max_spills=896),
        _mla_case(target, "MLA decode 64x4096 H128 bf16 Triton kernel", q_lens=[1] * 64,
                  context=4095, num_heads=128, dtype=bf16, max_spills=896, gluon=False),
        _mla_case(target, "MLA decode 64x4096 H16 bf16", q_lens=[1] * 64, context=4095,
                  num_heads=16, dtype=bf16),
        _mla_case(target, "MLA decode 8x32768 H16 fp16", q_lens=[1] * 8, context=32767,
                  num_heads=16, dtype=fp16),
        _mla_case(target, "MLA decode 64x4096 H128 bf16 fp8-e4m3 KV", q_lens=[1] * 64,
                  context=4095, num_heads=128, dtype=bf16, kv_cache_dtype="fp8_e4m3"),
        # The fp8 path with fp16 products (TritonMLADecodeConfig.fp8_fp16), off in the rows
        # until timed: the 16-head row with it on, beside the row as it is.
        _mla_case(target, "MLA decode 64x4096 H16 bf16 fp8-e4m3 KV", q_lens=[1] * 64,
                  context=4095, num_heads=16, dtype=bf16, kv_cache_dtype="fp8_e4m3"),
        _mla_case(target, "MLA decode 64x4096 H16 bf16 fp8-e4m3 KV fp8_fp16", q_lens=[1] * 64,
                  context=4095, num_heads=16, dtype=bf16, kv_cache_dtype="fp8_e4m3",
                  fp8_fp16=True),
        _mla_case(target, "MLA mixed 2x2048+62x1 ctx2048 H16 bf16", q_lens=mixed,
                  context=2048, num_heads=16, dtype=bf16),
        _mla_case(target, "MLA mixed 2x2048+62x1 ctx2048 H128 bf16 fp8-e4m3 KV", q_lens=mixed,
                  context=2048, num_heads=128, dtype=bf16, kv_cache_dtype="fp8_e4m3"),
        _latent_write_case(target, "latent write 2048 tok bf16", dtype=bf16),
        _latent_write_case(target, "latent write 2048 tok fp16", dtype=fp16),
        _latent_write_case(target, "latent write 2048 tok bf16 -> fp8-e4m3", dtype=bf16,
                           kv_cache_dtype="fp8_e4m3"),
        _indexer_write_case(target, "indexer write 2048 tok D128 bf16", dtype=bf16, scale_fmt=None),
        _indexer_write_case(target, "indexer write 2048 tok D128 bf16 ue8m0", dtype=bf16,
                            scale_fmt="ue8m0"),
    ]
