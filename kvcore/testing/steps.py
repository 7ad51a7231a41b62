"""One engine step through a backend, for backend tests: cached prefixes written, then a mixed
batch of new tokens written and attended, on a layer of a multi-layer cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.allocate import KVCaches, allocate_kv_caches
from kvcore.backend import AttentionBackend
from kvcore.metadata import AttentionMetadata, LayerScales, build_attention_metadata
from kvcore.registry import resolve_backend
from kvcore.testing.batch import random_block_tables
from kvcore.testing.reference import contiguous_attention_ref

__all__ = ["MixedStep", "run_mixed_step"]


@dataclass
class MixedStep:
    """What :func:`run_mixed_step` ran and got.

    Attributes:
        output: ``(num_tokens, num_heads, head_size)``, the backend's ``forward``.
        query: ``(num_tokens, num_heads, head_size)``, this step's packed queries.
        keys, values: per request, all its tokens ``(seq_len, num_kv_heads, head_size)``
            (cached prefix, then this step's), contiguous.
        metadata: the step's :class:`~kvcore.AttentionMetadata`.
        scale, sliding_window: the layer's.
        caches: the whole allocation; the step ran on ``caches.layers[layer]``.
        before: ``caches.storage`` as it was before the step (random bytes everywhere).
    """

    output: torch.Tensor
    query: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    metadata: AttentionMetadata
    scale: float
    sliding_window: int | None
    caches: KVCaches
    before: torch.Tensor

    def reference(self) -> torch.Tensor:
        """float64 :func:`~kvcore.testing.contiguous_attention_ref` of every request, packed
        like :attr:`output` (causal)."""
        starts = self.metadata.query_start_loc.tolist()
        return torch.cat([
            contiguous_attention_ref(self.query[starts[i]:starts[i + 1]], self.keys[i],
                                     self.values[i], self.scale,
                                     sliding_window=self.sliding_window)
            for i in range(len(self.keys))])


def run_mixed_step(
    backend: str | type[AttentionBackend],
    *,
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    sliding_window: int | None = None,
    kv_cache_dtype: str = "auto",
    layer_scales: LayerScales | None = None,
    cross_layer: bool | str = "auto",
    num_layers: int = 3,
    layer: int = 1,
    spare_blocks: int = 3,
    device: str = "cpu",
) -> MixedStep:
    """Run one step of requests with ``context_lens`` cached and ``query_lens`` new tokens.

    Allocates ``num_layers`` layers of random bytes, writes every request's cached prefix into
    layer ``layer`` (one ``do_kv_cache_update``), then this step's tokens, then calls
    ``forward``; block tables are shuffled (:func:`random_block_tables`). All values come from
    ``gen``.
    """
    backend_cls = resolve_backend(backend) if isinstance(backend, str) else backend
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    caches = allocate_kv_caches(
        backend_cls, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, device=device,
        cross_layer=cross_layer, kv_cache_dtype=kv_cache_dtype)
    caches.storage.copy_(torch.randn(caches.storage.shape, generator=gen))
    before = caches.storage.clone()
    kv_cache = caches.layers[layer]
    scale = head_size ** -0.5
    impl = backend_cls.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                      sliding_window=sliding_window,
                                      kv_cache_dtype=kv_cache_dtype)
    scales = layer_scales or LayerScales()

    def tokens(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, head_size, generator=gen).to(dtype).to(device)

    keys = [tokens(s, num_kv_heads) for s in seq_lens]
    values = [tokens(s, num_kv_heads) for s in seq_lens]
    cached = list(zip(keys, values, context_lens, strict=True))
    prefix = build_attention_metadata(context_lens, [0] * len(seq_lens), tables, block_size,
                                      device=device)
    impl.do_kv_cache_update(scales, torch.cat([k[:c] for k, _, c in cached]),
                            torch.cat([v[:c] for _, v, c in cached]), kv_cache,
                            prefix.slot_mapping)
    metadata = build_attention_metadata(query_lens, context_lens, tables, block_size,
                                        device=device)
    new_k = torch.cat([k[c:] for k, _, c in cached])
    new_v = torch.cat([v[c:] for _, v, c in cached])
    impl.do_kv_cache_update(scales, new_k, new_v, kv_cache, metadata.slot_mapping)
    query = tokens(sum(query_lens), num_heads)
    output = impl.forward(scales, query, new_k, new_v, kv_cache, metadata)
    return MixedStep(output, query, keys, values, metadata, scale, sliding_window, caches, before)
