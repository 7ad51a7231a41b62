"""TRITON_ATTN's kernels by name, their launch configs, and the per-GPU tables that pick them.

Each kernel of :func:`kvcore.ops.triton_attention.paged_attention` has a name and a frozen
config class holding only the parameters that kernel takes:

=====================  =====================  ===============================================
kernel                 config                 what runs
=====================  =====================  ===============================================
``triton_decode``      :class:`TritonDecodeConfig`   the paged kernel, one program per (query
                                              tile, KV head) over all its keys
``triton_split_kv``    :class:`TritonSplitKVConfig`  the paged kernel with the key range cut in
                                              ``num_splits`` parts, then the merge
                                              (:mod:`kvcore.ops.split_kv`)
``triton_prefill``     :class:`TritonPrefillConfig`  the prefill kernel: unmasked key tiles
                                              apart from the masked edges
``gluon_ws_pingpong``  :class:`GluonPrefillConfig`   the Hopper prefill kernel in Gluon: two
                                              consumer warpgroups taking turns on the tensor
                                              cores, a copy warpgroup
=====================  =====================  ===============================================

A launch config's rows are ``block_q`` query tokens x ``g_pad`` query heads (the GQA group
padded to a power of two). The tables hold rows independent of the model
(:class:`TritonPrefillTile`, :class:`GluonPrefillTile`, :class:`DecodeTile`), per GPU
architecture (:func:`device_arch`'s names; ``cuda`` and ``rocm`` for the others); the
measurements that chose them are below. No autotuning runs inside a step or a CUDA-graph
capture; ``benchmarks/bench_triton_prefill.py`` sweeps candidates and prints its winners as rows
to paste here.

Tuned rows (Hq 32, Hk 8, D 128, bf16, block 16; times in us, CUDA-graph replays, one run each;
``benchmarks/RESULTS.md`` has the runs):

==========================  =======  ============================================================
row                         device   measured
==========================  =======  ============================================================
sm90 ``gluon_ws_pingpong``  H200     128 keys x 3 stages: 326.1 / 1021.2 / 1064.6 on prefill 4 x
                                     2048 / 1 x 8192 / 4 x 512 over 16k cached (FlashInfer 305.6
                                     / 1033.7 / 1006.8), against 338.5 / 1081.9 / 1102.0 without
                                     the consumers taking turns, 340.6 / 1144.5 / 1155.5 at 64
                                     keys, and the Triton row's 453.1 / 1407.2 / 1424.8; two
                                     stages and the kernel without warp specialisation were
                                     slower than the Triton row
sm90 ``triton_prefill``     H200     256 rows x 32 keys, 8 warps, 3 stages, block size compiled
                                     in, one edge stage: fastest on all three prefill cases,
                                     ahead of 128 x 32 x 4 x 3 (spills on sm_90a), 128 x 64 x 8
                                     warps and warp-specialised Triton loops
all ``DECODE_TILES``        H200     32 keys, 4 warps, 3 stages: the fastest tile at every decode
                                     shape (64 x 4096, 8 x 32768, 256 x 1024, 16 x 4096); 4 waves
                                     / 512 tokens a split the fastest split rule
sm90 ``DECODE_TILES``       H200     block size compiled in: 0-2% faster at every shape; split
                                     launches at 64 keys and 2 waves: 1.7-1.8% faster than 32
                                     keys at 4 waves at 8 x 32768 (4 splits) and 16 x 4096 (2)
==========================  =======  ============================================================
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kvcore.dtypes import FP8_KV_CACHE_DTYPES

__all__ = [
    "DECODE_TILES",
    "GLUON_PREFILL_TILES",
    "KERNELS",
    "PREFILL_TILES",
    "WIDE_GROUP",
    "AttentionConfig",
    "DecodeTile",
    "GluonPrefillConfig",
    "GluonPrefillTile",
    "TritonAttentionPlan",
    "TritonDecodeConfig",
    "TritonPrefillConfig",
    "TritonPrefillTile",
    "TritonSplitKVConfig",
    "decode_tile",
    "device_arch",
    "is_rocm",
    "next_power_of_2",
    "prefill_tile",
]


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``0`` for ``0``), as ``triton.next_power_of_2``
    computes it, for launch parameters on the host: recent Triton makes that function a
    constexpr function whose call costs microseconds, paid per layer per step."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be a non-negative int")
    return 1 << (n - 1).bit_length() if n else 0


def _kernel(name: str) -> dataclasses.Field:
    """The ``kernel`` field of a config or tile: fixed per class, shown in its repr."""
    return dataclasses.field(default=name, init=False)


@dataclasses.dataclass(frozen=True)
class _QueryTileConfig:
    """The fields every TRITON_ATTN kernel's config starts with: the ``kernel`` name (each
    config class sets its own) and its tile, ``block_q`` query tokens x ``g_pad`` query heads
    a program, ``block_n`` keys a loop step."""

    kernel: str = _kernel("")
    block_q: int
    g_pad: int
    block_n: int


@dataclasses.dataclass(frozen=True)
class TritonDecodeConfig(_QueryTileConfig):
    """``triton_decode``: the tile, the launch's warps and pipeline stages; ``const_block``
    compiles the cache's block size in (page lookups by shifts, one compiled kernel per block
    size). ``fp8_fp16``: on an fp8 cache, bf16 queries meet K/V in fp16 products and V is
    converted before shared memory (:mod:`kvcore.ops.triton_decode`); ``False`` converts the
    fp8 tiles to the query's dtype after shared memory, as before (the ROCm row keeps that:
    the fp16 path takes more registers there and has not been measured). Caches of the
    model's dtype ignore it. ``max_registers``: the registers a thread may take (Triton's
    ``maxnreg``, passed to ``ptxas``; NVIDIA only), so more programs fit on an SM at once;
    ``None`` leaves the choice to the compiler."""

    kernel: str = _kernel("triton_decode")
    num_warps: int
    num_stages: int
    const_block: bool = False
    fp8_fp16: bool = True
    max_registers: int | None = None


@dataclasses.dataclass(frozen=True)
class TritonSplitKVConfig(_QueryTileConfig):
    """``triton_split_kv``: :class:`TritonDecodeConfig`'s parameters, and ``num_splits`` (2
    to :data:`kvcore.ops.split_kv.MAX_KV_SPLITS`) parts of every query tile's key range,
    each run by its own program."""

    kernel: str = _kernel("triton_split_kv")
    num_splits: int
    num_warps: int
    num_stages: int
    const_block: bool = False
    fp8_fp16: bool = True
    max_registers: int | None = None


@dataclasses.dataclass(frozen=True)
class TritonPrefillConfig(_QueryTileConfig):
    """``triton_prefill``: as :class:`TritonDecodeConfig`, and ``edge_stages`` > 0 pipelines
    the masked edge loops (causal diagonal, window edge) that deep instead of
    ``num_stages``. ``fp8_fp16``: on an fp8 cache, bf16 queries meet K/V in fp16 products
    (:mod:`kvcore.ops.triton_prefill`); off by default, on in sm90's row for head sizes up
    to 128 (:data:`PREFILL_TILES`)."""

    kernel: str = _kernel("triton_prefill")
    num_warps: int
    num_stages: int
    const_block: bool = False
    edge_stages: int = 0
    fp8_fp16: bool = False


@dataclasses.dataclass(frozen=True)
class GluonPrefillConfig(_QueryTileConfig):
    """``gluon_ws_pingpong`` (:mod:`kvcore.ops.gluon_prefill`): ``block_q * g_pad`` = 128 rows
    (two consumer warpgroups of 64), ``block_n`` 64 or 128 keys a step, 2 to 4 shared-memory
    ``num_stages``; the block size is always compiled in. Runs where
    :func:`kvcore.ops.attention_dispatch.gluon_prefill_unmet` finds nothing unmet."""

    kernel: str = _kernel("gluon_ws_pingpong")
    num_stages: int


#: A launch config of any TRITON_ATTN kernel.
AttentionConfig = (TritonDecodeConfig | TritonSplitKVConfig | TritonPrefillConfig
                   | GluonPrefillConfig)

#: Every TRITON_ATTN kernel by name, with its config class.
KERNELS: dict[str, type] = {cls.kernel: cls for cls in (
    TritonDecodeConfig, TritonSplitKVConfig, TritonPrefillConfig, GluonPrefillConfig)}


@dataclasses.dataclass(frozen=True)
class TritonAttentionPlan:
    """What a step's builder chose for :func:`kvcore.ops.triton_attention.paged_attention`.

    Attributes:
        config: the launch config (its class names the kernel), or ``None`` for the GPU's
            default (:func:`kvcore.ops.attention_dispatch.default_config`).
        num_kv_splits: with ``config=None``, the split-KV count (1: no split; ``None``: the
            heuristic of :func:`kvcore.ops.split_kv.default_num_kv_splits`).
        workspace: preallocated float32 ``(partial outputs, log-sum-exps)`` for a split
            launch, contiguous, on the query's device, at least
            :func:`kvcore.ops.split_kv.workspace_numel` elements each (a builder owns them, so
            a step allocates nothing and can be captured in a CUDA graph); ``None`` allocates
            per call.
    """

    config: AttentionConfig | None = None
    num_kv_splits: int | None = None
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass(frozen=True)
class TritonPrefillTile:
    """A :data:`PREFILL_TILES` row for ``triton_prefill``: ``rows`` = query tokens x padded
    GQA group per program, and :class:`TritonPrefillConfig`'s other parameters."""

    kernel: str = _kernel("triton_prefill")
    rows: int
    block_n: int
    num_warps: int
    num_stages: int
    const_block: bool = False
    edge_stages: int = 0
    fp8_fp16: bool = False


@dataclasses.dataclass(frozen=True)
class GluonPrefillTile:
    """A :data:`GLUON_PREFILL_TILES` row for ``gluon_ws_pingpong`` (128 rows, 8 warps):
    ``block_n`` keys a step, ``num_stages`` shared-memory stages."""

    kernel: str = _kernel("gluon_ws_pingpong")
    block_n: int
    num_stages: int


#: Query heads per KV head from which a 16-bit cache's split launch takes
#: ``DecodeTile.wide_group_split_waves``.
WIDE_GROUP = 8


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """A :data:`DECODE_TILES` row: ``triton_decode``'s keys a step, warps, stages and
    ``const_block``, and the split rule (:func:`kvcore.ops.split_kv.default_num_kv_splits`):
    split while the grid has fewer than ``split_waves`` programs per SM, into about
    ``split_waves`` programs per SM, at most one split per ``min_split_tokens`` tokens.
    ``fp8_split_waves``: the programs per SM a split launch on an fp8 cache aims at (``None``:
    ``split_waves``); whether to split is still decided by ``split_waves``. An fp8 split
    program reads half the bytes of a 16-bit one, so it finishes sooner and more of them keep
    enough bytes in flight. ``split_block_n``: keys a step of ``triton_split_kv`` (``None``:
    ``block_n``); with longer steps each split program keeps more bytes in flight, so fewer
    splits (a lower ``split_waves``) fill the GPU. ``fp8_fp16`` and ``max_registers``: the
    configs' fields (:class:`TritonDecodeConfig`). ``fp8_wide``: the tile an fp8 cache takes
    above head size 128 (its ``block_n``, ``num_warps``, ``num_stages``, ``const_block``,
    ``split_block_n``, ``fp8_fp16``, ``max_registers``; the split rule stays this row's);
    ``None``: this row's tile. ``fp8_narrow``: likewise, the tile an fp8 cache takes at head
    sizes up to 64. The split rule is the row's, but for ``fp8_split_waves``, which a head-size
    tile may set for its own head sizes (it holds another number of programs per SM).
    ``wide_group_split_waves``: the programs per SM a split launch on a 16-bit cache aims at
    when each KV head serves :data:`WIDE_GROUP` query heads or more, padded to a power of two
    (``None``: ``split_waves``): such a program does twice the work per byte of a group of 4,
    and more of them in flight pay."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    const_block: bool = False
    split_waves: int = 4
    min_split_tokens: int = 512
    split_block_n: int | None = None
    fp8_fp16: bool = True
    fp8_split_waves: int | None = None
    wide_group_split_waves: int | None = None
    max_registers: int | None = None
    fp8_wide: DecodeTile | None = None
    fp8_narrow: DecodeTile | None = None


#: ``triton_prefill`` rows: (head sizes up to 128, above 128). Above 128 the tile keeps 64
#: rows: a 128-row fp32 accumulator of 256 columns spills (so does 128 x 64 with 4 warps on
#: sm80, ``kvcore kernels``). sm100 has not been measured: it takes the sm90 row.
#: ``fp8_fp16`` on sm90's first row (``benchmarks/bench_fp8_prefill.py``, H100, fp8 e4m3
#: cache, bf16 queries): 1.08x / 1.12x faster at Llama-3.1-8B's prefill 4 x 2048 and mixed
#: step, 1.02x / 1.08x at gpt-oss-20B's full layers; 0.92x / 0.94x at its 128-token-window
#: layers (8-16 µs there against 15-134 µs gained on the full layers of the same model). The
#: head-256 row has not been timed with it; nor has sm100, where it compiles with a 36-byte
#: spill (``kvcore kernels``), so sm100 keeps it off.
PREFILL_TILES: dict[str, tuple[TritonPrefillTile, TritonPrefillTile]] = {
    "sm90": (TritonPrefillTile(256, 32, 8, 3, const_block=True, edge_stages=1, fp8_fp16=True),
             TritonPrefillTile(64, 32, 4, 3)),
    "sm100": (TritonPrefillTile(256, 32, 8, 3, const_block=True, edge_stages=1),
              TritonPrefillTile(64, 32, 4, 3)),
    "cuda": (TritonPrefillTile(128, 32, 4, 3), TritonPrefillTile(64, 32, 4, 3)),
    # Two 32-key K/V tiles in flight beside a 64 x 256 query tile take 68 KiB of LDS: more
    # than gfx942's 64 KiB (`kvcore kernels`), so one tile in flight above head_size 128.
    "rocm": (TritonPrefillTile(128, 32, 4, 3), TritonPrefillTile(64, 32, 4, 2)),
}

#: ``gluon_ws_pingpong`` rows: where a row exists, prefill at head sizes 64 and 128 runs it;
#: a call it cannot run (dtype, fp8 cache, a logit soft-cap, cache alignment, a Triton
#: without Gluon, not a Hopper GPU) runs the :data:`PREFILL_TILES` row; sinks it takes.
#: 128 keys x 3 stages take 224 KiB of shared memory.
GLUON_PREFILL_TILES: dict[str, GluonPrefillTile] = {
    "sm90": GluonPrefillTile(block_n=128, num_stages=3),
}

#: ``triton_decode`` / ``triton_split_kv`` rows and the split rule. Above head size 128 on
#: ROCm the decode kernel keeps one tile in flight (LDS, as in :data:`PREFILL_TILES`).
#: sm90's fp8 splits (benchmarks/bench_fp8_decode.py, H100, block 16, bf16 queries, explicit plans,
#: 2026-12-07): the times fit three split programs of the fp8 tile (64 keys a step, 4 warps, 3
#: stages) an SM, 3 * 132 = 396 at once, and a launch is best cut into about that many (more starts
#: a second, nearly empty round). Llama-3.1-8B (Hq 32, Hk 8, D 128) at 8 x 32768, 64 programs: 6
#: splits 228.5 us, 12 232.6, 16 248.5, 24 245.6 (FlashInfer fp8 238.6); Llama-3.1-70B at TP 8 (Hk
#: 1) at 8 x 32768, 8 programs: 49 splits 39.4 us, 48 39.5, 40 43.7, 56 50.5, 64 49.8 (a second,
#: nearly empty round), 32 50.4 (FlashInfer fp8 44.5). So fp8 aims at 3 programs per SM (396 / 64 ->
#: 6 splits; 396 / 8 -> 49). 64 x 4096 of the 8B layer (512 programs) stays unsplit: 245.9-249.8 us
#: (FlashInfer fp8 242.9). The head-size tiles hold 4 programs an SM (their 528 at once): at 8 x
#: 32768 on fp8 (64 programs), gpt-oss-20B's full layer (D 64) took 151.0 us with 8 splits, 155.0
#: with 16, 193.2 with 4 (FlashInfer fp8 145.9), and Gemma-2-9B's sliding layer (D 256, window 4096)
#: 66.3 with 8 splits of the ``fp8_wide`` tile, 72.8 with 16 (FlashInfer fp8 72.3): 528 / 64 -> 8
#: splits.
#: sm90's ``fp8_wide`` (head sizes above 128 on fp8 caches): at Gemma-2-9B's sliding layer (Hq
#: 16, Hk 8, D 256, soft-cap 50, window 4096, block 16) the row's 32-key tile takes 164
#: registers and 57 KiB of shared memory on an fp8 cache (Triton 3.6, sm_90a), so 3 programs
#: share an SM: 64 x 4096's 512 programs run as 396 at once, then 116 more alone on their SMs,
#: where nothing hides a key step's latency (16 dependent mma.sync over D, eight
#: barriers for the cross-warp row max and sum; 662 instructions a step, the bf16 cache's 710):
#: 682.3 us on an H100, no faster than the bf16 cache (695.9, read-bound; FlashInfer fp8
#: 386.5). Capped at 128 registers with one tile in flight (42 KiB, a 60-byte spill) 4
#: programs fit an SM and the 512 run in one round; benchmarks/bench_fp8_decode.py
#: ``--layer gemma2-sliding`` times it against the other ways (splits, 8 warps, 16 keys):
#: 442.2 us against the row's tile's 666.6 at 64 x 4096 (H100, FlashInfer fp8 394.2).
#: sm90's ``fp8_narrow`` (head sizes up to 64 on fp8 caches): at gpt-oss-20B's full layers (Hq
#: 64, Hk 8, D 64, block 16) a 32-key step of 64-wide heads leaves too little in flight: the
#: fp8 cache took 207.7 us at 64 x 4096 with the row's tile, no faster than bf16 (212.9),
#: and 148.3 with 64 keys a step (FlashInfer fp8 152.0; 8 warps 159.5, 128 keys 149.7;
#: ``--layer gpt-oss-full``, H100). Split launches already take 64 keys (``split_block_n``).
#: sm90's ``wide_group_split_waves`` (a sweep of explicit plans, H100, 2026-12-07, bf16 cache,
#: Llama-3.1-70B at TP 8: 8 query heads on one KV head): 49 splits at 8 x 32768 took 57.6 us
#: against the 2-wave rule's 33 (61.1), 6 at 64 x 4096 55.7 against 4 (57.9) (and 12-25 at
#: 16 x 4096 16.0-16.2 against 8's 18.4, but ``min_split_tokens`` keeps it at 8 there);
#: Llama-3.1-8B's group of 4 is slower with more (6 splits at 8 x 32768 394.8 us against 4's
#: 352.9; 3 at 16 x 4096 104.5 against 2's 95.4).
DECODE_TILES: dict[str, DecodeTile] = {
    "sm90": DecodeTile(const_block=True, split_waves=2, split_block_n=64, fp8_split_waves=3,
                       wide_group_split_waves=3,
                       fp8_wide=DecodeTile(block_n=32, num_warps=4, num_stages=2,
                                           const_block=True, max_registers=128,
                                           fp8_split_waves=4),
                       fp8_narrow=DecodeTile(block_n=64, num_warps=4, num_stages=3,
                                             const_block=True, fp8_split_waves=4)),
    "cuda": DecodeTile(),
    "rocm": DecodeTile(fp8_fp16=False),
}


def device_arch(device: torch.device) -> str:
    """The table key of ``device``: ``sm<major><minor>`` on NVIDIA, the gfx name on AMD
    (``gfx942``), ``cpu`` otherwise."""
    return _device_arch(device.type, device.index)


@functools.cache
def _device_arch(device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(index or 0)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def is_rocm(rocm: bool | None = None) -> bool:
    """``rocm`` if given, else whether torch is a ROCm build."""
    return getattr(torch.version, "hip", None) is not None if rocm is None else rocm


def prefill_tile(head_size: int, arch: str, rocm: bool) -> TritonPrefillTile:
    """The :data:`PREFILL_TILES` row for ``arch`` (the platform's default when the table has
    no row for it)."""
    row = PREFILL_TILES.get(arch) or PREFILL_TILES["rocm" if rocm else "cuda"]
    return row[0] if head_size <= 128 else row[1]


def decode_tile(arch: str, rocm: bool, *, head_size: int = 0,
                kv_cache_dtype: str = "auto") -> DecodeTile:
    """The :data:`DECODE_TILES` row for ``arch`` (the platform's default when the table has
    no row for it); on an fp8 ``kv_cache_dtype`` its ``fp8_wide`` tile above head size 128
    and its ``fp8_narrow`` tile at head sizes up to 64, where it has them (the split rule,
    :func:`kvcore.ops.split_kv.default_num_kv_splits`, reads the row itself, but for the
    tile's ``fp8_split_waves``)."""
    row = DECODE_TILES.get(arch) or DECODE_TILES["rocm" if rocm else "cuda"]
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        if row.fp8_wide is not None and head_size > 128:
            return row.fp8_wide
        if row.fp8_narrow is not None and 0 < head_size <= 64:
            return row.fp8_narrow
    return row
