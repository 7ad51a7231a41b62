"""CudaGraphRunner's replay on the CPU (capturing needs CUDA, so the captured state is set as
``capture`` leaves it): a replayed step copies its inputs into the captured buffers with one
foreach copy, converting dtypes and reading strided sources as ``copy_`` does, and leaves the
padding rows alone."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.cuda_graphs import _Graph


class _Recorded:
    """A captured graph that counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def uncaptured_runner() -> kvcore.CudaGraphRunner:
    """A runner for batches of 4 over a CPU builder, not captured yet."""
    spec = kvcore.FullAttentionSpec(block_size=4, dtype=torch.float32, num_kv_heads=1,
                                    head_size=8)
    builder = kvcore.PersistentMetadataBuilder(spec, num_heads=1, max_num_seqs=4,
                                               max_num_batched_tokens=8, max_model_len=32,
                                               device="cpu")
    return kvcore.CudaGraphRunner(builder, lambda inputs, meta: None, num_blocks=16,
                                  batch_sizes=[4])


def captured(runner: kvcore.CudaGraphRunner) -> _Recorded:
    """Set the state ``capture`` leaves (inputs ``x`` (4, 3) float32 and ``ids`` (4,) int64,
    a graph for 4 requests) without CUDA; the graph that counts its replays."""
    graph = _Recorded()
    empty = kvcore.build_attention_metadata([], [], [], 4)
    runner._inputs = {"x": torch.zeros(4, 3), "ids": torch.zeros(4, dtype=torch.int64)}
    runner._graphs[4] = _Graph(graph, torch.arange(4.0), runner._signature(
        runner.builder.build(empty, graph_batch_size=4)))
    return graph


def test_a_replay_copies_every_input_with_one_foreach_copy(monkeypatch) -> None:
    runner = uncaptured_runner()
    graph = captured(runner)
    calls = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_",
                        lambda dst, src: (calls.append(len(dst)), foreach_copy(dst, src)))

    x = torch.arange(6.0).view(3, 2).t()  # strided
    ids = torch.tensor([7, 8], dtype=torch.int32)  # converted to the buffer's int64
    out = runner.run({"x": x, "ids": ids}, kvcore.build_attention_metadata(
        [1, 1], [5, 9], [[0, 1], [2, 3, 4]], 4))
    assert calls == [2] and graph.replays == 1 and runner.replayed_steps == 1
    assert out.tolist() == [0.0, 1.0]
    assert runner._inputs["x"].tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0], [0.0] * 3,
                                            [0.0] * 3]
    assert runner._inputs["ids"].tolist() == [7, 8, 0, 0]
    with pytest.raises(ValueError, match=r"inputs\['ids'\] has shape \(3,\)"):
        runner.run({"x": x, "ids": torch.zeros(3, dtype=torch.int64)},
                   kvcore.build_attention_metadata([1, 1], [5, 9], [[0, 1], [2, 3, 4]], 4))


def test_inputs_written_into_the_runners_buffers_are_not_copied(monkeypatch) -> None:
    runner = uncaptured_runner()
    with pytest.raises(RuntimeError, match="needs capture"):
        runner.input_buffers(2)
    graph = captured(runner)
    copied = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_",
                        lambda dst, src: (copied.append([d.data_ptr() for d in dst]),
                                          foreach_copy(dst, src)))
    step = kvcore.build_attention_metadata([1, 1], [5, 9], [[0, 1], [2, 3, 4]], 4)
    views = runner.input_buffers(2)
    assert {k: tuple(v.shape) for k, v in views.items()} == {"x": (2, 3), "ids": (2,)}
    views["x"].copy_(torch.rand(2, 3))
    views["ids"].copy_(torch.tensor([5, 6]))
    expected = views["x"].clone()
    runner.run(views, step)
    assert copied == [] and graph.replays == 1
    assert torch.equal(runner._inputs["x"][:2], expected)
    # One input in place, the other from elsewhere: only that one is copied.
    runner.run({"x": views["x"], "ids": torch.tensor([7, 8])}, step)
    assert copied == [[runner._inputs["ids"].data_ptr()]]
    assert runner._inputs["ids"].tolist() == [7, 8, 0, 0]
    # The buffer's address in another layout would be copied onto itself: refused.
    with pytest.raises(ValueError, match=r"inputs\['ids'\] starts at its captured buffer"):
        runner.run({"x": views["x"], "ids": runner._inputs["ids"].view(torch.float64)[:2]},
                   step)
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match="must be an integer in 1..4"):
            runner.input_buffers(bad)
