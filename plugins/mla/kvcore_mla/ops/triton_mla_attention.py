"""Triton split-KV attention over paged caches: MLA latents, and K/V caches for GQA/MHA.

Two entry points, two attention kernels:

- :func:`decode_attention_fwd`: the decode API engines know from SGLang/vLLM (one query per
  request, a float32 split workspace ``attn_logits``), for MLA (``is_mla=True``: keys are the
  whole latent, values its first ``v_head_dim`` channels) and for GQA/MHA caches.
- :func:`mla_attention`: latent-space MLA for a batch that mixes prefill (with a cached
  prefix) and decode requests, as the TRITON_MLA backend calls it.

MLA decode (``_mla_decode_kernel``)
-----------------------------------
The decode path of both entry points for a cache of one latent per token (DeepSeek-class
models). A program owns one request, one group of ``BLOCK_H`` query heads and one of the
request's KV splits; it loads ``BLOCK_N`` latents a step, each read once for the whole head
group, and computes the group's scores with ``tl.dot`` (``[BLOCK_H, kv_lora_rank] x
[kv_lora_rank, BLOCK_N]`` plus the rope part), so 16 heads (8-way tensor parallelism) are
bandwidth-bound and 128 heads (one GPU) run on the tensor cores. The value is the same tile
(``acc += p x latent``). A tile that lies in one page costs one block-table read. Split counts
come from :func:`mla_decode_num_splits`, launch configurations from the per-GPU table
:data:`MLA_DECODE_CONFIGS`; a builder chooses both once per step (TRITON_MLA's does). A
configuration may also cut the latent into two halves with an accumulator each
(``split_latent``), have the warpgroups share the score tile by keys (``split_score_keys``,
below), ask for a warp-specialised loop (``warp_specialize``), tell the split
chooser how many of its programs an SM holds (``programs_per_sm``) and load the latent tiles
through tensor descriptors (``tma``): two ``tl.make_tensor_descriptor`` built on the device over
the cache seen as rows of its token stride (the ``kv_lora_rank`` channels, and the rope
channels), a tile being ``BLOCK_N`` rows at ``page * (page stride / token stride) + offset in
page``. On Hopper and newer the TMA unit copies tiles into shared memory asynchronously, with no
per-element address registers; elsewhere Triton lowers the descriptor loads to ordinary loads.
It needs ``BLOCK_N`` to divide the page size, contiguous channels and 16-byte aligned base,
token stride and rope offset (checked before launch). Full tiles load unmasked; a request's
last, partial tile loads through two more descriptors whose rows end at the request's last key,
so the hardware zero-fills the stale rows past it (what the default path's masked loads read),
in a loop of its own so it too streams to shared memory. ``benchmarks/bench_mla.py`` sweeps
these and prints the winners as table rows.

Warps of the score tile (``split_score_keys``)
---------------------------------------------
Triton lays out a dot whose result feeds another dot with every warp along its rows, so a
softmax row stays inside one warp. For a 64-head program of 8 warps that covers 128 rows: both
warpgroups compute the same ``[64, BLOCK_N]`` scores, about half of MLA decode's FLOPs, twice.
With ``split_score_keys`` the two warpgroups compute half the keys each (Triton's layout for a
dot that feeds no dot); the row max then crosses warpgroups through shared memory each step,
and so do the probabilities on their way to the value dot. The row sums are kept per key
column and added up once after the loop (a per-step row sum would cross warpgroups too).
Triton decides by following the score's uses: scaling each score part before they are added
(otherwise the parts fuse into one accumulating chain of dots), and the softmax inside a
branch on a runtime condition that always holds (``seq_len > 0``), end that walk before the
value dot. The results agree within rounding (each part is scaled before the sum). The sm90
table's 64-head row uses it (a compile test checks the layout Triton gives it).

The Gluon kernel for Hopper (``gluon``)
--------------------------------------
The sm90 table's 64-head row runs :mod:`kvcore_mla.ops.gluon_mla_decode` instead, written in
Gluon, Triton's lower-level language where the program places shared memory, barriers, wgmma
waits and warp roles itself. It is warp-specialised as FlashMLA and FlashInfer's Hopper MLA
kernels are: one warpgroup computes each tile's scores whole (64 x 64 wgmmas, the query read
from shared memory once a tile, where key-split scores read it twice in 64 x 32 pieces) and
its softmax, a second does P x V of the other latent half, and a copy warpgroup issues the TMA
loads. On the H200 at 128 heads it runs at 0.96-1.02x FlashInfer MLA's speed and 1.3-1.4x
``_mla_decode_kernel``'s best row (``benchmarks/RESULTS.md``, Gluon MLA decode). It takes
bf16/fp16 queries and caches that :func:`gluon_unmet` accepts; :func:`mla_decode_config`
skips the row where Triton has no Gluon Hopper API (3.6 or newer has it) or the cache is fp8,
and the decode entry points given no config where :func:`gluon_unmet` finds the tensors unfit.

Mixed batches and GQA/MHA decode (``_attention_kernel``)
--------------------------------------------------------
A program owns ``BLOCK_Q`` consecutive query tokens of one request times ``BLOCK_H`` query
heads that share one KV head (``BLOCK_M = BLOCK_Q * BLOCK_H`` rows; MLA's single latent "KV
head" is shared by all heads), and one of ``NUM_SPLITS`` contiguous parts of the request's key
range. It streams ``BLOCK_N`` keys per step, each token's page looked up in the block table and
addressed as ``page * stride(0) + offset * stride(1)`` with the cache's *real* strides, so a
per-layer view of a cross-layer pool (page stride ``num_layers`` times the page size) reads
exactly the bytes of its layer and gives bit-identical results. MLA tiles are loaded once: the
``[0, v_head_dim)`` channels serve as the value tile and as the first part of the key, the rope
channels ``[v_head_dim, head_dim)`` as a second, small key part (576 = 512 + 64 needs no padding
to 1024). Scores use ``exp2`` with ``log2(e)`` folded into the scale; partial results of each
split (normalised output and base-2 log-sum-exp) go to a float32 workspace that
``_merge_splits_kernel`` reduces, also producing the natural-log ``lse``. With one split the
attention kernel writes ``o`` and ``lse`` itself.

In both kernels programs are numbered with the head block fastest, then the split, then the
query tile: the programs that read the same keys (one request, one split, all head blocks)
run side by side and share them through L2.

All address arithmetic is int64. ``tl.make_block_ptr`` is not used (removed in triton 3.9);
under ``TRITON_INTERPRET=1`` tiles are cast to float32 before ``tl.dot`` (the interpreter
mishandles low-precision dots); on a GPU the dots run in the query dtype.

This module imports triton at import time; :mod:`kvcore_mla.ops` imports it lazily.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.ops import FP8_KV_CACHE_DTYPES, validate_mla_attention
from kvcore.ops.triton_utils import (
    find_sequence,
    gluon_defaults_enabled,
    gluon_kernels_unavailable,
    interpreting,
    load_kv_scales,
    next_power_of_2,
    recording_launches,
    scale_arg,
)
from kvcore_mla.ops.triton_utils import is_rocm
from kvcore_mla.ops.validation import FP8_DTYPES, validate_decode_attention

__all__ = [
    "GLUON_MAX_WIDTH",
    "MAX_KV_SPLITS",
    "MLA_DECODE_CONFIGS",
    "LaunchConfig",
    "decode_attention_fwd",
    "decode_partials",
    "default_config",
    "default_num_kv_splits",
    "family_of",
    "gluon_available",
    "gluon_unmet",
    "gpu_family",
    "mla_attention",
    "mla_decode_config",
    "mla_decode_num_splits",
    "mla_workspace_numel",
    "split_rows",
    "tma_unmet",
]

#: Most KV splits one call may use.
MAX_KV_SPLITS = 64
# Split a decode batch until it has this many programs per SM ...
_SPLIT_TARGET_WAVES = 2
# ... but give every split at least this many keys of the longest request.
_MIN_SPLIT_TOKENS = 256
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of one attention call (see the module docstring).

    ``block_q`` query tokens x ``block_h`` query heads form one program's rows (``block_q`` is 1
    on the decode path; rows must number at least 16 for ``tl.dot``); ``block_n`` keys per loop
    step. MLA decode kernel only (the other kernel ignores them): ``split_latent`` processes
    the latent as two column halves (two score dots, two value dots with the same
    probabilities into two float32 accumulators of half the width, so each dot chain is
    independent); ``warp_specialize`` asks Triton to warp-specialise the key loop (``tl.range(...,
    warp_specialize=True)``, a hint: where the compiler can, loads and dots run in separate
    warps; elsewhere it is ignored or refused, so only configs measured to compile and to
    help belong in the table);
    ``programs_per_sm`` is how many programs of this config an SM runs at once (shared memory
    and registers permitting), which :func:`mla_decode_num_splits` counts as slots when it
    chooses the split count; ``tma`` loads the latent tiles through tensor descriptors
    (``tl.make_tensor_descriptor``: on Hopper and newer the TMA unit copies each
    ``[block_n, latent]`` tile into shared memory asynchronously, with no per-element address
    registers; elsewhere Triton lowers the descriptor loads to ordinary loads). It applies when
    ``block_n`` divides the cache's page size (a tile never crosses a page), the cache's last
    stride is 1, its base address, token stride and ``kv_lora_rank`` channels are multiples of
    16 bytes, and Triton has ``tl.make_tensor_descriptor`` (3.4 or newer); the decode call
    raises a ValueError naming what is not met. The kernel builds its descriptors on the
    device, so a launch needs Triton's global scratch allocator: when none is set
    (``triton.set_allocator``), the launch sets a torch one for its own duration only.
    ``split_score_keys`` has the warps share the score tile by keys, not by head rows: see
    "Warps of the score tile" in the module docstring. ``gluon`` runs the Gluon kernel for
    Hopper instead (:mod:`kvcore_mla.ops.gluon_mla_decode`, "The Gluon kernel for Hopper" in
    the module docstring): its tile is fixed (``block_h=64``, ``block_n=64``, 12 warps in
    three warpgroups, two stages, TMA loads, so ``tma`` must be True) and the Triton kernel's
    variants (``split_latent``, ``warp_specialize``, ``split_score_keys``) do not apply to it.
    """

    block_q: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    split_latent: bool = False
    warp_specialize: bool = False
    programs_per_sm: int = 1
    tma: bool = False
    split_score_keys: bool = False
    gluon: bool = False

    def __post_init__(self) -> None:
        for name in ("block_q", "block_h", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm={self.programs_per_sm} must be >= 1: the "
                             "programs of this config one SM runs at once (1 when unsure)")
        if self.block_q * self.block_h < 16 or self.block_n < 16:
            raise ValueError(
                f"block_q * block_h = {self.block_q * self.block_h} and block_n = "
                f"{self.block_n} must be >= 16 (tl.dot tiles)"
            )
        gluon_tile = dict(block_q=1, block_h=64, block_n=64, num_warps=12, num_stages=2,
                          tma=True, split_latent=False, split_score_keys=False,
                          warp_specialize=False)
        wrong = {k: getattr(self, k) for k, v in gluon_tile.items() if getattr(self, k) != v}
        if self.gluon and wrong:
            raise ValueError(
                f"gluon=True runs the Gluon Hopper kernel's fixed tile "
                f"({', '.join(f'{k}={v}' for k, v in gluon_tile.items())}); this config has "
                f"{', '.join(f'{k}={v}' for k, v in wrong.items())}: set those fields so, or "
                "gluon=False for the Triton kernel")


def default_config(num_heads: int, num_kv_heads: int, k_main_dim: int, *,
                   decode: bool, rocm: bool | None = None) -> LaunchConfig:
    """The launch configuration used when none is given.

    ``k_main_dim`` is the width of the key part that is not rope (MLA: ``kv_lora_rank``).
    Decode: one query per program and 16 head rows (padded for GQA/MHA, as ``tl.dot`` needs
    16). Prefill: up to 16 heads of one KV head times enough tokens for 32 rows (MLA, whose
    512-wide accumulator limits rows) or 64 rows. ``rocm`` picks the AMD configs (default: the
    torch build's platform; the compile check passes its target's).
    """
    group = num_heads // num_kv_heads
    wide = k_main_dim > 256
    rocm = is_rocm() if rocm is None else rocm
    if decode and wide and group >= 64 and not rocm:
        # Many heads (MLA at 128 heads/GPU): decode is compute-bound, so one program takes 64
        # heads against each latent tile: tl.dot with M = 64 runs on Hopper's wgmma (M = 16
        # ran mma.sync at ~10% of peak and re-read every tile from L2 eight times). 64 x 512
        # float32 accumulators need 8 warps (128 registers a thread); two stages of 32 x 576
        # bf16 keys plus the 64 x 576 query tile take ~144 KiB of shared memory.
        return LaunchConfig(block_q=1, block_h=64, block_n=32, num_warps=8, num_stages=2)
    if decode:
        block_q = 1
        block_h = 32 if wide and group >= 32 and not rocm else 16
    else:
        block_h = min(next_power_of_2(group), 16)
        block_q = max(1, (32 if wide else 64) // block_h)
    if wide:
        # ROCm's 64 KiB of LDS per CU does not hold two stages of 32 x 576 bf16 keys.
        block_n = 16 if rocm else 32
    else:
        block_n = 32 if k_main_dim > 128 else 64
    num_warps = 8 if wide and (not decode or block_h > 16) else 4
    return LaunchConfig(block_q=block_q, block_h=block_h, block_n=block_n,
                        num_warps=num_warps, num_stages=1 if rocm else 2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def default_num_kv_splits(num_seqs: int, num_head_blocks: int, max_seq_len: int,
                          device: torch.device, *, block_h: int = 16,
                          num_sms: int | None = None) -> int:
    """KV splits for a decode batch: enough programs for ``_SPLIT_TARGET_WAVES`` per SM (one
    per SM for programs of 64+ heads, which fill an SM's shared memory alone), at most one
    split per ``_MIN_SPLIT_TOKENS`` keys of the longest request, at most
    :data:`MAX_KV_SPLITS`. ``num_sms`` defaults to ``device``'s SM count."""
    programs = max(1, num_seqs * num_head_blocks)
    target = (1 if block_h >= 64 else _SPLIT_TARGET_WAVES) * (num_sms or _num_sms(device))
    if programs >= target:
        return 1
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(-(-target // programs), by_length, MAX_KV_SPLITS))


#: MLA decode launch configurations per GPU family (:func:`gpu_family`): rows of
#: ``(min_heads, config)``, most heads first; the rows of the largest ``min_heads <= num_heads``
#: apply, the first of them whose loads can serve the cache (a row with ``tma=True`` may be
#: followed by a pointer-load row of the same ``min_heads``: see :func:`mla_decode_config`).
#: ``benchmarks/bench_mla.py`` sweeps candidates on a GPU and prints the winners as rows of
#: this table.
MLA_DECODE_CONFIGS: dict[str, tuple[tuple[int, LaunchConfig], ...]] = {
    # Hopper: 64-head programs for 64+ heads (tl.dot with M = 64 runs on wgmma; the 64 x 512
    # float32 accumulator needs 8 warps); two buffers of 64 latents beside the 64 x 576 query
    # tile take ~220 KiB of shared memory. 16-head programs (memory-bound) keep two tiles of
    # 64 latents in flight (164 KiB). All as compiled for sm90 by `kvcore kernels`. From the
    # H200 sweeps (benchmarks/RESULTS.md): at 64+ heads, tiles loaded through tensor
    # descriptors (TMA) with the warpgroups sharing the score tile by keys (split_score_keys:
    # about 20% faster than the best layout where both compute it); caches TMA cannot serve take
    # the pointer-load row (the latent in two 256-wide halves; with key-split scores, pointer
    # loads of 2-byte latents need more shared memory than an SM has). 4 warps for 16-head
    # programs (faster than 8). First of all at 64+ heads, the Gluon kernel (three
    # warpgroups: whole-tile scores and softmax, values, copies): 1.3-1.4x the Triton
    # kernel's speed on the H200, 0.96-1.02x FlashInfer MLA's.
    "sm90": ((64, LaunchConfig(block_q=1, block_h=64, block_n=64, num_warps=12, num_stages=2,
                               tma=True, gluon=True)),
             (64, LaunchConfig(block_q=1, block_h=64, block_n=64, num_warps=8, num_stages=2,
                               tma=True, split_score_keys=True)),
             (64, LaunchConfig(block_q=1, block_h=64, block_n=64, num_warps=8, num_stages=2,
                               split_latent=True)),
             (1, LaunchConfig(block_q=1, block_h=16, block_n=64, num_warps=4, num_stages=3))),
    # A100 (164 KiB of shared memory a block): 32-head programs at most.
    "sm80": ((32, LaunchConfig(block_q=1, block_h=32, block_n=32, num_warps=8, num_stages=2)),
             (1, LaunchConfig(block_q=1, block_h=16, block_n=32, num_warps=4, num_stages=2))),
    # AMD: 64 KiB of LDS a CU holds one stage of 16 latents beside the query tile.
    "rocm": ((32, LaunchConfig(block_q=1, block_h=32, block_n=16, num_warps=8, num_stages=1)),
             (1, LaunchConfig(block_q=1, block_h=16, block_n=16, num_warps=4, num_stages=1))),
    # Anything else (consumer GPUs with ~100 KiB of shared memory, the CPU interpreter).
    "default": ((1, LaunchConfig(block_q=1, block_h=16, block_n=32, num_warps=4,
                                 num_stages=2)),),
}
#: A split's fixed cost (its partial output written and merged) in latent tiles, for
#: :func:`mla_decode_num_splits`.
_SPLIT_COST_TILES = 1.0


def gpu_family(device: torch.device | str | None = None) -> str:
    """The key of :data:`MLA_DECODE_CONFIGS` for ``device`` (default: the current GPU; a CPU
    device, e.g. under ``TRITON_INTERPRET=1``, is ``"default"``)."""
    if is_rocm():
        return "rocm"
    dev = torch.device(device) if device is not None else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        return "default"
    return family_of(torch.cuda.get_device_capability(dev), rocm=False)


def family_of(capability: tuple[int, int], *, rocm: bool) -> str:
    """The key of :data:`MLA_DECODE_CONFIGS` for a GPU of compute ``capability`` (``(major,
    minor)``; any on ROCm), e.g. a compile target's."""
    if rocm:
        return "rocm"
    if capability[0] == 9:
        return "sm90"
    if tuple(capability) == (8, 0):
        return "sm80"
    return "default"


def mla_decode_config(num_heads: int, family: str = "default", *,
                      page_size: int | None = None, fp8_cache: bool = False,
                      tma: bool = True, gluon: bool = True,
                      dtype: torch.dtype | None = None) -> LaunchConfig:
    """The MLA decode launch configuration of :data:`MLA_DECODE_CONFIGS` for ``num_heads``
    query heads on a GPU of ``family`` (see :func:`gpu_family`); ``block_h`` never exceeds
    ``num_heads`` rounded up to a power of two (at least 16, as ``tl.dot`` needs).

    A row that loads through tensor descriptors (``tma=True``) applies only where they can
    serve: ``tma`` is True (callers pass False when :func:`tma_unmet` finds the cache itself
    unfit), with ``page_size`` given when ``block_n`` divides it, when the installed Triton
    has ``tl.make_tensor_descriptor``, and not for an fp8 cache (``fp8_cache``: its tiles are
    widened in registers, and on sm90 the 128-head program then spills twice as much through
    descriptors, ``kvcore kernels``). Otherwise the next row of the same ``min_heads`` applies,
    or, when there is none, the same config with ``tma=False`` (same result, pointer loads).
    Gluon rows are skipped when ``KVCORE_GLUON=0``
    (:func:`~kvcore.ops.triton_utils.gluon_defaults_enabled`).
    The decode entry points given no config check the cache with :func:`tma_unmet`."""
    if family not in MLA_DECODE_CONFIGS:
        raise ValueError(f"family={family!r} (known: {', '.join(MLA_DECODE_CONFIGS)})")
    rows = MLA_DECODE_CONFIGS[family]
    least = next((least for least, _ in rows if num_heads >= least), rows[-1][0])
    group = [config for row_least, config in rows if row_least == least]
    descriptors = tma and not fp8_cache and hasattr(tl, "make_tensor_descriptor")
    gluon_ok = (gluon and tma and not fp8_cache and gluon_defaults_enabled()
                and (dtype is None or dtype in _GLUON_DTYPES) and gluon_available() is None)

    def serves(config: LaunchConfig) -> bool:
        if config.gluon:
            return gluon_ok and (page_size is None or page_size % config.block_n == 0)
        return not config.tma or (descriptors and (page_size is None
                                                   or page_size % config.block_n == 0))

    config = next((c for c in group if serves(c)),
                  dataclasses.replace(group[0], tma=False, gluon=False))
    block_h = min(config.block_h, max(16, next_power_of_2(num_heads)))
    return dataclasses.replace(config, block_h=block_h)


def _table_config(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> LaunchConfig:
    """The table's decode config for these queries and cache: its Gluon and TMA rows only where
    they can serve them."""
    rows = functools.partial(mla_decode_config, q.shape[1], gpu_family(q.device),
                             page_size=kv_cache.shape[1], fp8_cache=kv_cache.dtype in FP8_DTYPES,
                             dtype=q.dtype)
    config = rows()
    if config.gluon and gluon_unmet(q, kv_cache, kv_lora_rank) is not None:
        config = rows(gluon=False)
    if config.tma and not config.gluon and tma_unmet(kv_cache, kv_lora_rank, config) is not None:
        config = rows(gluon=False, tma=False)
    return config


def mla_decode_num_splits(num_seqs: int, num_heads: int, max_seq_len: int,
                          config: LaunchConfig, num_sms: int) -> int:
    """KV splits for an MLA decode batch, from its shape and the SM count.

    Each of the ``num_sms * config.programs_per_sm`` slots gets ``ceil(programs / slots)``
    programs (programs = requests x head groups x splits) and each program ``ceil(tiles /
    splits)`` latent tiles of ``config.block_n`` plus a fixed cost for a split's partial
    result: the count with the least work on the busiest slot wins (the fewest splits on
    ties), at most :data:`MAX_KV_SPLITS` and one tile a split.
    """
    programs = max(1, num_seqs) * -(-num_heads // config.block_h)
    tiles = max(1, -(-max_seq_len // config.block_n))
    slots = max(1, num_sms) * config.programs_per_sm
    best, best_cost = 1, float("inf")
    for splits in range(1, min(MAX_KV_SPLITS, tiles) + 1):
        cost = -(-programs * splits // slots) * (
            -(-tiles // splits) + (_SPLIT_COST_TILES if splits > 1 else 0.0))
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, v_scale, qk_scale,
    num_seqs, num_head_blocks, group, blocks_per_kv_head, k_main_dim, k_dim, v_dim,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_pt, stride_ph, stride_ps, stride_pd,
    stride_bts, stride_btb,
    PAGE_SIZE: tl.constexpr, VARLEN: tl.constexpr, IS_MLA: tl.constexpr, HAS_PE: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr, WRITE_LSE: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    pid = tl.program_id(0)
    head_block = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % NUM_SPLITS
    tile = rest // NUM_SPLITS

    if VARLEN:
        seq = find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_tile = tile - (q_start // BLOCK_Q + seq)
        if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        # Keys this tile sees (causal): up to its last query.
        kv_end = seq_len - q_len + tl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q)
    else:  # decode: request i has exactly one query, token i, which sees every key
        seq = tile
        q_start = tile
        q_len = 1
        q_tile = 0
        seq_len = tl.load(seq_lens_ptr + seq)
        kv_end = seq_len
    context_len = seq_len - q_len

    kv_head = head_block // blocks_per_kv_head
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // BLOCK_H
    g = (head_block % blocks_per_kv_head) * BLOCK_H + rows % BLOCK_H
    row_valid = (q_idx < q_len) & (g < group)
    head = (kv_head * group + g).to(tl.int64)
    token = (q_start + q_idx).to(tl.int64)
    q_pos = context_len + q_idx
    q_row = q_ptr + token * stride_qt + head * stride_qh

    dk = tl.arange(0, BLOCK_DK).to(tl.int64)
    dk_valid = dk < k_main_dim
    q = tl.load(q_row[:, None] + dk[None, :] * stride_qd,
                mask=row_valid[:, None] & dk_valid[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    if HAS_PE:
        dpe = k_main_dim + tl.arange(0, BLOCK_DPE).to(tl.int64)
        dpe_valid = dpe < k_dim
        q_pe = tl.load(q_row[:, None] + dpe[None, :] * stride_qd,
                       mask=row_valid[:, None] & dpe_valid[None, :], other=0.0)
        if INTERPRET:
            q_pe = q_pe.to(tl.float32)
    if not IS_MLA:
        dv = tl.arange(0, BLOCK_DV).to(tl.int64)
        dv_valid = dv < v_dim

    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR)
        qk_scale = qk_scale * ks

    # The keys are cut into NUM_SPLITS parts of whole BLOCK_N tiles.
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bts
    kv_head64 = kv_head.to(tl.int64)
    for t in range(t_lo, t_hi):
        k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        page = tl.load(bt_row + (k_pos // PAGE_SIZE) * stride_btb, mask=k_valid, other=0)
        in_page = (k_pos % PAGE_SIZE).to(tl.int64)
        # The page's address from the cache's own page stride: see the module docstring.
        k_row = k_ptr + page.to(tl.int64) * stride_kb + in_page * stride_ks + kv_head64 * stride_kh
        k = tl.load(k_row[:, None] + dk[None, :] * stride_kd,
                    mask=k_valid[:, None] & dk_valid[None, :], other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)  # fp8 -> model dtype is exact; the scale is applied outside
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_PE:
            k_pe = tl.load(k_row[:, None] + dpe[None, :] * stride_kd,
                           mask=k_valid[:, None] & dpe_valid[None, :], other=0.0)
            if INTERPRET:
                k_pe = k_pe.to(tl.float32)
            else:
                k_pe = k_pe.to(q.dtype)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = s * qk_scale
        mask = row_valid[:, None] & k_valid[None, :]
        if VARLEN:  # causal within the tile's queries; a decode query sees all kv_end keys
            mask &= k_pos[None, :] <= q_pos[:, None]
        s = tl.where(mask, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_MLA:
            v = k  # the latent's first v_dim channels are the value
        else:
            v_row = (v_ptr + page.to(tl.int64) * stride_vb + in_page * stride_vs
                     + kv_head64 * stride_vh)
            v = tl.load(v_row[:, None] + dv[None, :] * stride_vd,
                        mask=k_valid[:, None] & dv_valid[None, :], other=0.0)
            if INTERPRET:
                v = v.to(tl.float32)
            else:
                v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * vs
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    d_out = tl.arange(0, BLOCK_DV).to(tl.int64)
    out_mask = row_valid[:, None] & (d_out[None, :] < v_dim)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None]
                 + d_out[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        if WRITE_LSE:
            tl.store(lse_ptr + token * stride_lt + head * stride_lh,
                     (lse2 * 0.6931471805599453).to(lse_ptr.dtype.element_ty),  # x ln(2)
                     mask=row_valid)
    else:
        # Workspace (tokens, heads, splits, v_dim + 1): the split's normalised output, then
        # its base-2 log-sum-exp.
        part = part_ptr + token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part[:, None] + d_out[None, :] * stride_pd, out, mask=out_mask)
        tl.store(part + v_dim * stride_pd, lse2, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, v_dim,
    stride_pt, stride_ph, stride_ps, stride_pd,
    stride_qt, stride_qh, stride_qs,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    WRITE_LSE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD).to(tl.int64)
    part_lse = part_lse_ptr + token * stride_qt + head * stride_qh
    m = tl.max(tl.load(part_lse + splits * stride_qs, mask=splits < NUM_SPLITS,
                       other=float("-inf")), 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, BLOCK_DV).to(tl.int64)
    d_valid = d < v_dim
    part = part_ptr + token * stride_pt + head * stride_ph + d * stride_pd
    # One 1-D row a split, the splits unrolled: every thread sums its own channels over the
    # splits in registers. A [splits, channels] tile let Triton spread 16-bit rows over warps
    # on the splits axis, and its sum then crossed warps through shared memory (2x slower).
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    total = 0.0
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(part_lse + s * stride_qs) - m_use)  # 0 for an empty split
        row = tl.load(part + s * stride_ps, mask=d_valid, other=0.0).to(tl.float32)
        acc += w * row
        total += w
    has_keys = total > 0
    out = acc / tl.where(has_keys, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)
    if WRITE_LSE:
        lse = tl.where(has_keys, (m_use + tl.log2(tl.where(has_keys, total, 1.0))), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh,
                 (lse * 0.6931471805599453).to(lse_ptr.dtype.element_ty))  # x ln(2)


@triton.jit
def _load_latent(rows, cols, stride_d, valid, like, width: tl.constexpr, EVEN: tl.constexpr):
    """Columns ``cols`` of the latent rows ``rows`` (masked rows read 0) in ``like``'s dtype
    (the query tile's: fp8 -> model dtype is exact, the scale is applied outside; float32 under
    the interpreter). The column mask is left out when every column is inside ``width``, so
    the loads stay 16-byte vectors."""
    if EVEN:
        tile = tl.load(rows[:, None] + cols[None, :] * stride_d, mask=valid[:, None], other=0.0)
    else:
        tile = tl.load(rows[:, None] + cols[None, :] * stride_d,
                       mask=valid[:, None] & (cols < width)[None, :], other=0.0)
    return tile.to(like.dtype)


@triton.jit
def _load_query(q_rows, cols, stride_d, h_valid, width: tl.constexpr, INTERPRET: tl.constexpr):
    """Query columns ``cols`` of the head rows ``q_rows`` (float32 under the interpreter, which
    mishandles low-precision dots)."""
    q = tl.load(q_rows[:, None] + cols[None, :] * stride_d,
                mask=h_valid[:, None] & (cols < width)[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    return q


@triton.jit
def _store_rows(base, cols, stride_d, values, h_valid, width: tl.constexpr):
    """``values`` into columns ``cols`` (those inside ``width``) of the head rows ``base``."""
    tl.store(base[:, None] + cols[None, :] * stride_d, values.to(base.dtype.element_ty),
             mask=h_valid[:, None] & (cols < width)[None, :])


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile's online-softmax step on the scaled, masked scores ``s`` ``[BLOCK_H,
    BLOCK_N]``: the new running max and sum, the tile's probabilities ``p`` and the factor
    ``alpha`` that rescales the accumulators (``acc = acc * alpha + p x value``)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _score_part(q, kv, qk_scale, SPLIT_SCORE_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One part (latent, latent half or rope) of a tile's scores ``[BLOCK_H, BLOCK_N]``: ``q x
    kv^T``, already scaled with ``SPLIT_SCORE_KEYS`` (the parts are then summed as separate
    dots: added unscaled, Triton fuses them into one accumulating chain of dots, which keeps
    the chained-dot layout; module docstring); the caller scales the sum otherwise."""
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
    if SPLIT_SCORE_KEYS:
        s = s * qk_scale
    return s


@triton.jit
def _softmax_step(s, m_i, l_i, like, live, SPLIT_SCORE_KEYS: tl.constexpr):
    """:func:`_online_softmax` with ``p`` in ``like``'s dtype. ``SPLIT_SCORE_KEYS``: inside a
    branch on ``live`` (a runtime condition that always holds), which ends Triton's walk from
    the score dot to the value dot (module docstring); the other branch is never taken. There
    ``l_i`` is ``[BLOCK_H, BLOCK_N]``, each key column's running sum, added up once after the
    loop: a row sum per step would cross the warpgroups through shared memory, as the row
    max does."""
    if SPLIT_SCORE_KEYS:
        if live:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_new = l_i * alpha[:, None] + p
            p = p.to(like.dtype)
        else:
            m_new = m_i
            l_new = l_i
            p = tl.zeros(s.shape, like.dtype)
            alpha = tl.full(m_i.shape, 1.0, tl.float32)
    else:
        m_new, l_new, p, alpha = _online_softmax(s, m_i, l_i)
        p = p.to(like.dtype)
    return m_new, l_new, p, alpha


@triton.jit
def _tma_tile(q0, q1, q_pe, nope_desc, pe_desc, row, m_i, l_i, acc0, acc1, valid, qk_scale,
              live, D_PE: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_LATENT: tl.constexpr,
              SPLIT_SCORE_KEYS: tl.constexpr, MASKED: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """One latent tile of the TMA path: ``BLOCK_N`` rows from ``row`` of the descriptors,
    read once as keys (scores against the head group) and values (``acc += p x latent``).
    ``MASKED``: scores of keys where ``valid`` is False are dropped (a request's last tile).
    ``live``: see :func:`_softmax_step`."""
    kv0 = nope_desc.load([row, 0]).to(q0.dtype)
    s = _score_part(q0, kv0, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
    if SPLIT_LATENT:
        kv1 = nope_desc.load([row, BLOCK_C]).to(q0.dtype)
        s += _score_part(q1, kv1, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
    if D_PE > 0:
        kpe = pe_desc.load([row, 0]).to(q0.dtype)
        s += _score_part(q_pe, kpe, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
    if not SPLIT_SCORE_KEYS:
        s = s * qk_scale
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, kv0, live, SPLIT_SCORE_KEYS)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0, input_precision=DOT_PRECISION)
    if SPLIT_LATENT:
        acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1, input_precision=DOT_PRECISION)
    return m_i, l_i, acc0, acc1


@triton.jit
def _mla_decode_kernel(
    q_ptr, kv_ptr, out_ptr, lse_ptr, part_ptr, part_lse_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, qk_scale, num_heads, num_head_blocks, num_splits, kv_rows, page_rows,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kd,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_sb, stride_sh, stride_ss,
    stride_btb, stride_btp,
    D_NOPE: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_LATENT: tl.constexpr, BLOCK_C: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    TMA: tl.constexpr, SPLIT_SCORE_KEYS: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr, SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (head group, KV split, request) of MLA decode; see :func:`_launch_mla_decode`."""
    pid = tl.program_id(0)
    head_block = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % num_splits
    seq = (rest // num_splits).to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, num_tiles)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = heads < num_heads
    heads64 = heads.to(tl.int64)
    # SPLIT_LATENT: the latent is two column halves of BLOCK_C = BLOCK_D / 2, each its own key
    # part, value tile and float32 accumulator (same P): two independent dot chains a tile.
    c0 = tl.arange(0, BLOCK_C).to(tl.int64)
    c1 = BLOCK_C + c0
    # Latent rows are masked by token only when the width is a power of two (MLA's 512): a
    # mask along the contiguous dim could cost the 16-byte vector loads.
    EVEN_D: tl.constexpr = BLOCK_D == D_NOPE
    q_rows = q_ptr + seq * stride_qb + heads64 * stride_qh
    q0 = _load_query(q_rows, c0, stride_qd, h_valid, D_NOPE, INTERPRET)
    # Placeholders where a part is absent (never read: the constexpr flags skip it), so the
    # tile helpers take one signature.
    q1 = q0
    q_pe = q0
    if SPLIT_LATENT:
        q1 = _load_query(q_rows, c1, stride_qd, h_valid, D_NOPE, INTERPRET)
    if D_PE > 0:
        dpe = D_NOPE + tl.arange(0, BLOCK_PE).to(tl.int64)
        q_pe = _load_query(q_rows, dpe, stride_qd, h_valid, D_NOPE + D_PE, INTERPRET)
    if FP8:
        if SCALE_IS_TENSOR:
            ks = tl.load(k_scale).to(tl.float32)
        else:
            ks = k_scale
        qk_scale = qk_scale * ks

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if SPLIT_SCORE_KEYS:  # per key column, summed after the loop (see _softmax_step)
        l_i = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    acc1 = 0.0  # a scalar placeholder: no second accumulator carried without SPLIT_LATENT
    if SPLIT_LATENT:
        acc1 = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    bt_row = block_table_ptr + seq * stride_btb
    offs_n = tl.arange(0, BLOCK_N)
    live = seq_len > 0  # true wherever a tile is computed: see _softmax_step
    # Page ids are read one tile ahead and carried into the next iteration: a latent load whose
    # address comes from a block-table load of the same iteration is not multi-buffered by
    # Triton's pipeliner (one tile in flight); from a carried value it is (num_stages - 1).
    if PAGE_SIZE % BLOCK_N == 0:  # a tile lies in one page: one block-table read a tile
        page_next = tl.load(bt_row + ((t_lo * BLOCK_N) // PAGE_SIZE) * stride_btp,
                            mask=t_lo < t_hi, other=0)
    else:
        pos_next = t_lo * BLOCK_N + offs_n
        page_next = tl.load(bt_row + (pos_next // PAGE_SIZE) * stride_btp,
                            mask=pos_next < seq_len, other=0)
    if TMA:
        # The cache as rows of stride_ks (a page starts every page_rows rows: the page size,
        # more on a cross-layer view), as two descriptors: the first D_NOPE channels and the
        # rope channels (the hardware zero-fills columns past each width). PAGE_SIZE % BLOCK_N
        # == 0 (checked on the host): a tile is BLOCK_N consecutive rows of one page.
        nope_desc = tl.make_tensor_descriptor(kv_ptr, shape=[kv_rows, D_NOPE],
                                              strides=[stride_ks, 1],
                                              block_shape=[BLOCK_N, BLOCK_C])
        pe_desc = nope_desc
        if D_PE > 0:
            pe_desc = tl.make_tensor_descriptor(kv_ptr + D_NOPE, shape=[kv_rows, D_PE],
                                                strides=[stride_ks, 1],
                                                block_shape=[BLOCK_N, BLOCK_PE])
        # Tiles whose every key is < seq_len load unmasked; only a request's last tile can be
        # partial, and it is done after the loop.
        t_full = tl.minimum(t_hi, seq_len // BLOCK_N)
        for t in tl.range(t_lo, t_full, warp_specialize=WARP_SPECIALIZE):
            start = t * BLOCK_N
            row = page_next.to(tl.int32) * page_rows + start % PAGE_SIZE
            page_next = tl.load(bt_row + ((start + BLOCK_N) // PAGE_SIZE) * stride_btp,
                                mask=t + 1 < t_hi, other=0)
            m_i, l_i, acc0, acc1 = _tma_tile(
                q0, q1, q_pe, nope_desc, pe_desc, row, m_i, l_i, acc0, acc1, offs_n, qk_scale,
                live, D_PE=D_PE, BLOCK_C=BLOCK_C, SPLIT_LATENT=SPLIT_LATENT,
                SPLIT_SCORE_KEYS=SPLIT_SCORE_KEYS, MASKED=False, DOT_PRECISION=DOT_PRECISION)
        if (t_lo <= t_full) & (t_full < t_hi):
            # The request's last tile, partly past seq_len, if it is this split's. The rows past
            # seq_len are stale cache bytes (any value, NaN included): descriptors whose rows
            # end at seq_len have the hardware zero-fill them, as the default path's masked
            # loads read them. A loop (of this one tile) so the pipeliner streams it to shared
            # memory as in the main loop instead of through registers.
            start = t_full * BLOCK_N
            tail = kv_ptr + (page_next.to(tl.int64) * page_rows + start % PAGE_SIZE) * stride_ks
            tail_nope = tl.make_tensor_descriptor(tail, shape=[seq_len - start, D_NOPE],
                                                  strides=[stride_ks, 1],
                                                  block_shape=[BLOCK_N, BLOCK_C])
            tail_pe = tail_nope
            if D_PE > 0:
                tail_pe = tl.make_tensor_descriptor(tail + D_NOPE, shape=[seq_len - start, D_PE],
                                                    strides=[stride_ks, 1],
                                                    block_shape=[BLOCK_N, BLOCK_PE])
            for t in tl.range(t_full, t_hi):
                m_i, l_i, acc0, acc1 = _tma_tile(
                    q0, q1, q_pe, tail_nope, tail_pe, (t - t_full) * BLOCK_N,  # 0: one tile
                    m_i, l_i, acc0, acc1, t * BLOCK_N + offs_n < seq_len, qk_scale, live,
                    D_PE=D_PE, BLOCK_C=BLOCK_C, SPLIT_LATENT=SPLIT_LATENT,
                    SPLIT_SCORE_KEYS=SPLIT_SCORE_KEYS, MASKED=True, DOT_PRECISION=DOT_PRECISION)
    else:
        for t in tl.range(t_lo, t_hi, warp_specialize=WARP_SPECIALIZE):
            start = t * BLOCK_N
            pos = start + offs_n
            valid = pos < seq_len  # every tile holds at least one key: rows never see only -inf
            page = page_next.to(tl.int64)
            if PAGE_SIZE % BLOCK_N == 0:
                rows = kv_ptr + page * stride_kb + ((start % PAGE_SIZE) + offs_n).to(tl.int64) * \
                    stride_ks
                page_next = tl.load(bt_row + ((start + BLOCK_N) // PAGE_SIZE) * stride_btp,
                                    mask=t + 1 < t_hi, other=0)
            else:
                rows = kv_ptr + page * stride_kb + (pos % PAGE_SIZE).to(tl.int64) * stride_ks
                pos_next = pos + BLOCK_N
                page_next = tl.load(bt_row + (pos_next // PAGE_SIZE) * stride_btp,
                                    mask=(pos_next < seq_len) & (pos_next < t_hi * BLOCK_N),
                                    other=0)
            # The latent tile, read once: keys (with the rope part) and values.
            kv0 = _load_latent(rows, c0, stride_kd, valid, q0, D_NOPE, EVEN_D)
            s = _score_part(q0, kv0, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
            if SPLIT_LATENT:
                kv1 = _load_latent(rows, c1, stride_kd, valid, q0, D_NOPE, EVEN_D)
                s += _score_part(q1, kv1, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
            if D_PE > 0:
                kpe = _load_latent(rows, dpe, stride_kd, valid, q0, D_NOPE + D_PE, BLOCK_PE == D_PE)
                s += _score_part(q_pe, kpe, qk_scale, SPLIT_SCORE_KEYS, DOT_PRECISION)
            if not SPLIT_SCORE_KEYS:
                s = s * qk_scale
            m_i, l_i, p, alpha = _softmax_step(tl.where(valid[None, :], s, float("-inf")),
                                               m_i, l_i, kv0, live, SPLIT_SCORE_KEYS)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0, input_precision=DOT_PRECISION)
            if SPLIT_LATENT:
                acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1, input_precision=DOT_PRECISION)

    if FP8:
        acc0 = acc0 * ks
        if SPLIT_LATENT:
            acc1 = acc1 * ks
    if SPLIT_SCORE_KEYS:
        l_i = tl.sum(l_i, 1)
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)[:, None]
    lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    if SPLIT:
        # Partials (batch, heads, splits, D_NOPE): normalised output; (batch, heads, splits):
        # base-2 LSE.
        part = part_ptr + seq * stride_pb + heads64 * stride_ph + split * stride_ps
        _store_rows(part, c0, stride_pd, acc0 / l_safe, h_valid, D_NOPE)
        if SPLIT_LATENT:
            _store_rows(part, c1, stride_pd, acc1 / l_safe, h_valid, D_NOPE)
        tl.store(part_lse_ptr + seq * stride_sb + heads64 * stride_sh + split * stride_ss, lse2,
                 mask=h_valid)
    else:
        o_rows = out_ptr + seq * stride_ob + heads64 * stride_oh
        _store_rows(o_rows, c0, stride_od, acc0 / l_safe, h_valid, D_NOPE)
        if SPLIT_LATENT:
            _store_rows(o_rows, c1, stride_od, acc1 / l_safe, h_valid, D_NOPE)
        if WRITE_LSE:
            tl.store(lse_ptr + seq * stride_lb + heads64 * stride_lh,
                     (lse2 * 0.6931471805599453).to(lse_ptr.dtype.element_ty),  # x ln(2)
                     mask=h_valid)


def _merge_splits(partials: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor | None, num_splits: int, block_dv: int) -> None:
    """Reduce each split's normalised output ``partials`` ``(tokens, heads, num_splits,
    v_dim)`` (float32, or the output's 16-bit dtype) and base-2 log-sum-exp ``partial_lse``
    ``(tokens, heads, num_splits)`` (float32) into ``out`` ``(tokens, heads, v_dim)`` (and the
    natural-log ``lse`` ``(tokens, heads)`` if given): one program per (token, head), sums in
    float32. ``benchmarks/bench_mla.py`` times it alone."""
    num_tokens, num_heads, v_dim = out.shape
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0)
    _merge_splits_kernel[(num_tokens, num_heads)](
        partials, partial_lse, out, lse_arg, v_dim, *partials.stride(), *partial_lse.stride(),
        *out.stride(), *lse_strides, WRITE_LSE=lse is not None, NUM_SPLITS=num_splits,
        SPLITS_PAD=next_power_of_2(num_splits), BLOCK_DV=block_dv,
        # 16 bytes a thread a row: 4 warps on float32 rows of 512, 2 on 16-bit ones.
        num_warps=max(1, min(8, block_dv * partials.element_size() // 512)),
    )


def split_rows(workspace: torch.Tensor, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, partial_lse)`` views of a float32 split workspace ``(tokens, heads,
    splits, >= v_dim + 1)`` whose rows hold a split's normalised output then its base-2
    log-sum-exp (``decode_attention_fwd``'s ``attn_logits``): ``[..., :v_dim]`` and
    ``[..., v_dim]``, as the split kernels and :func:`_merge_splits` take them."""
    return workspace[..., :v_dim], workspace[..., v_dim]


def decode_partials(workspace: torch.Tensor, num_tokens: int, num_heads: int, v_dim: int,
                    num_splits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, partial_lse)`` carved out of a flat float32 workspace of
    :func:`mla_workspace_numel` elements for the MLA decode path: the base-2 log-sum-exps
    first, float32 ``(tokens, heads, splits)``; then the normalised outputs ``(tokens, heads,
    splits, v_dim)`` in ``dtype`` when it is 16-bit (the output's: half the bytes written and
    merged, rounding the merge adds is below the output's own), else float32, rows padded to
    64 bytes for vector stores."""
    rows = num_tokens * num_heads * num_splits
    partial_lse = workspace[:rows].view(num_tokens, num_heads, num_splits)
    part_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    per_float = 4 // part_dtype.itemsize
    row = -(-v_dim // (16 * per_float)) * 16 * per_float
    start = -(-rows // 16) * 16
    partials = workspace[start:start + rows * row // per_float].view(part_dtype).view(
        num_tokens, num_heads, num_splits, row)[..., :v_dim]
    return partials, partial_lse


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    workspace: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None,
    v_scale: torch.Tensor | float | None,
    num_splits: int,
    is_mla: bool,
    config: LaunchConfig,
) -> None:
    """Launch the attention kernel (and the merge when split). Caches are 4-dim
    ``(num_pages, page_size, num_kv_heads, dim)``; ``query_start_loc=None`` selects the decode
    path (query ``i`` belongs to request ``i``)."""
    num_tokens, num_heads, k_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    v_dim = v_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    # The kernel indexes these densely (the block table goes with its strides); an engine's
    # view of a larger buffer may have stride > 1 (contiguous() returns a dense tensor as is).
    seq_lens = seq_lens.contiguous()
    if query_start_loc is not None:
        query_start_loc = query_start_loc.contiguous()
    group = num_heads // num_kv_heads
    blocks_per_kv_head = -(-group // config.block_h)
    num_head_blocks = num_kv_heads * blocks_per_kv_head
    varlen = query_start_loc is not None
    num_tiles = num_tokens // config.block_q + num_seqs if varlen else num_tokens
    k_main_dim = v_dim if is_mla else k_dim
    pe_dim = k_dim - k_main_dim
    fp8 = k_cache.dtype in FP8_DTYPES
    ks = scale_arg(k_scale if fp8 else None, q.device)
    vs = scale_arg(v_scale if fp8 else None, q.device)
    if isinstance(ks, torch.Tensor) != isinstance(vs, torch.Tensor):
        ks = ks if isinstance(ks, float) else float(ks.reshape(()).item())
        vs = vs if isinstance(vs, float) else float(vs.reshape(()).item())
    block_dk = max(16, next_power_of_2(k_main_dim))
    block_dv = block_dk if is_mla else max(16, next_power_of_2(v_dim))
    split = num_splits > 1
    lse_arg = lse if lse is not None else out
    part = workspace if split else out
    part_strides = workspace.stride() if split else (0, 0, 0, 0)
    lse_strides = lse.stride() if lse is not None else (0, 0)
    _attention_kernel[(num_tiles * num_splits * num_head_blocks,)](
        q, k_cache, v_cache, out, lse_arg, part,
        query_start_loc if varlen else seq_lens, seq_lens, block_table,
        ks, vs, float(scale) * _LOG2E,
        num_seqs, num_head_blocks, group, blocks_per_kv_head, k_main_dim, k_dim, v_dim,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *lse_strides,
        *part_strides, *block_table.stride(),
        PAGE_SIZE=page_size, VARLEN=varlen, IS_MLA=is_mla, HAS_PE=pe_dim > 0,
        FP8=fp8, SCALE_IS_TENSOR=isinstance(ks, torch.Tensor), WRITE_LSE=lse is not None,
        INTERPRET=interpreting(),
        # fp32 queries (tests) get exact dots; others the backend's default (names differ
        # between NVIDIA and AMD, so none is spelled out).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        BLOCK_Q=config.block_q, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        BLOCK_DK=block_dk, BLOCK_DPE=max(16, next_power_of_2(max(pe_dim, 1))),
        BLOCK_DV=block_dv, NUM_SPLITS=num_splits,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        _merge_splits(*split_rows(workspace, v_dim), out, lse, num_splits, block_dv)


#: TMA coordinates are signed 32-bit: the rows a descriptor spans.
_TMA_MAX_ROWS = 2**31 - 1


def tma_unmet(kv_cache: torch.Tensor, kv_lora_rank: int, config: LaunchConfig) -> str | None:
    """Why the TMA path (``config.tma``) cannot read ``kv_cache`` (3-dim ``(num_pages,
    page_size, kv_lora_rank + rope)``), as a sentence naming the unmet condition and the fix;
    ``None`` when it can."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return (f"config.tma=True needs tl.make_tensor_descriptor (Triton 3.4 or newer); Triton "
                f"{triton.__version__} lacks it: upgrade Triton or use tma=False")
    return _descriptor_unmet(kv_cache, kv_lora_rank, config.block_n, "the TMA path",
                             "tma=False")


def _descriptor_unmet(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int, path: str,
                      fix: str) -> str | None:
    """Why tensor descriptors over ``kv_cache`` seen as rows of its token stride, in tiles of
    ``block_n`` rows, cannot read it (``path`` names the kernel, ``fix`` the config change);
    ``None`` when they can."""
    num_pages, page_size, width = kv_cache.shape
    item = kv_cache.element_size()
    if page_size % block_n:
        return (f"config.block_n={block_n} does not divide the cache's page size "
                f"{page_size}: {path} loads tiles that lie in one page (use a block_n "
                f"that divides the page size, or {fix})")
    if kv_cache.stride(2) != 1 and width > 1:
        return (f"kv_cache has last stride {kv_cache.stride(2)}; {path} needs contiguous "
                f"channels (stride 1): pass a cache whose last dim is contiguous, or use {fix}")
    stride_page, stride_token = kv_cache.stride(0), kv_cache.stride(1)
    base = kv_cache.data_ptr()
    if (base | stride_token * item | kv_lora_rank * item) % 16:  # messages only on a refusal
        unaligned = [what for what, nbytes in (
            (f"base address {base:#x}", base),
            (f"token stride ({stride_token} x {item} bytes)", stride_token * item),
            (f"rope offset (kv_lora_rank={kv_lora_rank} x {item} bytes)", kv_lora_rank * item),
        ) if nbytes % 16]
        return (f"kv_cache's {' and '.join(unaligned)} is not a multiple of 16 bytes, as "
                f"tensor descriptors (TMA) need: use a 16-byte aligned cache, or {fix}")
    if stride_token <= 0 or stride_page % stride_token:
        return (f"kv_cache's page stride {stride_page} is not a multiple of its token stride "
                f"{stride_token}; {path} addresses the cache as rows of the token "
                f"stride: use {fix} for this layout")
    if (num_pages - 1) * (stride_page // stride_token) + page_size > _TMA_MAX_ROWS:
        return ("kv_cache spans more than 2**31 - 1 rows of its token stride, past what TMA "
                f"coordinates reach: use {fix} for this cache")
    return None


#: Query and cache dtypes the Gluon decode kernel takes.
_GLUON_DTYPES = (torch.bfloat16, torch.float16)
#: The widest query / cache row (kv_lora_rank + rope) the Gluon kernel takes: the query and two
#: 64-row stages of 16-bit channels, plus 1 KiB of barriers and row factors, within 227 KiB.
GLUON_MAX_WIDTH = (227 * 1024 - 1024) // (3 * 64 * 2)


def gluon_available() -> str | None:
    """``None`` when the installed Triton can build the Gluon decode kernel for Hopper
    (:mod:`kvcore_mla.ops.gluon_mla_decode` imports), else why not, as a sentence."""
    return gluon_kernels_unavailable("kvcore_mla.ops.gluon_mla_decode")


def gluon_unmet(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why the Gluon decode kernel (``config.gluon``) cannot serve queries ``q`` ``(batch,
    heads, kv_lora_rank + rope)`` on ``kv_cache`` (3-dim ``(num_pages, page_size,
    kv_lora_rank + rope)``), as a sentence naming the unmet condition and the fix; ``None``
    when it can: Triton has Gluon's Hopper API, the tensors are on a GPU of compute
    capability 9.x, both bf16 or both fp16, ``kv_lora_rank`` 128, 256 or 512 (two
    warpgroups' halves of at most 256 columns) and the rope width 64 times a power of two (TMA
    boxes of 64-channel chunks), the query and two 64-row stages within Hopper's 227 KiB of
    shared memory (:data:`GLUON_MAX_WIDTH` channels at most, DeepSeek's 576 included), the page
    size a multiple of 64 and the cache addressable by tensor descriptors (as
    :func:`tma_unmet` checks). The device is not
    checked while launches are recorded for an ahead-of-time compile
    (:func:`kvcore.ops.triton_utils.recording_launches`)."""
    reason = gluon_available()
    if reason is not None:
        return reason
    if q.dtype not in _GLUON_DTYPES or kv_cache.dtype != q.dtype:
        return (f"config.gluon=True takes bf16 or fp16 queries and a cache of the same dtype; "
                f"got q {q.dtype} and kv_cache {kv_cache.dtype}: use gluon=False")
    if kv_lora_rank not in (128, 256, 512):
        return (f"config.gluon=True needs kv_lora_rank = 128, 256 or 512 (each of the Gluon "
                f"kernel's two warpgroups holds half the latent columns, at most 256); it is "
                f"{kv_lora_rank}: use gluon=False")
    rope = q.shape[2] - kv_lora_rank
    if rope % 64 or rope < 64 or (rope // 64) & (rope // 64 - 1):
        return (f"config.gluon=True needs rope width = 64 x a power of two (TMA boxes of "
                f"64-channel chunks); it is {rope}: use gluon=False")
    if q.shape[2] > GLUON_MAX_WIDTH:
        return (f"config.gluon=True keeps the query and two 64-row stages of {q.shape[2]} "
                f"channels in shared memory, {3 * 64 * 2 * q.shape[2] // 1024} KiB, more than "
                f"Hopper's 227 KiB (at most {GLUON_MAX_WIDTH} channels): use gluon=False")
    reason = _descriptor_unmet(kv_cache, kv_lora_rank, 64, "the Gluon kernel", "gluon=False")
    if reason is not None:
        return reason
    device = kv_cache.device
    if recording_launches():  # compiled ahead of time for a target: no device to check
        return None
    if device.type != "cuda" or is_rocm() or torch.cuda.get_device_capability(device)[0] != 9:
        where = (f"{device} (compute capability {torch.cuda.get_device_capability(device)})"
                 if device.type == "cuda" and not is_rocm() else str(device))
        return (f"config.gluon=True runs on NVIDIA Hopper GPUs (compute capability 9.x); "
                f"kv_cache is on {where}: use gluon=False")
    return None


def _tma_rows(kv_cache: torch.Tensor, kv_lora_rank: int,
              config: LaunchConfig) -> tuple[int, int]:
    """For the TMA path (``config.tma``): ``(kv_rows, page_rows)``, the cache seen as rows of
    ``stride(1)`` elements (``kv_rows`` of them, a page every ``page_rows``); raises
    ValueError with :func:`tma_unmet`'s reason when the cache does not meet its needs."""
    reason = tma_unmet(kv_cache, kv_lora_rank, config)
    if reason is not None:
        raise ValueError(reason)
    page_rows = kv_cache.stride(0) // kv_cache.stride(1)
    return (kv_cache.shape[0] - 1) * page_rows + kv_cache.shape[1], page_rows


def _torch_scratch(device: torch.device) -> Callable[[int, int, int | None], torch.Tensor]:
    """A Triton allocator (``triton.set_allocator``'s protocol) of torch memory on
    ``device``: its caching allocator (and a CUDA graph's pool during capture) serves it."""
    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    return alloc


def _with_scratch_allocator(device: torch.device, launch: Callable[[], None]) -> None:
    """Run ``launch``, a kernel launch that builds tensor descriptors on the device (Triton
    writes them to a global scratch buffer it allocates per launch), with an allocator: the
    one the caller set with ``triton.set_allocator`` if any, else a torch one for this launch
    only. Triton keeps its allocator in a ContextVar: it is set and reset around the launch
    (or, should that private variable move, set in a copy of the context), so no other code
    sees it."""
    var = getattr(importlib.import_module("triton.runtime._allocation"), "_allocator", None)
    if var is None:
        def run() -> None:
            triton.set_allocator(_torch_scratch(device))
            launch()

        contextvars.copy_context().run(run)
        return
    if type(var.get()).__name__ != "NullAllocator":  # the caller's allocator
        launch()
        return
    token = var.set(_torch_scratch(device))
    try:
        launch()
    finally:
        var.reset(token)


def _launch_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | float | None,
    num_splits: int,
    config: LaunchConfig,
) -> None:
    """MLA decode: one program per (head group of ``config.block_h`` heads, KV split,
    request), head group fastest so the programs that read the same latents run side by side
    (L2). Each streams ``config.block_n`` latents a step, read once: scores against the whole
    head group with ``tl.dot`` (``[block_h, kv_lora_rank] x [kv_lora_rank, block_n]`` plus the
    rope part), online softmax in float32 with ``exp2``, and the same tile as the value
    (``acc += p x latent``). With splits, each split's normalised output and base-2 LSE go to
    ``partials`` (``(batch, heads, splits, kv_lora_rank)`` float32 or 16-bit, ``(batch, heads,
    splits)`` float32: :func:`decode_partials`, :func:`split_rows`) and
    :func:`_merge_splits_kernel` reduces them. ``kv_cache`` is 3-dim ``(num_pages, page_size,
    kv_lora_rank + rope)`` of any strides; ``q`` ``(batch, heads, kv_lora_rank + rope)``;
    k_scale is used for fp8 caches."""
    batch, num_heads, k_dim = q.shape
    if batch == 0:
        return
    seq_lens = seq_lens.contiguous()  # read densely (see _launch)
    part, part_lse = partials if num_splits > 1 else (None, None)
    if config.gluon:
        reason = gluon_available()
        if reason is not None:
            raise ValueError(reason)
        from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode

        gluon_mla_decode(q, kv_cache, kv_lora_rank, seq_lens, block_table, scale, out, lse,
                         num_splits, part, part_lse)
        return
    page_size = kv_cache.shape[1]
    pe_dim = k_dim - kv_lora_rank
    fp8 = kv_cache.dtype in FP8_DTYPES
    ks = scale_arg(k_scale if fp8 else None, q.device)
    num_head_blocks = -(-num_heads // config.block_h)
    split = num_splits > 1
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0)
    part_strides = part.stride() if split else (0, 0, 0, 0)
    part_lse_strides = part_lse.stride() if split else (0, 0, 0)
    if not split:
        part = part_lse = out
    block_d = max(16, next_power_of_2(kv_lora_rank))
    kv_rows = page_rows = 0
    if config.tma:
        kv_rows, page_rows = _tma_rows(kv_cache, kv_lora_rank, config)
    launch = functools.partial(
        _mla_decode_kernel[(num_head_blocks * num_splits * batch,)],
        q, kv_cache, out, lse_arg, part, part_lse, seq_lens, block_table,
        ks, float(scale) * _LOG2E, num_heads, num_head_blocks, num_splits, kv_rows, page_rows,
        *q.stride(), *kv_cache.stride(), *out.stride(), *lse_strides, *part_strides,
        *part_lse_strides, *block_table.stride(),
        D_NOPE=kv_lora_rank, D_PE=pe_dim, BLOCK_D=block_d,
        BLOCK_PE=max(16, next_power_of_2(max(pe_dim, 1))),
        PAGE_SIZE=page_size, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        SPLIT_LATENT=config.split_latent,
        BLOCK_C=block_d // 2 if config.split_latent else block_d,
        WARP_SPECIALIZE=config.warp_specialize, TMA=config.tma,
        SPLIT_SCORE_KEYS=config.split_score_keys,
        FP8=fp8, SCALE_IS_TENSOR=isinstance(ks, torch.Tensor), SPLIT=split,
        WRITE_LSE=lse is not None, INTERPRET=interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config.tma:
        _with_scratch_allocator(q.device, launch)
    else:
        launch()
    if split:
        _merge_splits(part, part_lse, out, lse, num_splits, block_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    req_to_page: torch.Tensor,
    b_seq_len: torch.Tensor,
    attn_logits: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    page_size: int,
    is_mla: bool = False,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    config: LaunchConfig | None = None,
) -> None:
    """Split-KV decode attention over a paged cache, in place (Triton).

    Args:
        q: ``(batch, num_heads, qk_head_dim)``; request ``i``'s single query, at position
            ``b_seq_len[i] - 1``. fp16/bf16/fp32, any strides.
        k_buffer: ``(num_pages, page_size, num_kv_heads, qk_head_dim)``, or ``(num_pages,
            page_size, qk_head_dim)`` for one KV head (an MLA latent cache), of any strides:
            the page stride ``stride(0)`` may exceed the page size (one layer of a cross-layer
            pool). q's dtype, or fp8 (read as ``stored * k_scale``).
        v_buffer: ``(num_pages, page_size, num_kv_heads, v_head_dim)`` (or 3-dim), any
            strides. With ``is_mla=True`` it must be ``k_buffer[..., :v_head_dim]``: the kernel
            then reads each latent once for keys and values.
        o: ``(batch, num_heads, v_head_dim)`` output, any strides.
        lse: ``(batch, num_heads)`` natural-log log-sum-exp of ``sm_scale * q.k`` per head.
        req_to_page: ``(batch, max_pages)`` int32/int64 page ids (the block table).
        b_seq_len: ``(batch,)`` tokens per request (a request with 0 tokens gets ``o = 0``,
            ``lse = -inf``).
        attn_logits: float32 workspace ``(batch, num_heads, num_kv_splits, v_head_dim + 1)``
            (unused with one split); afterwards it holds each split's normalised output and
            base-2 log-sum-exp.
        num_kv_splits: parts each request's keys are cut into (1..:data:`MAX_KV_SPLITS`).
        sm_scale: softmax scale.
        page_size: tokens per page; must equal ``k_buffer.shape[1]``.
        is_mla: MLA mode (one latent: keys = all channels, values = the first ``v_head_dim``).
        k_scale, v_scale: fp8 per-tensor scales (1-element tensors or floats).
        config: launch override (tuning, benchmarks); otherwise :func:`mla_decode_config`
            for an MLA cache of one latent per token, :func:`default_config` for the rest.
    """
    k_buffer, v_buffer = validate_decode_attention(
        q, k_buffer, v_buffer, o, lse, req_to_page, b_seq_len, attn_logits, num_kv_splits,
        sm_scale, page_size, is_mla, k_scale, v_scale)
    if num_kv_splits > MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits={num_kv_splits} exceeds {MAX_KV_SPLITS}")
    if q.dtype == torch.float64:
        raise TypeError("q has dtype float64; the Triton kernels take fp16/bf16/fp32 "
                        "(use kvcore_mla.ops.reference.decode_attention_ref)")
    mla = is_mla and k_buffer.shape[2] == 1  # one latent per token: the MLA decode kernel
    if mla:
        cfg = config or _table_config(q, k_buffer[:, :, 0], v_buffer.shape[3])
    else:
        cfg = config or default_config(q.shape[1], k_buffer.shape[2],
                                       v_buffer.shape[3] if is_mla else k_buffer.shape[3],
                                       decode=True)
    if cfg.block_q != 1:
        raise ValueError(f"config.block_q={cfg.block_q}; decode runs one query per program (1)")
    if mla:
        _launch_mla_decode(q, k_buffer[:, :, 0], v_buffer.shape[3], o, lse,
                           split_rows(attn_logits, v_buffer.shape[3]), b_seq_len, req_to_page,
                           sm_scale, k_scale, num_kv_splits, cfg)
        return
    _launch(q, k_buffer, v_buffer, o, lse, attn_logits, None, b_seq_len, req_to_page,
            sm_scale, k_scale, v_scale, num_kv_splits, is_mla, cfg)


def mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    kv_lora_rank: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    output: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    config: LaunchConfig | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent-space MLA attention for a batch mixing prefill and decode requests (Triton).

    Semantics and shapes are those of :func:`kvcore.ops.mla_attention_ref`:
    ``q`` ``(num_tokens, num_heads, kv_lora_rank + rope_dim)`` (absorbed ``W_UK^T q_nope``,
    then ``q_pe``); ``kv_cache`` ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` of any
    strides; causal; returns ``(num_tokens, num_heads, kv_lora_rank)`` (``output`` if given).

    Args:
        max_query_len: host-side maximum query length; when it is 1 and every request has one
            token the batch takes the decode path (one query per program, split-KV).
        max_seq_len: host-side bound on ``seq_lens`` for the split heuristic (default
            ``block_table.shape[1] * block_size``).
        num_kv_splits: force the number of splits (decode and prefill); ``None``:
            :func:`mla_decode_num_splits` on the decode path, 1 otherwise.
        config: launch override; otherwise :func:`mla_decode_config` (the GPU's row of
            :data:`MLA_DECODE_CONFIGS`) on the decode path, :func:`default_config` for mixed
            batches.
        workspace: float32 split-KV workspace, contiguous, on ``q``'s device, with at least
            :func:`mla_workspace_numel` elements (a builder owns it, so a step allocates
            nothing and can be captured in a CUDA graph); ``None`` allocates per call.
    """
    validate_mla_attention(q, kv_cache, kv_lora_rank, query_start_loc, seq_lens, block_table,
                           scale, kv_cache_dtype, k_scale, output)
    if q.dtype == torch.float64:
        raise TypeError("q has dtype float64; the Triton kernels take fp16/bf16/fp32 "
                        "(use kvcore.ops.mla_attention_ref)")
    if num_kv_splits is not None and not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be in 1..{MAX_KV_SPLITS} or None")
    num_tokens, num_heads, _ = q.shape
    num_seqs = seq_lens.shape[0]
    out = output if output is not None else torch.empty(
        num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    decode = max_query_len == 1 and num_tokens == num_seqs
    if decode:
        cfg = config or _table_config(q, kv_cache, kv_lora_rank)
    else:
        cfg = config or default_config(num_heads, 1, kv_lora_rank, decode=False)
    if decode and cfg.block_q != 1:
        raise ValueError(f"config.block_q={cfg.block_q}; a decode batch needs 1")
    if num_kv_splits is None:
        num_kv_splits = 1
        if decode:
            bound = max_seq_len if max_seq_len is not None else (
                block_table.shape[1] * kv_cache.shape[1])
            num_kv_splits = mla_decode_num_splits(num_seqs, num_heads, bound, cfg,
                                                  _num_sms(q.device))
    if num_kv_splits > 1:
        needed = mla_workspace_numel(num_tokens, num_heads, kv_lora_rank, num_kv_splits)
        if workspace is None:
            workspace = torch.empty(needed, dtype=torch.float32, device=q.device)
        else:
            if not isinstance(workspace, torch.Tensor):
                raise TypeError(f"workspace must be a tensor, got {type(workspace).__name__}")
            if (workspace.dtype != torch.float32 or workspace.device != q.device
                    or not workspace.is_contiguous()):
                raise ValueError(f"workspace must be a contiguous float32 tensor on {q.device}, "
                                 f"got {workspace.dtype} on {workspace.device} (contiguous: "
                                 f"{workspace.is_contiguous()})")
            if workspace.numel() < needed:
                raise ValueError(f"workspace has {workspace.numel()} elements but this call's "
                                 f"split-KV path needs {needed} (see mla_workspace_numel)")
        workspace = workspace.reshape(-1)
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    scale_used = k_scale if fp8 else None
    if decode:
        partials = None
        if num_kv_splits > 1:
            partials = decode_partials(workspace, num_tokens, num_heads, kv_lora_rank,
                                       num_kv_splits, q.dtype)
        _launch_mla_decode(q, kv_cache, kv_lora_rank, out, None, partials, seq_lens,
                           block_table, scale, scale_used, num_kv_splits, cfg)
        return out
    part = None
    if num_kv_splits > 1:  # the mixed kernel's rows: output then base-2 LSE, float32
        padded = (num_tokens, num_heads, num_kv_splits, _part_row(kv_lora_rank))
        part = workspace[:math.prod(padded)].view(padded)[..., :kv_lora_rank + 1]
    k_cache = kv_cache.unsqueeze(2)
    _launch(q, k_cache, k_cache[..., :kv_lora_rank], out, None, part,
            query_start_loc, seq_lens, block_table, scale,
            scale_used, scale_used, num_kv_splits, True, cfg)
    return out


def mla_workspace_numel(num_tokens: int, num_heads: int, kv_lora_rank: int,
                        num_kv_splits: int) -> int:
    """float32 elements of :func:`mla_attention`'s split-KV workspace (0 without splits):
    room for either layout it takes. Mixed batches: each split's normalised output and
    log-sum-exp, ``(num_tokens, num_heads, num_kv_splits, kv_lora_rank + 1)``, rows padded to
    a multiple of 16 elements. Decode: :func:`decode_partials` (the log-sum-exps, then the
    outputs in the query's 16-bit dtype or float32, rows padded to 64 bytes)."""
    if num_kv_splits <= 1:
        return 0
    rows = num_tokens * num_heads * num_kv_splits
    return -(-rows // 16) * 16 + rows * _part_row(kv_lora_rank)


def _part_row(kv_lora_rank: int) -> int:
    """float32 elements a workspace row takes: ``kv_lora_rank + 1`` rounded up to a multiple
    of 16, so every row starts 64-byte aligned and Triton (which specialises integer arguments
    divisible by 16) can store partial outputs 16 bytes at a time."""
    return -(-(kv_lora_rank + 1) // 16) * 16
