"""What every command shares: where human output goes, the one-line error writer, and the backend a command
opens (and closes)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from ..backend.base import AnyBackend

#: Human output. Wide enough for tables when stdout is a file or a CI log (rich would wrap at 80 columns).
out = Console(width=None if sys.stdout.isatty() else 160)

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
def open_engine(
    *, pool_size: int = 10, timeout: float = 120, cluster: str | None = None, registry: str | None = None
) -> Iterator[AnyBackend]:
    """The local engine (or, with ``cluster``, the Ray cluster at that address, its nodes pulling images from
    ``registry`` when given) for one command, closed afterwards."""
    from ..backend import open_backend

    backend = open_backend(pool_size=pool_size, timeout=timeout, cluster=cluster, registry=registry)
    try:
        yield backend
    finally:
        backend.close()
