"""The ``nixl`` connector: a producer publishes blocks, consumers READ them through NIXL.

What it shares with ``mooncake`` is tested on both in ``test_pull_connectors.py``; this module
holds what is NIXL's own. Two-process tests run the producer as a real subprocess on loopback
(``pull_peer.py``) with DRAM caches; the rest pair connectors inside this process, which runs
the same protocol (sockets and NIXL agents) faster.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from kv_helpers import block_bytes, keys_for, make_caches
from pull_cases import (
    NIXL,
    PEER,
    converting_between_two_processes,
    round_trip_between_two_processes,
)

from kvcore.connectors import get_connector, pull_channel, pull_producer
from kvcore.connectors import nixl as nixl_module
from kvcore.connectors.nixl import nixl_unavailable_reason
from kvcore.connectors.pull_channel import recv_frame, send_frame

needs_nixl = NIXL.needs
consumer, producer, producer_process = NIXL.consumer, NIXL.producer, NIXL.producer_process


# -- arguments and availability ---------------------------------------------------------------


@pytest.mark.parametrize(("config", "match"), [
    ({"role": "server"}, "role='server' must be 'producer'"),
    ({"role": "consumer"}, "port=0 for a consumer"),
    ({"role": "producer", "port": 70000}, "port=70000 must be an int in 0..65535"),
    ({"role": "producer", "port": True}, "port=True"),
    ({"role": "producer", "timeout_s": float("nan")}, "timeout_s=nan must be a finite"),
    ({"role": "producer", "timeout_s": 0}, "timeout_s=0 must be"),
    ({"role": "producer", "connect_timeout_s": float("inf")}, "connect_timeout_s=inf"),
    ({"role": "producer", "publish_timeout_s": -1}, "publish_timeout_s=-1"),
    ({"role": "producer", "publish_timeout_s": True}, "publish_timeout_s=True"),
    ({"role": "producer", "max_lease_s": float("inf")}, "max_lease_s=inf must be a finite"),
    ({"role": "producer", "max_lease_s": 0}, "max_lease_s=0 must be"),
    ({"role": "producer", "readers": 0}, "readers=0 must be a positive int"),
    ({"role": "consumer", "port": 1, "staging_buffers": 3},
     r"staging_buffers=3 must be 2 \(the READ of one chunk overlaps"),
    ({"role": "producer", "backends": "UCX"}, "backends must be a non-empty list"),
    ({"role": "producer", "backends": []}, "backends must be a non-empty list"),
    ({"role": "producer", "host": ""}, "host must be a non-empty str"),
    ({"role": "producer", "backend_params": {"GDS": {}}},
     r"backend_params names \['GDS'\], which are not in backends=\['UCX'\]"),
    ({"role": "producer", "backend_params": {"UCX": {"num_workers": 2}}},
     "backend_params must map a backend name to a dict of str parameters"),
    ({"role": "producer", "ucx_tls": ""}, "ucx_tls='' must be a non-empty UCX_TLS string"),
    ({"role": "producer", "ucx_tls": "tcp", "backends": ["POSIX"]},
     r"ucx_tls='tcp' must be .* with 'UCX' in backends"),
    ({"role": "producer", "ucx_tls": "cuda_ipc,cuda_copy,sm,self"},
     r"ucx_tls='cuda_ipc,cuda_copy,sm,self' lists only transports without peer failure "
     r"handling .*_handling_mode 'peer' .* add tcp .*'ucx_error_handling_mode': 'none'"),
    ({"role": "producer", "ucx_tls": "sm", "backend_params": {"UCX": {
        "ucx_error_handling_mode": "peer"}}}, r"ucx_tls='sm' lists only transports"),
    ({"role": "producer", "progress_thread": "off"},
     r"progress_thread='off' must be True, False or None"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_bad_arguments_are_named(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        get_connector("nixl", **config)


def test_missing_nixl_is_a_clear_reason(monkeypatch):
    monkeypatch.setattr(nixl_module, "_NIXL_MODULES", ("kvcore_no_such_nixl._api",))
    reason = nixl_unavailable_reason()
    assert "pip install 'kvcore[nixl]'" in reason and "kvcore_no_such_nixl" in reason
    with pytest.raises(RuntimeError, match=r"the nixl connector is unavailable: NIXL's Python"):
        get_connector("nixl", role="producer")


# -- two processes ----------------------------------------------------------------------------


CONSUMER_WITHOUT_CLOSE = """
import sys
sys.path.insert(0, {helpers!r})
from kv_helpers import keys_for, make_caches
from kvcore.connectors import get_connector
conn = get_connector("nixl", role="consumer", port={port}, timeout_s=1.0)
conn.register_kv_caches(make_caches(cross_layer=True))
assert conn.load(keys_for(1, 2), [0, 1]).wait(timeout=10).ok
late = conn.load(keys_for(2, 1), [5]).wait(timeout=10)  # never published: times out
assert list(late.failed) == [5], late
print("ok", flush=True)
# no close(): the connector must still let the interpreter exit cleanly
"""


@needs_nixl
@pytest.mark.slow
def test_interpreter_exits_cleanly_without_close():
    with producer() as prod:
        kv = make_caches(cross_layer=True)
        prod.register_kv_caches(kv)
        save = prod.save(keys_for(1, 2), [3, 4])
        code = CONSUMER_WITHOUT_CLOSE.format(helpers=str(PEER.parent), port=prod.port)
        env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == "ok"
        assert save.wait(timeout=10).ok


# -- in one process ---------------------------------------------------------------------------


def test_never_connecting_producer_is_a_clear_error_within_the_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    conn = get_connector("nixl", role="consumer", port=port, connect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no producer answered at 127\.0\.0\.1:{port} "
                                              r"within connect_timeout_s=1\.0.*firewall"):
        conn.register_kv_caches(make_caches(cross_layer=True))
    assert time.monotonic() - started < 3
    conn.close()


def test_silent_server_is_a_clear_error_within_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        conn = get_connector("nixl", role="consumer", port=silent.getsockname()[1],
                             connect_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="did not complete the handshake within "
                                                  r"connect_timeout_s=1\.0"):
            conn.register_kv_caches(make_caches(cross_layer=True))
        assert time.monotonic() - started < 3
        conn.close()


@needs_nixl
def test_unread_blocks_are_released_after_publish_timeout():
    with producer(publish_timeout_s=0.5) as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        result = prod.save(keys_for(1, 2), [1, 2]).wait(timeout=5)
    assert sorted(result.failed) == [1, 2]
    assert "no consumer connected to 127.0.0.1" in result.failed[1]
    assert "publish_timeout_s=0.5" in result.failed[1]


@needs_nixl
def test_closing_the_producer_fails_what_nobody_read():
    prod = get_connector("nixl", role="producer", port=0)
    prod.register_kv_caches(make_caches(cross_layer=True))
    handle = prod.save(keys_for(3, 2), [0, 1])
    prod.close()
    result = handle.wait(timeout=5)
    assert sorted(result.failed) == [0, 1]
    assert "closed before a consumer read it" in result.failed[0]


def raw_frame(body: bytes) -> bytes:
    """A side-channel frame around ``body`` (any bytes), with no tail."""
    return len(body).to_bytes(4, "big") + bytes(4) + body


def raw_consumer(port: int, hello: dict | bytes) -> tuple[socket.socket, dict]:
    """A consumer speaking the side-channel protocol by hand: its socket and the answer to
    its hello (``bytes``: a raw frame body)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if isinstance(hello, bytes):
        sock.sendall(raw_frame(hello))
    else:
        send_frame(sock, {"op": "hello", "protocol": "kvcore-nixl-v3",
                          "agent": "raw-consumer", **hello})
    return sock, recv_frame(sock)


def request(sock: socket.socket, message: dict) -> dict:
    send_frame(sock, message)
    return recv_frame(sock)


@needs_nixl
def test_leases_are_bounded_by_the_producer_and_end_when_the_connection_closes():
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(11, 2)
    with producer(max_lease_s=30.0) as prod, consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [3, 4])
        sock, hello = raw_consumer(prod.port, {"layout": kv_c.layout.to_dict()})
        try:
            assert hello["ok"] and hello["max_lease_s"] == 30.0
            refused = request(sock, {"op": "fetch", "keys": keys, "lease_s": 1e9})
            assert not refused["ok"]
            assert "lease_s=1000000000.0 is longer than this producer's max_lease_s=30.0" in (
                refused["error"])
            taken = request(sock, {"op": "fetch", "keys": keys, "lease_s": 30.0})
            # Each key's block, then its publication's serial.
            blocks_and_serials = pull_channel.unpack_blocks(taken["tail"])
            assert taken["ok"] and blocks_and_serials[:2] == [3, 4]
            assert min(blocks_and_serials[2:]) > 0 and len(set(blocks_and_serials[2:])) == 2
            assert conn.lookup(keys) == 0  # leased to the raw consumer, which never READs
        finally:
            sock.close()  # what a killed consumer's kernel does
        deadline = time.monotonic() + 5
        while conn.lookup(keys) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert conn.lookup(keys) == 2  # published again at once, not after 30 s
        assert conn.load(keys, [0, 1]).wait(timeout=10).ok
        assert save.wait(timeout=10).ok
    assert torch.equal(block_bytes(kv_c, [0, 1]), block_bytes(kv_p, [3, 4]))


@needs_nixl
def test_a_read_that_finishes_after_the_link_went_down_is_not_counted(monkeypatch):
    """The producer ends a closed connection's leases, so it may hand those blocks on while
    the READ runs: a READ seen finished only after the link went down fails its blocks."""
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(12, 1)
    with producer() as prod, consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        prod.save(keys, [3])
        agent = conn._engine.agent
        real = agent.check_xfer_state

        def check(handle):
            state = real(handle)
            if state == "DONE":
                conn._consumer.disconnect()  # the link is lost while the READ runs
            return state

        monkeypatch.setattr(agent, "check_xfer_state", check)
        result = conn.load(keys, [0]).wait(timeout=10)
    assert list(result.failed) == [0]
    assert "the READ finished after the link went down" in result.failed[0]


@needs_nixl
def test_a_consumer_closing_right_after_its_last_load_completes_the_save(monkeypatch):
    """A consumer closes at once after its loads; the producer sees the connection close
    before its notification loop fetched the READ's notification. The blocks were read and
    the consumer counted them, so the save is done (not published again until
    publish_timeout_s)."""
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(14, 3)
    with producer(publish_timeout_s=600.0) as prod:
        prod.register_kv_caches(kv_p)
        save = prod.save(keys, [2, 3, 4])  # published before any consumer connects
        engine, producer_state = prod._producer.engine, prod._producer
        closed = threading.Event()
        real_notifications, real_release_link = engine.notifications, producer_state.release_link

        def late_notifications():  # the notification loop fetches only after the close
            if threading.current_thread().name.endswith("-notifs"):
                closed.wait(10)
            return real_notifications()

        def release_link(link):
            closed.set()
            real_release_link(link)

        monkeypatch.setattr(engine, "notifications", late_notifications)
        monkeypatch.setattr(producer_state, "release_link", release_link)
        with consumer(prod.port) as conn:
            conn.register_kv_caches(kv_c)
            assert conn.load(keys, [5, 6, 7]).wait(timeout=10).ok
        result = save.wait(timeout=5)  # TimeoutError when the READs went unnoticed
        assert result.ok and sorted(result.succeeded) == [2, 3, 4], result.failed
    assert torch.equal(block_bytes(kv_c, [5, 6, 7]), block_bytes(kv_p, [2, 3, 4]))


@needs_nixl
def test_a_read_notified_only_after_the_producer_handled_the_close_still_counts(monkeypatch):
    """The READ's notification reaches the producer after it handled the consumer's close (a
    notification and the side channel travel apart, and over a network the socket's close can
    come first): the closed connection's leases last CLOSED_LINK_GRACE_S longer, so the READ
    still completes the save."""
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(15, 3)
    with producer(publish_timeout_s=600.0) as prod:
        prod.register_kv_caches(kv_p)
        save = prod.save(keys, [2, 3, 4])
        _notify_after_close(monkeypatch, prod)
        with consumer(prod.port) as conn:
            conn.register_kv_caches(kv_c)
            assert conn.load(keys, [5, 6, 7]).wait(timeout=10).ok
        result = save.wait(timeout=5)  # TimeoutError when the lease ended with the close
        assert result.ok and sorted(result.succeeded) == [2, 3, 4], result.failed
    assert torch.equal(block_bytes(kv_c, [5, 6, 7]), block_bytes(kv_p, [2, 3, 4]))


def _notify_after_close(monkeypatch, prod) -> None:
    """Hold the producer's READ notifications back until it has handled a consumer's close
    (as when the side channel's close overtakes a notification)."""
    engine, state = prod._producer.engine, prod._producer
    released = threading.Event()
    real_notifications, real_release_link = engine.notifications, state.release_link

    def late_notifications():
        return real_notifications() if released.is_set() else []

    def release_link(link):
        real_release_link(link)
        released.set()

    monkeypatch.setattr(engine, "notifications", late_notifications)
    monkeypatch.setattr(state, "release_link", release_link)


def _collected(prod, count: int = 1) -> None:
    """Wait until the producer holds ``count`` READ notifications it has not counted yet."""
    deadline = time.monotonic() + 5
    while len(prod._producer.unsettled) < count:
        assert time.monotonic() < deadline, "the notification never arrived"
        time.sleep(0.002)


@needs_nixl
def test_notifications_are_counted_after_the_next_fetch_is_answered(monkeypatch):
    """A READ's notification is not counted when it arrives (the consumer's next fetch comes
    then) but right after the producer answered that fetch; without one, the notification
    loop counts it SETTLE_AFTER_S after it fetched it."""
    monkeypatch.setattr(pull_producer, "SETTLE_AFTER_S", 60.0)
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(16, 4)
    with producer() as prod, consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        engine = prod._producer.engine
        real_notifications = engine.notifications

        def notifications():  # the notification loop fetches none: the fetch's answer does
            if threading.current_thread().name.endswith("-notifs"):
                return []
            return real_notifications()

        monkeypatch.setattr(engine, "notifications", notifications)
        first, second = prod.save(keys[:2], [0, 1]), prod.save(keys[2:], [2, 3])
        assert conn.load(keys[:2], [4, 5]).wait(timeout=10).ok
        time.sleep(0.05)  # the notification arrives, and is not counted
        assert not first.done()
        assert conn.load(keys[2:], [6, 7]).wait(timeout=10).ok  # its fetch counts the first
        assert first.wait(timeout=5).ok
        monkeypatch.setattr(engine, "notifications", real_notifications)
        monkeypatch.setattr(pull_producer, "SETTLE_AFTER_S", 0.01)  # no fetch comes
        assert second.wait(timeout=5).ok
    assert torch.equal(block_bytes(kv_c, [4, 5, 6, 7]), block_bytes(kv_p, [0, 1, 2, 3]))


@needs_nixl
def test_a_notification_not_counted_yet_counts_before_its_lease_expires(monkeypatch):
    """A READ notified but not counted yet still counts when its lease runs out first: the
    save reports the blocks read, none is published again."""
    monkeypatch.setattr(pull_producer, "SETTLE_AFTER_S", 60.0)
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(17, 2)
    with producer(publish_timeout_s=600.0) as prod, \
            consumer(prod.port, timeout_s=0.5) as conn:  # a lease of 1 s
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [2, 3])
        assert conn.load(keys, [0, 1]).wait(timeout=10).ok
        _collected(prod)
        assert not save.done()
        result = save.wait(timeout=5)  # counted when the lease was due
        assert conn.lookup(keys) == 0  # read, not published again
    assert result.ok and sorted(result.succeeded) == [2, 3], result.failed
    assert torch.equal(block_bytes(kv_c, [0, 1]), block_bytes(kv_p, [2, 3]))


@needs_nixl
def test_a_notification_not_counted_yet_counts_when_the_producer_closes(monkeypatch):
    """The consumer left, its READ's notification arrived after the producer handled that
    (so closing its link did not count it), and the producer closes before SETTLE_AFTER_S:
    the READ counts, the save reports the blocks read rather than failed."""
    monkeypatch.setattr(pull_producer, "SETTLE_AFTER_S", 60.0)
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(19, 2)
    with producer(publish_timeout_s=600.0) as prod:
        prod.register_kv_caches(kv_p)
        save = prod.save(keys, [2, 3])
        _notify_after_close(monkeypatch, prod)
        with consumer(prod.port) as conn:
            conn.register_kv_caches(kv_c)
            assert conn.load(keys, [0, 1]).wait(timeout=10).ok
        _collected(prod)
        assert not save.done()
        prod.close()
        result = save.wait(timeout=5)
    assert result.ok and sorted(result.succeeded) == [2, 3], result.failed
    assert torch.equal(block_bytes(kv_c, [0, 1]), block_bytes(kv_p, [2, 3]))


@needs_nixl
def test_a_request_carries_its_keys_as_the_frame_tail_or_a_json_list():
    """The consumer sends keys as raw hex digits after the JSON (pull_channel.pack_keys); a
    JSON list is read too, and a tail that is not whole keys is refused with the reason. The
    answers to a lookup and a fetch name the blocks and their publications' serials the same
    way (pull_channel.pack_blocks; -1: none to take)."""
    kv = make_caches(cross_layer=True)
    keys = keys_for(18, 3)
    with producer() as prod:
        prod.register_kv_caches(kv)
        save = prod.save(keys, [1, 2, 3])
        sock, hello = raw_consumer(prod.port, {"layout": kv.layout.to_dict()})
        try:
            assert hello["ok"]
            # A lookup's answer names the hits' blocks, then their publications' serials.
            send_frame(sock, {"op": "lookup"}, pull_channel.pack_keys(keys))
            found = recv_frame(sock)
            assert found["ok"] and found["hits"] == 3
            serials = pull_channel.unpack_blocks(found["tail"])[3:]
            assert pull_channel.unpack_blocks(found["tail"])[:3] == [1, 2, 3]
            found = request(sock, {"op": "lookup", "keys": keys[:2]})
            assert found["hits"] == 2
            assert pull_channel.unpack_blocks(found["tail"]) == [1, 2, *serials[:2]]
            send_frame(sock, {"op": "fetch", "lease_s": 5.0}, pull_channel.pack_keys(keys)[:-1])
            refused = recv_frame(sock)
            assert not refused["ok"]
            assert "keys are 64 characters each; its tail has 191 bytes" in refused["error"]
            send_frame(sock, {"op": "fetch", "lease_s": 5.0}, pull_channel.pack_keys(keys))
            assert pull_channel.unpack_blocks(recv_frame(sock)["tail"]) == [1, 2, 3, *serials]
            send_frame(sock, {"op": "fetch", "lease_s": 5.0}, pull_channel.pack_keys(keys))
            assert pull_channel.unpack_blocks(recv_frame(sock)["tail"]) == [-1] * 6  # leased
        finally:
            sock.close()
        prod.close()
        assert not save.wait(timeout=5).ok  # leased, never read


@needs_nixl
def test_a_consumer_needing_longer_leases_than_the_producer_grants_is_refused():
    with producer(max_lease_s=8.0) as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        conn = consumer(prod.port, timeout_s=5.0)
        with pytest.raises(ValueError, match=r"timeout_s=5\.0 needs leases of 10 s.*"
                                             r"max_lease_s=8\.0: lower timeout_s to 4"):
            conn.register_kv_caches(make_caches(cross_layer=True))
        conn.close()


@needs_nixl
@pytest.mark.parametrize("hello", [
    {"layout": "infinity"},
    b"[" * 100_000 + b"]" * 100_000,
    b'{"op": "hello", "layout": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b"Infinity",
], ids=["layout_with_infinity", "deep_frame", "deep_layout", "not_an_object"])
def test_a_malformed_hello_gets_a_refusal_and_the_producer_serves_on(hello):
    kv = make_caches(cross_layer=True)
    with producer() as prod:
        prod.register_kv_caches(kv)
        if hello == {"layout": "infinity"}:
            layout = kv.layout.to_dict()
            hello = {"layout": {**layout, "logical_shape": [float("inf"),
                                                            *layout["logical_shape"][1:]]}}
        sock, reply = raw_consumer(prod.port, hello)
        sock.close()
        assert reply["ok"] is False and reply["error"]
        sock, reply = raw_consumer(prod.port, {"layout": kv.layout.to_dict()})  # serves on
        try:
            assert reply["ok"]
            deep = b"[" * 100_000 + b"]" * 100_000  # and a request like that is refused too
            sock.sendall(raw_frame(deep))
            assert "refused" in recv_frame(sock)["error"]
        finally:
            sock.close()


@needs_nixl
def test_several_consumers_and_a_key_published_twice():
    kv_p = make_caches(cross_layer=True)
    keys = keys_for(7, 3)
    with producer() as prod:
        prod.register_kv_caches(kv_p)
        with consumer(prod.port) as c1, consumer(prod.port) as c2:
            kv1, kv2 = make_caches(cross_layer=True), make_caches(cross_layer=True)
            c1.register_kv_caches(kv1)
            c2.register_kv_caches(kv2)
            first = prod.save(keys, [0, 1, 2])
            second = prod.save(keys[:1], [5])  # same key, another block (same contents)
            assert c1.lookup(keys) == 3
            assert c1.load(keys, [6, 7, 8]).wait(timeout=10).ok
            assert c2.lookup(keys) == 1  # the second copy of keys[0] is still published
            assert c2.load(keys[:1], [3]).wait(timeout=10).ok
            assert first.wait(timeout=10).ok and second.wait(timeout=10).ok
            assert c2.lookup(keys) == 0
    assert torch.equal(block_bytes(kv1, [6, 7, 8]), block_bytes(kv_p, [0, 1, 2]))
    assert torch.equal(block_bytes(kv2, [3]), block_bytes(kv_p, [5]))
    assert not NIXL.threads()


@needs_nixl
def test_a_key_repeated_in_one_load_takes_two_publications():
    kv_p, kv_c = make_caches(cross_layer=False), make_caches(cross_layer=False)
    key = keys_for(9, 1)
    with producer() as prod, consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        saves = [prod.save(key, [2]), prod.save(key, [6])]
        result = conn.load(key * 2, [0, 1]).wait(timeout=10)
        assert result.succeeded == (0, 1)
        assert all(s.wait(timeout=10).ok for s in saves)
    assert torch.equal(block_bytes(kv_c, [0, 1]), block_bytes(kv_p, [2, 6]))


@needs_nixl
def test_ucx_transports_and_backend_params_reach_ucx_and_the_environment_is_restored(
        monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(11, 2)
    with producer(ucx_tls="tcp", backend_params={"UCX": {"num_workers": "2"}}) as prod, \
            consumer(prod.port, ucx_tls="tcp") as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [0, 1])
        assert conn.load(keys, [4, 5]).wait(timeout=10).ok and save.wait(timeout=10).ok
    assert torch.equal(block_bytes(kv_c, [4, 5]), block_bytes(kv_p, [0, 1]))
    assert "UCX_TLS" not in os.environ
    # UCX really reads it: a transport that does not exist leaves UCX nothing to use.
    bogus = get_connector("nixl", role="producer", ucx_tls="no_such_transport")
    with pytest.raises(RuntimeError, match=r"NIXL could not create backend UCX with parameters "
                       r"\{\} and UCX_TLS=no_such_transport"):
        bogus.register_kv_caches(make_caches(cross_layer=True))
    bogus.close()
    assert "UCX_TLS" not in os.environ


def _ucx_setting_at_backend_creation(monkeypatch, preset: str | None, device: str) -> list:
    """What ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` was while a producer on ``device`` created its
    NIXL backends (the variable preset to ``preset`` or unset); checks it is restored."""
    from kvcore.connectors import nixl as nixl_connector

    name = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    if preset is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, preset)
    agent_cls = nixl_connector._nixl_api().nixl_agent
    create_backend, seen = agent_cls.create_backend, []

    def spy(self, backend, params):
        seen.append((backend, os.environ.get(name)))
        return create_backend(self, backend, params)

    monkeypatch.setattr(agent_cls, "create_backend", spy)
    with producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=True, device=device))
    assert os.environ.get(name) == preset  # restored after the backend was created
    return seen


@needs_nixl
def test_ucx_cuda_defaults_stay_out_of_a_host_memory_cache(monkeypatch):
    # UCX warns of a CUDA variable it does not use; a DRAM cache gets none of them.
    assert _ucx_setting_at_backend_creation(monkeypatch, None, "cpu") == [("UCX", None)]


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", [None, "auto"], ids=["unset", "set-by-the-user"])
def test_ucx_cuda_defaults_apply_to_a_vram_cache_unless_the_environment_sets_them(
        monkeypatch, preset):
    from kvcore.connectors import nixl as nixl_connector

    assert nixl_connector.UCX_DEFAULTS == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    seen = _ucx_setting_at_backend_creation(monkeypatch, preset, "cuda")
    assert seen == [("UCX", preset or "y")]


class _RefusingAgent:
    """A stand-in NIXL agent whose UCX backend fails, recording the environment it saw."""

    seen: list[tuple[str | None, str | None]] = []

    def __init__(self, name, config):
        pass

    def get_plugin_list(self):
        return ["UCX"]

    def create_backend(self, backend, params):
        self.seen.append((os.environ.get("UCX_TLS"),
                          os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")))
        raise RuntimeError("no usable transport")


@pytest.mark.skipif(torch.version.hip is not None, reason="the CUDA defaults are for CUDA")
@pytest.mark.parametrize("is_cuda, preset, applied", [
    (True, None, "y"), (True, "auto", "auto"), (False, None, None)],
    ids=["vram-unset", "vram-set-by-the-user", "dram"])
def test_a_failed_ucx_backend_names_the_settings_it_was_created_with(monkeypatch, is_cuda,
                                                                      preset, applied):
    # Without NIXL: a stand-in agent checks which UCX_DEFAULTS reach UCX (a VRAM cache only,
    # unless the environment sets them), that the failure names them, and the restore.
    import types

    name = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    if preset is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, preset)
    monkeypatch.delenv("UCX_TLS", raising=False)
    api = types.SimpleNamespace(nixl_agent=_RefusingAgent, nixl_agent_config=lambda **kw: kw)
    monkeypatch.setattr(nixl_module, "_nixl_api", lambda: api)
    monkeypatch.setattr(_RefusingAgent, "seen", [])
    storage = types.SimpleNamespace(is_cuda=is_cuda)  # never registered: creation fails first
    expected = "UCX_TLS=tcp" + (f", {name}=y" if is_cuda and preset is None else "")
    with pytest.raises(RuntimeError, match=rf"NIXL could not create backend UCX with "
                                           rf"parameters \{{\}} and {expected}: no usable"):
        nixl_module._Agent("a", storage, ("UCX",), ucx_tls="tcp")
    assert _RefusingAgent.seen == [("tcp", applied)]
    assert os.environ.get(name) == preset and "UCX_TLS" not in os.environ


class _SlowReadAgent:
    """A stand-in NIXL agent whose READs report ``PROC`` until ``seconds`` after their post."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.checks, self.released, self.posted = seconds, 0, [], None

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, peer, notif):
        return object()

    def transfer(self, handle):
        self.posted = time.monotonic()
        return "PROC"

    def check_xfer_state(self, handle):
        self.checks += 1
        return "DONE" if time.monotonic() - self.posted >= self.seconds else "PROC"

    def release_xfer_handle(self, handle):
        self.released.append(handle)


def _slow_read_engine(mem_type: str, seconds: float):
    import threading

    from kvcore.connectors.pull_engine import Regions

    engine = object.__new__(nixl_module._Agent)  # no NIXL: only the READ calls are used
    engine.agent, engine.lock = _SlowReadAgent(seconds), threading.Lock()
    engine.mem_type = mem_type
    regions = Regions((0,), (64,), (64,), mem_type, 0)
    return engine, regions


def test_a_poll_checks_the_read_once():
    # How often to look again is the connector's (pull_reads.poll_pause), for every library.
    from kvcore.connectors.pull_engine import Run

    engine, regions = _slow_read_engine("VRAM", seconds=60.0)
    run = Run(0, 2, 0, 0)
    engine.start_read(run, "lease", regions, regions, "peer")
    assert engine.poll(run) == "PROC" and engine.agent.checks == 1
    assert engine.release(run) and run.handle is None


def test_a_read_in_flight_is_polled_with_pauses_of_a_fraction_of_its_time(monkeypatch):
    """A READ that takes 60 ms: the consumer pauses between polls as ``poll_pause`` says (a
    fraction of the time so far, never more than 5 ms), so it sees it finished soon after
    it did, in tens of polls; the timing hook hears of every poll and pause."""
    from types import SimpleNamespace

    from kvcore.connectors import pull_reads
    from kvcore.connectors.pull_engine import Run

    asked, schedule = [], pull_reads.poll_pause

    def recorded(elapsed_s):
        asked.append(elapsed_s)
        return schedule(elapsed_s)

    monkeypatch.setattr(pull_reads, "poll_pause", recorded)
    engine, regions = _slow_read_engine("DRAM", seconds=0.06)
    conn = object.__new__(nixl_module.NixlConnector)  # only what _read_runs reads
    conn._engine, conn.timeout_s = engine, 5.0
    conn._consumer = SimpleNamespace(regions=regions, remote="peer", failure=None)
    phases = []
    conn.timing = lambda phase, seconds: phases.append(phase)
    read, errors = conn._read_runs("lease", [Run(0, 2, 0, 0)], time.monotonic() + 5, regions)
    late = time.monotonic() - engine.agent.posted - 0.06
    assert read == [0, 1] and errors == {}
    assert asked == sorted(asked) and len(asked) == engine.agent.checks - 1
    assert 10 <= engine.agent.checks <= 80, engine.agent.checks
    assert late < 0.06 / 8 + 0.02, late  # (scheduling slack on a busy machine)
    assert phases.count("poll") == engine.agent.checks and phases.count("pause") == len(asked)
    assert set(phases) == {"start_read", "poll", "pause", "release"}


def test_poll_pauses_grow_with_the_time_a_read_took_within_bounds():
    from kvcore.connectors.pull import POLL_PAUSE_MAX_S, POLL_PAUSE_MIN_S, poll_pause

    assert poll_pause(0.0) == POLL_PAUSE_MIN_S == 20e-6
    assert poll_pause(0.001) == pytest.approx(0.001 / 8)
    assert poll_pause(10.0) == POLL_PAUSE_MAX_S == 0.005
    times = [i * 1e-4 for i in range(1000)]
    assert [poll_pause(t) for t in times] == sorted(poll_pause(t) for t in times)


@needs_nixl
def test_the_progress_thread_is_off_for_a_consumer_and_on_for_a_producer_by_default():
    assert get_connector("nixl", role="consumer", port=1).progress_thread is False
    assert get_connector("nixl", role="consumer", port=1,
                         progress_thread=True).progress_thread is True
    with get_connector("nixl", role="producer") as prod:
        assert prod.progress_thread is True


def test_shared_memory_transports_are_accepted_with_error_handling_off():
    from kvcore.connectors.nixl import _no_peer_failure_handling

    assert _no_peer_failure_handling("cuda_ipc,cuda_copy,sm,self")
    assert not _no_peer_failure_handling("cuda_ipc,cuda_copy,tcp")
    assert not _no_peer_failure_handling("^tcp")  # an exclusion list: UCX decides
    assert not _no_peer_failure_handling("sm,no_such_transport")  # unknown: UCX decides
    if nixl_unavailable_reason() is None:
        get_connector("nixl", role="producer", ucx_tls="cuda_ipc,cuda_copy,sm,self",
                      backend_params={"UCX": {"ucx_error_handling_mode": "none"}}).close()


@needs_nixl
def test_unknown_nixl_backend_is_refused_at_registration():
    conn = get_connector("nixl", role="producer", backends=["NO_SUCH_BACKEND"])
    with pytest.raises(ValueError, match=r"NIXL has no plugin for NO_SUCH_BACKEND "
                                         r"\(available: .*UCX"):
        conn.register_kv_caches(make_caches(cross_layer=True))
    conn.close()


@needs_nixl
def test_a_consumer_in_another_process_reads_a_dram_cache_through_nixl_to_convert():
    """A CPU producer in another process cannot be mapped: the consumer says why and
    converts through NIXL READs into its staging buffer, bit-exact."""
    converting_between_two_processes(NIXL, 22, in_place=False)


# -- GPU --------------------------------------------------------------------------------------


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cross", [True, False], ids=["cross_layer", "per_layer"])
def test_vram_round_trip_between_two_processes_on_one_gpu(cross):
    round_trip_between_two_processes(NIXL, 21, layout="nhd", cross=cross, device="cuda")


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_consumer_on_the_producers_gpu_converts_in_place_from_its_mapped_cache():
    """Block size 4 -> 8, NHD per layer -> HND cross-layer, two processes on one GPU: the
    consumer maps the producer's cache (CUDA IPC) and gathers from it, bit-exact."""
    converting_between_two_processes(NIXL, 23, device="cuda", in_place=True)


@pytest.mark.parametrize(("cuda", "first"), [("13.0", "nixl_cu13._api"), ("12.8", "nixl_cu12._api"),
                                             (None, "nixl._api")])
def test_the_nixl_build_matching_torchs_cuda_is_tried_first(monkeypatch, cuda, first):
    monkeypatch.setattr(nixl_module.torch.version, "cuda", cuda)
    order = nixl_module._nixl_module_order()
    assert order[0] == first and sorted(order) == sorted(nixl_module._NIXL_MODULES)
