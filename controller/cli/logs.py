"""Logging for the CLI: the one place loguru sinks are configured (the library only logs)."""

from __future__ import annotations

import sys
from typing import Any

from loguru import logger

_PREFIX = {"WARNING": "warning: ", "ERROR": "error: ", "CRITICAL": "error: "}


def _plain(record: Any) -> str:
    prefix = _PREFIX.get(record["level"].name, "")
    item = "[{extra[item]}] " if "item" in record["extra"] else ""
    return "<dim>pvisor-host:</dim> " + item + prefix + "{message}\n"


def _debug(record: Any) -> str:
    item = "[{extra[item]}] " if "item" in record["extra"] else ""
    return "<dim>{time:HH:mm:ss.SSS}</dim> <level>{level: <7}</level> <dim>{name}:{line}</dim> " + item + "{message}\n"


def _milestone(record: Any) -> bool:
    """A batch item's routine progress (logged with an ``item``) stays out of the default log; the
    progress display covers it. Its warnings and errors still show."""
    return "item" not in record["extra"] or record["level"].no >= logger.level("WARNING").no


def configure(*, verbose: bool = False, quiet: bool = False, debug: bool = False) -> None:
    """Send pvisor-host's log to stderr: milestones by default, details with ``verbose``/``debug``.

    Batch items log with an ``item`` extra (their id), shown as a ``[id]`` prefix.
    """
    logger.remove()
    logger.enable("pvisor_host")
    level = "DEBUG" if (verbose or debug) else ("WARNING" if quiet else "INFO")
    logger.add(
        sys.stderr,
        level=level,
        format=_debug if debug else _plain,
        filter=None if (verbose or debug) else _milestone,
        colorize=None,
        backtrace=False,
        diagnose=False,  # never print variable values: they may hold paths, prompts or tokens
    )
