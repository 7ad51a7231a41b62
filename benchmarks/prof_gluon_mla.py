"""Run the Gluon and Triton MLA decode kernels twice on one decode batch (128 heads; B64 x 4096
tokens, one split, unless ``PROF_SHAPE=batch,tokens,splits`` says otherwise), for a profiler
(ncu) to read. Usage: ncu ... python3 benchmarks/prof_gluon_mla.py"""

import os

import torch
from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode
from kvcore_mla.ops.mla_configs import mla_decode_config
from kvcore_mla.ops.triton_mla_attention import (
    decode_attention_fwd,
    decode_partials,
    mla_workspace_numel,
)

RANK, ROPE, PAGE = 512, 64, 64
batch, tokens, splits = (int(v) for v in os.environ.get("PROF_SHAPE", "64,4096,1").split(","))
heads = 128
pages = batch * tokens // PAGE
cache = torch.randn(pages + 8, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
out = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device="cuda")
lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
logits = torch.empty(batch, heads, splits, 528, dtype=torch.float32, device="cuda")[..., :513]
flat = torch.empty(mla_workspace_numel(batch, heads, RANK, splits) or 1, device="cuda")
partials = decode_partials(flat, batch, heads, RANK, splits, q.dtype) if splits > 1 else ()
triton_row = mla_decode_config(heads, "sm90", page_size=PAGE, gluon=False)
for _ in range(2):
    decode_attention_fwd(q, cache, cache[..., :RANK], out, lse, table, lens, logits, splits,
                         0.1, PAGE, True, config=triton_row)
    gluon_mla_decode(q, cache, RANK, lens, table, 0.1, out, lse, splits, *partials)
torch.cuda.synchronize()
