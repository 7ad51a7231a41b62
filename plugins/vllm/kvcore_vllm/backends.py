"""kvcore backends as vLLM attention backends.

Each name vLLM resolves here (``kvcore_vllm.backends.KVCORE_TRITON_ATTN``, ...) is a class made
on first use (PEP 562) from :class:`KvcoreBackend`: ``KVCORE_<NAME>`` is bound to kvcore's
backend ``<NAME>``, ``KVCORE`` asks kvcore's selector for the platform and the layer's config.
Capabilities are read from kvcore's declarations, and a configuration kvcore refuses is refused
in vLLM with kvcore's reasons (``validate_configuration`` where vLLM asks, the impl's
constructor where it does not, as on the CPU platform).

Per step, the builder turns vLLM's ``CommonAttentionMetadata`` into kvcore metadata without
reading the device (:func:`kvcore.attention_metadata_from_engine`) and runs the kvcore
builder; per layer, the impl adopts vLLM's ``[B, H, N, C]`` cache view as kvcore's ``(B, 2, N,
H, D)`` view of the same memory (:func:`kvcore.from_vllm_layer_view`; cached per tensor) and
calls kvcore's ``do_kv_cache_update`` and ``forward``.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import kvcore
from kvcore_vllm.plugin import PREFIX, SELECTED
from kvcore_vllm.vllm_private import (
    current_attn_metadata,
    layer_impls,
    layer_kv_caches,
    layer_scales,
)

#: kvcore's CUDA_GRAPH_SUPPORT -> vLLM's cudagraph support level.
CUDA_GRAPH_LEVELS = {
    kvcore.CudaGraphSupport.NEVER: AttentionCGSupport.NEVER,
    kvcore.CudaGraphSupport.UNIFORM_DECODE: AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
    kvcore.CudaGraphSupport.ALWAYS: AttentionCGSupport.ALWAYS,
}


class KvcoreSelectionError(ValueError):
    """kvcore cannot run a layer's configuration; the message has kvcore's reasons."""


def selector_config(*, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                    block_size: int | None, use_mla: bool = False, has_sink: bool = False,
                    attn_type: str = AttentionType.DECODER, use_kv_connector: bool = False,
                    has_logits_soft_cap: bool = False, num_heads: int | None = None,
                    num_kv_heads: int | None = None) -> kvcore.AttentionSelectorConfig:
    """kvcore's selector config for what vLLM knows of a layer (the head counts per rank,
    where known, pick a ranking's cases of the same heads; counts that do not group, which
    no layer has, are left out rather than refused: they decide no validity)."""
    if num_heads and num_kv_heads and num_heads % num_kv_heads:
        num_heads = num_kv_heads = None
    return kvcore.AttentionSelectorConfig(
        head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype or "auto",
        block_size=block_size or 16, use_mla=use_mla, has_sink=has_sink,
        attn_type=kvcore.AttentionType(str(getattr(attn_type, "value", attn_type))),
        use_kv_connector=use_kv_connector, has_logits_soft_cap=has_logits_soft_cap,
        num_heads=num_heads, num_kv_heads=num_kv_heads)


def _model_heads(vllm_config: Any) -> dict[str, int]:
    """The model's query and KV heads per rank (vLLM's tensor-parallel split)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return {"num_heads": model.get_num_attention_heads(parallel),
            "num_kv_heads": model.get_num_kv_heads(parallel)}


@functools.cache
def _select(kvcore_name: str | None, config: kvcore.AttentionSelectorConfig
            ) -> type[kvcore.AttentionBackend]:
    """The kvcore backend for a layer: ``kvcore_name`` if it can run ``config``, else kvcore's
    selector's pick; :class:`KvcoreSelectionError` with kvcore's reasons otherwise."""
    try:
        return kvcore.get_attn_backend(config, backend=kvcore_name)
    except kvcore.BackendSelectionError as exc:
        raise KvcoreSelectionError(f"kvcore cannot run this attention layer in vLLM: {exc}"
                                   ) from None


class KvcoreBackend(AttentionBackend):
    """A vLLM attention backend running kvcore's backend :attr:`KVCORE_NAME` (``None``:
    the one kvcore's selector picks for each layer's configuration)."""

    KVCORE_NAME: ClassVar[str | None] = None
    VLLM_NAME: ClassVar[str] = SELECTED
    # kvcore's forward never writes the cache (its contract declares it under vLLM's name):
    # vLLM calls do_kv_cache_update before forward, as kvcore's engines do.
    forward_includes_kv_cache_update: bool = kvcore.AttentionImpl.forward_includes_kv_cache_update
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @classmethod
    def kvcore_backend(cls) -> type[kvcore.AttentionBackend] | None:
        return None if cls.KVCORE_NAME is None else kvcore.resolve_backend(cls.KVCORE_NAME)

    @classmethod
    def _default_backend(cls) -> type[kvcore.AttentionBackend]:
        """The bound backend, or what kvcore picks for a plain decoder layer here: what the
        class-level answers (layouts) describe when no layer's config is known yet."""
        bound = cls.kvcore_backend()
        if bound is not None:
            return bound
        vllm_config = get_current_vllm_config_or_none()
        model = None if vllm_config is None else vllm_config.model_config
        dtype = torch.bfloat16 if model is None else model.dtype
        head = 128 if model is None else model.get_head_size()
        heads = {} if model is None else _model_heads(vllm_config)
        return _select(None, selector_config(head_size=head, dtype=dtype,
                                             kv_cache_dtype=None, block_size=None, **heads))

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return cls.VLLM_NAME

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:  # type: ignore[override]
        return _bound(KvcoreImpl, cls)

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:  # type: ignore[override]
        return _bound(KvcoreBuilder, cls)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None
                                         ) -> list[int | MultipleOf]:
        # kvcore's kernels look every token's page up on its own: any size their declaration
        # allows; the declared sizes are checked per layer (validate_configuration).
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """The vLLM layouts kvcore's backend reads (kvcore's declaration)."""
        from vllm.platforms import current_platform

        platform = "cpu" if current_platform.is_cpu() else (
            "rocm" if current_platform.is_rocm() else "cuda")
        return tuple(KVCacheLayout[name]
                     for name in cls._default_backend().supported_vllm_layouts(platform))

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype,  # type: ignore[override]
                               kv_cache_dtype: str | None, block_size: int | None,
                               use_mla: bool, has_sink: bool, use_sparse: bool,
                               use_mm_prefix: bool, use_per_head_quant_scales: bool,
                               device_capability: Any, attn_type: str,
                               **features: Any) -> list[str]:
        """kvcore's reasons, in vLLM's form (vLLM prints them when it refuses the backend)."""
        reasons = []
        for feature in ("use_pcp", "use_dcp", "use_rswa", "use_adaptive_verification"):
            if features.get(feature):
                reasons.append(f"{feature}=True: kvcore's backends do not support it")
        if use_mla:
            reasons.append("use_mla=True: MLA layers run through vLLM's MLA backends, not "
                           "kvcore-vllm yet")
        config = selector_config(head_size=head_size, dtype=dtype,
                                 kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                                 has_sink=has_sink, attn_type=attn_type,
                                 use_kv_connector=bool(features.get("use_kv_connector")))
        try:
            _select(cls.KVCORE_NAME, config)
        except KvcoreSelectionError as exc:
            reasons.append(str(exc))
        return reasons


class KvcoreBuilder(AttentionMetadataBuilder):
    """vLLM's builder interface over kvcore's builder: one kvcore build per step."""

    BACKEND: ClassVar[type[KvcoreBackend]] = KvcoreBackend

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_head_size_v(kv_cache_spec)
        model = vllm_config.model_config
        # The backend its layers' impls chose (with everything they know: sinks, soft-cap,
        # heads), so the metadata is theirs; the spec's own choice where none is kvcore's.
        chosen = impls_backend(layer_impls(vllm_config, layer_names), layer_names)
        self.kvcore_backend = chosen or _select(
            self.BACKEND.KVCORE_NAME, _spec_config(kv_cache_spec, vllm_config))
        spec = kvcore_spec(kv_cache_spec, vllm_config)
        scheduler = vllm_config.scheduler_config
        self.inner = self.kvcore_backend.get_builder_cls()(
            spec, num_heads=model.get_num_attention_heads(vllm_config.parallel_config),
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs),
            max_model_len=model.max_model_len, device=device)
        self._num_blocks: int | None = None

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any
                              ) -> AttentionCGSupport:
        backend = _select(cls.BACKEND.KVCORE_NAME, _spec_config(kv_cache_spec, vllm_config))
        return CUDA_GRAPH_LEVELS[backend.CUDA_GRAPH_SUPPORT]

    def _cache_blocks(self) -> int:
        if self._num_blocks is None:
            caches = layer_kv_caches(self.vllm_config, self.layer_names)
            if not caches:
                raise RuntimeError("kvcore-vllm: build() before vLLM bound the KV caches to "
                                   f"the layers {self.layer_names[:2]}")
            self._num_blocks = min(int(c.shape[0]) for c in caches)
        return self._num_blocks

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> kvcore.AttentionMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        common = kvcore.attention_metadata_from_engine(
            query_start_loc=cm.query_start_loc[:n + 1], seq_lens=cm.seq_lens[:n],
            block_table=cm.block_table_tensor[:n], slot_mapping=cm.slot_mapping,
            query_start_loc_cpu=cm.query_start_loc_cpu[:n + 1],
            max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            block_size=self.kv_cache_spec.block_size, num_blocks=self._cache_blocks(),
            causal=cm.causal)
        return self.inner.build(common)


def impls_backend(impls: list[Any], layer_names: list[str]
                  ) -> type[kvcore.AttentionBackend] | None:
    """The kvcore backend the kvcore impls among ``impls`` (a KV-cache group's layers) chose,
    or ``None`` when none is kvcore's.

    Raises:
        RuntimeError: they chose different backends (one builder serves them all).
    """
    chosen = {impl.kvcore_backend for impl in impls if isinstance(impl, KvcoreImpl)}
    if len(chosen) > 1:
        raise RuntimeError(
            f"kvcore-vllm: the layers {layer_names[:4]} share a KV-cache group but chose "
            f"different kvcore backends ({', '.join(sorted(b.get_name() for b in chosen))}); "
            "pick one with --attention-backend KVCORE_<NAME>")
    return chosen.pop() if chosen else None


def check_head_size_v(kv_cache_spec: Any) -> None:
    """Refuse layers whose V head size (vLLM's ``head_size_v``) differs from their K head size:
    kvcore's caches hold K and V of one head size, and its backends read V at K's width.

    Raises:
        NotImplementedError: naming both sizes and what to run instead.
    """
    head_size, head_size_v = kv_cache_spec.head_size, getattr(kv_cache_spec, "head_size_v", None)
    if head_size_v is not None and head_size_v != head_size:
        raise NotImplementedError(
            f"kvcore-vllm: these attention layers have head_size_v={head_size_v} (V) and "
            f"head_size={head_size} (K); kvcore's KV caches hold K and V of one head size "
            "and its backends read V at K's width, so such a model runs only on vLLM's own "
            "backends (--attention-backend, or KVCORE_VLLM_CPU=0 on a CPU)")


def kvcore_spec(kv_cache_spec: Any, vllm_config: VllmConfig) -> kvcore.FullAttentionSpec:
    """kvcore's spec of a vLLM KV-cache group: the model's dtype and the cache's
    ``kv_cache_dtype`` (vLLM's spec holds the storage dtype, fp8 for an fp8 cache), and the
    group's window, so a builder plans the layers' queries and cache as they are."""
    return kvcore.FullAttentionSpec(
        block_size=kv_cache_spec.block_size, dtype=vllm_config.model_config.dtype,
        kv_cache_dtype=vllm_config.cache_config.cache_dtype or "auto",
        num_kv_heads=kv_cache_spec.num_kv_heads, head_size=kv_cache_spec.head_size,
        sliding_window=getattr(kv_cache_spec, "sliding_window", None))


def _spec_config(kv_cache_spec: Any, vllm_config: VllmConfig) -> kvcore.AttentionSelectorConfig:
    heads = _model_heads(vllm_config)
    return selector_config(head_size=kv_cache_spec.head_size, dtype=vllm_config.model_config.dtype,
                           kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                           block_size=kv_cache_spec.block_size,
                           num_heads=heads["num_heads"], num_kv_heads=kv_cache_spec.num_kv_heads)


class KvcoreImpl(AttentionImpl):
    """vLLM's per-layer impl over kvcore's impl, on vLLM's own cache memory."""

    BACKEND: ClassVar[type[KvcoreBackend]] = KvcoreBackend

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unsupported: Any) -> None:
        # The soft-cap and the sinks go to kvcore's impl (its backend must declare them).
        for what, value in (("alibi_slopes", alibi_slopes), *unsupported.items()):
            if value is not None and value is not False:
                raise NotImplementedError(f"kvcore-vllm: {what} is not supported by kvcore's "
                                          "backends; run this model with vLLM's own backend "
                                          "(KVCORE_VLLM_CPU=0 on a CPU)")
        vllm_config = get_current_vllm_config()
        config = selector_config(head_size=head_size, dtype=vllm_config.model_config.dtype,
                                 kv_cache_dtype=kv_cache_dtype,
                                 block_size=vllm_config.cache_config.block_size,
                                 attn_type=attn_type, has_sink=sinks is not None,
                                 has_logits_soft_cap=bool(logits_soft_cap),
                                 num_heads=num_heads, num_kv_heads=num_kv_heads)
        self.kvcore_backend = _select(self.BACKEND.KVCORE_NAME, config)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.inner = self.kvcore_backend.get_impl_cls()(
            num_heads=num_heads, head_size=head_size, scale=scale, num_kv_heads=num_kv_heads,
            sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype,
            attn_type=config.attn_type, logits_soft_cap=logits_soft_cap or None, sinks=sinks)
        self._view_of: tuple[int, tuple, tuple, torch.Tensor] | None = None

    def _view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """kvcore's view of vLLM's cache view, checked once per tensor (host facts only)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride())
        if self._view_of is None or self._view_of[:3] != key:
            view = kvcore.from_vllm_layer_view(self.kvcore_backend, kv_cache,
                                               head_size=self.head_size)
            self._view_of = (*key, view)
        return self._view_of[3]

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # The step's own slot tensor (marked as checked) when vLLM hands the same memory.
        meta = current_attn_metadata(getattr(layer, "layer_name", ""))
        if (isinstance(meta, kvcore.AttentionMetadata)
                and meta.slot_mapping.data_ptr() == slot_mapping.data_ptr()
                and meta.slot_mapping.shape == slot_mapping.shape):
            slot_mapping = meta.slot_mapping
        rows = slot_mapping.shape[0]
        k_scale, v_scale = layer_scales(layer)
        self.inner.do_kv_cache_update(kvcore.LayerScales(k_scale, v_scale), key[:rows],
                                      value[:rows], self._view(kv_cache), slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: kvcore.AttentionMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvcore-vllm: fused output quantisation is not "
                                      "supported by kvcore's backends")
        if attn_metadata is None:  # vLLM's profiling run: nothing to attend
            return output
        k_scale, v_scale = layer_scales(layer)
        return self.inner.forward(kvcore.LayerScales(k_scale, v_scale), query, key, value,
                                  self._view(kv_cache), attn_metadata, output=output)


@functools.cache
def _bound(base: type, backend: type[KvcoreBackend]) -> type:
    """``base`` (the impl or the builder) for ``backend``: one class per pair."""
    return type(f"{backend.__name__}{base.__name__.removeprefix('Kvcore')}", (base,),
                {"BACKEND": backend, "__module__": __name__})


def _backend_class(vllm_name: str) -> type[KvcoreBackend]:
    kvcore_name = None if vllm_name == SELECTED else vllm_name.removeprefix(PREFIX)
    if kvcore_name is not None and kvcore_name not in kvcore.backend_registry().names():
        raise AttributeError(f"kvcore has no backend {kvcore_name!r} (kvcore list shows them)")
    return type(vllm_name, (KvcoreBackend,), {"KVCORE_NAME": kvcore_name,
                                              "VLLM_NAME": vllm_name,
                                              "__module__": __name__})


@functools.cache
def __getattr__(name: str) -> type[KvcoreBackend]:
    if name == SELECTED or name.startswith(PREFIX):
        return _backend_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
