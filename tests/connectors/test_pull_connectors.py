"""The protocol both pull connectors (``nixl``, ``mooncake``) implement, run on each: a
producer publishes blocks, consumers READ them (``pull_cases.py`` describes the connectors).

Two-process tests run the producer as a real subprocess on loopback (``pull_peer.py``) with
DRAM caches; the rest pair connectors inside this process, which runs the same protocol faster.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from kv_helpers import block_bytes, keys_for, make_caches
from pull_cases import NIXL, PULLS, round_trip_between_two_processes

from kvcore import LayoutMismatchError

EACH = pytest.mark.parametrize("pull", PULLS)


# -- two processes ----------------------------------------------------------------------------


@EACH
@pytest.mark.parametrize(("layout", "cross", "dtype", "dst"), [
    ("nhd", True, "fp8", [0, 1, 2, 7]),
    ("hnd", False, "bf16", [0, 1, 2, 7]),
    ("nhd", False, "fp16", [11, 0, 6, 5]),
], ids=["cross_layer-nhd-fp8", "per_layer-hnd-bf16", "per_layer-scattered-fp16"])
def test_round_trip_between_two_processes_is_bit_exact(pull, layout, cross, dtype, dst):
    round_trip_between_two_processes(pull, 11, layout=layout, cross=cross, dtype=dtype, dst=dst)


@EACH
def test_layout_mismatch_is_refused_before_any_byte_moves(pull):
    with pull.producer_process("serve", 3, layout="nhd") as peer:
        port = peer.port()
        # NHD against HND converts on load (test_convert_connectors.py); MLA against K/V
        # cannot.
        kv = make_caches(cross_layer=False, layout="mla")
        before = kv.storage.clone()
        conn = pull.consumer(port)
        with pytest.raises(LayoutMismatchError, match=r"consumer .*producer 127\.0\.0\.1:"
                                                      r"\d+.*MLA latent cache and a K/V"):
            conn.register_kv_caches(kv)
        conn.close()
        assert torch.equal(kv.storage.view(torch.uint8), before.view(torch.uint8))
        peer.proc.kill()  # (it would wait for a consumer until publish_timeout_s)
        assert f"{pull.name} producer: refused consumer" in peer.proc.stderr.read()


#: Each connector with its producer killed; NIXL's also stopped (SIGSTOP), which looks the same
#: to a consumer only once the timeout passes.
FAULTS = [*(pytest.param(p.values[0], "killed", marks=p.marks, id=f"{p.id}-killed")
            for p in PULLS),
          pytest.param(NIXL, "frozen", marks=[NIXL.needs, pytest.mark.slow], id="nixl-frozen")]


@pytest.mark.parametrize(("pull", "fault"), FAULTS)
@pytest.mark.parametrize("one_load", [True, False], ids=["one-load", "after-the-published"])
def test_a_dead_producer_fails_exactly_the_unread_blocks_within_the_timeout(pull, fault,
                                                                              one_load):
    """Two of four keys are published: a load of all four (``one_load``), or of the two never
    published after the published two were read, fails exactly the unread blocks within the
    timeout once the producer dies; later loads fail too, and closing leaves no thread."""
    seed, timeout_s = 5, 3.0
    with pull.producer_process("partial", seed) as peer:
        port = peer.port()
        kv = make_caches(cross_layer=False)
        before = block_bytes(kv, list(range(kv.num_blocks)))
        keys = keys_for(seed, 4)
        conn = pull.consumer(port, timeout_s=timeout_s)
        conn.register_kv_caches(kv)
        while conn.lookup(keys[:2]) < 2:
            time.sleep(0.01)
        if one_load:
            started = time.monotonic()
            handle = conn.load(keys, [0, 1, 2, 3])  # reads the two published, polls for the rest
            assert peer.line(timeout=30) == "served"
        else:
            assert conn.load(keys[:2], [0, 1]).wait(timeout=timeout_s + 5).ok
            assert peer.line() == "served"
            started = time.monotonic()
            handle = conn.load(keys[2:], [2, 3])  # never published: polls for them
        if fault == "killed":
            peer.proc.kill()
        else:
            os.kill(peer.proc.pid, signal.SIGSTOP)
        result = handle.wait(timeout=timeout_s + 5)
        elapsed = time.monotonic() - started
        assert result.succeeded == ((0, 1) if one_load else ())
        assert sorted(result.failed) == [2, 3]
        assert elapsed < timeout_s + 1.5, elapsed
        theirs = make_caches(cross_layer=False, seed=seed)
        after = block_bytes(kv, list(range(kv.num_blocks)))
        assert torch.equal(after[[0, 1]], block_bytes(theirs, [3, 4]))
        assert torch.equal(after[2:], before[2:])  # nothing partial written
        started = time.monotonic()
        assert conn.lookup(keys) == 0
        later = conn.load(keys[2:], [4, 5]).wait(timeout=timeout_s + 5)
        assert sorted(later.failed) == [4, 5]
        assert time.monotonic() - started < 2 * timeout_s + 1.5
        conn.close()
        assert not pull.threads()


# -- in one process ---------------------------------------------------------------------------


@EACH
@pytest.mark.parametrize("cross", [True, False], ids=["cross_layer", "per_layer"])
def test_a_lease_nobody_confirms_is_published_again(pull, cross):
    kv_p, kv_c = make_caches(cross_layer=cross), make_caches(cross_layer=cross)
    keys = keys_for(4, 1)
    with pull.producer() as prod, pull.consumer(prod.port) as conn:
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


@EACH
def test_a_block_waits_for_its_readers_each_reading_it_once(pull):
    """``readers=2`` (two tensor-parallel decode ranks on one prefill rank): the block stays
    published until two different consumers READ it, neither reads it twice, and a block
    only one of them read is released at publish_timeout_s, its save naming the count."""
    kv_p = make_caches(cross_layer=True)
    keys, other = keys_for(1, 2), keys_for(9, 1)
    with pull.producer(readers=2, publish_timeout_s=1.5) as prod:
        prod.register_kv_caches(kv_p)
        with pull.consumer(prod.port) as a, pull.consumer(prod.port) as b:
            kv_a, kv_b = make_caches(cross_layer=True), make_caches(cross_layer=True)
            a.register_kv_caches(kv_a)
            b.register_kv_caches(kv_b)
            save = prod.save(keys, [3, 4])
            assert a.load(keys, [0, 1]).wait(timeout=10).ok
            assert a.lookup(keys) == 0 and not save.done()  # read by a, waiting for b
            assert b.lookup(keys) == 2
            assert b.load(keys, [5, 6]).wait(timeout=10).ok
            assert save.wait(timeout=10).ok and b.lookup(keys) == 0
            half = prod.save(other, [7])
            assert a.load(other, [2]).wait(timeout=10).ok
            result = half.wait(timeout=10)
        assert "read by 1 of the readers=2 consumers" in result.failed[7]
    for kv in (kv_a, kv_b):
        assert torch.equal(block_bytes(kv, [0, 1] if kv is kv_a else [5, 6]),
                           block_bytes(kv_p, [3, 4]))
    assert not pull.threads()


@EACH
def test_in_process_dtype_mismatch_is_refused(pull):
    with pull.producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=False, dtype="bf16"))
        conn = pull.consumer(prod.port)
        with pytest.raises(LayoutMismatchError, match="dtype"):
            conn.register_kv_caches(make_caches(cross_layer=False, dtype="fp16"))
        conn.close()


@EACH
def test_roles_that_do_not_apply_fail_per_block_with_the_reason(pull):
    with pull.producer() as prod:
        prod.register_kv_caches(make_caches(cross_layer=True))
        assert prod.lookup(keys_for(1, 2)) == 0
        loaded = prod.load(keys_for(1, 2), [0, 1]).wait()
        assert sorted(loaded.failed) == [0, 1] and "role='producer'" in loaded.failed[0]
        with pull.consumer(prod.port) as conn:
            conn.register_kv_caches(make_caches(cross_layer=True))
            saved = conn.save(keys_for(2, 1), [4]).wait()
            assert saved.failed[4].startswith("role='consumer' only loads")
    assert not pull.threads()


@EACH
@pytest.mark.parametrize("looked_up", [False, True], ids=["cold", "after_lookup"])
def test_a_load_makes_one_fetch_round_trip_and_reports_its_phases(pull, looked_up):
    """A load of two runs (blocks consecutive on both sides) makes one ``fetch`` on the side
    channel, plus one ``done`` per run where READs are confirmed over it (mooncake), none
    where the library notifies (nixl). After a lookup (one ``lookup``), which named the
    blocks, the READs start before the fetch's answer is read, and nixl confirms each with
    one ``notify`` once the lease named the same blocks. The timing hook hears of each, with
    the library's calls and nothing else."""
    from kvcore.connectors.pull import PHASES

    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(6, 4)
    with pull.producer() as prod, pull.consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [2, 3, 7, 8])
        phases: list[str] = []
        conn.timing = lambda phase, seconds: phases.append(phase)
        if looked_up:
            assert conn.lookup(keys) == 4
        assert conn.load(keys, [0, 1, 5, 6]).wait(timeout=pull.wait_s).ok
        assert save.wait(timeout=pull.wait_s).ok
    assert set(phases) <= set(PHASES)
    runs = 2
    assert phases.count("lookup") == looked_up and phases.count("fetch") == 1
    assert phases.count("done") == (runs if pull.name == "mooncake" else 0)
    assert phases.count("notify") == (runs if looked_up and pull.name == "nixl" else 0)
    assert phases.count("start_read") == runs and "giveback" not in phases
    first_read = phases.index("start_read")
    assert (first_read < phases.index("fetch")) == looked_up
    assert torch.equal(block_bytes(kv_c, [0, 1, 5, 6]), block_bytes(kv_p, [2, 3, 7, 8]))


@EACH
def test_blocks_a_lookup_named_that_changed_before_the_lease_are_read_again_from_it(pull):
    """A lookup named blocks 2 and 3 for two keys; before the load, another consumer leased
    them and the producer published the keys again in blocks 7 and 8 (other bytes here, to
    tell them apart). The load's READs from 2 and 3 are not trusted: the lease names other
    blocks and serials, so it READs 7 and 8 over them. Nothing else changes."""
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(19, 2)
    with pull.producer() as prod, pull.consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        assert not torch.equal(block_bytes(kv_p, [2, 3]), block_bytes(kv_p, [7, 8]))
        prod.save(keys, [2, 3])
        assert conn.lookup(keys) == 2
        prod._producer.fetch("another-consumer", keys, lease_s=30.0)
        again = prod.save(keys, [7, 8])
        before = block_bytes(kv_c, list(range(kv_c.num_blocks)))
        phases: list[str] = []
        conn.timing = lambda phase, seconds: phases.append(phase)
        result = conn.load(keys, [4, 5]).wait(timeout=pull.wait_s)
        assert result.ok, result.failed
        assert again.wait(timeout=pull.wait_s).ok
    assert torch.equal(block_bytes(kv_c, [4, 5]), block_bytes(kv_p, [7, 8]))
    others = [b for b in range(kv_c.num_blocks) if b not in (4, 5)]
    assert torch.equal(block_bytes(kv_c, others), before[others])
    assert phases.count("start_read") == 2 and phases.count("fetch") == 1
    assert "notify" not in phases  # nothing was read from the blocks the lookup named


@EACH
def test_keys_no_lookup_named_are_read_from_the_lease_after_the_others(pull):
    """A lookup named the first two keys of a load of four: those are READ while the fetch is
    on the way, the last two from the lease once it answered; all arrive bit-exactly."""
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(21, 4)
    with pull.producer() as prod, pull.consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [2, 3, 4, 5])
        assert conn.lookup(keys[:2]) == 2
        phases: list[str] = []
        conn.timing = lambda phase, seconds: phases.append(phase)
        result = conn.load(keys, [6, 7, 8, 9]).wait(timeout=pull.wait_s)
        assert result.ok, result.failed
        assert save.wait(timeout=pull.wait_s).ok
    assert torch.equal(block_bytes(kv_c, [6, 7, 8, 9]), block_bytes(kv_p, [2, 3, 4, 5]))
    assert phases.count("start_read") == 2 and phases.count("fetch") == 1
    assert phases.index("start_read") < phases.index("fetch")  # the guessed run went first


@EACH
def test_a_consumer_keeps_the_blocks_of_its_last_looked_up_keys_only(pull, monkeypatch):
    """Past ``GUESSES_KEPT`` keys the first looked up are forgotten; a load takes its keys'."""
    from kvcore.connectors import pull as pull_module

    monkeypatch.setattr(pull_module, "GUESSES_KEPT", 3)
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(22, 5)
    with pull.producer() as prod, pull.consumer(prod.port) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [2, 3, 4, 5, 6])
        assert conn.lookup(keys[:2]) == 2 and conn.lookup(keys[2:]) == 3
        assert list(conn._guesses) == keys[2:]
        assert [b for b, _ in conn._guesses.values()] == [4, 5, 6]
        assert conn.load(keys, [7, 8, 9, 10, 11]).wait(timeout=pull.wait_s).ok
        assert not conn._guesses  # each serves one load
        assert save.wait(timeout=pull.wait_s).ok
    assert torch.equal(block_bytes(kv_c, [7, 8, 9, 10, 11]), block_bytes(kv_p, [2, 3, 4, 5, 6]))


@EACH
def test_blocks_a_lookup_named_that_expired_before_the_load_fail_with_the_reason(pull):
    """The producer let the blocks a lookup named go (nobody read them within
    ``publish_timeout_s``) before the load: its READs from them count for nothing, the
    fetch finds the keys unpublished, and the load fails them within ``timeout_s``."""
    kv_p, kv_c = make_caches(cross_layer=True), make_caches(cross_layer=True)
    keys = keys_for(20, 2)
    with pull.producer(publish_timeout_s=0.2) as prod, \
            pull.consumer(prod.port, timeout_s=1.0) as conn:
        prod.register_kv_caches(kv_p)
        conn.register_kv_caches(kv_c)
        save = prod.save(keys, [2, 3])
        assert conn.lookup(keys) == 2
        assert not save.wait(timeout=pull.wait_s).ok  # expired, unread
        result = conn.load(keys, [4, 5]).wait(timeout=pull.wait_s)
    assert sorted(result.failed) == [4, 5]
    assert "not published by the producer" in result.failed[4]


def test_a_load_waited_for_before_the_loader_took_it_runs_in_the_waiting_thread():
    """A caller that waits (long enough for any load) runs a load the loader thread has not
    started itself, saving two thread hand-offs; one the loader runs is waited for, within
    the caller's timeout; an error reaches the caller either way."""
    import threading

    from kvcore.connectors.pull_reads import LoadTask

    ran_on: list[str] = []

    def load(name):
        ran_on.append(threading.current_thread().name)
        if name == "bad":
            raise ConnectionError("the link went down")
        return name

    unfinished: set = set()
    task = LoadTask(unfinished, load, "a")
    assert not task.wait(0.01, inline=False) and ran_on == []  # queued, not run
    assert unfinished == {task}  # close() waits for it
    assert task.wait(None, inline=True) and task.result() == "a" and not unfinished
    assert ran_on == [threading.current_thread().name]
    task.run()  # the loader thread comes later: nothing to do
    assert ran_on == [threading.current_thread().name]

    started, release = threading.Event(), threading.Event()

    def slow(name):
        started.set()
        release.wait(5)
        return load(name)

    task = LoadTask(unfinished, slow, "b")
    loader = threading.Thread(target=task.run, name="loader")
    loader.start()
    assert started.wait(5)
    assert not task.wait(0.05, inline=True)  # the loader has it: wait, within the timeout
    release.set()
    assert task.wait(5, inline=True) and task.result() == "b" and ran_on[-1] == "loader"
    loader.join(5)

    task = LoadTask(unfinished, load, "bad")
    assert task.wait(None, inline=True)
    with pytest.raises(ConnectionError, match="the link went down"):
        task.result()


def test_the_producer_looks_for_expired_blocks_only_when_one_is_due():
    """The notification loop expires leases and publications each turn; it looks over them
    only once the earliest deadline has passed (not over every publication each turn), and
    what a lease lets go of past its deadline still expires."""
    from types import SimpleNamespace

    from kvcore.connectors.pull_producer import Producer

    conn = SimpleNamespace(transport="test", readers=1, max_lease_s=60.0,
                           confirms_over_channel=True, publish_timeout_s=0.2, host="h",
                           port=1)
    producer = Producer(conn, listener=None)
    keys = keys_for(0, 4)
    early = producer.publish(keys[:2], [0, 1], timeout_s=0.2)
    late = producer.publish(keys[2:], [2, 3], timeout_s=60.0)
    lease, blocks, _ = producer.fetch("consumer", keys[:1], lease_s=30.0)
    assert blocks == [0]

    class Watched(dict):
        looked = 0

        def values(self):
            Watched.looked += 1
            return super().values()

    with producer.cond:
        producer.published = Watched(producer.published)
        producer.leases = Watched(producer.leases)
        producer._expire(time.monotonic())
        assert Watched.looked == 0  # nothing due yet
        producer._expire(time.monotonic() + 0.3)
        assert Watched.looked > 0
    assert early.failed.keys() == {1} and early.pending == 1  # block 0 is leased
    assert late.pending == 2
    producer.give_back("consumer", lease, [0])  # past its deadline: due at once
    with producer.cond:
        producer._expire(time.monotonic() + 0.3)
    assert early.failed.keys() == {0, 1} and early.pending == 0
    assert "not read within publish_timeout_s=0.2" in early.failed[0]
