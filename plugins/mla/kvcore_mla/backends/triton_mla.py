"""TRITON_MLA: portable MLA backend (NVIDIA and AMD) on kvcore-mla's Triton kernels.

Writes latents with :func:`kvcore_mla.ops.triton_cache.concat_and_cache_mla` and computes the
absorbed latent-space attention of :class:`kvcore.MLACommonImpl` with
:func:`kvcore_mla.ops.triton_mla_attention.mla_attention`: split-KV decode for pure-decode
batches, causal query tiles for mixed prefill/decode batches. Both kernels address pages
through the cache's real strides and are verified bit-exact on per-layer views of cross-layer
pools, so this backend opts in to cross-layer KV caches.

The builder (:class:`TritonMLAMetadataBuilder`) keeps the step in persistent buffers, chooses
the kernels' configurations (the decode one from the GPU's row of
:data:`~kvcore_mla.ops.mla_configs.MLA_DECODE_CONFIGS`) at start-up and the decode split count
once per step (from the batch size, the head count, the longest request and the SM count), and
owns the split-KV workspace; it hands all three to the forward as the step's
:class:`~kvcore_mla.ops.mla_configs.TritonMLAPlan`. Uniform-decode steps can be captured in
CUDA graphs (``CUDA_GRAPH_SUPPORT = UNIFORM_DECODE``): in a graph the split
count depends only on the captured batch size and ``max_model_len``, eagerly on the step's
longest request. The builder also owns the absorbed forward's buffers
(:class:`kvcore.MLACommonBackend.new_step_buffers`): ``W_UK`` writes the latent query into
them, ``q_pe`` is copied beside it (the kernel reads one query tensor by pointer and strides),
the kernel writes the latent output into them and ``W_UV`` writes the layer's output. With its
metadata a layer's forward launches only (the value checks were done once for the step,
nothing is allocated for the splits or the intermediates).

Importing this module imports no kernel library: triton is imported when the impl is first called.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

import kvcore.ops
from kvcore import (
    AttentionLayer,
    AttentionMetadata,
    AttentionSelectorConfig,
    CudaGraphSupport,
    DeviceCapability,
    MLAAttentionSpec,
    MLACommonBackend,
    MLACommonImpl,
    MLAMetadata,
    MLAStepViews,
    PersistentMetadataBuilder,
    is_uniform_decode,
)
from kvcore.ops import triton_fp8_reasons

if TYPE_CHECKING:
    from kvcore_mla.ops.mla_configs import TritonMLAPlan

__all__ = ["TritonMLABackend", "TritonMLAImpl", "TritonMLAMetadata", "TritonMLAMetadataBuilder"]


@dataclasses.dataclass
class TritonMLAMetadata(MLAMetadata):
    """:class:`~kvcore.MLAMetadata` (the step's views of the builder's buffers) plus the
    builder's plan for the step.

    Attributes:
        plan: the :class:`kvcore_mla.ops.mla_configs.TritonMLAPlan` the forward hands to
            :func:`~kvcore_mla.ops.triton_mla_attention.mla_attention`: the kernel's
            configuration (the decode one for a decode step, the mixed kernel's otherwise),
            the split count and the builder's workspace. ``None``: the op plans the call.
    """

    plan: TritonMLAPlan | None = None


class TritonMLAMetadataBuilder(PersistentMetadataBuilder):
    """Persistent step buffers, the decode split choice and its workspace (see the module).

    The workspace is sized at construction for the largest split decode any step up to the
    maxima can choose (``max_num_seqs`` requests of ``max_model_len``), so no step allocates.
    ``spec`` must be a :class:`kvcore.MLAAttentionSpec`. ``decode_config`` overrides the
    table's launch configuration (tuning, benchmarks); ``num_sms`` the SM count the split
    choice assumes (default: the device's; 1 on a CPU).
    """

    def __init__(self, spec, *, num_heads, max_num_seqs, max_num_batched_tokens,
                 max_model_len, device, decode_config=None, num_sms=None) -> None:
        if not isinstance(spec, MLAAttentionSpec):
            raise TypeError(f"spec must be a kvcore.MLAAttentionSpec (latent cache), got "
                            f"{type(spec).__name__}")
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        from kvcore_mla.ops.mla_configs import (
            DECODE_CONFIG_TYPES,
            gpu_family,
            mixed_config,
            mla_decode_config,
        )
        from kvcore_mla.ops.triton_mla_attention import mla_workspace_numel
        from kvcore_mla.ops.validation import FP8_DTYPES

        # Checked by its kernel name, not its class: a reloaded module makes a second class.
        if decode_config is not None and getattr(decode_config, "kernel", None) not in (
                DECODE_CONFIG_TYPES):
            raise ValueError(f"decode_config={decode_config!r} must be a decode kernel's "
                             f"configuration (kernels: {', '.join(DECODE_CONFIG_TYPES)})")
        if (getattr(decode_config, "uses_tma", False)
                and spec.block_size % decode_config.block_n):
            raise ValueError(f"decode_config.block_n={decode_config.block_n} does not divide "
                             f"the block size {spec.block_size}: the kernel "
                             f"{decode_config.kernel} loads tiles that lie in one page "
                             "through TMA; use a block_n that divides the block size, or a "
                             "pointer-load kernel's config")
        #: The decode kernel's launch configuration for every decode step.
        self.decode_config = decode_config or mla_decode_config(
            num_heads, gpu_family(self.device), page_size=spec.block_size,
            fp8_cache=spec.cache_dtype in FP8_DTYPES, dtype=spec.dtype)
        #: The mixed kernel's configuration for every step with prefill tokens.
        self.mixed_config = mixed_config(num_heads, spec.kv_lora_rank)
        if num_sms is None:
            num_sms = kvcore.ops.num_sms(self.device)
        elif isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
            raise ValueError(f"num_sms={num_sms!r} must be a positive integer or None")
        #: SM count the decode split choice assumes.
        self.num_sms = num_sms
        # Graph steps split by the captured size and max_model_len; eager ones by the step's
        # longest request, never more: the graph choice bounds the workspace.
        most = max(mla_workspace_numel(b, num_heads, spec.kv_lora_rank, self.num_kv_splits(b))
                   for b in range(1, max_num_seqs + 1))
        self.workspace: torch.Tensor | None = None
        if most:
            with torch.inference_mode(False):
                self.workspace = torch.empty(most, dtype=torch.float32, device=self.device)
        #: The absorbed forward's intermediates (latent query and output) for every step.
        self.step_buffers = TritonMLABackend.new_step_buffers(
            spec, num_heads=num_heads, max_num_tokens=max_num_batched_tokens, device=self.device)

    def num_kv_splits(self, num_seqs: int, max_seq_len: int | None = None) -> int:
        """The split count of a decode step of ``num_seqs`` requests no longer than
        ``max_seq_len`` (default ``max_model_len``: what a step captured for ``num_seqs``
        uses)."""
        from kvcore_mla.ops.mla_configs import mla_decode_num_splits

        bound = self.max_model_len if max_seq_len is None else max_seq_len
        return mla_decode_num_splits(num_seqs, self.num_heads, bound, self.decode_config,
                                     self.num_sms)

    def buffers(self) -> dict[str, torch.Tensor]:
        found = super().buffers()
        if self.workspace is not None:
            found["workspace"] = self.workspace
        found["q_latent"] = self.step_buffers.q_latent
        found["o_latent"] = self.step_buffers.o_latent
        return found

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> TritonMLAMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        decode = graph_batch_size is not None or is_uniform_decode(meta)
        if graph_batch_size is not None:
            splits = self.num_kv_splits(graph_batch_size)
        elif decode:  # never above the graph choice, which sized the workspace
            splits = min(self.num_kv_splits(meta.num_seqs, meta.max_seq_len),
                         self.num_kv_splits(meta.num_seqs))
        else:
            splits = 1
        from kvcore_mla.ops.mla_configs import TritonMLAPlan

        plan = TritonMLAPlan(self.decode_config if decode else self.mixed_config, splits,
                             self.workspace if splits > 1 else None)
        return meta.extend(TritonMLAMetadata, plan=plan,
                           mla_views=self.step_buffers.for_step(meta.num_actual_tokens))


def _check_runnable(kv_cache: torch.Tensor) -> None:
    from kvcore.ops.triton_utils import interpreting

    if kv_cache.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"kv_cache is on {kv_cache.device}; TRITON_MLA runs Triton kernels on GPU tensors "
            "(set TRITON_INTERPRET=1 to run them on the CPU for testing)"
        )


class TritonMLAImpl(MLACommonImpl):
    """:class:`kvcore.MLACommonImpl` on the Triton kernels (the same arguments as CPU_MLA's)."""

    def write_kv_cache(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write latents: ``key`` = ``kv_c`` ``(num_tokens, kv_lora_rank)``, ``value`` =
        ``k_pe`` ``(num_tokens, [1,] qk_rope_head_dim)``; fp8 caches use ``layer.k_scale``."""
        _check_runnable(kv_cache)
        from kvcore_mla.ops.triton_cache import concat_and_cache_mla

        concat_and_cache_mla(key, value, kv_cache, slot_mapping, self.kv_cache_dtype,
                             layer.k_scale)

    def _latent_attention(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_runnable(kv_cache)
        from kvcore_mla.ops.triton_mla_attention import mla_attention

        plan = attn_metadata.plan if isinstance(attn_metadata, TritonMLAMetadata) else None
        return mla_attention(
            q, kv_cache, kv_lora_rank=self.kv_lora_rank,
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype, k_scale=layer.k_scale,
            max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len,
            plan=plan, output=output)

    def _latent_attention_into(self, layer: AttentionLayer, views: MLAStepViews,
                               q_pe: torch.Tensor, kv_cache: torch.Tensor,
                               attn_metadata: AttentionMetadata) -> None:
        """``q_pe`` beside the absorbed query in the step's buffer (the kernels read one query
        tensor by pointer and strides), the kernel's output straight into ``views.o_latent``."""
        views.q_rope.copy_(q_pe)
        self._latent_attention(layer, views.q_latent, kv_cache, attn_metadata,
                               output=views.o_latent)


class TritonMLABackend(MLACommonBackend):
    """MLA on Triton kernels; cross-layer KV caches supported (verified)."""

    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # bf16 tensor-core dots need Ampere (CUDA 8.0); every ROCm capability kvcore knows is above.
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    PLATFORMS = ("cuda", "rocm")
    USES_TRITON = True
    # The cross-layer bit-exact tests have run on NVIDIA only; ROCm stays per-layer until a
    # ROCm run passes them.
    CROSS_LAYER_PLATFORMS = ("cuda",)
    # With the builder's metadata the launch depends only on shapes and the builder's choices:
    # no host sync, no split-KV allocation (module docstring).
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE

    NAME = "TRITON_MLA"
    IMPL_CLS = TritonMLAImpl
    BUILDER_CLS = TritonMLAMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """``B,N,D``; with layers ``B,L,N,D`` (cross-layer): both kernels take the page stride
        from the cache and pass the cross-layer tests."""
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        """fp8 caches need Triton's fp8 conversions, which NVIDIA GPUs have from 8.9 on."""
        return triton_fp8_reasons(config.kv_cache_dtype, device_capability)
