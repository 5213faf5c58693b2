"""How many sandboxes start at once on one engine, counted across every pvisor-host process that uses it.

A start (the engine's start of a created container: the runtime's ``create`` and ``start``) holds one of a few
slots: lock files in the state directory, one
folder per engine, taken with ``flock`` so that a process that dies lets go of its slot with its last file
descriptor. More starts at once than the runtime can take only queue inside it, and worse: runc 1.1.5 was seen
here to hang in ``runc init`` when a dozen started together on 2 cores, with two batches side by side each
starting what its own workers allowed. So the number is the engine's host's, not each batch's: two batches
beside each other share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ...._log import logger
from ....signals import pause

#: Sandboxes starting at once on one engine, whatever the number of processes starting them.
START_SLOTS = max(2, os.cpu_count() or 2)
#: How often a start that found every slot taken looks again (seconds).
_POLL = 0.05


class StartSlots:
    """The start slots of one engine (see the module docstring)."""

    def __init__(self, folder: Path, slots: int = START_SLOTS) -> None:
        self.folder = folder
        self.slots = slots
        self._said = False

    @contextlib.contextmanager
    def holding(self, cancel: threading.Event | None = None) -> Iterator[None]:
        """Hold a slot for the block, waiting for one while they are all taken (a ``cancel`` ends the wait with
        :class:`Interrupted`)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = self._take(cancel)
        except OSError as exc:  # a state directory that cannot be written: starts go unshared rather than fail
            if not self._said:
                self._said = True
                logger.warning("sandboxes start without the engine's shared slots: {} ({})", self.folder, exc)
            yield
            return
        try:
            yield
        finally:
            handle.close()  # and with it the lock

    def _take(self, cancel: threading.Event | None) -> IO[str]:
        while True:
            for number in range(self.slots):
                handle = (self.folder / f"slot-{number}.lock").open("a")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                return handle
            pause(_POLL, cancel, "waiting to start a sandbox")
