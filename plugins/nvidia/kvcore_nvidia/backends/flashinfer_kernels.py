"""FLASHINFER's kernels: which FlashInfer kernels a configuration runs
(:func:`flashinfer_kernels`, the one place they are chosen, per GPU and phase), the wrappers
that run them and the arguments every plan takes (see :mod:`kvcore_nvidia.backends.flashinfer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["TENSOR_CORE_DECODE_MIN_GROUP", "WORKSPACE_BYTES", "FlashInferKernels",
           "cuda_capability", "flashinfer_kernels", "new_wrappers",
           "plan_args"]

#: Bytes of the float workspace shared by the wrappers of one builder (or device),
#: FlashInfer's recommended size (``FlashInferBackend.WORKSPACE_BYTES``).
WORKSPACE_BYTES = 128 * 1024 * 1024


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


#: Query heads per K/V head from which tensor-core decode is the faster decode kernel:
#: FlashInfer packs the group's query heads into the rows of one tensor-core tile, so each
#: K/V page is read once for the group; with fewer heads per group the tile is mostly empty
#: and the CUDA-core decode kernel is faster (FlashInfer's own guidance, as in vLLM).
TENSOR_CORE_DECODE_MIN_GROUP = 4


def flashinfer_kernels(capability: tuple[int, int] | None, num_heads: int,
                       num_kv_heads: int) -> FlashInferKernels:
    """The fastest FlashInfer kernels per phase: the one place they are chosen.

    - Prefill: on SM 9.x (Hopper: H100, H200) FlashInfer's SM90 kernels (``"fa3"``: wgmma and
      TMA), which take the cache's strides like fa2 and cover what this backend declares
      (fp16/bf16, head sizes 64/128/256, causal or not, sliding window, logit soft-cap). On
      Ampere and Ada (8.x) ``"fa2"``, FlashInfer's fastest there. On Blackwell (10.x, 12.x)
      ``"fa2"`` too: FlashInfer's Blackwell prefill kernels (``"cutlass"``, ``"trtllm-gen"``)
      come with other layout and option constraints and have not been verified on kvcore's
      cache.
      ``capability`` ``None`` (no GPU: the CPU tests' stand-ins) gives ``"fa2"``.
    - Decode: tensor cores when a K/V head serves at least
      :data:`TENSOR_CORE_DECODE_MIN_GROUP` query heads, else the CUDA-core decode kernel.

    A mixed batch runs its decode requests on the decode kernel and the rest on the prefill
    kernel (see :mod:`kvcore_nvidia.backends.flashinfer`).
    """
    prefill = "fa3" if capability is not None and capability[0] == 9 else "fa2"
    group = num_heads // max(num_kv_heads, 1)
    return FlashInferKernels(prefill=prefill,
                             decode_tensor_cores=group >= TENSOR_CORE_DECODE_MIN_GROUP)


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
    the capped variant of its kernels only for a positive cap)."""
    window_left = -1 if sliding_window is None else sliding_window - 1
    return ((num_heads, num_kv_heads, head_size, block_size),
            dict(window_left=window_left, sm_scale=scale, logits_soft_cap=logits_soft_cap,
                 q_data_type=q_dtype, kv_data_type=kv_dtype))

