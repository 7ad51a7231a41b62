"""The attention configuration a backend is selected and validated for."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvcore.dtypes import KV_CACHE_DTYPES, parse_dtype
from kvcore.platform_types import AttentionType

__all__ = ["HEAD_COUNT_FIELDS", "AttentionSelectorConfig"]

#: The config's optional per-rank head counts: facts about speed, not validity.
HEAD_COUNT_FIELDS = ("num_heads", "num_kv_heads")


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """Everything about an attention layer that decides which backend may run it (and, with
    the head counts, which one runs it fastest).

    Frozen and hashable, so selections can be cached per config. ``dtype`` accepts a
    ``torch.dtype`` or its name; ``attn_type`` an :class:`AttentionType` or its value.
    ``has_sink``: a learned sink logit per query head joins the softmax (gpt-oss);
    ``has_logits_soft_cap``: scores are capped as ``cap * tanh(score / cap)`` (Gemma 2).
    ``num_heads`` / ``num_kv_heads``: query and KV heads of the layer on this rank (after
    tensor parallelism; an MLA layer caches one latent head), when the engine knows them.
    They decide no backend's validity, only speed: a measured ranking prefers the cases
    timed with the same head counts (Llama-3-70B at TP 8 keeps one KV head per rank, and
    the fastest backend there is not the one at eight). ``None``: not given, every head
    count's cases speak.
    """

    head_size: int
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    use_mm_prefix: bool = False
    use_per_head_quant_scales: bool = False
    attn_type: AttentionType = AttentionType.DECODER
    use_non_causal: bool = False
    use_batch_invariant: bool = False
    use_kv_connector: bool = False
    has_logits_soft_cap: bool = False
    num_heads: int | None = None
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "attn_type", AttentionType(self.attn_type))
        for name in ("head_size", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in HEAD_COUNT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive integer or None "
                                 "(not given)")
        if self.num_heads is not None and self.num_kv_heads is not None \
                and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}: each KV head serves a whole group of query heads; give "
                "the per-rank counts of the layer")
        for f in fields(self):
            value = getattr(self, f.name)
            # A string such as "no" would read as True: the flags must be real booleans.
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(
                    f"{f.name}={value!r} must be a bool (True or False), got "
                    f"{type(value).__name__}"
                )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} (supported: {', '.join(KV_CACHE_DTYPES)})"
            )

    def as_kwargs(self) -> dict[str, object]:
        """The fields as keyword arguments of ``AttentionBackend.validate_configuration``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        """One line naming every field, for error messages and logs."""
        parts = []
        for key, value in self.as_kwargs().items():
            if key in HEAD_COUNT_FIELDS and value is None:
                continue  # not given: nothing to name
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, AttentionType):
                value = value.value
            parts.append(f"{key}={value}")
        return ", ".join(parts)
