"""The ``mooncake`` connector: a producer publishes blocks, consumers READ them through
Mooncake's transfer engine (TCP, DRAM caches, P2P handshake: no metadata server).

Two-process tests run the producer as a real subprocess on loopback (``pull_peer.py``); the
rest pair connectors inside this process, which runs the same protocol faster.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from kv_helpers import block_bytes, keys_for, make_caches
from peer_process import Peer
from pull_peer import LARGE

from kvcore import LayoutMismatchError
from kvcore.connectors import get_connector
from kvcore.connectors import mooncake as mooncake_module
from kvcore.connectors.mooncake import MooncakeConnector, mooncake_unavailable_reason

PEER = Path(__file__).with_name("pull_peer.py")
needs_mooncake = pytest.mark.skipif(mooncake_unavailable_reason() is not None,
                                    reason=str(mooncake_unavailable_reason()))


@contextmanager
def producer_process(scenario: str, seed: int, *, layout: str = "nhd", cross: bool = False,
                     dtype: str = "bf16") -> Iterator[Peer]:
    # Mooncake logs (glog) INFO lines to stderr unless told otherwise.
    peer = Peer(PEER, "mooncake", scenario, str(seed), layout, "1" if cross else "0", dtype,
                env={"GLOG_minloglevel": "2"}, timeout=30.0)
    try:
        yield peer
    finally:
        if peer.proc.poll() is None:
            peer.proc.stdin.close()
            try:
                peer.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                peer.proc.kill()
                peer.proc.wait(timeout=20)


def consumer(port: int, **config) -> MooncakeConnector:
    return get_connector("mooncake", role="consumer", port=port,
                         **{"timeout_s": 5.0, "connect_timeout_s": 20.0, **config})


@contextmanager
def producer(**config) -> Iterator[MooncakeConnector]:
    with get_connector("mooncake", role="producer", port=0, **config) as conn:
        yield conn


def mooncake_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvcore-mooncake")]


# -- arguments and availability ---------------------------------------------------------------


@pytest.mark.parametrize(("config", "match"), [
    ({"role": "server"}, "role='server' must be 'producer'"),
    ({"role": "consumer"}, "port=0 for a consumer"),
    ({"role": "producer", "timeout_s": 0}, "timeout_s=0 must be"),
    ({"role": "producer", "protocol": "udp"},
     r"protocol='udp' is not a Mooncake transport; use one of 'tcp', 'rdma'"),
    ({"role": "producer", "device_name": None}, "device_name must be a str"),
    ({"role": "producer", "engine_host": "0.0.0.0"},
     r"engine_host='0.0.0.0' must be an address peers reach"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_bad_arguments_are_named(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        get_connector("mooncake", **config)


def test_missing_mooncake_is_a_clear_reason(monkeypatch):
    monkeypatch.setattr(mooncake_module, "_MOONCAKE_MODULE", "kvcore_no_such_mooncake.engine")
    reason = mooncake_unavailable_reason()
    assert "pip install 'kvcore[mooncake]'" in reason and "kvcore_no_such_mooncake" in reason
    with pytest.raises(RuntimeError, match=r"the mooncake connector is unavailable: Mooncake's "
                                           r"transfer engine is not importable"):
        get_connector("mooncake", role="producer")


def test_a_missing_rdma_library_names_the_system_package(monkeypatch):
    def broken(name):
        raise ImportError("libibverbs.so.1: cannot open shared object file")

    monkeypatch.setattr(mooncake_module.importlib, "import_module", broken)
    assert "apt-get install libibverbs1" in mooncake_unavailable_reason()


# -- two processes ----------------------------------------------------------------------------


@needs_mooncake
@pytest.mark.parametrize(("layout", "cross", "dtype", "dst"), [
    ("nhd", True, "fp8", [0, 1, 2, 7]),
    ("hnd", False, "bf16", [0, 1, 2, 7]),
    ("nhd", False, "fp16", [11, 0, 6, 5]),
], ids=["cross_layer-nhd-fp8", "per_layer-hnd-bf16", "per_layer-scattered-fp16"])
def test_round_trip_between_two_processes_is_bit_exact(layout, cross, dtype, dst):
    """A producer process publishes blocks 3, 4, 5, 9 of a cache drawn from a seed; this
    process loads them into ``dst`` of a fresh one, bit-exactly, and nothing else changes."""
    seed = 11
    with producer_process("serve", seed, layout=layout, cross=cross, dtype=dtype) as peer:
        port = peer.port()
        kv = make_caches(cross_layer=cross, dtype=dtype, layout=layout)  # fresh random data
        before = block_bytes(kv, list(range(kv.num_blocks)))
        keys = keys_for(seed, 4)
        with consumer(port) as conn:
            conn.register_kv_caches(kv)
            deadline = time.monotonic() + 20
            while conn.lookup(keys) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert conn.lookup(keys) == 4
            result = conn.load(keys, dst).wait(timeout=20)
            assert result.ok, result.failed
            assert result.succeeded == tuple(dst)
            assert result.num_bytes == 4 * conn.block_bytes
            assert peer.line() == "saved True 4 0"  # the confirmations released them
            assert conn.lookup(keys) == 0  # taken: published once, read once
        theirs = make_caches(cross_layer=cross, dtype=dtype, layout=layout, seed=seed)
        after = block_bytes(kv, list(range(kv.num_blocks)))
        assert torch.equal(after[dst], block_bytes(theirs, [3, 4, 5, 9]))
        untouched = [b for b in range(kv.num_blocks) if b not in dst]
        assert torch.equal(after[untouched], before[untouched])


@needs_mooncake
def test_layout_mismatch_is_refused_before_any_byte_moves():
    with producer_process("serve", 3, layout="nhd") as peer:
        port = peer.port()
        kv = make_caches(cross_layer=False, layout="hnd")
        before = kv.storage.clone()
        conn = consumer(port)
        with pytest.raises(LayoutMismatchError, match=r"consumer .*producer 127\.0\.0\.1:"
                                                      r"\d+.*physical order"):
            conn.register_kv_caches(kv)
        conn.close()
        assert torch.equal(kv.storage.view(torch.uint8), before.view(torch.uint8))
        peer.proc.kill()  # (it would wait for a consumer until publish_timeout_s)
        assert "mooncake producer: refused consumer" in peer.proc.stderr.read()


@needs_mooncake
def test_dead_producer_fails_exactly_the_unread_blocks_within_the_timeout():
    seed, timeout_s = 5, 3.0
    with producer_process("partial", seed) as peer:
        port = peer.port()
        kv = make_caches(cross_layer=False)
        before = block_bytes(kv, list(range(kv.num_blocks)))
        keys = keys_for(seed, 4)
        conn = consumer(port, timeout_s=timeout_s)
        conn.register_kv_caches(kv)
        while conn.lookup(keys[:2]) < 2:
            time.sleep(0.01)
        assert conn.load(keys[:2], [0, 1]).wait(timeout=timeout_s + 5).ok
        assert peer.line() == "served"
        started = time.monotonic()
        handle = conn.load(keys[2:], [2, 3])  # never published: polls for them
        peer.proc.kill()
        result = handle.wait(timeout=timeout_s + 5)
        assert sorted(result.failed) == [2, 3] and not result.succeeded
        assert time.monotonic() - started < timeout_s + 1.5
        after = block_bytes(kv, list(range(kv.num_blocks)))
        assert torch.equal(after[[0, 1]], block_bytes(make_caches(cross_layer=False, seed=seed),
                                                      [3, 4]))
        assert torch.equal(after[2:], before[2:])  # nothing written
        started = time.monotonic()
        later = conn.load(keys[2:], [4, 5]).wait(timeout=timeout_s + 5)
        assert sorted(later.failed) == [4, 5]
        assert time.monotonic() - started < timeout_s + 1.5
        conn.close()
        assert not mooncake_threads()


@needs_mooncake
def test_producer_killed_mid_read_fails_the_run_within_the_timeout(monkeypatch):
    seed, timeout_s = 6, 5.0
    with producer_process("large", seed, cross=True) as peer:
        port = peer.port()
        kv = make_caches(cross_layer=True, **LARGE)
        keys = keys_for(seed, 4)
        conn = consumer(port, timeout_s=timeout_s)
        conn.register_kv_caches(kv)
        while conn.lookup(keys) < 4:
            time.sleep(0.01)
        engine = conn._engine
        start_read = engine.start_read

        def start_then_kill(*args):  # the READ (32 MiB, one run) is in flight: kill now
            start_read(*args)
            peer.proc.kill()

        monkeypatch.setattr(engine, "start_read", start_then_kill)
        started = time.monotonic()
        result = conn.load(keys, [0, 1, 2, 3]).wait(timeout=timeout_s + 5)
        assert sorted(result.failed) == [0, 1, 2, 3]
        assert "Mooncake READ from the producer failed: the transfer failed" in result.failed[0]
        assert time.monotonic() - started < timeout_s + 1.5
        conn.close()
        assert not mooncake_threads()


# -- in one process ---------------------------------------------------------------------------


@needs_mooncake
def test_a_consumer_that_never_reads_leaves_the_blocks_to_the_publish_timeout():
    with producer(publish_timeout_s=0.5) as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        keys = keys_for(1, 2)
        save = prod.save(keys, [1, 2])
        with consumer(prod.port) as idle:
            idle.register_kv_caches(make_caches(cross_layer=True))
            assert idle.lookup(keys) == 2  # it looks, never loads
            result = save.wait(timeout=5)
    assert sorted(result.failed) == [1, 2]
    assert "not read within publish_timeout_s=0.5: none of the 1 consumer(s) that connected " \
           "read it" in result.failed[1]


@needs_mooncake
def test_a_lease_nobody_confirms_is_published_again():
    kv_p, kv_c = make_caches(cross_layer=False), make_caches(cross_layer=False)
    keys = keys_for(4, 1)
    with producer() as prod, consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [8])
        # A consumer that took the block and froze before reading it.
        prod._producer.fetch("frozen-consumer", keys, lease_s=0.3)
        assert conn.lookup(keys) == 0
        deadline = time.monotonic() + 5
        while conn.lookup(keys) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert conn.load(keys, [2]).wait(timeout=10).ok
        assert save.wait(timeout=10).ok
    assert torch.equal(block_bytes(kv_c, [2]), block_bytes(kv_p, [8]))


@needs_mooncake
def test_an_unreachable_producer_engine_is_a_clear_error_at_registration(monkeypatch):
    with producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        prod._producer.hello["engine"] = "127.0.0.1:1"  # nothing listens there
        conn = consumer(prod.port)
        with pytest.raises(ConnectionError, match=r"the producer's transfer engine at "
                                                  r"127\.0\.0\.1:1 did not answer a probe"):
            conn.register_kv_caches(make_caches(cross_layer=True))
        conn.close()


@needs_mooncake
def test_in_process_dtype_mismatch_is_refused():
    with producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=False, dtype="bf16"))
        conn = consumer(prod.port)
        with pytest.raises(LayoutMismatchError, match="dtype"):
            conn.register_kv_caches(make_caches(cross_layer=False, dtype="fp16"))
        conn.close()


@needs_mooncake
def test_roles_that_do_not_apply_fail_per_block_with_the_reason():
    with producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        assert prod.lookup(keys_for(1, 2)) == 0
        loaded = prod.load(keys_for(1, 2), [0, 1]).wait()
        assert sorted(loaded.failed) == [0, 1] and "role='producer'" in loaded.failed[0]
        with consumer(prod.port) as conn:
            conn.register_kv_caches(make_caches(cross_layer=True))
            saved = conn.save(keys_for(2, 1), [4]).wait()
            assert saved.failed[4].startswith("role='consumer' only loads")
    assert not mooncake_threads()
