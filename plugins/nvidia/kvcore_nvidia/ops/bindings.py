"""The Python bindings of kvcore-nvidia's CUDA C++ ops: a stride-aware cache write and a batched
block copy.

Both validate their arguments in Python (errors name the argument) before anything is built
or launched, then call the extension compiled from ``csrc/nvidia`` on first use
(:mod:`kvcore_nvidia.ops._build`). On a machine that cannot build it (no CUDA torch, no GPU, no
nvcc) they raise ``RuntimeError`` with :func:`extension_unavailable_reason`.

- :func:`reshape_and_cache_flash` computes exactly :func:`kvcore.ops.reshape_and_cache_ref`
  (bit for bit, fp8 included) on caches of any strides, with int64 offsets.
- :func:`copy_blocks` moves whole KV blocks between GPU memory and pinned host memory (or
  between two GPU buffers): it sorts the mapping, merges adjacent blocks into runs
  (:func:`block_runs`), and issues one copy per run, all in one ``cudaMemcpyBatchAsync``
  by default.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

import torch

from kvcore.ops import (
    FP8_KV_CACHE_DTYPES,
    KVScale,
    block_runs,
    check_block_mapping,
    validate_reshape_and_cache,
)
from kvcore_nvidia.ops import _build

__all__ = [
    "COPY_METHODS",
    "DEFAULT_COPY_STREAMS",
    "build_extension",
    "copy_blocks",
    "extension_status",
    "extension_unavailable_reason",
    "reshape_and_cache_flash",
]

CopyMethod = Literal["batch", "per_run", "kernel"]
#: How :func:`copy_blocks` issues its copies: one ``cudaMemcpyBatchAsync`` for all runs
#: (one ``cudaMemcpyAsync`` each before CUDA 12.8), one ``cudaMemcpyAsync`` per run, or an
#: SM copy kernel reading/writing pinned memory through unified addressing.
COPY_METHODS: dict[str, int] = {"batch": 0, "per_run": 1, "kernel": 2}
_FP8_KIND = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}
_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def extension_unavailable_reason() -> str | None:
    """Why the CUDA C++ ops cannot run here (``None`` when they can be built and run)."""
    return _build.unavailable_reason()


def extension_status() -> str:
    """Whether the extension is loaded, built, not built yet, failed or unavailable (and why),
    without building it: what ``kvcore plugins`` and ``kvcore collect-env`` show."""
    return _build.status()


def build_extension() -> ModuleType:
    """Build (or load from the on-disk cache) the extension now rather than on the first call:
    an engine calls it at start-up to keep the one-time nvcc compile out of its first step.

    Raises:
        RuntimeError: it cannot be built here or the build failed (the reason says why).
    """
    return _build.load()


def _scale_args(scale: KVScale,
                device: torch.device) -> tuple[torch.Tensor | None, float]:
    """A scale as the kernel takes it: a float32 device tensor read in the kernel (no host
    sync, CUDA-graph safe), or a float."""
    if scale is None:
        return None, 1.0
    if isinstance(scale, torch.Tensor):
        if scale.device == device:
            return scale.reshape(1).to(torch.float32), 1.0
        return None, float(scale.reshape(()).item())
    return None, float(scale)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_cache_dtype: str = "auto", k_scale: KVScale = None,
                            v_scale: KVScale = None) -> None:
    """:func:`kvcore.ops.reshape_and_cache_ref`'s cache write on the CUDA C++ kernel, bit for
    bit (arguments and shapes documented there; fp8 stores ``satfinite(x * float32(1 /
    scale))``), for float16/bfloat16/float32 ``key``/``value`` on CUDA tensors.

    Raises:
        ValueError, TypeError: a bad argument (kvcore's validator, same messages), before
            anything is built or launched.
        RuntimeError: the extension cannot be built here (the reason says why).
    """
    validate_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                               kv_cache_dtype, k_scale, v_scale)
    if key.dtype not in _MODEL_DTYPES:
        raise TypeError(f"key has dtype {key.dtype}; reshape_and_cache_flash supports "
                        "float16, bfloat16 and float32")
    if key_cache.device.type != "cuda":
        raise ValueError(f"key_cache is on {key_cache.device}; reshape_and_cache_flash runs on "
                         "CUDA tensors (kvcore.ops.reshape_and_cache_ref runs anywhere)")
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    k_tensor, k_value = _scale_args(k_scale if fp8 else None, key_cache.device)
    v_tensor, v_value = _scale_args(v_scale if fp8 else None, key_cache.device)
    # The kernel indexes slot_mapping densely; an engine's view of a larger buffer may have
    # stride > 1 (contiguous() returns a dense tensor as it is).
    _build.load().reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping.contiguous(), _FP8_KIND[kv_cache_dtype],
        k_tensor, v_tensor, k_value, v_value)


def _check_copy_args(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                     method: str, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What is copied first (method, shapes, mapping), then where the memory lives."""
    if not isinstance(block_mapping, torch.Tensor):
        raise TypeError(f"block_mapping must be a torch.Tensor, got {type(block_mapping).__name__}")
    if method not in COPY_METHODS:
        raise ValueError(f"method={method!r} (supported: {', '.join(COPY_METHODS)})")
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 8:
        raise ValueError(f"streams={streams!r} must be an integer from 1 to 8")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be (num_pairs, 2) (src_block, dst_block), got "
                         f"shape {tuple(block_mapping.shape)}")
    src_ids, dst_ids = check_block_mapping(
        src, dst, block_mapping[:, 0], block_mapping[:, 1],
        names=("src", "dst", "block_mapping[:, 0]", "block_mapping[:, 1]"))
    for name, t in (("src", src), ("dst", dst)):
        if t.shape[0] and not t[0].is_contiguous():
            raise ValueError(f"{name}'s blocks are not contiguous (strides {t.stride()}); pass "
                             "a blocks-first view whose every block is one run of bytes")
    for name, t in (("src", src), ("dst", dst)):
        if t.device.type == "cpu" and not t.is_pinned():
            raise ValueError(f"{name} is in pageable host memory; copy_blocks needs pinned "
                             "memory (torch.empty(..., pin_memory=True)) for asynchronous copies")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {t.device}; copy_blocks moves CUDA and pinned memory")
    if src.device.type != "cuda" and dst.device.type != "cuda":
        raise ValueError("src and dst are both host memory; one side must be on a GPU")
    if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
        raise ValueError(f"src is on {src.device} and dst on {dst.device}; copy_blocks moves "
                         "blocks within one GPU or between it and host memory")
    if (src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
            and bool(torch.isin(dst_ids, src_ids).any())):
        raise ValueError("src and dst share memory and a block is both read and written; the "
                         "copies of one call run in no fixed order")
    if method == "kernel":
        page = src[0].numel() * src.element_size() if src.shape[0] else 0
        strides = (src.stride(0) * src.element_size(), dst.stride(0) * dst.element_size())
        if (page % 16 or any(s % 16 for s in strides)
                or src.data_ptr() % 16 or dst.data_ptr() % 16):
            raise ValueError("method='kernel' copies 16-byte vectors: the blocks' sizes, "
                             "strides and start addresses must be multiples of 16 bytes")
    return src_ids, dst_ids


#: Default of :func:`copy_blocks`'s ``streams``: four batches in flight moved scattered blocks
#: faster than one, and large runs no slower (measurements in ``benchmarks/RESULTS.md``).
DEFAULT_COPY_STREAMS = 4


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                method: CopyMethod = "batch", streams: int = DEFAULT_COPY_STREAMS) -> int:
    """Copy ``src[block_mapping[i, 0]]`` to ``dst[block_mapping[i, 1]]`` for every row.

    Args:
        src, dst: blocks-first tensors with the same block shape and dtype (e.g.
            :meth:`kvcore.KVCaches.block_view`, ``(num_blocks, page_bytes)`` uint8), each
            block one contiguous run of bytes; one on a GPU, the other on the same GPU or in
            pinned host memory.
        block_mapping: ``(num_pairs, 2)`` int ``(src_block, dst_block)``; dst blocks unique.
        method: see :data:`COPY_METHODS` (``"batch"`` is the fast default).
        streams: for ``"batch"`` and ``"per_run"``, split the copies (in order, contiguous
            shares) over this many pooled side streams, so several are in flight at once
            (:data:`DEFAULT_COPY_STREAMS`); ``"kernel"`` ignores it (one launch sequence on
            the current stream).

    Returns:
        The number of copies issued: runs of adjacent blocks are merged into one.

    The copies are queued asynchronously, ordered after the work already queued on the current
    CUDA stream and before the work queued on it next (side streams are joined back; ``"batch"``
    always uses one, since the batch API refuses the legacy default stream): synchronise before
    reading host memory. Arguments are checked (and the mapping read on the host) before
    anything is built or queued.
    """
    src_ids, dst_ids = _check_copy_args(src, dst, block_mapping, method, streams)
    page = src[0].numel() if src.shape[0] else 0
    runs = block_runs(src_ids, dst_ids, src.stride(0) == page, dst.stride(0) == page)
    if runs.shape[0]:
        _build.load().copy_block_runs(src, dst, runs, COPY_METHODS[method], streams)
    return int(runs.shape[0])
