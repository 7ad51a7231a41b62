"""``kvcore layout --convert SRC DST``: the layout conversion plan between two caches."""

from __future__ import annotations

import json

from cli_helpers import run_cli


def test_convert_prints_every_change(capsys):
    status, out, err = run_cli(
        capsys, "layout", "--num-kv-heads", "8", "--convert",
        "TRITON_ATTN:block_size=16,tp=4/1",
        "TRITON_ATTN_HND:block_size=64,cross_layer=yes,tp=2/0,dtype=fp8")
    assert status == 0, err
    for phrase in ("block size 16 -> 64 (4 source block(s) to 1 destination block(s))",
                   "order within a block 2,N,H,D -> 2,H,N,D", "per-layer -> cross-layer",
                   "TP4 rank 1 (heads 2-3) -> TP2 rank 0 (heads 0-3) of 8",
                   "needs source ranks [0, 1]", "dtype bfloat16 -> float8_e4m3fn (quantize"):
        assert phrase in out, out


def test_convert_same_layout_and_json(capsys):
    status, out, _ = run_cli(capsys, "layout", "--format", "json", "--convert",
                             "CPU_ATTN:cross_layer=yes", "TRITON_ATTN:cross_layer=yes")
    assert status == 0
    data = json.loads(out)
    assert data["identity"] is True and data["changes"] == []


def test_convert_refusals_name_the_field(capsys):
    status, _, err = run_cli(capsys, "layout", "--convert", "CPU_ATTN", "CPU_MLA")
    assert status == 2 and "an MLA latent cache and a K/V cache" in err
    status, _, err = run_cli(capsys, "layout", "--convert", "CPU_ATTN:tp=3/5", "CPU_ATTN")
    assert status == 2 and "TPRank.rank=5 is outside the tensor-parallel degree 3" in err
    status, _, err = run_cli(capsys, "layout", "--convert", "CPU_ATTN:bs=4", "CPU_ATTN")
    assert status == 2 and "'bs=4' is not key=value with a key of block_size" in err
    status, _, err = run_cli(capsys, "layout", "CPU_ATTN", "--convert", "CPU_ATTN", "CPU_ATTN")
    assert status == 2 and "leave out the BACKEND argument" in err
