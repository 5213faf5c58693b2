"""Interrupt handling: SIGTERM (and SIGHUP) behave like Ctrl-C, and cleanup cannot be interrupted.

While :func:`deferred_interrupts` is active, SIGINT and SIGTERM are only noted; the block (removing a
container, say) always finishes. If an interrupt arrived and no exception was already on its way out,
``KeyboardInterrupt`` is raised when the block ends, so the user's request is never lost.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def install_sigterm_as_interrupt() -> None:
    """Make SIGTERM — and SIGHUP (a closed terminal), unless ignored as under ``nohup`` — raise
    ``KeyboardInterrupt`` in the main thread, like Ctrl-C, so that cleanup runs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
            signal.signal(signal.SIGHUP, _raise_interrupt)


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
    if received and reraise and sys.exc_info()[1] is None:
        raise KeyboardInterrupt
