"""FLASHINFER's kernels: which FlashInfer kernels a configuration runs
(:func:`flashinfer_kernels`, the one place they are chosen, per GPU and phase), the wrappers
that run them and the arguments every plan takes (see :mod:`kvcore_nvidia.backends.flashinfer`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["FP8_CACHE_DTYPES", "TENSOR_CORE_DECODE_MIN_GROUP", "WORKSPACE_BYTES",
           "FlashInferKernels", "HostScales", "cuda_capability", "flashinfer_kernels",
           "new_wrappers", "plan_args"]

#: Bytes of the float workspace shared by the wrappers of one builder (or device),
#: FlashInfer's recommended size (``FlashInferBackend.WORKSPACE_BYTES``).
WORKSPACE_BYTES = 128 * 1024 * 1024

#: The fp8 storage dtypes FlashInfer's fa2 kernels read with fp16/bf16 queries.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class FlashInferKernels:
    """The FlashInfer kernels a configuration runs (see :func:`flashinfer_kernels`).

    Attributes:
        prefill: the prefill wrapper's ``backend``: ``"fa3"`` (FlashInfer's SM90 kernels) or
            ``"fa2"``.
        decode_tensor_cores: the decode wrapper's ``use_tensor_cores``.
    """

    prefill: str
    decode_tensor_cores: bool


#: Query heads per K/V head from which tensor-core decode is the faster decode kernel on a
#: cache of the model's dtype without a window: FlashInfer packs the group's query heads into
#: the rows of one tensor-core tile, so each K/V page is read once for the group. Measured on
#: an H100 (2026-12-06, benchmarks/RESULTS.md): at 2 (Gemma 2's 16/8 heads of 256, decode
#: 64 x 4096 bf16) tensor cores took 712 us, the CUDA-core decode kernel 733. With one query
#: head per K/V head (MHA) the tile is mostly empty and the CUDA-core kernel is kept.
TENSOR_CORE_DECODE_MIN_GROUP = 2


def flashinfer_kernels(capability: tuple[int, int] | None, num_heads: int,
                       num_kv_heads: int, kv_dtype: torch.dtype | None = None,
                       sliding_window: int | None = None) -> FlashInferKernels:
    """The fastest FlashInfer kernels per phase: the one place they are chosen.

    - Prefill: on SM 9.x (Hopper: H100, H200) FlashInfer's SM90 kernels (``"fa3"``: wgmma and
      TMA), which take the cache's strides like fa2 and cover what this backend declares
      (fp16/bf16, head sizes 64/128/256, causal or not, sliding window, logit soft-cap) on a
      cache of the model's dtype. An fp8 cache (``kv_dtype`` an fp8 dtype) with fp16/bf16
      queries runs on ``"fa2"``: FlashInfer's SM90 kernels read an fp8 cache only with fp8
      queries. On
      Ampere and Ada (8.x) ``"fa2"``, FlashInfer's fastest there. On Blackwell (10.x, 12.x)
      ``"fa2"`` too: FlashInfer's Blackwell prefill kernels (``"cutlass"``, ``"trtllm-gen"``)
      come with other layout and option constraints and have not been verified on kvcore's
      cache.
      ``capability`` ``None`` (no GPU: the CPU tests' stand-ins) gives ``"fa2"``.
    - Decode: tensor cores when a K/V head serves at least
      :data:`TENSOR_CORE_DECODE_MIN_GROUP` query heads, on an fp8 cache and on a layer with a
      ``sliding_window``, else the CUDA-core decode kernel. FlashInfer's CUDA-core decode
      kernel reads every page of a request, also those a window excludes (H100, Gemma 2's
      4096-token window at 8 x 32768: 715 us against 101 on tensor cores), and converts fp8
      slowly (64 x 4096: 687 us, about its bf16 time, against 391).

    A mixed batch runs its decode requests on the decode kernel and the rest on the prefill
    kernel (see :mod:`kvcore_nvidia.backends.flashinfer`).
    """
    fp8_cache = kv_dtype in FP8_CACHE_DTYPES
    prefill = ("fa3" if capability is not None and capability[0] == 9 and not fp8_cache
               else "fa2")
    group = num_heads // max(num_kv_heads, 1)
    tensor_cores = (group >= TENSOR_CORE_DECODE_MIN_GROUP or fp8_cache
                    or sliding_window is not None)
    return FlashInferKernels(prefill=prefill, decode_tensor_cores=tensor_cores)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s CUDA compute capability, ``None`` off CUDA (the argument
    :func:`flashinfer_kernels` takes)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def new_wrappers(workspace: torch.Tensor, kernels: FlashInferKernels) -> tuple[Any, Any]:
    """A (prefill, decode) pair of eager wrappers sharing ``workspace``."""
    import flashinfer

    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
                                                             backend=kernels.prefill)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=kernels.decode_tensor_cores, backend="fa2")
    return prefill, decode


def plan_args(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
              scale: float, sliding_window: int | None, q_dtype: torch.dtype,
              kv_dtype: torch.dtype, logits_soft_cap: float | None = None
              ) -> tuple[tuple, dict]:
    """The ``plan`` arguments every FlashInfer wrapper of a layer takes after its page lists:
    ``(shape, options)``, ``shape`` the positional ``(num_heads, num_kv_heads, head_size,
    block_size)`` and ``options`` the keywords (window, softmax scale, logit soft-cap,
    dtypes).

    ``logits_soft_cap``: FlashInfer's ``cap * tanh(s / cap)`` of the scaled score ``s``,
    kvcore's convention (``None``: none; FlashInfer reads ``None`` as 0, no cap, and builds
    the capped variant of its kernels only for a positive cap). ``kv_dtype`` is the cache's
    storage dtype: an fp8 cache is read by FlashInfer's mixed-precision kernels (fp8 K/V
    converted in registers, queries and output in ``q_dtype``), its scales passed to ``run``
    (see :class:`HostScales`)."""
    window_left = -1 if sliding_window is None else sliding_window - 1
    return ((num_heads, num_kv_heads, head_size, block_size),
            dict(window_left=window_left, sm_scale=scale, logits_soft_cap=logits_soft_cap,
                 q_data_type=q_dtype, kv_data_type=kv_dtype))



class HostScales:
    """A layer's fp8 K/V scales as the host floats FlashInfer's ``run`` takes (``k_scale`` is
    folded into the softmax scale on the host, ``v_scale`` multiplies the output; a tensor
    there would not be), for one layer.

    :meth:`kwargs` returns ``{"k_scale": k, "v_scale": v}`` for ``layer.k_scale`` and
    ``layer.v_scale`` (floats, or one-element tensors read with one device read). A tensor is
    read again only when it changed: another object, or the same one written in place (its
    version counter, which every in-place op advances), so scales calibrated between steps
    are seen. Reading a device tensor inside a CUDA graph capture is refused (a capture
    cannot read the device): run one eager step first, as ``kvcore.CudaGraphRunner`` does.
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        #: ``(k_scale, v_scale, k_version, v_version, kwargs)`` of the last read; empty before.
        self._seen: tuple = ()

    def kwargs(self, layer: Any) -> dict[str, float]:
        """``{"k_scale": ..., "v_scale": ...}`` of ``layer`` as floats (see the class)."""
        k, v = layer.k_scale, layer.v_scale
        seen = self._seen
        if (seen and seen[0] is k and seen[1] is v and _version(k) == seen[2]
                and _version(v) == seen[3]):
            return seen[4]
        kwargs = {"k_scale": _host_float(k, "k_scale"), "v_scale": _host_float(v, "v_scale")}
        self._seen = (k, v, _version(k), _version(v), kwargs)
        return kwargs


def _version(scale: object) -> int | None:
    return scale._version if isinstance(scale, torch.Tensor) else None


def _host_float(scale: object, name: str) -> float:
    """``scale`` (a float or a one-element tensor) as a positive finite float."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"layer.{name} has shape {tuple(scale.shape)}: FLASHINFER takes "
                             "one scale per layer for an fp8 cache (a float or a one-element "
                             "tensor); per-head scales are not supported")
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"layer.{name} (a CUDA tensor) is read for the first time inside "
                               "a CUDA graph capture, which cannot read the device: run one "
                               "eager step before capturing (kvcore.CudaGraphRunner does)")
        value = float(scale.item())
    else:
        value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"layer.{name}={value!r}: an fp8 cache's scale must be a finite "
                         "float > 0 (the cache stores value / scale)")
    return value
