"""What the tests of the pull connectors (``nixl``, ``mooncake``) share: each connector's
description (:class:`Pull`), a producer in a subprocess (``pull_peer.py``), connectors in this
process, and the two-process round trip every pull connector must pass bit-exactly.

``test_pull_connectors.py`` runs the protocol cases both connectors share on each of them;
``test_nixl.py`` and ``test_mooncake.py`` keep what only one of them has.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from kv_helpers import SIZES, block_bytes, keys_for, make_caches
from peer_process import Peer

from kvcore.connectors import get_connector
from kvcore.connectors.mooncake import mooncake_unavailable_reason
from kvcore.connectors.nixl import nixl_unavailable_reason

PEER = Path(__file__).with_name("pull_peer.py")


@dataclass(frozen=True)
class Pull:
    """A pull connector as its tests use it."""

    #: The connector's registered name.
    name: str
    #: Why it cannot run here (``None``: it can).
    unavailable: Callable[[], str | None]
    #: Environment of a producer process: the library's log level.
    env: dict[str, str] = field(default_factory=dict)
    #: A consumer's ``connect_timeout_s``, and how long a test waits for a block or a process.
    wait_s: float = 30.0

    @property
    def needs(self) -> pytest.MarkDecorator:
        """Skips a test where the connector's library is not installed."""
        return pytest.mark.skipif(self.unavailable() is not None, reason=str(self.unavailable()))

    def consumer(self, port: int, **config):
        return get_connector(self.name, role="consumer", port=port,
                             **{"timeout_s": 5.0, "connect_timeout_s": self.wait_s, **config})

    @contextmanager
    def producer(self, **config) -> Iterator:
        with get_connector(self.name, role="producer", port=0, **config) as conn:
            yield conn

    @contextmanager
    def producer_process(self, scenario: str, seed: int, *, layout: str = "nhd",
                         cross: bool = False, dtype: str = "bf16",
                         device: str = "cpu") -> Iterator[Peer]:
        """``pull_peer.py`` running ``scenario``; on exit it is woken (a test may have stopped
        it), told to finish by closing its stdin, and killed if it does not."""
        peer = Peer(PEER, self.name, scenario, str(seed), layout, "1" if cross else "0", dtype,
                    device, env=self.env, timeout=2 * self.wait_s)
        try:
            yield peer
        finally:
            if peer.proc.poll() is None:
                try:
                    os.kill(peer.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                peer.proc.stdin.close()
                try:
                    peer.proc.wait(timeout=self.wait_s)
                except subprocess.TimeoutExpired:
                    peer.proc.kill()
                    peer.proc.wait(timeout=self.wait_s)

    def threads(self) -> list[str]:
        """The names of the connector's threads still alive."""
        return [t.name for t in threading.enumerate()
                if t.name.startswith(f"kvcore-{self.name}")]


NIXL = Pull("nixl", nixl_unavailable_reason, {"NIXL_LOG_LEVEL": "WARN"}, 30.0)
# Mooncake logs (glog) INFO lines to stderr unless told otherwise.
MOONCAKE = Pull("mooncake", mooncake_unavailable_reason, {"GLOG_minloglevel": "2"}, 20.0)
#: Both, as pytest parameters that skip where the library is missing.
PULLS = [pytest.param(pull, marks=pull.needs, id=pull.name) for pull in (NIXL, MOONCAKE)]


def round_trip_between_two_processes(pull: Pull, seed: int, *, layout: str, cross: bool,
                                     dtype: str = "bf16", dst: Sequence[int] = (0, 1, 2, 7),
                                     device: str = "cpu") -> None:
    """A producer process publishes blocks 3, 4, 5, 9 of a cache drawn from ``seed``; this
    process loads them into blocks ``dst`` of a fresh one on ``device``, bit-exactly, and
    nothing else changes."""
    dst = list(dst)
    with pull.producer_process("serve", seed, layout=layout, cross=cross, dtype=dtype,
                               device=device) as peer:
        port = peer.port()
        kv = make_caches(cross_layer=cross, dtype=dtype, layout=layout, device=device)
        before = block_bytes(kv, list(range(kv.num_blocks))).cpu()
        keys = keys_for(seed, 4)
        with pull.consumer(port, timeout_s=5.0 if device == "cpu" else 20.0) as conn:
            conn.register_kv_caches(kv)
            deadline = time.monotonic() + pull.wait_s
            while conn.lookup(keys) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert conn.lookup(keys) == 4
            # Blocks adjacent on both sides move as one run (one transfer).
            result = conn.load(keys, dst).wait(timeout=pull.wait_s)
            assert result.ok, result.failed
            assert result.succeeded == tuple(dst)
            assert result.num_bytes == 4 * conn.block_bytes
            assert peer.line() == "saved True 4 0"  # the confirmations released them
            assert conn.lookup(keys) == 0  # taken: published once, read once
        theirs = make_caches(cross_layer=cross, dtype=dtype, layout=layout, seed=seed)
        after = block_bytes(kv, list(range(kv.num_blocks))).cpu()
        assert torch.equal(after[dst], block_bytes(theirs, [3, 4, 5, 9]))
        untouched = [b for b in range(kv.num_blocks) if b not in dst]
        assert torch.equal(after[untouched], before[untouched])


def converting_between_two_processes(pull: Pull, seed: int, *, device: str = "cpu",
                                     in_place: bool) -> None:
    """A producer process publishes blocks 3, 4, 5, 9 (NHD, per layer, block size 4) of a
    cache drawn from ``seed``; this process loads them into 2 blocks of 8 tokens of an HND
    cross-layer cache on ``device``, in place from the producer's mapped cache
    (``in_place``: the same GPU) or READ into a staging buffer. Every token equals the
    producer's, every other block is untouched, and the save completes."""
    with pull.producer_process("serve", seed, layout="nhd", cross=False,
                               device=device) as peer:
        port = peer.port()
        bs = SIZES["block_size"]
        kv = make_caches(cross_layer=True, layout="hnd", block_size=2 * bs, device=device)
        before = block_bytes(kv, list(range(kv.num_blocks))).cpu()
        keys = keys_for(seed, 4)
        with pull.consumer(port, timeout_s=5.0 if device == "cpu" else 20.0) as conn:
            conn.register_kv_caches(kv)
            assert conn.converts_in_place is in_place, conn.in_place_reason
            deadline = time.monotonic() + pull.wait_s
            while conn.lookup(keys) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            result = conn.load(keys, [6, 1]).wait(timeout=pull.wait_s)
            assert result.ok, result.failed
            assert peer.line() == "saved True 4 0"  # the confirmations released them
            reason = conn.in_place_reason
        theirs = make_caches(cross_layer=False, layout="nhd", seed=seed)
        want = torch.stack([layer[[3, 4, 5, 9]].transpose(0, 1).flatten(1, 2)
                            for layer in theirs.layers])  # (L, 2, 16 tokens, H, D)
        got = torch.stack([layer[[6, 1]].cpu().transpose(0, 1).flatten(1, 2)
                           for layer in kv.layers])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        after = block_bytes(kv, list(range(kv.num_blocks))).cpu()
        untouched = [b for b in range(kv.num_blocks) if b not in (6, 1)]
        assert torch.equal(after[untouched], before[untouched])
    if not in_place and device == "cpu":
        assert "CPU memory of process" in reason and "another process cannot map" in reason
