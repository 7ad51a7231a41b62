"""SDPA_GATHER: gather each request's pages, then one ``scaled_dot_product_attention`` call.

Pure torch, so it runs on any torch device. It is written the way a vendor backend is: only
kvcore's public API (``kvcore``, ``kvcore.ops``), capabilities declared once as class
attributes, kernels that read the cache through the strides of the views they are given.

Layout: HND pages (``get_kv_cache_stride_order() == (0, 1, 3, 2, 4)``), stored as
``(num_blocks, 2, num_kv_heads, block_size, head_size)``. The gather indexes the logical view,
so any stride order would work; HND shows that a non-identity order is just a declaration.
Because nothing assumes contiguous pages, the backend opts in to cross-layer caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kvcore
from kvcore.ops import FP8_KV_CACHE_DTYPES, reshape_and_cache_ref, scale_value
from kvcore_example_plugin.ops.gather import gather_pages


class SdpaGatherImpl(kvcore.AttentionImpl):
    def write_kv_cache(self, layer: kvcore.AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter ``key``/``value`` ``(num_tokens, num_kv_heads, head_size)`` into the cache."""
        key_cache, value_cache = kv_cache.unbind(1)
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping,
                              self.kv_cache_dtype, layer.k_scale, layer.v_scale)

    def attend(self, layer: kvcore.AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: kvcore.AttentionMetadata, output: torch.Tensor) -> None:
        """Attention of ``query`` ``(num_tokens, num_heads, head_size)`` over the paged cache.

        ``forward`` (kvcore's template) calls this with the step's real tokens only and the
        output rows to fill. Every request is padded to the batch's longest query and
        sequence so that the whole batch is one SDPA call; a boolean mask ``(num_seqs, 1,
        max_query_len, max_seq_len)`` hides the padding, the future (causal) and what falls
        out of the sliding window.
        """
        m = attn_metadata
        n = query.shape[0]
        device = query.device
        fp8 = self.kv_cache_dtype in FP8_KV_CACHE_DTYPES
        key_cache, value_cache = kv_cache.unbind(1)
        block_size = key_cache.shape[1]
        table = m.block_table[:, : -(-m.max_seq_len // block_size)].long()
        k = gather_pages(key_cache, table, scale_value(layer.k_scale) if fp8 else 1.0,
                          query.dtype)
        v = gather_pages(value_cache, table, scale_value(layer.v_scale) if fp8 else 1.0,
                          query.dtype)

        # Where each packed query row goes in the padded (num_seqs, max_query_len) batch.
        q_lens = (m.query_start_loc[1:] - m.query_start_loc[:-1]).long()
        seq_of_row = torch.repeat_interleave(torch.arange(m.num_seqs, device=device), q_lens)
        row_in_seq = torch.arange(n, device=device) - m.query_start_loc[seq_of_row].long()
        q = query.new_zeros(m.num_seqs, m.max_query_len, *query.shape[1:])
        q[seq_of_row, row_in_seq] = query

        seq_lens = m.seq_lens.long()
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(m.max_query_len, device=device)
        k_pos = torch.arange(k.shape[1], device=device)
        allowed = k_pos[None, None, :] < seq_lens[:, None, None]  # (num_seqs, 1, keys)
        # Whatever lies beyond a request's length (its last page's tail, padding pages) may be
        # stale NaN: zero it, since SDPA weights it by 0 and 0 * NaN is NaN.
        beyond = ~allowed[:, 0, :, None, None]
        k, v = k.masked_fill(beyond, 0), v.masked_fill(beyond, 0)
        if self.is_causal(m):
            allowed = allowed & (k_pos[None, None, :] <= q_pos[:, :, None])
        if self.sliding_window is not None:  # symmetric on non-causal layers
            distance = q_pos[:, :, None] - k_pos[None, None, :]
            if not self.is_causal(m):
                distance = distance.abs()
            allowed = allowed & (distance < self.sliding_window)

        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=allowed[:, None], scale=self.scale, enable_gqa=True)
        output.copy_(out.transpose(1, 2)[seq_of_row, row_in_seq])


class SdpaGatherBackend(kvcore.AttentionBackend):
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    # SDPA falls back to its math kernel for shapes the fused kernels refuse: any size works.
    SUPPORTED_HEAD_SIZES = None
    SUPPORTED_BLOCK_SIZES = None
    SUPPORTS_NON_CAUSAL = True
    PLATFORMS = ("cpu", "cuda", "rocm")
    # fp32 SDPA computes in fp32 on every device (no TF32), tighter than kvcore's default.
    CONFORMANCE_TOLERANCES = {torch.float32: (1e-4, 1e-4)}
    # forward pads every request to the step's longest (sizes read on the host) and allocates
    # per call: a captured step could not replay another step's shapes.
    CUDA_GRAPH_SUPPORT = kvcore.CudaGraphSupport.NEVER

    NAME = "SDPA_GATHER"
    # The impl class, defined above: get_impl_cls() returns it.
    IMPL_CLS = SdpaGatherImpl
    # The default builder (what AttentionBackend uses anyway, spelled out as a model): once
    # per step it checks the step's values and returns the metadata unchanged. A backend with
    # per-step work (a plan, split choices, a mask) subclasses it, or
    # kvcore.PersistentMetadataBuilder to support CUDA graphs (docs/backend-plugin.md).
    BUILDER_CLS = kvcore.AttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Logical (num_blocks, 2, block_size, num_kv_heads, head_size), stored HND. With a
        # leading layer dim: block outermost, then layer, then the same per-layer order.
        return (1, 0, 2, 4, 3, 5) if include_num_layers_dimension else (0, 1, 3, 2, 4)
