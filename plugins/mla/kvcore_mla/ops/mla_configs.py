"""TRITON_MLA's named kernels, their launch configurations and the per-GPU decode table.

Every configuration names the kernel it runs (``config.kernel``) and holds only that kernel's
parameters:

========================================  ===============================================
``kernel``                                 what runs
========================================  ===============================================
``"triton_mla_decode"``                    :mod:`~kvcore_mla.ops.triton_mla_decode`, the
                                           latent loaded through pointers, whole
``"triton_mla_decode_halves"``             the same kernel, the latent in two column halves
                                           with an accumulator each (two independent dot
                                           chains a tile)
``"triton_mla_decode_tma_keysplit"``       the same kernel, tiles loaded through tensor
                                           descriptors (TMA) and the score tile shared by the
                                           warpgroups by keys
``"gluon_mla_ws"``                         :mod:`~kvcore_mla.ops.gluon_mla_decode`, the
                                           warp-specialised Gluon kernel for Hopper (fixed tile)
``"triton_mla_mixed"``                     :mod:`~kvcore_mla.ops.triton_mla_mixed`, causal
                                           query tiles of a batch mixing prefill and decode
========================================  ===============================================

The decode configurations (all but the mixed kernel's) come from :data:`MLA_DECODE_CONFIGS`
through :func:`mla_decode_config`; split counts from :func:`mla_decode_num_splits`. The
measurements behind the table's rows are in ``MEASUREMENTS.md`` next to this module.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from kvcore.ops import MAX_KV_SPLITS
from kvcore.ops.triton_utils import gluon_defaults_enabled, next_power_of_2
from kvcore_mla.ops.descriptors import GLUON_DTYPES, descriptors_available, gluon_available
from kvcore_mla.ops.triton_utils import is_rocm

__all__ = [
    "DECODE_CONFIG_TYPES",
    "MLA_DECODE_CONFIGS",
    "GluonMLAWSConfig",
    "MLADecodeConfig",
    "TritonMLADecodeConfig",
    "TritonMLAHalvesConfig",
    "TritonMLAMixedConfig",
    "TritonMLAPlan",
    "TritonMLATMAKeySplitConfig",
    "family_of",
    "gpu_family",
    "mixed_config",
    "mla_decode_config",
    "mla_decode_num_splits",
]


def _check_tile(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two")
    rows = getattr(config, "block_q", 1) * config.block_h
    if rows < 16 or config.block_n < 16:
        raise ValueError(f"the tile's {rows} query rows and block_n={config.block_n} keys must "
                         "both be >= 16 (tl.dot tiles)")


@dataclasses.dataclass(frozen=True)
class TritonMLADecodeConfig:
    """The Triton MLA decode kernel with pointer loads of the whole latent.

    ``block_h`` query heads a program (at least 16, as ``tl.dot`` needs), ``block_n`` latents
    a loop step, ``num_warps`` and ``num_stages`` as Triton takes them; ``programs_per_sm`` is
    how many programs of this config an SM runs at once (shared memory and registers
    permitting), which :func:`mla_decode_num_splits` counts as slots (1 when unsure).
    ``fp8_fp16``: on an fp8 cache, bf16 queries meet the latents in fp16 products and each
    tile is converted once, where it is loaded (:mod:`~kvcore_mla.ops.triton_mla_decode`;
    NVIDIA only); ``False`` stages fp8 tiles in shared memory and converts each dot's operand
    to the query's dtype. On in sm90's Triton rows of :data:`MLA_DECODE_CONFIGS`
    (``benchmarks/bench_mla_fp8_decode.py``, H100, e4m3 cache, bf16 queries: 16 heads 241.2
    -> 106.5 µs at 64 x 4096 and 237.3 -> 108.0 at 8 x 32768, under the bf16 cache's 121.8
    and 119.2; 128 heads, the halves row, 416.4 -> 331.6 at 64 x 4096); off elsewhere
    (unmeasured); caches of the model's dtype ignore it.
    """

    kernel: ClassVar[str] = "triton_mla_decode"
    #: Whether the kernel loads tiles through tensor descriptors (a cache must meet
    #: :func:`~kvcore_mla.ops.descriptors.tma_unmet`'s conditions).
    uses_tma: ClassVar[bool] = False

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1
    fp8_fp16: bool = False

    def __post_init__(self) -> None:
        _check_tile(self, "block_h", "block_n")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm={self.programs_per_sm} must be >= 1: the "
                             "programs of this config one SM runs at once (1 when unsure)")


@dataclasses.dataclass(frozen=True)
class TritonMLAHalvesConfig(TritonMLADecodeConfig):
    """The Triton MLA decode kernel with the latent in two column halves: two score dots and
    two value dots (same probabilities) into two float32 accumulators of half the width, so
    each dot chain is independent. Same parameters as :class:`TritonMLADecodeConfig`."""

    kernel: ClassVar[str] = "triton_mla_decode_halves"


@dataclasses.dataclass(frozen=True)
class TritonMLATMAKeySplitConfig(TritonMLADecodeConfig):
    """The Triton MLA decode kernel loading latent tiles through tensor descriptors
    (``tl.make_tensor_descriptor``: on Hopper the TMA unit copies each tile into shared memory
    asynchronously) with the warpgroups sharing the score tile by keys (see
    :mod:`~kvcore_mla.ops.triton_mla_decode`). ``block_n`` must divide the cache's page size
    (a tile never crosses a page). Same parameters as :class:`TritonMLADecodeConfig`."""

    kernel: ClassVar[str] = "triton_mla_decode_tma_keysplit"
    uses_tma: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class GluonMLAWSConfig:
    """The warp-specialised Gluon MLA decode kernel for Hopper
    (:mod:`~kvcore_mla.ops.gluon_mla_decode`). Its tile is fixed: 64 heads, 64 latents a
    tile, three warpgroups, two stages of TMA loads; nothing to tune."""

    kernel: ClassVar[str] = "gluon_mla_ws"
    uses_tma: ClassVar[bool] = True
    block_h: ClassVar[int] = 64
    block_n: ClassVar[int] = 64
    programs_per_sm: ClassVar[int] = 1


#: A decode configuration: one of the named decode kernels.
MLADecodeConfig = TritonMLADecodeConfig | GluonMLAWSConfig
#: The decode configuration classes, by kernel name.
DECODE_CONFIG_TYPES: dict[str, type] = {
    cls.kernel: cls for cls in (TritonMLADecodeConfig, TritonMLAHalvesConfig,
                                TritonMLATMAKeySplitConfig, GluonMLAWSConfig)}


@dataclasses.dataclass(frozen=True)
class TritonMLAMixedConfig:
    """The mixed-batch kernel (:mod:`~kvcore_mla.ops.triton_mla_mixed`): ``block_q``
    consecutive query tokens x ``block_h`` heads form a program's rows (at least 16),
    ``block_n`` keys a loop step."""

    kernel: ClassVar[str] = "triton_mla_mixed"

    block_q: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_tile(self, "block_q", "block_h", "block_n")


def mixed_config(num_heads: int, kv_lora_rank: int, *,
                 rocm: bool | None = None) -> TritonMLAMixedConfig:
    """The mixed kernel's configuration for ``num_heads`` query heads and a latent of
    ``kv_lora_rank`` channels: up to 16 heads times enough tokens for 32 rows when the latent
    is wider than 256 (its float32 accumulator limits rows; 8 warps), else 64 rows (4 warps).
    Keys a step: 32 for a wide latent (16 on ROCm, whose 64 KiB of LDS a CU does not hold two
    stages of 32 x 576 bf16 keys), else 32 above 128 channels and 64 below. ``rocm`` picks the
    AMD config (default: the torch build's platform; the compile check passes its target's)."""
    rocm = is_rocm() if rocm is None else rocm
    wide = kv_lora_rank > 256
    block_h = min(next_power_of_2(num_heads), 16)
    if wide:
        block_n = 16 if rocm else 32
    else:
        block_n = 32 if kv_lora_rank > 128 else 64
    return TritonMLAMixedConfig(block_q=max(1, (32 if wide else 64) // block_h),
                                block_h=block_h, block_n=block_n, num_warps=8 if wide else 4,
                                num_stages=1 if rocm else 2)


#: MLA decode configurations per GPU family (:func:`gpu_family`): rows of ``(min_heads,
#: config)``, most heads first; the rows of the largest ``min_heads <= num_heads`` apply, the
#: first of them that can serve the cache (:func:`mla_decode_config`); the last row of each
#: head count needs neither TMA nor Gluon, so one always can. ``benchmarks/bench_mla.py``
#: sweeps candidates on a GPU and prints the winners as rows of this table.
MLA_DECODE_CONFIGS: dict[str, tuple[tuple[int, MLADecodeConfig], ...]] = {
    # Hopper, 64+ heads: the Gluon kernel; then 64-head Triton programs (tl.dot with M = 64
    # runs on wgmma; the 64 x 512 float32 accumulator needs 8 warps) whose two buffers of 64
    # latents beside the 64 x 576 query tile take ~220 KiB of shared memory, through TMA with
    # key-split scores; caches TMA cannot serve take pointer loads of the latent in two
    # 256-wide halves (with key-split scores, pointer loads of 2-byte latents need more
    # shared memory than an SM has). Fewer heads: 16-head programs (memory-bound) keep two
    # tiles of 64 latents in flight (164 KiB); 4 warps beat 8.
    "sm90": ((64, GluonMLAWSConfig()),
             (64, TritonMLATMAKeySplitConfig(block_h=64, block_n=64, num_warps=8,
                                             num_stages=2)),
             (64, TritonMLAHalvesConfig(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                        fp8_fp16=True)),
             (1, TritonMLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=3,
                                       fp8_fp16=True))),
    # A100 (164 KiB of shared memory a block): 32-head programs at most.
    "sm80": ((32, TritonMLADecodeConfig(block_h=32, block_n=32, num_warps=8, num_stages=2)),
             (1, TritonMLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2))),
    # AMD: 64 KiB of LDS a CU holds one stage of 16 latents beside the query tile.
    "rocm": ((32, TritonMLADecodeConfig(block_h=32, block_n=16, num_warps=8, num_stages=1)),
             (1, TritonMLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1))),
    # Anything else (consumer GPUs with ~100 KiB of shared memory, the CPU interpreter).
    "default": ((1, TritonMLADecodeConfig(block_h=16, block_n=32, num_warps=4,
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
                      dtype: torch.dtype | None = None) -> MLADecodeConfig:
    """The MLA decode configuration of :data:`MLA_DECODE_CONFIGS` for ``num_heads`` query
    heads on a GPU of ``family`` (see :func:`gpu_family`): the first row of the head count
    that can serve. A Triton row's ``block_h`` never exceeds ``num_heads`` rounded up to a
    power of two (at least 16, as ``tl.dot`` needs).

    A row whose kernel loads through tensor descriptors (``uses_tma``) serves only where they
    can: ``tma`` is True (callers pass False when
    :func:`~kvcore_mla.ops.descriptors.tma_unmet` finds the cache itself unfit), its
    ``block_n`` divides ``page_size`` (when given), the installed Triton has
    ``tl.make_tensor_descriptor``, and the cache is not fp8 (``fp8_cache``: its tiles are
    widened in registers, and on sm90 the 128-head program then spills twice as much through
    descriptors, ``kvcore kernels``). The Gluon row serves where ``gluon`` is True, Triton has
    Gluon's Hopper API, the queries (``dtype``, when given) are bf16 or fp16, and
    ``KVCORE_GLUON`` is not 0 (:func:`~kvcore.ops.triton_utils.gluon_defaults_enabled`).
    """
    if family not in MLA_DECODE_CONFIGS:
        raise ValueError(f"family={family!r} (known: {', '.join(MLA_DECODE_CONFIGS)})")
    rows = MLA_DECODE_CONFIGS[family]
    least = next((least for least, _ in rows if num_heads >= least), rows[-1][0])
    descriptors = tma and not fp8_cache and descriptors_available()

    def serves(config: MLADecodeConfig) -> bool:
        if not config.uses_tma:
            return True
        fits = descriptors and (page_size is None or page_size % config.block_n == 0)
        if isinstance(config, GluonMLAWSConfig):
            return (fits and gluon and gluon_defaults_enabled()
                    and (dtype is None or dtype in GLUON_DTYPES) and gluon_available() is None)
        return fits

    group = [config for row_least, config in rows if row_least == least]
    config = next((c for c in group if serves(c)), None)
    if config is None:
        raise ValueError(f"MLA_DECODE_CONFIGS[{family!r}] has no row for {num_heads} heads "
                         "that loads without TMA; end each head count's rows with one")
    if isinstance(config, GluonMLAWSConfig):
        return config
    return dataclasses.replace(config, block_h=min(config.block_h,
                                                   max(16, next_power_of_2(num_heads))))


def mla_decode_num_splits(num_seqs: int, num_heads: int, max_seq_len: int,
                          config: MLADecodeConfig, num_sms: int) -> int:
    """KV splits for an MLA decode batch, from its shape and the SM count.

    Each of the ``num_sms * config.programs_per_sm`` slots gets ``ceil(programs / slots)``
    programs (programs = requests x head groups x splits) and each program ``ceil(tiles /
    splits)`` latent tiles of ``config.block_n`` plus a fixed cost for a split's partial
    result: the count with the least work on the busiest slot wins (the fewest splits on
    ties), at most :data:`~kvcore.ops.MAX_KV_SPLITS` and one tile a split.
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


@dataclasses.dataclass(frozen=True)
class TritonMLAPlan:
    """How :func:`~kvcore_mla.ops.triton_mla_attention.mla_attention` runs a step: TRITON_MLA's
    builder makes one per step (``TritonMLAMetadata.plan``), so the forward only launches.

    Attributes:
        config: the kernel and its parameters: a decode configuration
            (:data:`MLADecodeConfig`) for a decode batch (one query per request), a
            :class:`TritonMLAMixedConfig` otherwise; ``None``: the op's choice.
        num_kv_splits: parts each request's keys are cut into (1..:data:`MAX_KV_SPLITS`);
            ``None``: :func:`mla_decode_num_splits` for a decode batch, 1 otherwise.
        workspace: float32 split-KV workspace, contiguous, of at least
            :func:`~kvcore_mla.ops.triton_mla_attention.mla_workspace_numel` elements (so a
            step allocates nothing and can be captured in a CUDA graph); ``None``: allocated
            per call when the call splits.
    """

    config: MLADecodeConfig | TritonMLAMixedConfig | None = None
    num_kv_splits: int | None = None
    workspace: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.config is not None and not hasattr(self.config, "kernel"):
            raise TypeError(f"config must be a TRITON_MLA kernel configuration (a decode config "
                            f"or TritonMLAMixedConfig) or None, got {type(self.config).__name__}")
        splits = self.num_kv_splits
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                                   or not 1 <= splits <= MAX_KV_SPLITS):
            raise ValueError(f"num_kv_splits={splits!r} must be an int in 1..{MAX_KV_SPLITS} "
                             "or None")
