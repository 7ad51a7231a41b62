"""Block-movement helpers (``kvcore.blocks``, exported by ``kvcore.ops``): mapping checks that
name the caller's arguments, and run merging checked against a simple model."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore.ops
from kvcore.blocks import block_runs, check_block_mapping

NAMES = ("src_cache", "dst_cache", "src_block_indices", "dst_block_indices")


def caches(src_blocks: int = 6, dst_blocks: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(src_blocks, 2, 4), torch.randn(dst_blocks, 2, 4)


def ids(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_kvcore_ops_exports_both():
    assert kvcore.ops.check_block_mapping is check_block_mapping
    assert kvcore.ops.block_runs is block_runs
    assert {"check_block_mapping", "block_runs"} <= set(kvcore.ops.__all__)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_valid_mapping_comes_back_as_int64_cpu_ids(dtype):
    src, dst = caches()
    src_ids, dst_ids = check_block_mapping(src, dst, ids(5, 0, 5, dtype=dtype),
                                           ids(7, 1, 2, dtype=dtype))
    assert src_ids.dtype == dst_ids.dtype == torch.int64
    assert src_ids.device.type == dst_ids.device.type == "cpu"
    assert src_ids.tolist() == [5, 0, 5] and dst_ids.tolist() == [7, 1, 2]
    empty = check_block_mapping(src, dst, ids(), ids())
    assert [t.numel() for t in empty] == [0, 0]


BAD = [
    ("src_ids", [1], TypeError, r"src_block_indices must be a torch\.Tensor, got list"),
    ("src", torch.zeros(()), ValueError,
     "src_cache and dst_cache must have a leading block dim"),
    ("dst", torch.zeros(8, 2, 5), ValueError,
     r"src_cache blocks have shape \(2, 4\) but dst_cache blocks have \(2, 5\); both caches"),
    ("dst", torch.zeros(8, 2, 4, dtype=torch.float16), TypeError,
     "src_cache is torch.float32 but dst_cache is torch.float16"),
    ("src_ids", torch.zeros(1, 1, dtype=torch.int64), ValueError,
     r"src_block_indices must be 1-D, got shape \(1, 1\)"),
    ("dst_ids", torch.zeros(1), TypeError,
     "dst_block_indices must be int32 or int64, got torch.float32"),
    ("src_ids", ids(6), ValueError,
     r"src_block_indices contains block id 6, outside the cache's 6 blocks "
     r"\(valid ids: 0\.\.5\)"),
    ("dst_ids", ids(-1), ValueError, "dst_block_indices contains block id -1, outside the "
     "cache's 8 blocks"),
    ("dst_ids", ids(0, 1), ValueError,
     "src_block_indices has 1 entries but dst_block_indices has 2"),
]


@pytest.mark.parametrize("field,value,error,message", BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_mapping_is_refused_naming_the_argument(field, value, error, message):
    src, dst = caches()
    args = {"src": src, "dst": dst, "src_ids": ids(3), "dst_ids": ids(4)}
    args[field] = value
    with pytest.raises(error, match=message):
        check_block_mapping(args["src"], args["dst"], args["src_ids"], args["dst_ids"],
                            names=NAMES)


def test_a_destination_written_twice_is_refused_and_a_source_read_twice_is_not():
    src, dst = caches()
    check_block_mapping(src, dst, ids(1, 1), ids(2, 3))
    with pytest.raises(ValueError, match=r"dst_ids repeats block ids \[2, 5\]: each "
                                         "destination block is written once"):
        check_block_mapping(src, dst, ids(0, 1, 2, 3, 4), ids(2, 5, 2, 5, 0))


def test_default_names_are_the_parameter_names():
    src, dst = caches()
    with pytest.raises(ValueError, match="src_ids contains block id 9"):
        check_block_mapping(src, dst, ids(9), ids(0))


def model_runs(src: list[int], dst: list[int], merge: bool) -> list[list[int]]:
    runs: list[list[int]] = []
    for s, d in sorted(zip(src, dst, strict=True)):
        last = runs[-1] if runs else None
        if merge and last and s == last[0] + last[2] and d == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def test_runs_merge_where_both_ids_advance_by_one():
    runs = block_runs(ids(5, 6, 7, 9, 10, 2), ids(0, 1, 2, 3, 5, 7))
    assert runs.dtype == torch.int64 and runs.device.type == "cpu"
    assert runs.tolist() == [[2, 7, 1], [5, 0, 3], [9, 3, 1], [10, 5, 1]]
    assert block_runs([], []).shape == (0, 3)


@pytest.mark.parametrize("src_adjacent,dst_adjacent", [(True, True), (True, False),
                                                       (False, True)])
def test_runs_of_random_mappings_match_the_model(src_adjacent, dst_adjacent):
    """Small mappings (merged in Python) and large ones (merged with torch ops) alike."""
    rnd = random.Random(random.randrange(2**31))
    for _ in range(200):
        n = rnd.choice([rnd.randint(1, 40), rnd.randint(100, 400)])
        dst = rnd.sample(range(512), n)
        src = [rnd.randrange(512) for _ in range(n)] if rnd.random() < 0.3 else \
            rnd.sample(range(512), n)
        if rnd.random() < 0.5:  # long stretches of consecutive ids
            src.sort()
            dst.sort()
        as_tensor = rnd.random() < 0.5
        runs = block_runs(ids(*src, dtype=torch.int32) if as_tensor else src,
                          ids(*dst) if as_tensor else dst, src_adjacent, dst_adjacent)
        expected = model_runs(src, dst, src_adjacent and dst_adjacent)
        assert runs.tolist() == expected, (src, dst)


def test_runs_refuse_mappings_of_different_lengths():
    with pytest.raises(ValueError, match="src_ids has 2 entries but dst_ids has 1"):
        block_runs([0, 1], [0])
