"""Deliberately broken backends, each with a bug real kernels have shipped with.

``test_conformance_suite.py`` runs the conformance suite on each (``--kvcore-backend
broken_backends:Class``) and checks that it fails with the rule the bug breaks. They run on
CPU, in float32 only, to keep those runs short.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import kvcore
from kvcore.ops import paged_attention_ref, reshape_and_cache_ref


def assume_contiguous_pages(cache: torch.Tensor) -> torch.Tensor:
    """THE BUG: a K or V view whose page stride is what a contiguous cache would have.

    Right on a per-layer allocation; on a layer of a cross-layer allocation the real page
    stride is ``num_layers`` times larger, so page ``b`` lands in other layers' memory.
    """
    page = 2 * math.prod(cache.shape[1:])
    return cache.as_strided(cache.shape, (page, *cache.stride()[1:]), cache.storage_offset())


class ReferenceImpl(kvcore.AttentionImpl):
    """Correct: the pure-torch reference ops on the views it is given."""

    def write_kv_cache(self, layer, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = self.kv_views(kv_cache, writing=True)
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, layer, query, kv_cache, attn_metadata, output):
        key_cache, value_cache = self.kv_views(kv_cache, writing=False)
        self.run(query, key_cache, value_cache, attn_metadata, output)

    def kv_views(self, kv_cache, writing):
        return kv_cache.unbind(1)

    def run(self, query, key_cache, value_cache, meta, output):
        paged_attention_ref(query, key_cache, value_cache, query_start_loc=meta.query_start_loc,
                            seq_lens=meta.seq_lens, block_table=meta.block_table,
                            scale=self.scale, causal=self.is_causal(meta),
                            sliding_window=self.sliding_window, output=output)


class CorrectBackend(kvcore.AttentionBackend):
    """A correct backend, NHD and cross-layer; the broken ones below change one thing."""

    SUPPORTED_DTYPES = (torch.float32,)
    PLATFORMS = ("cpu",)

    @staticmethod
    def get_name():
        return "CORRECT"

    @staticmethod
    def get_impl_cls():
        return ReferenceImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


class ZeroTimesStaleImpl(ReferenceImpl):
    def run(self, query, key_cache, value_cache, meta, output):
        super().run(query, key_cache, value_cache, meta, output)
        # THE BUG: the tail of each request's blocks "masked" by a multiply by zero, which
        # keeps a NaN left in an unowned slot (0 * NaN is NaN).
        read = key_cache[meta.block_table.long().flatten()].sum()
        output.add_((0 * read).to(output.dtype))


class MasksStaleSlotsByMultiplying(CorrectBackend):
    @staticmethod
    def get_name():
        return "MASKS_BY_MULTIPLYING"

    @staticmethod
    def get_impl_cls():
        return ZeroTimesStaleImpl


class StrideOrderNotPermutation(CorrectBackend):
    """Meant HND, typed (0, 1, 3, 3, 4): dim 2 is never placed."""

    @staticmethod
    def get_name():
        return "BROKEN_STRIDE_ORDER"

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (1, 0, 2, 4, 4, 5) if include_num_layers_dimension else (0, 1, 3, 3, 4)


class CrossLayerOrderSplitsPages(CorrectBackend):
    """Block outermost, but K/V before the layer: a layer's page is two separate halves."""

    @staticmethod
    def get_name():
        return "BROKEN_CROSS_LAYER_ORDER"

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (1, 2, 0, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


class PageStrideIgnoringImpl(ReferenceImpl):
    def kv_views(self, kv_cache, writing):
        key_cache, value_cache = kv_cache.unbind(1)
        if writing:
            return key_cache, value_cache
        return assume_contiguous_pages(key_cache), assume_contiguous_pages(value_cache)


class IgnoresPageStride(CorrectBackend):
    """Opts in to cross-layer, but its attention kernel reads pages at the contiguous stride."""

    @staticmethod
    def get_name():
        return "BROKEN_PAGE_STRIDE"

    @staticmethod
    def get_impl_cls():
        return PageStrideIgnoringImpl


class NeighbourWritingImpl(ReferenceImpl):
    def kv_views(self, kv_cache, writing):
        key_cache, value_cache = kv_cache.unbind(1)
        if not writing:
            return key_cache, value_cache
        return assume_contiguous_pages(key_cache), assume_contiguous_pages(value_cache)


class WritesIntoNeighbourLayer(CorrectBackend):
    """Opts in to cross-layer, but its cache write scatters at the contiguous page stride."""

    @staticmethod
    def get_name():
        return "BROKEN_NEIGHBOUR_WRITE"

    @staticmethod
    def get_impl_cls():
        return NeighbourWritingImpl


class PowerOfTwoImpl(ReferenceImpl):
    def run(self, query, key_cache, value_cache, meta, output):
        if self.head_size & (self.head_size - 1):
            raise RuntimeError(f"tile size {self.head_size} is not a power of two")
        super().run(query, key_cache, value_cache, meta, output)


class ClaimsAnyHeadSize(CorrectBackend):
    """Declares every head size, but its kernel handles powers of two only."""

    SUPPORTED_HEAD_SIZES = None

    @staticmethod
    def get_name():
        return "BROKEN_HEAD_SIZE_CLAIM"

    @staticmethod
    def get_impl_cls():
        return PowerOfTwoImpl


class VagueReasons(CorrectBackend):
    """Refuses what it should, but with a reason nobody can act on."""

    @staticmethod
    def get_name():
        return "BROKEN_REASONS"

    @classmethod
    def validate_configuration(cls, *args, **kwargs):
        return ["not supported"] if super().validate_configuration(*args, **kwargs) else []


class DeclaresABlockSizeItRefuses(CorrectBackend):
    """Declares block size 16 (a list copied from another backend), but its kernel tiles 64
    tokens; check_combination refuses 16 whatever the dtype, worded as a clash of two fields."""

    SUPPORTED_BLOCK_SIZES = (16, 64)

    @staticmethod
    def get_name():
        return "BROKEN_BLOCK_SIZE_CLAIM"

    @classmethod
    def check_combination(cls, config, device_capability):
        if config.block_size % 64:
            return [f"block_size={config.block_size} with dtype="
                    f"{str(config.dtype).removeprefix('torch.')}: the kernel tiles 64 tokens"]
        return []


class GraphClaimWithoutBuffers(CorrectBackend):
    """Declares CUDA-graph support but keeps the default builder (new tensors every step)."""

    CUDA_GRAPH_SUPPORT = kvcore.CudaGraphSupport.UNIFORM_DECODE

    @staticmethod
    def get_name():
        return "BROKEN_GRAPH_CLAIM"


class FreshTensorsBuilder(kvcore.PersistentMetadataBuilder):
    """THE BUG: copies the step into its buffers, then hands out a copy of them."""

    def build(self, common, *, graph_batch_size=None):
        meta = super().build(common, graph_batch_size=graph_batch_size)
        return dataclasses.replace(meta, seq_lens=meta.seq_lens.clone())


class BuilderAllocatesPerStep(GraphClaimWithoutBuffers):

    @staticmethod
    def get_name():
        return "BROKEN_GRAPH_BUFFERS"

    @staticmethod
    def get_builder_cls():
        return FreshTensorsBuilder


class OffByOneBuilder(kvcore.AttentionMetadataBuilder):
    """THE BUG: "precomputes" every request's length one token short."""

    def build(self, common, *, graph_batch_size=None):
        common = super().build(common, graph_batch_size=graph_batch_size)
        return dataclasses.replace(common, seq_lens=common.seq_lens - 1)


class BuilderDropsAToken(CorrectBackend):

    @staticmethod
    def get_name():
        return "BROKEN_BUILDER"

    @staticmethod
    def get_builder_cls():
        return OffByOneBuilder


class UncheckedBuilder(kvcore.AttentionMetadataBuilder):
    """THE BUG: "saves" the step's value checks by returning the step as it came."""

    def build(self, common, *, graph_batch_size=None):
        return common


class BuilderSkipsStepChecks(CorrectBackend):

    @staticmethod
    def get_name():
        return "BROKEN_STEP_CHECKS"

    @staticmethod
    def get_builder_cls():
        return UncheckedBuilder


class WindowOnlyWhenCausalImpl(ReferenceImpl):
    def run(self, query, key_cache, value_cache, meta, output):
        # THE BUG: the window applied with the causal mask only (a kernel whose window code
        # sits inside its causal branch): non-causal layers see every key.
        paged_attention_ref(query, key_cache, value_cache, query_start_loc=meta.query_start_loc,
                            seq_lens=meta.seq_lens, block_table=meta.block_table,
                            scale=self.scale, causal=self.is_causal(meta),
                            sliding_window=self.sliding_window if self.is_causal(meta) else None,
                            output=output)


class DropsNonCausalWindow(CorrectBackend):
    SUPPORTS_NON_CAUSAL = True

    @staticmethod
    def get_name():
        return "BROKEN_NONCAUSAL_WINDOW"

    @staticmethod
    def get_impl_cls():
        return WindowOnlyWhenCausalImpl


# -- MLA ---------------------------------------------------------------------------------------


def mla_contiguous_pages(cache: torch.Tensor) -> torch.Tensor:
    """THE BUG, for a latent cache ``(num_blocks, block_size, entry)``: the page stride of a
    contiguous cache, wrong on a layer of a cross-layer allocation."""
    page = math.prod(cache.shape[1:])
    return cache.as_strided(cache.shape, (page, *cache.stride()[1:]), cache.storage_offset())


_CpuMLA = kvcore.resolve_backend("CPU_MLA")


class CorrectMLABackend(_CpuMLA):
    """CPU_MLA in float32 with an ``auto`` cache only (short runs)."""

    SUPPORTED_DTYPES = (torch.float32,)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)

    @staticmethod
    def get_name():
        return "CORRECT_MLA"


class OnePercentOffImpl(_CpuMLA.get_impl_cls()):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs).mul_(1.01)


class MLAOnePercentOff(CorrectMLABackend):
    """Every output 1% too large (e.g. a softmax scale or normalisation slightly off), in
    bfloat16, whose element-wise tolerance alone would let it pass."""

    SUPPORTED_DTYPES = (torch.bfloat16,)

    @staticmethod
    def get_name():
        return "BROKEN_MLA_ONE_PERCENT"

    @staticmethod
    def get_impl_cls():
        return OnePercentOffImpl


class MLAPageStrideIgnoringImpl(_CpuMLA.get_impl_cls()):
    def _latent_attention(self, layer, q, kv_cache, attn_metadata):
        return super()._latent_attention(layer, q, mla_contiguous_pages(kv_cache), attn_metadata)


class MLAIgnoresPageStride(CorrectMLABackend):
    """Opts in to cross-layer, but its attention reads latents at the contiguous page stride."""

    @staticmethod
    def get_name():
        return "BROKEN_MLA_PAGE_STRIDE"

    @staticmethod
    def get_impl_cls():
        return MLAPageStrideIgnoringImpl


class MLANeighbourWritingImpl(_CpuMLA.get_impl_cls()):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        super().do_kv_cache_update(layer, key, value, mla_contiguous_pages(kv_cache),
                                   slot_mapping)


class MLAWritesIntoNeighbourLayer(CorrectMLABackend):
    """Opts in to cross-layer, but its latent write scatters at the contiguous page stride."""

    @staticmethod
    def get_name():
        return "BROKEN_MLA_NEIGHBOUR_WRITE"

    @staticmethod
    def get_impl_cls():
        return MLANeighbourWritingImpl


def _dense(t):
    """``t`` as a kernel that indexes its raw pointer densely sees it (strides ignored)."""
    strides = tuple(math.prod(t.shape[i + 1:]) for i in range(t.dim()))
    return t.as_strided(t.shape, strides, t.storage_offset())


class DenseStepTensorsImpl(ReferenceImpl):
    """Broken: reads slot_mapping, query_start_loc, seq_lens and block_table as dense
    memory, whatever their strides (a kernel given raw pointers and no strides)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        super().do_kv_cache_update(layer, key, value, kv_cache, _dense(slot_mapping))

    def run(self, query, key_cache, value_cache, meta, output):
        dense = dataclasses.replace(meta, query_start_loc=_dense(meta.query_start_loc),
                                    seq_lens=_dense(meta.seq_lens),
                                    block_table=_dense(meta.block_table))
        super().run(query, key_cache, value_cache, dense, output)


class ReadsStepTensorsDensely(CorrectBackend):
    @staticmethod
    def get_name():
        return "READS_STEP_TENSORS_DENSELY"

    @staticmethod
    def get_impl_cls():
        return DenseStepTensorsImpl


class OwnOrderImpl(ReferenceImpl):
    """Broken: reads and writes the cache as if it lay densely in the backend's own order
    (NHD), whatever its strides (a kernel given a raw pointer and the sizes)."""

    def kv_views(self, kv_cache, writing):
        return _dense(kv_cache).unbind(1)


class ReadsAdoptedOrderAsItsOwn(CorrectBackend):
    """Declares it reads vLLM's LBNHC (K and V side by side per token and head), but its
    kernels assume their own NHD order. Per-layer (not cross-layer), so only that claim is
    wrong."""

    EXTRA_STRIDE_ORDERS = (kvcore.vllm_layout_order("LBNHC", include_num_layers_dimension=False),)

    @staticmethod
    def get_name():
        return "READS_ADOPTED_ORDER_AS_ITS_OWN"

    @staticmethod
    def get_impl_cls():
        return OwnOrderImpl

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return tuple(range(6 if include_num_layers_dimension else 5))
