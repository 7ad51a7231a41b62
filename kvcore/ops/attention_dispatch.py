"""TRITON_ATTN's dispatcher: which kernel (:mod:`kvcore.ops.attention_config`) runs a call, the
checks that a Gluon config fits the call, and the launch of each kernel.

:func:`default_config` picks by the batch: decode-only batches (``num_tokens == num_seqs``) run
``triton_decode``, or ``triton_split_kv`` when :func:`kvcore.ops.split_kv.default_num_kv_splits`
splits them (or a split count is forced); other batches (prefill, chunked prefill, mixed) run
``triton_prefill`` with the GPU's :data:`~kvcore.ops.attention_config.PREFILL_TILES` row, or
``gluon_ws_pingpong`` where :data:`~kvcore.ops.attention_config.GLUON_PREFILL_TILES` has a row
and :func:`gluon_prefill_unmet` finds nothing unmet (:func:`call_config`).

This module imports triton; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import functools

import torch

from kvcore.ops.attention_config import (
    GLUON_PREFILL_TILES,
    AttentionConfig,
    GluonPrefillConfig,
    TritonDecodeConfig,
    TritonPrefillConfig,
    TritonSplitKVConfig,
    decode_tile,
    device_arch,
    is_rocm,
    prefill_tile,
)
from kvcore.ops.split_kv import LOG2E, default_num_kv_splits
from kvcore.ops.triton_decode import paged_attention_kernel
from kvcore.ops.triton_launch import KernelLaunch, int_class
from kvcore.ops.triton_merge import launch_merge
from kvcore.ops.triton_prefill import prefill_attention_kernel
from kvcore.ops.triton_utils import (
    gluon_defaults_enabled,
    gluon_kernels_unavailable,
    is_interpreted,
    next_power_of_2,
    recording_launches,
)

__all__ = ["AttentionLaunch", "StepArgs", "call_config", "default_config",
           "gluon_prefill_available", "gluon_prefill_unmet"]

#: Query and cache dtypes of ``gluon_ws_pingpong``, and its head sizes.
_GLUON_DTYPES = (torch.bfloat16, torch.float16)
_GLUON_HEAD_SIZES = (64, 128)
#: Rows of one ``gluon_ws_pingpong`` program (:data:`kvcore.ops.gluon_prefill.BLOCK_M`).
_GLUON_ROWS = 128
#: Shared memory one program of the Gluon prefill kernel may take (an H100/H200 SM's 227 KiB).
_GLUON_SMEM = 227 * 1024


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
    kv_cache_dtype: str = "auto",
) -> AttentionConfig:
    """The launch config :func:`kvcore.ops.triton_attention.paged_attention` uses (see the
    module docstring).

    With ``gluon`` the GPU's :data:`GLUON_PREFILL_TILES` row is taken for prefill where it
    takes ``head_size`` (unless ``KVCORE_GLUON=0``:
    :func:`~kvcore.ops.triton_utils.gluon_defaults_enabled`). ``max_seq_len_bound`` is an
    upper bound on every request's length (``block_table.shape[1] * block_size``); only the
    split rule uses it, with ``num_sms`` (default: ``device``'s SM count) and
    ``kv_cache_dtype`` (an fp8 cache may take more splits). ``rocm`` picks the
    AMD rows (default: the torch build's platform), ``arch`` the tables' row (default:
    :func:`~kvcore.ops.attention_config.device_arch`). The compile check passes its target's
    values for all three.
    """
    g_pad = next_power_of_2(num_heads // num_kv_heads)
    decode_only = num_tokens == num_seqs
    rocm = is_rocm(rocm)
    arch = arch or device_arch(device)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_tokens, num_seqs, num_kv_heads,
                                              max_seq_len_bound, device, num_sms=num_sms,
                                              arch=arch, rocm=rocm,
                                              kv_cache_dtype=kv_cache_dtype,
                                              head_size=head_size,
                                              group_size=num_heads // num_kv_heads)
    if not decode_only and num_kv_splits == 1:
        gluon_row = GLUON_PREFILL_TILES.get(arch) if gluon and not rocm else None
        if (gluon_row is not None and gluon_defaults_enabled()
                and head_size in _GLUON_HEAD_SIZES and g_pad <= _GLUON_ROWS):
            return GluonPrefillConfig(block_q=_GLUON_ROWS // g_pad, g_pad=g_pad,
                                      block_n=gluon_row.block_n,
                                      num_stages=gluon_row.num_stages)
        tile = prefill_tile(head_size, arch, rocm)
        return TritonPrefillConfig(block_q=max(1, tile.rows // g_pad), g_pad=g_pad,
                                   block_n=tile.block_n, num_warps=tile.num_warps,
                                   num_stages=tile.num_stages, const_block=tile.const_block,
                                   edge_stages=tile.edge_stages, fp8_fp16=tile.fp8_fp16)
    # tl.dot needs >= 16 rows: decode tiles hold one query (16 rows), split prefill tiles 128
    # rows (64 above head_size 128, where a 128-row fp32 accumulator would spill).
    rows = 16 if decode_only else (128 if head_size <= 128 else 64)
    block_q = max(1, rows // g_pad)
    tile = decode_tile(arch, rocm, head_size=head_size, kv_cache_dtype=kv_cache_dtype)
    # Two 32-key K/V tiles in flight beside a 64 x 256 query tile take 68 KiB of LDS: more
    # than gfx942's 64 KiB (`kvcore kernels`), so one tile in flight above head_size 128.
    num_stages = min(tile.num_stages, 2) if rocm and head_size > 128 else tile.num_stages
    if num_kv_splits > 1:
        return TritonSplitKVConfig(block_q=block_q, g_pad=g_pad,
                                   block_n=tile.split_block_n or tile.block_n,
                                   num_splits=num_kv_splits, num_warps=tile.num_warps,
                                   num_stages=num_stages, const_block=tile.const_block,
                                   fp8_fp16=tile.fp8_fp16, max_registers=tile.max_registers)
    return TritonDecodeConfig(block_q=block_q, g_pad=g_pad, block_n=tile.block_n,
                              num_warps=tile.num_warps, num_stages=num_stages,
                              const_block=tile.const_block, fp8_fp16=tile.fp8_fp16,
                              max_registers=tile.max_registers)


def call_config(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                kv_cache_dtype: str, num_seqs: int, max_seq_len_bound: int,
                num_kv_splits: int | None = None, *, soft_cap: bool = False,
                **target) -> AttentionConfig:
    """The config :func:`kvcore.ops.triton_attention.paged_attention` uses when given none:
    :func:`default_config` for these tensors (``query`` ``(tokens, heads, head_size)``, caches
    ``(blocks, block_size, kv_heads, head_size)``, ``kv_cache_dtype`` theirs), with its Gluon
    row only where :func:`gluon_prefill_unmet` finds nothing unmet (``soft_cap``: the call has
    a logit soft-cap), the Triton row otherwise. ``target`` (``num_sms``, ``rocm``,
    ``arch``) as :func:`default_config` takes it: an ahead-of-time compile passes its
    target's."""
    num_tokens, num_heads, head_size = query.shape
    choose = functools.partial(default_config, num_tokens, num_seqs, num_heads,
                               key_cache.shape[2], head_size, max_seq_len_bound, query.device,
                               num_kv_splits, kv_cache_dtype=kv_cache_dtype, **target)
    cfg = choose()
    if isinstance(cfg, GluonPrefillConfig) and gluon_prefill_unmet(
            query, key_cache, value_cache, kv_cache_dtype, cfg, soft_cap=soft_cap) is not None:
        cfg = choose(gluon=False)
    return cfg


def gluon_prefill_available() -> str | None:
    """``None`` when the installed Triton can build ``gluon_ws_pingpong``
    (:mod:`kvcore.ops.gluon_prefill` imports), else why not, as a sentence."""
    return gluon_kernels_unavailable("kvcore.ops.gluon_prefill")


@functools.cache  # configs are frozen: the answer is one dict lookup after the first call
def _gluon_config_unmet(cfg: GluonPrefillConfig, head_size: int) -> str | None:
    if cfg.block_q * cfg.g_pad != _GLUON_ROWS:
        return (f"GluonPrefillConfig has block_q * g_pad = {cfg.block_q * cfg.g_pad} rows; "
                f"gluon_ws_pingpong runs {_GLUON_ROWS} (64 rows a consumer warpgroup): set "
                f"block_q = {_GLUON_ROWS} // g_pad")
    if cfg.block_n not in (64, 128) or not 2 <= cfg.num_stages <= 4:
        return (f"GluonPrefillConfig has block_n={cfg.block_n} and num_stages="
                f"{cfg.num_stages}; gluon_ws_pingpong takes block_n 64 or 128 and 2 to 4 "
                "stages: set them in that range, or use a TritonPrefillConfig")
    # Stages, query tile, and room for the mbarriers (288 bytes compiled). Nothing else: the
    # kernel stages its output through the query tile (the slow sm90 compile test checks this
    # bound against what the compiler allocated).
    smem = (2 * cfg.num_stages * cfg.block_n + _GLUON_ROWS) * head_size * 2 + 1024
    if smem > _GLUON_SMEM:
        return (f"GluonPrefillConfig has block_n={cfg.block_n} and num_stages="
                f"{cfg.num_stages}: at head_size {head_size} its K/V stages, query tile and "
                f"barriers take {smem} bytes of shared memory, "
                f"more than the {_GLUON_SMEM} an SM has; use fewer stages or block_n=64")
    return None


def gluon_prefill_unmet(query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, kv_cache_dtype: str,
                        config: GluonPrefillConfig, *, soft_cap: bool = False) -> str | None:
    """Why ``gluon_ws_pingpong`` cannot run this call with ``config``, as a sentence naming
    the unmet condition and the fix; ``None`` when it can: no logit soft-cap (``soft_cap``
    says the call has one; the Gluon kernel takes sinks but not a soft-cap); Triton has
    Gluon's Hopper API;
    ``config`` is one of its tiles (:class:`~kvcore.ops.attention_config.GluonPrefillConfig`);
    the query bf16 or fp16 with a cache of the same dtype (no fp8); ``head_size`` 64 or 128;
    both caches with contiguous channels and 16-byte aligned base and strides (``cp.async``
    copies 16 bytes); the tensors on a GPU of compute capability 9.x. The device is not
    checked while launches are recorded for an ahead-of-time compile
    (:func:`kvcore.ops.triton_utils.recording_launches`)."""
    if soft_cap:
        return ("gluon_ws_pingpong implements no logit soft-cap, and this call has one: use a "
                "TritonPrefillConfig")
    reason = gluon_prefill_available()
    if reason is not None:
        return reason
    head_size = query.shape[-1]
    reason = _gluon_config_unmet(config, head_size)
    if reason is not None:
        return reason
    if (query.dtype not in _GLUON_DTYPES or key_cache.dtype != query.dtype
            or value_cache.dtype != query.dtype or kv_cache_dtype != "auto"):
        return (f"gluon_ws_pingpong takes bf16 or fp16 queries and caches of the same dtype "
                f"(kv_cache_dtype='auto'); got query {query.dtype}, key_cache "
                f"{key_cache.dtype}, value_cache {value_cache.dtype}, kv_cache_dtype="
                f"{kv_cache_dtype!r}: use a TritonPrefillConfig")
    if head_size not in _GLUON_HEAD_SIZES:
        return (f"gluon_ws_pingpong takes head_size 64 or 128; it is {head_size}: use a "
                "TritonPrefillConfig")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        reason = _gluon_cache_unmet(name, cache)
        if reason is not None:
            return reason
    device = query.device
    if recording_launches():  # compiled ahead of time for a target: no device to check
        return None
    if is_interpreted(prefill_attention_kernel):  # this process's kernels are interpreted
        return ("gluon_ws_pingpong cannot run under TRITON_INTERPRET=1 (Gluon kernels have no "
                "interpreter): unset it on a Hopper GPU, or use a TritonPrefillConfig")
    if device.type != "cuda" or not _is_hopper(
            device.index if device.index is not None else torch.cuda.current_device()):
        return (f"gluon_ws_pingpong runs on NVIDIA Hopper GPUs (compute capability 9.x); the "
                f"query is on {device} ({device_arch(device)}): use a TritonPrefillConfig")
    return None


def _gluon_cache_unmet(name: str, cache: torch.Tensor) -> str | None:
    """Why ``cache`` cannot feed the Gluon kernel's 16-byte copies, or ``None``. It runs once
    per call and layer, so the messages are built only on a refusal."""
    item = cache.element_size()
    if cache.stride(3) != 1:
        return (f"{name} has channel stride {cache.stride(3)}; gluon_ws_pingpong copies "
                "16 contiguous bytes at a time: pass a cache whose last dim is contiguous, "
                "or use a TritonPrefillConfig")
    strides = cache.stride()
    if cache.data_ptr() % 16 == 0 and all(strides[dim] * item % 16 == 0 for dim in range(3)):
        return None
    unaligned = [what for what, nbytes in (
        (f"base address {cache.data_ptr():#x}", cache.data_ptr()),
        *((f"stride({dim}) ({strides[dim]} x {item} bytes)", strides[dim] * item)
          for dim in range(3)),
    ) if nbytes % 16]
    return (f"{name}'s {' and '.join(unaligned)} is not a multiple of 16 bytes, as "
            "gluon_ws_pingpong's 16-byte copies need: use a 16-byte aligned cache, "
            "or a TritonPrefillConfig")


@functools.cache
def _is_hopper(cuda_index: int) -> bool:
    """Whether CUDA device ``cuda_index`` is an NVIDIA GPU of compute capability 9.x (cached
    per device)."""
    return (not getattr(torch.version, "hip", None)
            and torch.cuda.get_device_capability(cuda_index)[0] == 9)


class AttentionLaunch:
    """``cfg``'s kernel on one layer's caches with one call's scalar arguments fixed (the
    launch :func:`kvcore.ops.triton_attention.paged_attention` makes once per layer and
    config): calling it runs the kernel on arguments ``paged_attention`` has validated
    (the step's metadata as a :class:`StepArgs`, ``ks``/``vs`` as
    :func:`~kvcore.ops.triton_utils.scale_args` gives them, of the types they had here).
    ``workspace``: flat float32 ``(partial outputs, log-sum-exps)`` of at least
    :func:`~kvcore.ops.split_kv.workspace_numel` elements for ``triton_split_kv``, or
    ``None`` (allocated per call)."""

    def __init__(self, cfg: AttentionConfig, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, scale: float, causal: bool,
                 sliding_window: int | None, fp8: bool, ks: torch.Tensor | float,
                 logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        num_heads, head_size = query.shape[1:]
        _, block_size, num_kv_heads, _ = key_cache.shape
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.gluon = isinstance(cfg, GluonPrefillConfig)
        self.args = (scale, causal, sliding_window)
        if self.gluon:
            self.gluon_sinks = sinks  # in the kernel's softmax
            return
        self.prefill = isinstance(cfg, TritonPrefillConfig)
        self.num_splits = cfg.num_splits if isinstance(cfg, TritonSplitKVConfig) else 1
        self.block_q = cfg.block_q
        self.qk_scale = float(scale) * LOG2E
        block_d = max(16, next_power_of_2(head_size))
        # fp32 queries get exact dots; fp16/bf16 the backend's default (the names of the
        # other precisions differ between NVIDIA and AMD, so none is spelled out).
        dot_precision = "ieee" if query.dtype == torch.float32 else None
        fn = prefill_attention_kernel if self.prefill else paged_attention_kernel
        constexprs = dict(CAUSAL=bool(causal), USE_WINDOW=sliding_window is not None, FP8=fp8,
                          SCALE_IS_TENSOR=isinstance(ks, torch.Tensor),
                          INTERPRET=is_interpreted(fn), DOT_PRECISION=dot_precision,
                          BLOCK_Q=cfg.block_q, G_PAD=cfg.g_pad, BLOCK_N=cfg.block_n,
                          BLOCK_D=block_d)
        # The sinks go into the kernel's softmax, or, for a split launch, into the merge.
        self.merge_sinks = sinks if self.num_splits > 1 else None
        kernel_sinks = sinks is not None and self.num_splits == 1
        features = dict(SOFT_CAP=float(logits_soft_cap or 0.0), HAS_SINKS=kernel_sinks)
        window = sliding_window or 0
        group = num_heads // num_kv_heads
        if self.prefill:
            self.ints = (group, block_size, head_size, window)
            constexprs.update(EVEN_D=block_d == head_size,
                              PAGE=block_size if cfg.const_block else 0,
                              # Off for other caches: their prefill kernel stays one compile.
                              EDGE_STAGES=cfg.edge_stages, FP8_FP16=cfg.fp8_fp16 and fp8,
                              **features)
        else:
            self.ints = (num_heads, group, block_size, head_size, window, self.num_splits)
            constexprs.update(SPLIT_KV=self.num_splits > 1,
                              PAGE=block_size if cfg.const_block else 0,
                              FP8_FP16=cfg.fp8_fp16, **features)
        self.cache_strides = (*key_cache.stride(), *value_cache.stride())
        # Without sinks the kernel never reads its sinks argument: the query goes there.
        self.sinks = sinks if kernel_sinks else None
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        max_registers = getattr(cfg, "max_registers", None)
        if max_registers is not None:
            if is_rocm():
                raise ValueError(f"{type(cfg).__name__} has max_registers={max_registers}, a "
                                 "register cap for NVIDIA's ptxas (Triton's maxnreg), which "
                                 "ROCm's compiler does not take; pass max_registers=None.")
            options["maxnreg"] = max_registers
        self.kernel = KernelLaunch(
            fn, (query.dtype, key_cache.dtype, key_cache.data_ptr() & 15,
                 value_cache.data_ptr() & 15, self.ints, self.cache_strides,
                 type(ks), getattr(ks, "dtype", None),
                 None if self.sinks is None else (self.sinks.dtype, self.sinks.data_ptr() & 15)),
            constexprs, options)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, out: torch.Tensor, step: StepArgs,
                 ks: torch.Tensor | float, vs: torch.Tensor | float,
                 workspace: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Launch on the call's ``query``/``out`` and caches, with the step's metadata
        arguments (``step``, made once per step; see :class:`StepArgs`)."""
        if self.gluon:
            from kvcore.ops.gluon_prefill import gluon_prefill_attention

            cfg = self.cfg
            scale, causal, sliding_window = self.args
            gluon_prefill_attention(query, key_cache, value_cache, out, *step.tensors, scale,
                                    causal, sliding_window, cfg.block_q, cfg.g_pad,
                                    cfg.block_n, cfg.num_stages, sinks=self.gluon_sinks)
            return
        num_tokens = query.shape[0]
        num_seqs = step.num_seqs
        num_splits = self.num_splits
        q_strides, out_strides = query.stride(), out.stride()
        if self.prefill:
            parts, part_key = (), None
        elif num_splits > 1:
            n = num_tokens * self.num_heads * num_splits
            part_out, part_lse = workspace if workspace is not None else (
                torch.empty(n * self.head_size, dtype=torch.float32, device=query.device),
                torch.empty(n, dtype=torch.float32, device=query.device))
            parts, part_key = (part_out, part_lse), (part_out.data_ptr() & 15,
                                                     part_lse.data_ptr() & 15)
        else:  # unused by the kernel; any tensor will do as the argument (out: keyed already)
            parts, part_key = (out, out), None
        self.kernel(
            (num_tokens // self.block_q + num_seqs, self.num_kv_heads, num_splits),
            (query, key_cache, value_cache, out, *parts, *step.tensors, ks, vs,
             query if self.sinks is None else self.sinks, self.qk_scale, num_seqs,
             *self.ints, *q_strides, *self.cache_strides, *out_strides, *step.strides),
            (query.data_ptr() & 15, out.dtype, out.data_ptr() & 15, part_key, step.key,
             ks.data_ptr() & 15 if isinstance(ks, torch.Tensor) else type(ks),
             vs.data_ptr() & 15 if isinstance(vs, torch.Tensor) else type(vs),
             q_strides, out_strides))
        if num_splits > 1:
            n = num_tokens * self.num_heads * num_splits
            launch_merge(
                part_out[:n * self.head_size].view(num_tokens, self.num_heads, num_splits,
                                                   self.head_size),
                part_lse[:n].view(num_tokens, self.num_heads, num_splits), out, None,
                self.merge_sinks)


class StepArgs:
    """A step's metadata tensors as every layer's :class:`AttentionLaunch` passes them, with
    what a launch derives from them (their specialisation classes, the request count, the
    block table's strides), made once per step instead of once per layer.

    ``query_start_loc`` and ``seq_lens`` must be dense (stride 1, as the kernels index
    them) and the three tensors checked as :func:`kvcore.ops.triton_attention.
    paged_attention` checks them; they must not change shape, strides or address while the
    object is used (its maker keeps it only while their version counters and addresses are
    unchanged)."""

    __slots__ = ("key", "num_seqs", "strides", "tensors")

    def __init__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor) -> None:
        self.tensors = (query_start_loc, seq_lens, block_table)
        self.num_seqs = num_seqs = seq_lens.shape[0]
        self.strides = strides = block_table.stride()
        self.key = (query_start_loc.dtype, query_start_loc.data_ptr() & 15, seq_lens.dtype,
                    seq_lens.data_ptr() & 15, block_table.dtype, block_table.data_ptr() & 15,
                    int_class(num_seqs), strides)
