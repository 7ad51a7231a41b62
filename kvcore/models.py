"""Real models' attention shapes per tensor-parallel rank: what ``kvcore bench --model``,
``kvcore tune`` and ``benchmarks/bench_matrix.py`` time, and the selector configs each model's
layers ask for.

A :class:`ModelPreset` lists its attention layers by kind (:class:`LayerAttention`: all
layers of one kind share heads, head size, window, sinks and soft-cap), so a model whose
layers alternate a sliding window with full attention has two kinds. Shapes are per rank: at
tensor-parallel degree ``tp`` a rank holds ``num_heads / tp`` query heads and
``max(1, num_kv_heads / tp)`` KV heads (KV heads are replicated when there are fewer than
ranks). MLA layers cache one latent per token on every rank and split only the query heads.

Every number comes from the model's published ``config.json`` on the Hugging Face Hub (named
in :attr:`ModelPreset.source`); the transformers field names are given where they differ.

:meth:`ModelPreset.selector_configs` gives the :class:`~kvcore.AttentionSelectorConfig` of each
layer kind; :meth:`ModelPreset.cases` the benchmark steps: decode at two batch x context
points, a prefill, and one mixed chunked-prefill step (decodes beside a prompt chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore.config import AttentionSelectorConfig

__all__ = ["MODELS", "LayerAttention", "MLADims", "ModelCase", "ModelPreset", "get_model"]


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention sizes (DeepSeek's ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``). The cache holds ``kv_lora_rank + qk_rope_head_dim``
    channels per token."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_size(self) -> int:
        """Channels cached per token: the MLA layer's ``head_size`` (512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LayerAttention:
    """One kind of attention layer of a model, on one tensor-parallel rank.

    Attributes:
        kind: a short name, e.g. ``"full"``, ``"sliding"``, ``"mla"``.
        num_layers: layers of this kind in the model.
        num_heads: query heads on the rank.
        num_kv_heads: KV heads on the rank (1 for MLA: one latent per token).
        head_size: size of one K head (MLA: the latent, ``kv_lora_rank + qk_rope_head_dim``).
        head_size_v: size of one V head where it differs from ``head_size`` (MLA:
            ``v_head_dim``), else ``None``.
        sliding_window: tokens each query sees, itself included (``None``: all).
        has_sink: a learned sink logit per head (gpt-oss).
        logits_soft_cap: ``cap * tanh(score / cap)`` before the softmax (Gemma 2), or ``None``.
        scale: the softmax scale (default ``head_size ** -0.5``; MLA ``(qk_nope + rope) ** -0.5``).
        mla: the MLA sizes, or ``None`` for K/V attention.
    """

    kind: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    sliding_window: int | None = None
    has_sink: bool = False
    logits_soft_cap: float | None = None
    scale: float | None = None
    mla: MLADims | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.kind}: {name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.kind}: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.mla is not None and (self.num_kv_heads != 1
                                     or self.head_size != self.mla.latent_size):
            raise ValueError(f"{self.kind}: an MLA layer caches one latent per token: "
                             f"num_kv_heads=1 and head_size={self.mla.latent_size} "
                             f"(kv_lora_rank + qk_rope_head_dim), got {self.num_kv_heads} and "
                             f"{self.head_size}")

    @property
    def softmax_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        if self.mla is not None:
            return (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** -0.5
        return self.head_size ** -0.5

    def describe(self) -> str:
        """``Hq=32 Hk=8 D=128 window=4096 sinks soft-cap=50`` (only what the layer has)."""
        if self.mla is not None:
            m = self.mla
            text = (f"MLA Hq={self.num_heads} latent={m.kv_lora_rank}+{m.qk_rope_head_dim} "
                    f"v={m.v_head_dim}")
        else:
            text = f"Hq={self.num_heads} Hk={self.num_kv_heads} D={self.head_size}"
            if self.head_size_v is not None:
                text += f" Dv={self.head_size_v}"
        if self.sliding_window is not None:
            text += f" window={self.sliding_window}"
        if self.has_sink:
            text += " sinks"
        if self.logits_soft_cap is not None:
            text += f" soft-cap={self.logits_soft_cap:g}"
        return text

    def selector_config(self, dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto",
                        block_size: int = 16) -> AttentionSelectorConfig:
        """The selector config of this layer kind: sinks and the soft-cap are fields (a
        backend must declare them), the per-rank head counts too (they pick the measured
        cases that speak for it); the window is the layer's own
        (``AttentionImpl(sliding_window=...)``), not part of it."""
        return AttentionSelectorConfig(head_size=self.head_size, dtype=dtype,
                                       kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                                       use_mla=self.mla is not None, has_sink=self.has_sink,
                                       has_logits_soft_cap=self.logits_soft_cap is not None,
                                       num_heads=self.num_heads,
                                       num_kv_heads=self.num_kv_heads)

    def scaled_down(self) -> LayerAttention:
        """The same kind of layer with few heads (at most 4 query heads, the GQA ratio kept
        where it fits) and a window of at most 32 tokens, for CPU runs (``--small``). The
        head size is kept: it decides which backends can run the layer."""
        ratio = self.num_heads // self.num_kv_heads
        kv = 1 if self.mla is not None else max(1, 4 // ratio)
        heads = min(self.num_heads, kv * min(ratio, 4))
        window = None if self.sliding_window is None else min(self.sliding_window, 32)
        return LayerAttention(self.kind, self.num_layers, heads, kv, self.head_size,
                              self.head_size_v, window, self.has_sink, self.logits_soft_cap,
                              self.scale, self.mla)


@dataclass(frozen=True)
class ModelCase:
    """One benchmark step: ``q_lens[i]`` new tokens of request ``i`` after ``ctx_lens[i]``
    cached ones; ``phase`` is ``decode``, ``prefill`` or ``mixed``."""

    phase: str
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def kv_tokens(self) -> int:
        """Tokens of K/V the step reads (each request's whole context, new tokens included)."""
        return sum(q + c for q, c in zip(self.q_lens, self.ctx_lens, strict=True))

    def attended_pairs(self, sliding_window: int | None = None) -> int:
        """(query, key) pairs the step computes, causal, within the window when given."""
        pairs = 0
        for q, c in zip(self.q_lens, self.ctx_lens, strict=True):
            if sliding_window is None:
                pairs += q * c + q * (q + 1) // 2
            else:
                pairs += sum(min(c + i + 1, sliding_window) for i in range(q))
        return pairs


def _decode(batch: int, context: int) -> ModelCase:
    return ModelCase("decode", f"decode {batch}x{context}", (1,) * batch,
                     (context - 1,) * batch)


def _prefill(batch: int, tokens: int) -> ModelCase:
    return ModelCase("prefill", f"prefill {batch}x{tokens}", (tokens,) * batch, (0,) * batch)


def _mixed(decodes: int, context: int, chunk: int, cached: int) -> ModelCase:
    return ModelCase("mixed", f"mixed {decodes}x{context} + {chunk} over {cached}",
                     (1,) * decodes + (chunk,), (context - 1,) * decodes + (cached,))


#: The serving-sized steps (on a GPU): decode at 64 x 4096 and 8 x 32768, a 4 x 2048 prefill,
#: and a chunked-prefill step (32 decodes at 4096 beside a 2048-token chunk over 2048 cached).
FULL_CASES = (_decode(64, 4096), _decode(8, 32768), _prefill(4, 2048),
              _mixed(32, 4096, 2048, 2048))
#: The same four kinds of step, small enough for a CPU in seconds (``--small``).
SMALL_CASES = (_decode(4, 256), _decode(2, 1024), _prefill(2, 64), _mixed(3, 256, 32, 64))


@dataclass(frozen=True)
class ModelPreset:
    """A model's attention per tensor-parallel rank (see the module docstring).

    Attributes:
        name: the preset's name, e.g. ``"llama-3.1-70b-tp8"``.
        model: the model's Hugging Face id.
        tp: tensor-parallel degree the shapes are for.
        layers: the layer kinds, in the order of the model's first layers.
        pattern: how the kinds are laid out over the layers (e.g. alternating).
        dtype: the model's dtype (``torch_dtype`` of its config).
        source: where the numbers come from.
    """

    name: str
    model: str
    tp: int
    layers: tuple[LayerAttention, ...]
    pattern: str
    source: str
    dtype: torch.dtype = torch.bfloat16
    cases_full: tuple[ModelCase, ...] = field(default=FULL_CASES, repr=False)

    #: The KV-cache dtypes every preset is benchmarked with: the model's dtype and fp8 e4m3
    #: (the most common production setting).
    KV_CACHE_DTYPES: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3")
    #: The block size the peers prefer: 64 is the largest FLASHINFER and FLASHINFER_MLA accept
    #: and the only one FlashMLA takes.
    PEER_BLOCK_SIZE: ClassVar[int] = 64
    #: Block sizes every preset is benchmarked with: kvcore's (and vLLM's) default 16, and 64.
    BLOCK_SIZES: ClassVar[tuple[int, ...]] = (16, 64)

    @property
    def num_layers(self) -> int:
        return sum(layer.num_layers for layer in self.layers)

    def layer(self, kind: str) -> LayerAttention:
        for layer in self.layers:
            if layer.kind == kind:
                return layer
        raise ValueError(f"{self.name} has no layer kind {kind!r} (it has "
                         f"{', '.join(x.kind for x in self.layers)})")

    def selector_configs(self, kv_cache_dtype: str = "auto", block_size: int = 16
                         ) -> dict[str, AttentionSelectorConfig]:
        """The selector config of each layer kind, keyed by kind."""
        return {layer.kind: layer.selector_config(self.dtype, kv_cache_dtype, block_size)
                for layer in self.layers}

    def cases(self, small: bool = False) -> tuple[ModelCase, ...]:
        """The benchmark steps: decode at two points, a prefill and a mixed step."""
        return SMALL_CASES if small else self.cases_full

    def scaled_down(self) -> ModelPreset:
        """The preset with every layer kind :meth:`LayerAttention.scaled_down`."""
        return ModelPreset(self.name, self.model, self.tp,
                           tuple(layer.scaled_down() for layer in self.layers), self.pattern,
                           self.source, self.dtype, self.cases_full)

    def describe(self) -> str:
        kinds = "; ".join(f"{x.num_layers} x {x.kind}: {x.describe()}" for x in self.layers)
        return f"{self.name} ({self.model}, TP {self.tp}, {self.num_layers} layers: {kinds})"


def _per_rank(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    if heads % tp:
        raise ValueError(f"{heads} query heads do not split over tp={tp}")
    return heads // tp, max(1, kv_heads // tp)


def _dense(name: str, model: str, source: str, *, layers: int, heads: int, kv_heads: int,
           head_size: int = 128, tp: int = 1, window: int | None = None) -> ModelPreset:
    hq, hk = _per_rank(heads, kv_heads, tp)
    kind = "full" if window is None else "sliding"
    return ModelPreset(name, model, tp,
                       (LayerAttention(kind, layers, hq, hk, head_size, sliding_window=window),),
                       f"all {layers} layers {kind}", source)


def _alternating(name: str, model: str, source: str, *, layers: int, heads: int,
                 kv_heads: int, head_size: int, window: int, has_sink: bool = False,
                 soft_cap: float | None = None, tp: int = 1) -> ModelPreset:
    hq, hk = _per_rank(heads, kv_heads, tp)
    common = dict(num_heads=hq, num_kv_heads=hk, head_size=head_size, has_sink=has_sink,
                  logits_soft_cap=soft_cap)
    sliding = LayerAttention("sliding", layers - layers // 2, sliding_window=window, **common)
    full = LayerAttention("full", layers // 2, **common)
    return ModelPreset(name, model, tp, (sliding, full),
                       "alternating: even layers (0, 2, ...) sliding, odd layers full", source)


def _deepseek_v3(tp: int) -> ModelPreset:
    # DeepSeek-V3 config.json: num_hidden_layers 61, num_attention_heads 128, kv_lora_rank 512,
    # qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; torch_dtype bfloat16 (the
    # checkpoint's weights are fp8, the activations and the cache bf16).
    dims = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    heads, _ = _per_rank(128, 1, tp)
    return ModelPreset(
        f"deepseek-v3-tp{tp}", "deepseek-ai/DeepSeek-V3", tp,
        (LayerAttention("mla", 61, heads, 1, dims.latent_size, head_size_v=dims.v_head_dim,
                        mla=dims),),
        "all 61 layers MLA", "huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json")


def _hub(model: str) -> str:
    return f"huggingface.co/{model}/blob/main/config.json"


#: Every preset by name (``kvcore bench --model NAME``, ``kvcore tune --model NAME``).
MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    # 32 layers, 32 heads, 8 KV heads, hidden 4096 (head_dim 4096 / 32 = 128).
    _dense("llama-3.1-8b", "meta-llama/Llama-3.1-8B", _hub("meta-llama/Llama-3.1-8B"),
           layers=32, heads=32, kv_heads=8),
    # 80 layers, 64 heads, 8 KV heads, hidden 8192 (head_dim 128); TP 8: 8 heads, 1 KV head.
    _dense("llama-3.1-70b-tp8", "meta-llama/Llama-3.1-70B", _hub("meta-llama/Llama-3.1-70B"),
           layers=80, heads=64, kv_heads=8, tp=8),
    # 28 layers, 28 heads, 4 KV heads (GQA 7:1), hidden 3584 (head_dim 128);
    # use_sliding_window false.
    _dense("qwen2.5-7b", "Qwen/Qwen2.5-7B", _hub("Qwen/Qwen2.5-7B"),
           layers=28, heads=28, kv_heads=4),
    # Mistral-7B-v0.1: 32 layers, 32 heads, 8 KV heads, hidden 4096, sliding_window 4096 on
    # every layer (v0.2 and later dropped the window).
    _dense("mistral-7b", "mistralai/Mistral-7B-v0.1", _hub("mistralai/Mistral-7B-v0.1"),
           layers=32, heads=32, kv_heads=8, window=4096),
    # 42 layers, 16 heads, 8 KV heads, head_dim 256, attn_logit_softcapping 50.0,
    # sliding_window 4096 on the even layers (layer_types), query_pre_attn_scalar 256 (the
    # scale is 256 ** -0.5 = head_size ** -0.5).
    _alternating("gemma-2-9b", "google/gemma-2-9b", _hub("google/gemma-2-9b"),
                 layers=42, heads=16, kv_heads=8, head_size=256, window=4096, soft_cap=50.0),
    # 24 layers, 64 heads, 8 KV heads, head_dim 64, sliding_window 128 on the even layers
    # (layer_types: sliding_attention first), a learned sink per head (self_attn.sinks).
    _alternating("gpt-oss-20b", "openai/gpt-oss-20b", _hub("openai/gpt-oss-20b"),
                 layers=24, heads=64, kv_heads=8, head_size=64, window=128, has_sink=True),
    # 48 layers, 32 heads, 4 KV heads, head_dim 128 (hidden 2048: the heads are wider than
    # hidden / heads); use_sliding_window false.
    _dense("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", _hub("Qwen/Qwen3-30B-A3B"),
           layers=48, heads=32, kv_heads=4),
    _deepseek_v3(8),
    _deepseek_v3(1),
)}


def get_model(name: str) -> ModelPreset:
    """The preset ``name`` (case-insensitive); a ``ValueError`` listing the names if unknown."""
    key = name.strip().lower()
    if key not in MODELS:
        raise ValueError(f"model={name!r} is not a preset; choose from: {', '.join(MODELS)}")
    return MODELS[key]
