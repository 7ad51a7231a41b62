"""FLEX_ATTENTION: torch's ``flex_attention`` over kvcore's paged, blocks-first KV cache.

The paged cache as one flex sequence
------------------------------------
``flex_attention`` attends a query sequence to *one* key/value sequence, so a layer's cache
``(num_blocks, 2, block_size, H, D)`` is presented as one long *virtual* sequence, without a
copy: the K half ``kv_cache.unbind(1)[0]`` (strides ``(sB, sN, sH, sD)``) is re-strided to
``(1, H, S, D)`` with token stride ``sN``. Its block ``b`` then starts at virtual token
``b * m * block_size`` with ``m = sB // (block_size * sN)``: ``m = 1`` for FLEX_ATTENTION's own
per-layer order ``B,N,2,H,D`` (a token's K and V side by side, token stride ``2 * H * D``),
``m = num_layers`` for one layer of its cross-layer order ``B,L,N,2,H,D``, ``m = 2`` for an NHD
``B,2,N,H,D`` cache (between two K pages lies the V page of the same block). The V half gets
the same view from its own start, so one virtual index addresses K and V of the same token.

The block table becomes a :class:`~torch.nn.attention.flex_attention.BlockMask` built directly
(``BlockMask.from_kv_blocks``, no ``create_block_mask``): the queries are cut into tiles of
:data:`Q_TILE` tokens; each tile lists the virtual blocks ``b * m`` of every page of every
request that has a token in the tile (deduplicated: prefix-shared pages appear once). Its
``mask_mod`` maps a virtual key index back to (physical block, offset), looks up the logical
block of that page *in the query's own request* (``-1`` if the page is not the request's) and
applies ``position < seq_len``, causality (bottom-right aligned: query ``j`` of a request with
``q_len`` new tokens sits at ``seq_len - q_len + j``) and the sliding window.

Layer features
--------------
- **Logit soft-capping** (``logits_soft_cap``, Gemma 2): a ``score_mod`` turns each scaled
  score into ``cap * tanh(score / cap)``; flex applies it before ``mask_mod``, as kvcore's
  reference does (:func:`kvcore.ops.reference.apply_attention_features`).
- **Attention sinks** (``sinks``, gpt-oss): one logit per query head that joins each row's
  softmax denominator and adds no value. flex also returns each row's natural-log
  log-sum-exp ``lse`` of its kept scores, so the sink scales the output by
  ``sum / (sum + exp(sink)) = sigmoid(lse - sink)``, computed in float32.

Devices: on CUDA ``flex_attention`` runs compiled (``torch.compile``, Triton kernels, block
sparse), one compiled entry point per static configuration with dynamic batch and context
sizes (:func:`compiled_flex`): a few graphs per model shape, within dynamo's recompile limit
however batch and context sizes vary. On CPU it runs **eagerly**, for reasons measured with
torch 2.13: compiling it took 20-33 s for one small shape on a 2-core machine, its
dynamic-shape recompile failed to build (a C++ compile error), and inductor's CPU template
asserts that the block mask is as wide as the whole key sequence (``num_blocks * m`` columns
per query tile instead of a few pages). The eager path is torch's unfused implementation: it
evaluates ``mask_mod`` on the dense ``(num_tokens, S)`` score matrix, exact but memory-hungry
(``num_heads * num_tokens * S`` floats). It exists for testing and portability; CPU_ATTN is
the CPU platform's backend.

Limits
------
- **int32 offsets.** torch's flex_attention kernel template computes K/V element offsets in
  int32 (pytorch/pytorch issue 185262, fix proposed in PR 185264), so a cache view whose
  elements span more than ``2**31`` from its first to its last element reads wrong memory.
  :meth:`FlexAttentionImpl.forward` refuses such a view with ``ValueError`` before launching
  (:data:`FlexAttentionBackend.MAX_KV_CACHE_SPAN`; engines can check sizes before allocating
  with :meth:`FlexAttentionBackend.kv_cache_size_reasons`). The same rule holds on CPU, so a
  configuration accepted on CPU is accepted on the GPU.
- **Stride order.** ``(0, 2, 1, 3, 4)`` per layer (physical ``B,N,2,H,D``) and ``(1, 0, 3, 2,
  4, 5)`` with layers, as upstream FlexAttention backends declare them, so an engine using
  either lays blocks out the same way. A per-layer view of a cross-layer allocation spans all
  layers, so the int32 limit falls ``num_layers`` times lower (``allocate_kv_caches`` refuses
  a larger one with the largest ``num_blocks`` that fits). Cross-layer is not verified
  (``CROSS_LAYER_PLATFORMS`` is empty), so caches stay per layer: on the CPU the eager path
  is not bit-exact across layouts (it reduces over the whole virtual sequence, whose length
  follows the page stride), and on CUDA the GPU test
  ``test_flex_attention_on_a_cross_layer_view_is_bit_exact`` has to pass first.
- **Stale bytes.** Masked positions are zero weights, but ``0 * NaN`` is NaN. On CPU the
  eager path would multiply every page of the cache, so it reads V through a copy whose
  unowned positions are zero (:func:`owned_positions`): stale NaN/Inf never reach an output.
  On CUDA the compiled kernel visits only the batch's pages, but whole pages: NaN/Inf bit
  patterns in the unused tail of a request's last page (or, within one prefill, in V of a
  key after the query in the same page) make that output NaN. ``allocate_kv_caches``
  allocates zeros and kvcore's cache writes never store NaN from finite inputs, so this needs
  a cache corrupted from outside; :meth:`FlexAttentionBackend.stale_bytes_reason` says so,
  and the conformance rule ``stale-bytes-masked`` is skipped there with this reason.
- **Block masks once per step.** The builder (:class:`FlexAttentionMetadataBuilder`) gives
  every step a :class:`FlexAttentionMetadata` that holds the step's block masks: a mask also
  depends on the cache (its number of blocks and page stride) and on the layer (causal,
  sliding window), which the builder does not know, so the first layer of each kind builds its
  mask and every later layer of the step reuses it (a model alternating windowed and global
  layers builds two masks per step, not one per layer). Metadata that did not come from the
  builder keeps the last mask built (:class:`~kvcore_nvidia.backends.common.StepCache`).
  Building a mask syncs with the host: not CUDA-graph capturable (``CUDA_GRAPH_SUPPORT`` is
  ``NEVER``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    AttentionType,
    DeviceCapability,
)
from kvcore_nvidia.backends.common import PagedCacheImpl, StepCache

__all__ = ["Q_TILE", "FlexAttentionBackend", "FlexAttentionImpl", "FlexAttentionMetadata",
           "FlexAttentionMetadataBuilder", "build_block_mask", "compiled_flex",
           "paged_sequence_views", "padded_rows"]

#: Query tokens per row tile of the block mask (the kernel's ``BLOCK_M`` on CUDA).
Q_TILE = 16
#: Query rows below which inductor's CUDA lowering of ``flex_attention`` considers its
#: decoding kernel (see :func:`padded_rows`); a multiple of :data:`Q_TILE`.
_DECODE_ROWS = 128
_BF16_CAPABILITY = DeviceCapability(8, 0)
_INT32_ISSUE = "torch's flex_attention kernel computes K/V offsets in int32 (pytorch issue 185262)"


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last element a view reaches (``numel`` if contiguous)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _refuse_int32_overflow(kv_cache: torch.Tensor) -> None:
    span = _span(kv_cache)
    if span > FlexAttentionBackend.MAX_KV_CACHE_SPAN:
        raise ValueError(
            f"kv_cache spans {span} elements (shape {tuple(kv_cache.shape)}, strides "
            f"{kv_cache.stride()}), over FLEX_ATTENTION's limit of 2**31 elements per layer: "
            f"{_INT32_ISSUE} and would read wrong memory. Allocate fewer blocks per layer "
            "(FlexAttentionBackend.max_num_blocks gives the limit) or use another backend"
        )


def paged_sequence_views(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The K and V halves as one virtual flex sequence each, and the page stride ``m``.

    Args:
        key_cache, value_cache: ``(num_blocks, block_size, H, D)`` views with equal strides
            (``kv_cache.unbind(1)``).

    Returns:
        ``(k_seq, v_seq, m)``: ``(1, H, S, D)`` views of the same memory with
        ``S = (num_blocks - 1) * m * block_size + block_size``; block ``b``'s token ``t`` is
        virtual token ``b * m * block_size + t`` in both.

    Raises:
        ValueError: the block stride is not a whole number of token runs, so no single
            token stride reaches every page.
    """
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    s_block, s_token, s_head, s_dim = key_cache.stride()
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache has strides {value_cache.stride()} but key_cache has "
                         f"{key_cache.stride()}; both must be halves of one kv_cache")
    if s_token <= 0 or s_block % (block_size * s_token):
        raise ValueError(
            f"key_cache strides {key_cache.stride()}: the block stride {s_block} is not a "
            f"multiple of block_size * token stride = {block_size * s_token}, so the pages "
            "cannot be addressed as one sequence"
        )
    m = s_block // (block_size * s_token)
    length = (num_blocks - 1) * m * block_size + block_size
    size = (1, num_heads, length, head_size)
    stride = (0, s_head, s_token, s_dim)
    k_seq = key_cache.as_strided(size, stride, key_cache.storage_offset())
    v_seq = value_cache.as_strided(size, stride, value_cache.storage_offset())
    return k_seq, v_seq, m


def padded_rows(num_tokens: int) -> int:
    """Query rows the compiled kernel runs for ``num_tokens`` tokens: whole :data:`Q_TILE`
    tiles, at least 128 rows.

    Inductor's CUDA lowering asks whether the query has fewer than 128 rows (its decoding
    kernel's condition) before it reads ``FORCE_USE_FLEX_ATTENTION``, and so guards the graph
    on the answer: with a dynamic row count, a graph compiled for a 48-row step does not serve
    a 336-row one, and steps on both sides of 128 would take a graph each beyond the promised
    three (:func:`compiled_flex`). From 128 rows up every step is on the same side. The rows
    past the batch's tokens list no page, so their tiles visit no key block.
    """
    return max(_DECODE_ROWS, Q_TILE * -(-num_tokens // Q_TILE))


def build_block_mask(
    attn_metadata: AttentionMetadata,
    num_blocks: int,
    block_size: int,
    page_stride: int,
    causal: bool,
    sliding_window: int | None,
    *,
    pad: bool = False,
) -> Any:
    """The ``BlockMask`` of one batch over the virtual sequence of :func:`paged_sequence_views`.

    Args:
        attn_metadata: the batch; its first ``num_actual_tokens`` query rows are attended.
        num_blocks, block_size: the cache's.
        page_stride: ``m`` from :func:`paged_sequence_views`.
        causal: bottom-right aligned causal masking within each request.
        sliding_window: keep keys with ``q_pos - k_pos < sliding_window`` (``None``: all);
            not causal, the symmetric ``|q_pos - k_pos| < sliding_window``.
        pad: cover :func:`padded_rows` query rows instead of ``num_actual_tokens``; the rows
            past the batch's tokens belong to no request, attend to nothing and list no page.

    Returns:
        A ``BlockMask`` with ``Q_TILE x block_size`` tiles: each query tile lists the virtual
        blocks of every page of the requests it touches; ``mask_mod`` does the token masking.
        Its ``seq_lengths`` are ``(query rows, S)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = attn_metadata.block_table.device
    n = attn_metadata.num_actual_tokens
    qsl = attn_metadata.query_start_loc.to(torch.int64)
    seq_lens = attn_metadata.seq_lens.to(torch.int64)
    table = attn_metadata.block_table.to(torch.int64)
    num_seqs, width = table.shape
    rows = padded_rows(n) if pad else n
    q_lens = qsl[1:] - qsl[:-1]
    # Request and absolute position of every query row. Padding rows belong to an extra
    # request ``num_seqs`` of length 0 that owns no page (so they keep no key); it also
    # keeps the per-request tensors at two rows or more (see compiled_flex).
    lens = torch.cat([q_lens, q_lens.new_full((1,), rows - n)])
    doc = torch.repeat_interleave(torch.arange(num_seqs + 1, device=device), lens,
                                  output_size=rows)
    seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(1)])
    q_pos = seq_lens[doc] - lens[doc] + torch.arange(rows, device=device) - qsl[doc]
    cols = torch.arange(width, device=device)
    used = cols[None, :] < (seq_lens[:num_seqs, None] + block_size - 1) // block_size
    # physical -> logical block per request; -1 where the page is not the request's. Unused
    # table entries are scattered into a spare column that is then dropped (no host sync).
    p2l = torch.full((num_seqs + 1, num_blocks + 1), -1, dtype=torch.int64, device=device)
    p2l[:num_seqs].scatter_(1, torch.where(used, table, num_blocks), torch.where(used, cols, -1))
    p2l = p2l[:, :num_blocks]

    # Pages each query tile must visit: the used pages of each of its tokens' requests,
    # sorted and deduplicated (num_blocks is the "empty" sentinel and sorts last).
    tiles = -(-rows // Q_TILE)
    pages = torch.full((tiles * Q_TILE, width), num_blocks, dtype=torch.int64, device=device)
    pages[:n] = torch.where(used[doc[:n]], table[doc[:n]], num_blocks)
    pages = pages.view(tiles, Q_TILE * width).sort(dim=1).values
    repeat = torch.zeros_like(pages, dtype=torch.bool)
    repeat[:, 1:] = pages[:, 1:] == pages[:, :-1]
    pages = pages.masked_fill(repeat, num_blocks).sort(dim=1).values
    listed = pages < num_blocks
    kv_num_blocks = listed.sum(dim=1).to(torch.int32)
    kv_indices = torch.where(listed, pages * page_stride, 0).to(torch.int32)
    span = page_stride * block_size
    window = sliding_window

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        virtual_block = kv_idx // block_size
        block = kv_idx // span
        logical = p2l[doc[q_idx], block]
        k_pos = logical * block_size + kv_idx % block_size
        keep = ((virtual_block % page_stride == 0) & (logical >= 0)
                & (k_pos < seq_lens[doc[q_idx]]))
        if causal:
            keep = keep & (k_pos <= q_pos[q_idx])
        if window is not None:
            distance = q_pos[q_idx] - k_pos
            keep = keep & ((distance if causal else distance.abs()) < window)
        return keep

    length = (num_blocks - 1) * span + block_size
    return BlockMask.from_kv_blocks(
        kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=(Q_TILE, block_size),
        mask_mod=mask_mod, seq_lengths=(rows, length), compute_q_blocks=False)


def owned_positions(attn_metadata: AttentionMetadata, num_blocks: int, block_size: int,
                    page_stride: int) -> torch.Tensor:
    """``(S,)`` bool over the virtual sequence of :func:`paged_sequence_views`: True at the
    tokens some request of the batch owns (its first ``seq_len`` tokens)."""
    table = attn_metadata.block_table.to(torch.int64)
    seq_lens = attn_metadata.seq_lens.to(torch.int64)
    width = table.shape[1]
    pos = torch.arange(width * block_size, device=table.device)
    valid = pos[None, :] < seq_lens[:, None]  # (num_seqs, width * block_size)
    virtual = (table.repeat_interleave(block_size, dim=1) * page_stride * block_size
               + pos % block_size)
    length = (num_blocks - 1) * page_stride * block_size + block_size
    owned = torch.zeros(length + 1, dtype=torch.bool, device=table.device)
    owned[torch.where(valid, virtual, length)] = True  # invalid entries land in a spare slot
    return owned[:length]


_MASKS = StepCache()


@dataclasses.dataclass
class FlexAttentionMetadata(AttentionMetadata):
    """:class:`~kvcore.AttentionMetadata` plus the step's block masks (see the module).

    Attributes:
        block_masks: ``BlockMask`` by ``(device, num_blocks, block_size, page_stride, causal,
            sliding_window)``, filled by the first layer of the step that needs each.
    """

    block_masks: dict[tuple, Any] = dataclasses.field(default_factory=dict)


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Checks the step once and gives it a fresh :class:`FlexAttentionMetadata`, whose block
    masks the step's layers share (see the module docstring)."""

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> FlexAttentionMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        return meta.extend(FlexAttentionMetadata)


def _flex_entry(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
                scale: float, enable_gqa: bool, kernel_options: dict[str, Any] | None,
                soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``flex_attention`` with the layer's features: a soft-cap as ``score_mod`` (on the
    scaled scores, before ``mask_mod``), sinks from the log-sum-exp (see :func:`_run_flex`)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    score_mod = None
    if soft_cap is not None:
        def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                      q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return soft_cap * torch.tanh(score / soft_cap)

    if sinks is None:
        return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                              scale=scale, enable_gqa=enable_gqa, kernel_options=kernel_options)
    out, aux = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                              scale=scale, enable_gqa=enable_gqa, kernel_options=kernel_options,
                              return_aux=AuxRequest(lse=True))
    # lse (natural log, float32) of the row's kept scores: exp(sink) joins the denominator,
    # so the output shrinks by sum / (sum + exp(sink)) = sigmoid(lse - sink). A row that
    # keeps no key has lse = -inf and stays 0.
    kept = torch.sigmoid(aux.lse - sinks.float()[None, :, None])
    return (out.float() * kept[..., None]).to(out.dtype)


@functools.cache
def compiled_flex(config: tuple, backend: str | Callable[..., Any] = "inductor"
                  ) -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)`` for one static configuration ``config`` (a hashable
    key: dtype, head counts and size, page size and stride, scale, mask kind, soft-cap value,
    sinks' dtype or ``None``). The entry takes ``(query, key, value, block_mask, scale,
    enable_gqa, kernel_options, soft_cap, sinks)``: the cap is a constant of its graphs, the
    sinks a tensor argument, so layers that differ only in their sink values share them.

    Dynamo keeps its graphs, and counts them against ``torch._dynamo.config.recompile_limit``
    (8), per code object. One shared entry point would spend that budget on the model shapes
    a process meets (``kvcore tune`` runs every preset; a Gemma layer alternates windows) and
    then run eagerly. Each configuration therefore compiles its own copy of one small entry
    function, and within it the sizes that change every step (query rows, cache length,
    query tiles, pages per tile, requests) become dynamic after their first change
    (automatic dynamic shapes); :func:`build_block_mask` with ``pad=True`` keeps them at two
    or more, so none is specialised to 0 or 1 either, and the query rows at 128 or more, so
    inductor's guard on ``rows < 128`` holds for every step (:func:`padded_rows`). A
    configuration then holds at most three graphs, whatever the batch and context sizes.
    """
    code = _flex_entry.__code__.replace(co_name=f"flex_attention_{len(_CONFIGS)}")
    _CONFIGS.append(config)
    entry = types.FunctionType(code, _flex_entry.__globals__, code.co_name)
    return torch.compile(entry, fullgraph=True, backend=backend)


#: The configurations :func:`compiled_flex` has compiled, in order (names its entry points).
_CONFIGS: list[tuple] = []


def _run_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
              scale: float, block_size: int, config: tuple, soft_cap: float | None,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``query`` ``(1, Hq, rows, D)``, ``rows = block_mask.seq_lengths[0]``.

    ``soft_cap``: scores (scaled) become ``soft_cap * tanh(score / soft_cap)`` before the
    mask. ``sinks``: ``(Hq,)`` logits, one per query head, in each row's softmax denominator
    only: the output is flex's times ``sigmoid(lse - sinks[h])`` in float32, ``lse`` being
    flex's natural-log log-sum-exp of the row's kept (capped) scores. On CUDA both are part
    of the compiled graph: the cap a constant of the configuration, sinks a tensor argument.
    """
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cuda":
        # The kernel tiles must divide the block mask's tiles (Q_TILE x one page).
        options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_TILE, "BLOCK_N": block_size}
        return compiled_flex(config)(query, key, value, block_mask, scale, gqa, options,
                                     soft_cap, sinks)
    with warnings.catch_warnings():
        # The eager path is the CPU choice (module docstring); its "use torch.compile" warning
        # would repeat on every call.
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        return _flex_entry(query, key, value, block_mask, scale, gqa, None, soft_cap, sinks)


class FlexAttentionImpl(PagedCacheImpl):
    """Cache write: :func:`kvcore_nvidia.ops.write_kv_cache` (GPU) or the reference (CPU).

    Attention: ``flex_attention`` over :func:`paged_sequence_views` with the block mask of
    :func:`build_block_mask`, the layer's soft-cap and sinks applied as the module says;
    refuses caches beyond :data:`FlexAttentionBackend.MAX_KV_CACHE_SPAN`.
    """

    def check_forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      attn_metadata: AttentionMetadata, output: torch.Tensor | None) -> None:
        _refuse_int32_overflow(kv_cache)

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        key_cache, value_cache = self.checked_halves(query, kv_cache, attn_metadata, output)
        num_blocks, block_size = key_cache.shape[:2]
        k_seq, v_seq, page_stride = paged_sequence_views(key_cache, value_cache)
        causal = self.is_causal(attn_metadata)
        key = (key_cache.device, num_blocks, block_size, page_stride, causal, self.sliding_window)
        on_cpu = key_cache.device.type == "cpu"

        def make() -> Any:
            # The compiled (CUDA) path runs padded query rows: see compiled_flex.
            return (build_block_mask(attn_metadata, num_blocks, block_size, page_stride, causal,
                                     self.sliding_window, pad=not on_cpu),
                    owned_positions(attn_metadata, num_blocks, block_size, page_stride)
                    if on_cpu else None)

        if isinstance(attn_metadata, FlexAttentionMetadata):
            masks = attn_metadata.block_masks.get(key)
            if masks is None:
                masks = attn_metadata.block_masks[key] = make()
        else:
            masks = _MASKS.get(attn_metadata, key, make)
        block_mask, owned = masks
        if owned is not None:
            # The eager path multiplies every cache position's V by its (zero) weight: stale
            # NaN/Inf anywhere would poison every output. Unowned positions read as zero.
            v_seq = v_seq.masked_fill(~owned[None, None, :, None], 0)
        n, rows = query.shape[0], block_mask.seq_lengths[0]
        if rows > n:
            padded = query.new_zeros((rows, *query.shape[1:]))
            padded[:n] = query
            query = padded
        q = query.transpose(0, 1).unsqueeze(0)  # (1, num_heads, rows, head_size)
        sinks = self.sinks
        # The cap's value and whether (and in which dtype) sinks come are static: one entry
        # point per model layer kind; the sinks' values are an argument (no recompile).
        config = (query.dtype, query.shape[1:], k_seq.shape[1], block_size, page_stride,
                  self.scale, causal, self.sliding_window, self.logits_soft_cap,
                  None if sinks is None else sinks.dtype)
        out = _run_flex(q, k_seq, v_seq, block_mask, self.scale, block_size, config,
                        self.logits_soft_cap, sinks)
        output.copy_(out[0, :, :n].transpose(0, 1))


class FlexAttentionBackend(AttentionBackend):
    """torch ``flex_attention`` on the blocks-first ``B,N,2,H,D`` cache; CUDA compiled, CPU
    eager."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    # Powers of two: the CUDA kernel tiles head_size with tl.arange.
    SUPPORTED_HEAD_SIZES = (32, 64, 128, 256)
    # The block mask's KV tile is one page and the CUDA kernel's BLOCK_N equals it: a power
    # of two of at least 16 (the smallest tl.dot tile).
    SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
    SUPPORTS_NON_CAUSAL = True
    # score_mod (the cap) and the log-sum-exp output (sinks): see _run_flex.
    SUPPORTS_SINK = True
    SUPPORTS_LOGITS_SOFT_CAP = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda", "cpu")
    # The cache write on GPU tensors is kvcore's Triton kernel.
    USES_TRITON = True
    #: Most elements one layer's ``kv_cache`` view may span (see the module docstring): its
    #: largest element offset must fit in int32.
    MAX_KV_CACHE_SPAN = 2**31

    NAME = "FLEX_ATTENTION"
    IMPL_CLS = FlexAttentionImpl
    BUILDER_CLS = FlexAttentionMetadataBuilder

    # The order opts in to cross-layer, but no platform is verified yet (module docstring).
    CROSS_LAYER_PLATFORMS: tuple[str, ...] = ()

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Physical B,N,2,H,D (a token's K and V side by side), with layers B,L,N,2,H,D: the
        # upstream FlexAttention order. The kernel takes the token stride from the view.
        return (1, 0, 3, 2, 4, 5) if include_num_layers_dimension else (0, 2, 1, 3, 4)

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        if (config.dtype == torch.bfloat16 and device_capability is not None
                and not device_capability.at_least(_BF16_CAPABILITY)):
            return [f"dtype=bfloat16 needs device capability >= {_BF16_CAPABILITY} (got "
                    f"{device_capability}); use dtype=float16"]
        return []

    @classmethod
    def stale_bytes_reason(cls, device_type: str) -> str | None:
        if device_type != "cuda":
            return None
        return ("torch's compiled flex_attention kernel weights masked keys of a visited page "
                "by zero, and 0 * NaN is NaN: NaN/Inf in the unused tail of a request's last "
                "page reach its output (see the module docstring)")

    @classmethod
    def max_num_blocks(cls, block_size: int, num_kv_heads: int, head_size: int) -> int:
        """Most blocks a contiguous per-layer cache may have under :data:`MAX_KV_CACHE_SPAN`."""
        return cls.MAX_KV_CACHE_SPAN // (2 * block_size * num_kv_heads * head_size)

    @classmethod
    def kv_cache_size_reasons(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> list[str]:
        """Why a contiguous per-layer cache of these sizes cannot run (empty: it can).

        For engines to call before allocating; :meth:`FlexAttentionImpl.forward` applies the
        same limit to the actual view (its strides included).
        """
        elements = num_blocks * 2 * block_size * num_kv_heads * head_size
        if elements <= cls.MAX_KV_CACHE_SPAN:
            return []
        limit = cls.max_num_blocks(block_size, num_kv_heads, head_size)
        return [f"num_blocks={num_blocks}: one layer's cache would hold {elements} elements, "
                f"over FLEX_ATTENTION's limit of 2**31 ({_INT32_ISSUE}); use at most "
                f"{limit} blocks per layer at block_size={block_size}, "
                f"num_kv_heads={num_kv_heads}, head_size={head_size}, or another backend"]
