"""Triton paged attention for batches that mix prefill (with a cached prefix) and decode.

:func:`paged_attention` computes exactly :func:`kvcore.ops.reference.paged_attention_ref` (see
that module for the conventions: query positions, causal mask, sliding window, fp8 scales).

Kernel structure
----------------
Two kernels share one tiling: ``_paged_attention_kernel`` runs decode-only batches (and any
batch with split-KV), ``_prefill_attention_kernel`` every other batch (prefill, chunked
prefill, mixed); :func:`default_config` picks one (``AttentionConfig.prefill``). A program
owns one *query tile* of one request and one KV head: ``BLOCK_Q`` consecutive query tokens times the
``num_heads // num_kv_heads`` query heads that share the KV head (padded to ``G_PAD``), i.e.
``BLOCK_M = BLOCK_Q * G_PAD`` rows. It streams the request's keys in tiles of ``BLOCK_N``
tokens gathered through the block table (each token's page looked up on its own, so a tile
may span pages and block ids are arbitrary), so every K/V byte is read once per
(request, KV head, query tile). The page ids of the next tile are loaded one iteration ahead,
so the K/V loads of a tile depend only on loop-carried values and Triton's pipeliner keeps
``num_stages - 1`` tiles in flight (with the lookup in the same iteration it kept one). Tiles
entirely before the sliding window or after the last query's position (causal) are never
visited. Programs find their request by a binary search
over ``query_start_loc``, so the grid needs no host-side metadata and no device sync.

Prefill kernel
--------------
The same program tile, with the key loop cut in up to three loops (``_prefill_tiles``): key
tiles every query of the query tile sees (after the window's lower edge of its last query, up
to its first query's position) run with no mask, no load guard and the softmax scale folded
into one multiply-add before ``exp2``; only the tiles on the causal diagonal, on the window's
lower edge and past the last key mask scores and loads. The dots take bf16/fp16 operands and
accumulate in fp32 (``tl.dot(p, v, acc)``). Programs run last query tile first, so the
longest causal tiles start first and the short ones fill the last wave. Tiles per GPU come
from :data:`PREFILL_TILES`, a fixed table (no autotuning inside a step or a graph capture)
filled from ``benchmarks/bench_triton_prefill.py`` sweeps.

Split-KV decode
---------------
With ``num_splits > 1`` the key range of every (query tile, KV head) is cut into
``num_splits`` contiguous parts processed by separate programs, each writing a normalised
partial output and its log-sum-exp (base 2) to a float32 workspace; ``_reduce_splits_kernel``
then merges them. Each request is split by its *own* length, read on the device.

Heuristic (:func:`default_config`, when ``num_kv_splits`` is not given): split only batches
that are decode-only (``num_tokens == num_seqs``) and whose ``num_seqs * num_kv_heads``
programs are fewer than ``split_waves`` per SM; then use
``floor(split_waves * num_sms / (num_seqs * num_kv_heads))`` splits, i.e. as many as keep the
grid at or just under ``split_waves`` programs per SM, at most one per ``min_split_tokens``
(512) tokens of the longest possible sequence (``block_table.shape[1] * block_size``, known
without a sync) and at most ``_MAX_SPLITS``. The waves, and the keys per step of a split
launch, are per-GPU rows of :data:`DECODE_TILES`: 4 waves of 32-key programs by default; on
sm90 2 waves of 64-key programs. On the H200 (132 SMs, Hk=8) that gives 1 split at 64 x 4096
and 256 x 1024, 4 at 8 x 32768 and 2 at 16 x 4096, the fastest of the swept (tile, splits)
pairs at each of those shapes (``benchmarks/RESULTS.md``).

Kernel variants
---------------
Both kernels share their prologue (:func:`~kvcore.ops.triton_utils.locate_query_tile`,
:func:`_load_query_tile`) and page lookup (:func:`_page_ids`, :func:`_in_page`).
``AttentionConfig.const_block`` compiles the block size in (shifts instead of integer
divisions per key row); the prefill kernel can also
pipeline its masked edge loops at their own depth (``edge_stages``) and warp-specialise its
unmasked loop (``warp_specialize``, where Triton has it). They change speed only, never the
result; the tables say which ones a GPU uses. On Hopper, ``AttentionConfig.gluon`` runs the
prefill tile in a kernel written in Gluon instead (:mod:`kvcore.ops.gluon_prefill`: its
softmax overlaps the tensor cores, which no Triton-level schedule does), taken by
:func:`default_config` where :data:`GLUON_PREFILL_TILES` has a row (sm90: the
warp-specialised Gluon kernel with ping-pong).

Masking: K/V loads are masked beyond each query tile's last visible key, so no byte outside
a request's first ``seq_len`` tokens (the tail of its last block, other blocks) is read; masked
scores are set to ``-inf`` with ``where``, so a NaN *key* after a query changes nothing. A
NaN/Inf *value* after a query, within the key tile (``BLOCK_N`` keys) a query tile visits,
does reach that tile's earlier queries (``0 * NaN`` in the ``p @ V`` product; docs/faults.md).

All address arithmetic is int64. ``tl.make_block_ptr`` is not used (removed in triton 3.9);
under ``TRITON_INTERPRET=1`` tiles are cast to float32 before ``tl.dot`` (the interpreter
mishandles bf16 dots), on the GPU the dots run in the input dtype; the interpreter also
truncates float32 to bf16, so there outputs are rounded to nearest even first, as a GPU does
(:func:`_to_output`).

This module imports triton at import time; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_utils import (
    gluon_defaults_enabled,
    gluon_kernels_unavailable,
    interpreting,
    load_kv_scales,
    locate_query_tile,
    next_power_of_2,
    prefill_key_tiles,
    recording_launches,
    scale_args,
)
from kvcore.ops.validation import FP8_KV_CACHE_DTYPES, validate_paged_attention

__all__ = [
    "MAX_HEAD_SIZE",
    "SUPPORTED_QUERY_DTYPES",
    "AttentionConfig",
    "DECODE_TILES",
    "DecodeTile",
    "GLUON_PREFILL_TILES",
    "PREFILL_TILES",
    "PrefillTile",
    "call_config",
    "default_config",
    "decode_tile",
    "default_num_kv_splits",
    "device_arch",
    "gluon_prefill_available",
    "gluon_prefill_unmet",
    "paged_attention",
    "prefill_tile",
    "warp_specialize_supported",
    "workspace_numel",
]

#: Largest head size the kernel supports (any size up to it; non-powers of two are masked).
MAX_HEAD_SIZE = 256
#: Query / output dtypes of the Triton path.
SUPPORTED_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of one paged-attention call.

    ``block_q`` query tokens x ``g_pad`` query heads form one program's rows; ``block_n`` keys
    per loop step; ``num_splits`` > 1 selects the split-KV path. ``prefill`` selects the
    prefill kernel (key loop split into unmasked tiles and masked edges; no split-KV).

    Kernel variants (all compute the same result): ``const_block`` compiles the cache's block
    size into the kernel (page lookups by shifts, not integer divisions; one compiled kernel
    per block size). Prefill kernel only: ``edge_stages`` > 0 pipelines the masked edge loops
    (causal diagonal, window edge) that deep instead of ``num_stages``, and
    ``warp_specialize`` asks Triton to warp-specialise the unmasked key loop (needs a Triton
    whose ``tl.range`` takes ``warp_specialize``: :func:`warp_specialize_supported`).
    ``gluon`` runs the Hopper prefill kernel written in Gluon instead
    (:mod:`kvcore.ops.gluon_prefill`: softmax overlapped with the tensor cores); it takes
    128 rows, 8 warps, ``block_n`` 64 or 128, 2 to 4 ``num_stages`` (as shared memory allows)
    and always compiles the block size in (``const_block=True``), and runs where
    :func:`gluon_prefill_unmet` finds nothing unmet. With ``warp_specialize`` as well, its
    warp-specialised variant runs: the 8 warps are two consumer warpgroups (64 rows each), and
    a third warpgroup issues the K/V copies; ``pingpong`` (that kernel only) has its two
    consumer warpgroups take turns issuing their matrix products, so one's softmax overlaps
    the other's products (FlashAttention-3's schedule; on the H200 up to 3% faster at 128
    keys, slower at 64).
    """

    block_q: int
    g_pad: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    prefill: bool = False
    const_block: bool = False
    edge_stages: int = 0
    warp_specialize: bool = False
    gluon: bool = False
    pingpong: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillTile:
    """One entry of :data:`PREFILL_TILES`: ``rows`` = query tokens x padded GQA group per
    program, ``block_n`` keys per step, the launch's warps and pipeline stages, and the
    kernel variants of :class:`AttentionConfig` (``const_block``, ``edge_stages``,
    ``warp_specialize``, ``gluon``, ``pingpong``)."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int
    const_block: bool = False
    edge_stages: int = 0
    warp_specialize: bool = False
    gluon: bool = False
    pingpong: bool = False


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """One entry of :data:`DECODE_TILES`: the decode kernel's keys per step, warps, stages
    and ``const_block`` variant, and the split-KV heuristic's parameters: split while the grid
    has fewer than ``split_waves`` programs per SM, at most one split per
    ``min_split_tokens`` tokens (module docstring). ``split_block_n``: keys per step of a
    launch that splits (``None``: ``block_n``); with longer steps each split program keeps
    more bytes in flight, so fewer splits (a lower ``split_waves``) fill the GPU."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    const_block: bool = False
    split_waves: int = 4
    min_split_tokens: int = 512
    split_block_n: int | None = None


#: Prefill tiles per GPU architecture (``sm90``, ``gfx942``, ... as :func:`device_arch` names
#: them; ``cuda`` and ``rocm`` for the others), for head sizes up to 128 and above 128. A
#: deterministic table, filled from ``benchmarks/bench_triton_prefill.py`` sweeps (the sweep
#: prints its winner over the three prefill cases as a ``PrefillTile(...)`` to paste), so no
#: autotuning runs inside a step or a CUDA-graph capture. Above head size 128 the tile keeps
#: 64 rows: a 128-row fp32 accumulator of 256 columns spills; so does 128 x 64 with 4 warps on
#: sm80 (``kvcore kernels``), which keeps the 32-key tile.
#: sm90: 256 rows x 32 keys, 8 warps, 3 stages, the block size compiled in and one stage on
#: the masked edge won all three prefill cases of the H200 sweep (benchmarks/RESULTS.md: ahead
#: of the earlier 128 x 32 x 4 x 3 tile, which spills on sm_90a, and of 128 x 64 x 8 warps and
#: warp-specialised loops). sm100 has not been measured: it takes the sm90 row.
PREFILL_TILES: dict[str, tuple[PrefillTile, PrefillTile]] = {
    "sm90": (PrefillTile(256, 32, 8, 3, const_block=True, edge_stages=1),
             PrefillTile(64, 32, 4, 3)),
    "sm100": (PrefillTile(256, 32, 8, 3, const_block=True, edge_stages=1),
              PrefillTile(64, 32, 4, 3)),
    "cuda": (PrefillTile(128, 32, 4, 3), PrefillTile(64, 32, 4, 3)),
    # Two 32-key K/V tiles in flight beside a 64 x 256 query tile take 68 KiB of LDS: more
    # than gfx942's 64 KiB (`kvcore kernels`), so one tile in flight above head_size 128.
    "rocm": (PrefillTile(128, 32, 4, 3), PrefillTile(64, 32, 4, 2)),
}

#: Gluon prefill tiles per GPU architecture (keys as in :data:`PREFILL_TILES`; rows of 128
#: query tokens x padded GQA group, 8 warps, ``gluon=True``): where a row exists,
#: :func:`default_config` picks it for prefill at head sizes 64 and 128, and
#: :func:`paged_attention` falls back to the :data:`PREFILL_TILES` row for any call the Gluon
#: kernel cannot run (:func:`gluon_prefill_unmet`: dtype, fp8 cache, cache alignment, a
#: Triton without Gluon, not a Hopper GPU).
#: sm90: the warp-specialised kernel (two consumer warpgroups taking turns on the tensor
#: cores, a copy warpgroup), 128 keys a step, 3 stages (224 KiB of shared memory). On an H200
#: (benchmarks/RESULTS.md, the Gluon prefill sweep) it took 326.1 / 1021.2 /
#: 1064.6 us on the three prefill cases (FlashInfer direct 305.6 / 1033.7 / 1006.8), against
#: 338.5 / 1081.9 / 1102.0 without ping-pong, the 64-key WS tile's 340.6 / 1144.5 / 1155.5
#: and the Triton row's 453.1 / 1407.2 / 1424.8, same call; two stages and the non-specialised
#: kernel were slower than the Triton row.
GLUON_PREFILL_TILES: dict[str, PrefillTile] = {
    "sm90": PrefillTile(128, 128, 8, 3, const_block=True, warp_specialize=True, gluon=True,
                        pingpong=True),
}

#: Decode tiles and split-KV heuristic per GPU architecture (keys as in
#: :data:`PREFILL_TILES`), filled from the decode sweep of ``benchmarks/bench_triton_prefill.py``.
#: 32 keys per step, 4 warps, 3 stages (2 tiles in flight) was the fastest tile at every
#: decode shape swept on the H200, and 4 waves / 512 tokens per split the fastest split rule;
#: on sm90 the block size compiled in (``const_block``) is 0-2% faster at every shape
#: (benchmarks/RESULTS.md). Launches that split run 64 keys per step at half the splits
#: (2 waves) on sm90: 1.7-1.8% faster than 32 keys at 4 waves at the two split shapes of the
#: sweep (8 x 32768: 4 splits, 16 x 4096: 2), while 32 keys stay fastest unsplit. Above head
#: size 128 on ROCm the decode kernel keeps one tile in flight (LDS, as in
#: :data:`PREFILL_TILES`).
DECODE_TILES: dict[str, DecodeTile] = {
    "sm90": DecodeTile(const_block=True, split_waves=2, split_block_n=64),
    "cuda": DecodeTile(),
    "rocm": DecodeTile(),
}


@functools.cache
def warp_specialize_supported() -> bool:
    """Whether the installed Triton's ``tl.range`` takes ``warp_specialize`` (Triton >= 3.4;
    whether it pays off on a GPU is for the sweep to say)."""
    return "warp_specialize" in inspect.signature(tl.range).parameters


#: Query and cache dtypes of the Gluon prefill kernel, and its head sizes.
_GLUON_DTYPES = (torch.bfloat16, torch.float16)
_GLUON_HEAD_SIZES = (64, 128)
#: Shared memory one program of the Gluon prefill kernel may take (an H100/H200 SM's 227 KiB).
_GLUON_SMEM = 227 * 1024


def gluon_prefill_available() -> str | None:
    """``None`` when the installed Triton can build the Gluon prefill kernel for Hopper
    (:mod:`kvcore.ops.gluon_prefill` imports), else why not, as a sentence."""
    return gluon_kernels_unavailable("kvcore.ops.gluon_prefill")


@functools.cache  # configs are frozen: the answer is one dict lookup after the first call
def _gluon_config_unmet(cfg: AttentionConfig, head_size: int) -> str | None:
    from kvcore.ops.gluon_prefill import BLOCK_M, NUM_WARPS

    if not cfg.prefill or cfg.num_splits != 1:
        return (f"config has gluon=True with prefill={cfg.prefill} and num_splits="
                f"{cfg.num_splits}: the Gluon kernel is a prefill kernel (set prefill=True, "
                "num_splits=1, or gluon=False)")
    if cfg.block_q * cfg.g_pad != BLOCK_M or cfg.num_warps != NUM_WARPS:
        return (f"config has gluon=True with block_q * g_pad = {cfg.block_q * cfg.g_pad} rows "
                f"and num_warps={cfg.num_warps}; the Gluon kernel runs {BLOCK_M} rows with "
                f"{NUM_WARPS} warps (64 rows a warpgroup): set block_q = {BLOCK_M} // g_pad "
                f"and num_warps={NUM_WARPS}")
    if cfg.block_n not in (64, 128) or not 2 <= cfg.num_stages <= 4:
        return (f"config has gluon=True with block_n={cfg.block_n} and num_stages="
                f"{cfg.num_stages}; the Gluon kernel takes block_n 64 or 128 and 2 to 4 "
                "stages: set them in that range, or use gluon=False")
    if cfg.pingpong and not cfg.warp_specialize:
        return ("config has gluon=True and pingpong=True with warp_specialize=False; only the "
                "warp-specialised Gluon kernel has consumers to take turns: set "
                "warp_specialize=True or pingpong=False")
    if not cfg.const_block or cfg.edge_stages:
        return (f"config has gluon=True with const_block={cfg.const_block} and edge_stages="
                f"{cfg.edge_stages}; the Gluon kernel always compiles the block size in and "
                "has no masked-edge pipeline: set const_block=True and edge_stages=0")
    # Stages, query tile, and room for the mbarriers (288 bytes compiled). Nothing else: the
    # warp-specialised kernel stages its output through the query tile, and the plain
    # kernel's output conversion reuses the stages, free by then (the slow sm90 compile test
    # checks this bound against what the compiler allocated).
    smem = (2 * cfg.num_stages * cfg.block_n + BLOCK_M) * head_size * 2 + 1024
    if smem > _GLUON_SMEM:
        return (f"config has gluon=True with block_n={cfg.block_n} and num_stages="
                f"{cfg.num_stages}: at head_size {head_size} its K/V stages, query tile and "
                f"barriers take {smem} bytes of shared memory, "
                f"more than the {_GLUON_SMEM} an SM has; use fewer stages or block_n=64")
    return None


def gluon_prefill_unmet(query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, kv_cache_dtype: str,
                        config: AttentionConfig) -> str | None:
    """Why the Gluon prefill kernel (``config.gluon``) cannot run this call, as a sentence
    naming the unmet condition and the fix; ``None`` when it can: Triton has Gluon's Hopper
    API; ``config`` is one of its tiles (:class:`AttentionConfig`); the query bf16 or fp16
    with a cache of the same dtype (no fp8); ``head_size`` 64 or 128; both caches with
    contiguous channels and 16-byte aligned base and strides (``cp.async`` copies 16 bytes);
    the tensors on a GPU of compute capability 9.x. The device is not checked while launches
    are recorded for an ahead-of-time compile (:func:`kvcore.ops.triton_utils.
    recording_launches`)."""
    reason = gluon_prefill_available()
    if reason is not None:
        return reason
    head_size = query.shape[-1]
    reason = _gluon_config_unmet(config, head_size)
    if reason is not None:
        return reason
    if (query.dtype not in _GLUON_DTYPES or key_cache.dtype != query.dtype
            or value_cache.dtype != query.dtype or kv_cache_dtype != "auto"):
        return (f"config.gluon=True takes bf16 or fp16 queries and caches of the same dtype "
                f"(kv_cache_dtype='auto'); got query {query.dtype}, key_cache "
                f"{key_cache.dtype}, value_cache {value_cache.dtype}, kv_cache_dtype="
                f"{kv_cache_dtype!r}: use gluon=False")
    if head_size not in _GLUON_HEAD_SIZES:
        return (f"config.gluon=True takes head_size 64 or 128; it is {head_size}: use "
                "gluon=False")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        reason = _gluon_cache_unmet(name, cache)
        if reason is not None:
            return reason
    device = query.device
    if recording_launches():  # compiled ahead of time for a target: no device to check
        return None
    if interpreting():
        return ("config.gluon=True cannot run under TRITON_INTERPRET=1 (Gluon kernels have no "
                "interpreter): unset it on a Hopper GPU, or use gluon=False")
    if device.type != "cuda" or not _is_hopper(
            device.index if device.index is not None else torch.cuda.current_device()):
        return (f"config.gluon=True runs on NVIDIA Hopper GPUs (compute capability 9.x); the "
                f"query is on {device} ({device_arch(device)}): use gluon=False")
    return None


def _gluon_cache_unmet(name: str, cache: torch.Tensor) -> str | None:
    """Why ``cache`` cannot feed the Gluon kernel's 16-byte copies, or ``None``. It runs once
    per call and layer, so the messages are built only on a refusal."""
    item = cache.element_size()
    if cache.stride(3) != 1:
        return (f"{name} has channel stride {cache.stride(3)}; config.gluon=True copies "
                "16 contiguous bytes at a time: pass a cache whose last dim is contiguous, "
                "or use gluon=False")
    strides = cache.stride()
    if cache.data_ptr() % 16 == 0 and all(strides[dim] * item % 16 == 0 for dim in range(3)):
        return None
    unaligned = [what for what, nbytes in (
        (f"base address {cache.data_ptr():#x}", cache.data_ptr()),
        *((f"stride({dim}) ({strides[dim]} x {item} bytes)", strides[dim] * item)
          for dim in range(3)),
    ) if nbytes % 16]
    return (f"{name}'s {' and '.join(unaligned)} is not a multiple of 16 bytes, as "
            "config.gluon=True's 16-byte copies need: use a 16-byte aligned cache, "
            "or gluon=False")


@functools.cache
def _is_hopper(cuda_index: int) -> bool:
    """Whether CUDA device ``cuda_index`` is an NVIDIA GPU of compute capability 9.x (cached
    per device)."""
    return (not getattr(torch.version, "hip", None)
            and torch.cuda.get_device_capability(cuda_index)[0] == 9)


@triton.jit
def _to_output(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with float32 -> bf16 rounded to nearest even under the interpreter too
    (it truncates, a bias of half a bf16 step that the conformance suite's bound sees)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)  # the truncation below then rounds to even
            # Zeros and subnormals keep their value (a biased zero would be a subnormal).
            x = tl.where(tl.abs(x) < 1.1754943508222875e-38, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def _load_query_tile(
    q_ptr, seq_lens_ptr, seq, q_start, q_len, q_tile, kv_head, num_queries_per_kv, head_size,
    stride_qt, stride_qh, stride_qd,
    INTERPRET: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The program's rows (``BLOCK_Q`` tokens x ``G_PAD`` query heads of ``kv_head``) and its
    query tile: ``(q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q,
    last_q)``, positions counted in the request's keys."""
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    row_valid = (q_idx < q_len) & (g < num_queries_per_kv)
    head = (kv_head * num_queries_per_kv + g).to(tl.int64)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dims64 = dims.to(tl.int64)
    d_valid = dims < head_size
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + dims64[None, :] * stride_qd,
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    first_q = context_len + q_tile * BLOCK_Q
    last_q = context_len + tl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q) - 1
    return q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q, last_q


@triton.jit
def _page_ids(bt_row, k_pos, kv_end, block_size, stride_btb, PAGE: tl.constexpr):
    """Block ids of key positions ``k_pos`` (0 past ``kv_end``, never read). ``PAGE`` > 0 is
    the block size as a compile-time constant (shifts instead of integer divisions)."""
    if PAGE > 0:
        idx = k_pos // PAGE
    else:
        idx = k_pos // block_size
    return tl.load(bt_row + idx * stride_btb, mask=k_pos < kv_end, other=0)


@triton.jit
def _in_page(k_pos, block_size, PAGE: tl.constexpr):
    """int64 slots of key positions ``k_pos`` in their blocks."""
    if PAGE > 0:
        slot = k_pos % PAGE
    else:
        slot = k_pos % block_size
    return slot.to(tl.int64)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, v_scale, qk_scale,
    num_seqs, num_heads, num_queries_per_kv, block_size, head_size, sliding_window, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_KV: tl.constexpr, PAGE: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq, q_start, q_len, q_tile = locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
        return
    q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q, last_q = \
        _load_query_tile(q_ptr, seq_lens_ptr, seq, q_start, q_len, q_tile, kv_head,
                         num_queries_per_kv, head_size, stride_qt, stride_qh, stride_qd,
                         INTERPRET=INTERPRET, BLOCK_Q=BLOCK_Q, G_PAD=G_PAD, BLOCK_D=BLOCK_D)

    # Keys this tile can see: up to its last query (causal) or its window's end (non-causal
    # windows are symmetric), and from its first query's window.
    if CAUSAL:
        kv_end = last_q + 1
    elif USE_WINDOW:
        kv_end = last_q + tl.minimum(seq_len - last_q, sliding_window)
    else:
        kv_end = seq_len
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(first_q - sliding_window + 1, 0) // BLOCK_N
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT_KV:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR)
        qk_scale = qk_scale * ks

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bts
    kv_head64 = kv_head.to(tl.int64)
    # Page ids are fetched one tile ahead and carried, so the K/V addresses of a tile do not
    # wait on a load issued in the same iteration and the K/V loads can be pipelined deeper.
    offs_n = tl.arange(0, BLOCK_N)
    page = _page_ids(bt_row, tile_lo * BLOCK_N + offs_n, kv_end, block_size, stride_btb, PAGE)
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + offs_n
        k_valid = k_pos < kv_end
        page64 = page.to(tl.int64)
        page = _page_ids(bt_row, k_pos + BLOCK_N, kv_end, block_size, stride_btb, PAGE)
        in_page = _in_page(k_pos, block_size, PAGE)
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + (page64 * stride_kb + in_page * stride_ks
                                   + kv_head64 * stride_kh)[:, None]
                    + dims64[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (page64 * stride_vb + in_page * stride_vs
                                   + kv_head64 * stride_vh)[:, None]
                    + dims64[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)  # fp8 -> model dtype is exact; the scale is applied outside
            v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        mask = row_valid[:, None] & k_valid[None, :]
        if CAUSAL:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
            if not CAUSAL:
                mask &= (k_pos[None, :] - q_pos[:, None]) < sliding_window
        s = tl.where(mask, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * vs
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if not SPLIT_KV:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims64[None, :] * stride_od,
                 _to_output(out, out_ptr.dtype.element_ty, INTERPRET), mask=store_mask)
    else:
        # Workspace (num_tokens, num_heads, num_splits, head_size), contiguous float32.
        part = (token * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * head_size + dims64[None, :], out,
                 mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _prefill_step(
    acc, l_i, m_i, page, t, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
    d_valid, kv_end, block_size, sliding_window, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):
    """Key tile ``t`` of one query tile (its block ids ``page``); returns the updated state
    and the next tile's block ids."""
    k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    page64 = page.to(tl.int64)
    # The next tile's page ids, carried: the K/V addresses below depend only on loop-carried
    # values, so the pipeliner keeps num_stages - 1 tiles in flight.
    page = _page_ids(bt_row, k_pos + BLOCK_N, kv_end, block_size, stride_btb, PAGE)
    in_page = _in_page(k_pos, block_size, PAGE)
    k_ptrs = (k_cache_ptr + (page64 * stride_kb + in_page * stride_ks
                             + kv_head64 * stride_kh)[:, None] + dims64[None, :] * stride_kd)
    v_ptrs = (v_cache_ptr + (page64 * stride_vb + in_page * stride_vs
                             + kv_head64 * stride_vh)[:, None] + dims64[None, :] * stride_vd)
    if MASKED:
        k_valid = k_pos < kv_end
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)  # fp8 -> model dtype is exact; the scale is applied outside
        v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        mask = k_valid[None, :]
        if CAUSAL:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
            if not CAUSAL:
                mask &= (k_pos[None, :] - q_pos[:, None]) < sliding_window
        s = tl.where(mask, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
    else:
        # qk_scale > 0 (validated), so the row maximum of the scaled scores is the scaled
        # maximum, and the scale folds into one multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new, page


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64, d_valid,
    lo, hi, kv_end, block_size, sliding_window, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Key tiles ``lo <= t < hi`` of one query tile. ``MASKED=False`` tiles are entirely
    visible to every query of the tile (no mask, no load guard); ``MASKED`` ones (the causal
    diagonal, the window's lower edge, the tail past ``kv_end``) mask scores and loads.
    ``STAGES`` > 0 pipelines this loop that deep instead of the launch's ``num_stages``;
    ``WARP_SPECIALIZE`` asks Triton for producer/consumer warps (Hopper and later)."""
    page = _page_ids(bt_row, lo * BLOCK_N + tl.arange(0, BLOCK_N), kv_end, block_size,
                     stride_btb, PAGE)
    if WARP_SPECIALIZE:
        for t in tl.range(lo, hi, warp_specialize=True):
            acc, l_i, m_i, page = _prefill_step(
                acc, l_i, m_i, page, t, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64,
                dims64, d_valid, kv_end, block_size, sliding_window, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
                MASKED=MASKED, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, EVEN_D=EVEN_D,
                INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, PAGE=PAGE)
    elif STAGES > 0:
        for t in tl.range(lo, hi, num_stages=STAGES):
            acc, l_i, m_i, page = _prefill_step(
                acc, l_i, m_i, page, t, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64,
                dims64, d_valid, kv_end, block_size, sliding_window, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
                MASKED=MASKED, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, EVEN_D=EVEN_D,
                INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, PAGE=PAGE)
    else:
        for t in range(lo, hi):
            acc, l_i, m_i, page = _prefill_step(
                acc, l_i, m_i, page, t, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64,
                dims64, d_valid, kv_end, block_size, sliding_window, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
                MASKED=MASKED, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW, EVEN_D=EVEN_D,
                INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, PAGE=PAGE)
    return acc, l_i, m_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    k_scale, v_scale, qk_scale,
    num_seqs, num_queries_per_kv, block_size, head_size, sliding_window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, PAGE: tl.constexpr, EDGE_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    # Last tiles first: under a causal mask they have the most keys, and the short ones then
    # fill the last wave.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    seq, q_start, q_len, q_tile = locate_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:  # past the last tile of the batch, or an empty request
        return
    q, q_pos, token, head, row_valid, dims64, d_valid, seq_len, first_q, last_q = \
        _load_query_tile(q_ptr, seq_lens_ptr, seq, q_start, q_len, q_tile, kv_head,
                         num_queries_per_kv, head_size, stride_qt, stride_qh, stride_qd,
                         INTERPRET=INTERPRET, BLOCK_Q=BLOCK_Q, G_PAD=G_PAD, BLOCK_D=BLOCK_D)

    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR)
        qk_scale = qk_scale * ks

    kv_end, lo, hi, full_lo, full_hi = prefill_key_tiles(
        first_q, last_q, seq_len, sliding_window, CAUSAL, USE_WINDOW, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bts
    kv_head64 = kv_head.to(tl.int64)
    if USE_WINDOW:
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
            d_valid, lo, full_lo, kv_end, block_size, sliding_window, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, stride_btb, MASKED=True, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
            EVEN_D=EVEN_D, INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
            PAGE=PAGE, STAGES=EDGE_STAGES, WARP_SPECIALIZE=False)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
        d_valid, full_lo, full_hi, kv_end, block_size, sliding_window, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
        stride_vd, stride_btb, MASKED=False, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        EVEN_D=EVEN_D, INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        PAGE=PAGE, STAGES=0, WARP_SPECIALIZE=WARP_SPECIALIZE)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head64, dims64,
        d_valid, full_hi, hi, kv_end, block_size, sliding_window, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
        stride_vd, stride_btb, MASKED=True, CAUSAL=CAUSAL, USE_WINDOW=USE_WINDOW,
        EVEN_D=EVEN_D, INTERPRET=INTERPRET, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        PAGE=PAGE, STAGES=EDGE_STAGES, WARP_SPECIALIZE=False)

    if FP8:
        acc = acc * vs
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
             + dims64[None, :] * stride_od,
             _to_output(out, out_ptr.dtype.element_ty, INTERPRET),
             mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_heads, head_size, num_splits,
    stride_ot, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    s_valid = splits < num_splits
    part = (token * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=s_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(part_out_ptr + part[:, None] * head_size + dims[None, :],
                mask=s_valid[:, None] & (dims[None, :] < head_size), other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
             _to_output(out, out_ptr.dtype.element_ty, INTERPRET), mask=dims < head_size)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def default_num_kv_splits(num_tokens: int, num_seqs: int, num_kv_heads: int,
                          max_seq_len_bound: int, device: torch.device, *,
                          num_sms: int | None = None, arch: str | None = None,
                          rocm: bool | None = None) -> int:
    """The split-KV heuristic of the module docstring: 1 unless the batch is decode-only and
    too small to fill the GPU; ``max_seq_len_bound`` bounds every request's length and
    ``num_sms`` (default: ``device``'s SM count) sets the target; the waves and tokens per
    split come from the :func:`decode_tile` of ``arch`` (default: :func:`device_arch`).

    The result depends only on its arguments, so a builder that passes a fixed bound (e.g.
    ``max_model_len``) gets a choice that is stable for a batch size (CUDA-graph replays).
    """
    rule = decode_tile(arch or device_arch(device), _is_rocm(rocm))
    work = num_seqs * num_kv_heads
    target = rule.split_waves * (num_sms or _num_sms(device))
    if num_tokens != num_seqs or work == 0 or work >= target:
        return 1
    by_length = max(1, max_seq_len_bound // rule.min_split_tokens)
    return max(1, min(target // work, by_length, _MAX_SPLITS))


def workspace_numel(num_tokens: int, num_heads: int, head_size: int,
                    num_kv_splits: int) -> tuple[int, int]:
    """Elements of the two float32 split-KV workspaces :func:`paged_attention` needs: partial
    outputs ``(num_tokens, num_heads, num_kv_splits, head_size)`` and their log-sum-exps
    ``(num_tokens, num_heads, num_kv_splits)`` (0 without splits)."""
    if num_kv_splits <= 1:
        return 0, 0
    lse = num_tokens * num_heads * num_kv_splits
    return lse * head_size, lse


def device_arch(device: torch.device) -> str:
    """The key of :data:`PREFILL_TILES` for ``device``: ``sm<major><minor>`` on NVIDIA, the
    gfx name on AMD (``gfx942``), ``cpu`` otherwise."""
    return _device_arch(device.type, device.index)


@functools.cache
def _device_arch(device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(index or 0)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def _is_rocm(rocm: bool | None) -> bool:
    return getattr(torch.version, "hip", None) is not None if rocm is None else rocm


def prefill_tile(head_size: int, arch: str, rocm: bool) -> PrefillTile:
    """The :data:`PREFILL_TILES` entry for ``arch`` (the platform's default when the table
    has no row for it)."""
    row = PREFILL_TILES.get(arch) or PREFILL_TILES["rocm" if rocm else "cuda"]
    return row[0] if head_size <= 128 else row[1]


def decode_tile(arch: str, rocm: bool) -> DecodeTile:
    """The :data:`DECODE_TILES` entry for ``arch`` (the platform's default when the table has
    no row for it)."""
    return DECODE_TILES.get(arch) or DECODE_TILES["rocm" if rocm else "cuda"]


def default_config(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_seq_len_bound: int,
    device: torch.device,
    num_kv_splits: int | None = None,
    *,
    num_sms: int | None = None,
    rocm: bool | None = None,
    arch: str | None = None,
    gluon: bool = True,
) -> AttentionConfig:
    """The launch configuration :func:`paged_attention` uses (see the module docstring).

    Decode-only batches (``num_tokens == num_seqs``) and forced splits run the decode kernel;
    other batches the prefill kernel with the :func:`prefill_tile` of the GPU, or, when
    ``gluon`` and the GPU has a :data:`GLUON_PREFILL_TILES` row that takes ``head_size``, the
    Gluon kernel with that tile (unless ``KVCORE_GLUON=0``:
    :func:`~kvcore.ops.triton_utils.gluon_defaults_enabled`).
    ``max_seq_len_bound`` is an upper bound on every request's length
    (``block_table.shape[1] * block_size``); only the split heuristic uses it, with
    ``num_sms`` (default: ``device``'s SM count). ``rocm`` picks the AMD configs (default: the
    torch build's platform), ``arch`` the row of :data:`PREFILL_TILES` and :data:`DECODE_TILES`
    (default: :func:`device_arch`). The compile check passes its target's values for all three.
    """
    group = num_heads // num_kv_heads
    g_pad = next_power_of_2(group)
    decode_only = num_tokens == num_seqs
    rocm = _is_rocm(rocm)
    arch = arch or device_arch(device)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_tokens, num_seqs, num_kv_heads,
                                              max_seq_len_bound, device, num_sms=num_sms,
                                              arch=arch, rocm=rocm)
    if not decode_only and num_kv_splits == 1:
        tile = prefill_tile(head_size, arch, rocm)
        if (gluon and not rocm and arch in GLUON_PREFILL_TILES and gluon_defaults_enabled()
                and head_size in _GLUON_HEAD_SIZES and g_pad <= GLUON_PREFILL_TILES[arch].rows):
            tile = GLUON_PREFILL_TILES[arch]
        return AttentionConfig(block_q=max(1, tile.rows // g_pad), g_pad=g_pad,
                               block_n=tile.block_n, num_splits=1, num_warps=tile.num_warps,
                               num_stages=tile.num_stages, prefill=True,
                               const_block=tile.const_block, edge_stages=tile.edge_stages,
                               warp_specialize=tile.warp_specialize, gluon=tile.gluon,
                               pingpong=tile.pingpong)
    # tl.dot needs >= 16 rows: decode tiles hold one query (16 rows), split prefill tiles 128
    # rows (64 above head_size 128, where a 128-row fp32 accumulator would spill).
    rows = 16 if decode_only else (128 if head_size <= 128 else 64)
    block_q = max(1, rows // g_pad)
    tile = decode_tile(arch, rocm)
    # Two 32-key K/V tiles in flight beside a 64 x 256 query tile take 68 KiB of LDS: more
    # than gfx942's 64 KiB (`kvcore kernels`), so one tile in flight above head_size 128.
    num_stages = min(tile.num_stages, 2) if rocm and head_size > 128 else tile.num_stages
    block_n = tile.split_block_n if num_kv_splits > 1 and tile.split_block_n else tile.block_n
    return AttentionConfig(block_q=block_q, g_pad=g_pad, block_n=block_n,
                           num_splits=num_kv_splits, num_warps=tile.num_warps,
                           num_stages=num_stages, const_block=tile.const_block)


def call_config(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                kv_cache_dtype: str, num_seqs: int, max_seq_len_bound: int,
                num_kv_splits: int | None = None, **target) -> AttentionConfig:
    """The config :func:`paged_attention` uses when given none: :func:`default_config` for
    these tensors (``query`` ``(tokens, heads, head_size)``, caches ``(blocks, block_size,
    kv_heads, head_size)``), with its Gluon row only where :func:`gluon_prefill_unmet` finds
    nothing unmet, the Triton row otherwise. ``target`` (``num_sms``, ``rocm``, ``arch``) as
    :func:`default_config` takes it: an ahead-of-time compile passes its target's."""
    num_tokens, num_heads, head_size = query.shape
    choose = functools.partial(default_config, num_tokens, num_seqs, num_heads,
                               key_cache.shape[2], head_size, max_seq_len_bound, query.device,
                               num_kv_splits, **target)
    cfg = choose()
    if cfg.gluon and gluon_prefill_unmet(query, key_cache, value_cache, kv_cache_dtype,
                                         cfg) is not None:
        cfg = choose(gluon=False)
    return cfg


def _check_workspace(workspace: object, device: torch.device,
                     needed: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(workspace, (tuple, list)) and len(workspace) == 2
            and all(isinstance(t, torch.Tensor) for t in workspace)):
        raise TypeError("workspace must be a pair of tensors (partial outputs, log-sum-exps), "
                        f"got {type(workspace).__name__}")
    for name, t, n in zip(("workspace[0]", "workspace[1]"), workspace, needed, strict=True):
        if t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor on {device}, got "
                             f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})")
        if t.numel() < n:
            raise ValueError(f"{name} has {t.numel()} elements but this call's split-KV "
                             f"path needs {n} (see workspace_numel)")
    return workspace[0], workspace[1]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    output: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    config: AttentionConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention over a paged KV cache for a batch mixing prefill and decode (Triton).

    Args:
        query: ``(num_tokens, num_heads, head_size)``, fp16/bf16/fp32, any strides;
            ``head_size <= 256``.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_size)`` views of
            any strides (any page stride, per-layer views of cross-layer caches, legacy
            ``(2, num_blocks, ...)`` halves); fp8 (e4m3/e5m2) when ``kv_cache_dtype`` says so.
        query_start_loc: ``(num_seqs + 1,)`` cumulative query lengths.
        seq_lens: ``(num_seqs,)`` cached + new tokens per request.
        block_table: ``(num_seqs, max_blocks_per_seq)`` block ids, any order.
        scale: softmax scale.
        causal, sliding_window: masking, as in the reference.
        kv_cache_dtype, k_scale, v_scale: fp8 cache and its per-tensor scales (1-element
            tensors or floats).
        output: optional ``(num_tokens, num_heads, head_size)`` tensor (any strides) written
            in place.
        num_kv_splits: force the number of KV splits (1 disables split-KV); ``None`` uses the
            heuristic of :func:`default_config`.
        config: full launch override (tuning and benchmarks); takes precedence over
            ``num_kv_splits``.
        workspace: preallocated ``(partial outputs, log-sum-exps)`` for the split-KV path,
            contiguous float32 tensors on the query's device with at least
            :func:`workspace_numel` elements (a builder owns them, so a step allocates
            nothing and can be captured in a CUDA graph); ``None`` allocates per call.

    Returns:
        ``output`` (or a new tensor like ``query``).
    """
    validate_paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                             block_table, kv_cache_dtype=kv_cache_dtype,
                             sliding_window=sliding_window, output=output, scale=scale,
                             k_scale=k_scale, v_scale=v_scale)
    if query.dtype not in SUPPORTED_QUERY_DTYPES:
        raise TypeError(
            f"query has dtype {query.dtype}; the Triton kernel supports "
            f"{', '.join(str(d) for d in SUPPORTED_QUERY_DTYPES)}"
        )
    if output is not None and output.dtype not in SUPPORTED_QUERY_DTYPES:
        raise TypeError(f"output has dtype {output.dtype}; expected one of fp16/bf16/fp32")
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head_size={head_size} (the Triton kernel supports up to "
                         f"{MAX_HEAD_SIZE})")
    if num_kv_splits is not None and (
        isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)
        or not 1 <= num_kv_splits <= _MAX_SPLITS
    ):
        raise ValueError(f"num_kv_splits={num_kv_splits!r} must be an int in 1..{_MAX_SPLITS} "
                         "or None")

    out = output if output is not None else torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    # The kernels index these two densely (block_table goes with its strides); an engine's
    # view of a larger buffer may have stride > 1 (contiguous() returns a dense tensor as is).
    query_start_loc, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    if config is None:
        cfg = call_config(query, key_cache, value_cache, kv_cache_dtype, num_seqs,
                          block_table.shape[1] * block_size, num_kv_splits)
        gluon_reason = None  # call_config has checked its Gluon row against these tensors
    else:
        cfg = config
        gluon_reason = (gluon_prefill_unmet(query, key_cache, value_cache, kv_cache_dtype, cfg)
                        if cfg.gluon else None)
    if cfg.prefill and cfg.num_splits != 1:
        raise ValueError(f"config has prefill=True and num_splits={cfg.num_splits}: the "
                         "prefill kernel does not split keys (set num_splits=1 or prefill=False)")
    if not cfg.prefill and (cfg.edge_stages or cfg.warp_specialize):
        raise ValueError(f"config has edge_stages={cfg.edge_stages} and warp_specialize="
                         f"{cfg.warp_specialize} with prefill=False: only the prefill kernel "
                         "has these variants (set prefill=True or leave them at 0/False)")
    if cfg.pingpong and not cfg.gluon:
        raise ValueError("config has pingpong=True with gluon=False: only the warp-specialised "
                         "Gluon kernel has it (set gluon=True and warp_specialize=True, or "
                         "pingpong=False)")
    if cfg.warp_specialize and not cfg.gluon and not warp_specialize_supported():
        raise ValueError(f"config has warp_specialize=True but Triton {triton.__version__}'s "
                         "tl.range does not take warp_specialize (Triton >= 3.4 does); set "
                         "warp_specialize=False")
    if cfg.edge_stages < 0:
        raise ValueError(f"config has edge_stages={cfg.edge_stages}; it must be >= 0 (0: the "
                         "launch's num_stages)")
    if cfg.gluon:
        if gluon_reason is not None:
            raise ValueError(gluon_reason)
        from kvcore.ops.gluon_prefill import gluon_prefill_attention

        gluon_prefill_attention(query, key_cache, value_cache, out, query_start_loc, seq_lens,
                                block_table, scale, causal, sliding_window, cfg.block_q,
                                cfg.g_pad, cfg.block_n, cfg.num_stages, cfg.warp_specialize,
                                cfg.pingpong)
        return out
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    ks, vs = scale_args(k_scale if fp8 else None, v_scale if fp8 else None, query.device)

    block_d = max(16, next_power_of_2(head_size))
    num_tiles = num_tokens // cfg.block_q + num_seqs
    if cfg.num_splits > 1 and workspace is not None:
        part_out, part_lse = _check_workspace(workspace, query.device, workspace_numel(
            num_tokens, num_heads, head_size, cfg.num_splits))
    elif cfg.num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, cfg.num_splits, head_size,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, cfg.num_splits,
                               dtype=torch.float32, device=query.device)
    else:  # unused by the kernel; any tensor will do as the argument
        part_out = part_lse = out
    interpret = interpreting()
    # fp32 queries get exact dots; fp16/bf16 the backend's default (the names of the other
    # precisions differ between NVIDIA and AMD, so none is spelled out).
    dot_precision = "ieee" if query.dtype == torch.float32 else None
    if cfg.prefill:
        _prefill_attention_kernel[(num_tiles, num_kv_heads)](
            query, key_cache, value_cache, out,
            query_start_loc, seq_lens, block_table,
            ks, vs, float(scale) * _LOG2E,
            num_seqs, num_heads // num_kv_heads, block_size, head_size, sliding_window or 0,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
            *block_table.stride(),
            CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None,
            FP8=fp8, SCALE_IS_TENSOR=isinstance(ks, torch.Tensor),
            INTERPRET=interpret, DOT_PRECISION=dot_precision,
            BLOCK_Q=cfg.block_q, G_PAD=cfg.g_pad, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            EVEN_D=block_d == head_size, PAGE=block_size if cfg.const_block else 0,
            EDGE_STAGES=cfg.edge_stages, WARP_SPECIALIZE=cfg.warp_specialize,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out
    _paged_attention_kernel[(num_tiles, num_kv_heads, cfg.num_splits)](
        query, key_cache, value_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_table,
        ks, vs, float(scale) * _LOG2E,
        num_seqs, num_heads, num_heads // num_kv_heads, block_size, head_size,
        sliding_window or 0, cfg.num_splits,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        *block_table.stride(),
        CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None,
        FP8=fp8, SCALE_IS_TENSOR=isinstance(ks, torch.Tensor),
        INTERPRET=interpret, DOT_PRECISION=dot_precision,
        BLOCK_Q=cfg.block_q, G_PAD=cfg.g_pad, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        SPLIT_KV=cfg.num_splits > 1, PAGE=block_size if cfg.const_block else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, num_heads, head_size, cfg.num_splits, *out.stride(),
            SPLITS_PAD=next_power_of_2(cfg.num_splits),
            BLOCK_D=block_d, INTERPRET=interpret, num_warps=4,
        )
    return out

