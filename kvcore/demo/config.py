"""Sizes of the demo model and its ``--model`` presets.

Kept apart from :mod:`kvcore.demo.model` (which needs torch) so that the ``kvcore`` command can
offer the preset names in its ``--help`` without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MODEL_PRESETS", "DemoModelConfig"]


@dataclass(frozen=True)
class DemoModelConfig:
    """Sizes of a :class:`DemoModel`; ``num_heads`` must be a multiple of ``num_kv_heads``.

    With ``kv_lora_rank`` set the model's attention is MLA (DeepSeek-V2/V3 style): ``head_size``
    is then the query/key "nope" dim, each token caches one latent of ``kv_lora_rank +
    qk_rope_head_dim`` channels, values have ``v_head_dim`` channels, ``num_kv_heads`` is 1.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        mla = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
        for name, value in asdict(self).items():
            if name in ("rope_theta", "rms_eps") or (name in mla and not self.kv_lora_rank):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.is_mla and (self.num_kv_heads != 1 or self.qk_rope_head_dim % 2):
            raise ValueError(f"an MLA model has num_kv_heads=1 (got {self.num_kv_heads}) and an "
                             f"even qk_rope_head_dim (got {self.qk_rope_head_dim})")
        if self.head_size % 2:
            raise ValueError(f"head_size={self.head_size} must be even (rotary embeddings "
                             "rotate pairs of dims)")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cache_head_size(self) -> int:
        """Channels a token takes in one layer's cache per KV head (MLA: the latent)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_size

    @property
    def rope_dim(self) -> int:
        """Dims the rotary embedding rotates (MLA: only the rope part of q and k)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_size

    @property
    def attn_scale(self) -> float:
        return (self.head_size + self.qk_rope_head_dim) ** -0.5

    def describe(self) -> str:
        if self.is_mla:
            return (f"{self.num_layers} layers, hidden {self.hidden_size}, MLA: {self.num_heads} "
                    f"heads, latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}, "
                    f"qk_nope {self.head_size}, v {self.v_head_dim}, vocab {self.vocab_size}")
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} query / "
                f"{self.num_kv_heads} KV heads of {self.head_size}, vocab {self.vocab_size}")


#: ``--model`` sizes. ``tiny``, ``small`` and ``mla-small`` (MLA attention) run in seconds on a
#: CPU; ``large`` is for a GPU.
MODEL_PRESETS: dict[str, DemoModelConfig] = {
    "tiny": DemoModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_size=32, intermediate_size=256),
    "small": DemoModelConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                             num_kv_heads=2, head_size=64, intermediate_size=512),
    "medium": DemoModelConfig(vocab_size=2048, hidden_size=1024, num_layers=8, num_heads=16,
                              num_kv_heads=4, head_size=64, intermediate_size=2816),
    "large": DemoModelConfig(vocab_size=8192, hidden_size=2048, num_layers=16, num_heads=16,
                             num_kv_heads=4, head_size=128, intermediate_size=5632),
    "mla-small": DemoModelConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                                 num_kv_heads=1, head_size=32, intermediate_size=512,
                                 kv_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32),
}
