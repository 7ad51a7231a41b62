"""A small decoder-only transformer with fixed-seed random weights, for ``kvcore demo``.

Llama-shaped: token embedding, ``num_layers`` blocks of (RMSNorm, GQA self-attention with
rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an LM head. An MLA
config (``kv_lora_rank`` set) replaces GQA by DeepSeek-V2/V3's multi-head latent attention:
``kv_a_proj`` makes a normalised latent ``kv_c`` and a rotated rope key ``k_pe`` per token,
``kv_b_proj`` expands the latent to per-head keys and values. The model has no attention of
its own: :meth:`DemoModel.forward` hands each layer's projected ``q``, ``k``, ``v`` to a
callback, so one set of weights runs over kvcore's paged cache in the engine and over plain
contiguous K/V in the reference.

Tokens are *packed*: a step's new tokens of every request are concatenated along dim 0
(``(num_tokens,)`` ids and positions), the layout :class:`kvcore.AttentionMetadata` describes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcore.demo.config import DemoModelConfig

__all__ = ["AttendFn", "DemoModel", "contiguous_attention"]

#: ``attend(layer, q, k, v) -> out``: ``q`` ``(num_tokens, num_heads, head_size)``, ``k``/``v``
#: ``(num_tokens, num_kv_heads, head_size)``, ``out`` shaped like ``q``. MLA: ``q`` ``(num_tokens,
#: num_heads, head_size + qk_rope_head_dim)``, ``k`` = ``kv_c`` ``(num_tokens, kv_lora_rank)``,
#: ``v`` = ``k_pe`` ``(num_tokens, qk_rope_head_dim)`` (what an MLA backend caches), ``out``
#: ``(num_tokens, num_heads, v_head_dim)``.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in at least float32: bf16 squares lose the small components.
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, "rotate half" convention: ``x`` ``(num_tokens, heads, head_size)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DemoModel:
    """The weights of a demo model and its packed forward pass (inference only, no autograd).

    Weights are drawn once in float32 on the CPU from ``torch.Generator().manual_seed(seed)``,
    so every device and dtype gets the same model, rounded to ``dtype``. Matrices have
    standard deviation ``1 / sqrt(fan_in)``, which keeps activations and logits of order one:
    greedy decoding then has clear winners, not ties decided by rounding.
    """

    def __init__(self, config: DemoModelConfig, *, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        c = config

        def matrix(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
            return w.to(device=self.device, dtype=dtype)

        def norm_weight(size: int = c.hidden_size) -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(size, generator=gen)
            return w.to(device=self.device, dtype=dtype)

        def attention() -> dict[str, torch.Tensor]:
            if c.is_mla:
                return {
                    "wq": matrix(c.num_heads * (c.head_size + c.qk_rope_head_dim), c.hidden_size),
                    "kv_a_proj": matrix(c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
                    "kv_norm": norm_weight(c.kv_lora_rank),
                    "kv_b_proj": matrix(c.num_heads * (c.head_size + c.v_head_dim),
                                        c.kv_lora_rank),
                    "wo": matrix(c.hidden_size, c.num_heads * c.v_head_dim),
                }
            q_out, kv_out = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
            return {"wq": matrix(q_out, c.hidden_size), "wk": matrix(kv_out, c.hidden_size),
                    "wv": matrix(kv_out, c.hidden_size), "wo": matrix(c.hidden_size, q_out)}

        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen).to(
            device=self.device, dtype=dtype)
        self.layers = [
            {
                "attn_norm": norm_weight(),
                **attention(),
                "mlp_norm": norm_weight(),
                "w_gate": matrix(c.intermediate_size, c.hidden_size),
                "w_up": matrix(c.intermediate_size, c.hidden_size),
                "w_down": matrix(c.hidden_size, c.intermediate_size),
            }
            for _ in range(c.num_layers)
        ]
        self.final_norm = norm_weight()
        self.lm_head = matrix(c.vocab_size, c.hidden_size)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.rope_dim, 2, dtype=torch.float64)
                                           / c.rope_dim))
        self._inv_freq = inv_freq.to(self.device)

    def to(self, dtype: torch.dtype) -> DemoModel:
        """A copy with every weight cast to ``dtype`` (the float64 reference uses the rounded
        weights of a bf16 model, so both compute the same function)."""
        other = object.__new__(DemoModel)
        other.config, other.dtype, other.device = self.config, dtype, self.device
        other.embed = self.embed.to(dtype)
        other.layers = [{k: w.to(dtype) for k, w in layer.items()} for layer in self.layers]
        other.final_norm = self.final_norm.to(dtype)
        other.lm_head = self.lm_head.to(dtype)
        other._inv_freq = self._inv_freq
        return other

    def parameter_bytes(self) -> int:
        tensors = [self.embed, self.final_norm, self.lm_head,
                   *(w for layer in self.layers for w in layer.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        """Hidden states after the final norm, ``(num_tokens, hidden_size)``.

        Args:
            token_ids: ``(num_tokens,)`` int64, the packed new tokens of a step.
            positions: ``(num_tokens,)`` int64, each token's position in its own sequence.
            attend: runs attention for one layer (see :data:`AttendFn`); it sees the rotated
                ``q`` and ``k``, so a cache stores keys with their positions applied.
        """
        c = self.config
        n = token_ids.shape[0]
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = angles.cos().to(self.dtype)[:, None, :]
        sin = angles.sin().to(self.dtype)[:, None, :]
        x = self.embed[token_ids]
        for i, w in enumerate(self.layers):
            h = _rms_norm(x, w["attn_norm"], c.rms_eps)
            if c.is_mla:
                q = (h @ w["wq"].T).view(n, c.num_heads, c.head_size + c.qk_rope_head_dim)
                q_nope, q_pe = q.split([c.head_size, c.qk_rope_head_dim], dim=-1)
                q = torch.cat([q_nope, _rotate(q_pe, cos, sin)], dim=-1)
                latent = h @ w["kv_a_proj"].T
                kv_c = _rms_norm(latent[:, :c.kv_lora_rank], w["kv_norm"], c.rms_eps)
                k_pe = _rotate(latent[:, None, c.kv_lora_rank:], cos, sin)[:, 0]
                attn = attend(i, q.contiguous(), kv_c.contiguous(), k_pe.contiguous())
            else:
                q = (h @ w["wq"].T).view(n, c.num_heads, c.head_size)
                k = (h @ w["wk"].T).view(n, c.num_kv_heads, c.head_size)
                v = (h @ w["wv"].T).view(n, c.num_kv_heads, c.head_size)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
                attn = attend(i, q.contiguous(), k.contiguous(), v.contiguous())
            x = x + attn.reshape(n, -1) @ w["wo"].T
            h = _rms_norm(x, w["mlp_norm"], c.rms_eps)
            gate = torch.nn.functional.silu(h @ w["w_gate"].T)
            x = x + (gate * (h @ w["w_up"].T)) @ w["w_down"].T
        return _rms_norm(x, self.final_norm, c.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(num_tokens, vocab_size)`` logits of hidden states from :meth:`forward`."""
        return hidden @ self.lm_head.T


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Plain causal attention of one sequence over its contiguous K/V (the reference).

    ``q`` ``(seq_len, num_heads, head_size)``, ``k``/``v`` ``(seq_len, num_kv_heads,
    head_size)``; query ``i`` sees keys ``0..i``. Computed in ``q``'s dtype.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
