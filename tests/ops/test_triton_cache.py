"""The Triton cache write against the reference, on every cache layout, bit-exactly.

Runs on the CPU under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``) on small shapes,
and on a GPU when there is one; ``gpu``-marked tests need real sizes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import zlib

import pytest
import torch

import kvcore.ops
from kvcore.ops import reshape_and_cache_ref
from kvcore.testing import random_slot_mapping

triton_cache = pytest.importorskip("kvcore.ops.triton_cache")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random finite data of any dtype (fp8 included), never zeros."""
    return (torch.randn(shape, generator=gen) * 4).to(dtype).to(DEVICE)


def _slots(num_tokens: int, num_slots: int, gen: torch.Generator,
           dtype: torch.dtype) -> torch.Tensor:
    return random_slot_mapping(num_tokens, num_slots, gen, dtype).to(DEVICE)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _case_id(p: tuple) -> str:
    n, bs, h, d, dtype, slot_dtype = p
    return f"N{n}-bs{bs}-H{h}-D{d}-{str(dtype).split('.')[-1]}-{str(slot_dtype).split('.')[-1]}"


CASES = [
    (37, 16, 2, 64, torch.bfloat16, torch.int64),
    (50, 32, 4, 80, torch.float16, torch.int32),
    (23, 16, 1, 128, torch.float32, torch.int64),
    (64, 64, 8, 96, torch.bfloat16, torch.int32),
    (19, 16, 20, 256, torch.bfloat16, torch.int64),  # several head blocks per token
]


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference_exactly(case: tuple) -> None:
    n, bs, h, d, dtype, slot_dtype = case
    gen = torch.Generator().manual_seed(zlib.crc32(_case_id(case).encode()))
    num_blocks = 12
    # key/value as strided slices of a fused QKV projection.
    qkv = _random_cache((n, 3, h, d), dtype, gen)
    key, value = qkv[:, 1], qkv[:, 2]
    kc = _random_cache((num_blocks, bs, h, d), dtype, gen)
    # V in the HND physical order, one half of a (num_blocks, 2, h, bs, d) allocation: its
    # block stride and head stride differ from K's.
    vc = _random_cache((num_blocks, 2, h, bs, d), dtype, gen)[:, 1].transpose(1, 2)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = _slots(n, num_blocks * bs, gen, slot_dtype)
    triton_cache.reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_fp8_matches_reference_bytes(kv_cache_dtype: str, scale_kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    n, bs, h, d, num_blocks = 40, 16, 4, 64, 10
    key = (torch.randn(n, h, d, generator=gen) * 30).to(torch.bfloat16).to(DEVICE)
    value = (torch.randn(n, h, d, generator=gen) * 0.01).to(torch.bfloat16).to(DEVICE)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 125 * 0.37, 400 * 0.37])  # saturation, carries
    cache_dtype = FP8[kv_cache_dtype]
    kc = _random_cache((num_blocks, bs, h, d), cache_dtype, gen)
    vc = _random_cache((num_blocks, bs, h, d), cache_dtype, gen)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ks, vs = 0.37, 0.0021
    if scale_kind == "tensor":
        ks = torch.tensor([ks], device=DEVICE)
        vs = torch.tensor(vs, device=DEVICE)
    slots = _slots(n, num_blocks * bs, gen, torch.int64)
    triton_cache.reshape_and_cache(key, value, kc, vc, slots, kv_cache_dtype, ks, vs)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots, kv_cache_dtype, ks, vs)
    assert torch.equal(_as_bytes(kc), _as_bytes(kc_ref))
    assert torch.equal(_as_bytes(vc), _as_bytes(vc_ref))


def _cross_layer_views(num_blocks: int, num_layers: int, bs: int, h: int, d: int,
                       dtype: torch.dtype, gen: torch.Generator):
    """A physical ``(num_blocks, num_layers, 2, bs, h, d)`` pool of random data and the K/V
    views of layer 1 (block stride ``num_layers * 2 * bs * h * d``, non-zero offset)."""
    pool = _random_cache((num_blocks, num_layers, 2, bs, h, d), dtype, gen)
    layer = pool.permute(1, 0, 2, 3, 4, 5)[1]  # (num_blocks, 2, bs, h, d), strided
    key_cache, value_cache = layer.unbind(1)
    assert key_cache.storage_offset() > 0 and not key_cache.is_contiguous()
    return pool, key_cache, value_cache


def _interleaved_views(num_blocks: int, num_layers: int | None, bs: int, h: int, d: int,
                       dtype: torch.dtype, gen: torch.Generator):
    """K and V side by side per token, the FLASH_ATTN / FLEX_ATTENTION order: a physical
    ``(num_blocks, bs, 2, h, d)`` cache, or with ``num_layers`` a cross-layer ``(num_blocks,
    num_layers, bs, 2, h, d)`` pool and layer 1; the K/V views (token stride ``2 * h * d``)."""
    if num_layers is None:
        pool = _random_cache((num_blocks, bs, 2, h, d), dtype, gen)
        layer = pool
    else:
        pool = _random_cache((num_blocks, num_layers, bs, 2, h, d), dtype, gen)
        layer = pool[:, 1]
    key_cache, value_cache = layer.permute(0, 2, 1, 3, 4).unbind(1)
    assert key_cache.stride(1) == 2 * h * d
    return pool, key_cache, value_cache


def _legacy_views(num_blocks: int, bs: int, h: int, d: int, dtype: torch.dtype,
                  gen: torch.Generator):
    """A legacy ``(2, num_blocks, bs, h, d)`` cache and its K/V halves."""
    pool = _random_cache((2, num_blocks, bs, h, d), dtype, gen)
    return pool, pool[0], pool[1]


@pytest.mark.parametrize("layout", ["cross_layer", "legacy", "interleaved",
                                    "interleaved_cross_layer"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_layout_views_bit_exact(layout: str, kv_cache_dtype: str) -> None:
    """Writing through a strided view equals writing a contiguous cache, and touches nothing
    outside the view."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, bs, h, d, n = 9, 16, 2, 64, 45
    dtype = torch.bfloat16
    cache_dtype = FP8["fp8"] if kv_cache_dtype == "fp8" else dtype
    if layout == "cross_layer":
        pool, kc, vc = _cross_layer_views(num_blocks, 3, bs, h, d, cache_dtype, gen)
    elif layout.startswith("interleaved"):
        layers = 3 if layout.endswith("cross_layer") else None
        pool, kc, vc = _interleaved_views(num_blocks, layers, bs, h, d, cache_dtype, gen)
    else:
        pool, kc, vc = _legacy_views(num_blocks, bs, h, d, cache_dtype, gen)
    kc_flat, vc_flat = kc.contiguous(), vc.contiguous()
    before = _as_bytes(pool).clone()
    key = _random_cache((n, h, d), dtype, gen)
    value = _random_cache((n, h, d), dtype, gen)
    slots = _slots(n, num_blocks * bs, gen, torch.int32)
    triton_cache.reshape_and_cache(key, value, kc, vc, slots, kv_cache_dtype, 0.5, 0.25)
    triton_cache.reshape_and_cache(key, value, kc_flat, vc_flat, slots, kv_cache_dtype, 0.5, 0.25)
    assert torch.equal(_as_bytes(kc), _as_bytes(kc_flat))
    assert torch.equal(_as_bytes(vc), _as_bytes(vc_flat))
    # Only the bytes of the written slots may change: compare everything else to the snapshot.
    expected = before.view((*pool.shape, -1)).clone()
    written = slots[slots >= 0].long()
    blocks, offsets = written // bs, written % bs
    k_new = _as_bytes(kc_flat).view(num_blocks, bs, h, d, -1)[blocks, offsets]
    v_new = _as_bytes(vc_flat).view(num_blocks, bs, h, d, -1)[blocks, offsets]
    if layout == "cross_layer":
        expected[blocks, 1, 0, offsets] = k_new
        expected[blocks, 1, 1, offsets] = v_new
    elif layout == "interleaved":
        expected[blocks, offsets, 0] = k_new
        expected[blocks, offsets, 1] = v_new
    elif layout == "interleaved_cross_layer":
        expected[blocks, 1, offsets, 0] = k_new
        expected[blocks, 1, offsets, 1] = v_new
    else:
        expected[0, blocks, offsets] = _as_bytes(kc_flat).view(num_blocks, bs, h, d, -1)[
            blocks, offsets]
        expected[1, blocks, offsets] = _as_bytes(vc_flat).view(num_blocks, bs, h, d, -1)[
            blocks, offsets]
    assert torch.equal(_as_bytes(pool).view(expected.shape), expected)


def test_empty_and_all_padding_are_noops() -> None:
    gen = torch.Generator().manual_seed(3)
    kc = _random_cache((4, 16, 2, 64), torch.float16, gen)
    vc = _random_cache((4, 16, 2, 64), torch.float16, gen)
    before = (kc.clone(), vc.clone())
    empty = torch.empty(0, 2, 64, dtype=torch.float16, device=DEVICE)
    triton_cache.reshape_and_cache(empty, empty, kc, vc,
                                   torch.empty(0, dtype=torch.int64, device=DEVICE))
    key = _random_cache((3, 2, 64), torch.float16, gen)
    triton_cache.reshape_and_cache(key, key, kc, vc,
                                   torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.parametrize(
    ("change", "error", "names"),
    [
        ("slot_out_of_range", ValueError, "slot_mapping"),
        ("cache_dtype", TypeError, "key_cache"),
        ("slot_float", TypeError, "slot_mapping"),
        ("scale_shape", ValueError, "k_scale"),
        ("value_shape", ValueError, "value"),
        ("unknown_cache_dtype", ValueError, "kv_cache_dtype"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(change: str, error: type, names: str) -> None:
    gen = torch.Generator().manual_seed(5)
    kc = _random_cache((4, 16, 2, 64), torch.bfloat16, gen)
    vc = _random_cache((4, 16, 2, 64), torch.bfloat16, gen)
    key = _random_cache((3, 2, 64), torch.bfloat16, gen)
    value = key.clone()
    slots = torch.tensor([0, 5, 17], device=DEVICE)
    kwargs: dict = {}
    if change == "slot_out_of_range":
        slots = torch.tensor([0, 5, 64], device=DEVICE)
    elif change == "cache_dtype":
        kc = kc.half()
    elif change == "slot_float":
        slots = slots.float()
    elif change == "scale_shape":
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        kwargs = dict(kv_cache_dtype="fp8", k_scale=torch.ones(2, device=DEVICE))
    elif change == "value_shape":
        value = value[:, :1]
    elif change == "unknown_cache_dtype":
        kwargs = dict(kv_cache_dtype="int4")
    with pytest.raises(error, match=names):
        triton_cache.reshape_and_cache(key, value, kc, vc, slots, **kwargs)


def test_dispatcher_runs_reference_on_cpu_and_triton_on_gpu() -> None:
    gen = torch.Generator().manual_seed(9)
    kc = _random_cache((6, 16, 2, 64), torch.bfloat16, gen)
    vc = _random_cache((6, 16, 2, 64), torch.bfloat16, gen)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    key = _random_cache((10, 2, 64), torch.bfloat16, gen)
    slots = _slots(10, 96, gen, torch.int64)
    kvcore.ops.reshape_and_cache(key, key, kc, vc, slots)
    reshape_and_cache_ref(key, key, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_importing_kvcore_ops_does_not_import_triton() -> None:
    code = ("import sys, kvcore, kvcore.ops; "
            "assert 'triton' not in sys.modules, 'kvcore.ops imported triton'; "
            "print(kvcore.ops.triton_available())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_triton_available_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kvcore.ops.triton_available() == (True, "")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.5.1")
    ok, reason = kvcore.ops.triton_available()
    assert not ok and "3.5.1" in reason and ">= 3.6" in reason
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert kvcore.ops.triton_available() == (False, "triton is not installed (pip install triton)")


@pytest.mark.gpu
def test_int64_offsets_in_a_32_layer_cross_layer_pool() -> None:
    """Layer 31 of a 32-layer cross-layer pool, block ids above 2,048: offsets > 2**31."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    num_blocks, num_layers, bs, h, d, n = 2200, 32, 16, 8, 128, 2048
    pool = torch.empty(num_blocks, num_layers, 2, bs, h, d, dtype=torch.bfloat16, device="cuda")
    pool.normal_(generator=gen)
    kc, vc = pool[:, num_layers - 1].unbind(1)
    assert (num_blocks - 1) * kc.stride(0) + kc.storage_offset() > 2**31
    key = torch.randn(n, h, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    value = torch.randn(n, h, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    # Slots in blocks 2048..2199 and a few low ones.
    slots = torch.cat([torch.randperm(152 * bs, device="cuda", generator=gen)[: n - 16]
                       + 2048 * bs, torch.arange(16, device="cuda")])
    expected = pool.clone()
    ekc, evc = expected[:, num_layers - 1].unbind(1)
    reshape_and_cache_ref(key, value, ekc, evc, slots)
    triton_cache.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="Triton runs CPU tensors only under its interpreter, "
        "which is off where a GPU is: the cuda case runs instead")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_of_every_bf16_value_is_the_same_bytes_as_the_reference(device: str) -> None:
    """fp8 is defined as x * float32(1/scale) everywhere; at scale 0.3 a true division and the
    reciprocal multiply round some values (e.g. +-9*2**-11) to different e4m3 bytes."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values)].to(device)
    values = values[values.abs() < 400]  # inside e4m3's range after scaling by 1/0.3
    n = (values.numel() // 8) * 8
    key = values[:n].reshape(-1, 1, 8)
    num_blocks = -(-key.shape[0] // 16)
    kc = torch.zeros(num_blocks, 16, 1, 8, dtype=torch.float8_e4m3fn, device=device)
    vc, expected_k, expected_v = (torch.zeros_like(kc) for _ in range(3))
    slots = torch.arange(key.shape[0], device=device)
    reshape_and_cache_ref(key, key, expected_k, expected_v, slots, "fp8", 0.3, 0.3)
    triton_cache.reshape_and_cache(key, key, kc, vc, slots, "fp8", 0.3, 0.3)
    assert torch.equal(_as_bytes(kc), _as_bytes(expected_k))
