"""Run TRITON_ATTN's prefill twice with the table's Triton tile (``triton_prefill``) and twice
with a ``gluon_ws_pingpong`` tile on one prefill batch (Hq 32, Hk 8, D 128, bf16, block 16,
causal; 4 x 2048 new tokens unless ``PROF_SHAPE=requests,new,cached`` says otherwise; the Gluon
tile ``PROF_TILE=block_n,stages``, default 128,3), for a profiler (ncu) to read. Usage: ncu -k
regex:prefill ... python3 benchmarks/prof_gluon_prefill.py"""

import os

import torch

from kvcore.ops import GluonPrefillConfig, TritonAttentionPlan
from kvcore.ops import triton_attention as ta
from kvcore.ops.attention_dispatch import default_config

HQ, HK, D, BS = 32, 8, 128, 16
requests, new, cached = (int(v) for v in os.environ.get("PROF_SHAPE", "4,2048,0").split(","))
block_n, stages = (int(v) for v in os.environ.get("PROF_TILE", "128,3").split(","))
pages = -(-(new + cached) // BS)
kv = torch.randn(requests * pages + 8, 2, BS, HK, D, dtype=torch.bfloat16, device="cuda")
k_cache, v_cache = kv.unbind(1)
table = torch.randperm(requests * pages + 8, device="cuda")[:requests * pages]
kwargs = dict(query_start_loc=(torch.arange(requests + 1, device="cuda") * new).int(),
              seq_lens=torch.full((requests,), new + cached, dtype=torch.int32, device="cuda"),
              block_table=table.view(requests, pages).int(), scale=D ** -0.5)
query = torch.randn(requests * new, HQ, D, dtype=torch.bfloat16, device="cuda")
gluon = TritonAttentionPlan(config=GluonPrefillConfig(block_q=32, g_pad=4, block_n=block_n,
                                                      num_stages=stages))
# The Triton row explicitly: sm90's default config is the Gluon one.
triton_row = TritonAttentionPlan(config=default_config(
    requests * new, requests, HQ, HK, D, pages * BS, query.device, gluon=False))
for _ in range(2):
    ta.paged_attention(query, k_cache, v_cache, **kwargs, plan=triton_row)
    ta.paged_attention(query, k_cache, v_cache, **kwargs, plan=gluon)
torch.cuda.synchronize()
