"""Connectors that convert layouts on transfer: blocks written by one layout load into caches
of another, equal value for value through the logical views."""

from __future__ import annotations

import random
import time

import pytest
import torch
from kv_helpers import keys_for, make_caches
from pull_cases import PULLS
from test_p2p import pair

from kvcore import KVCaches
from kvcore.connectors import LayoutConversionError, get_connector


def logical_blocks(kv: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """``(layers, blocks, ...)`` bytes of the blocks through the logical views: equal for two
    layouts exactly when they hold the same values."""
    idx = torch.tensor(block_ids)
    return torch.stack([layer.index_select(0, idx).contiguous().view(torch.uint8)
                        for layer in kv.layers])


@pytest.mark.parametrize("writer, reader", [
    (("nhd", False), ("hnd", True)),
    (("hnd", True), ("interleaved", False)),
    (("interleaved", False), ("nhd", True)),
], ids=["nhd-per-layer->hnd-cross-layer", "hnd-cross-layer->interleaved-per-layer",
        "interleaved-per-layer->nhd-cross-layer"])
def test_storage_loads_blocks_another_layout_wrote(tmp_path, writer, reader):
    source = make_caches(layout=writer[0], cross_layer=writer[1])
    keys = keys_for(random.randrange(2**31), 3)
    with get_connector("storage", root=tmp_path) as conn:
        conn.register_kv_caches(source)
        assert conn.save(keys, [4, 1, 7]).wait().ok
    dest = make_caches(layout=reader[0], cross_layer=reader[1])
    untouched = logical_blocks(dest, [0, 2, 3])
    with get_connector("storage", root=tmp_path) as plain:
        plain.register_kv_caches(make_caches(layout=reader[0], cross_layer=reader[1]))
        assert plain.lookup(keys) == 0  # without convert=True: this layout's blocks only
    with get_connector("storage", root=tmp_path, convert=True) as conn:
        conn.register_kv_caches(dest)
        assert conn.lookup(keys) == 3
        result = conn.load(keys, [5, 9, 6]).wait()
    assert result.ok and result.succeeded == (5, 9, 6)
    assert torch.equal(logical_blocks(dest, [5, 9, 6]), logical_blocks(source, [4, 1, 7]))
    assert torch.equal(logical_blocks(dest, [0, 2, 3]), untouched)


def test_storage_does_not_offer_blocks_it_cannot_convert(tmp_path):
    """Another block size (keys name other tokens), MLA, or another dtype: not found."""
    keys = keys_for(random.randrange(2**31), 2)
    for kind in ({"block_size": 8}, {"layout": "mla"}, {"dtype": "fp8"}):
        with get_connector("storage", root=tmp_path) as conn:
            conn.register_kv_caches(make_caches(cross_layer=False, **kind))
            assert conn.save(keys, [0, 1]).wait().ok
    with get_connector("storage", root=tmp_path, convert=True) as conn:
        conn.register_kv_caches(make_caches(layout="hnd", cross_layer=True))
        assert conn.lookup(keys) == 0
        assert "no file for key" in conn.load(keys, [2, 3]).wait().failed[2]


def test_offload_loads_into_caches_reallocated_with_another_backend():
    before = make_caches(layout="nhd", cross_layer=True)
    keys = keys_for(random.randrange(2**31), 4)
    with get_connector("offload", capacity_bytes=1 << 20) as conn:
        conn.register_kv_caches(before)
        assert conn.save(keys[:3], [2, 5, 6]).wait().ok
        after = make_caches(layout="hnd", cross_layer=False)  # the engine switched backends
        conn.reregister_kv_caches(after)
        assert conn.save(keys[3:], [0]).wait().ok  # saved in the new layout
        untouched = logical_blocks(after, [1, 3])
        result = conn.load(keys, [7, 8, 9, 10]).wait()
        assert result.ok and set(result.succeeded) == {7, 8, 9, 10}
        assert torch.equal(logical_blocks(after, [7, 8, 9]), logical_blocks(before, [2, 5, 6]))
        assert torch.equal(logical_blocks(after, [10]), logical_blocks(after, [0]))
        assert torch.equal(logical_blocks(after, [1, 3]), untouched)
        # Back to the first backend: the first blocks load as they were, the later converted.
        again = make_caches(layout="nhd", cross_layer=True)
        conn.reregister_kv_caches(again)
        assert conn.load(keys, [1, 2, 3, 4]).wait().ok
        assert torch.equal(logical_blocks(again, [1, 2, 3]), logical_blocks(before, [2, 5, 6]))
        assert torch.equal(logical_blocks(again, [4]), logical_blocks(after, [0]))


def test_offload_reregistration_keeps_the_block_size():
    with get_connector("offload", capacity_bytes=1 << 20) as conn:
        conn.register_kv_caches(make_caches(layout="nhd", cross_layer=True))
        with pytest.raises(ValueError, match=r"differ in size from the pool's"):
            conn.reregister_kv_caches(make_caches(layout="hnd", cross_layer=True, block_size=8))
        with pytest.raises(ValueError, match=r"an MLA latent cache and a K/V cache"):
            conn.reregister_kv_caches(make_caches(layout="mla", cross_layer=False))


# -- pull connectors (nixl, mooncake): the consumer converts on load ---------------------------


def tokens_of(kv: KVCaches, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """``(layers, 2, num_tokens, heads, dim)`` values of the tokens held by ``block_ids`` in
    order, through the logical views."""
    idx = torch.tensor(block_ids)
    out = []
    for layer in kv.layers:
        blocks = layer.index_select(0, idx)  # (n, 2, N, H, D)
        out.append(blocks.transpose(0, 1).flatten(1, 2)[:, :num_tokens])
    return torch.stack(out)


#: (producer layout, cross, block size, heads, tp) -> (consumer ...), source blocks
CONVERTING_PULLS = {
    "4nhd->8hnd-cross, partial last block": (
        ("nhd", False, 4, 2, None), ("hnd", True, 8, 2, None), 5),
    "8hnd-cross->4nhd": (("hnd", True, 8, 2, None), ("nhd", False, 4, 2, None), 3),
    "tp1->2 head slice": (("nhd", True, 4, 2, None), ("interleaved", False, 8, 1, (2, 1)), 6),
}


@pytest.mark.parametrize("pull, case, staging_bytes", [
    # Every case on nixl: in place (the producer's cache mapped: here, in this process), and
    # READ into the staging buffer in one chunk and one group per chunk; mooncake (slower)
    # in place and by chunks.
    *(pytest.param(PULLS[0].values[0], case, staging, marks=PULLS[0].marks,
                   id=f"nixl-{name}-{chunks}")
      for name, case in CONVERTING_PULLS.items()
      for staging, chunks in ((None, "in-place"), (1 << 20, "one-chunk"),
                              (1, "chunk-per-group"))),
    *(pytest.param(PULLS[1].values[0], CONVERTING_PULLS["tp1->2 head slice"], staging,
                   marks=PULLS[1].marks, id=f"mooncake-tp1->2 head slice-{chunks}")
      for staging, chunks in ((None, "in-place"), (1, "chunk-per-group"))),
])
def test_pull_consumer_converts_on_load(pull, case, staging_bytes):
    """``staging_bytes=None``: the consumer maps the producer's cache and gathers from it in
    place (one gather, no READ); else it READs into a staging buffer of that size."""
    (p_layout, p_cross, p_bs, p_heads, p_tp), (c_layout, c_cross, c_bs, c_heads, c_tp), n = case
    seed = random.randrange(2**31)
    src = make_caches(layout=p_layout, cross_layer=p_cross, block_size=p_bs,
                      num_kv_heads=p_heads, seed=seed)
    dst = make_caches(layout=c_layout, cross_layer=c_cross, block_size=c_bs,
                      num_kv_heads=c_heads)
    before = {b: tokens_of(dst, [b], c_bs).clone() for b in range(dst.num_blocks)}
    keys = keys_for(seed, n, block_size=p_bs)
    src_ids = [3, 4, 5, 9, 10, 1][:n]
    dst_ids = [7, 0, 2, 11, 5, 6][:-(-n * p_bs // c_bs)]
    with pull.producer(tp=p_tp) as prod:
        prod.register_kv_caches(src)
        save = prod.save(keys, src_ids)
        in_place = staging_bytes is None
        staging = {} if in_place else {"staging_bytes": staging_bytes, "map_producer": False}
        with pull.consumer(prod.port, tp=c_tp, **staging) as conn:
            conn.register_kv_caches(dst)
            assert conn.plan is not None and not conn.plan.is_identity
            assert conn.converts_in_place is in_place
            assert conn.in_place_reason == (None if in_place else "map_producer=False")
            phases: list[str] = []
            conn.timing = lambda phase, seconds: phases.append(phase)
            assert conn.key_block_size == p_bs
            assert conn.lookup(keys) == n
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
            assert result.ok, result.failed
            assert sorted(result.succeeded) == sorted(dst_ids)
            if in_place:  # one gather, prepared and launched before the fetch; one confirmation
                assert [p for p in phases if p != "wait"] == \
                    ["lookup", "prepare", "gather", "fetch", "done"]
            else:
                assert "start_read" in phases
        assert save.wait(timeout=pull.wait_s).ok
    num_tokens = n * p_bs
    want = tokens_of(src, src_ids, num_tokens)
    if c_tp is not None:  # this rank's slice of the heads
        want = want[:, :, :, [c_tp[1]]]
    assert torch.equal(tokens_of(dst, dst_ids, num_tokens).view(torch.uint8),
                       want.contiguous().view(torch.uint8))
    # The partial last block keeps its other tokens; other blocks are untouched.
    last = dst_ids[-1]
    filled = num_tokens - (len(dst_ids) - 1) * c_bs
    assert torch.equal(tokens_of(dst, [last], c_bs)[:, :, filled:], before[last][:, :, filled:])
    for b in set(range(dst.num_blocks)) - set(dst_ids):
        assert torch.equal(tokens_of(dst, [b], c_bs), before[b])


def staged_load() -> tuple:
    """A converting load of 23 source blocks of 4 tokens (NHD, per layer, fresh random seed)
    into 12 destination blocks of 8 (a group: 8 tokens, two source blocks, one destination
    block): ``(n, p_bs, c_bs, seed, src, keys, src_ids, dst_ids, group_bytes)``."""
    n, p_bs, c_bs = 23, 4, 8
    seed = random.randrange(2**31)
    src = make_caches(layout="nhd", cross_layer=False, block_size=p_bs, num_blocks=32,
                      seed=seed)
    keys = keys_for(seed, n, block_size=p_bs)
    src_ids = random.Random(seed).sample(range(32), n)
    dst_ids = [13, 2, 7, 0, 9, 1, 14, 3, 5, 11, 4, 12]
    group_bytes = 2 * src.num_layers * src.layout.page_size_bytes
    return n, p_bs, c_bs, seed, src, keys, src_ids, dst_ids, group_bytes


def destination(seed: int) -> KVCaches:
    """A :func:`staged_load` destination: 16 HND cross-layer blocks of 8 tokens, random."""
    return make_caches(layout="hnd", cross_layer=True, block_size=8, num_blocks=16,
                       seed=seed + 1)


def assert_converted(dst: KVCaches, dst_ids: list[int], src: KVCaches, src_ids: list[int]
                     ) -> None:
    """The tokens of a :func:`staged_load`'s 23 source blocks (4 tokens each) in ``dst_ids``
    equal the producer's in ``src_ids``, bit for bit."""
    num_tokens = len(src_ids) * 4
    assert torch.equal(tokens_of(dst, dst_ids, num_tokens).view(torch.uint8),
                       tokens_of(src, src_ids, num_tokens).contiguous().view(torch.uint8))


@pytest.mark.parametrize("pull", PULLS)
def test_double_buffered_staging_moves_the_same_bytes_as_one_buffer(pull):
    """A staging buffer of four block groups (two parts of two) and 23 source blocks: twelve
    groups, six chunks READ into alternating parts while the previous chunk converts, all
    leased by one fetch. Both ways write the same bytes into the same blocks, equal to the
    producer's tokens, the partial last block's other tokens and every other block
    untouched."""
    n, p_bs, c_bs, seed, src, keys, src_ids, dst_ids, group_bytes = staged_load()
    results, caches = [], []
    with pull.producer(readers=2) as prod:
        prod.register_kv_caches(src)
        save = prod.save(keys, src_ids)
        for buffers in (1, 2):
            dst = destination(seed)
            with pull.consumer(prod.port, staging_bytes=4 * group_bytes,
                               staging_buffers=buffers, map_producer=False) as conn:
                conn.register_kv_caches(dst)
                assert conn._halves == buffers and conn._staging_blocks == 8
                phases: list[str] = []
                conn.timing = lambda phase, seconds, phases=phases: phases.append(phase)
                results.append(conn.load(keys, dst_ids).wait(timeout=pull.wait_s))
                # One fetch for the whole load (before: one per chunk).
                assert phases.count("fetch") == 1 and "giveback" not in phases
            caches.append(dst)
        assert save.wait(timeout=pull.wait_s).ok
    single, double = results
    assert single.ok and double.ok, (single.failed, double.failed)
    assert single.num_bytes == double.num_bytes > 0
    assert single.succeeded == double.succeeded == tuple(dst_ids)
    one, two = caches
    assert torch.equal(logical_blocks(one, list(range(16))), logical_blocks(two, list(range(16))))
    want = tokens_of(src, src_ids, n * p_bs)
    assert torch.equal(tokens_of(two, dst_ids, n * p_bs).view(torch.uint8),
                       want.contiguous().view(torch.uint8))
    untouched = destination(seed)
    others = sorted(set(range(16)) - set(dst_ids))
    assert torch.equal(logical_blocks(two, others), logical_blocks(untouched, others))
    assert torch.equal(tokens_of(two, [dst_ids[-1]], c_bs)[:, :, 4:],
                       tokens_of(untouched, [dst_ids[-1]], c_bs)[:, :, 4:])


@pytest.mark.parametrize("pull", PULLS)
def test_every_gather_is_prepared_while_the_fetch_is_answered_and_launched_once_read(
        pull, monkeypatch):
    """Every chunk's gather is prepared while the load's one fetch is on the way (before any
    READ starts) and launched once its chunk arrived whole: no per-key work between or after
    the READs (apply_keys, for chunks that lost keys, is not called). The timing hook tells
    the preparing apart from the fetch."""
    from kvcore.connectors.convert import ConversionPlan

    _, _, _, seed, src, keys, src_ids, dst_ids, group_bytes = staged_load()
    phases: list[str] = []
    prepare = ConversionPlan.prepare

    def prepare_noting(self, *args, **kwargs):
        phases.append("plan.prepare")
        return prepare(self, *args, **kwargs)

    def apply_keys(*args, **kwargs):
        raise AssertionError("apply_keys after a chunk read whole")

    monkeypatch.setattr(ConversionPlan, "prepare", prepare_noting)
    monkeypatch.setattr(ConversionPlan, "apply_keys", apply_keys)
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        save = prod.save(keys, src_ids)
        dst = destination(seed)
        with pull.consumer(prod.port, staging_bytes=4 * group_bytes,
                           map_producer=False) as conn:
            conn.register_kv_caches(dst)
            conn.timing = lambda phase, seconds: phases.append(phase)
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
        assert save.wait(timeout=pull.wait_s).ok
    assert result.ok, result.failed
    assert result.succeeded == tuple(dst_ids)
    assert_converted(dst, dst_ids, src, src_ids)
    # Six chunks (two groups each, the last one group), all prepared before the fetch ended.
    assert phases[:8] == ["plan.prepare"] * 6 + ["prepare", "fetch"]
    assert phases.count("plan.prepare") == 6 and phases.count("prepare") == 1
    # Each launched once its READ is over (its handle released).
    gathers = [i for i, phase in enumerate(phases) if phase == "gather"]
    assert len(gathers) == 6
    for i in gathers:
        started = max(j for j in range(i) if phases[j] == "start_read")
        assert "release" in phases[started:i]


@pytest.mark.parametrize("pull", PULLS)
def test_a_part_of_the_staging_buffer_is_read_into_again_only_after_its_gather(
        pull, monkeypatch):
    """Six chunks in two parts: the first two chunks' READs start at once (before any
    gather), and chunk ``k`` (k >= 2) starts only once chunk ``k - 2``, the one before it
    in its part, was converted."""
    from kvcore.connectors.pull_reads import Reads

    _, _, _, seed, src, keys, src_ids, dst_ids, group_bytes = staged_load()
    events: list[str] = []
    start = Reads.start

    def start_noting(self, runs, local):
        events.append("start")
        return start(self, runs, local)

    monkeypatch.setattr(Reads, "start", start_noting)
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        save = prod.save(keys, src_ids)
        dst = destination(seed)
        with pull.consumer(prod.port, staging_bytes=4 * group_bytes,
                           map_producer=False) as conn:
            conn.register_kv_caches(dst)
            conn.timing = lambda phase, seconds: events.append(phase) if phase == "gather" \
                else None
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
        assert save.wait(timeout=pull.wait_s).ok
    assert result.ok, result.failed
    assert_converted(dst, dst_ids, src, src_ids)
    assert events.count("start") == events.count("gather") == 6
    assert events[:2] == ["start", "start"]
    starts = [i for i, event in enumerate(events) if event == "start"]
    for k, i in enumerate(starts[2:], 2):
        assert events[:i].count("gather") >= k - 1


@pytest.mark.parametrize("pull", PULLS)
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_converting_load_reads_keys_published_after_its_fetch(pull, in_place):
    """Keys the producer publishes only after the load's fetch are asked for again (staged:
    chunk by chunk): the load completes, every token equal to the producer's."""
    _, _, _, seed, src, keys, src_ids, dst_ids, group_bytes = staged_load()
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        saves = [prod.save(keys[:10], src_ids[:10])]
        dst = destination(seed)
        with pull.consumer(prod.port, staging_bytes=4 * group_bytes,
                           map_producer=in_place) as conn:
            conn.register_kv_caches(dst)
            assert conn.converts_in_place is in_place
            phases: list[str] = []
            conn.timing = lambda phase, seconds: phases.append(phase)
            handle = conn.load(keys, dst_ids)
            deadline = time.monotonic() + pull.wait_s
            while "fetch" not in phases and time.monotonic() < deadline:
                time.sleep(0.005)
            saves.append(prod.save(keys[10:], src_ids[10:]))
            result = handle.wait(timeout=pull.wait_s)
        assert all(save.wait(timeout=pull.wait_s).ok for save in saves)
    assert result.ok, result.failed
    assert phases.count("fetch") >= 2
    assert_converted(dst, dst_ids, src, src_ids)


@pytest.mark.parametrize("pull", PULLS)
def test_in_place_groups_with_a_key_never_published_fail_and_their_leased_keys_go_back(pull):
    """In place, keys 5 and 9 never published (groups 2 and 4 of two keys each): exactly
    those groups' destination blocks fail, naming the key; the other keys of those groups
    (4 and 8), leased but not gathered, are published again for another load; the other
    groups convert, and the producer's save of them completes."""
    n, p_bs, c_bs, seed, src, keys, src_ids, dst_ids, _ = staged_load()
    published = [i for i in range(n) if i not in (5, 9)]
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        save = prod.save([keys[i] for i in published], [src_ids[i] for i in published])
        dst = destination(seed)
        before = logical_blocks(dst, list(range(16)))
        with pull.consumer(prod.port, timeout_s=0.5) as conn:
            conn.register_kv_caches(dst)
            assert conn.converts_in_place
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
            assert sorted(result.failed) == sorted([dst_ids[2], dst_ids[4]])
            assert "source block 5 of the load" in result.failed[dst_ids[2]]
            assert "not published by the producer" in result.failed[dst_ids[2]]
            assert "source block 9 of the load" in result.failed[dst_ids[4]]
            good = [b for g, b in enumerate(dst_ids) if g not in (2, 4)]
            assert result.succeeded == tuple(good)
            assert conn.lookup([keys[4]]) == conn.lookup([keys[8]]) == 1  # given back
    n_good = [g for g in range(len(dst_ids)) if g not in (2, 4)]
    want = tokens_of(src, src_ids, n * p_bs)
    got = tokens_of(dst, dst_ids, n * p_bs)
    for g in n_good:
        span = slice(g * c_bs, min((g + 1) * c_bs, n * p_bs))
        assert torch.equal(got[:, :, span].view(torch.uint8), want[:, :, span].contiguous()
                           .view(torch.uint8))
    for b in (dst_ids[2], dst_ids[4], *sorted(set(range(16)) - set(dst_ids))):
        assert torch.equal(logical_blocks(dst, [b]), before[:, [b]])
    assert set(save.wait(timeout=pull.wait_s).failed) == {src_ids[4], src_ids[8]}


@pytest.mark.parametrize("pull", PULLS)
def test_in_place_groups_a_lookup_named_stale_blocks_for_are_gathered_again_from_the_lease(
        pull):
    """In place, a lookup named the blocks of every key; before the load, another consumer
    leased keys 6 and 11 and the producer published them again in other blocks (other bytes).
    The gather from the named blocks runs while the fetch is out; the groups of keys 6 and
    11 (3 and 5) are gathered again from the lease, over what it wrote. Every token equals
    the producer's second publication; nothing else changes."""
    n, p_bs, _, seed, src, keys, src_ids, dst_ids, _ = staged_load()
    spare = sorted(set(range(32)) - set(src_ids))[:2]
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        save = prod.save(keys, src_ids)
        dst = destination(seed)
        before = logical_blocks(dst, list(range(16)))
        with pull.consumer(prod.port) as conn:
            conn.register_kv_caches(dst)
            assert conn.lookup(keys) == n
            moved = [keys[6], keys[11]]
            prod._producer.fetch("another-consumer", moved, lease_s=30.0)
            again = prod.save(moved, spare)
            phases: list[str] = []
            conn.timing = lambda phase, seconds: phases.append(phase)
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
            assert result.ok, result.failed
            assert result.succeeded == tuple(dst_ids)
        assert again.wait(timeout=pull.wait_s).ok
        # (the other consumer's lease of the first publications of keys 6 and 11 is never
        # confirmed: those two stay pending until the producer closes)
    assert set(save.wait(timeout=pull.wait_s).failed) == {src_ids[6], src_ids[11]}
    assert phases.count("gather") == 2 and phases.count("fetch") == 1
    assert phases.index("gather") < phases.index("fetch")
    # Every token's bytes counted once, gathered again or not.
    assert result.num_bytes == tokens_of(src, src_ids, n * p_bs).numel() * 2
    now = list(src_ids)
    now[6], now[11] = spare
    assert_converted(dst, dst_ids, src, now)
    others = sorted(set(range(16)) - set(dst_ids))
    assert torch.equal(logical_blocks(dst, others), before[:, others])


@pytest.mark.parametrize("pull", PULLS)
def test_in_place_blocks_whose_confirmation_the_producer_refused_fail(pull, monkeypatch):
    """The confirmation of a gather in place cannot be sent (injected): every destination
    block fails, saying its source blocks may have changed during the gather."""
    _, _, _, seed, src, keys, src_ids, dst_ids, _ = staged_load()
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        prod.save(keys, src_ids)
        dst = destination(seed)
        with pull.consumer(prod.port) as conn:
            conn.register_kv_caches(dst)
            monkeypatch.setattr(conn, "_done", lambda lease, first, end, quiet=False:
                                "refused (injected)")
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
    assert not result.succeeded and sorted(result.failed) == sorted(dst_ids)
    assert result.num_bytes == 0
    why = result.failed[dst_ids[3]]
    assert "source block 6 of the load" in why and "refused (injected)" in why
    assert "may have changed meanwhile" in why


@pytest.mark.parametrize("pull", PULLS)
def test_a_chunk_whose_read_fails_fails_its_groups_and_goes_back(pull, monkeypatch):
    """The READs of one chunk (keys 4..7: groups 2 and 3) fail: exactly that chunk's
    destination blocks fail, naming the library's error, its keys are published again for
    the next load, and the other chunks convert as usual."""
    _, _, _, seed, src, keys, src_ids, dst_ids, group_bytes = staged_load()
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        save = prod.save(keys, src_ids)
        dst = destination(seed)
        before = logical_blocks(dst, list(range(16)))
        with pull.consumer(prod.port, staging_bytes=4 * group_bytes,
                           map_producer=False) as conn:
            conn.register_kv_caches(dst)
            engine = conn._engine
            real_poll = engine.poll

            def poll(run):
                state = real_poll(run)
                return "ERR (injected)" if state == "DONE" and 4 <= run.first < 8 else state

            # A READ that really failed notifies nothing: drop the injected ones' notifications
            # (NIXL's), or the producer may count them read before the give-back arrives.
            notifying = prod._producer.engine
            real_notifications = notifying.notifications

            def notifications():
                return [(who, message) for who, message in real_notifications()
                        if not 4 <= int(message.rsplit(b":", 2)[1]) < 8]

            monkeypatch.setattr(engine, "poll", poll)
            monkeypatch.setattr(notifying, "notifications", notifications)
            result = conn.load(keys, dst_ids).wait(timeout=pull.wait_s)
            assert sorted(result.failed) == sorted(dst_ids[2:4])
            assert "READ from the producer failed: ERR (injected)" in result.failed[dst_ids[2]]
            assert result.succeeded == tuple(dst_ids[:2] + dst_ids[4:])
            assert conn.lookup(keys[4:8]) == 4  # given back
            monkeypatch.setattr(engine, "poll", real_poll)
            monkeypatch.setattr(notifying, "notifications", real_notifications)
            again = conn.load(keys[4:8], dst_ids[2:4]).wait(timeout=pull.wait_s)
            assert again.ok, again.failed
        assert save.wait(timeout=pull.wait_s).ok
    assert_converted(dst, dst_ids, src, src_ids)
    others = sorted(set(range(16)) - set(dst_ids))
    assert torch.equal(logical_blocks(dst, others), before[:, others])


@pytest.mark.parametrize("pull", PULLS)
def test_pull_consumer_refuses_what_cannot_convert_before_any_byte(pull):
    src = make_caches(layout="nhd", cross_layer=False, num_kv_heads=2)
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        for kind, match in (({"layout": "mla"}, r"an MLA latent cache and a K/V cache"),
                            ({"num_kv_heads": 3}, r"KV heads \(H\)"),
                            ({"block_size": 6}, r"block size \(N\) 4 vs 6: one must divide")):
            dst = make_caches(cross_layer=False, **kind)
            with pull.consumer(prod.port) as conn, pytest.raises(LayoutConversionError,
                                                                   match=match) as info:
                conn.register_kv_caches(dst)
            assert str(src.layout) in str(info.value) and str(dst.layout) in str(info.value)
        # fp8 only with the consumer's scales (quantize is opt-in).
        with pull.consumer(prod.port) as conn, pytest.raises(LayoutConversionError,
                                                               match=r"pass quantize=True"):
            conn.register_kv_caches(make_caches(cross_layer=False, dtype="fp8"))


@pytest.mark.parametrize("pull", PULLS)
def test_pull_bad_loads_are_refused_naming_the_argument(pull):
    src = make_caches(layout="nhd", cross_layer=False)
    keys = keys_for(random.randrange(2**31), 3)
    with pull.producer() as prod:
        prod.register_kv_caches(src)
        with pull.consumer(prod.port) as conn:
            conn.register_kv_caches(make_caches(layout="hnd", cross_layer=True, block_size=8))
            # 3 blocks of 4 tokens fill 2 blocks of 8 here.
            with pytest.raises(ValueError, match=r"keys has 3 entries, blocks of the peer's 4 "
                                                 r"tokens, which fill 2 block\(s\) .* 8 tokens"
                                                 r", but block_ids has 3"):
                conn.load(keys, [0, 1, 2])
            with pytest.raises(ValueError, match=r"block_ids\[1\]=12 is outside"):
                conn.load(keys, [0, 12])
    with pytest.raises(ValueError, match=r"tp=\(2, 2\) \(degree, rank\): TPRank.rank=2 is "
                                         r"outside the tensor-parallel degree 2"):
        pull.consumer(1234, tp=(2, 2))


# -- p2p: the receiver converts on load -------------------------------------------------------


@pytest.mark.parametrize("case", [
    (("nhd", False, 4, 2, None), ("hnd", True, 8, 2, None), 5),
    (("hnd", True, 8, 2, None), ("interleaved", False, 4, 2, None), 3),
    (("nhd", False, 4, 2, (2, 0)), ("nhd", True, 4, 4, None), 4),
], ids=["4nhd->8hnd-cross, partial last block", "8hnd-cross->4interleaved",
        "tp2 rank 0 -> tp1 (its heads)"])
def test_p2p_receiver_converts_on_load(case):
    (s_layout, s_cross, s_bs, s_heads, s_tp), (r_layout, r_cross, r_bs, r_heads, r_tp), n = case
    seed = random.randrange(2**31)
    src = make_caches(layout=s_layout, cross_layer=s_cross, block_size=s_bs,
                      num_kv_heads=s_heads, seed=seed)
    dst = make_caches(layout=r_layout, cross_layer=r_cross, block_size=r_bs,
                      num_kv_heads=r_heads)
    before = tokens_of(dst, list(range(dst.num_blocks)), dst.num_blocks * r_bs).clone()
    keys = keys_for(seed, n, block_size=s_bs)
    src_ids, dst_ids = [3, 4, 5, 9, 10][:n], [7, 0, 2, 11, 5, 6][:-(-n * s_bs // r_bs)]
    with pair(src, dst, tp=(s_tp, r_tp)) as (sender, receiver):
        assert receiver.plan is not None
        assert sender.save(keys, src_ids).wait(timeout=5).ok
        result = receiver.load(keys, dst_ids).wait(timeout=5)
        assert result.ok, result.failed
    num_tokens = n * s_bs
    # Expected: the receiver's tokens as before, with the sent tokens (and heads) in place.
    expected = before.view(*before.shape[:2], dst.num_blocks, r_bs, *before.shape[3:]).clone()
    sent = tokens_of(src, src_ids, num_tokens)
    heads = slice(0, sent.shape[3])  # TP2 rank 0 supplies heads 0-1 of 4
    for j, b in enumerate(dst_ids):
        t0, t1 = j * r_bs, min(num_tokens, (j + 1) * r_bs)
        expected[:, :, b, :t1 - t0, heads] = sent[:, :, t0:t1]
    after = tokens_of(dst, list(range(dst.num_blocks)), dst.num_blocks * r_bs)
    assert torch.equal(after.contiguous().view(torch.uint8),
                       expected.flatten(2, 3).contiguous().view(torch.uint8))
