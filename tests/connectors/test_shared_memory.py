"""Sharing an allocation with a peer (:mod:`kvcore.connectors.shared_memory`): what maps, and
the reasons for what does not, before any byte is read."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from kvcore.connectors.shared_memory import (
    host_identity,
    map_allocation,
    peer_facts,
    share_allocation,
    shareable_with,
)


def test_a_peer_in_this_process_gets_the_very_allocation():
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    handle = share_allocation(data)
    assert handle["kind"] == "process" and handle["nbytes"] == 4096
    assert handle["pid"] == os.getpid() and handle["host"] == host_identity()
    mapped = map_allocation(handle)
    assert mapped is data
    mapped[7] = 255 - int(mapped[7])  # one memory: the owner sees the peer's write
    assert int(data[7]) == int(mapped[7])


def test_an_allocation_its_owner_dropped_is_not_mapped():
    handle = share_allocation(torch.zeros(64, dtype=torch.uint8))
    gc.collect()
    with pytest.raises(ValueError, match="made in this process and is freed"):
        map_allocation(handle)


@pytest.mark.parametrize("change, match", [
    ({"kind": "process", "pid": 1}, r"CPU memory of process 1, which another process cannot "
                                    r"map"),
    ({"kind": "cuda", "pid": 1, "host": "elsewhere/boot"},
     r"on host 'elsewhere/boot'.*CUDA IPC maps memory of one host only"),
    ({"kind": "cuda", "pid": 1, "gpu": "GPU-none"},
     r"on GPU GPU-none, which this process does not see"),
    ({"kind": "shm", "pid": 1}, r"of kind 'shm': this kvcore maps 'cuda' and 'process'"),
], ids=["cpu-of-another-process", "another-host", "an-unseen-gpu", "unknown-kind"])
def test_what_cannot_be_mapped_here_says_why(change, match):
    data = torch.ones(16, dtype=torch.uint8)
    handle = {**share_allocation(data), **change}
    with pytest.raises(ValueError, match=match):
        map_allocation(handle)


def test_a_malformed_handle_or_tensor_is_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match=r"lacks token$"):
        map_allocation({"kind": "cuda", "nbytes": 1, "pid": 1})
    with pytest.raises(ValueError, match=r"'None' lacks kind, nbytes, pid, token"):
        map_allocation(None)
    with pytest.raises(ValueError, match=r"contiguous uint8 tensor, got torch.float32"):
        share_allocation(torch.ones(4))
    with pytest.raises(ValueError, match=r"contiguous uint8 tensor"):
        share_allocation(torch.ones(8, dtype=torch.uint8)[::2])


def test_a_sharer_tells_which_peers_can_map_it_from_their_facts():
    data = torch.zeros(32, dtype=torch.uint8)
    assert shareable_with(data, peer_facts()) is None  # this process: anything
    other = {**peer_facts(), "pid": os.getpid() + 1}
    assert "CPU memory of process" in shareable_with(data, other)
    assert "no mapping facts" in shareable_with(data, {"pid": 1})


def test_the_same_pid_on_another_host_is_not_this_process():
    """Containers reuse PIDs: a handle is this process's only with the host's identity too."""
    handle = {**share_allocation(torch.ones(8, dtype=torch.uint8)), "host": "other/boot"}
    with pytest.raises(ValueError, match="CPU memory of process"):
        map_allocation(handle)
