"""The MLA common base: the latent-cache layout and the absorbed forward of every MLA backend
(CPU_MLA here, TRITON_MLA and others in plugins), public as ``kvcore.MLACommonBackend`` /
``kvcore.MLACommonImpl``.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) caches one latent per
token, ``[kv_c, k_pe]`` of ``kv_lora_rank + rope_dim`` channels (512 + 64), shared by all heads:
the cache's logical shape is ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, dims
``B,N,D``, with no K/V split. Per head, the model's keys and values are
``k = [W_UK c, k_pe]`` and ``v = W_UV c`` (``W_UK``, ``W_UV``: the two halves of
``kv_b_proj``).

:class:`MLACommonImpl` computes attention in latent space for every request, prefill
included ("absorbed"): ``q_latent = [W_UK^T q_nope, q_pe]`` scores against the cached latents
directly (``q_latent . [c, k_pe] = q_nope . W_UK c + q_pe . k_pe``), the attention-weighted sum
of the latents' first ``kv_lora_rank`` channels is taken, and ``W_UV`` maps it to each head's
output. It is exactly the model's attention, needs no per-head K/V expansion (no extra memory,
one code path for mixed batches), and reads each latent once per head block; the price is
compute on long prefills: per score it spends ``kv_lora_rank + rope_dim`` (576) multiply-adds
instead of ``qk_nope + rope`` (192), which a prefill-specialised backend may avoid by expanding
K/V instead.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from kvcore.backend import AttentionBackend
from kvcore.impl import AttentionImpl
from kvcore.metadata import AttentionLayer, AttentionMetadata
from kvcore.platform_types import AttentionType

__all__ = ["MLACommonBackend", "MLACommonImpl", "latent_cache_shape"]


def latent_cache_shape(
    owner: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int]:
    """``(num_blocks, block_size, head_size)``: one entry of ``head_size`` per token.

    ``owner`` (a backend name) appears in the error when ``num_kv_heads`` is not 1.
    """
    if num_kv_heads != 1:
        raise ValueError(
            f"num_kv_heads={num_kv_heads}: a {owner} cache holds one entry per token, shared by "
            "all heads; pass num_kv_heads=1 and the entry size as head_size (MLA: "
            "kv_lora_rank + rope_dim, e.g. 576)"
        )
    return (num_blocks, block_size, head_size)


class MLACommonBackend(AttentionBackend):
    """Base of the MLA backends: latent-cache layout and shared capabilities.

    Opted out of cross-layer KV caches: ``get_kv_cache_stride_order(True)`` keeps the layer dim
    outermost, so a new MLA backend is safe by default. A backend opts in by returning
    ``(1, 0, 2, 3)`` once all its kernels are shown bit-exact on a per-layer view of a
    cross-layer pool (the conformance suite's ``cross-layer`` cases check exactly that).
    """

    IS_MLA = True
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """``(num_blocks, block_size, head_size)``; ``head_size = kv_lora_rank + rope_dim`` and
        ``num_kv_heads`` must be 1."""
        return latent_cache_shape("MLA", num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Identity (``B,N,D``; with layers ``L,B,N,D``): not cross-layer, see the class doc."""
        return (0, 1, 2, 3) if include_num_layers_dimension else (0, 1, 2)


class MLACommonImpl(AttentionImpl):
    """Per-layer MLA state and the absorbed forward (see the module docstring).

    Shapes: ``query`` ``(num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim)``; the
    cache ``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``; the output
    ``(num_tokens, num_heads, v_head_dim)``. For :meth:`do_kv_cache_update` the ``key`` is
    ``kv_c`` ``(num_tokens, kv_lora_rank)`` and the ``value`` is ``k_pe`` ``(num_tokens,
    qk_rope_head_dim)`` (or ``(num_tokens, 1, qk_rope_head_dim)``); the fp8 scale of the
    latent cache is ``layer.k_scale``. :meth:`forward` does not read ``key`` and ``value``
    (the latents come from the cache): pass ``None``. A backend implements
    :meth:`write_kv_cache` and :meth:`_latent_attention`.

    Args:
        num_heads: query heads of this layer (on this rank).
        head_size: the latent size ``kv_lora_rank + qk_rope_head_dim``, as for allocation.
        scale: softmax scale of the model's ``q . k`` (usually
            ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times the YaRN factor).
        num_kv_heads: must be 1 (one latent per token).
        sliding_window: must be ``None``.
        kv_cache_dtype: ``"auto"`` or an fp8 name the backend supports.
        attn_type: must be ``decoder``.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: the model's MLA dims
            (DeepSeek-V3: 512, 128, 64, 128).
        kv_b_proj_weight: ``(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)``,
            the checkpoint's ``kv_b_proj.weight`` (per head: the ``W_UK`` rows, then the
            ``W_UV`` rows), in the model dtype. Kept by reference, not copied.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = 1,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        attn_type: AttentionType | str = AttentionType.DECODER,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_b_proj_weight: torch.Tensor,
    ) -> None:
        if num_kv_heads not in (None, 1):
            raise ValueError(f"num_kv_heads={num_kv_heads}: MLA has one latent per token (1)")
        if sliding_window is not None:
            raise ValueError(f"sliding_window={sliding_window}: MLA backends support None only")
        if AttentionType(attn_type) != AttentionType.DECODER:
            raise ValueError(f"attn_type={AttentionType(attn_type).value}: MLA backends "
                             "support decoder only")
        super().__init__(num_heads, head_size, scale, 1, None, kv_cache_dtype, attn_type)
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if head_size != kv_lora_rank + qk_rope_head_dim:
            raise ValueError(
                f"head_size={head_size} must be the latent size kv_lora_rank + qk_rope_head_dim "
                f"= {kv_lora_rank} + {qk_rope_head_dim} = {kv_lora_rank + qk_rope_head_dim}"
            )
        expected = (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)
        is_tensor = isinstance(kv_b_proj_weight, torch.Tensor)
        if not is_tensor or tuple(kv_b_proj_weight.shape) != expected:
            got = tuple(kv_b_proj_weight.shape) if is_tensor else type(kv_b_proj_weight).__name__
            raise ValueError(
                f"kv_b_proj_weight has shape {got}; expected (num_heads * (qk_nope_head_dim + "
                f"v_head_dim), kv_lora_rank) = {expected}"
            )
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        w = kv_b_proj_weight.view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)
        #: ``(num_heads, qk_nope_head_dim, kv_lora_rank)``: ``q_latent = q_nope @ W_UK``.
        self.w_uk = w[:, :qk_nope_head_dim]
        #: ``(num_heads, kv_lora_rank, v_head_dim)``: ``out = o_latent @ W_UV^T``.
        self.w_uv_t = w[:, qk_nope_head_dim:].transpose(1, 2)

    def check_forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      attn_metadata: AttentionMetadata, output: torch.Tensor | None) -> None:
        """``query`` ``(num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim)`` in the
        model dtype (``kv_b_proj_weight``'s), ``output`` ``(num_tokens, num_heads,
        v_head_dim)``."""
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if query.dim() != 3 or tuple(query.shape[1:]) != (self.num_heads, qk_dim):
            raise ValueError(
                f"query has shape {tuple(query.shape)}; expected (num_tokens, num_heads, "
                f"qk_nope_head_dim + qk_rope_head_dim) = (num_tokens, {self.num_heads}, {qk_dim})"
            )
        if query.dtype != self.w_uk.dtype:
            raise TypeError(f"query has dtype {query.dtype} but kv_b_proj_weight has "
                            f"{self.w_uk.dtype}; both must be the model dtype")
        want = (query.shape[0], self.num_heads, self.v_head_dim)
        if output is not None and tuple(output.shape) != want:
            raise ValueError(f"output has shape {tuple(output.shape)}; expected {want}")

    def new_output(self, query: torch.Tensor) -> torch.Tensor:
        """``(num_tokens, num_heads, v_head_dim)`` in the query's dtype."""
        return query.new_empty((query.shape[0], self.num_heads, self.v_head_dim))

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        """The absorbed attention (module docstring): ``query`` into latent space,
        :meth:`_latent_attention` (the backend's kernels), ``W_UV`` into ``output``."""
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        q = torch.cat([q_latent, q_pe], dim=-1)
        o_latent = self._latent_attention(layer, q, kv_cache, attn_metadata)
        output.copy_(torch.bmm(o_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1))

    @abstractmethod
    def _latent_attention(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                          attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Causal attention of latent queries ``q`` ``(num_tokens, num_heads, kv_lora_rank +
        rope_dim)`` over the latent cache; returns ``(num_tokens, num_heads, kv_lora_rank)``."""

