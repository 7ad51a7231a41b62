"""Notices for long first-use steps: a JIT or extension build, kernel compiles, pinning memory.

A step that is slow only the first time (its result is cached) runs inside :func:`long_step`.
If it ends quickly (the cache was warm) nothing is printed; if it is still running after
``after_s`` seconds, one line on ``sys.stderr`` says what is being built, about how long the
first use takes and where the result is cached, and a second line says how long it took::

    kvcore: compiling FlashInfer's decode kernels (bfloat16, 4/2 heads of 64) -- first use
    only, about 1-2 min; cached in /root/.cache/flashinfer, reused by later runs
    kvcore: compiling FlashInfer's decode kernels (bfloat16, 4/2 heads of 64): done in 93.2 s

The lines go to the terminal only: not when stderr is redirected, not with
``KVCORE_PROGRESS=0`` or after ``set_progress(False)`` (``kvcore demo --no-progress``), and
always with ``KVCORE_PROGRESS=1`` (a log of a scripted run). The same text is logged at INFO
level on the ``kvcore.progress`` logger whatever the setting, for engines that keep logs.

A leaf module: it imports nothing of kvcore and no torch, so plugins and connectors use it
(through ``kvcore.long_step``) without import cost.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["long_step", "progress_enabled", "set_progress"]

logger = logging.getLogger(__name__)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: ``set_progress``'s override of ``KVCORE_PROGRESS`` (``None``: no override).
_override: bool | None = None


def set_progress(enabled: bool | None) -> bool | None:
    """Turn the notices of :func:`long_step` on or off for this process (``None``: back to
    ``KVCORE_PROGRESS``, by default on when stderr is a terminal). Returns the previous
    override, so a caller can restore it."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    previous, _override = _override, enabled
    return previous


def progress_enabled() -> bool:
    """Whether :func:`long_step` prints: :func:`set_progress`'s override, else
    ``KVCORE_PROGRESS`` (``1`` always, ``0`` never, ``auto`` or unset: when stderr is a
    terminal).

    Raises:
        ValueError: ``KVCORE_PROGRESS`` has another value.
    """
    if _override is not None:
        return _override
    value = os.environ.get("KVCORE_PROGRESS", "auto").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value in ("", "auto"):
        isatty = getattr(sys.stderr, "isatty", None)
        return bool(isatty and isatty())
    raise ValueError(f"KVCORE_PROGRESS={value!r} (supported: 1, 0, auto); unset it for the "
                     "default (notices on a terminal only)")


def _say(text: str, show: bool) -> None:
    logger.info("%s", text)
    if show:
        print(f"kvcore: {text}", file=sys.stderr, flush=True)


@contextmanager
def long_step(what: str, *, estimate: str | None = None, cache: str | os.PathLike | None = None,
              after_s: float = 1.0) -> Iterator[None]:
    """Run the body as a step that may be long the first time; announce it if it is.

    Args:
        what: what is being built, for a user: ``"compiling FlashInfer's decode kernels
            (bfloat16, 32/8 heads of 128)"``.
        estimate: how long the first use usually takes, e.g. ``"about 1-2 min"``.
        cache: where the result is kept for later runs (a directory).
        after_s: seconds to wait before announcing: a step that ends sooner (its cache was
            warm) prints nothing. ``0`` announces at once.
    """
    if not what:
        raise ValueError("what must name the step, e.g. \"compiling X's kernels\"")
    if after_s < 0:
        raise ValueError(f"after_s={after_s!r} must be >= 0 (seconds before the notice)")
    show = progress_enabled()
    details = [part for part in (
        f"first use only, {estimate}" if estimate else None,
        f"cached in {os.fspath(cache)}, reused by later runs" if cache is not None else None)
        if part]
    start_text = what + (f" -- {'; '.join(details)}" if details else "") + " ..."
    lock = threading.Lock()
    state = "running"  # -> "announced" when the notice is out, "ended" when the body is

    def announce() -> None:
        nonlocal state
        with lock:
            if state == "ended":
                return
            state = "announced"
        _say(start_text, show)

    started = time.perf_counter()
    timer = None
    if after_s == 0:
        announce()
    else:
        timer = threading.Timer(after_s, announce)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            was_announced = state == "announced"
            state = "ended"
        if was_announced:
            _say(f"{what}: done in {time.perf_counter() - started:.1f} s", show)
