"""TRITON_ATTN: the portable Triton backend for CUDA and ROCm GPUs.

Its kernels (:mod:`kvcore.ops.triton_cache`, :mod:`kvcore.ops.triton_attention`) take every
stride from the views they get, so the backend opts in to cross-layer caches. ``TRITON_ATTN``
stores pages NHD (``(block_size, num_kv_heads, head_size)`` inside a K or V half);
``TRITON_ATTN_HND`` is the same kernels on an HND physical order, for engines and transfer
peers that use that layout. Both are blocks-first, so KV connectors can move their blocks.

The builder (:class:`TritonAttentionMetadataBuilder`) keeps the step in persistent buffers,
chooses the split-KV count once per step and owns the split-KV workspace, so uniform-decode
steps can be captured in CUDA graphs (``CUDA_GRAPH_SUPPORT = UNIFORM_DECODE``): in a graph the
split count depends only on the captured batch size, ``max_model_len`` and the spec's
``kv_cache_dtype`` (an fp8 cache may split more; requests shorter than ``max_model_len`` leave
some splits empty, which the kernel and the merge handle), eagerly it follows the step's
longest request. The phase picks the kernel: decode-only steps run the decode
kernel with the builder's split count; steps with more tokens than requests (prefill, chunked
prefill, mixed) are never split and run the prefill kernel with the GPU's tile
(:data:`kvcore.ops.attention_config.PREFILL_TILES`; the decode tile and the split rule are the
GPU's row of :data:`kvcore.ops.attention_config.DECODE_TILES`). The builder's choices reach the
op as a :class:`kvcore.ops.TritonAttentionPlan` (``TritonAttentionMetadata.plan``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from kvcore.backend import AttentionBackend, CudaGraphSupport
from kvcore.builder import PersistentMetadataBuilder
from kvcore.config import AttentionSelectorConfig
from kvcore.impl import PagedAttentionImpl
from kvcore.layout_names import vllm_layout_order
from kvcore.metadata import AttentionLayer, AttentionMetadata
from kvcore.ops import (
    TritonAttentionPlan,
    default_num_kv_splits,
    triton_fp8_reasons,
    triton_paged_attention,
    triton_reshape_and_cache,
    workspace_numel,
)
from kvcore.platform_types import AttentionType, DeviceCapability, MultipleOf

#: The plan of a step that does not split (frozen: one instance serves every such step).
_NO_SPLIT = TritonAttentionPlan(num_kv_splits=1)


@dataclasses.dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """:class:`~kvcore.AttentionMetadata` plus the builder's launch choices for the step.

    Attributes:
        plan: what every layer of the step passes to :func:`kvcore.ops.triton_paged_attention`
            as ``plan=``: the split-KV count (1: no split; the kernel config is left to the
            op, ``config=None``) and, for a split step, the builder's float32 workspace
            ``(partial outputs, log-sum-exps)``.
    """

    plan: TritonAttentionPlan = _NO_SPLIT


class TritonAttentionMetadataBuilder(PersistentMetadataBuilder):
    """Persistent step buffers, the split-KV choice and its workspace (see the module).

    The workspace is sized at construction for the largest split decode any step up to the
    maxima can choose with the spec's ``kv_cache_dtype`` (fp8 caches may split more), so no
    step allocates. Public (``kvcore.TritonAttentionMetadataBuilder``)
    for plugins whose backends run kvcore's Triton kernels: their
    :class:`kvcore.PagedAttentionImpl` passes ``TritonAttentionMetadata.plan`` on as ``plan=``.
    """

    def __init__(self, spec, *, num_heads, max_num_seqs, max_num_batched_tokens,
                 max_model_len, device) -> None:
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        num_kv_heads = self.spec_kv_heads()
        # The spec's cache dtype and head size, and the GQA group: an fp8 cache (or a wide
        # group) may take more splits (and a larger workspace).
        self._splits = functools.partial(default_num_kv_splits,
                                         kv_cache_dtype=spec.kv_cache_dtype,
                                         head_size=spec.head_size,
                                         group_size=num_heads // num_kv_heads)
        self._num_kv_heads = num_kv_heads
        self._graph_splits: dict[int, int] = {}
        # Graph steps split by the captured size and max_model_len; eager ones by the step's
        # longest request, never more: the graph choice bounds the workspace.
        most = max(workspace_numel(b, num_heads, spec.head_size, self.graph_num_kv_splits(b))
                   for b in range(1, max_num_seqs + 1))
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._plans: dict[int, TritonAttentionPlan] = {}
        if most[0]:
            with torch.inference_mode(False):
                self.workspace = (torch.empty(most[0], dtype=torch.float32, device=self.device),
                                  torch.empty(most[1], dtype=torch.float32, device=self.device))

    def graph_num_kv_splits(self, batch_size: int) -> int:
        """The split count of a uniform-decode step captured for ``batch_size`` requests
        (worked out once per size: it depends only on the builder's fixed facts)."""
        splits = self._graph_splits.get(batch_size)
        if splits is None:
            splits = self._graph_splits[batch_size] = self._splits(
                batch_size, batch_size, self._num_kv_heads, self.max_model_len, self.device)
        return splits

    def buffers(self) -> dict[str, torch.Tensor]:
        found = super().buffers()
        if self.workspace is not None:
            found["workspace_out"], found["workspace_lse"] = self.workspace
        return found

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> TritonAttentionMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        if graph_batch_size is not None:
            splits = self.graph_num_kv_splits(graph_batch_size)
        else:
            splits = self._splits(meta.num_actual_tokens, meta.num_seqs, self._num_kv_heads,
                                  meta.max_seq_len, self.device)
        plan = self._plans.get(splits)
        if plan is None:  # one plan object per split count: the ops check a plan once
            plan = self._plans[splits] = TritonAttentionPlan(
                num_kv_splits=splits, workspace=self.workspace if splits > 1 else None)
        return meta.extend(TritonAttentionMetadata, plan=plan)


class TritonAttentionImpl(PagedAttentionImpl):
    """The Triton ops on the ``unbind(1)`` halves, with the builder's
    :class:`kvcore.ops.TritonAttentionPlan` for the step when it has one.

    Public (``kvcore.TritonAttentionImpl``) for plugins whose backends run kvcore's Triton
    kernels with :class:`TritonAttentionMetadataBuilder` (override :meth:`split_kv` for
    another cache layout)."""

    # Called on any device (CPU tensors run under TRITON_INTERPRET=1); triton is imported on
    # first call, not when the backend is registered or selected.
    reshape_and_cache = staticmethod(triton_reshape_and_cache)
    paged_attention = staticmethod(triton_paged_attention)

    def write_kv_cache(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The cache write on :meth:`split_kv`'s views (kvcore's op without its lazy-import
        wrapper, unless a subclass sets its own :meth:`reshape_and_cache`)."""
        key_cache, value_cache = self.split_kv(kv_cache)
        self._write(layer, key, value, key_cache, value_cache, slot_mapping)

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        """The op with the builder's plan (``None`` for plain metadata: the op chooses the
        split count and allocates its workspace)."""
        key_cache, value_cache = self.split_kv(kv_cache)
        self._attend(layer, query, key_cache, value_cache, attn_metadata, output)

    def update_and_forward(self, layer: AttentionLayer, query: torch.Tensor,
                           key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           attn_metadata: AttentionMetadata,
                           output: torch.Tensor | None = None) -> torch.Tensor:
        """The cache write and the attention on one pair of K/V views, the ops called
        without their lazy-import wrappers (same result and errors as the two calls). An
        encoder-only layer, or a subclass with its own :meth:`write_kv_cache` or
        :meth:`attend`, takes the two calls."""
        cls = type(self)
        if (not self.writes_kv_cache() or cls.attend is not TritonAttentionImpl.attend
                or cls.write_kv_cache is not TritonAttentionImpl.write_kv_cache):
            return super().update_and_forward(layer, query, key, value, kv_cache,
                                              attn_metadata, output)
        key_cache, value_cache = self.split_kv(kv_cache)
        self._write(layer, key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        self.check_forward(query, kv_cache, attn_metadata, output)
        if output is None:
            output = self.new_output(query)
        n = attn_metadata.num_actual_tokens
        if n:
            self._attend(layer, query if query.shape[0] == n else query[:n], key_cache,
                         value_cache, attn_metadata,
                         output if output.shape[0] == n else output[:n])
        return output

    def _write(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        write = self.reshape_and_cache
        if write is triton_reshape_and_cache:  # not a subclass's own: skip the wrapper
            write = _ops()[0]
        write(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
              layer.k_scale, layer.v_scale)

    def _attend(self, layer: AttentionLayer, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, m: AttentionMetadata, output: torch.Tensor) -> None:
        plan = m.plan if isinstance(m, TritonAttentionMetadata) else None
        attention = self.paged_attention
        if attention is not triton_paged_attention:  # a subclass's own op
            attention(query, key_cache, value_cache, query_start_loc=m.query_start_loc,
                      seq_lens=m.seq_lens, block_table=m.block_table, scale=self.scale,
                      causal=self.is_causal(m), sliding_window=self.sliding_window,
                      kv_cache_dtype=self.kv_cache_dtype, k_scale=layer.k_scale,
                      v_scale=layer.v_scale, output=output, plan=plan,
                      **self.attention_features)
            return
        # kvcore's op without its wrapper. The layer's features (what attention_features
        # holds when not None) go as plain keywords: a ** merge costs more than the rest of
        # the call's arguments together.
        _ops()[1](query, key_cache, value_cache, query_start_loc=m.query_start_loc,
                  seq_lens=m.seq_lens, block_table=m.block_table, scale=self.scale,
                  causal=self.is_causal(m), sliding_window=self.sliding_window,
                  kv_cache_dtype=self.kv_cache_dtype, k_scale=layer.k_scale,
                  v_scale=layer.v_scale, output=output, plan=plan,
                  logits_soft_cap=self.logits_soft_cap, sinks=self.sinks)


@functools.cache
def _ops() -> tuple[Callable[..., None], Callable[..., torch.Tensor]]:
    """The Triton cache write and attention (importing triton, on first use)."""
    from kvcore.ops.triton_attention import paged_attention
    from kvcore.ops.triton_cache import reshape_and_cache

    return reshape_and_cache, paged_attention


class TritonAttentionBackend(AttentionBackend):
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # Any head size up to 256: the kernel pads to a power of two and masks.
    SUPPORTED_HEAD_SIZES = (MultipleOf(8, max=256),)
    # Every token's page is looked up on its own, so any block size works.
    SUPPORTED_BLOCK_SIZES = None
    # bf16 tensor-core dots need Ampere (CUDA 8.0); every ROCm capability we know is above.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    SUPPORTS_NON_CAUSAL = True
    # Compile-time switches of both kernels (the sinks of a split launch go into the merge).
    SUPPORTS_SINK = True
    SUPPORTS_LOGITS_SOFT_CAP = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda", "rocm")
    USES_TRITON = True
    # The cross-layer bit-exact tests have run on NVIDIA only; ROCm stays per-layer until a
    # ROCm run passes them.
    CROSS_LAYER_PLATFORMS = ("cuda",)
    # The launch depends only on shapes and the builder's choices: no host sync, no
    # allocation with the builder's workspace and a given output.
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE
    # Strides come from the views: K and V side by side per token and head (vLLM's LBHNC and
    # LBNHC, and their cross-layer forms where cross-layer is verified) read too.
    EXTRA_STRIDE_ORDERS = tuple(vllm_layout_order(name, include_num_layers_dimension=False)
                                for name in ("LBNHC", "LBHNC"))

    NAME = "TRITON_ATTN"
    IMPL_CLS = TritonAttentionImpl
    BUILDER_CLS = TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD; with layers, blocks outermost: verified bit-exact on cross-layer views.
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        return triton_fp8_reasons(config.kv_cache_dtype, device_capability)


class TritonAttentionHNDBackend(TritonAttentionBackend):
    NAME = "TRITON_ATTN_HND"

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 4, 3, 5) if include_num_layers_dimension else (0, 1, 3, 2, 4)
