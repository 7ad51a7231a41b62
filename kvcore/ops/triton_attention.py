"""Triton paged attention for batches that mix prefill (with a cached prefix) and decode.

:func:`paged_attention` computes exactly :func:`kvcore.ops.reference.paged_attention_ref` (see
that module for the conventions: query positions, causal mask, sliding window, fp8 scales). It
validates its arguments and runs one of TRITON_ATTN's named kernels
(:mod:`kvcore.ops.attention_config`): the one a :class:`~kvcore.ops.attention_config.
TritonAttentionPlan` names, or the one :mod:`kvcore.ops.attention_dispatch` picks for the
batch and the GPU. The kernels: :mod:`kvcore.ops.triton_decode` (``triton_decode``,
``triton_split_kv`` with :mod:`kvcore.ops.split_kv`'s merge), :mod:`kvcore.ops.triton_prefill`
(``triton_prefill``), :mod:`kvcore.ops.gluon_prefill` (``gluon_ws_pingpong``). They differ in
speed only, never in the result beyond rounding.

Masking: K/V loads are masked beyond each query tile's last visible key, so no byte outside
a request's first ``seq_len`` tokens (the tail of its last block, other blocks) is read; masked
scores are set to ``-inf`` with ``where``, so a NaN *key* after a query changes nothing. A
NaN/Inf *value* after a query, within the key tile (``BLOCK_N`` keys) a query tile visits,
does reach that tile's earlier queries (``0 * NaN`` in the ``p @ V`` product; docs/faults.md).

All address arithmetic is int64. ``tl.make_block_ptr`` is not used (removed in triton 3.9);
under ``TRITON_INTERPRET=1`` tiles are cast to float32 before ``tl.dot`` (the interpreter
mishandles bf16 dots), on the GPU the dots run in the input dtype; the interpreter also
truncates float32 to bf16, so there outputs are rounded to nearest even first, as a GPU does
(:func:`kvcore.ops.triton_utils.to_output`).

This module imports triton at import time; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import torch

from kvcore.ops.attention_config import (
    AttentionConfig,
    GluonPrefillConfig,
    TritonAttentionPlan,
    TritonPrefillConfig,
    TritonSplitKVConfig,
)
from kvcore.ops.attention_dispatch import (
    AttentionLaunch,
    StepArgs,
    call_config,
    gluon_prefill_unmet,
)
from kvcore.ops.reference import check_attention_features
from kvcore.ops.split_kv import MAX_KV_SPLITS, workspace_numel
from kvcore.ops.triton_cache import CacheViews, same_scale, scale_key
from kvcore.ops.triton_utils import gluon_defaults_enabled, recording_launches, scale_args
from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KVScale,
    check_paged_attention_values,
    check_scale,
    validate_paged_attention,
    value_checks_enabled,
)
from kvcore.step_facts import checked_step_facts

__all__ = ["MAX_HEAD_SIZE", "SUPPORTED_QUERY_DTYPES", "paged_attention"]

#: Largest head size the kernels support (any size up to it; non-powers of two are masked).
MAX_HEAD_SIZE = 256
#: Query / output dtypes of the Triton path.
SUPPORTED_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DEFAULT_PLAN = TritonAttentionPlan()


def _check_splits(num_kv_splits: object, what: str) -> None:
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or not (
            1 <= num_kv_splits <= MAX_KV_SPLITS):
        raise ValueError(f"{what}={num_kv_splits!r} must be an int in 1..{MAX_KV_SPLITS}")


def _check_workspace(workspace: object, device: torch.device,
                     needed: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(workspace, (tuple, list)) and len(workspace) == 2
            and all(isinstance(t, torch.Tensor) for t in workspace)):
        raise TypeError("plan.workspace must be a pair of tensors (partial outputs, "
                        f"log-sum-exps), got {type(workspace).__name__}")
    for name, t, n in zip(("plan.workspace[0]", "plan.workspace[1]"), workspace, needed,
                          strict=True):
        if t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor on {device}, got "
                             f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})")
        if t.numel() < n:
            raise ValueError(f"{name} has {t.numel()} elements but this call's split-KV "
                             f"path needs {n} (see kvcore.ops.workspace_numel)")
    return workspace[0].reshape(-1), workspace[1].reshape(-1)


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
    plan: TritonAttentionPlan | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
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
        plan: the kernel config, split count and split-KV workspace a builder chose
            (:class:`~kvcore.ops.attention_config.TritonAttentionPlan`); ``None``: the
            defaults for the batch and the GPU.
        logits_soft_cap, sinks: a logit soft-cap and per-head sink logits, as in the
            reference (compile-time switches of the kernels; the Gluon prefill kernel takes
            sinks but no soft-cap, so its row is not used with one; a split launch adds the
            sinks in the merge).

    Returns:
        ``output`` (or a new tensor like ``query``).

    Host path: the checks the caches and scalar arguments decide run once per cache pair
    (:class:`_Layer`, found by the cache view objects, else by the full signature); what the
    step's metadata tensors give (their facts, the value checks for a cache's geometry, the
    launch arguments) is derived by the first call on them and kept while they are unchanged
    (:class:`_Step`), so every other layer of the step reuses it. A call repeats only the
    checks of its own ``query`` and ``output``.
    """
    seen = _RECENT.get(id(key_cache))
    if seen is not None and seen[0].same(key_cache, value_cache) and seen[1].same_call(
            query, scale, causal, sliding_window, kv_cache_dtype, k_scale, v_scale,
            logits_soft_cap, sinks):
        layer = seen[1]
    else:
        try:
            layer = _LAYERS.get(_layer_key(query, key_cache, value_cache, scale, causal,
                                           sliding_window, kv_cache_dtype, k_scale, v_scale,
                                           logits_soft_cap, sinks))
        except (AttributeError, TypeError, IndexError):  # the checks below say what is wrong
            layer = None
        seen = None
    step = None if layer is None else layer.takes(query, query_start_loc, seq_lens,
                                                  block_table, output)
    if step is not None:
        if layer.fp8:  # a tensor scale's value is read each call, as the checks do
            check_scale("k_scale", k_scale, used=True)
            check_scale("v_scale", v_scale, used=True)
        step.check_values(query, key_cache, layer.blocks)
    else:
        _check_call(query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                    scale, sliding_window, kv_cache_dtype, k_scale, v_scale, output)
        check_attention_features(query, logits_soft_cap, sinks)
        layer = _Layer(query, key_cache, value_cache, scale, causal, sliding_window,
                       kv_cache_dtype, k_scale, v_scale, logits_soft_cap, sinks)
        if len(_LAYERS) >= _MAX_LAYERS:
            _LAYERS.clear()
        _LAYERS[layer.key] = layer
        step = _take_step(query_start_loc, seq_lens, block_table, layer.device)
    if seen is None:  # found by the full signature, or new: look it up by these views next
        if len(_RECENT) >= _MAX_LAYERS:
            _RECENT.clear()
        _RECENT[id(key_cache)] = (CacheViews(key_cache, value_cache), layer)
    plan = _DEFAULT_PLAN if plan is None else plan
    if plan is not layer.plan:
        _check_plan(plan)
        layer.plan = plan

    out = output if output is not None else torch.empty_like(query)
    if query.shape[0] == 0 or step.num_seqs == 0:
        return out
    args = step.args
    if args is None:
        # The kernels index these two densely (block_table goes with its strides); an
        # engine's view of a larger buffer may have stride > 1. Copied per call: a copy
        # kept for the step would go stale in a captured graph.
        args = StepArgs(query_start_loc if query_start_loc.stride(0) == 1
                        else query_start_loc.contiguous(),
                        seq_lens if seq_lens.stride(0) == 1 else seq_lens.contiguous(),
                        block_table)
    cfg, workspace = layer.choose(plan, query, key_cache, value_cache, step.num_seqs,
                                  step.width)
    ks, vs = scale_args(k_scale, v_scale, layer.device) if layer.fp8 else _UNSCALED
    launch = layer.launches.get(cfg)
    if launch is None:
        launch = layer.launches[cfg] = AttentionLaunch(
            cfg, query, key_cache, value_cache, scale, causal, sliding_window, layer.fp8, ks,
            logits_soft_cap, sinks)
    launch(query, key_cache, value_cache, out, args, ks, vs, workspace)
    return out


def _check_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, scale: float, sliding_window: int | None,
                kv_cache_dtype: str, k_scale: KVScale, v_scale: KVScale,
                output: torch.Tensor | None) -> None:
    """Every check of :func:`paged_attention`'s arguments but the plan's."""
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
    head_size = query.shape[2]
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head_size={head_size} (the Triton kernel supports up to "
                         f"{MAX_HEAD_SIZE})")


def _check_plan(plan: object) -> None:
    if not isinstance(plan, TritonAttentionPlan):
        raise TypeError(f"plan must be a kvcore.ops.TritonAttentionPlan or None, got "
                        f"{type(plan).__name__}")
    if plan.num_kv_splits is not None:
        _check_splits(plan.num_kv_splits, "plan.num_kv_splits")


#: Checked layers by their signature (the key of :func:`paged_attention`'s lookup).
_LAYERS: dict[tuple, _Layer] = {}
_MAX_LAYERS = 1024
#: By ``id`` of a key cache view: the views (:class:`~kvcore.ops.triton_cache.CacheViews`)
#: and the checked layer of the last call on them (what :func:`paged_attention` looks up
#: first).
_RECENT: dict[int, tuple[CacheViews, _Layer]] = {}
#: The step metadata :meth:`_Layer.takes` last accepted (every layer of a step finds it).
_last_step: _Step | None = None
#: The kernels' scale arguments without an fp8 cache (see scale_args).
_UNSCALED = scale_args(None, None, torch.device("cpu"))


def _layer_key(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               scale: float, causal: bool, sliding_window: int | None, kv_cache_dtype: str,
               k_scale: KVScale, v_scale: KVScale, logits_soft_cap: float | None,
               sinks: torch.Tensor | None) -> tuple:
    """What a :class:`_Layer`'s checks and choices hold for: the caches (shape, strides,
    dtype, device, address), the query's dtype and head shape, the scalar arguments and
    scales, the sinks tensor (by identity: the launches keep it), whether launches are
    recorded, and the Gluon switch (read once per process; a test that changes it gets
    new layers). Whether the kernels are interpreted is fixed when they were decorated, so
    it is no part of it."""
    return (key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device,
            key_cache.data_ptr(), value_cache.shape, value_cache.stride(), value_cache.dtype,
            value_cache.device, value_cache.data_ptr(), query.dtype, query.shape[1:],
            kv_cache_dtype, scale, causal, sliding_window, scale_key(k_scale),
            scale_key(v_scale), logits_soft_cap, None if sinks is None else id(sinks),
            recording_launches(), gluon_defaults_enabled())


class _Layer:
    """One cache pair's checked attention: what the checks established for it with one
    query dtype, head count and the scalar arguments, its kernel choices (by plan and step
    shape) and launches (by config)."""

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 scale: float, causal: bool, sliding_window: int | None, kv_cache_dtype: str,
                 k_scale: KVScale, v_scale: KVScale, logits_soft_cap: float | None,
                 sinks: torch.Tensor | None) -> None:
        self.key = _layer_key(query, key_cache, value_cache, scale, causal, sliding_window,
                              kv_cache_dtype, k_scale, v_scale, logits_soft_cap, sinks)
        self.soft_cap = logits_soft_cap is not None  # the Gluon prefill kernel has none
        self.sinks = sinks  # held: the key names it by identity
        self.query_dtype, self.heads = query.dtype, query.shape[1:]
        # What same_call compares: the scalars as the key holds them, and the scales
        # (held: a number is compared by identity, else by scale_key).
        self.scalars = self.key[12:16] + self.key[18:20]
        self.scales = (k_scale, self.key[16], v_scale, self.key[17])
        # Both numbers: a call passing these very objects needs no scale_key compared.
        self.numbers = not (isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor))
        self.device = query.device
        #: The caches' (num_blocks, block_size): what the value checks compare the step with.
        self.blocks = key_cache.shape[:2]
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self.plan: TritonAttentionPlan | None = None
        self.launches: dict[object, AttentionLaunch] = {}
        self._configs: dict[tuple, AttentionConfig] = {}
        self._workspace: tuple = ()

    def same_call(self, query: torch.Tensor, scale: float, causal: bool,
                  sliding_window: int | None, kv_cache_dtype: str, k_scale: KVScale,
                  v_scale: KVScale, logits_soft_cap: float | None,
                  sinks: torch.Tensor | None) -> bool:
        """Whether a call on the cache views this layer was found by
        (:class:`~kvcore.ops.triton_cache.CacheViews`) has the rest of its signature
        (:func:`_layer_key` but the caches): a few comparisons, nothing built or hashed."""
        scales, key, heads, shape = self.scales, self.key, self.heads, query.shape
        return (query.dtype == self.query_dtype and len(shape) == 3 and shape[1] == heads[0]
                and shape[2] == heads[1]
                and (kv_cache_dtype, scale, causal, sliding_window, logits_soft_cap,
                     None if sinks is None else id(sinks)) == self.scalars
                and ((self.numbers and k_scale is scales[0] and v_scale is scales[2])
                     or (same_scale(k_scale, scales[0], scales[1])
                         and same_scale(v_scale, scales[2], scales[3])))
                and recording_launches() == key[20] and gluon_defaults_enabled() == key[21])

    def takes(self, query: torch.Tensor, query_start_loc: torch.Tensor,
              seq_lens: torch.Tensor, block_table: torch.Tensor,
              output: torch.Tensor | None) -> _Step | None:
        """The step of a call with these tensors when the checks this layer passed cover it
        (the last step taken when it is the same, unchanged), else ``None``."""
        device = self.device
        if not (isinstance(query, torch.Tensor) and query.device == device):
            return None
        if output is not None and not (
                isinstance(output, torch.Tensor) and output.shape == query.shape
                and output.device == device and output.dtype in SUPPORTED_QUERY_DTYPES):
            return None
        last = _last_step
        if last is not None and last.same(query_start_loc, seq_lens, block_table, device):
            return last
        if not (isinstance(query_start_loc, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
                and isinstance(block_table, torch.Tensor) and query_start_loc.dim() == 1
                and seq_lens.dim() == 1 and block_table.dim() == 2
                and query_start_loc.shape[0] == seq_lens.shape[0] + 1
                and block_table.shape[0] == seq_lens.shape[0]
                and query_start_loc.dtype in _INDEX_DTYPES and seq_lens.dtype in _INDEX_DTYPES
                and block_table.dtype in _INDEX_DTYPES and query_start_loc.device == device
                and seq_lens.device == device and block_table.device == device):
            return None
        return _take_step(query_start_loc, seq_lens, block_table, device)

    def choose(self, plan: TritonAttentionPlan, query: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, num_seqs: int, width: int
               ) -> tuple[AttentionConfig, tuple[torch.Tensor, torch.Tensor] | None]:
        """The config and split-KV workspace of a call: ``plan``'s, or the defaults for the
        batch and the GPU (checked or chosen once per plan and step shape)."""
        num_tokens = query.shape[0]
        found = (plan.config, plan.num_kv_splits, num_tokens, num_seqs, width)
        cfg = self._configs.get(found)
        if cfg is None:
            cfg = _config(plan, query, key_cache, value_cache, self.kv_cache_dtype, num_seqs,
                          width, self.soft_cap)
            if len(self._configs) >= _MAX_LAYERS:
                self._configs.clear()
            self._configs[found] = cfg
        if not (isinstance(cfg, TritonSplitKVConfig) and cfg.num_splits > 1
                and plan.workspace is not None):
            return cfg, None
        needed = workspace_numel(num_tokens, *query.shape[1:], cfg.num_splits)
        last = self._workspace
        if not (last and last[0] is plan and last[1] == needed):
            last = self._workspace = (plan, needed, _check_workspace(
                plan.workspace, query.device, needed))
        return cfg, last[2]


_INDEX_DTYPES = (torch.int32, torch.int64)


class _Step:
    """A call's metadata tensors (``query_start_loc``, ``seq_lens``, ``block_table``), checked
    as :meth:`_Layer.takes` checks them, and what every layer of the step derives from them
    once: the step's facts (:func:`~kvcore.step_facts.checked_step_facts`), the value checks
    passed (:meth:`check_values`), the request count, the block table's width and the
    launches' arguments (:class:`~kvcore.ops.attention_dispatch.StepArgs`; ``None`` when
    ``query_start_loc`` or ``seq_lens`` is strided: copied per call)."""

    __slots__ = ("args", "device", "facts", "num_seqs", "passed", "seen", "tensors", "width")

    def __init__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, device: torch.device) -> None:
        self.tensors = (query_start_loc, seq_lens, block_table)
        self.device = device
        # Inference tensors keep no version counter: such a step is never found again.
        self.seen = None if (query_start_loc.is_inference() or seq_lens.is_inference()
                             or block_table.is_inference()) else (
            query_start_loc._version, seq_lens._version, block_table._version,
            query_start_loc.data_ptr(), seq_lens.data_ptr(), block_table.data_ptr())
        self.facts = checked_step_facts(query_start_loc, seq_lens, block_table)
        #: (query rows, the cache's (num_blocks, block_size), value checks on) passed.
        self.passed: set[tuple] = set()
        self.num_seqs = seq_lens.shape[0]
        self.width = block_table.shape[1]
        self.args = (StepArgs(query_start_loc, seq_lens, block_table)
                     if query_start_loc.stride(0) == 1 and seq_lens.stride(0) == 1 else None)

    def same(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor, device: torch.device) -> bool:
        """Whether these are this step's tensors, unwritten since (versions and addresses:
        what the step's facts and launch arguments hold for), on ``device``."""
        seen, tensors = self.seen, self.tensors
        return (seen is not None and tensors[0] is query_start_loc and tensors[1] is seq_lens
                and tensors[2] is block_table and query_start_loc._version == seen[0]
                and seq_lens._version == seen[1] and block_table._version == seen[2]
                and query_start_loc.data_ptr() == seen[3] and seq_lens.data_ptr() == seen[4]
                and block_table.data_ptr() == seen[5] and device == self.device)

    def check_values(self, query: torch.Tensor, key_cache: torch.Tensor,
                     blocks: torch.Size) -> None:
        """:func:`~kvcore.ops.validation.check_paged_attention_values` for a call with
        ``query`` on ``key_cache`` (whose ``(num_blocks, block_size)`` is ``blocks``): once
        per row count, cache geometry and value-check switch for a step with facts (its
        tensors unchanged, the answer is too), every call for one without (read, as
        documented there)."""
        if self.facts is None:
            check_paged_attention_values(query, key_cache, *self.tensors)
            return
        found = (query.shape[0], blocks, value_checks_enabled())
        if found not in self.passed:
            check_paged_attention_values(query, key_cache, *self.tensors)
            self.passed.add(found)


def _take_step(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, device: torch.device) -> _Step:
    """A new :class:`_Step` for checked tensors, kept as the last step unless it can never be
    found again (inference tensors)."""
    global _last_step
    step = _Step(query_start_loc, seq_lens, block_table, device)
    if step.seen is not None:
        _last_step = step
    return step


def _config(plan: TritonAttentionPlan, query: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, kv_cache_dtype: str, num_seqs: int,
            width: int, soft_cap: bool) -> AttentionConfig:
    """``plan.config`` checked against the call, or the default config for it
    (``soft_cap``: the call has a logit soft-cap)."""
    cfg = plan.config
    if cfg is None:  # call_config checks its Gluon row against these tensors
        return call_config(query, key_cache, value_cache, kv_cache_dtype, num_seqs,
                           width * key_cache.shape[1], plan.num_kv_splits, soft_cap=soft_cap)
    if isinstance(cfg, GluonPrefillConfig):
        reason = gluon_prefill_unmet(query, key_cache, value_cache, kv_cache_dtype, cfg,
                                     soft_cap=soft_cap)
        if reason is not None:
            raise ValueError(reason)
    elif isinstance(cfg, TritonSplitKVConfig):
        _check_splits(cfg.num_splits, "TritonSplitKVConfig.num_splits")
    elif isinstance(cfg, TritonPrefillConfig) and cfg.edge_stages < 0:
        raise ValueError(f"TritonPrefillConfig has edge_stages={cfg.edge_stages}; it must be "
                         ">= 0 (0: the launch's num_stages)")
    return cfg
