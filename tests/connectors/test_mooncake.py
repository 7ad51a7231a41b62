"""The ``mooncake`` connector: a producer publishes blocks, consumers READ them through
Mooncake's transfer engine (TCP, DRAM caches, P2P handshake: no metadata server).

What it shares with ``nixl`` is tested on both in ``test_pull_connectors.py``; this module
holds what is Mooncake's own. Two-process tests run the producer as a real subprocess on
loopback (``pull_peer.py``); the rest pair connectors inside this process.
"""

from __future__ import annotations

import time

import pytest
from kv_helpers import keys_for, make_caches
from pull_cases import MOONCAKE
from pull_peer import LARGE

from kvcore.connectors import get_connector
from kvcore.connectors import mooncake as mooncake_module
from kvcore.connectors.mooncake import mooncake_unavailable_reason

needs_mooncake = MOONCAKE.needs
consumer, producer, producer_process = MOONCAKE.consumer, MOONCAKE.producer, \
    MOONCAKE.producer_process


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
def test_producer_killed_mid_read_fails_the_run_within_the_timeout(monkeypatch):
    seed, timeout_s = 6, 5.0
    with producer_process("large", seed, cross=True) as peer:
        port = peer.port()
        kv = make_caches(cross_layer=True, **LARGE)
        keys = keys_for(seed, 4)
        conn = consumer(port, timeout_s=timeout_s)
        try:
            conn.register_kv_caches(kv)
            while conn.lookup(keys) < 4:
                time.sleep(0.01)
            engine = conn._engine
            poll = engine.poll

            def poll_then_kill(run):  # the READ (32 MiB, one run) is in flight: kill now
                state = poll(run)
                if peer.proc.poll() is None:
                    peer.proc.kill()
                return state

            # (polled once the fetch answered: the producer leased the blocks, then died)
            monkeypatch.setattr(engine, "poll", poll_then_kill)
            started = time.monotonic()
            result = conn.load(keys, [0, 1, 2, 3]).wait(timeout=timeout_s + 5)
            assert sorted(result.failed) == [0, 1, 2, 3]
            assert "Mooncake READ from the producer failed: the transfer failed" in (
                result.failed[0])
            assert time.monotonic() - started < timeout_s + 1.5
        finally:
            conn.close()
        assert not MOONCAKE.threads()


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
def test_an_unreachable_producer_engine_is_a_clear_error_at_registration(monkeypatch):
    with producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        prod._producer.hello["engine"] = "127.0.0.1:1"  # nothing listens there
        conn = consumer(prod.port)
        with pytest.raises(ConnectionError, match=r"the producer's transfer engine at "
                                                  r"127\.0\.0\.1:1 did not answer a probe"):
            conn.register_kv_caches(make_caches(cross_layer=True))
        conn.close()
