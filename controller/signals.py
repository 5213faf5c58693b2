"""Interrupt handling: SIGTERM (and SIGHUP) behave like Ctrl-C, and cleanup cannot be interrupted, within reason.

While :func:`deferred_interrupts` is active, SIGINT and SIGTERM are only noted; the block (removing a
container, say) always finishes. If an interrupt arrived and no exception was already on its way out,
``KeyboardInterrupt`` is raised when the block ends, so the user's request is never lost.

An engine that stops answering would hold such a block for good. So a second interrupt insists: where the
process asked for it (the CLI: :func:`give_up_when_insisted`), it exits with 130 at most :data:`GIVE_UP_AFTER`
seconds later whatever the cleanup is waiting for, naming what it could not remove (:func:`cleaning` notes
what is being removed); the next run into the same ``--out``, or ``pvisor-host gc``, removes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

from .errors import Interrupted

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds a second interrupt leaves the cleanup before the process exits anyway.
GIVE_UP_AFTER = 8.0


class _Insisting:
    """How many interrupts the process got, what its cleanup is removing now, and whether to give up."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a signal handler may run while the main thread holds it (``cleaning``)
        self.interrupts = 0
        self.enabled = False
        self.timer: threading.Timer | None = None
        self.cleaning: dict[int, str] = {}
        self.next = 0

    def interrupted(self) -> None:
        with self.lock:
            self.interrupts += 1
            if not self.enabled or self.interrupts < 2 or self.timer is not None:
                return
            self.timer = threading.Timer(GIVE_UP_AFTER, self.give_up)
            self.timer.daemon = True
            self.timer.start()
        _say(f"pvisor-host: interrupted again: waiting at most {GIVE_UP_AFTER:.0f} s more for the cleanup")

    def settle(self) -> None:
        """The cleanup a second interrupt hurried has ended by itself: no reason left to cut what follows short
        (the reports being written). Another interrupt arms the timer again."""
        with self.lock:
            timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    def give_up(self) -> None:
        with self.lock:
            left = sorted(set(self.cleaning.values()))
        if left:
            _say(
                f"pvisor-host: gave up waiting for the engine; not removed: {', '.join(left)} (the next run into "
                "the same --out, or pvisor-host gc, removes them)"
            )
        else:
            _say("pvisor-host: gave up waiting for the cleanup")
        os._exit(130)


_INSISTING = _Insisting()


def _say(line: str) -> None:
    """Write ``line`` to stderr without ever waiting on it (a full pipe nobody reads must not hold the exit)."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stderr.fileno()
        blocking = os.get_blocking(fd)
        os.set_blocking(fd, False)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.set_blocking(fd, blocking)


def give_up_when_insisted() -> None:
    """Exit with 130 within :data:`GIVE_UP_AFTER` seconds of a second interrupt, whatever the cleanup waits for
    (the CLI asks for this; a library embedding pvisor-host decides for itself)."""
    _INSISTING.enabled = True


@contextlib.contextmanager
def cleaning(what: str) -> Iterator[None]:
    """Note that ``what`` (``container NAME``) is being removed while the block runs, for the line a process that
    gives up says (any thread)."""
    with _INSISTING.lock:
        key = _INSISTING.next
        _INSISTING.next += 1
        _INSISTING.cleaning[key] = what
    try:
        yield
    finally:
        with _INSISTING.lock:
            _INSISTING.cleaning.pop(key, None)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    _INSISTING.interrupted()
    raise KeyboardInterrupt


def install_sigterm_as_interrupt() -> None:
    """Make SIGTERM — and SIGHUP (a closed terminal), unless ignored as under ``nohup`` — raise
    ``KeyboardInterrupt`` in the main thread, like Ctrl-C, so that cleanup runs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
            signal.signal(signal.SIGHUP, _raise_interrupt)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # counted (an ignored one stays so)
            signal.signal(signal.SIGINT, _raise_interrupt)


def ignore_interrupts() -> None:
    """Ignore SIGINT, SIGTERM and SIGHUP from now on (the process is about to exit with a decided code)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def deferred_interrupts(*, reraise: bool = True, hurry: Callable[[], None] | None = None) -> Iterator[None]:
    """Defer SIGINT, SIGTERM and SIGHUP until the block is done (a no-op outside the main thread); an
    ignored signal stays ignored. With ``reraise=False`` an interrupt received meanwhile is dropped: for work
    that finishes something already over, where an interrupt has nothing left to stop. ``hurry`` is called
    at each one (the user insists: the block should skip what it may, waits on pulls say)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        _INSISTING.interrupted()
        if hurry is not None:
            hurry()

    previous = {sig: signal.getsignal(sig) for sig in _HANDLED if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, note)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _INSISTING.settle()
    if received and reraise and sys.exc_info()[1] is None:
        raise KeyboardInterrupt


def pause(seconds: float, cancel: threading.Event | None, what: str) -> None:
    """Wait ``seconds`` (a backoff, a poll), cut short by ``cancel`` (the batch's end, or Ctrl-C seen by another
    thread) with :class:`~pvisor_host.errors.Interrupted`: ``interrupted while <what>``. Without ``cancel``, the
    wait is the calling thread's, and Ctrl-C reaches it as ``KeyboardInterrupt``."""
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise Interrupted(f"interrupted while {what}")
