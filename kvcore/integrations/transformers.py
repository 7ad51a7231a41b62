"""transformers' continuous batching on a kvcore backend, viewing transformers' own paged cache.

::

    from kvcore.integrations.transformers import use_kvcore

    with use_kvcore(model):                       # kvcore's selector picks; or backend="..."
        outputs = model.generate_batch(prompts, generation_config)

Inside the block, every continuous-batching step (``generate_batch``,
``init_continuous_batching`` / ``ContinuousBatchingManager``, ``transformers serve`` in the same
process) runs attention through the chosen kvcore backend; scheduling, chunked prefill, prefix
sharing, forks and offload stay transformers'. What happens per step:

- **Memory.** transformers' ``PagedAttentionCache`` holds one flat byte tensor; its
  full-attention allocator lays each block out as ``[layer][K page | V page]``, a page being
  ``(page_size, num_kv_heads, head_dim)``: kvcore's cross-layer NHD order ``B,L,2,N,H,D``
  (stride order ``(1, 0, 2, 3, 4, 5)``). The whole tensor is adopted with
  :func:`kvcore.adopt_kv_caches` (no copy, ``data_ptr`` equal), its two leading "trash"
  sectors included, so transformers' block ids are kvcore's block ids. Forks and prefix
  sharing copy or share blocks inside that tensor; kvcore sees them.
- **Metadata, once per step.** A forward pre-hook on the first attention layer turns the step's
  kwargs into :class:`kvcore.AttentionMetadata`: ``cu_seq_lens_q`` is ``query_start_loc``;
  sequence lengths come from ``cu_seq_lens_k``; a row index ``w`` of transformers' write or
  read index (``block * block_physical_stride + offset``) becomes the slot ``(w // S) * N + w %
  S`` (``S`` the stride, ``N`` the page size); block tables are the read index's rows at every
  page start of each request. All of it is device arithmetic; the host copy of
  ``cu_seq_lens_q`` is the one device read (nothing on a CPU model). The backend's builder
  then runs once; every layer reuses the result. Its persistent buffers are sized to what the
  steps so far needed (requests and longest request, rounded up to a power of two, at most
  transformers' ``max_batch_tokens`` and ``max_tokens_read``); a step that needs more makes
  a larger builder, so metadata memory follows the workload, not the whole cache.
- **Lifetime.** kvcore holds transformers' cache only while transformers does: when
  ``generate_batch`` (or a manager) drops its ``PagedAttentionCache``, the views and the
  builder go with it, so the next batch's cache is sized from memory that is really free.
- **Per layer.** Each attention module's pre-hook takes ``cache`` out of its kwargs (so
  transformers neither writes nor gathers K/V) and hands the layer's cache view and impl to the
  attention function registered under :data:`ATTENTION_NAME`, which calls the backend's
  ``do_kv_cache_update`` and ``forward``.
- **Cache groups.** A hybrid model (gpt-oss, Gemma 2) has a ``full_attention`` and a
  ``sliding_attention`` group, each laying its own blocks (a page per layer of the group) over
  the whole tensor: each group is adopted, gets its impls (``sliding_window`` on the sliding
  ones), its metadata and its builder per step, and each layer gets its group's.
- **Sliding layers.** transformers keeps a request's last ``sliding_window`` tokens in a ring
  (position ``p`` in slot ``p % sliding_window``) and reads before it writes. A step in which
  every request reads at most ``sliding_window`` keys (``max_length_k`` of the group, a host
  value: decode steps, and prefill chunks that do not wrap the ring) attends on the ring **in
  place**: a request's block table maps logical block ``j`` onto its ring's pages cyclically
  (its first column at the page of the oldest key it sees), the new tokens are written to the
  ring and attention reads it there. A decode's token replaces the one that just left the
  window, which kvcore's step check allows for the group's window
  (``FullAttentionSpec(sliding_window=...)``). In other steps a new token would replace a key
  an earlier query of the step still sees, and in a ring whose size is not a multiple of the
  page size a page's offsets do not follow the positions: those are **gathered**. Per layer,
  the read index's rows (the window, oldest first) are copied into a scratch cache of one
  layer (kvcore's memory, shared by the group's layers, sized to the step), the new tokens
  written there, attention runs there, and the new tokens are then written to the ring
  through transformers' write index.

Refused up front, each with its reason: MLA (compressed latents), layer types other than full
and sliding attention, backends that cannot read a cross-layer NHD cache on this platform.
An attention module's logit soft-cap
(``attn_logit_softcapping``) and sinks (``sinks``) go to its impl, and the selector keeps the
backends that declare them. The
plain ``model.generate`` path (transformers' ``DynamicCache``) is not served: leave the block
first. ``examples/transformers_llama.py`` is the minimal form of the other direction: kvcore's
own cache and a hand-written batching loop around a transformers model. CB's CUDA graphs
(``use_cuda_graph``) and ``torch.compile`` are not served yet (the step reads its host facts):
pass ``ContinuousBatchingConfig(use_cuda_graph=False)``.

Which transformers internals this relies on, and the supported versions:
:mod:`kvcore.integrations.transformers_internals`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionSelectorConfig,
    FullAttentionSpec,
    LayerScales,
    adopt_kv_caches,
    explain_selection,
    get_attn_backend,
)
from kvcore.adopt import check_readable_order
from kvcore.integrations.transformers_internals import (
    SUPPORTED_RANGE,
    check_internals,
    version_problem,
)
from kvcore.integrations.transformers_steps import (
    CacheGroup,
    Staging,
    full_metadata,
    grown,
    ring_metadata,
    sliding_metadata,
)

__all__ = ["ATTENTION_NAME", "CROSS_LAYER_NHD", "KVCoreAttention", "select_backend",
           "use_kvcore"]

#: The attention implementation name the model runs under. Continuous batching accepts only
#: ``paged|eager``, ``sdpa`` or a name containing "flash"; with "flash" it builds no masks
#: and passes varlen kwargs, and without a version digit after it its flash-only decode fast
#: path stays off.
ATTENTION_NAME = "kvcore_flash"

#: transformers' full-attention block ``[layer][K page | V page]`` as a kvcore stride order of
#: ``(L, B, 2, N, H, D)``: block outermost, then layer (cross-layer NHD).
CROSS_LAYER_NHD = (1, 0, 2, 3, 4, 5)

_UNIT_SCALES = LayerScales()  # transformers' paged cache is unquantised
_FULL = "full_attention"
_SLIDING = "sliding_attention"
_registered = threading.Lock()
_is_registered = False


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "kvcore.integrations.transformers needs transformers, which is not installed; "
            f"install the extra: pip install 'kvcore[transformers]' (transformers{SUPPORTED_RANGE})"
        ) from exc
    return transformers


def _register() -> None:
    """Register :data:`ATTENTION_NAME` with transformers' attention and mask interfaces."""
    global _is_registered
    with _registered:
        if _is_registered:
            return
        transformers = _import_transformers()
        transformers.AttentionInterface.register(ATTENTION_NAME, _kvcore_attention)
        transformers.AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
        _is_registered = True


def _no_mask(*args: object, **kwargs: object) -> None:
    """kvcore's metadata carries causality and request boundaries: no 4-D mask is built."""
    return None


@dataclass
class _LayerCall:
    """What one attention layer's call needs, passed as the ``kvcore_layer`` kwarg."""

    cache: torch.Tensor  # the layer's (num_blocks, 2, N, H, D) view of transformers' tensor
    impl: AttentionImpl
    metadata: Any  # what the builder returned for this step (for the layer's group)
    staging: Staging | None = None  # a sliding layer's copies around its scratch cache


def _kvcore_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvcore_layer: _LayerCall | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for :data:`ATTENTION_NAME`.

    ``query`` is ``(1, num_heads, num_tokens, head_dim)``, ``key``/``value`` ``(1,
    num_kv_heads, num_tokens, head_dim)`` (the step's packed new tokens, rotary applied).
    Returns ``(1, num_tokens, num_heads, head_dim)``.
    """
    if kvcore_layer is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} runs only inside "
            "kvcore.integrations.transformers.use_kvcore(model) and only for continuous "
            "batching (generate_batch, init_continuous_batching); this call came without "
            "kvcore's per-layer state (another model, or model.generate): leave the block or "
            "use generate_batch")
    if query.shape[0] != 1:
        raise ValueError(f"query has batch size {query.shape[0]}; continuous batching packs "
                         "every request's tokens into batch dimension 1")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    impl, cache, meta = kvcore_layer.impl, kvcore_layer.cache, kvcore_layer.metadata
    staging = kvcore_layer.staging
    if staging is None:
        impl.do_kv_cache_update(_UNIT_SCALES, k, v, cache, meta.slot_mapping)
        return impl.forward(_UNIT_SCALES, q, k, v, cache, meta).unsqueeze(0), None
    # A sliding layer: its window gathered from transformers' ring into the scratch, the new
    # tokens written there, attention on the scratch, then the new tokens into the ring.
    scratch = staging.scratch
    if staging.src_blocks is not None:
        scratch[staging.dst_blocks, :, staging.dst_offsets] = \
            cache[staging.src_blocks, :, staging.src_offsets]
    impl.do_kv_cache_update(_UNIT_SCALES, k, v, scratch, meta.slot_mapping)
    out = impl.forward(_UNIT_SCALES, q, k, v, scratch, meta)
    impl.do_kv_cache_update(_UNIT_SCALES, k, v, cache, staging.ring_slots)
    return out.unsqueeze(0), None


def _text_config(model: torch.nn.Module) -> Any:
    """The config of ``model``'s language model (a multimodal model's text part)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_problems(model: torch.nn.Module) -> list[str]:
    """Why transformers' continuous batching of ``model`` cannot run on kvcore (empty: it
    can): MLA, or a layer type other than full and sliding attention."""
    config = _text_config(model)
    problems = []
    if getattr(config, "kv_lora_rank", None) is not None:
        problems.append(
            f"the model uses MLA (kv_lora_rank={config.kv_lora_rank}): transformers caches "
            "compressed latents, which kvcore's K/V backends cannot view; run it with "
            "transformers' own attention")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        layer_types = ["sliding_attention"] * config.num_hidden_layers
    other = sorted(set(layer_types or [_FULL]) - {_FULL, _SLIDING})
    if other:
        problems.append(
            f"the model has layers of type {', '.join(other)}: kvcore serves transformers' "
            f"{_FULL} and {_SLIDING} cache groups only; run it with transformers' own attention")
    return problems


def _layer_features(module: torch.nn.Module) -> dict[str, object]:
    """The impl keywords of an attention module's soft-cap (Gemma 2's
    ``module.attn_logit_softcapping``) and sinks (gpt-oss's ``module.sinks``), where it has
    them: the selector then keeps the backends that declare them."""
    features: dict[str, object] = {}
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap:
        features["logits_soft_cap"] = float(cap)
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        features["sinks"] = sinks.detach()
    return features


def _attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's attention modules by layer index (modules with an int ``layer_idx`` whose
    class name ends in ``Attention``)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and type(module).__name__.endswith("Attention"):
            found[idx] = module
    return found


def select_backend(
    model: torch.nn.Module,
    backend: str | type[AttentionBackend] | None = None,
    *,
    page_size: int | None = None,
    platform: str | None = None,
) -> type[AttentionBackend]:
    """The kvcore backend that serves ``model``'s continuous batching with pages of
    ``page_size`` tokens (default: ``ContinuousBatchingConfig``'s).

    kvcore's selector picks unless ``backend`` names one; only a backend that reads a
    cross-layer NHD cache on the platform can view transformers' tensor, so the first valid
    one that does is taken. A named backend that cannot is refused with its reasons.

    Raises:
        ValueError: the model cannot be served (:func:`model_problems`), or no backend (or
            not the named one) can run it on transformers' cache.
    """
    transformers = _import_transformers()
    config = _text_config(model)
    if page_size is None:
        page_size = transformers.ContinuousBatchingConfig.page_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    features = [_layer_features(m) for m in _attention_modules(model).values()]
    selector_config = AttentionSelectorConfig(
        head_size=head_dim, dtype=model.dtype, block_size=page_size,
        has_sink=any("sinks" in f for f in features),
        has_logits_soft_cap=any("logits_soft_cap" in f for f in features),
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    plat = platform or ("cpu" if model.device.type == "cpu" else None)
    if backend is not None:
        chosen = get_attn_backend(selector_config, backend=backend, platform=plat)
        reason = _view_problem(chosen, plat)
        if reason:
            raise ValueError(f"backend={chosen.get_name()!r} cannot serve transformers' "
                             f"continuous batching: {reason}")
        return chosen
    report = explain_selection(selector_config, platform=plat)
    valid = [c for c in report.candidates if c.valid]
    valid.sort(key=lambda c: not c.in_priority_list)  # the priority list first, in its order
    refused = []
    for candidate in valid:
        try:
            chosen = get_attn_backend(selector_config, backend=candidate.name, platform=plat)
        except ValueError as exc:
            refused.append(f"{candidate.name}: {exc}")
            continue
        reason = _view_problem(chosen, plat)
        if reason is None:
            return chosen
        refused.append(f"{candidate.name}: {reason}")
    invalid = [f"{c.name}: {'; '.join(c.reasons)}" for c in report.candidates
               if c.reasons and c.in_priority_list]
    raise ValueError(
        f"no kvcore backend can serve transformers' continuous batching of this model "
        f"({selector_config.describe()}) on platform {report.platform}: "
        f"{' | '.join(refused + invalid) or 'none is registered'}. Pick a page_size and dtype "
        "a backend supports (kvcore select --explain), or use transformers' own attention")


def _view_problem(backend: type[AttentionBackend], platform: str | None) -> str | None:
    """Why ``backend`` cannot read transformers' cross-layer NHD tensor, or ``None``."""
    try:
        check_readable_order(backend, CROSS_LAYER_NHD, platform,
                             what="transformers' paged cache (cross-layer NHD, B,L,2,N,H,D)")
    except ValueError as exc:
        return str(exc)
    return None


@dataclass
class _Adopted:
    """One transformers cache, adopted: the kvcore views of each cache group, the backend.

    ``cache`` is a weak reference: transformers owns the ``PagedAttentionCache``, and when it
    drops it a finalizer drops this record (and with it the views that keep the tensor).
    Each group's ``builder`` is ``None`` until the first step and grows with the steps (see
    :meth:`KVCoreAttention._builder_for`), up to ``max_seqs`` requests and ``max_len`` tokens.
    """

    cache: weakref.ref
    backend: type[AttentionBackend]
    groups: list[CacheGroup]
    group_of: dict[int, CacheGroup]  # layer index -> its group
    num_heads: int
    page_size: int
    max_seqs: int  # transformers' max_batch_tokens: no step has more requests
    max_len: int  # no request reads more tokens
    release: weakref.finalize | None = None


class KVCoreAttention:
    """The state of :func:`use_kvcore`: hooks on the model, the adopted cache, the step.

    Attributes:
        backend: the backend selected at entry (for the default page size, or ``page_size``).
        steps: forward passes served so far.
        in_place_steps: steps whose sliding-window layers attended on transformers' ring in
            place (one count per sliding group and step).
        gathered_steps: steps whose sliding-window layers gathered their window into the
            scratch cache instead (prefill chunks that wrap the ring, or a ring that is not
            whole pages).
        adopted: the transformers cache currently viewed (``None`` before the first step and
            once transformers has dropped that cache).
    """

    def __init__(self, model: torch.nn.Module, backend: str | type[AttentionBackend] | None,
                 page_size: int | None, platform: str | None) -> None:
        transformers = _import_transformers()
        problem = version_problem()
        if problem:
            raise RuntimeError(problem)
        changed = check_internals()
        if changed:
            raise RuntimeError(
                f"transformers {transformers.__version__} changed what kvcore's integration "
                f"relies on: {' | '.join(changed)}; install transformers{SUPPORTED_RANGE}")
        problems = model_problems(model)
        if problems:
            raise ValueError(f"{type(model).__name__} cannot run on kvcore under transformers' "
                             f"continuous batching: {' | '.join(problems)}")
        self.model = model
        self._requested = backend
        self._platform = platform
        self._page_size = page_size or transformers.ContinuousBatchingConfig.page_size
        self.backend = select_backend(model, backend, page_size=self._page_size,
                                      platform=platform)
        self._modules = _attention_modules(model)
        config = _text_config(model)
        expected = list(range(config.num_hidden_layers))
        if sorted(self._modules) != expected:
            raise ValueError(
                f"found attention modules for layers {sorted(self._modules)} but the model has "
                f"{config.num_hidden_layers} layers; kvcore hooks one module per layer (a "
                "module with an int layer_idx whose class name ends in Attention)")
        self._first = expected[0]
        self.steps = 0
        self.in_place_steps = 0
        self.gathered_steps = 0
        self.adopted: _Adopted | None = None
        self._step: dict[str, tuple[Any, Staging | None]] = {}
        self._handles: list[Any] = []
        self._previous: str | None = None

    # -- entering and leaving ---------------------------------------------------------------

    def attach(self) -> None:
        """Register the attention function, switch the model to it and hook its layers."""
        _register()
        self._previous = self.model.config._attn_implementation
        # set_attn_implementation would try to load a hub kernel for a name containing "flash".
        self.model.config._attn_implementation = ATTENTION_NAME
        for idx, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(
                self._hook(idx), with_kwargs=True))

    def detach(self) -> None:
        """Remove the hooks and restore the model's attention implementation."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._previous is not None:
            self.model.config._attn_implementation = self._previous
        self._forget(self.adopted)

    # -- per layer and per step ---------------------------------------------------------------

    def _hook(self, idx: int):
        def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            cache = kwargs.get("cache")
            if idx == self._first:
                self._step = self._build_step(cache, kwargs)
            group = self.adopted.group_of[idx]
            metadata, staging = self._step[group.name]
            kwargs["cache"] = None  # transformers neither writes nor gathers: kvcore does
            kwargs["kvcore_layer"] = _LayerCall(group.layers[idx], group.impls[idx], metadata,
                                                staging)
            return args, kwargs

        return pre_hook

    def _build_step(self, cache: Any, kwargs: dict) -> dict[str, tuple[Any, Staging | None]]:
        transformers = _import_transformers()
        paged = transformers.generation.continuous_batching.PagedAttentionCache
        if not isinstance(cache, paged):
            raise RuntimeError(
                f"use_kvcore serves transformers' continuous batching, but this forward pass "
                f"got cache={type(cache).__name__} (model.generate or a plain forward); leave "
                "the use_kvcore block for those, or call model.generate_batch")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "transformers is capturing a CUDA graph of a continuous-batching step, which "
                "kvcore's step (it reads cu_seq_lens_q on the host) cannot be part of yet; pass "
                "ContinuousBatchingConfig(use_cuda_graph=False) to generate_batch")
        if self.adopted is None or self.adopted.cache() is not cache:
            self._forget(self.adopted)
            self.adopted = self._adopt(cache)
        self.steps += 1
        cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
        starts_cpu = cu_q.cpu()
        step = {}
        for group in self.adopted.groups:
            if group.window is None:
                common = full_metadata(group, self.adopted.page_size, kwargs, cu_q, starts_cpu)
                staging = None
            elif group.in_place and int(kwargs["max_length_k"][group.name]) <= group.window:
                # No request reads more than the window: nothing a query sees is replaced.
                common = ring_metadata(group, self.adopted.page_size, kwargs, cu_q, starts_cpu)
                staging = None
                self.in_place_steps += 1
            else:
                common, staging = sliding_metadata(group, self.adopted.backend,
                                                   self.adopted.page_size, kwargs, cu_q,
                                                   starts_cpu)
                self.gathered_steps += 1
            step[group.name] = (self._builder_for(group, common).build(common), staging)
        return step

    def _builder_for(self, group: CacheGroup, common: AttentionMetadata) -> Any:
        """``group``'s builder, made (or remade larger) when ``common`` has more requests or a
        longer request than its buffers hold."""
        a = self.adopted
        builder = group.builder
        seqs, length = (0, 0) if builder is None else (builder.max_num_seqs,
                                                       builder.max_model_len)
        if builder is None or common.num_seqs > seqs or common.max_seq_len > length:
            seqs = grown(common.num_seqs, seqs, a.max_seqs)
            length = grown(common.max_seq_len, length, a.max_len)
            group.builder = a.backend.get_builder_cls()(
                group.spec, num_heads=a.num_heads, max_num_seqs=seqs,
                max_num_batched_tokens=a.max_seqs, max_model_len=length,
                device=next(iter(group.layers.values())).device)
        return group.builder

    def _forget(self, adopted: _Adopted | None) -> None:
        """Drop ``adopted`` (transformers dropped its cache, or a new one replaced it)."""
        if adopted is None:
            return
        if adopted.release is not None:
            adopted.release.detach()
        if self.adopted is adopted:
            self.adopted = None
            self._step = {}

    def _adopt(self, cache: Any) -> _Adopted:
        """View ``cache``'s tensor as kvcore caches, one set per cache group (each group lays
        its blocks out over the whole tensor with its own block size), with the backend's
        impls."""
        allocators = list(cache.cache_allocators.items())
        kinds = {_FULL: "FullAttentionCacheAllocator",
                 _SLIDING: "SlidingAttentionCacheAllocator"}
        for name, allocator in allocators:
            if kinds.get(name) != type(allocator).__name__:
                raise ValueError(
                    f"transformers' {name!r} cache group is a {type(allocator).__name__}; "
                    "kvcore views FullAttentionCacheAllocator's [layer][K page | V page] "
                    "blocks (full_attention) and SlidingAttentionCacheAllocator's rings of "
                    "such blocks (sliding_attention)")
        page_size = allocators[0][1].tokens_per_page
        backend = self.backend
        if page_size != self._page_size:  # the batching config chose another page size
            backend = select_backend(self.model, self._requested, page_size=page_size,
                                     platform=self._platform)
            self.backend, self._page_size = backend, page_size
        tensor = cache.cache_tensor
        groups, group_of = [], {}
        max_len = int(cache.max_tokens_read)
        for name, allocator in allocators:
            num_blocks = tensor.numel() // allocator.bytes_per_block
            caches = adopt_kv_caches(
                backend, tensor, layout=CROSS_LAYER_NHD,
                num_layers=len(allocator.layer_indices), num_blocks=num_blocks,
                block_size=page_size, num_kv_heads=allocator.num_key_value_heads,
                head_size=allocator.head_dim, dtype=allocator.cache_dtype,
                device=tensor.device, platform=self._platform)
            window = getattr(allocator, "sliding_window", None) if name == _SLIDING else None
            impls = {}
            for idx in allocator.layer_indices:
                module = self._modules[idx]
                impls[idx] = backend.get_impl_cls()(
                    num_heads=module.config.num_attention_heads, head_size=allocator.head_dim,
                    scale=float(module.scaling), num_kv_heads=allocator.num_key_value_heads,
                    sliding_window=window, **_layer_features(module))
            group = CacheGroup(
                name=name, allocator_index=allocator.index,
                layers=dict(zip(allocator.layer_indices, caches.layers, strict=True)),
                impls=impls,
                spec=FullAttentionSpec(block_size=page_size, dtype=allocator.cache_dtype,
                                       num_kv_heads=allocator.num_key_value_heads,
                                       head_size=allocator.head_dim, sliding_window=window),
                row_stride=allocator.block_physical_stride, num_blocks=num_blocks,
                window=window)
            if window is not None:
                group.sentinel = allocator.sentinel_index
                group.write_trash = allocator.write_trash_index
                group.in_place = window % page_size == 0
                # gathered: the window and a step; in place: the window from mid-page
                max_len = max(max_len, window - 1 + int(cache.max_batch_tokens),
                              window + page_size - 1)
            groups.append(group)
            group_of.update(dict.fromkeys(allocator.layer_indices, group))
        first = self._modules[self._first]
        adopted = _Adopted(
            cache=weakref.ref(cache), backend=backend, groups=groups, group_of=group_of,
            num_heads=first.config.num_attention_heads, page_size=page_size,
            max_seqs=int(cache.max_batch_tokens), max_len=max_len)
        # The finalizer holds the record, not the cache: transformers' dropping its cache
        # (end of generate_batch) drops kvcore's views of the tensor too.
        adopted.release = weakref.finalize(cache, self._forget, adopted)
        return adopted

@contextlib.contextmanager
def use_kvcore(
    model: torch.nn.Module,
    backend: str | type[AttentionBackend] | None = None,
    *,
    page_size: int | None = None,
    platform: str | None = None,
) -> Iterator[KVCoreAttention]:
    """Run ``model``'s continuous batching on a kvcore backend inside the block.

    Args:
        model: a transformers causal LM whose layers are full or sliding-window attention.
        backend: a kvcore backend name or class; default: kvcore's selector, limited to the
            backends that can view transformers' cache.
        page_size: the ``ContinuousBatchingConfig.page_size`` the batching will use (default:
            transformers' default); the backend is checked against it up front, and
            re-selected at the first step if the cache turns out to use another.
        platform: force a kvcore platform (default: ``cpu`` for a CPU model, else detected).

    Yields:
        the :class:`KVCoreAttention` state (``backend``, ``steps``, ``adopted``).

    Raises:
        ImportError: transformers is not installed (the ``kvcore[transformers]`` extra).
        RuntimeError: an unsupported transformers version, or one whose internals changed.
        ValueError: a model or backend that cannot be served, with the reasons.
    """
    state = KVCoreAttention(model, backend, page_size, platform)
    state.attach()
    try:
        yield state
    finally:
        state.detach()
