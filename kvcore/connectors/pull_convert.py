"""A converting load of the pull connectors (:mod:`kvcore.connectors.pull`): the producer's
blocks READ into the consumer's staging buffer in the producer's layout, chunk by chunk, and
each chunk converted into the consumer's cache by one gather
(:meth:`~kvcore.connectors.convert.ConversionPlan.prepare`). Works on a
:class:`~kvcore.connectors.pull.PullConnector` (``conn``: this module does not import it,
which imports this one), as :mod:`~kvcore.connectors.pull_reads` does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore.connectors.pull_channel import ChannelError
from kvcore.connectors.pull_engine import all_published, spans
from kvcore.connectors.pull_reads import Reads

__all__ = ["gather_in_place", "read_converting"]

# The connector's logger: what goes wrong here is the connector's to report.
logger = logging.getLogger("kvcore.connectors.pull")


def read_converting(conn: Any, keys: list[str], block_ids: list[int], deadline: float
                    ) -> tuple[list[int], dict[int, str], int]:
    """READ the producer's blocks into the staging buffer, as many whole groups of the
    plan at a time as a part of it holds, and convert each chunk into ``block_ids`` with
    one gather (:meth:`ConversionPlan.prepare`; :meth:`ConversionPlan.apply_keys` for a
    chunk whose keys were not all read).

    One ``fetch`` leases every key of the load, and every chunk's gather is prepared
    (checks, ids on the device) while its answer is on the way: between the READs only
    launches are left. With two parts (``staging_buffers=2`` and room for two groups),
    the chunks alternate between them: a chunk's READ starts as soon as its part is free
    (the gather of the chunk before in it has read it), so the READs of the first two
    start at once, and the READ of one chunk overlaps the gather of another. On a GPU the
    gathers run on the connector's stream, an event per part telling when its last
    gather has read it; on the CPU a gather runs when its chunk arrived. The host waits
    for the device only for a part it is about to READ into while nothing else is in
    flight, and for the connector's stream when the load ends. Keys the producer had not
    published at the fetch are asked for again while their chunk is read (chunk by chunk,
    in turn).
    """
    plan, staging, stream = conn._plan, conn._staging, conn._gather_stream
    cache, scales, halves = conn._reg.kv_caches, conn._kv_scales, conn._halves
    on_stream = ((lambda: torch.cuda.stream(stream)) if stream is not None
                 else contextlib.nullcontext)
    per_group = plan.group_tokens // plan.src_block_size
    dst_per_group = plan.group_tokens // plan.dst_block_size
    size = conn._staging_blocks // per_group // halves * per_group
    # Per chunk: its first key, the staging blocks its keys land in, its destination.
    chunks: list[tuple[int, list[int], list[int]]] = []
    for n, k0 in enumerate(range(0, len(keys), size)):
        count, base = min(size, len(keys) - k0), n % halves * size
        d0 = k0 // per_group * dst_per_group
        chunks.append((k0, list(range(base, base + count)),
                       block_ids[d0:d0 + plan.blocks_for_keys(count)]))
    prepared: list[Callable[[], int] | None] = [None] * len(chunks)

    def prepare() -> None:
        with on_stream():  # the ids' copies on the stream the gathers run on
            for n, (_, slots, dst) in enumerate(chunks):
                try:
                    prepared[n] = plan.prepare(staging, cache, slots, dst,
                                               len(slots) * plan.src_block_size,
                                               dst_scales=scales)
                except Exception:  # apply_keys raises it again for that chunk
                    pass

    loaded: list[int] = []
    failed: dict[int, str] = {}
    nbytes = 0
    gathered: list[torch.cuda.Event | None] = [None] * halves

    def convert(n: int, read: set[int], errors: dict[int, str]) -> None:
        """Convert chunk ``n``, of which keys ``read`` (indices in the chunk) arrived."""
        nonlocal nbytes
        k0, slots, dst = chunks[n]
        with on_stream():
            if len(read) == len(slots) and prepared[n] is not None:  # the common case
                written, missing = dst, {}
                moved = conn._timed("gather", prepared[n])
            else:  # some keys failed: the groups they leave whole
                arrived = [i in read for i in range(len(slots))]
                written, missing, moved = conn._timed(
                    "gather", lambda: plan.apply_keys(staging, cache, slots, dst, arrived,
                                                      dst_scales=scales))
            if written and stream is not None:
                gathered[n % halves] = stream.record_event()
        loaded.extend(written)
        nbytes += moved
        for block, i in missing.items():
            failed[block] = (f"source block {k0 + i} of the load (key "
                             f"{keys[k0 + i][:12]}..): {errors.get(i, 'not read')}")

    conn._take_guesses(keys)  # (READs into the staging buffer wait for the lease)
    with conn._staging_lock:
        try:
            lease, blocks, _ = conn._fetch(keys, deadline, while_waiting=prepare)
        except ChannelError as exc:
            lease, blocks, why = None, [None] * len(keys), str(exc)
        # The first key of the chunks whose READs were not started: those go back to the
        # producer if the load raises or runs out of time before them.
        untouched = [0]
        try:
            if lease is None:  # the fetch failed: nothing is READ
                for n, (_, slots, _) in enumerate(chunks):
                    convert(n, set(), dict.fromkeys(range(len(slots)), why))
            elif all_published(blocks, conn._consumer.num_blocks):
                _convert_overlapped(conn, lease, blocks, chunks, deadline, convert,
                                         gathered, untouched)
            else:
                for n, (k0, slots, _) in enumerate(chunks):
                    half = n % halves
                    if gathered[half] is not None:  # its last gather has read that part
                        conn._timed("wait", gathered[half].synchronize)
                    untouched[0] = k0 + len(slots)
                    read, errors = conn._pull(
                        keys[k0:k0 + len(slots)], slots, conn._staging_regions, deadline,
                        fetched=(lease, blocks[k0:k0 + len(slots)], k0))
                    convert(n, read, errors)
        finally:
            if lease is not None and untouched[0] < len(keys):  # the rest goes back
                conn._give_back(lease, [k for k in range(untouched[0], len(keys))
                                        if blocks[k] is not None])
            if stream is not None:  # the blocks are converted when the load reports them
                conn._timed("wait", stream.synchronize)
    return loaded, failed, nbytes

def _convert_overlapped(conn: Any, lease: str, blocks: list[int],
                       chunks: list[tuple[int, list[int], list[int]]], deadline: float,
                       convert: Callable[[int, set[int], dict[int, str]], None],
                       gathered: list[torch.cuda.Event | None], untouched: list[int]
                       ) -> None:
    """:func:`read_converting` when the fetch leased every key: READ the chunks into
    their parts of the staging buffer, each as soon as that part is free, and
    ``convert`` each once its READs ended. ``untouched[0]``: the first key of the chunks
    not started yet."""
    halves = conn._halves
    runs = [spans(k0, blocks[k0:k0 + len(slots)], slots) for k0, slots, _ in chunks]
    chunk_of = {run.first: n for n, chunk_runs in enumerate(runs) for run in chunk_runs}
    left = [len(chunk_runs) for chunk_runs in runs]  # READs not ended, per chunk
    reads = Reads(conn, lease, deadline)
    started = converted = 0  # chunks whose READs started; chunks converted (in order)

    def convert_read(n: int) -> None:
        k0, slots, _ = chunks[n]
        errors = {j - k0: why for j, why in reads.errors.items() if k0 <= j < k0 + len(slots)}
        convert(n, set(range(len(slots))) - set(errors), errors)

    try:
        while converted < len(chunks):
            # Start the next chunks while their part is free: the chunk before in it is
            # converted, and its gather (on a GPU) has read it.
            while started < len(chunks) and started - halves < converted:
                event = gathered[started % halves]
                if event is not None and not event.query():
                    break
                for run in reads.start(runs[started], conn._staging_regions):
                    left[chunk_of[run.first]] -= 1
                started += 1
                untouched[0] = chunks[started - 1][0] + len(chunks[started - 1][1])
            if not reads.active and converted == started:
                # Nothing in flight: the next part's last gather is all to wait for.
                conn._timed("wait", gathered[started % halves].synchronize)
                continue
            for run in reads.poll():
                left[chunk_of[run.first]] -= 1
            while converted < started and not left[converted]:
                convert_read(converted)
                converted += 1
            if reads.active and time.monotonic() >= deadline:
                reads.expire(f"{conn.label} READ did not finish within "
                             f"timeout_s={conn.timeout_s}")
                for n in range(converted, started):
                    convert_read(n)
                why = f"{conn.label} READ not started within timeout_s={conn.timeout_s}"
                for n in range(started, len(chunks)):  # (the caller gives them back)
                    convert(n, set(), dict.fromkeys(range(len(chunks[n][1])), why))
                break
            if reads.active and left[converted]:
                reads.pause()
    finally:
        reads.expire("the load raised while this READ was in flight")
        reads.give_back()


def gather_in_place(conn: Any, keys: list[str], block_ids: list[int], deadline: float
                    ) -> tuple[list[int], dict[int, str], int]:
    """A converting load that reads the producer's cache where it lies (mapped into this
    process: :attr:`~kvcore.connectors.pull.PullConnector.converts_in_place`): one gather
    from the producer's leased blocks into ``block_ids``, one pass over the memory, no
    READ and no staging buffer.

    The fetch leases the keys. Where lookups named every key's block, the gather from those
    blocks is launched while the fetch's answer is on the way (as READs start from them,
    :meth:`~kvcore.connectors.pull.PullConnector._pull_guessed`); a group of the plan with a
    key the lease holds elsewhere or under another publication serial is gathered again from
    the lease, after it and over what it wrote. Otherwise the gather runs once the fetch
    answered. Keys not published yet are asked for again, with pauses, until ``deadline``; a
    group whose keys are not all leased by then fails (written or not). Once the gathers ran
    (the host waits for them), the leased entries they read are confirmed with a quiet
    ``done`` on the side channel (no answer, as a READ's notification has none; a library's
    notification could sit unsent here, where no READ drives the library), so the producer
    reuses those blocks only after the gather read them; the entries of groups not written go
    back to the producer. As a READ, they count while the link is up: a destination block
    whose confirmation could not be sent, or whose link went down, fails with that reason (its
    source may have changed during the gather). Returns the destination blocks written, the
    failed ones with why, and the bytes written.
    """
    plan, source, cache, scales = conn._plan, conn._source, conn._reg.kv_caches, conn._kv_scales
    stream = conn._gather_stream
    on_stream = ((lambda: torch.cuda.stream(stream)) if stream is not None
                 else contextlib.nullcontext)
    n, num_tokens = len(keys), len(keys) * plan.src_block_size
    num_blocks = conn._consumer.num_blocks
    guesses = conn._take_guesses(keys)
    if guesses is not None and not all_published(guesses[0], num_blocks):
        guesses = None  # (not every key named: gather once the lease says where they are)
    early = [0, False]  # bytes the gather from the lookups' blocks wrote; launched

    def gather_early() -> None:
        # (a failure here leaves the gather to after the fetch's answer, which raises it
        # again if it persists)
        def launch() -> None:
            early[:] = run(), True  # (set here: a timing hook that raises comes after)

        try:
            with on_stream():
                run = conn._timed("prepare", lambda: plan.prepare(
                    source, cache, guesses[0], block_ids, num_tokens, dst_scales=scales))
                conn._timed("gather", launch)
        except Exception as exc:
            logger.warning("%s consumer: the gather from the blocks a lookup named failed "
                           "(%s); gathering once the fetch answered", conn.transport, exc)

    src: list[int | None] = [None] * n  # the producer's block of each key, once leased
    serial: list[int | None] = [None] * n  # and its publication's serial
    # (lease, entry) of each leased key; or, when the first fetch leased every key (entry i
    # is key i), that lease alone
    where: list[tuple[str, int] | None] | str = [None] * n
    errors: dict[int, str] = {}
    todo, pause, first = list(range(n)), 0.002, True
    try:
        if guesses is not None:  # launched before the fetch: its round trip runs under it
            gather_early()
        while todo:
            try:
                lease, blocks, serials = conn._fetch([keys[i] for i in todo] if not first
                                                     else keys, deadline)
            except ChannelError as exc:
                errors.update((i, str(exc)) for i in todo)
                break
            if first and all_published(blocks, num_blocks):  # the common case
                src, serial, where, todo = blocks, serials, lease, []
                break
            first, later, refused = False, [], []
            for j, (i, block) in enumerate(zip(todo, blocks, strict=True)):
                if block is None:
                    later.append(i)
                elif type(block) is int and 0 <= block < num_blocks:
                    src[i], serial[i], where[i] = block, serials[j], (lease, j)
                else:
                    errors[i] = f"the producer named block {block!r}"
                    refused.append(j)
            if refused:
                conn._give_back(lease, refused)
            todo = later
            if todo and time.monotonic() + max(pause, min(0.25, conn.timeout_s / 4)) >= deadline:
                why = (f"not published by the producer at {conn.host}:{conn.port} within "
                       f"timeout_s={conn.timeout_s}")
                errors.update((i, why) for i in todo)
                break
            if todo:
                conn._pause(pause)
                pause = min(2 * pause, 0.05)
        with on_stream():
            if early[1] and src == guesses[0] and serial == guesses[1]:  # the common case
                written, missing, nbytes = block_ids, {}, early[0]
            elif early[1]:
                written, missing, nbytes = _gather_again(conn, keys, block_ids, src, serial,
                                                         guesses, early[0])
            elif isinstance(where, str):  # the first fetch leased every key: one gather
                written, missing = block_ids, {}
                run = conn._timed("prepare", lambda: plan.prepare(
                    source, cache, src, block_ids, num_tokens, dst_scales=scales))
                nbytes = conn._timed("gather", run)
            else:
                arrived = [s is not None for s in src]
                written, missing, nbytes = conn._timed(
                    "gather", lambda: plan.apply_keys(
                        source, cache, [s or 0 for s in src], block_ids, arrived,
                        dst_scales=scales))
        if stream is not None and (written or early[1]):  # read whole before any reuse
            conn._timed("wait", stream.synchronize)
    except BaseException:
        if stream is not None:  # no gather of this load may write after it failed
            stream.synchronize()
        _settle(conn, where, set(), n)
        raise
    if missing:  # the keys of the groups written
        done = set(written)
        kept = {i for keys_of_group, dst in plan.key_groups(n) if block_ids[dst.start] in done
                for i in keys_of_group}
    else:
        kept = range(n)
    unconfirmed = _settle(conn, where, kept, n)
    down = conn._consumer.failure
    if down is not None:  # the producer ends a closed link's leases at once
        unconfirmed.update((i, f"the link went down: {down}") for i in kept)
    failed = {block: f"source block {i} of the load (key {keys[i][:12]}..): "
                     f"{errors.get(i, 'not read')}" for block, i in missing.items()}
    if unconfirmed:
        keys_of: dict[int, int] = {}  # each destination block: its group's key count
        for keys_of_group, dst in plan.key_groups(n):
            keys_of.update(dict.fromkeys(block_ids[dst], len(keys_of_group)))
            i = next((k for k in keys_of_group if k in unconfirmed), None)
            if i is None:
                continue
            for block in block_ids[dst]:
                failed[block] = (f"source block {i} of the load (key {keys[i][:12]}..) was "
                                 f"gathered, but the producer did not take the confirmation "
                                 f"({unconfirmed[i]}), so its block may have changed meanwhile")
        counted = [b for b in written if b not in failed]
        nbytes = nbytes * sum(keys_of[b] for b in counted) // sum(keys_of[b] for b in written)
        written = counted
    return list(written), failed, nbytes


def _gather_again(conn: Any, keys: list[str], block_ids: list[int], src: list[int | None],
                  serial: list[int | None], guesses: tuple[list[int], list[int]],
                  early_bytes: int) -> tuple[list[int], dict[int, int], int]:
    """After a gather from the blocks lookups named, where the lease differs: gather again,
    from the lease, the groups with a key held elsewhere or under another serial (on the
    current stream, after the first gather). Returns what
    :meth:`~kvcore.connectors.convert.ConversionPlan.apply_keys` does for the whole load:
    the destination blocks of the groups whose keys are all leased, the first unleased key
    of each other group's blocks, and the bytes written."""
    plan, n = conn._plan, len(keys)
    groups = plan.key_groups(n)
    leased, stale = set(), set()  # groups with every key leased; with a key not as named
    for g, (members, _) in enumerate(groups):
        if all(src[i] is not None for i in members):
            leased.add(g)
        if any(src[i] != guesses[0][i] or serial[i] != guesses[1][i] for i in members):
            stale.add(g)
    redo = leased & stale
    nbytes = 0
    if redo:
        arrived = [False] * n
        for g in redo:
            arrived[groups[g][0].start:groups[g][0].stop] = [True] * len(groups[g][0])
        _, _, nbytes = conn._timed("gather", lambda: plan.apply_keys(
            conn._source, conn._reg.kv_caches, [s or 0 for s in src], block_ids, arrived,
            dst_scales=conn._kv_scales))
    written, missing = [], {}
    for g, (members, dst) in enumerate(groups):
        if g in leased:
            written.extend(block_ids[dst])
        else:
            lost = next(i for i in members if src[i] is None)
            missing.update(dict.fromkeys(block_ids[dst], lost))
    untouched = leased - redo  # written by the first gather alone: their share of its bytes
    share = early_bytes * sum(len(groups[g][0]) for g in untouched) // n
    return written, missing, nbytes + share


def _settle(conn: Any, where: list[tuple[str, int] | None] | str, kept: set[int] | range,
            n: int) -> dict[int, str]:
    """End the leases of a gather in place: confirm the entries of the keys ``kept`` (read
    by it), in stretches of consecutive entries, and give the others back. ``where``: each
    of the ``n`` keys' ``(lease, entry)``, or one lease whose entry ``i`` is key ``i``.
    Returns the kept keys whose confirmation could not be sent, with why."""
    if isinstance(where, str):
        if isinstance(kept, range):  # every key read: one confirmation
            why = conn._done(where, 0, len(kept), quiet=True) if kept else None
            return {} if why is None else dict.fromkeys(kept, why)
        where = [(where, i) for i in range(n)]
    per_lease: dict[str, list[tuple[int, int]]] = {}
    for i, place in enumerate(where):
        if place is not None:
            per_lease.setdefault(place[0], []).append((place[1], i))
    unconfirmed: dict[int, str] = {}
    for lease, entries in per_lease.items():
        entries.sort()
        back = [j for j, i in entries if i not in kept]
        if back:
            conn._give_back(lease, back)
        confirm = [(j, i) for j, i in entries if i in kept]
        start = 0
        for end in range(1, len(confirm) + 1):
            if end < len(confirm) and confirm[end][0] == confirm[end - 1][0] + 1:
                continue
            why = conn._done(lease, confirm[start][0], confirm[end - 1][0] + 1, quiet=True)
            if why is not None:
                unconfirmed.update((i, why) for _, i in confirm[start:end])
            start = end
    return unconfirmed
