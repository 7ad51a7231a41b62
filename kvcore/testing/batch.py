"""Random inputs for the conformance checks: a mixed batch over a paged cache.

Everything is drawn from a seeded CPU generator and then moved to the device, so a failing case
reproduces on any machine from its id alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcore.config import parse_dtype
from kvcore.metadata import AttentionMetadata, build_attention_metadata
from kvcore.platform_types import AttentionType

__all__ = ["CaseConfig", "MLADims", "MixedBatch", "make_mixed_batch", "mla_dims", "random_like",
           "short_dtype"]

#: Query heads and KV heads of every batch: GQA with 4 query heads per KV head.
NUM_HEADS = 8
NUM_KV_HEADS = 2
#: Padding rows appended after the real tokens (slot -1, beyond ``num_actual_tokens``).
NUM_PADDING_TOKENS = 2

_SHORT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                 torch.float64: "fp64"}


def short_dtype(dtype: torch.dtype) -> str:
    """``bf16`` for ``torch.bfloat16``: the form used in case ids."""
    return _SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class CaseConfig:
    """The attention configuration one numerical case runs."""

    dtype: torch.dtype
    head_size: int
    block_size: int
    kv_cache_dtype: str = "auto"
    causal: bool = True
    #: The layer's ``sliding_window`` (``None``: every key up to the query).
    sliding_window: int | None = None
    #: The layer's ``attn_type``; any other than ``DECODER`` attends without the causal mask.
    attn_type: AttentionType = AttentionType.DECODER
    #: The layer's ``logits_soft_cap`` (``None``: no soft-cap).
    logits_soft_cap: float | None = None
    #: Whether the layer has attention sinks (random logits per query head, from the seed).
    has_sink: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "attn_type", AttentionType(self.attn_type))

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def label(self) -> str:
        """Readable id part, e.g. ``bf16-D64-bs16`` or ``bf16-D64-bs16-fp8_e4m3``."""
        parts = [short_dtype(self.dtype), f"D{self.head_size}", f"bs{self.block_size}"]
        if self.is_fp8:
            parts.append(self.kv_cache_dtype)
        if not self.causal:
            parts.append("noncausal")
        if self.sliding_window is not None:
            parts.append(f"window{self.sliding_window}")
        if self.attn_type is not AttentionType.DECODER:
            parts.append(self.attn_type.value)
        if self.logits_soft_cap is not None:
            parts.append(f"softcap{self.logits_soft_cap:g}")
        if self.has_sink:
            parts.append("sinks")
        return "-".join(parts)

    def describe(self, mla: bool = False) -> str:
        if mla:
            d = mla_dims(self.head_size)
            return (f"dtype={short_dtype(self.dtype)}, MLA latent {self.head_size} = "
                    f"kv_lora_rank {d.kv_lora_rank} + rope {d.qk_rope_head_dim}, "
                    f"qk_nope_head_dim={d.qk_nope_head_dim}, v_head_dim={d.v_head_dim}, "
                    f"block_size={self.block_size}, kv_cache_dtype={self.kv_cache_dtype}, "
                    f"num_heads={NUM_HEADS}")
        extra = "".join(
            [f", sliding_window={self.sliding_window}" if self.sliding_window else "",
             f", attn_type={self.attn_type.value}"
             if self.attn_type is not AttentionType.DECODER else "",
             f", logits_soft_cap={self.logits_soft_cap:g}"
             if self.logits_soft_cap is not None else "",
             ", sinks (one logit per query head)" if self.has_sink else ""])
        return (f"dtype={short_dtype(self.dtype)}, head_size={self.head_size}, "
                f"block_size={self.block_size}, kv_cache_dtype={self.kv_cache_dtype}, "
                f"causal={self.causal}{extra}, num_heads={NUM_HEADS}, "
                f"num_kv_heads={NUM_KV_HEADS}")


@dataclass(frozen=True)
class MLADims:
    """The model dims of an MLA case; ``kv_lora_rank + qk_rope_head_dim`` is the latent size."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


def mla_dims(head_size: int) -> MLADims:
    """MLA dims for a latent of ``head_size`` channels: DeepSeek's rope dim (64) for a
    DeepSeek-sized latent, 16 for the small ones of CPU runs; the nope and value dims differ
    from each other and from the rank, so a swapped dim shows."""
    rope = 64 if head_size >= 512 else (16 if head_size > 32 else head_size // 2)
    return MLADims(kv_lora_rank=head_size - rope, qk_rope_head_dim=rope, qk_nope_head_dim=32,
                   v_head_dim=24)


def random_like(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> torch.Tensor:
    """Standard-normal values of ``shape`` in ``dtype`` (fp8 included) on ``device``."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


@dataclass
class MixedBatch:
    """One step of a batch mixing decode and prefill requests.

    Attributes:
        query: ``(num_tokens + NUM_PADDING_TOKENS, NUM_HEADS, head_size)``.
        key, value: ``(num_tokens + NUM_PADDING_TOKENS, NUM_KV_HEADS, head_size)``.
        metadata: ``num_actual_tokens == num_tokens``; the padding rows have slot -1.
        kinds: what each request is (``"decode"``, ``"prefill with cached prefix"``, ...).
        num_blocks: blocks the cache must have (the block tables use ids below it).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    metadata: AttentionMetadata
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    kinds: list[str]
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.metadata.num_actual_tokens

    def locate(self, token: int) -> str:
        """Which request and query position a packed token row belongs to."""
        start = 0
        for i, q_len in enumerate(self.query_lens):
            if token < start + q_len:
                position = self.context_lens[i] + token - start
                return f"request {i} ({self.kinds[i]}), token at position {position}"
            start += q_len
        return f"padding row {token - start}"

    def describe(self) -> str:
        requests = "; ".join(
            f"{i}: {kind}, {ctx} cached + {q} new tokens, blocks {table}"
            for i, (kind, ctx, q, table) in enumerate(
                zip(self.kinds, self.context_lens, self.query_lens, self.block_tables,
                    strict=True))
        )
        return f"batch of {len(self.kinds)} requests ({requests}); {self.num_blocks} blocks"


def make_mixed_batch(
    config: CaseConfig, device: torch.device, gen: torch.Generator, extra_blocks: int = 3
) -> MixedBatch:
    """A decode with a long context, a decode that fills its block, a prefill with a cached
    prefix that crosses a block boundary, and a fresh prefill; block ids shuffled.

    For a layer that is not a decoder (``config.attn_type``): four fresh prefills of those
    lengths instead, since such a layer has no cached context to attend to.
    """
    bs = config.block_size
    requests = [
        (3 * bs + 5, 1, "decode"),
        (bs - 1, 1, "decode filling its block"),
        (bs + 3, bs // 2 + 3, "prefill with cached prefix"),
        (0, bs + 1, "prefill"),
    ]
    if config.attn_type is not AttentionType.DECODER:
        requests = [(0, ctx + q, "prefill") for ctx, q, _ in requests]
    needed = [-(-(ctx + q) // bs) for ctx, q, _ in requests]
    num_blocks = sum(needed) + extra_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start:start + n])
        start += n
    context_lens = [ctx for ctx, _, _ in requests]
    query_lens = [q for _, q, _ in requests]
    metadata = build_attention_metadata(query_lens, context_lens, tables, bs, device=device,
                                        causal=config.causal)
    padding = torch.full((NUM_PADDING_TOKENS,), -1, dtype=torch.int64, device=device)
    metadata = dataclasses.replace(
        metadata, slot_mapping=torch.cat([metadata.slot_mapping, padding]))
    rows = metadata.num_actual_tokens + NUM_PADDING_TOKENS
    d = config.head_size
    return MixedBatch(
        query=random_like((rows, NUM_HEADS, d), config.dtype, device, gen),
        key=random_like((rows, NUM_KV_HEADS, d), config.dtype, device, gen),
        value=random_like((rows, NUM_KV_HEADS, d), config.dtype, device, gen),
        metadata=metadata,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        kinds=[kind for _, _, kind in requests],
        num_blocks=num_blocks,
    )


def random_slot_mapping(num_tokens: int, num_slots: int, gen: torch.Generator,
                        dtype: torch.dtype = torch.int64, *, pad: bool = True) -> torch.Tensor:
    """``(num_tokens,)`` distinct random slots of ``range(num_slots)`` in ``dtype``, on the CPU;
    every fifth token (from the first) is padding (``-1``) when ``pad``. For cache-write
    tests."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    if pad:
        slots[::5] = -1
    return slots.to(dtype)


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                        gen: torch.Generator, *, shared_prefix: int = 0) -> list[list[int]]:
    """Shuffled, distinct block ids for each request, as an engine's block tables.

    Request ``i`` gets ``ceil(seq_lens[i] / block_size)`` blocks drawn from a random
    permutation of ``range(num_blocks)``, so pages are neither contiguous nor ordered; the first
    ``shared_prefix`` blocks of every request are the same pages (prefix caching).

    Raises:
        ValueError: the requests need more than ``num_blocks`` blocks.
    """
    need = [-(-n // block_size) - shared_prefix for n in seq_lens]
    if shared_prefix + sum(need) > num_blocks:
        raise ValueError(f"the requests need {shared_prefix + sum(need)} blocks of {block_size} "
                         f"tokens but num_blocks={num_blocks}")
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared, rest = perm[:shared_prefix], perm[shared_prefix:]
    tables = []
    for n in need:
        tables.append(shared + rest[:n])
        rest = rest[n:]
    return tables
