"""Adopting engine-allocated KV-cache memory (kvcore.adopt_kv_caches, from_vllm_layer_view)
and vLLM's layout names."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.ops import paged_attention_ref, reshape_and_cache_ref

SIZES = dict(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8)


def _vllm_buffer(dtype=torch.float32, extra_bytes: int = 0) -> torch.Tensor:
    n = 1
    for v in SIZES.values():
        n *= v
    return torch.zeros(2 * n * dtype.itemsize + extra_bytes, dtype=torch.int8)


def test_vllm_layout_names_map_onto_kvcore_orders():
    # LBNHC: per block, tokens, then heads, then K and V of that token and head together.
    assert kvcore.vllm_layout_order("LBNHC") == (0, 1, 3, 4, 2, 5)
    assert kvcore.vllm_layout_order("LBNHC", include_num_layers_dimension=False) == (
        0, 2, 3, 1, 4)
    assert kvcore.vllm_layout_order("BLHNC") == (1, 0, 4, 3, 2, 5)
    for name in kvcore.VLLM_LAYOUTS:
        assert kvcore.vllm_layout_name(kvcore.vllm_layout_order(name)) == name
    assert kvcore.vllm_layout_name((0, 1, 2, 3, 4)) is None  # kvcore's NHD: K, V halves apart
    with pytest.raises(ValueError, match="LBHNC, LBNHC"):
        kvcore.vllm_layout_order("NHD")


def test_backends_declare_vllm_layouts_from_their_orders():
    cpu = kvcore.resolve_backend("CPU_ATTN")
    assert set(cpu.supported_vllm_layouts()) == set(kvcore.VLLM_LAYOUTS)
    triton = kvcore.resolve_backend("TRITON_ATTN")
    # Cross-layer names only where its cross-layer layout is verified.
    assert triton.supported_vllm_layouts("rocm") == ("LBNHC", "LBHNC")
    assert "BLNHC" in triton.supported_vllm_layouts("cuda")
    assert "vllm_layouts" in cpu.capabilities()


@pytest.mark.parametrize("layout", list(kvcore.VLLM_LAYOUTS))
def test_adopted_buffer_aliases_the_engine_memory(layout):
    buf = _vllm_buffer()
    caches = kvcore.adopt_kv_caches("CPU_ATTN", buf, layout=layout, dtype=torch.float32,
                                    **SIZES)
    assert caches.storage.data_ptr() == buf.data_ptr()
    assert caches.layout.stride_order == kvcore.vllm_layout_order(layout)
    assert caches.layers[0].shape == (5, 2, 4, 2, 8)
    # A write through a layer view lands in the engine's buffer: no copy anywhere.
    caches.layers[2][3, 1, 2, 1, 5] = 7.0
    assert (buf.view(torch.float32) == 7.0).sum() == 1


def test_adopted_layer_view_matches_vllm_as_strided_view():
    """The same bytes as vLLM's own per-layer view of layout BLNHC (K then V in C)."""
    L, B, N, H, D = 3, 5, 4, 2, 8
    buf = torch.randn(L * B * N * H * 2 * D)
    caches = kvcore.adopt_kv_caches("CPU_ATTN", buf, layout="BLNHC", dtype=torch.float32,
                                    **SIZES)
    phys = buf.view(B, L, N, H, 2 * D)  # BLNHC, C = K || V
    for layer in range(L):
        vllm_view = phys[:, layer].permute(0, 2, 1, 3)  # [B, H, N, C]
        adopted = kvcore.from_vllm_layer_view("CPU_ATTN", vllm_view, head_size=D)
        assert adopted.data_ptr() == caches.layers[layer].data_ptr()
        assert adopted.stride() == caches.layers[layer].stride()
        torch.testing.assert_close(adopted[:, 0], vllm_view[..., :D].transpose(1, 2),
                                   rtol=0, atol=0)
        torch.testing.assert_close(adopted[:, 1], vllm_view[..., D:].transpose(1, 2),
                                   rtol=0, atol=0)


def test_attention_on_adopted_memory_equals_kvcore_own_allocation():
    gen = torch.Generator().manual_seed(3)
    L, B, N, H, D = 3, 5, 4, 2, 8
    own = kvcore.allocate_kv_caches("CPU_ATTN", dtype=torch.float32, device="cpu", **SIZES)
    adopted = kvcore.adopt_kv_caches("CPU_ATTN", torch.empty(L * B * N * H * 2 * D),
                                     layout="LBHNC", dtype=torch.float32, **SIZES)
    meta = kvcore.build_attention_metadata([3, 1], [2, 6], [[1, 4], [0, 2]], N, num_blocks=B)
    k = torch.randn(4, H, D, generator=gen)
    v = torch.randn(4, H, D, generator=gen)
    q = torch.randn(4, 4, D, generator=gen)
    outs = []
    for caches in (own, adopted):
        caches.layers[1].copy_(torch.randn(caches.layers[1].shape,
                                           generator=torch.Generator().manual_seed(9)))
        kc, vc = caches.layers[1].unbind(1)
        reshape_and_cache_ref(k, v, kc, vc, meta.slot_mapping)
        outs.append(paged_attention_ref(q, kc, vc, query_start_loc=meta.query_start_loc,
                                        seq_lens=meta.seq_lens, block_table=meta.block_table,
                                        scale=D ** -0.5))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_adopted_cross_layer_buffer_moves_blocks_whole():
    caches = kvcore.adopt_kv_caches("CPU_ATTN", _vllm_buffer(), layout="BLNHC",
                                    dtype=torch.float32, **SIZES)
    assert caches.is_cross_layer
    assert caches.block_view().shape == (5, 3 * caches.page_size_bytes)


def test_adopt_with_offset_and_the_engine_strides():
    page = 2 * 4 * 2 * 8 * 4
    buf = _vllm_buffer(extra_bytes=64)
    caches = kvcore.adopt_kv_caches("CPU_ATTN", buf, layout="LBNHC", dtype=torch.float32,
                                    offset_bytes=64, block_stride_bytes=page,
                                    layer_stride_bytes=5 * page, **SIZES)
    assert caches.storage.data_ptr() == buf.data_ptr() + 64


@pytest.mark.parametrize("case, kwargs, error, match", [
    ("too small", dict(buffer=torch.zeros(100, dtype=torch.int8)), ValueError,
     "buffer holds 100 bytes but 3 layers"),
    ("misaligned offset", dict(offset_bytes=2), ValueError, "not a multiple of the float32"),
    ("padded blocks", dict(block_stride_bytes=1024), ValueError,
     "block_stride_bytes=1024 but layout LBNHC.*512 bytes apart"),
    ("other dtype", dict(buffer=torch.zeros(4096, dtype=torch.float16)), TypeError,
     "buffer has dtype float16"),
    ("other device", dict(device="meta"), ValueError, "buffer is on cpu but the caches are"),
    ("not a layout", dict(layout="NHD"), ValueError, "not a vLLM layout name"),
    ("undeclared dtype", dict(dtype=torch.float64), TypeError, "CPU_ATTN supports"),
])
def test_adopt_refuses_with_the_fix(case, kwargs, error, match):
    args = dict(buffer=_vllm_buffer(), layout="LBNHC", dtype=torch.float32, **SIZES)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        kvcore.adopt_kv_caches("CPU_ATTN", args.pop("buffer"), **args)


def test_adopt_refuses_an_order_the_backend_does_not_read():
    with pytest.raises(ValueError, match=r"TRITON_ATTN does not read the per-layer order "
                                         r"\(3, 0, 2, 1, 4\) \(LHBNC\).*LBNHC, LBHNC"):
        kvcore.adopt_kv_caches("TRITON_ATTN", _vllm_buffer(), layout="LHBNC",
                               dtype=torch.float32, **SIZES)
    # TRITON_ATTN's cross-layer layout is verified on CUDA only: not on ROCm.
    with pytest.raises(ValueError, match="strided by other layers.*verified on cuda only"):
        kvcore.adopt_kv_caches("TRITON_ATTN", _vllm_buffer(), layout="BLNHC",
                               dtype=torch.float32, platform="rocm", **SIZES)


def test_vllm_layer_view_refusals():
    kv = torch.zeros(5, 2, 4, 16)
    with pytest.raises(ValueError, match="C = 2 \\* head_size = 12"):
        kvcore.from_vllm_layer_view("CPU_ATTN", kv, head_size=6)
    # A V head size other than K's (vLLM's head_size_v = C - head_size): the last dim shows
    # it, and it is refused by name, never read at K's width.
    with pytest.raises(ValueError, match="head_size_v=10 differs from head_size=6: kvcore's "
                                         "KV caches hold K and V of one head size"):
        kvcore.from_vllm_layer_view("CPU_ATTN", kv, head_size=6)  # C = 16 = 6 + 10
    with pytest.raises(TypeError, match="head_size_v"):  # no such argument
        kvcore.from_vllm_layer_view("CPU_ATTN", kv, head_size=8, head_size_v=8)
    assert kvcore.from_vllm_layer_view("CPU_ATTN", kv, head_size=8).shape == (5, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="vLLM layer view is"):
        kvcore.from_vllm_layer_view("CPU_ATTN", kv[0], head_size=8)
    strided = torch.zeros(5, 2, 4, 32)[..., ::2]
    with pytest.raises(ValueError, match="must be contiguous"):
        kvcore.from_vllm_layer_view("CPU_ATTN", strided, head_size=8)
    # BHLNC on ROCm: a layer's page interleaves with the others' for TRITON_ATTN.
    phys = torch.zeros(5, 2, 3, 4, 16)  # B, H, L, N, C
    with pytest.raises(ValueError, match="strided by other layers"):
        kvcore.from_vllm_layer_view("TRITON_ATTN", phys[:, :, 0], head_size=8,
                                    platform="rocm")


def test_kvcore_layout_shows_a_vllm_named_layout(capsys):
    from cli_helpers import run_cli

    code, out, _ = run_cli(capsys, "layout", "CPU_ATTN", "--vllm-layout", "blnhc",
                           "--num-layers", "2", "--num-blocks", "2", "--head-size", "8")
    assert code == 0
    assert "layout: B,L,N,H,2,D" in out and "vLLM name: BLNHC" in out
    code, out, _ = run_cli(capsys, "layout", "CPU_ATTN")
    assert "vLLM name: none (K and V halves apart)" in out
    code, _, err = run_cli(capsys, "layout", "TRITON_ATTN", "--vllm-layout", "LHBNC")
    assert code != 0 and "TRITON_ATTN does not read it; it reads LBNHC, LBHNC" in err
