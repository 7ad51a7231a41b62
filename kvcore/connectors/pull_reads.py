"""The consumer's side of a pull load in flight, for :mod:`kvcore.connectors.pull`.

:class:`LoadTask` is a load queued for a connector's loader thread (or run by the caller that
waits for it); :class:`Reads` is the READs of one lease, started, polled with the pauses
:func:`poll_pause` gives, and ended (read, failed, or given up at the deadline). Both work on
a :class:`~kvcore.connectors.pull.PullConnector` (``conn``: this module does not import it,
which imports this one) through its transfer library's
:class:`~kvcore.connectors.pull_engine.Engine`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvcore.connectors.base import TransferResult
from kvcore.connectors.pull_engine import Regions, Run

__all__ = ["POLL_PAUSE_MAX_S", "POLL_PAUSE_MIN_S", "LoadTask", "Reads", "poll_pause"]

#: The shortest and the longest pause between two polls of READs in flight (seconds).
POLL_PAUSE_MIN_S = 20e-6
POLL_PAUSE_MAX_S = 5e-3
#: The pause between polls as a fraction of the time the READs have taken so far.
_POLL_PAUSE_FRACTION = 0.125


def poll_pause(elapsed_s: float) -> float:
    """Seconds to pause before polling READs again that have been in flight ``elapsed_s``: an
    eighth of that, within :data:`POLL_PAUSE_MIN_S` .. :data:`POLL_PAUSE_MAX_S`. The same for
    every library: a READ that a copy engine finishes in a millisecond is seen finished within
    about 0.1 ms of it, one of a second costs some 200 polls, not thousands."""
    return min(POLL_PAUSE_MAX_S, max(POLL_PAUSE_MIN_S, _POLL_PAUSE_FRACTION * elapsed_s))


class LoadTask:
    """A load queued for the connector's loader thread, run by whichever comes first: that
    thread, or a caller that waits for it (:meth:`wait` with ``inline``)."""

    def __init__(self, unfinished: set[LoadTask], call: Callable[..., TransferResult],
                 *args: Any) -> None:
        self._call, self._args = call, args
        self._unfinished = unfinished  # the connector's: close() waits for them
        unfinished.add(self)
        self._claim = threading.Lock()  # taken by whoever runs it
        self.finished = threading.Event()
        self._result: TransferResult | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the load unless another thread took it."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            self._result = self._call(*self._args)
        except BaseException as exc:  # handed to the waiter, as a future would
            self._error = exc
        finally:
            self._call = self._args = None
            self.finished.set()
            self._unfinished.discard(self)

    def wait(self, timeout: float | None, inline: bool) -> bool:
        """Whether the load finished within ``timeout``; ``inline``: run it in this thread
        if the loader thread has not started it."""
        if inline:
            self.run()
        return self.finished.wait(timeout)

    def result(self) -> TransferResult:
        if self._error is not None:
            raise self._error
        return self._result


class Reads:
    """The READs of one lease: started, then polled until each is read, failed, or still in
    flight at ``deadline``. ``read``: the fetch indices read whole; ``errors``: why the
    others failed; ``timed_out``: those whose READ did not finish in time (they stay
    leased: a READ that could not be cancelled may still write).

    READs started before the lease exists (``lease=None``: from the blocks a lookup named,
    while the fetch is on the way) carry no notification. Once the fetch answered, the
    caller sets :attr:`lease` and :attr:`trusted`, the indices whose leased block and
    serial are the ones those READs were started from (a ``range``: all of them); when such
    a READ ends, the trusted entries count as read and are confirmed
    (:meth:`~kvcore.connectors.pull.PullConnector._confirm_entries`), or fail where it
    failed, and the others join :attr:`redo`: READ them again from the lease."""

    def __init__(self, conn: Any, lease: str | None, deadline: float) -> None:
        self.conn, self.lease, self.deadline = conn, lease, deadline
        self.read: list[int] = []
        self.errors: dict[int, str] = {}
        self.timed_out: set[int] = set()
        self.active: list[Run] = []
        self.posted = time.monotonic()  # when the last READs were started
        self.trusted: set[int] | range | None = None
        self.redo: list[int] = []

    def _fail(self, run: Run, why: str) -> None:
        self.errors.update((j, why) for j in range(run.first, run.end))

    def start(self, runs: list[Run], local: Regions) -> list[Run]:
        """Start the READ of each run into ``local``; returns those that could not start
        (failed, and over)."""
        conn = self.conn
        consumer, engine, timed = conn._consumer, conn._engine, conn._timed
        unstarted = []
        for run in runs:
            try:
                timed("start_read", engine.start_read, run, self.lease, local,
                      consumer.regions, consumer.remote)
                self.active.append(run)
            except Exception as exc:
                self._fail(run, f"{conn.label} READ could not start: {exc}")
                timed("release", engine.release, run)
                unstarted.append(run)
        self.posted = time.monotonic()
        return unstarted

    def poll(self) -> list[Run]:
        """Poll each READ in flight once; returns those that ended (read or failed)."""
        conn = self.conn
        consumer, engine, timed, label = conn._consumer, conn._engine, conn._timed, conn.label
        ended, still = [], []
        for run in self.active:
            state = timed("poll", engine.poll, run)
            if state == "PROC":
                still.append(run)
                continue
            ended.append(run)
            timed("release", engine.release, run)
            if state == "DONE" and consumer.failure is not None:
                # The producer ends the leases of a closed connection: the blocks may have
                # been handed on and rewritten during the READ.
                self._fail(run, f"the READ finished after the link went down "
                                f"({consumer.failure})")
            elif state == "DONE" and self.trusted is not None:
                self._settle_guessed(run)
            elif state == "DONE":
                self._count(run.first, run.end, conn._confirm(self.lease, run))
            else:
                self._failed(run, f"{label} READ from the producer failed: {state}")
        self.active = still
        return ended

    def _failed(self, run: Run, why: str) -> None:
        """A READ that ended in failure: its entries fail with ``why``; for a READ started
        before the lease, only those the lease holds at the blocks it READ (the others are
        to READ again from the lease)."""
        trusted = self.trusted
        if trusted is None or isinstance(trusted, range):
            self._fail(run, why)
            return
        for j in range(run.first, run.end):
            if j in trusted:
                self.errors[j] = why
            else:
                self.redo.append(j)

    def _settle_guessed(self, run: Run) -> None:
        """A READ started before the lease ended: its trusted entries count as read once
        confirmed, in stretches of consecutive ones; the others are to READ again."""
        trusted = self.trusted
        if isinstance(trusted, range):  # every entry (the common case): one stretch
            self._confirm_stretch(run.first, run.end)
            return
        first = None
        for j in range(run.first, run.end + 1):
            if j < run.end and j in trusted:
                if first is None:
                    first = j
                continue
            if first is not None:
                self._confirm_stretch(first, j)
                first = None
            if j < run.end:
                self.redo.append(j)

    def _confirm_stretch(self, first: int, end: int) -> None:
        """Entries ``first..end-1``, read by a READ that carried no notification: confirmed
        now (:meth:`_count`)."""
        self._count(first, end, self.conn._confirm_entries(self.lease, first, end))

    def _count(self, first: int, end: int, unconfirmed: str | None) -> None:
        """Entries ``first..end-1``, read: they count where the producer took the
        confirmation (``unconfirmed`` is ``None``), else they fail with why."""
        if unconfirmed is None:
            self.read.extend(range(first, end))
            return
        why = (f"{self.conn.label} READ finished, but the producer did not take the "
               f"confirmation ({unconfirmed}), so its blocks may have changed meanwhile")
        self.errors.update((i, why) for i in range(first, end))

    def wait(self) -> None:
        """Poll until no READ is in flight; those still in flight at the deadline fail."""
        conn = self.conn
        while self.active:
            self.poll()
            if self.active and time.monotonic() >= self.deadline:
                self.expire(f"{conn.label} READ did not finish within "
                            f"timeout_s={conn.timeout_s}")
            elif self.active:
                self.pause()

    def expire(self, why: str) -> None:
        """Give up the READs still in flight (cancelled where the library can), failing
        their blocks with ``why``."""
        conn = self.conn
        for run in self.active:
            because = why
            if not conn._timed("release", conn._engine.release, run):
                because += ("; the READ could not be cancelled, so these blocks may still "
                            "change: do not reuse them before close()")
            self._fail(run, because)
            # Not given back: the producer keeps them until the lease ends, beyond any READ
            # that could not be cancelled.
            self.timed_out.update(range(run.first, run.end))
        self.active = []

    def pause(self) -> None:
        """Pause before the next poll as :func:`poll_pause` says (not past the deadline)."""
        now = time.monotonic()
        self.conn._pause(min(poll_pause(now - self.posted), max(0.0, self.deadline - now)))

    def give_back(self) -> None:
        """Hand the entries whose READ failed (and is over) back to the producer."""
        finished = sorted(set(self.errors) - self.timed_out)  # readable again
        if finished:
            self.conn._give_back(self.lease, finished)
