"""Step metadata from an engine's device tensors plus host hints
(kvcore.attention_metadata_from_engine): no device read, padded rows honoured."""

from __future__ import annotations

import pytest
import torch

import kvcore
import kvcore.builder as builder_module

BS, NB, H, HQ, D = 4, 8, 2, 4, 8


def _engine_step(pad_rows: int = 2) -> dict:
    """Two requests (3 new over 2 cached; 1 new over 6 cached), vLLM-style: int32 starts,
    lengths and table, int64 slots padded with -1, host copy of the starts."""
    ref = kvcore.build_attention_metadata([3, 1], [2, 6], [[1, 4], [0, 2]], BS, num_blocks=NB)
    slots = torch.cat([ref.slot_mapping, torch.full((pad_rows,), -1, dtype=torch.int64)])
    table = torch.zeros(2, 5, dtype=torch.int32)  # wider than needed, as engines keep it
    table[:, :2] = ref.block_table[:, :2]
    return dict(query_start_loc=ref.query_start_loc.clone(), seq_lens=ref.seq_lens.clone(),
                block_table=table, slot_mapping=slots,
                query_start_loc_cpu=ref.query_start_loc.clone(), max_query_len=3,
                max_seq_len=8, block_size=BS, num_blocks=NB,
                seq_lens_cpu=ref.seq_lens.clone())


def _builder():
    spec = kvcore.FullAttentionSpec(block_size=BS, dtype=torch.float32, num_kv_heads=H,
                                    head_size=D)
    return kvcore.resolve_backend("CPU_ATTN").get_builder_cls()(
        spec, num_heads=HQ, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
        device="cpu")


def test_builder_reads_nothing_back_when_the_engine_gives_host_facts(monkeypatch):
    def device_read(*args, **kwargs):
        raise AssertionError("the builder read the step's tensors back")

    monkeypatch.setattr(builder_module, "step_facts_from_tensors", device_read)
    meta = kvcore.attention_metadata_from_engine(**_engine_step())
    assert meta.num_actual_tokens == 4
    _builder().build(meta)  # no device read
    # check_on_device: the builder reads the tensors once (here: the patched function).
    checked = kvcore.attention_metadata_from_engine(**_engine_step(), check_on_device=True)
    with pytest.raises(AssertionError, match="read the step"):
        _builder().build(checked)


def test_padded_rows_are_not_written_and_output_equals_host_built_metadata():
    backend = kvcore.resolve_backend("CPU_ATTN")
    impl = backend.get_impl_cls()(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=H)
    outs = []
    for meta in (kvcore.build_attention_metadata([3, 1], [2, 6], [[1, 4], [0, 2]], BS),
                 _builder().build(kvcore.attention_metadata_from_engine(**_engine_step()))):
        caches = kvcore.allocate_kv_caches(backend, num_layers=1, num_blocks=NB, block_size=BS,
                                           num_kv_heads=H, head_size=D, dtype=torch.float32,
                                           device="cpu")
        caches.storage.copy_(torch.randn(caches.storage.shape,
                                         generator=torch.Generator().manual_seed(1)))
        before = caches.layers[0].clone()
        rows = meta.slot_mapping.shape[0]
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(6, n, D, generator=g)[:rows] for n in (HQ, H, H))
        out = torch.full((rows, HQ, D), 123.0)
        layer = kvcore.LayerScales()
        impl.do_kv_cache_update(layer, k, v, caches.layers[0], meta.slot_mapping)
        impl.forward(layer, q, k, v, caches.layers[0], meta, output=out)
        # Only the 4 real tokens' slots change: the padding rows (slot -1) write nothing.
        assert int((caches.layers[0] != before).any(dim=(1, 3, 4)).sum()) == 4
        outs.append(out)
    torch.testing.assert_close(outs[1][:4], outs[0][:4], rtol=0, atol=0)
    assert (outs[1][4:] == 123.0).all()  # padding rows left alone


@pytest.mark.parametrize("case, change, match", [
    ("starts not from 0", dict(query_start_loc_cpu=torch.tensor([1, 3, 4], dtype=torch.int32)),
     "must start at 0"),
    ("more tokens than rows", dict(slot_mapping=torch.zeros(3, dtype=torch.int64)),
     "end at most at the 3 rows"),
    ("wrong max_query_len", dict(max_query_len=2), "max_query_len=2 but"),
    ("seq_len under its query", dict(seq_lens_cpu=torch.tensor([2, 7], dtype=torch.int32)),
     "requests \\[0\\] are shorter"),
    ("understated max_seq_len", dict(max_seq_len=6), "at most max_seq_len=6"),
    ("per-request causal", dict(causal=torch.ones(2, dtype=torch.bool)), "causal is a tensor"),
    ("int64 block table", dict(block_table=torch.zeros(2, 5, dtype=torch.int64)),
     "block_table has shape .2, 5. and dtype int64"),
    ("fewer starts", dict(query_start_loc_cpu=torch.tensor([0, 4], dtype=torch.int32)),
     "query_start_loc_cpu has 2 entries"),
])
def test_contradicting_host_facts_are_refused(case, change, match):
    step = _engine_step()
    step.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        kvcore.attention_metadata_from_engine(**step)
