"""The Gluon MLA decode kernel for Hopper (``kvcore_mla.ops.gluon_mla_decode``), TRITON_MLA's
sm90 row at 64+ heads. Compiled ahead of time for sm90 here (no GPU: Gluon has no
interpreter); on an H200 against the float64 reference at DeepSeek sizes, NaN in the stale
slots of a partial last page, with one split, uneven splits and splits left empty. The
TRITON_MLA GPU tests and the conformance suite run it too (it is the table's row there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mla_helpers import (
    REAL_RANK,
    REAL_SCALE,
    assert_decode_close,
    block_tables,
    generator,
    randn,
    real_size_decode_case,
)

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

_COMPILE = """
import json, torch
from kvcore.testing import compile_launches
from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode
q = torch.empty(4, 128, 576, dtype=torch.bfloat16)
cache = torch.empty(80, 64, 576, dtype=torch.bfloat16)
out = torch.empty(4, 128, 512, dtype=torch.bfloat16)
lse = torch.empty(4, 128, dtype=torch.float32)
lens = torch.full((4,), 1000, dtype=torch.int32)
table = torch.zeros(4, 16, dtype=torch.int32)
(c,) = compile_launches(lambda: gluon_mla_decode(q, cache, 512, lens, table, 0.1, out, lse),
                        "sm90")
print(json.dumps([c.kernel, c.asm["ttgir"].count("warp_group_dot ")]))
"""


def test_compiles_for_sm90_with_its_wgmmas() -> None:
    """The scores warpgroup's scores (latent and rope parts, the first tile's ahead of the
    loop and the rest in it) and P x V of its half (in the loop and the last tile's after it),
    and the values warpgroup's P x V: seven wgmmas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernel, wgmmas = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kernel == "_gluon_mla_decode_kernel" and wgmmas == 7


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits,partials", [(1, None), (3, "bf16"), (40, "bf16"),
                                                 (3, "fp32")],
                         ids=["one-split", "3-splits", "40-splits-some-empty",
                              "3-splits-fp32-rows"])
def test_real_size_matches_float64_reference(num_splits: int, partials: str | None) -> None:
    """bf16 partials as TRITON_MLA's decode carves them (decode_partials), and float32 rows
    of an ``attn_logits`` workspace, all from NaN-filled memory."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA decode kernel is written for Hopper (capability 9.x)")
    from kvcore_mla.ops import triton_mla_attention as tma
    from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode

    q, cache, table, seq_lens = real_size_decode_case(generator("mla-gluon-decode"))
    # The slots past the request of 1000 tokens hold NaN: they must never reach the output.
    last_page = table[2, (int(seq_lens[2]) - 1) // cache.shape[1]]
    cache[last_page, int(seq_lens[2]) % cache.shape[1]:] = float("nan")
    out = torch.full((*q.shape[:2], REAL_RANK), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    parts = ()  # one split: the kernel writes out and lse itself
    if partials == "bf16":
        workspace = torch.full((tma.mla_workspace_numel(*q.shape[:2], REAL_RANK, num_splits),),
                               float("nan"), device=q.device)
        parts = tma.decode_partials(workspace, *q.shape[:2], REAL_RANK, num_splits, q.dtype)
        assert parts[0].dtype == torch.bfloat16
    elif partials == "fp32":
        rows = torch.full((*q.shape[:2], num_splits, REAL_RANK + 1), float("nan"),
                          device=q.device)
        parts = rows[..., :REAL_RANK], rows[..., REAL_RANK]
    gluon_mla_decode(q, cache, REAL_RANK, seq_lens, table, REAL_SCALE, out, lse,
                     num_splits, *parts)
    assert_decode_close(out, lse, q, cache, table, seq_lens, torch.bfloat16, rank=REAL_RANK,
                        scale=REAL_SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,rank,rope,dtype,num_splits", [
    (80, 512, 64, torch.bfloat16, 1),
    (64, 512, 64, torch.float16, 2),
    (128, 256, 64, torch.bfloat16, 3),
    (64, 128, 128, torch.bfloat16, 1),
], ids=["80-heads-partial-group", "fp16-2-splits", "rank-256-3-splits", "rank-128-rope-128"])
def test_other_shapes_it_accepts_match_float64_reference(heads: int, rank: int, rope: int,
                                                         dtype: torch.dtype,
                                                         num_splits: int) -> None:
    """Shapes :func:`gluon_unmet` accepts besides DeepSeek's: a head count that leaves the last
    64-head group partly empty, fp16, and latents of 256 and 128 (each warpgroup's half 128
    and 64 columns) with a wider rope; requests end inside a page, NaN in the slots after."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA decode kernel is written for Hopper (capability 9.x)")
    from kvcore_mla.ops import triton_mla_attention as tma
    from kvcore_mla.ops.descriptors import gluon_unmet
    from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode

    gen = generator("mla-gluon-shapes", heads, rank, rope, str(dtype))
    lens = [700, 1024, 130]
    page = 64
    pages = sum(-(-n // page) for n in lens) + 3
    cache = randn((pages, page, rank + rope), dtype, gen)
    table = block_tables(lens, page, pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=cache.device)
    for i, n in enumerate(lens):
        cache[table[i, (n - 1) // page], n % page or page:] = float("nan")
    q = randn((len(lens), heads, rank + rope), dtype, gen)
    assert gluon_unmet(q, cache, rank) is None
    scale = (128 + rope) ** -0.5
    out = torch.full((len(lens), heads, rank), float("nan"), dtype=dtype, device=q.device)
    lse = torch.full((len(lens), heads), float("nan"), dtype=torch.float32, device=q.device)
    parts = ()
    if num_splits > 1:
        workspace = torch.full((tma.mla_workspace_numel(len(lens), heads, rank, num_splits),),
                               float("nan"), device=q.device)
        parts = tma.decode_partials(workspace, len(lens), heads, rank, num_splits, dtype)
    gluon_mla_decode(q, cache, rank, seq_lens, table, scale, out, lse, num_splits, *parts)
    clean = torch.nan_to_num(cache)  # the reference must not see the NaN either
    assert_decode_close(out, lse, q, clean, table, seq_lens, dtype, rank=rank, scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_step_tensors_as_views_of_larger_buffers(num_splits: int) -> None:
    """TRITON_MLA's decode (the Gluon kernel on Hopper, the Triton one elsewhere) with seq_lens
    and the block table as stride-2 views whose gaps hold other values, as engines pass
    slices of persistent buffers: bit-identical to the dense tensors."""
    from kvcore_mla.ops.mla_configs import TritonMLAPlan
    from kvcore_mla.ops.triton_mla_attention import mla_attention

    from kvcore.testing import strided_view

    q, cache, table, seq_lens = real_size_decode_case(generator("mla-strided-steps"))
    batch = q.shape[0]
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=q.device)

    def run(qsl: torch.Tensor, lens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return mla_attention(q, cache, kv_lora_rank=REAL_RANK, query_start_loc=qsl,
                             seq_lens=lens, block_table=table, scale=REAL_SCALE,
                             max_query_len=1, plan=TritonMLAPlan(num_kv_splits=num_splits))

    dense = run(qsl, seq_lens, table)
    views = (strided_view(qsl, 0), strided_view(seq_lens, 0),
             strided_view(table, cache.shape[0] - 1))
    assert views[2].stride(1) == 2
    assert torch.equal(run(*views), dense)
