"""Logging for the CLI: the one place loguru sinks are configured (the library only logs)."""

from __future__ import annotations

import sys
from typing import Any

from loguru import logger

_PREFIX = {"WARNING": "warning: ", "ERROR": "error: ", "CRITICAL": "error: "}


def _plain(record: Any) -> str:
    prefix = _PREFIX.get(record["level"].name, "")
    return "<dim>pvisor-host:</dim> " + prefix + "{message}\n"


_DEBUG = "<dim>{time:HH:mm:ss.SSS}</dim> <level>{level: <7}</level> <dim>{name}:{line}</dim> {message}\n"


def configure(*, verbose: bool = False, quiet: bool = False, debug: bool = False) -> None:
    """Send pvisor-host's log to stderr: milestones by default, details with ``verbose``/``debug``."""
    logger.remove()
    logger.enable("pvisor_host")
    level = "DEBUG" if (verbose or debug) else ("WARNING" if quiet else "INFO")
    logger.add(
        sys.stderr,
        level=level,
        format=_DEBUG if debug else _plain,
        colorize=None,
        backtrace=False,
        diagnose=False,  # never print variable values: they may hold paths, prompts or tokens
    )
