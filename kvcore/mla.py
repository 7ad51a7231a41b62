"""The MLA common base: the latent-cache layout and the absorbed forward of every MLA backend
(CPU_MLA here, TRITON_MLA and others in plugins), public as ``kvcore.MLACommonBackend`` /
``kvcore.MLACommonImpl``, with the step's intermediates a builder owns (``kvcore.MLAStepBuffers``,
``kvcore.MLAStepViews``) and the metadata that hands them to the layers (``kvcore.MLAMetadata``).

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

The pipeline of a layer is three launches and no allocation when the backend's builder gives
the step's buffers (:class:`MLAStepBuffers`, made once per builder by
:meth:`MLACommonBackend.new_step_buffers`, cut per step by :meth:`MLAStepBuffers.for_step` into
the ``mla_views`` of the :class:`MLAMetadata` its ``build`` returns):
``W_UK`` is applied with ``torch.bmm(..., out=)`` straight into the first ``kv_lora_rank``
channels of the step's latent-query buffer; the backend's kernel hook
(:meth:`MLACommonImpl._latent_attention_into`) reads the latent query and ``q_pe`` (a view of
the layer's query) separately where its kernel takes them apart (FLASHINFER_MLA), or copies
``q_pe`` into the buffer's last channels for a kernel that reads one query tensor
(TRITON_MLA, CPU_MLA), and writes the latent output into the step's output buffer; ``W_UV``
is applied with ``torch.bmm(..., out=)`` straight into the layer's ``output``. No
``torch.cat``, no copy of the output.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod

import torch

from kvcore.backend import AttentionBackend
from kvcore.impl import AttentionImpl
from kvcore.metadata import AttentionLayer, AttentionMetadata
from kvcore.platform_types import AttentionType
from kvcore.spec import MLAAttentionSpec

__all__ = ["MLACommonBackend", "MLACommonImpl", "MLAMetadata", "MLAStepBuffers", "MLAStepViews",
           "latent_cache_shape"]


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


@dataclasses.dataclass(frozen=True, slots=True)
class MLAStepViews:
    """One step's views of :class:`MLAStepBuffers` (made once per step, shared by its layers).

    Attributes:
        q_latent: ``(num_tokens, num_heads, kv_lora_rank + rope_dim)``: the absorbed query
            ``[W_UK^T q_nope, q_pe]``.
        q_nope: ``q_latent[..., :kv_lora_rank]``, the absorbed part.
        q_nope_t: ``q_nope.transpose(0, 1)``, what ``W_UK``'s ``bmm`` writes.
        q_rope: ``q_latent[..., kv_lora_rank:]``, where a one-tensor kernel's ``q_pe`` goes.
        o_latent: ``(num_tokens, num_heads, kv_lora_rank)``: the latent attention output.
        o_latent_t: ``o_latent.transpose(0, 1)``, what ``W_UV``'s ``bmm`` reads.
    """

    q_latent: torch.Tensor
    q_nope: torch.Tensor
    q_nope_t: torch.Tensor
    q_rope: torch.Tensor
    o_latent: torch.Tensor
    o_latent_t: torch.Tensor

    @classmethod
    def of(cls, q_latent: torch.Tensor, o_latent: torch.Tensor) -> MLAStepViews:
        """The views of a latent query ``(n, heads, kv_lora_rank + rope_dim)`` and a latent
        output ``(n, heads, kv_lora_rank)``."""
        rank = o_latent.shape[-1]
        q_nope = q_latent[..., :rank]
        return cls(q_latent, q_nope, q_nope.transpose(0, 1), q_latent[..., rank:], o_latent,
                   o_latent.transpose(0, 1))

    def fits(self, query: torch.Tensor, num_heads: int, latent_size: int) -> bool:
        """Whether these views serve a layer of ``num_heads`` heads and latent size
        ``latent_size`` on ``query``'s rows, dtype and device."""
        q = self.q_latent
        return (q.shape[0] == query.shape[0] and q.shape[1] == num_heads
                and q.shape[2] == latent_size and q.dtype == query.dtype
                and q.device == query.device)


class MLAStepBuffers:
    """The absorbed forward's intermediates, allocated once (by a backend's builder, with
    :meth:`MLACommonBackend.new_step_buffers`) for every step and layer: a latent query
    ``(max_num_tokens, num_heads, kv_lora_rank + rope_dim)`` and a latent output
    ``(max_num_tokens, num_heads, kv_lora_rank)`` in the model dtype. Layers of one step run
    one after another, so one pair serves them all; a step's views start at the buffers'
    first row, so a step captured in a CUDA graph reads the same memory on every replay."""

    def __init__(self, max_num_tokens: int, num_heads: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        with torch.inference_mode(False):
            self.q_latent = torch.empty(max_num_tokens, num_heads, kv_lora_rank + rope_dim,
                                        dtype=dtype, device=device)
            self.o_latent = torch.empty(max_num_tokens, num_heads, kv_lora_rank, dtype=dtype,
                                        device=device)
        self._views: dict[int, MLAStepViews] = {}

    def for_step(self, num_tokens: int) -> MLAStepViews:
        """The views of a step of ``num_tokens`` query rows (made once per row count)."""
        views = self._views.get(num_tokens)
        if views is None:
            if not 0 <= num_tokens <= self.q_latent.shape[0]:
                raise ValueError(f"num_tokens={num_tokens} exceeds the {self.q_latent.shape[0]} "
                                 "rows these buffers were made for (max_num_batched_tokens)")
            views = self._views[num_tokens] = MLAStepViews.of(self.q_latent[:num_tokens],
                                                              self.o_latent[:num_tokens])
        return views


@dataclasses.dataclass
class MLAMetadata(AttentionMetadata):
    """:class:`~kvcore.AttentionMetadata` plus the step's views of the builder's
    :class:`MLAStepBuffers`, which :meth:`MLACommonImpl.step_views` reads.

    An MLA backend's builder returns it, or a dataclass subclass with its own fields (a plan,
    a workspace), from ``build``: ``meta.extend(cls, mla_views=buffers.for_step(
    meta.num_actual_tokens), ...)``.

    Attributes:
        mla_views: the step's :class:`MLAStepViews` (rows ``num_actual_tokens``); ``None``
            (an empty step, or no buffers): each layer's forward allocates its intermediates.
    """

    mla_views: MLAStepViews | None = None


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

    @staticmethod
    def new_step_buffers(spec: MLAAttentionSpec, *, num_heads: int, max_num_tokens: int,
                         device: torch.device | str) -> MLAStepBuffers:
        """The :class:`MLAStepBuffers` a builder of this backend owns: ``max_num_tokens`` rows
        of ``num_heads`` heads in ``spec``'s model dtype (latent query ``kv_lora_rank +
        qk_rope_head_dim`` and latent output ``kv_lora_rank`` channels each)."""
        return MLAStepBuffers(max_num_tokens, num_heads, spec.kv_lora_rank,
                              spec.qk_rope_head_dim, spec.dtype, device)


class MLACommonImpl(AttentionImpl):
    """Per-layer MLA state and the absorbed forward (see the module docstring).

    Shapes: ``query`` ``(num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim)``; the
    cache ``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``; the output
    ``(num_tokens, num_heads, v_head_dim)``. For :meth:`do_kv_cache_update` the ``key`` is
    ``kv_c`` ``(num_tokens, kv_lora_rank)`` and the ``value`` is ``k_pe`` ``(num_tokens,
    qk_rope_head_dim)`` (or ``(num_tokens, 1, qk_rope_head_dim)``); the fp8 scale of the
    latent cache is ``layer.k_scale``. :meth:`forward` does not read ``key`` and ``value``
    (the latents come from the cache): pass ``None``. A backend implements
    :meth:`write_kv_cache` and :meth:`_latent_attention`, and where its kernels allow it
    :meth:`_latent_attention_into` (the query's two parts apart, the output given); its
    builder hands the step's buffers to the layers in an :class:`MLAMetadata`.

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

    def step_views(self, attn_metadata: AttentionMetadata) -> MLAStepViews | None:
        """The step's buffer views from the backend's builder: ``attn_metadata.mla_views`` of
        an :class:`MLAMetadata`; ``None`` for other metadata or a step without them
        (:meth:`attend` then allocates them for the call)."""
        return attn_metadata.mla_views if isinstance(attn_metadata, MLAMetadata) else None

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        """The absorbed attention (module docstring): ``W_UK`` into the step's latent query,
        :meth:`_latent_attention_into` (the backend's kernels) into the step's latent output,
        ``W_UV`` into ``output``."""
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        views = self.step_views(attn_metadata)
        if views is None or not views.fits(query, self.num_heads, latent):
            n = query.shape[0]
            views = MLAStepViews.of(query.new_empty(n, self.num_heads, latent),
                                    query.new_empty(n, self.num_heads, self.kv_lora_rank))
        nope = self.qk_nope_head_dim
        torch.bmm(query[..., :nope].transpose(0, 1), self.w_uk, out=views.q_nope_t)
        self._latent_attention_into(layer, views, query[..., nope:], kv_cache, attn_metadata)
        torch.bmm(views.o_latent_t, self.w_uv_t, out=output.transpose(0, 1))

    def _latent_attention_into(self, layer: AttentionLayer, views: MLAStepViews,
                               q_pe: torch.Tensor, kv_cache: torch.Tensor,
                               attn_metadata: AttentionMetadata) -> None:
        """The backend's kernels on the step's views (hook): ``views.q_nope`` holds the
        absorbed query, ``q_pe`` ``(num_tokens, num_heads, rope_dim)`` is the layer's rope
        query (a view of its ``query``); write the latent attention into ``views.o_latent``.

        The default serves a kernel that reads one query tensor: ``q_pe`` is copied into
        ``views.q_rope`` (completing ``views.q_latent``) and :meth:`_latent_attention`'s
        result into ``views.o_latent``. A backend whose kernel takes the two parts apart, or
        writes into a given output, overrides it.
        """
        views.q_rope.copy_(q_pe)
        views.o_latent.copy_(self._latent_attention(layer, views.q_latent, kv_cache,
                                                    attn_metadata))

    @abstractmethod
    def _latent_attention(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                          attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Causal attention of latent queries ``q`` ``(num_tokens, num_heads, kv_lora_rank +
        rope_dim)`` over the latent cache; returns ``(num_tokens, num_heads, kv_lora_rank)``."""

