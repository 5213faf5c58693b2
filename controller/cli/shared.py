"""What every command shares: where human output goes, the one-line error writer, and the backend a command
opens (and closes)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from ..backend.base import AnyBackend


@functools.cache
def console() -> Console:
    """Human output, made when first used (rich takes longer to import than all of ``--help``). Wide enough for
    tables when stdout is a file or a CI log (rich would wrap at 80 columns)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


#: Settings of every command and group: ``-h`` as ``--help``, exceptions left to :mod:`.main`, and click's
#: plain help (typer's rich help imports rich and a markdown parser: most of what ``--help`` would take).
SETTINGS: dict[str, Any] = {
    "add_completion": False,
    "pretty_exceptions_enable": False,
    "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}

#: ``--json``, as most commands offer it.
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def say(line: str) -> None:
    """One unwrapped line on stderr (errors must stay one line whatever the terminal width)."""
    try:
        sys.stderr.write(line.replace("\n", " ") + "\n")
        sys.stderr.flush()
    except OSError:
        pass  # stderr is gone (a closed pipe): the exit code still says what happened


@contextlib.contextmanager
def open_engine(*, timeout: float = 120) -> Iterator[AnyBackend]:
    """The local engine for one command, closed afterwards."""
    from ..backend import open_backend

    backend = open_backend(timeout=timeout)
    try:
        yield backend
    finally:
        backend.close()
