"""Rule ``engine-metadata``: a step described by an engine's own tensors runs as kvcore's own.

Engines keep a step's metadata in persistent device buffers and hand kvcore views of them
(:func:`kvcore.attention_metadata_from_engine`; vLLM's ``CommonAttentionMetadata`` is the
worked case). Those tensors differ from what :func:`kvcore.build_attention_metadata` makes
for the same step in everything but the values that matter: the block table is as wide as
the longest request the engine allows, its unused columns hold stale ids; requests padded in
for a CUDA-graph batch size have no query and no length; the slot mapping may be int32 and
its padding rows hold -1; each tensor may be a strided view; and the step is marked checked
with the bounds the engine vouches for instead of the exact ones. A builder or kernel that
sizes a loop from the table's width, reads it as dense rows of the needed width, trusts the
exact bounds, or trips on an empty request gives other results on the engine's tensors.

The check runs the mixed batch, with two padded requests, through the backend's builder and
``forward`` twice: from kvcore's own metadata and from the engine's tensors, in two engine
forms (vLLM's: dense views of wider buffers, int64 slots; and every tensor at stride 2 with
int32 slots and a host copy of the lengths). Cache and output must agree bit for bit, and the
padding rows of the output stay untouched.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcore.adopt import attention_metadata_from_engine
from kvcore.metadata import AttentionMetadata, build_attention_metadata
from kvcore.testing.batch import NUM_PADDING_TOKENS, CaseConfig, MixedBatch
from kvcore.testing.builder_checks import make_builder
from kvcore.testing.runs import bits, case_run
from kvcore.testing.strided_steps import strided_view, unowned_block

__all__ = ["ENGINE_FORMS", "check_engine_metadata", "engine_step_tensors"]

RULE = "engine-metadata"

#: Requests an engine pads a step with (no query, no length: a CUDA-graph batch size).
NUM_PADDED_REQUESTS = 2
#: Columns the engine's block table has beyond the step's longest request.
EXTRA_TABLE_COLUMNS = 3
#: What an output row holds before forward; padding rows must keep it.
_UNTOUCHED = 7.0

#: The engine forms checked: name -> (tensors at stride 2, slot dtype, host copy of lengths).
ENGINE_FORMS: dict[str, tuple[bool, torch.dtype, bool]] = {
    "vLLM's buffers (dense views of wider buffers, int64 slots)": (False, torch.int64, False),
    "strided views, int32 slots, host lengths": (True, torch.int32, True),
}


def _padded_step(batch: MixedBatch, causal: bool, block_size: int) -> AttentionMetadata:
    """kvcore's own metadata of ``batch`` with :data:`NUM_PADDED_REQUESTS` empty requests
    after its requests and its padding token rows (slot -1)."""
    pad = NUM_PADDED_REQUESTS
    meta = build_attention_metadata(
        [*batch.query_lens, *[0] * pad], [*batch.context_lens, *[0] * pad],
        [*batch.block_tables, *[[]] * pad], block_size, device=batch.query.device,
        causal=causal, num_blocks=batch.num_blocks)
    padding = torch.full((NUM_PADDING_TOKENS,), -1, dtype=torch.int64,
                         device=meta.slot_mapping.device)
    return dataclasses.replace(meta, slot_mapping=torch.cat([meta.slot_mapping, padding]))


def engine_step_tensors(meta: AttentionMetadata, *, stale_block: int, block_size: int,
                        strided: bool, slot_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The step's tensors as an engine holds them: ``block_table`` widened by
    :data:`EXTRA_TABLE_COLUMNS` columns of ``stale_block`` (and the unused tail of each row
    holding it too), ``slot_mapping`` in ``slot_dtype``, each tensor a view of a persistent
    buffer (at stride 2 with other values between when ``strided``)."""
    table = meta.block_table
    lens = meta.seq_lens.tolist()
    wide = torch.full((table.shape[0], table.shape[1] + EXTRA_TABLE_COLUMNS), stale_block,
                      dtype=torch.int32, device=table.device)
    for i, length in enumerate(lens):  # stale ids beyond each request's own blocks
        used = -(-length // block_size)
        wide[i, :used] = table[i, :used]
    tensors = {"query_start_loc": meta.query_start_loc.clone(),
               "seq_lens": meta.seq_lens.clone(), "block_table": wide,
               "slot_mapping": meta.slot_mapping.to(slot_dtype)}
    if strided:
        gaps = {"query_start_loc": 0, "seq_lens": 0, "block_table": stale_block,
                "slot_mapping": -1}
        return {name: strided_view(t, gaps[name]) for name, t in tensors.items()}
    # A persistent buffer sized for a larger step: the step's rows are a prefix view of it.
    return {name: torch.cat([t, t[-1:].clone()])[:t.shape[0]] for name, t in tensors.items()}


def check_engine_metadata(backend: type, config: CaseConfig, device: torch.device,
                          seed: int) -> None:
    """Rule ``engine-metadata``: the mixed batch plus two padded requests, written and attended
    through the backend's builder with metadata from
    :func:`kvcore.attention_metadata_from_engine` over the engine's forms of the step's tensors
    (:data:`ENGINE_FORMS`), gives bit for bit the cache and output rows of the same calls with
    :func:`kvcore.build_attention_metadata`'s metadata, and leaves the padding rows of the
    output untouched. The comparison is with the backend itself (``builder-reference`` holds
    the own path to the reference)."""
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    bs = config.block_size
    own_meta = _padded_step(batch, config.causal, bs)
    _, layer, scales, impl = run.setup_layer(batch.num_blocks)
    before = layer.clone()
    builder = make_builder(run, max_model_len=8 * bs)
    n = batch.num_tokens

    def step(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        layer.copy_(before)
        built = builder.build(meta)
        impl.do_kv_cache_update(scales, batch.key, batch.value, layer, meta.slot_mapping)
        output = torch.full(run.output_shape(batch.query.shape[0]), _UNTOUCHED,
                            dtype=batch.query.dtype, device=device)
        impl.forward(scales, batch.query, batch.key, batch.value, layer, built, output=output)
        return layer.clone(), output

    try:
        own_cache, own_out = step(own_meta)
    except Exception as exc:
        try:  # without the padded requests: a failure there is builder-reference's finding
            step(batch.metadata)
        except Exception:
            return
        raise run.fail(RULE, (
            f"with kvcore's own metadata of a step padded with {NUM_PADDED_REQUESTS} empty "
            "requests (query length 0, seq_len 0, no blocks: what an engine sends to fill a "
            f"CUDA-graph batch size), builder.build() or forward raised {type(exc).__name__}: "
            f"{exc} (without them they ran); skip requests with no tokens"
            f"\n{batch.describe()}")) from exc
    host = own_meta.seq_lens_cpu
    for form, (strided, slot_dtype, host_lens) in ENGINE_FORMS.items():
        tensors = engine_step_tensors(own_meta, stale_block=unowned_block(batch),
                                      block_size=bs, strided=strided, slot_dtype=slot_dtype)
        where = (f"metadata from kvcore.attention_metadata_from_engine over the engine's "
                 f"tensors ({form}; block_table {tuple(tensors['block_table'].shape)} with "
                 f"stale ids in unused columns, {NUM_PADDED_REQUESTS} padded requests, "
                 f"{NUM_PADDING_TOKENS} padding token rows of slot -1)")
        try:
            engine_meta = attention_metadata_from_engine(
                **tensors, query_start_loc_cpu=own_meta.query_start_loc_cpu.clone(),
                max_query_len=own_meta.max_query_len, max_seq_len=own_meta.max_seq_len,
                block_size=bs, num_blocks=batch.num_blocks,
                seq_lens_cpu=host.clone() if host_lens else None, causal=config.causal)
            cache, out = step(engine_meta)
        except Exception as exc:
            raise run.fail(RULE, (
                f"builder.build() and forward with {where} raised {type(exc).__name__}: "
                f"{exc} (with kvcore's own metadata of the step they ran)"
                f"\n{batch.describe()}")) from exc
        bad = bits(cache) != bits(own_cache)
        if bad.any():
            raise run.fail(RULE, (
                f"do_kv_cache_update with the engine's slot_mapping ({form}): {int(bad.sum())} "
                f"of {bad.numel()} cache elements differ from the write with kvcore's own "
                f"slot_mapping\n{batch.describe()}"))
        bad = bits(out[:n]) != bits(own_out[:n])
        if bad.any():
            token, head, dim = bad.nonzero()[0].tolist()
            raise run.fail(RULE, (
                f"forward with {where}: {int(bad.sum())} of {bad.numel()} output elements "
                f"differ from forward with kvcore's own metadata of the step, first at "
                f"{batch.locate(token)}, head {head}, dim {dim}: got "
                f"{out[token, head, dim].item():.6g}, kvcore's own metadata gives "
                f"{own_out[token, head, dim].item():.6g}; read the block table only up to "
                "each request's seq_len, through its strides\n" + batch.describe()))
        touched = int((out[n:] != _UNTOUCHED).any(dim=-1).any(dim=-1).sum())
        if touched:
            raise run.fail(RULE, (
                f"forward with {where} wrote {touched} of the {out.shape[0] - n} padding rows "
                f"of the output (rows from num_actual_tokens={n} on); leave them as they are"
                f"\n{batch.describe()}"))
