"""Collect stage: bring a finished sandbox's logs and trees (pvisor's output and state, the workspace) out.

Logs stream to files with a cap per stream. Trees come through the engine's archive API into the safe
extractor (:mod:`pvisor_host.files.archive`), under one byte budget for the whole attempt.
"""

from __future__ import annotations

from pathlib import Path

from docker.errors import NotFound
from docker.models.containers import Container
from loguru import logger
from pydantic import BaseModel

from ....errors import InfrastructureError
from ....files.archive import Budget, ExtractReport, extract_tar, tar_stream
from ....models.units import format_size
from ..engine import engine_errors
from . import container as sandbox


class Collected(BaseModel):
    """What came out of one sandbox."""

    reports: dict[str, ExtractReport] = {}
    """Tree name (``output``, ``state``, ``workspace``) → what its extraction wrote and skipped."""
    error: str | None = None
    """A tree that could not be read (the attempt then ends ``infra_error``)."""


def collect_logs(box: Container, logs: Path) -> bool:
    """Write the container's stdout and stderr under ``logs``; True when one of them was cut at the cap."""
    logs.mkdir(exist_ok=True)
    truncated = sandbox.save_logs(box, stdout=True, dest=logs / "stdout.log")
    return sandbox.save_logs(box, stdout=False, dest=logs / "stderr.log") or truncated


def collect_trees(box: Container, trees: dict[str, str], run_dir: Path, limit: int) -> Collected:
    """Copy each of ``trees`` (name → path in the sandbox) to ``run_dir/<name>``, within ``limit`` bytes in all.

    A tree the sandbox never created is left out; one the engine cannot hand over is noted in ``error``.
    """
    budget = Budget(limit)
    collected = Collected()
    for name, path in trees.items():
        try:
            with engine_errors(f"copy {path} out of the sandbox"):
                try:
                    chunks, _ = box.get_archive(path)
                except NotFound:
                    continue  # pvisor failed before creating it
                collected.reports[name] = extract_tar(tar_stream(chunks), run_dir / name, budget)
        except InfrastructureError as exc:
            collected.error = exc.one_line()
    if budget.exhausted:
        logger.warning(
            "the collect limit ({}) was reached; record.json lists what was not collected", format_size(limit)
        )
    return collected
