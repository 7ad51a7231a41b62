"""FLASH_ATTN: FlashAttention's paged varlen kernels on kvcore's blocks-first cache.

Two kernel libraries, one backend
---------------------------------
FLASH_ATTN runs whichever FlashAttention library covers the device and is installed
(:attr:`FlashAttentionBackend.KERNELS`, first match wins):

- **flash-attn-4** (``flash_attn.cute``, FlashAttention in the CuTe DSL, a pure-Python wheel that
  compiles its kernels on first use) on Hopper (9.x) and Blackwell (10.x, 11.x):
  ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=..., max_seqlen_q=..., seqused_k=...,
  page_table=..., causal=..., window_size=...)``. It takes any page size (pages that do not hold
  whole key tiles are gathered row by row with ``cp.async``), strided pages (the K and V halves
  of the cache as they are) and int32 ``seqused_k`` / ``page_table``. Head sizes: multiples of 8
  up to 256 on 9.x; up to 128, or 256, on 10.x/11.x. It has no paged path on 8.x or 12.x.
- **flash-attn** 2 (``flash_attn.flash_attn_varlen_func`` with ``block_table``) on Ampere and
  newer where flash-attn-4 is not installed: head sizes multiples of 8 up to 256, and paged
  blocks that are a multiple of 256 tokens (``mha_varlen_fwd``: "Paged KV cache block size must
  be divisible by 256").

Both take fp16/bf16 with a model-dtype cache, causal masking aligned bottom-right (a request's
queries are its last tokens, kvcore's convention), a sliding window (``window_size``) and
grouped-query attention. Both also have a logit soft-cap and flash-attn-4 learnable sinks;
kvcore's backend contract carries neither (no config field, no layer parameter), so FLASH_ATTN
does not declare them.

Layout
------
The stride order is the one upstream FlashAttention backends declare: ``(0, 2, 1, 3, 4)`` per
layer (physical ``B,N,2,H,D``: a token's K and V side by side) and ``(1, 0, 3, 2, 4, 5)`` with
layers. The kernels get the ``kv_cache.unbind(1)`` halves, ``(num_blocks, block_size, H, D)``
views whose token stride is ``2 * H * D``, and take every stride from them. flash-attn-4 needs
16-byte aligned pointers and strides (else it silently copies the tensor, here the whole cache):
:meth:`FlashAttentionImpl.forward` refuses such a view instead.

**Cross-layer on CUDA** (:attr:`FlashAttentionBackend.CROSS_LAYER_PLATFORMS`): verified on
an H200 with flash-attn-4 (``test_flash_attn_on_a_cross_layer_view_is_bit_exact``: a per-layer
view of a cross-layer cache gives exactly the contiguous cache's output, neighbouring layers
untouched). The declaration is per backend, not per library: flash-attn 2 takes the same
strided views, but that test has not run on it.

Per step
--------
:class:`FlashAttentionMetadataBuilder` keeps the step in persistent int32 buffers (what both
libraries read: ``query_start_loc`` as ``cu_seqlens_q``, ``seq_lens`` as ``seqused_k``, the
block table as ``page_table``, plus flash-attn 2's ``cu_seqlens_k``) and picks the library once.
``forward`` only launches. CUDA graphs: ``UNIFORM_DECODE``, verified with flash-attn-4 on an
H200 (``test_flash_attn_decode_replays_from_a_cuda_graph``: a decode step captured for 8
requests replays later steps of other lengths and block tables exactly as they run eagerly).
flash-attn-4 allocates its output per call, inside the graph's memory pool when captured, and
``forward`` copies it into ``output``. Per backend, like cross-layer: flash-attn 2 has not run
that test.

**Stale bytes.** flash-attn-4 loads whole pages by TMA when a page holds whole key tiles: masked
rows get probability 0, but ``0 * NaN`` is NaN, so the unused tail of a request's last page must
hold finite values (``allocate_kv_caches`` allocates zeros; kvcore's writes store finite values).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    AttentionSelectorConfig,
    AttentionType,
    CudaGraphSupport,
    DeviceCapability,
    MultipleOf,
    PersistentMetadataBuilder,
    format_supported,
    is_supported,
)
from kvcore_nvidia.backends.common import PagedCacheImpl, cumulative

__all__ = ["FlashAttentionBackend", "FlashAttentionImpl", "FlashAttentionMetadata",
           "FlashAttentionMetadataBuilder", "FlashAttnKernels", "device_kernels",
           "module_installed"]


def module_installed(name: str) -> bool:
    """Whether the dotted module ``name`` is installed, found without importing it or its
    parent packages.

    ``flash_attn`` is a namespace package when only flash-attn-4 is installed, and flash-attn
    2's ``flash_attn/__init__.py`` loads its CUDA extension: neither may be imported to ask.
    """
    if name in sys.modules:
        return True
    head, *parts = name.split(".")
    try:
        spec = importlib.util.find_spec(head)
    except ValueError:  # a module in sys.modules without a spec (made at run time)
        return False
    for part in parts:
        locations = list(spec.submodule_search_locations or []) if spec else []
        spec = importlib.machinery.PathFinder.find_spec(part, locations) if locations else None
    return spec is not None


@dataclass(frozen=True)
class FlashAttnKernels:
    """One FlashAttention library on one range of devices: what FLASH_ATTN can run there.

    Attributes:
        library: the library's name in reasons (``"flash-attn-4"``).
        requirement: what to ``pip install``.
        module: the module whose presence means the library is installed.
        min_capability, max_capability: the devices its paged kernels run on (inclusive).
        head_sizes: head sizes its kernels are built for.
        block_sizes: tokens per page it accepts (``None``: any).
    """

    library: str
    requirement: str
    module: str
    min_capability: DeviceCapability
    max_capability: DeviceCapability | None
    head_sizes: tuple[int | MultipleOf, ...]
    block_sizes: tuple[int | MultipleOf, ...] | None

    def covers(self, capability: DeviceCapability) -> bool:
        return capability.at_least(self.min_capability) and (
            self.max_capability is None or self.max_capability.at_least(capability))

    def devices(self) -> str:
        """The capability range, e.g. ``9.0-9.x``."""
        hi = self.max_capability
        return f"{self.min_capability}-{hi.major}.x" if hi else f">= {self.min_capability}"

    def installed(self) -> bool:
        return module_installed(self.module)


_FA4 = ("flash-attn-4", "kvcore-nvidia[flash-attn]", "flash_attn.cute")
_FA2 = ("flash-attn 2", "flash-attn", "flash_attn.flash_attn_interface")


def device_kernels(device: torch.device | str) -> FlashAttnKernels:
    """The library FLASH_ATTN runs on ``device`` (a CUDA device), installed.

    Raises:
        ValueError: ``device`` is not a CUDA device, or no installed library runs on it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"FLASH_ATTN runs on CUDA devices only, got {device} (use CPU_ATTN or "
                         "FLEX_ATTENTION on the CPU)")
    return _cuda_kernels(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_kernels(index: int) -> FlashAttnKernels:
    capability = DeviceCapability(*torch.cuda.get_device_capability(index))
    kernels = FlashAttentionBackend.kernels_for(capability)
    if kernels is None or not kernels.installed():
        reasons = FlashAttentionBackend.check_combination(
            AttentionSelectorConfig(head_size=128), capability) or \
            FlashAttentionBackend.unavailable_reasons() or [
            f"no FlashAttention library runs on device capability {capability}"]
        raise ValueError(f"FLASH_ATTN cannot run on cuda:{index}: {'; '.join(reasons)}")
    return kernels


@dataclasses.dataclass
class FlashAttentionMetadata(AttentionMetadata):
    """:class:`~kvcore.AttentionMetadata` plus what FlashAttention reads, made once per step.

    Attributes:
        cu_seqlens_k: ``(num_seqs + 1,)`` int32 running sum of ``seq_lens`` (flash-attn 2's
            ``cu_seqlens_k``; flash-attn-4 reads ``seq_lens`` as ``seqused_k``), or ``None``
            when the library does not need it.
        kernels: the library the builder chose for its device.
    """

    cu_seqlens_k: torch.Tensor | None = None
    kernels: FlashAttnKernels | None = None


class FlashAttentionMetadataBuilder(PersistentMetadataBuilder):
    """The step in persistent int32 buffers (see :class:`kvcore.PersistentMetadataBuilder`),
    plus flash-attn 2's ``cu_seqlens_k`` in one more, ``(max_num_seqs + 1,)``; the library is
    chosen once, for the builder's device."""

    def __init__(self, spec, *, num_heads, max_num_seqs, max_num_batched_tokens,
                 max_model_len, device) -> None:
        super().__init__(spec, num_heads=num_heads, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, device=device)
        self.kernels = device_kernels(self.device) if self.device.type == "cuda" else None
        with torch.inference_mode(False):
            self.cu_seqlens_k = torch.zeros(max_num_seqs + 1, dtype=torch.int32,
                                            device=self.device)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**super().buffers(), "cu_seqlens_k": self.cu_seqlens_k}

    def build(self, common: AttentionMetadata, *,
              graph_batch_size: int | None = None) -> FlashAttentionMetadata:
        meta = super().build(common, graph_batch_size=graph_batch_size)
        cu_seqlens_k = None
        if self.kernels is None or self.kernels.library == "flash-attn 2":
            cu_seqlens_k = self.cu_seqlens_k[:meta.num_seqs + 1]
            torch.cumsum(meta.seq_lens, dim=0, out=cu_seqlens_k[1:])
        return meta.extend(FlashAttentionMetadata, cu_seqlens_k=cu_seqlens_k,
                           kernels=self.kernels)


def _check_aligned(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """flash-attn-4 copies a K/V tensor whose pointer or strides are not 16-byte aligned (here:
    the whole cache, every call); refuse it instead."""
    per_16 = max(1, 16 // key_cache.element_size())
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if (t.stride(-1) != 1 or t.data_ptr() % 16
                or any(s % per_16 for s in t.stride()[:-1])):
            raise ValueError(
                f"{name} has strides {t.stride()} and address {t.data_ptr():#x}: flash-attn-4 "
                f"needs the head dim contiguous, 16-byte aligned addresses and strides that are "
                f"multiples of {per_16} elements (it would copy the whole cache otherwise); "
                "allocate the cache with kvcore.allocate_kv_caches and a head size that is a "
                "multiple of 8")


def _window(sliding_window: int | None, causal: bool, fa2: bool) -> tuple[Any, Any]:
    """kvcore's window (the last ``sliding_window`` keys up to the query; non-causal, the
    symmetric ``|q_pos - k_pos| < sliding_window``) as FlashAttention's ``(left, right)``:
    keys in ``[q - left, q + right]``; unbounded is ``-1`` in flash-attn 2, ``None`` in
    flash-attn-4."""
    unbounded = -1 if fa2 else None
    if sliding_window is None:
        return (unbounded, unbounded)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


class FlashAttentionImpl(PagedCacheImpl):
    """Cache write: :func:`kvcore_nvidia.ops.write_kv_cache` (stride-aware). Attention:
    flash-attn-4's or flash-attn 2's ``flash_attn_varlen_func`` (see the module docstring)."""

    def attend(self, layer: AttentionLayer, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata, output: torch.Tensor) -> None:
        key_cache, value_cache = self.checked_halves(query, kv_cache, attn_metadata, output)
        m = attn_metadata
        built = isinstance(m, FlashAttentionMetadata)  # else plain metadata: choose here
        kernels = (m.kernels if built else None) or device_kernels(key_cache.device)
        causal = self.is_causal(m)
        # flash-attn reads these densely; an engine's view of a larger buffer may have
        # stride > 1 (contiguous() returns a dense int32 tensor as it is).
        cu_seqlens_q = m.query_start_loc.to(torch.int32).contiguous()
        page_table = m.block_table.to(torch.int32).contiguous()
        if kernels.library == "flash-attn 2":
            from flash_attn import flash_attn_varlen_func

            cu_seqlens_k = m.cu_seqlens_k if built else None
            out = flash_attn_varlen_func(
                query, key_cache, value_cache,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cumulative(m.seq_lens) if cu_seqlens_k is None else cu_seqlens_k,
                max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len,
                softmax_scale=self.scale, causal=causal,
                window_size=_window(self.sliding_window, causal, fa2=True),
                block_table=page_table)
        else:
            from flash_attn.cute.interface import flash_attn_varlen_func

            _check_aligned(key_cache, value_cache)
            out, _ = flash_attn_varlen_func(
                query, key_cache, value_cache,
                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=m.max_query_len,
                seqused_k=m.seq_lens.to(torch.int32).contiguous(), max_seqlen_k=m.max_seq_len,
                page_table=page_table,
                softmax_scale=self.scale, causal=causal,
                window_size=_window(self.sliding_window, causal, fa2=False))
        output.copy_(out)


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention (flash-attn-4, else flash-attn 2) paged varlen attention (see module)."""

    #: The libraries FLASH_ATTN runs, in preference order; a device takes the first one that
    #: covers it and is installed. Validation, reasons and the kernel choice derive from this.
    KERNELS: tuple[FlashAttnKernels, ...] = (
        FlashAttnKernels(*_FA4, DeviceCapability(9, 0), DeviceCapability(9, 9),
                         (MultipleOf(8, max=256),), None),
        FlashAttnKernels(*_FA4, DeviceCapability(10, 0), DeviceCapability(11, 9),
                         (MultipleOf(8, max=128), 256), None),
        FlashAttnKernels(*_FA2, DeviceCapability(8, 0), None, (MultipleOf(8, max=256),),
                         (MultipleOf(256),)),
    )
    # The envelope of KERNELS (what some library accepts on some device), for allocation and
    # `kvcore list`; check_combination narrows it to the library that runs on the device.
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
    SUPPORTED_KV_CACHE_DTYPES = ("auto",)
    SUPPORTED_HEAD_SIZES = (MultipleOf(8, max=256),)
    SUPPORTED_BLOCK_SIZES = None
    MIN_DEVICE_CAPABILITY = DeviceCapability(8, 0)
    SUPPORTS_NON_CAUSAL = True
    SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    PLATFORMS = ("cuda",)
    # The cache write is kvcore's Triton kernel.
    USES_TRITON = True
    # Both verified with flash-attn-4 on an H200 (the bit-exact cross-layer and the graph
    # replay GPU tests); per backend, so flash-attn 2 inherits them unverified.
    CROSS_LAYER_PLATFORMS = ("cuda",)
    CUDA_GRAPH_SUPPORT = CudaGraphSupport.UNIFORM_DECODE

    NAME = "FLASH_ATTN"
    IMPL_CLS = FlashAttentionImpl
    BUILDER_CLS = FlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Physical B,N,2,H,D (a token's K and V side by side), as upstream FlashAttention
        # backends lay blocks out; with layers B,L,N,2,H,D.
        return (1, 0, 3, 2, 4, 5) if include_num_layers_dimension else (0, 2, 1, 3, 4)

    @classmethod
    def kernels_for(cls, capability: DeviceCapability | None) -> FlashAttnKernels | None:
        """The library FLASH_ATTN runs on ``capability``: the first of :attr:`KERNELS` that
        covers it and is installed, else the first that covers it (``None``: none does)."""
        covering = [k for k in cls.KERNELS if capability is None or k.covers(capability)]
        return next((k for k in covering if k.installed()), covering[0] if covering else None)

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The envelope (the base class's fields) plus each library of :attr:`KERNELS`."""
        return {**super().capabilities(), "libraries": [
            {"library": k.library, "devices": k.devices(),
             "head_sizes": format_supported(k.head_sizes),
             "block_sizes": "any" if k.block_sizes is None else format_supported(k.block_sizes),
             "installed": k.installed()} for k in cls.KERNELS]}

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        reasons = []
        if not any(k.installed() for k in cls.KERNELS):
            reasons.append("neither flash-attn-4 (Hopper/Blackwell: pip install "
                           "'kvcore-nvidia[flash-attn]') nor flash-attn 2 (Ampere: pip install "
                           "flash-attn) is installed")
        return [*reasons, *super().unavailable_reasons()]

    @classmethod
    def import_reasons(cls) -> list[str]:
        # The library this machine's GPU runs, else every installed one.
        libraries = [k for k in cls.KERNELS if k.installed()]
        if torch.cuda.is_available():
            chosen = cls.kernels_for(DeviceCapability(*torch.cuda.get_device_capability()))
            libraries = [chosen] if chosen in libraries else libraries
        reasons = []
        for k in {k.module: k for k in libraries}.values():
            try:
                importlib.import_module(k.module)
            except Exception as exc:  # whatever a broken package raises
                reasons.append(f"{k.library} is installed but importing {k.module} fails: "
                               f"{type(exc).__name__}: {exc} (reinstall {k.requirement})")
        return reasons

    @classmethod
    def check_combination(
        cls, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        if device_capability is None:
            return []  # the base class already asks for the capability
        kernels = cls.kernels_for(device_capability)
        if kernels is None:
            return []  # below every library's minimum: the base class says so
        # Each is a clash of two fields, both within the envelope: named as field=value.
        on = (f"with device_capability={device_capability}: {kernels.library} (the kernels "
              f"there, devices {kernels.devices()})")
        reasons = []
        # Values outside the envelope already have the base class's reason.
        if is_supported(config.head_size, cls.SUPPORTED_HEAD_SIZES) and not is_supported(
                config.head_size, kernels.head_sizes):
            reasons.append(f"head_size={config.head_size} {on} supports "
                           f"{format_supported(kernels.head_sizes)}")
        if not is_supported(config.block_size, kernels.block_sizes):
            assert kernels.block_sizes is not None
            reasons.append(f"block_size={config.block_size} {on} supports "
                           f"{format_supported(kernels.block_sizes)}"
                           + ("; flash-attn-4 takes any block size on Hopper and Blackwell "
                              "(9.x-11.x)" if kernels.library == "flash-attn 2" else ""))
        installed = [k for k in cls.KERNELS if k.installed()]
        if not kernels.installed() and installed:
            library = installed[0].library
            devices = ", ".join(k.devices() for k in installed if k.library == library)
            reasons.append(f"device_capability={device_capability}: {library} is installed "
                           f"but its paged kernels run on device capability {devices} only; "
                           f"there FLASH_ATTN needs {kernels.library} "
                           f"(pip install {kernels.requirement})")
        return reasons

    @classmethod
    def stale_bytes_reason(cls, device_type: str) -> str | None:
        if device_type != "cuda":
            return None
        return ("flash-attn-4 loads whole pages by TMA when a page holds whole key tiles and "
                "weights masked rows by zero, and 0 * NaN is NaN: NaN/Inf in the unused tail of "
                "a request's last page reach its output (flash_attn.cute.interface documents it)")
