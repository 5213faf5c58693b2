"""Collect stage: bring a finished sandbox's logs and trees (pvisor's output and state, the workspace) out.

Logs stream to files with a cap per stream. The trees are already on the host: the sandbox wrote them
through its bind mounts into the staging directory. Once it has stopped they are harvested from there,
judged entry by entry as untrusted (:func:`pvisor_host.files.archive.harvest_tree`), under one byte
budget for the whole attempt — no archive round trip through the engine.
"""

from __future__ import annotations

from pathlib import Path

from docker.models.containers import Container
from pydantic import BaseModel

from ...._log import logger
from ....files.archive import Budget, ExtractReport, harvest_tree
from ....units import format_size
from . import container as sandbox


class Collected(BaseModel):
    """What came out of one sandbox."""

    reports: dict[str, ExtractReport] = {}
    """Tree name (``output``, ``state``, ``workspace``) → what its extraction wrote and skipped."""


def collect_logs(box: Container, logs: Path) -> tuple[bool, bytes]:
    """Write the container's stdout and stderr under ``logs`` (each cut at the cap). Returns whether one was
    cut, and the end of stdout, where pvisor's result line is even when a flood filled the cap."""
    logs.mkdir(exist_ok=True)
    truncated, tail = sandbox.save_logs(box, stdout=True, dest=logs / "stdout.log")
    cut, _ = sandbox.save_logs(box, stdout=False, dest=logs / "stderr.log")
    return truncated or cut, tail


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
