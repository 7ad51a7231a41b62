"""What TRITON_MLA's TMA-loading decode kernels need of a latent cache, and Triton's scratch
allocator for the tensor descriptors they build on the device.

Both kernels that load through tensor descriptors (``"triton_mla_decode_tma_keysplit"`` and
``"gluon_mla_ws"``, :mod:`~kvcore_mla.ops.mla_configs`) see the cache as rows of its token
stride: page ``p``'s token ``j`` is row ``p * (page stride / token stride) + j``, a tile
``block_n`` consecutive rows of one page. :func:`tma_unmet` and :func:`gluon_unmet` say, as a
sentence naming the fix, why a cache (and for Gluon the queries) cannot be served;
:func:`mla_decode_config <kvcore_mla.ops.mla_configs.mla_decode_config>` and the decode entry
points given no config skip those rows then.

This module imports triton.
"""

from __future__ import annotations

import contextvars
import importlib
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_utils import gluon_kernels_unavailable, recording_launches
from kvcore_mla.ops.triton_utils import is_rocm

__all__ = ["GLUON_DTYPES", "GLUON_MAX_WIDTH", "descriptors_available", "gluon_available",
           "gluon_unmet", "tma_rows", "tma_unmet", "with_scratch_allocator"]


def descriptors_available() -> bool:
    """Whether the installed Triton has ``tl.make_tensor_descriptor`` (3.4 or newer)."""
    return hasattr(tl, "make_tensor_descriptor")


# The fixes a refusal names: a decode configuration of another kernel.
_POINTER_FIX = "a pointer-load config (e.g. mla_decode_config(..., tma=False))"
_TRITON_FIX = "a Triton config (e.g. mla_decode_config(..., gluon=False))"
#: TMA coordinates are signed 32-bit: the rows a descriptor spans.
_TMA_MAX_ROWS = 2**31 - 1


def tma_unmet(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> str | None:
    """Why the TMA kernel (``"triton_mla_decode_tma_keysplit"``) in tiles of ``block_n``
    latents cannot read ``kv_cache`` (3-dim ``(num_pages, page_size, kv_lora_rank + rope)``),
    as a sentence naming the unmet condition and the fix; ``None`` when it can."""
    if not descriptors_available():
        return (f"the kernel triton_mla_decode_tma_keysplit needs tl.make_tensor_descriptor "
                f"(Triton 3.4 or newer); Triton {triton.__version__} lacks it: upgrade Triton "
                f"or use {_POINTER_FIX}")
    return _descriptor_unmet(kv_cache, kv_lora_rank, block_n, "the TMA kernel", _POINTER_FIX)


def _descriptor_unmet(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int, path: str,
                      fix: str) -> str | None:
    """Why tensor descriptors over ``kv_cache`` seen as rows of its token stride, in tiles of
    ``block_n`` rows, cannot read it (``path`` names the kernel, ``fix`` the config change);
    ``None`` when they can."""
    num_pages, page_size, width = kv_cache.shape
    item = kv_cache.element_size()
    if page_size % block_n:
        return (f"block_n={block_n} does not divide the cache's page size "
                f"{page_size}: {path} loads tiles that lie in one page (use a block_n "
                f"that divides the page size, or {fix})")
    if kv_cache.stride(2) != 1 and width > 1:
        return (f"kv_cache has last stride {kv_cache.stride(2)}; {path} needs contiguous "
                f"channels (stride 1): pass a cache whose last dim is contiguous, or use {fix}")
    stride_page, stride_token = kv_cache.stride(0), kv_cache.stride(1)
    base = kv_cache.data_ptr()
    if (base | stride_token * item | kv_lora_rank * item) % 16:  # messages only on a refusal
        unaligned = [what for what, nbytes in (
            (f"base address {base:#x}", base),
            (f"token stride ({stride_token} x {item} bytes)", stride_token * item),
            (f"rope offset (kv_lora_rank={kv_lora_rank} x {item} bytes)", kv_lora_rank * item),
        ) if nbytes % 16]
        return (f"kv_cache's {' and '.join(unaligned)} is not a multiple of 16 bytes, as "
                f"tensor descriptors (TMA) need: use a 16-byte aligned cache, or {fix}")
    if stride_token <= 0 or stride_page % stride_token:
        return (f"kv_cache's page stride {stride_page} is not a multiple of its token stride "
                f"{stride_token}; {path} addresses the cache as rows of the token "
                f"stride: use {fix} for this layout")
    if (num_pages - 1) * (stride_page // stride_token) + page_size > _TMA_MAX_ROWS:
        return ("kv_cache spans more than 2**31 - 1 rows of its token stride, past what TMA "
                f"coordinates reach: use {fix} for this cache")
    return None


#: Query and cache dtypes the Gluon decode kernel takes.
GLUON_DTYPES = (torch.bfloat16, torch.float16)
#: The widest query / cache row (kv_lora_rank + rope) the Gluon kernel takes: the query and two
#: 64-row stages of 16-bit channels, plus 1 KiB of barriers and row factors, within 227 KiB.
GLUON_MAX_WIDTH = (227 * 1024 - 1024) // (3 * 64 * 2)


def gluon_available() -> str | None:
    """``None`` when the installed Triton can build the Gluon decode kernel for Hopper
    (:mod:`kvcore_mla.ops.gluon_mla_decode` imports), else why not, as a sentence."""
    return gluon_kernels_unavailable("kvcore_mla.ops.gluon_mla_decode")


def gluon_unmet(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why the Gluon decode kernel (``"gluon_mla_ws"``) cannot serve queries ``q`` ``(batch,
    heads, kv_lora_rank + rope)`` on ``kv_cache`` (3-dim ``(num_pages, page_size,
    kv_lora_rank + rope)``), as a sentence naming the unmet condition and the fix; ``None``
    when it can: Triton has Gluon's Hopper API, the tensors are on a GPU of compute
    capability 9.x, both bf16 or both fp16, ``kv_lora_rank`` 128, 256 or 512 (two
    warpgroups' halves of at most 256 columns) and the rope width 64 times a power of two (TMA
    boxes of 64-channel chunks), the query and two 64-row stages within Hopper's 227 KiB of
    shared memory (:data:`GLUON_MAX_WIDTH` channels at most, DeepSeek's 576 included), the page
    size a multiple of 64 and the cache addressable by tensor descriptors (as
    :func:`tma_unmet` checks). The device is not
    checked while launches are recorded for an ahead-of-time compile
    (:func:`kvcore.ops.triton_utils.recording_launches`)."""
    reason = gluon_available()
    if reason is not None:
        return reason
    if q.dtype not in GLUON_DTYPES or kv_cache.dtype != q.dtype:
        return (f"the kernel gluon_mla_ws takes bf16 or fp16 queries and a cache of the same "
                f"dtype; got q {q.dtype} and kv_cache {kv_cache.dtype}: use {_TRITON_FIX}")
    if kv_lora_rank not in (128, 256, 512):
        return (f"the kernel gluon_mla_ws needs kv_lora_rank = 128, 256 or 512 (each of the Gluon "
                f"kernel's two warpgroups holds half the latent columns, at most 256); it is "
                f"{kv_lora_rank}: use {_TRITON_FIX}")
    rope = q.shape[2] - kv_lora_rank
    if rope % 64 or rope < 64 or (rope // 64) & (rope // 64 - 1):
        return (f"the kernel gluon_mla_ws needs rope width = 64 x a power of two (TMA boxes of "
                f"64-channel chunks); it is {rope}: use {_TRITON_FIX}")
    if q.shape[2] > GLUON_MAX_WIDTH:
        return (f"the kernel gluon_mla_ws keeps the query and two 64-row stages of {q.shape[2]} "
                f"channels in shared memory, {3 * 64 * 2 * q.shape[2] // 1024} KiB, more than "
                f"Hopper's 227 KiB (at most {GLUON_MAX_WIDTH} channels): use {_TRITON_FIX}")
    reason = _descriptor_unmet(kv_cache, kv_lora_rank, 64, "the Gluon kernel", _TRITON_FIX)
    if reason is not None:
        return reason
    device = kv_cache.device
    if recording_launches():  # compiled ahead of time for a target: no device to check
        return None
    if device.type != "cuda" or is_rocm() or torch.cuda.get_device_capability(device)[0] != 9:
        where = (f"{device} (compute capability {torch.cuda.get_device_capability(device)})"
                 if device.type == "cuda" and not is_rocm() else str(device))
        return (f"the kernel gluon_mla_ws runs on NVIDIA Hopper GPUs (compute capability 9.x); "
                f"kv_cache is on {where}: use {_TRITON_FIX}")
    return None


def tma_rows(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> tuple[int, int]:
    """For the TMA kernel: ``(kv_rows, page_rows)``, the cache seen as rows of ``stride(1)``
    elements (``kv_rows`` of them, a page every ``page_rows``); raises ValueError with
    :func:`tma_unmet`'s reason when the cache does not meet its needs."""
    reason = tma_unmet(kv_cache, kv_lora_rank, block_n)
    if reason is not None:
        raise ValueError(reason)
    page_rows = kv_cache.stride(0) // kv_cache.stride(1)
    return (kv_cache.shape[0] - 1) * page_rows + kv_cache.shape[1], page_rows


def _torch_scratch(device: torch.device) -> Callable[[int, int, int | None], torch.Tensor]:
    """A Triton allocator (``triton.set_allocator``'s protocol) of torch memory on
    ``device``: its caching allocator (and a CUDA graph's pool during capture) serves it."""
    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    return alloc


def with_scratch_allocator(device: torch.device, launch: Callable[[], None]) -> None:
    """Run ``launch``, a kernel launch that builds tensor descriptors on the device (Triton
    writes them to a global scratch buffer it allocates per launch), with an allocator: the
    one the caller set with ``triton.set_allocator`` if any, else a torch one for this launch
    only. Triton keeps its allocator in a ContextVar: it is set and reset around the launch
    (or, should that private variable move, set in a copy of the context), so no other code
    sees it."""
    var = getattr(importlib.import_module("triton.runtime._allocation"), "_allocator", None)
    if var is None:
        def run() -> None:
            triton.set_allocator(_torch_scratch(device))
            launch()

        contextvars.copy_context().run(run)
        return
    if type(var.get()).__name__ != "NullAllocator":  # the caller's allocator
        launch()
        return
    token = var.set(_torch_scratch(device))
    try:
        launch()
    finally:
        var.reset(token)
