"""Collect stage: bring a finished sandbox's logs and trees (pvisor's output and state, the workspace) out.

Everything is already on the host: the sandbox wrote its output streams to the staging directory's
``logs/`` and its trees through its bind mounts. Once it has stopped, the logs are copied with a cap per
stream (the end of stdout, where pvisor prints its result, is read whatever the length), and the trees are
harvested, judged entry by entry as untrusted (:func:`pvisor_host.files.archive.harvest_tree`), under one
byte budget for the whole attempt: no round trip through the engine for either.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import IO

from pydantic import BaseModel

from ...._log import logger
from ....files.archive import Budget, ExtractReport, harvest_tree
from ....units import format_size
from .stage import LOG_FILES

#: Logs beyond this many bytes per stream are cut (the record says so).
LOG_LIMIT = 64 * 1024 * 1024
#: The end of stdout read whatever its length (pvisor prints its result last).
TAIL = 1024 * 1024


class Collected(BaseModel):
    """What came out of one sandbox."""

    reports: dict[str, ExtractReport] = {}
    """Tree name (``output``, ``state``, ``workspace``) → what its extraction wrote and skipped."""


def collect_logs(staged: Path, logs: Path, *, limit: int = LOG_LIMIT) -> tuple[bool, bytes]:
    """Copy the sandbox's stdout and stderr from ``staged`` to ``logs``, each cut at ``limit`` bytes. Returns
    whether one was cut, and the end of stdout, where pvisor's result line is even when a flood filled it."""
    logs.mkdir(exist_ok=True)
    truncated = False
    tail = b""
    for name in LOG_FILES:
        source, size = _open_log(staged / name)
        with source, (logs / name).open("wb") as sink:
            left = limit
            while left > 0 and (chunk := source.read(min(left, 2**20))):
                sink.write(chunk)
                left -= len(chunk)
            truncated = truncated or size > limit
            if name == "stdout.log":
                source.seek(max(0, size - TAIL))
                tail = source.read(TAIL)
    return truncated, tail


def _open_log(path: Path) -> tuple[IO[bytes], int]:
    """A log file the sandbox wrote, read as untrusted: the files are ours and the sandbox user cannot replace
    them, but a sandbox let run as root could have; anything but a regular file reads as an empty stream.
    Returns the file and its size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone, or a symbolic link
        return io.BytesIO(), 0
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a FIFO, say
        os.close(fd)
        return io.BytesIO(), 0
    return os.fdopen(fd, "rb"), info.st_size


def collect_trees(trees: dict[str, Path], run_dir: Path, limit: int) -> Collected:
    """Copy each of ``trees`` (name → its directory in the staging area) to ``run_dir/<name>``, within
    ``limit`` bytes in all. A tree the sandbox never created is left out."""
    budget = Budget(limit)
    collected = Collected()
    for name, path in trees.items():
        if not path.is_dir() or path.is_symlink():
            continue  # pvisor failed before creating it
        collected.reports[name] = harvest_tree(path, run_dir / name, budget)
    if budget.exhausted:
        limit_text = format_size(limit)
        logger.warning("the collect limit ({}) was reached; record.json lists what was not collected", limit_text)
    return collected
