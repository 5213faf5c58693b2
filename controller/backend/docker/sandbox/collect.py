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
from ....files.archive import Budget, ExtractReport, harvest_tree, snapshot_tree
from ....files.patch import write_patch
from ....files.trees import Entry, WorkspaceChanges, diff_trees
from ....models.spec import Collect
from ....units import format_size
from .stage import LOG_FILES

#: With ``--collect changes``: the patch from the starting workspace to the final one, in the run directory.
PATCH_NAME = "workspace.patch"

#: Logs beyond this many bytes per stream are cut (the record says so).
LOG_LIMIT = 64 * 1024 * 1024
#: The end of stdout read whatever its length (pvisor prints its result last).
TAIL = 1024 * 1024


class Collected(BaseModel):
    """What came out of one sandbox."""

    reports: dict[str, ExtractReport] = {}
    """Tree name (``output``, ``state``, ``workspace``) → what its extraction wrote and skipped."""
    changes: WorkspaceChanges | None = None
    """What the replay added, changed and removed in the workspace (whatever was collected of it)."""
    patch: int | None = None
    """With ``--collect changes``: the bytes of ``workspace.patch``."""


def collect_logs(staged: Path, logs: Path, *, limit: int = LOG_LIMIT) -> tuple[bool, bytes]:
    """Copy the sandbox's stdout and stderr from ``staged`` to ``logs``, each cut at ``limit`` bytes. Returns
    whether one was cut, and the end of stdout, where pvisor's result line is even when a flood filled it."""
    logs.mkdir(exist_ok=True)
    truncated = False
    tail = b""
    for name in LOG_FILES:
        cut, end = copy_log(staged / name, logs / name, limit=limit, tail=TAIL)
        truncated = truncated or cut
        if name == "stdout.log":
            tail = end
    return truncated, tail


def copy_log(source: Path, target: Path, *, limit: int, tail: int) -> tuple[bool, bytes]:
    """Copy a log the sandbox wrote (read as untrusted, :func:`open_log`) cut at ``limit`` bytes; return whether it
    was cut, and its last ``tail`` bytes (the end of the whole, whatever its length)."""
    handle, size = open_log(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    with handle, target.open("wb") as sink:
        left = limit
        while left > 0 and (chunk := handle.read(min(left, 2**20))):
            sink.write(chunk)
            left -= len(chunk)
        handle.seek(max(0, size - tail))
        return size > limit, handle.read(tail)


def open_log(path: Path) -> tuple[IO[bytes], int]:
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


def collect_trees(trees: dict[str, Path], run_dir: Path, budget: Budget) -> Collected:
    """Copy each of ``trees`` (name → its directory in the staging area) to ``run_dir/<name>``, within the
    attempt's byte ``budget``. A tree the sandbox never created is left out."""
    collected = Collected()
    for name, path in trees.items():
        if not path.is_dir() or path.is_symlink():
            continue  # pvisor failed before creating it
        collected.reports[name] = harvest_tree(path, run_dir / name, budget)
    return collected


def collect_workspace(
    collected: Collected,
    workspace: Path,
    run_dir: Path,
    budget: Budget,
    *,
    mode: Collect,
    before: list[Entry],
    origin: Path | None,
) -> None:
    """The final ``workspace`` as ``mode`` says (``full``: every file; ``changes``: the files added and changed,
    and ``workspace.patch`` from the starting workspace, whose files are under ``origin``, None: it started
    empty; ``none``: nothing), into ``collected``; its changes are listed whatever the mode."""
    if mode == "full":
        report = harvest_tree(workspace, run_dir / "workspace", budget)
        collected.reports["workspace"] = report
        collected.changes = diff_trees(before, report.entries, complete=not report.truncated)
        return
    after = snapshot_tree(workspace)
    collected.changes = diff_trees(before, after)
    if mode == "none":
        return
    changed = {path for path in (*collected.changes.added, *collected.changes.changed) if not path.endswith("/")}
    keep = changed | {path.rstrip("/") for path in collected.changes.added if path.endswith("/")}
    collected.reports["workspace"] = harvest_tree(workspace, run_dir / "workspace", budget, keep=keep.__contains__)
    target = run_dir / PATCH_NAME
    with target.open("wb") as sink:
        collected.patch = write_patch(before, after, origin, workspace, sink, max(0, budget.bytes))
    budget.bytes -= collected.patch


def warn_if_cut(budget: Budget, limit: int) -> None:
    """One warning when the attempt's collection stopped at ``--collect-limit``."""
    if budget.exhausted:
        logger.warning(
            "the collect limit ({}) was reached; record.json lists what was not collected", format_size(limit)
        )
