"""Sizes of the demo model and its ``--model`` presets.

Kept apart from :mod:`kvcore.demo.model` (which needs torch) so that the ``kvcore`` command can
offer the preset names in its ``--help`` without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MODEL_PRESETS", "DemoModelConfig"]


@dataclass(frozen=True)
class DemoModelConfig:
    """Sizes of a :class:`DemoModel`; ``num_heads`` must be a multiple of ``num_kv_heads``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name in ("rope_theta", "rms_eps"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_size % 2:
            raise ValueError(f"head_size={self.head_size} must be even (rotary embeddings "
                             "rotate pairs of dims)")

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} query / "
                f"{self.num_kv_heads} KV heads of {self.head_size}, vocab {self.vocab_size}")


#: ``--model`` sizes. ``tiny`` and ``small`` run in seconds on a CPU; ``large`` is for a GPU.
MODEL_PRESETS: dict[str, DemoModelConfig] = {
    "tiny": DemoModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_size=32, intermediate_size=256),
    "small": DemoModelConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                             num_kv_heads=2, head_size=64, intermediate_size=512),
    "medium": DemoModelConfig(vocab_size=2048, hidden_size=1024, num_layers=8, num_heads=16,
                              num_kv_heads=4, head_size=64, intermediate_size=2816),
    "large": DemoModelConfig(vocab_size=8192, hidden_size=2048, num_layers=16, num_heads=16,
                             num_kv_heads=4, head_size=128, intermediate_size=5632),
}
