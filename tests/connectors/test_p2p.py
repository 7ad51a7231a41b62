"""The ``p2p`` connector: blocks between two peers over torch.distributed (gloo on CPU).

Two-process tests run the peer (rank 1) as a real subprocess on loopback (``p2p_peer.py``);
the rest pair two connectors inside this process, which exercises the same protocol faster.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from kv_helpers import DTYPES, SIZES, block_bytes, keys_for, make_caches

import kvcore
from kvcore import KVCaches, LayoutMismatchError
from kvcore.connectors import get_connector
from kvcore.connectors import p2p as p2p_module
from kvcore.connectors.p2p import P2PConnector

PEER = Path(__file__).with_name("p2p_peer.py")
FROZEN = Path(__file__).with_name("p2p_frozen.py")


def bounded(call, limit_s: float):
    """Run ``call()`` on a daemon thread: its result, or what it raised; fails the test when
    it is still running after ``limit_s`` (a hang must not hang the suite)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still waiting after {limit_s} s"
    box["seconds"] = time.monotonic() - start
    return box


def p2p_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvcore-p2p")]


@contextmanager
def peer_process(scenario: str, port: int, seed: int, *, layout: str = "nhd",
                 cross: bool = False, dtype: str = "bf16", device: str = "cpu",
                 sizes: dict | None = None, options: dict | None = None
                 ) -> Iterator[subprocess.Popen]:
    """``p2p_peer.py`` (rank 1); ``sizes`` replace its cache's, ``options`` go to its
    connector."""
    proc = subprocess.Popen(
        [sys.executable, str(PEER), scenario, str(port), str(seed), layout,
         "1" if cross else "0", dtype, device, json.dumps(sizes or {}),
         json.dumps(options or {})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


@contextmanager
def pair(kv0: KVCaches, kv1: KVCaches, *, tp=(None, None), **config
         ) -> Iterator[tuple[P2PConnector, P2PConnector]]:
    """Rank 0 and rank 1 connectors in this process, registered concurrently; ``tp``: each
    rank's ``(degree, rank)``."""
    config = {"timeout_s": 5.0, "connect_timeout_s": 10.0, **config}
    c0 = get_connector("p2p", rank=0, tp=tp[0], **config)
    c1 = get_connector("p2p", rank=1, port=c0.port, tp=tp[1], **config)
    errors: list[BaseException] = []

    def register_peer() -> None:
        try:
            c1.register_kv_caches(kv1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=register_peer)
    thread.start()
    try:
        try:
            c0.register_kv_caches(kv0)
        finally:
            thread.join(30)
        if errors:
            raise errors[0]
        yield c0, c1
    finally:
        c1.close()
        c0.close()


# -- two processes ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "ipc"])
@pytest.mark.parametrize(("cross", "dtype"), [(False, "fp16"), (True, "fp8")],
                         ids=["per_layer-fp16", "cross_layer-fp8"])
def test_two_processes_exchange_blocks_bit_exact(cross, dtype, backend):
    seed = random.randrange(2**31)  # the peer's cache is random from this seed
    kv = make_caches(cross_layer=cross, dtype=dtype)
    sent = block_bytes(kv, [2, 9])
    with get_connector("p2p", rank=0, timeout_s=10.0, connect_timeout_s=30.0,
                       data_backend=backend) as conn, \
            peer_process("echo", conn.port, seed, cross=cross, dtype=dtype,
                         options={"data_backend": backend}) as proc:
        conn.register_kv_caches(kv)
        assert conn.transport == ("gloo" if backend == "auto" else "ipc")
        assert conn.save(keys_for(seed, 2), [2, 9]).wait(timeout=10).ok

        theirs = conn.load(keys_for(seed + 1, 2), [4, 1]).wait(timeout=10)
        assert theirs.succeeded == (4, 1) and not theirs.failed
        peer_cache = make_caches(cross_layer=cross, dtype=dtype, seed=seed)
        assert torch.equal(block_bytes(kv, [4, 1]), block_bytes(peer_cache, [3, 7]))

        echoed = conn.load(keys_for(seed + 2, 2), [10, 11]).wait(timeout=10)
        assert echoed.ok
        assert torch.equal(block_bytes(kv, [10, 11]), sent)
        out, err = proc.communicate(timeout=30)
        assert (proc.returncode, out.strip()) == (0, "ok"), err


def test_two_processes_refuse_mla_vs_kv_naming_both_sides():
    """NHD against HND converts (test_convert_connectors.py); an MLA latent cache against a K/V
    cache cannot, and both sides say so at registration."""
    kv = make_caches(cross_layer=False, layout="nhd")
    with get_connector("p2p", rank=0, connect_timeout_s=30.0) as conn, \
            peer_process("mismatch", conn.port, 1, layout="mla") as proc:
        with pytest.raises(LayoutMismatchError) as info:
            conn.register_kv_caches(kv)
        out, err = proc.communicate(timeout=30)
    ours = str(info.value)
    assert "local rank 0 cannot load from remote rank 1" in ours
    assert "an MLA latent cache and a K/V cache" in ours
    assert proc.returncode == 3, err
    assert "an MLA latent cache and a K/V cache" in out and "local rank 1" in out


@pytest.mark.parametrize("backend", ["auto", "ipc"])
def test_killed_peer_process_fails_exactly_the_blocks_and_never_hangs(backend):
    kv = make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 3)
    with get_connector("p2p", rank=0, timeout_s=1.0, connect_timeout_s=30.0,
                       data_backend=backend) as conn, \
            peer_process("idle", conn.port, 2, options={"data_backend": backend}) as proc:
        conn.register_kv_caches(kv)
        assert proc.stdout.readline().strip() == "ok"

        # Alive but silent: a timeout, and the link stays up.
        late = conn.load(keys, [0, 1, 2]).wait(timeout=10)
        assert late.succeeded == () and set(late.failed) == {0, 1, 2}
        assert all("within timeout_s=1.0" in why for why in late.failed.values())

        proc.kill()
        proc.wait(10)
        for _ in range(5):  # the death is noticed when the socket closes, normally at once
            dead = conn.load(keys[:2], [3, 4]).wait(timeout=10)
            if "within timeout_s" not in dead.failed[3]:
                break
        assert set(dead.failed) == {3, 4} and dead.succeeded == ()
        assert "receiving from peer rank 1 failed" in dead.failed[3]

        start = time.monotonic()
        unsent = conn.save(keys, [5, 6, 7]).wait(timeout=10)
        assert set(unsent.failed) == {5, 6, 7} and unsent.succeeded == ()
        assert time.monotonic() - start < 1.0  # the link is known down: no waiting


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "ipc"])
@pytest.mark.parametrize("scenario", ["send", "idle"],
                         ids=["after_a_send_timed_out", "bye_unanswered"])
def test_close_against_a_frozen_peer_is_bounded_and_the_process_exits_cleanly(scenario,
                                                                               backend):
    proc = subprocess.Popen([sys.executable, str(FROZEN), scenario, backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=FROZEN.parent)
    peer_pid = None
    try:
        peer_pid = json.loads(proc.stdout.readline())["peer_pid"]
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if peer_pid is not None:
            with contextlib.suppress(ProcessLookupError):  # killed by the driver normally
                os.kill(peer_pid, signal.SIGKILL)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {err[-2000:]}"
    report = json.loads(out.splitlines()[-1])
    if scenario == "send":
        assert report["failed"] == 512 and "Timed out" in report["reason"]
    assert report["close_s"] < 10.0  # timeout_s=1.0 twice at most, with a margin
    assert report["threads"] == []


def test_rank0_without_a_peer_fails_within_connect_timeout():
    conn = get_connector("p2p", rank=0, connect_timeout_s=1.0, timeout_s=1.0)
    try:
        box = bounded(lambda: conn.register_kv_caches(make_caches(cross_layer=False)), 30)
    finally:
        conn.close()
    assert isinstance(box.get("error"), ConnectionError)
    assert "peer rank 1 did not join" in str(box["error"])
    assert "within connect_timeout_s=1.0" in str(box["error"])
    assert box["seconds"] < 10.0
    assert p2p_threads() == []


def test_rank1_whose_rank0_never_registers_fails_within_connect_timeout():
    host = get_connector("p2p", rank=0, connect_timeout_s=1.0)  # listens, never registers
    conn = get_connector("p2p", rank=1, port=host.port, connect_timeout_s=1.0, timeout_s=1.0)
    try:
        box = bounded(lambda: conn.register_kv_caches(make_caches(cross_layer=False)), 30)
    finally:
        conn.close()
        host.close()
    assert isinstance(box.get("error"), ConnectionError)
    assert "peer rank 0 did not join" in str(box["error"])
    assert "within connect_timeout_s=1.0" in str(box["error"])
    assert box["seconds"] < 10.0


def test_port_that_accepts_but_never_answers_fails_within_connect_timeout():
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    try:
        box = bounded(lambda: get_connector("p2p", rank=1, port=server.getsockname()[1],
                                            connect_timeout_s=1.0), 30)
    finally:
        for sock in (*accepted, server):
            sock.close()
    assert isinstance(box.get("error"), ConnectionError)
    assert "did not answer the rendezvous handshake within connect_timeout_s=1.0" in str(
        box["error"])
    assert box["seconds"] < 10.0
    time.sleep(0.2)  # the connecting thread ends when its socket is shut down
    assert [t for t in threading.enumerate() if t.name == "kvcore-p2p-connect"] == []


def test_a_closed_port_is_not_reported_as_one_that_accepted():
    """Nothing listens at the port: the message says so (not that something accepted the
    connection and then kept silent)."""
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    box = bounded(lambda: get_connector("p2p", rank=1, port=port, connect_timeout_s=1.0), 30)
    assert isinstance(box.get("error"), ConnectionError)
    message = str(box["error"])
    assert "accepted" not in message.replace("nothing accepted", "")
    assert (f"nothing accepted a connection at 127.0.0.1:{port} within connect_timeout_s=1.0; "
            "start rank 0 first" in message) or "no rendezvous at" in message, message
    assert box["seconds"] < 10.0


def test_giving_up_on_a_silent_rendezvous_leaves_other_sockets_to_its_port_alone():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    box: dict = {}
    connecting = threading.Thread(target=lambda: box.update(bounded(
        lambda: get_connector("p2p", rank=1, port=port, connect_timeout_s=1.5), 30)))
    connecting.start()
    time.sleep(0.5)  # opened while rank 1 waits: another user of the same host and port
    other = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        connecting.join(30)
        assert isinstance(box.get("error"), ConnectionError)
        other.sendall(b"still open")  # a shut-down socket raises BrokenPipeError here
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            received = []
            for sock in list(accepted):
                sock.settimeout(0.05)
                with contextlib.suppress(OSError):
                    received.append(sock.recv(64))
            if b"still open" in received:
                break
        assert b"still open" in received
    finally:
        for sock in (other, *accepted, server):
            sock.close()


# -- a pair in one process --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_blocks_arrive_bit_exact_in_other_block_ids(cross, dtype):
    kv0, kv1 = make_caches(cross_layer=cross, dtype=dtype), make_caches(cross_layer=cross,
                                                                       dtype=dtype)
    keys = keys_for(random.randrange(2**31), 4)
    untouched = block_bytes(kv1, [0, 1, 2])
    with pair(kv0, kv1) as (c0, c1):
        assert c0.save(keys, [8, 3, 5, 11]).wait(timeout=5).ok
        result = c1.load(keys, [9, 4, 10, 6]).wait(timeout=5)
        assert result.succeeded == (9, 4, 10, 6) and result.num_bytes == 4 * c1.block_bytes
    assert torch.equal(block_bytes(kv1, [9, 4, 10, 6]), block_bytes(kv0, [8, 3, 5, 11]))
    assert torch.equal(block_bytes(kv1, [0, 1, 2]), untouched)


@pytest.mark.parametrize(
    ("theirs", "difference"),
    [({"cross_layer": False, "layout": "mla"}, "an MLA latent cache and a K/V cache"),
     ({"cross_layer": False, "dtype": "fp16"}, "dtype float16 vs bfloat16"),
     ({"cross_layer": False, "block_size": 6}, "block size (N) 6 vs 4: one must divide"),
     ({"cross_layer": False, "num_kv_heads": 3}, "KV heads (H) 3 vs 2")],
    ids=["mla", "dtype", "block_size", "heads"])
def test_mismatched_peers_are_refused_before_any_block(theirs, difference):
    with pytest.raises(LayoutMismatchError, match="local rank 0.*remote rank 1") as info, \
            pair(make_caches(cross_layer=False), make_caches(**theirs)):
        pass
    assert difference in str(info.value)


def test_a_hello_whose_layout_cannot_be_read_is_a_layout_mismatch(monkeypatch):
    real = P2PConnector._hello

    def hello(self: P2PConnector) -> dict:
        message = real(self)
        if self.rank == 1:  # JSON Infinity where a size belongs
            shape = [float("inf"), *message["layout"]["logical_shape"][1:]]
            message["layout"] = {**message["layout"], "logical_shape": shape}
        return message

    monkeypatch.setattr(P2PConnector, "_hello", hello)
    with pytest.raises(LayoutMismatchError, match="remote rank 1 sent a layout this kvcore "
                                                  "cannot read .*logical_shape"), \
            pair(make_caches(cross_layer=False), make_caches(cross_layer=False)):
        pass


def test_silent_peer_times_out_then_late_blocks_still_load():
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 2)
    with pair(kv0, kv1, timeout_s=0.3) as (c0, c1):
        late = c1.load(keys, [0, 1]).wait(timeout=5)
        assert set(late.failed) == {0, 1}
        assert c0.save(keys, [4, 5]).wait(timeout=5).ok
        assert c1.load(keys, [0, 1]).wait(timeout=5).ok
    assert torch.equal(block_bytes(kv1, [0, 1]), block_bytes(kv0, [4, 5]))


def test_partial_arrival_loads_what_came_and_fails_the_rest():
    kv0, kv1 = make_caches(cross_layer=False), make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 3)
    with pair(kv0, kv1, timeout_s=0.3) as (c0, c1):
        assert c0.save(keys[:2], [1, 2]).wait(timeout=5).ok
        result = c1.load(keys, [5, 6, 7]).wait(timeout=5)
    assert result.succeeded == (5, 6) and set(result.failed) == {7}
    assert torch.equal(block_bytes(kv1, [5, 6]), block_bytes(kv0, [1, 2]))


@pytest.mark.parametrize(
    ("payload_blocks", "reason"),
    [(3, "carries 2304 bytes, expected 1536"),
     (10**6, "768000000-byte payload (limit 4608: inbox_bytes=4608")],
    ids=["size_disagrees_with_keys", "larger_than_inbox"])
def test_malformed_message_breaks_the_link_with_the_reason(payload_blocks, reason):
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 2)
    with pair(kv0, kv1, inbox_bytes=6 * kv0.num_layers * kv0.page_size_bytes,
              timeout_s=0.5) as (c0, c1):
        # What a buggy peer would send for 2 keys: sizes, then (if the sizes pass) the
        # header; the receiver must refuse before allocating or receiving the payload.
        header = json.dumps({"op": "blocks", "keys": keys}).encode()
        sizes = torch.tensor([len(header), payload_blocks * c0.block_bytes])
        c0._tx_ctrl.send([sizes], 1, 0).wait()
        if payload_blocks * c0.block_bytes <= c1.inbox_bytes:
            c0._tx_ctrl.send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], 1,
                             0).wait()
        result = c1.load(keys, [0, 1]).wait(timeout=5)
        assert set(result.failed) == {0, 1}
        assert reason in result.failed[0]
        # The refusing side closed the link: the sender learns it, and does not hang.
        start = time.monotonic()
        assert set(c0.save(keys, [0, 1]).wait(timeout=5).failed) == {0, 1}
        assert time.monotonic() - start < 2.0


def held_bytes(conn: P2PConnector) -> int:
    """Bytes of memory the inbox's entries keep alive: every distinct storage reachable from
    them, whole (a row view keeps all of its storage)."""
    storages: dict[int, int] = {}

    def visit(obj) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item)
        elif hasattr(obj, "__slots__"):
            for name in obj.__slots__:
                visit(getattr(obj, name, None))

    with conn._cond:
        visit(list(conn._inbox.values()))
    return sum(storages.values())


def test_inbox_bytes_bounds_the_memory_of_partly_loaded_messages():
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    block = kv0.num_layers * kv0.page_size_bytes
    keys = keys_for(random.randrange(2**31), 24)
    held = []
    with pair(kv0, kv1, inbox_bytes=8 * block, timeout_s=5.0) as (c0, c1):
        for m in range(6):  # 6 messages of 4 blocks; the receiver loads 3 of each
            four = keys[4 * m:4 * m + 4]
            assert c0.save(four, [(2 * m + i) % 12 for i in range(4)]).wait(timeout=10).ok
            assert c1.load(four[:3], [4, 5, 6]).wait(timeout=10).ok
            held.append(held_bytes(c1))
        assert max(held) <= 8 * block  # one unloaded row per message used to hold them all
        assert c1.inbox_held_bytes == held_bytes(c1)
        left = [keys[4 * m + 3] for m in range(6)]
        # 8 blocks fit: the 5 latest stragglers (and then the 4 of message 6)
        assert [c1.lookup([k]) for k in left] == [0, 1, 1, 1, 1, 1]
        assert c1.stats.evictions == 1
        result = c1.load(left[1:], [7, 8, 9, 10, 11]).wait(timeout=10)  # copied, still exact
        assert result.ok and c1.inbox_held_bytes == 0
    assert torch.equal(block_bytes(kv1, [7, 8, 9, 10, 11]), block_bytes(kv0, [5, 7, 9, 11, 1]))


def test_a_key_repeated_in_one_message_keeps_its_last_row_and_the_count_exact():
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    (key,) = keys_for(random.randrange(2**31), 1)
    with pair(kv0, kv1) as (c0, c1):
        rows = c0._read_blocks([2, 3])
        c0._send_message({"op": "blocks", "keys": [key, key]}, rows)  # what a buggy peer sends
        assert c1.load([key], [9]).wait(timeout=10).ok
        assert c1.inbox_held_bytes == 0 and held_bytes(c1) == 0
    assert torch.equal(block_bytes(kv1, [9]), block_bytes(kv0, [3]))


def test_a_second_hello_with_another_layout_breaks_the_link():
    kv0, kv1 = make_caches(cross_layer=False), make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 4)
    hnd = make_caches(cross_layer=False, layout="hnd").layout.to_dict()
    with pair(kv0, kv1, timeout_s=1.0) as (c0, c1):
        c0._send_message(c0._hello(), None)  # the same hello again: harmless
        assert c0.save(keys[:2], [1, 2]).wait(timeout=10).ok
        assert c1.load(keys[:1], [5]).wait(timeout=10).ok
        c0._send_message({**c0._hello(), "layout": hnd}, None)
        deadline = time.monotonic() + 10
        while c1.lookup(keys[1:2]) and time.monotonic() < deadline:
            time.sleep(0.01)  # the receiver handles the hello a moment after it is sent
        refused = c1.load(keys[1:2], [6]).wait(timeout=10)
        assert set(refused.failed) == {6}  # received under the old layout: dropped too
        why = refused.failed[6]
        assert "peer rank 0 announced another layout after registration, refused" in why
        assert "L,B,2,N,H,D vs L,B,2,H,N,D" in why
        assert set(c1.save(keys[2:], [7, 8]).wait(timeout=10).failed) == {7, 8}
        assert set(c0.save(keys[2:], [7, 8]).wait(timeout=10).failed) == {7, 8}


def test_full_inbox_drops_the_oldest_blocks():
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 3)
    with pair(kv0, kv1, inbox_bytes=2 * kv0.num_layers * kv0.page_size_bytes,
              timeout_s=0.3) as (c0, c1):
        assert c0.save(keys, [0, 1, 2]).wait(timeout=5).ok
        result = c1.load(keys, [3, 4, 5]).wait(timeout=5)
        assert result.succeeded == (4, 5) and set(result.failed) == {3}
        assert c1.stats.evictions == 1


def test_lookup_counts_leading_arrived_keys():
    kv0, kv1 = make_caches(cross_layer=False), make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 3)
    with pair(kv0, kv1) as (c0, c1):
        assert c0.save([keys[0], keys[2]], [1, 2]).wait(timeout=5).ok
        deadline = time.monotonic() + 5
        while c1.lookup(keys[2:]) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # a completed send is in the peer's inbox a moment later
        assert c1.lookup(keys) == 1
        assert c1.lookup([keys[0], keys[2]]) == 2


def test_closed_peer_fails_transfers_at_once():
    kv0, kv1 = make_caches(cross_layer=False), make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 2)
    with pair(kv0, kv1, timeout_s=5.0) as (c0, c1):
        c1.close()
        start = time.monotonic()
        loaded = c0.load(keys, [0, 1]).wait(timeout=5)
        saved = c0.save(keys, [2, 3]).wait(timeout=5)
        assert time.monotonic() - start < 2.0
    assert loaded.failed == {0: "peer rank 1 closed the connection",
                             1: "peer rank 1 closed the connection"}
    assert set(saved.failed) == {2, 3}


@pytest.mark.parametrize(
    ("config", "message"),
    [({"rank": 2}, "rank=2 must be 0"),
     ({"rank": 1, "port": 0}, "port=0 on rank 1"),
     ({"rank": 0, "timeout_s": 0}, "timeout_s=0 must be a positive finite number"),
     ({"rank": 0, "timeout_s": -1.5}, "timeout_s=-1.5 must be a positive finite number"),
     ({"rank": 0, "timeout_s": float("nan")}, "timeout_s=nan must be a positive finite"),
     ({"rank": 0, "timeout_s": True}, "timeout_s=True must be a positive finite"),
     ({"rank": 0, "connect_timeout_s": float("inf")},
      r"connect_timeout_s=inf must be a positive finite number of seconds, at most 31536000"),
     ({"rank": 0, "connect_timeout_s": 1e9}, "connect_timeout_s=1000000000.0 must be"),
     ({"rank": 0, "inbox_bytes": 0}, "inbox_bytes=0 must be a positive int"),
     ({"rank": 0, "data_backend": "mpi"}, "data_backend='mpi'")],
    ids=["rank", "port", "timeout", "negative_timeout", "nan_timeout", "bool_timeout",
         "inf_connect_timeout", "huge_connect_timeout", "inbox", "backend"])
def test_bad_config_names_the_option(config, message):
    with pytest.raises(ValueError, match=message):
        get_connector("p2p", **config)


# -- ipc: block bytes through staging slots both processes map --------------------------------


def logical_tokens(kv: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """``(layers, 2, tokens, heads, dim)`` bytes of the tokens ``block_ids`` hold in order,
    through the logical views (comparable across block sizes and orders)."""
    idx = torch.tensor(block_ids, device=kv.storage.device)
    return torch.stack([layer.index_select(0, idx).transpose(0, 1).flatten(1, 2)
                        for layer in kv.layers]).contiguous().view(torch.uint8).cpu()


def shm_files() -> set[str]:
    """This process's staging-slot files in /dev/shm."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"kvcore-p2p-{os.getpid()}-")}


HND_CROSS = {"layout": "hnd", "cross": True}


@pytest.mark.parametrize(("peer", "device", "backend"), [
    (HND_CROSS, "cpu", "ipc"), ({"layout": "nhd"}, "cpu", "ipc"),
    pytest.param(HND_CROSS, "cuda:0", "ipc", marks=pytest.mark.gpu),
    pytest.param(HND_CROSS, "cuda:0", "auto", marks=pytest.mark.gpu)],
    ids=["4nhd<->16hnd-cross", "4nhd<->16nhd", "one_gpu-ipc", "one_gpu-auto"])
def test_two_processes_convert_over_ipc_bit_exact(peer, device, backend):
    """Blocks travel in the sender's layout through the slots; each side converts on load
    (block 4 <-> 16, NHD <-> HND and per-layer <-> cross-layer). On one GPU, ``"auto"``
    picks ``"ipc"`` (NCCL refuses two ranks on one device)."""
    seed = random.randrange(2**31)
    kv = make_caches(cross_layer=False, device=device)
    theirs = make_caches(cross_layer=peer.get("cross", False), layout=peer["layout"],
                         block_size=16, seed=seed)
    with get_connector("p2p", rank=0, timeout_s=10.0, connect_timeout_s=30.0,
                       data_backend=backend) as conn, \
            peer_process("echo", conn.port, seed, sizes={"block_size": 16}, device=device,
                         options={"data_backend": backend}, **peer) as proc:
        conn.register_kv_caches(kv)
        assert conn.transport == "ipc" and conn.plan is not None
        assert conn.blocks_for_keys(2) == 8
        sent = logical_tokens(kv, [2, 9])
        assert conn.save(keys_for(seed, 2), [2, 9]).wait(timeout=10).ok
        into = [0, 1, 3, 4, 5, 6, 7, 8]
        got = conn.load(keys_for(seed + 1, 2), into).wait(timeout=10)
        assert got.ok, got.failed
        assert torch.equal(logical_tokens(kv, into), logical_tokens(theirs, [3, 7]))
        # Our 8 tokens went into the peer's block 0 and came back: its first half.
        echoed = conn.load(keys_for(seed + 2, 1), [10, 11, 0, 1]).wait(timeout=10)
        assert echoed.ok, echoed.failed
        assert torch.equal(logical_tokens(kv, [10, 11]), sent)
        out, err = proc.communicate(timeout=30)
        assert (proc.returncode, out.strip()) == (0, "ok"), err


def test_a_save_waiting_for_slots_fails_within_the_timeout_when_the_peer_dies():
    """The peer is frozen: its slots fill and the save waits; killed, the save fails its
    pending blocks at once (not after timeout_s), and the blocks already handed over count as
    sent."""
    kv = make_caches(cross_layer=False)
    block = kv.num_layers * kv.page_size_bytes
    keys = keys_for(random.randrange(2**31), 8)
    with get_connector("p2p", rank=0, timeout_s=5.0, connect_timeout_s=30.0,
                       data_backend="ipc") as conn, \
            peer_process("idle", conn.port, 3, options={"data_backend": "ipc",
                                                        "inbox_bytes": block}) as proc:
        conn.register_kv_caches(kv)  # one block a message: the peer's inbox holds one
        assert proc.stdout.readline().strip() == "ok"
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        handle = conn.save(keys, list(range(8)))
        time.sleep(0.5)
        proc.kill()
        result = handle.wait(timeout=20)
        assert time.monotonic() - start < 4.0  # timeout_s=5.0: the death ended the wait
    assert len(result.succeeded) + len(result.failed) == 8 and len(result.failed) >= 5
    assert list(result.succeeded) == list(range(len(result.succeeded)))  # in order
    assert all("peer rank 1" in why for why in result.failed.values()), result.failed
    assert shm_files() == set() and p2p_threads() == []


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_ipc_pair_moves_blocks_bit_exact_and_leaves_nothing_behind(cross, dtype):
    kv0, kv1 = (make_caches(cross_layer=cross, dtype=dtype) for _ in range(2))
    keys = keys_for(random.randrange(2**31), 4)
    with pair(kv0, kv1, data_backend="ipc") as (c0, c1):
        assert (c0.transport, c1.transport) == ("ipc", "ipc")
        assert shm_files() == set()  # unlinked once the peer mapped them
        assert c0.save(keys, [8, 3, 5, 11]).wait(timeout=5).ok
        assert c1.load(keys, [9, 4, 10, 6]).wait(timeout=5).ok
        back = c1.save(keys[:2], [9, 4]).wait(timeout=5)  # the other way
        assert back.ok and c0.load(keys[:2], [0, 1]).wait(timeout=5).ok
    assert torch.equal(block_bytes(kv1, [9, 4, 10, 6]), block_bytes(kv0, [8, 3, 5, 11]))
    assert torch.equal(block_bytes(kv0, [0, 1]), block_bytes(kv1, [9, 4]))
    assert p2p_threads() == []


@pytest.mark.parametrize("case", [(4, "nhd", False, 16, "hnd", True),
                                  (16, "hnd", True, 4, "nhd", False),
                                  (4, "nhd", True, 4, "interleaved", False)],
                         ids=["4nhd->16hnd-cross", "16hnd-cross->4nhd", "nhd->interleaved"])
def test_ipc_receiver_converts_on_load(case):
    s_bs, s_layout, s_cross, r_bs, r_layout, r_cross = case
    src = make_caches(layout=s_layout, cross_layer=s_cross, block_size=s_bs)
    dst = make_caches(layout=r_layout, cross_layer=r_cross, block_size=r_bs)
    n = 8 if s_bs < r_bs else 2  # 32 tokens either way
    keys = keys_for(random.randrange(2**31), n, block_size=s_bs)
    src_ids = list(range(1, n + 1))
    with pair(src, dst, data_backend="ipc") as (sender, receiver):
        dst_ids = [11, 2, 7, 5, 0, 9, 3, 1][:receiver.blocks_for_keys(n)]
        assert sender.save(keys, src_ids).wait(timeout=5).ok
        result = receiver.load(keys, dst_ids).wait(timeout=5)
        assert result.ok, result.failed
    assert torch.equal(logical_tokens(dst, dst_ids), logical_tokens(src, src_ids))


@pytest.fixture
def small_messages(monkeypatch):
    """Messages of two blocks at most (the payload limit), so a save of many blocks is many
    messages through the two slots."""
    block = 3 * 2 * SIZES["block_size"] * SIZES["num_kv_heads"] * SIZES["head_size"] * 2
    monkeypatch.setattr(p2p_module, "_MAX_PAYLOAD_BYTES", 2 * block)
    return block


def test_more_messages_than_slots_flow_through_them(small_messages):
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 12)
    with pair(kv0, kv1, data_backend="ipc", inbox_bytes=12 * small_messages) as (c0, c1):
        assert c0._blocks_per_message == 2 and c0._ipc.pool.count == 2
        order = [7, 2, 9, 0, 11, 4, 1, 8, 3, 10, 5, 6]
        assert c0.save(keys, order).wait(timeout=10).ok  # 6 messages, 2 slots
        assert c1.load(keys, list(range(12))).wait(timeout=10).ok
        # Every slot comes back: the last acknowledgement may still be on its way when the
        # load has its blocks (the receiver acknowledges after copying them out).
        deadline = time.monotonic() + 10
        while sorted(c0._ipc.pool._free) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(c0._ipc.pool._free) == [0, 1]
    assert torch.equal(block_bytes(kv1, list(range(12))), block_bytes(kv0, order))


def test_both_peers_sending_at_once_through_full_slots_never_deadlock(small_messages):
    """Each side's receiver gives the other's slots back while its own sender waits for one:
    the acknowledgements travel on a channel of their own, never behind a send."""
    kv0, kv1 = make_caches(cross_layer=False), make_caches(cross_layer=False)
    with pair(kv0, kv1, data_backend="ipc", inbox_bytes=48 * small_messages) as (c0, c1):
        ids = list(range(12))
        for round_ in range(3):
            keys0, keys1 = (keys_for(random.randrange(2**31), 12) for _ in range(2))
            box = bounded(lambda k0=keys0, k1=keys1: [h.wait(timeout=20) for h in (
                c0.save(k0, ids), c1.save(k1, ids[::-1]))], 30)
            assert "error" not in box and all(r.ok for r in box["value"]), box
            assert box["seconds"] < 5.0, f"round {round_} took {box['seconds']:.1f} s"
        sent0, sent1 = block_bytes(kv0, ids), block_bytes(kv1, ids[::-1])
        assert c1.load(keys0, ids).wait(timeout=5).ok and c0.load(keys1, ids).wait(timeout=5).ok
    assert torch.equal(block_bytes(kv1, ids), sent0)
    assert torch.equal(block_bytes(kv0, ids), sent1)


def test_slots_never_given_back_fail_the_pending_blocks_within_the_timeout(small_messages):
    kv0, kv1 = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 8)
    with pair(kv0, kv1, data_backend="ipc", timeout_s=0.5,
              inbox_bytes=12 * small_messages) as (c0, c1):
        real = c1._ipc._ack
        c1._ipc._ack = lambda value: real(value) if value < 0 else None  # a stuck receiver
        start = time.monotonic()
        result = c0.save(keys, list(range(8))).wait(timeout=10)
        assert 0.5 <= time.monotonic() - start < 3.0
        assert result.succeeded == (0, 1, 2, 3)  # two messages in the two slots
        assert set(result.failed) == {4, 5, 6, 7}
        assert "no staging slot came back within timeout_s=0.5" in result.failed[4]
        assert c1.load(keys[:4], [0, 1, 2, 3]).wait(timeout=5).ok  # those arrived
        assert set(c0.save(keys[:1], [0]).wait(timeout=5).failed) == {0}  # the link is down


@pytest.mark.parametrize(
    ("ours", "theirs", "patch", "message"),
    [("ipc", "ipc", {"host": "elsewhere/boot"},
      r"data_backend='ipc' maps the peer's memory, which needs both processes on one host: "
      r".*'elsewhere/boot'; pass data_backend='nccl' \(CUDA caches on two GPUs\) or 'gloo'"),
     ("auto", "ipc", {"host": "elsewhere/boot"}, r"needs both processes on one host"),
     ("ipc", "gloo", {}, r"data_backend='ipc' on local rank \d but 'gloo' on remote rank \d: "
                         r"pass the same data_backend to both peers"),
     ("ipc", "ipc", {"device": "cuda", "gpu": "GPU-0000", "gpus": ["GPU-0000"]},
      r"the cache of remote rank 1 is on GPU GPU-0000, which local rank 0 does not see")],
    ids=["another_host", "auto_vs_ipc_on_another_host", "ipc_vs_gloo", "gpu_not_visible"])
def test_peers_that_cannot_share_a_data_path_are_refused_before_any_byte(
        monkeypatch, ours, theirs, patch, message):
    real = p2p_module.transport_facts

    def facts(requested: str, device: torch.device) -> dict:
        found = real(requested, device)
        if threading.current_thread().name == "elsewhere":  # rank 1: a peer elsewhere
            found.update(patch)
        return found

    monkeypatch.setattr(p2p_module, "transport_facts", facts)
    c0 = get_connector("p2p", rank=0, data_backend=ours, timeout_s=2.0, connect_timeout_s=10.0)
    c1 = get_connector("p2p", rank=1, port=c0.port, data_backend=theirs, timeout_s=2.0,
                       connect_timeout_s=10.0)
    box: dict = {}

    def register_peer() -> None:
        try:
            c1.register_kv_caches(make_caches(cross_layer=False))
        except BaseException as exc:
            box["error"] = exc

    peer = threading.Thread(target=register_peer, name="elsewhere")
    peer.start()
    try:
        with pytest.raises(ValueError, match=message):
            c0.register_kv_caches(make_caches(cross_layer=False))
        peer.join(30)
    finally:
        c1.close()
        c0.close()
    assert isinstance(box.get("error"), ValueError), box  # refused on both sides
    assert str(box["error"]).startswith("p2p rank 1: data_backend=")
    assert c0._ipc is None and c1._ipc is None
    assert shm_files() == set() and p2p_threads() == []


def test_auto_keeps_gloo_for_cpu_caches():
    with pair(make_caches(cross_layer=False), make_caches(cross_layer=False)) as (c0, c1):
        assert (c0.transport, c1.transport) == ("gloo", "gloo") and c0._ipc is None


@pytest.mark.gpu
def test_cuda_caches_over_gloo_are_staged_through_host_memory_bit_exact():
    kv0, kv1 = (kvcore.allocate_kv_caches("CPU_ATTN", **SIZES, dtype=torch.bfloat16,
                                          device="cuda", cross_layer=True) for _ in range(2))
    for kv in (kv0, kv1):
        kv.storage.copy_(torch.randn(kv.storage.shape, device="cuda"))
    keys = keys_for(random.randrange(2**31), 3)
    with pair(kv0, kv1, data_backend="gloo") as (c0, c1):
        assert c0.save(keys, [1, 2, 3]).wait(timeout=10).ok
        assert c1.load(keys, [7, 8, 9]).wait(timeout=10).ok
    assert torch.equal(block_bytes(kv1, [7, 8, 9]), block_bytes(kv0, [1, 2, 3]))


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs (NCCL pairs one rank per GPU); this machine has "
                    f"{torch.cuda.device_count()}")


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_two_processes_on_two_gpus_exchange_blocks_over_nccl_bit_exact(cross):
    _two_gpus()
    seed = random.randrange(2**31)
    kv = make_caches(cross_layer=cross, device="cuda:0")
    with get_connector("p2p", rank=0, timeout_s=30.0, connect_timeout_s=60.0) as conn, \
            peer_process("echo", conn.port, seed, cross=cross, device="cuda:1") as proc:
        conn.register_kv_caches(kv)
        assert conn._tx_data is not conn._tx_ctrl  # blocks go over their own (NCCL) group
        _exchange_with_echo_peer(conn, kv, seed, cross, proc)


def _exchange_with_echo_peer(conn, kv, seed: int, cross: bool, proc) -> None:
    """Blocks 2 and 9 of ``kv`` saved to an ``echo`` peer, the two it sends loaded into 4 and
    1, the two it echoes back into 10 and 11: all bit-exact; then the peer exits cleanly."""
    sent = block_bytes(kv, [2, 9]).cpu()
    assert conn.save(keys_for(seed, 2), [2, 9]).wait(timeout=30).ok
    theirs = conn.load(keys_for(seed + 1, 2), [4, 1]).wait(timeout=30)
    assert theirs.succeeded == (4, 1) and not theirs.failed
    peer_cache = make_caches(cross_layer=cross, seed=seed)  # same values, on the CPU
    assert torch.equal(block_bytes(kv, [4, 1]).cpu(), block_bytes(peer_cache, [3, 7]))
    echoed = conn.load(keys_for(seed + 2, 2), [10, 11]).wait(timeout=30)
    assert echoed.ok
    assert torch.equal(block_bytes(kv, [10, 11]).cpu(), sent)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out.strip()) == (0, "ok"), err


@pytest.mark.gpu
def test_killed_peer_on_another_gpu_fails_exactly_the_blocks_and_never_hangs():
    _two_gpus()
    kv = make_caches(cross_layer=False, device="cuda:0")
    keys = keys_for(random.randrange(2**31), 3)
    with get_connector("p2p", rank=0, timeout_s=2.0, connect_timeout_s=60.0) as conn, \
            peer_process("idle", conn.port, 2, device="cuda:1") as proc:
        conn.register_kv_caches(kv)
        assert proc.stdout.readline().strip() == "ok"
        proc.kill()
        proc.wait(10)
        start = time.monotonic()
        dead = conn.load(keys, [3, 4, 5]).wait(timeout=30)
        assert set(dead.failed) == {3, 4, 5} and dead.succeeded == ()
        unsent = conn.save(keys, [0, 1, 2]).wait(timeout=30)
        assert set(unsent.failed) == {0, 1, 2} and unsent.succeeded == ()
        assert time.monotonic() - start < 15.0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["ipc", "auto"])
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_two_processes_on_one_gpu_exchange_blocks_over_ipc_bit_exact(cross, backend):
    """Both processes on one GPU: ``"auto"`` picks ``"ipc"``, blocks move through the slots
    (CUDA IPC) by device copies."""
    seed = random.randrange(2**31)
    kv = make_caches(cross_layer=cross, device="cuda:0")
    with get_connector("p2p", rank=0, timeout_s=30.0, connect_timeout_s=60.0,
                       data_backend=backend) as conn, \
            peer_process("echo", conn.port, seed, cross=cross, device="cuda:0",
                         options={"data_backend": backend}) as proc:
        conn.register_kv_caches(kv)
        assert conn.transport == "ipc" and conn._ipc.pool.slots.is_cuda
        _exchange_with_echo_peer(conn, kv, seed, cross, proc)
    assert p2p_threads() == []


@pytest.mark.gpu
def test_an_ipc_pair_in_one_process_on_one_gpu_uses_its_own_slots():
    """CUDA IPC cannot open a handle in the process that made it: a pair in one process (the
    tests' ``pair``) reads the sender's slots as they are."""
    kv0, kv1 = (make_caches(cross_layer=True, device="cuda") for _ in range(2))
    keys = keys_for(random.randrange(2**31), 3)
    with pair(kv0, kv1) as (c0, c1):
        assert (c0.transport, c1.transport) == ("ipc", "ipc")
        assert c0.save(keys, [1, 2, 3]).wait(timeout=10).ok
        assert c1.load(keys, [7, 8, 9]).wait(timeout=10).ok
    assert torch.equal(block_bytes(kv1, [7, 8, 9]), block_bytes(kv0, [1, 2, 3]))


# -- NCCL data transfers: bounded by polling, the group aborted past the timeout ---------------


class _Work:
    """A send/receive that completes after ``polls`` completion checks (never: ``None``);
    its ``wait`` ignores timeouts, as NCCL's does without blocking wait."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.checks, self.waited = polls, 0, False

    def is_completed(self) -> bool:
        self.checks += 1
        return self.polls is not None and self.checks > self.polls

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True


class _Group:
    def __init__(self, name: str = "abort") -> None:
        self.aborted = 0
        setattr(self, name, self._abort_impl)

    def _abort_impl(self) -> None:
        self.aborted += 1


@pytest.mark.parametrize("abort_name", ["abort", "_abort"])
def test_a_data_transfer_that_never_completes_fails_within_the_timeout_and_aborts(abort_name):
    from kvcore.connectors.p2p_transport import wait_bounded

    work, group = _Work(None), _Group(abort_name)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"receiving 64 bytes from peer rank 1 did not "
                       r"complete within timeout_s=0.2"):
        wait_bounded(work, group, 0.2, "receiving 64 bytes from peer rank 1")
    assert 0.2 <= time.monotonic() - start < 2.0
    assert group.aborted == 1 and not work.waited  # nothing completes into reused memory


def test_a_data_transfer_that_completes_is_waited_for_and_nothing_aborted():
    from kvcore.connectors.p2p_transport import wait_bounded

    work, group = _Work(3), _Group()
    wait_bounded(work, group, 5.0, "sending")
    assert work.checks == 4 and work.waited and group.aborted == 0
