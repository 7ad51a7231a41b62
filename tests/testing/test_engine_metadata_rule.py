"""Conformance rule ``engine-metadata``: kvcore's backends pass it, and it catches builders
and kernels that read an engine's step tensors as if kvcore had made them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcore
from kvcore.testing import ConformanceError, conformance_cases
from kvcore.testing.engine_metadata import EXTRA_TABLE_COLUMNS, engine_step_tensors

CPU_BACKEND = kvcore.resolve_backend("CPU_ATTN")


def engine_case(backend: type[kvcore.AttentionBackend]):
    (case,) = [c for c in conformance_cases(backend, devices=["cpu"])
               if c.kind == "engine-metadata"]
    return case


class DenseTableBuilder(CPU_BACKEND.get_builder_cls()):
    """THE BUG: trims the block table to the step's longest request by reading its storage
    as dense rows of that width (right for kvcore's own tables, which are exactly that wide;
    wrong for an engine's table, as wide as its longest allowed request)."""

    def build(self, common, *, graph_batch_size=None):
        meta = super().build(common, graph_batch_size=graph_batch_size)
        width = -(-meta.max_seq_len // self.spec.block_size)
        table = meta.block_table.contiguous()
        dense = torch.as_strided(table, (table.shape[0], width), (width, 1))
        return dataclasses.replace(meta, block_table=dense)


class ReadsEngineTableDensely(CPU_BACKEND):
    @staticmethod
    def get_name():
        return "READS_ENGINE_TABLE_DENSELY"

    @staticmethod
    def get_builder_cls():
        return DenseTableBuilder


class WritesPaddingRowsImpl(CPU_BACKEND.get_impl_cls()):
    """THE BUG: attends over every row of the query (padding rows too) when the step's slot
    mapping is int32, as a kernel launched over ``slot_mapping.shape[0]`` rows would."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output=output)
        if attn_metadata.slot_mapping.dtype == torch.int32:
            out[attn_metadata.num_actual_tokens:] = 0
        return out


class WritesPaddingRows(CPU_BACKEND):
    @staticmethod
    def get_name():
        return "WRITES_PADDING_ROWS"

    @staticmethod
    def get_impl_cls():
        return WritesPaddingRowsImpl


@pytest.mark.parametrize("name", ["CPU_ATTN", "CPU_MLA", "SDPA_GATHER"])
def test_cpu_backends_pass(name):
    engine_case(kvcore.resolve_backend(name)).run()


@pytest.mark.triton
@pytest.mark.parametrize("name", ["TRITON_ATTN", "TRITON_MLA"])
def test_triton_backends_pass_under_the_interpreter(name, monkeypatch):
    if name not in kvcore.backend_registry().names():
        pytest.skip(f"{name} is not installed")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    engine_case(kvcore.resolve_backend(name)).run()


def test_a_builder_reading_the_engine_table_densely_fails():
    with pytest.raises(ConformanceError) as info:
        engine_case(ReadsEngineTableDensely).run()
    message = str(info.value)
    assert "broke conformance rule 'engine-metadata'" in message
    assert "docs/conformance.md#engine-metadata" in message
    assert "vLLM's buffers" in message and "stale ids in unused columns" in message
    assert "read the block table only up to each request's seq_len" in message


def test_a_forward_writing_padding_rows_fails():
    with pytest.raises(ConformanceError, match=r"wrote 2 of the 2 padding rows of the output "
                                               r"\(rows from num_actual_tokens=\d+ on\)"):
        engine_case(WritesPaddingRows).run()


def test_engine_tensors_hold_the_steps_values_in_the_engines_forms():
    meta = kvcore.build_attention_metadata([3, 1, 0], [2, 6, 0], [[1, 4], [0, 2], []], 4)
    for strided, dtype in ((False, torch.int64), (True, torch.int32)):
        t = engine_step_tensors(meta, stale_block=7, block_size=4, strided=strided,
                                slot_dtype=dtype)
        assert t["slot_mapping"].dtype == dtype
        assert t["slot_mapping"].tolist() == meta.slot_mapping.tolist()
        assert t["block_table"].shape == (3, 2 + EXTRA_TABLE_COLUMNS)
        assert t["block_table"].tolist() == [[1, 4, 7, 7, 7], [0, 2, 7, 7, 7], [7] * 5]
        assert all(x.stride(-1) == (2 if strided else 1) for x in t.values())
        assert t["seq_lens"].tolist() == [5, 7, 0]
