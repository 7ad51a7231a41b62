"""Triton cache write: scatter new K/V tokens into a paged, blocks-first KV cache.

``reshape_and_cache`` implements exactly :func:`kvcore.ops.reference.reshape_and_cache_ref`:
``key``/``value`` are ``(num_tokens, num_kv_heads, head_size)`` and the caches are
``(num_blocks, block_size, num_kv_heads, head_size)`` views of any strides (a per-layer view,
``kv_cache.unbind(1)`` of the blocks-first cache, one layer of a cross-layer allocation, the
halves of a legacy ``(2, num_blocks, ...)`` cache). Every stride is taken from the tensors, so
a kernel launched on a view writes only the bytes that view covers.

One program writes the K and V of a few tokens for a block of heads (all heads when they fit
in ``_TILE`` elements), with 16-byte vector loads and stores along ``head_size``. All address
arithmetic is int64: a layer of a 32-layer cross-layer pool with block ids above 2,048 sits
more than 2**31 elements from the storage's start.

This module imports triton at import time; :mod:`kvcore.ops` imports it lazily.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from kvcore.ops.triton_launch import KernelLaunch, int_class
from kvcore.ops.triton_utils import (
    fp8_format,
    is_interpreted,
    load_kv_scales,
    next_power_of_2,
    round_to_fp8_grid,
    scale_args,
)
from kvcore.ops.validation import (
    FP8_KV_CACHE_DTYPES,
    KVScale,
    check_reshape_and_cache_values,
    check_scale,
    validate_reshape_and_cache,
    value_checks_enabled,
)
from kvcore.step_facts import checked_step_facts

__all__ = ["reshape_and_cache"]

# Elements of one program's (tokens x heads x head_size) tile per tensor: 4,096 bf16 values are
# 32 per thread with 4 warps (four 16-byte vectors each for K and V), without spilling.
_TILE = 4096
_MAX_TOKENS_PER_PROGRAM = 16


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_tokens, block_size, num_kv_heads, head_size,
    FP8: tl.constexpr, SCALE_IS_TENSOR: tl.constexpr, FP8_MAX: tl.constexpr,
    EXACT_FP8_ROUNDING: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # A (BLOCK_T tokens, BLOCK_H heads, BLOCK_D dims) tile: several tokens per program keep
    # many independent 16-byte loads in flight behind the one slot lookup.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_valid = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=t_valid, other=-1).to(tl.int64)
    t_valid = t_valid & (slots >= 0)  # negative slots are padding
    blocks = slots // block_size
    offsets = slots % block_size

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads64 = heads.to(tl.int64)[None, :, None]
    dims64 = dims.to(tl.int64)[None, None, :]
    mask = (t_valid[:, None, None] & (heads[None, :, None] < num_kv_heads)
            & (dims[None, None, :] < head_size))
    t3 = tokens[:, None, None]

    k = tl.load(key_ptr + t3 * stride_kt + heads64 * stride_kh + dims64 * stride_kd, mask=mask)
    v = tl.load(value_ptr + t3 * stride_vt + heads64 * stride_vh + dims64 * stride_vd,
                mask=mask)
    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALE_IS_TENSOR)
        # One definition everywhere (see kvcore.ops.reference): multiply by the float32
        # reciprocal of the scale, computed with an exact division.
        k_inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), ks)
        v_inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), vs)
        k = tl.clamp(k.to(tl.float32) * k_inv, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * v_inv, -FP8_MAX, FP8_MAX)
        if EXACT_FP8_ROUNDING:
            k = round_to_fp8_grid(k, MANTISSA_BITS, MIN_EXPONENT)
            v = round_to_fp8_grid(v, MANTISSA_BITS, MIN_EXPONENT)

    kc = (blocks * stride_kcb + offsets * stride_kcs)[:, None, None]
    vc = (blocks * stride_vcb + offsets * stride_vcs)[:, None, None]
    tl.store(key_cache_ptr + kc + heads64 * stride_kch + dims64 * stride_kcd,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + vc + heads64 * stride_vch + dims64 * stride_vcd,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str = "auto", k_scale: KVScale = None,
                      v_scale: KVScale = None) -> None:
    """:func:`kvcore.ops.reshape_and_cache_ref`'s cache write on a Triton kernel, byte for
    byte (arguments, shapes and errors documented there); ``key``/``value`` may be slices of
    a fused QKV projection, and a tensor scale is read on the device (no host sync).

    The argument checks the caches decide run once per cache (:class:`_CacheWrite`); a call
    compares its tokens with what the cache's checks saw and repeats only the value checks
    (:func:`~kvcore.ops.validation.check_reshape_and_cache_values`), or runs every check
    again when something differs, so a bad argument gets the same message as ever. The
    cache's checks are found by the cache view objects of the last call on them
    (:class:`CacheViews`: the same objects, unchanged) and the call's dtype, cache dtype and
    scales, else by the caches' full signature (:func:`_write_key`). What the step's
    ``slot_mapping`` gives (its facts, the value checks for a cache's geometry, its launch
    arguments) is derived by the first call on it and kept while it is unchanged
    (:class:`_Slots`), so every other layer of the step reuses it.
    """
    seen = _RECENT.get(id(key_cache))
    if seen is not None and seen[0].same(key_cache, value_cache) and seen[1].same_call(
            key, kv_cache_dtype, k_scale, v_scale):
        found = seen[1]
    else:
        try:
            found = _WRITES.get(_write_key(key, key_cache, value_cache, kv_cache_dtype,
                                           k_scale, v_scale))
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
            found = None
        seen = None
    slots = None if found is None else found.takes(key, value, slot_mapping)
    if slots is not None:
        if found.fp8:  # a tensor scale's value is read each call, as the checks do
            check_scale("k_scale", k_scale, used=True)
            check_scale("v_scale", v_scale, used=True)
        slots.check_values(key_cache, found.blocks)
    else:
        validate_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                   kv_cache_dtype, k_scale, v_scale)
        found = _CacheWrite(key, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
        if len(_WRITES) >= _MAX_WRITES:
            _WRITES.clear()
        _WRITES[found.key] = found
        slots = _take_slots(slot_mapping, found.device)
    if seen is None:  # found by the full signature, or new: look it up by these views next
        if len(_RECENT) >= _MAX_WRITES:
            _RECENT.clear()
        _RECENT[id(key_cache)] = (CacheViews(key_cache, value_cache), found)
    found.launch(key, value, key_cache, value_cache, slots, k_scale, v_scale)


def scale_key(scale: KVScale) -> object:
    """What the checks and the launch see of a scale: a number's type and value, a tensor's
    size, dtype and device."""
    if isinstance(scale, torch.Tensor):
        return (scale.numel(), scale.dtype, scale.device)
    return (type(scale), scale)


def same_scale(scale: KVScale, seen: KVScale, seen_key: object) -> bool:
    """Whether ``scale`` passes wherever ``seen`` (whose :func:`scale_key` is ``seen_key``)
    passed: the same number object, or the same :func:`scale_key`."""
    if scale is seen and not isinstance(scale, torch.Tensor):
        return True
    return scale_key(scale) == seen_key


class CacheViews:
    """The K and V cache view objects a checked op last ran on, held weakly (a view freed
    since is never matched, whatever takes its ``id``), with their addresses and version
    counters. :meth:`same` is the per-call lookup of :func:`reshape_and_cache` and
    :func:`kvcore.ops.triton_attention.paged_attention`: a few comparisons instead of the
    caches' full signature, built and hashed."""

    __slots__ = ("key_ref", "seen", "value_ref")

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        self.key_ref = weakref.ref(key_cache)
        self.value_ref = weakref.ref(value_cache)
        # Inference tensors keep no version counter: such views are never matched (the
        # full signature is looked up every call).
        self.seen = None if key_cache.is_inference() or value_cache.is_inference() else (
            key_cache.data_ptr(), value_cache.data_ptr(), key_cache._version,
            value_cache._version)

    def same(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether these are the view objects seen, at the same addresses and versions: an
        in-place ``set_``, ``resize_``, ``as_strided_`` or other in-place op since (which
        could change a shape or stride the checks read) bumps the version, and then the
        caller looks the full signature up again. Triton kernels' writes bump nothing."""
        seen = self.seen
        return (seen is not None and self.key_ref() is key_cache
                and self.value_ref() is value_cache and key_cache.data_ptr() == seen[0]
                and value_cache.data_ptr() == seen[1] and key_cache._version == seen[2]
                and value_cache._version == seen[3])


def _write_key(key: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               kv_cache_dtype: str, k_scale: KVScale, v_scale: KVScale) -> tuple:
    """What a :class:`_CacheWrite`'s checks and launch hold for: the caches (shape, strides,
    dtype, device, address), the tokens' dtype, the cache dtype and the scales."""
    return (key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device,
            key_cache.data_ptr(), value_cache.shape, value_cache.stride(), value_cache.dtype,
            value_cache.device, value_cache.data_ptr(), key.dtype, kv_cache_dtype,
            scale_key(k_scale), scale_key(v_scale))


#: Checked caches by their signature (the key of :func:`reshape_and_cache`'s lookup).
_WRITES: dict[tuple, _CacheWrite] = {}
_MAX_WRITES = 1024
#: By ``id`` of a key cache view: the views (:class:`CacheViews`) and the checked write of
#: the last call on them (what :func:`reshape_and_cache` looks up first).
_RECENT: dict[int, tuple[CacheViews, _CacheWrite]] = {}
#: The slot mapping :meth:`_CacheWrite.takes` last accepted (every layer of a step finds it).
_last_slots: _Slots | None = None
#: The kernel's scale arguments without an fp8 cache (see scale_args).
_UNSCALED = scale_args(None, None, torch.device("cpu"))


class _CacheWrite:
    """One K/V cache pair's checked write: what the checks established for it (and the
    dtype, scales and cache dtype of the call that made it), and its kernel launch."""

    def __init__(self, key: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 kv_cache_dtype: str, k_scale: KVScale, v_scale: KVScale) -> None:
        self.key = _write_key(key, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
        self.dtype, self.device = key.dtype, key_cache.device
        self.kv_cache_dtype = kv_cache_dtype
        # Held: same_call compares a number by identity, else by scale_key.
        self.scales = (k_scale, scale_key(k_scale), v_scale, scale_key(v_scale))
        # Both numbers: a call passing these very objects needs no scale_key compared.
        self.numbers = not (isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor))
        self.heads = key_cache.shape[2:]
        #: The caches' (num_blocks, block_size): what the value checks compare slots with.
        self.blocks = key_cache.shape[:2]
        self.fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        num_kv_heads, head_size = self.heads
        self.block_d = next_power_of_2(head_size)
        self.block_h = max(1, min(next_power_of_2(num_kv_heads), _TILE // self.block_d))
        self.block_t = max(1, min(_MAX_TOKENS_PER_PROGRAM, _TILE // (self.block_h * self.block_d)))
        self.grid_h = -(-num_kv_heads // self.block_h)
        ks, _ = scale_args(k_scale if self.fp8 else None, v_scale if self.fp8 else None,
                           self.device)
        fp8_max, mantissa_bits, min_exponent = fp8_format(key_cache.dtype)
        self.fixed = (*key_cache.stride(), *value_cache.stride())
        self.tail = (key_cache.shape[1], num_kv_heads, head_size)
        self.kernel = KernelLaunch(
            _reshape_and_cache_kernel, (self.key, self.fixed, self.tail),
            dict(FP8=self.fp8, SCALE_IS_TENSOR=isinstance(ks, torch.Tensor), FP8_MAX=fp8_max,
                 EXACT_FP8_ROUNDING=is_interpreted(_reshape_and_cache_kernel),
                 MANTISSA_BITS=mantissa_bits, MIN_EXPONENT=min_exponent, BLOCK_T=self.block_t,
                 BLOCK_H=self.block_h, BLOCK_D=self.block_d),
            dict(num_warps=4))

    def same_call(self, key: torch.Tensor, kv_cache_dtype: str, k_scale: KVScale,
                  v_scale: KVScale) -> bool:
        """Whether a call on the cache views this write was found by (:class:`CacheViews`)
        has the rest of its signature: the tokens' dtype, the cache dtype, the scales."""
        scales = self.scales
        return (key.dtype == self.dtype and kv_cache_dtype == self.kv_cache_dtype
                and ((self.numbers and k_scale is scales[0] and v_scale is scales[2])
                     or (same_scale(k_scale, scales[0], scales[1])
                         and same_scale(v_scale, scales[2], scales[3]))))

    def takes(self, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> _Slots | None:
        """The slots of a call with these tokens when the checks this cache passed cover it
        (the last slots taken when they are the same, unchanged), else ``None``."""
        device, heads = self.device, self.heads
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
            return None
        shape = key.shape
        if not (len(shape) == 3 and shape[1] == heads[0] and shape[2] == heads[1]
                and value.shape == shape and value.dtype == self.dtype and key.device == device
                and value.device == device):
            return None
        slots = _last_slots
        if slots is None or not slots.same(slot_mapping, device):
            if not (isinstance(slot_mapping, torch.Tensor) and slot_mapping.device == device
                    and slot_mapping.dim() == 1
                    and slot_mapping.dtype in (torch.int32, torch.int64)):
                return None
            slots = _take_slots(slot_mapping, device)
        return slots if slots.num_tokens == shape[0] else None

    def launch(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, slots: _Slots, k_scale: KVScale,
               v_scale: KVScale) -> None:
        num_tokens = slots.num_tokens
        if num_tokens == 0:
            return
        slot_mapping, slot_key = slots.slot_mapping, slots.key
        if slot_key is None:
            # The kernel indexes slot_mapping densely; an engine's view of a larger buffer may
            # have stride > 1. Copied per call: a copy kept for the step would go stale in a
            # captured graph.
            slot_mapping = slot_mapping.contiguous()
            slot_key = (slot_mapping.data_ptr() & 15, slot_mapping.dtype, int_class(num_tokens))
        ks, vs = scale_args(k_scale, v_scale, self.device) if self.fp8 else _UNSCALED
        k_strides, v_strides = key.stride(), value.stride()
        self.kernel(
            (-(-num_tokens // self.block_t), self.grid_h, 1),
            (key, value, key_cache, value_cache, slot_mapping, ks, vs, *k_strides, *v_strides,
             *self.fixed, num_tokens, *self.tail),
            (key.data_ptr() & 15, value.data_ptr() & 15, slot_key,
             ks.data_ptr() & 15 if isinstance(ks, torch.Tensor) else type(ks),
             vs.data_ptr() & 15 if isinstance(vs, torch.Tensor) else type(vs), k_strides,
             v_strides))


class _Slots:
    """A write's ``slot_mapping``, checked as :meth:`_CacheWrite.takes` checks it, and what
    every layer's write of the step derives from it once: the step's facts
    (:func:`~kvcore.step_facts.checked_step_facts`), the value checks passed
    (:meth:`check_values`), the token count and the launch's key of it (``None`` when it is
    strided: copied per call)."""

    __slots__ = ("device", "facts", "key", "num_tokens", "passed", "seen", "slot_mapping")

    def __init__(self, slot_mapping: torch.Tensor, device: torch.device) -> None:
        self.slot_mapping = slot_mapping
        self.device = device
        # Inference tensors keep no version counter: such slots are never found again.
        self.seen = None if slot_mapping.is_inference() else (slot_mapping._version,
                                                              slot_mapping.data_ptr())
        self.facts = checked_step_facts(slot_mapping)
        #: (the cache's (num_blocks, block_size), value checks on) passed.
        self.passed: set[tuple] = set()
        self.num_tokens = num_tokens = slot_mapping.shape[0]
        self.key = ((slot_mapping.data_ptr() & 15, slot_mapping.dtype, int_class(num_tokens))
                    if slot_mapping.stride(0) == 1 else None)

    def same(self, slot_mapping: torch.Tensor, device: torch.device) -> bool:
        """Whether this is the slot mapping seen, unwritten since (version and address: what
        its facts and launch key hold for), on ``device``."""
        seen = self.seen
        return (seen is not None and self.slot_mapping is slot_mapping
                and slot_mapping._version == seen[0] and slot_mapping.data_ptr() == seen[1]
                and device == self.device)

    def check_values(self, key_cache: torch.Tensor, blocks: torch.Size) -> None:
        """:func:`~kvcore.ops.validation.check_reshape_and_cache_values` for a write into
        ``key_cache`` (whose ``(num_blocks, block_size)`` is ``blocks``): once per cache
        geometry and value-check switch for slots with facts (unchanged, so is the answer),
        every call for slots without (read, as documented there)."""
        if self.facts is None:
            check_reshape_and_cache_values(key_cache, self.slot_mapping)
            return
        found = (blocks, value_checks_enabled())
        if found not in self.passed:
            check_reshape_and_cache_values(key_cache, self.slot_mapping)
            self.passed.add(found)


def _take_slots(slot_mapping: torch.Tensor, device: torch.device) -> _Slots:
    """New :class:`_Slots` for a checked ``slot_mapping``, kept as the last ones unless they
    can never be found again (inference tensors)."""
    global _last_slots
    slots = _Slots(slot_mapping, device)
    if slots.seen is not None:
        _last_slots = slots
    return slots
