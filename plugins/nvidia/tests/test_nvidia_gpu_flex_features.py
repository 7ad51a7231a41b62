"""FLEX_ATTENTION compiled on an NVIDIA GPU with the layer features of gpt-oss (sinks, head 64,
a 128-token window on alternate layers) and Gemma 2 (soft-cap 50, head 256, a 4096-token
window on alternate layers), bf16, blocks of 16: every step against the float64 reference,
while batch, context and cache sizes change, within three graphs per layer kind."""

from __future__ import annotations

import pytest
import torch
from kvcore_nvidia.backends.flex_attention import FlexAttentionBackend
from nvidia_helpers import mixed_batch, random_caches, rel_err

import kvcore
from kvcore.ops import paged_attention_ref

pytestmark = pytest.mark.gpu

BLOCK_SIZE, NUM_BLOCKS = 16, 8192
#: ||out - ref|| / ||ref|| of a bf16 kernel against float64 (bf16 rounding is ~4e-3 per value).
BF16_REL_ERR = 1e-2
#: Per model: heads, KV heads, head size, the window of its sliding layers, the soft-cap, sinks
#: and how much the queries are scaled (Gemma's scores must reach the cap for it to matter).
MODELS = {
    "gpt-oss": dict(num_heads=64, num_kv_heads=8, head_size=64, window=128, soft_cap=None,
                    sinks=True, query_scale=1.0),
    "gemma-2": dict(num_heads=16, num_kv_heads=8, head_size=256, window=4096, soft_cap=50.0,
                    sinks=False, query_scale=30.0),
}
#: Decodes, prefills and mixed steps whose contexts reach past both windows; the cache's
#: number of blocks changes too (see the test).
STEPS = [((1,), (30,)), ((1,) * 4, (300, 40, 5000, 17)), ((64, 1, 1), (0, 900, 3)),
         ((1,) * 64, tuple(range(10, 64 * 30, 30))), ((333, 1), (0, 4500)), ((1,), (6000,)),
         ((17,) * 8, (40,) * 8), ((200, 1, 1), (4000, 130, 7))]


def _layers(model: dict, gen: torch.Generator) -> list[kvcore.AttentionImpl]:
    """Sliding, global, sliding: the second sliding layer has its own sink values and must
    share the first one's compiled entry point."""
    head_size = model["head_size"]
    return [FlexAttentionBackend.get_impl_cls()(
        num_heads=model["num_heads"], head_size=head_size, scale=head_size**-0.5,
        num_kv_heads=model["num_kv_heads"], sliding_window=window,
        logits_soft_cap=model["soft_cap"],
        sinks=(torch.randn(model["num_heads"], generator=gen) + 4).cuda()
        if model["sinks"] else None)
        for window in (model["window"], None, model["window"])]


def _reference(impl: kvcore.AttentionImpl, batch, kv_cache: torch.Tensor, *,
               features: bool = True) -> torch.Tensor:
    """float64 attention of the batch with the layer's window, and its soft-cap and sinks
    unless ``features`` is False."""
    m = batch.meta
    return paged_attention_ref(
        batch.query.double(), *(c.double() for c in kv_cache.unbind(1)),
        query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table,
        scale=impl.scale, causal=impl.is_causal(m), sliding_window=impl.sliding_window,
        logits_soft_cap=impl.logits_soft_cap if features else None,
        sinks=impl.sinks if features else None)


def _graphs(run) -> int:
    """Graphs dynamo holds for one compiled entry point (the cache entries of its code)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(run._torchdynamo_orig_callable.__code__))


@pytest.mark.parametrize("name", MODELS)
def test_flex_attention_features_stay_within_three_graphs_per_layer_kind(name, monkeypatch):
    """gpt-oss's sinks with its 128 window at head 64, Gemma 2's soft-cap with its 4096 window
    at head 256: each step of each layer against the float64 reference (the first step also
    against the reference without the feature, which must be far off); the model uses two
    entry points (sliding, global), whatever its sink values, each within three graphs
    (torch raises past them)."""
    model = MODELS[name]
    gen = torch.Generator().manual_seed(40 if name == "gpt-oss" else 41)
    full = random_caches(
        FlexAttentionBackend, gen, num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        num_kv_heads=model["num_kv_heads"], head_size=model["head_size"]).layers[0]
    layers = _layers(model, gen)
    # Where _run_flex looks it up (another test may have re-imported the module).
    namespace = FlexAttentionBackend.get_impl_cls().attend.__globals__
    compiled = namespace["compiled_flex"]
    configs = set()
    monkeypatch.setitem(namespace, "compiled_flex",
                        lambda config, *a: (configs.add(config), compiled(config, *a))[1])
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for i, (q_lens, ctx_lens) in enumerate(STEPS):
            kv_cache = full[:NUM_BLOCKS - 1000 * (i % 3)]
            for impl in layers:
                batch = mixed_batch(impl, kv_cache, gen, q_lens=q_lens, ctx_lens=ctx_lens)
                batch.query.mul_(model["query_scale"])
                out = torch.full_like(batch.query, float("nan"))
                impl.forward(kvcore.LayerScales(), batch.query, batch.key, batch.value,
                             kv_cache, batch.meta, output=out)
                ref = _reference(impl, batch, kv_cache)
                assert rel_err(out, ref) < BF16_REL_ERR, (name, i, impl.sliding_window)
                if i == 0 and impl.sliding_window is not None:
                    without = _reference(impl, batch, kv_cache, features=False)
                    assert rel_err(without, ref) > 5 * BF16_REL_ERR, name
    assert len(configs) == 2, configs
    assert all(_graphs(compiled(config)) <= 3 for config in configs), configs
