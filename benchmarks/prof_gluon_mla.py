"""EXPERIMENTAL (branch wt/gluon-mla): run the Gluon and Triton MLA decode kernels twice at
B64 x 4096 tokens, 128 heads, one split, for a profiler (ncu) to read.
Usage: ncu ... python3 benchmarks/prof_gluon_mla.py"""

import torch
from kvcore_mla.ops.gluon_mla_decode import gluon_mla_decode
from kvcore_mla.ops.triton_mla_attention import decode_attention_fwd

RANK, ROPE, PAGE = 512, 64, 64
batch, heads, tokens = 64, 128, 4096
pages = batch * tokens // PAGE
cache = torch.randn(pages + 8, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
out = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device="cuda")
lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
logits = torch.empty(batch, heads, 1, RANK + 1, dtype=torch.float32, device="cuda")
for _ in range(2):
    decode_attention_fwd(q, cache, cache[..., :RANK], out, lse, table, lens, logits, 1, 0.1,
                         PAGE, True)
    gluon_mla_decode(q, cache, RANK, lens, table, 0.1, out, lse)
torch.cuda.synchronize()
