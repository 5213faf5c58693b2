"""The ``pvisor-host`` commands: parse → validate into a model → one library call → render → exit code.

Every command is thin: options become pydantic models (a :class:`~pvisor_host.models.spec.ReplaySpec`, say),
the library does the work behind the backend seam, and :mod:`.render` shows the result. The commands live in
one module per group (:mod:`.commands`); the replay options come from the models (:mod:`.options`).
Exceptions become exit codes in one place, :func:`pvisor_host.cli.main.main`.

Imports inside commands are lazy, and the commands whose options come from the models (``build``, ``replay``,
``batch``) are made into click commands only when they are run or their help is shown (:class:`_Commands`):
``pvisor-host --help`` loads no engine client and no model. Typer has no lazy commands of its own; click's
groups allow them, so this is a small group of typer's kind that adds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from .._version import PVISOR_VERSION, __version__
from .commands import cluster, host, images, results, run
from .shared import SETTINGS, say

__all__ = ["app", "command", "say"]

#: The commands built when used, in the order ``--help`` lists all commands.
_LAZY: dict[str, Callable[..., Any]] = {"build": images.build, "replay": run.replay, "batch": run.batch}
_ORDER = (
    "build",
    "agents",
    "inspect",
    "doctor",
    "gc",
    "replay",
    "batch",
    "compare",
    "report",
    "results",
    "images",
    "node",
    "cluster",
)


class _LazyCommand(TyperCommand):
    """A command known by its name and help until it is used; then typer makes it (see the module docstring).
    (typer ships its own copy of click, whose classes it does not name publicly: hence ``Any`` below.)"""

    def __init__(self, name: str, callback: Callable[..., Any]) -> None:
        super().__init__(name, help=callback.__doc__)
        self._function = callback
        self._made: Any = None

    def resolved(self) -> Any:
        """The command itself, made by typer from its function."""
        if self._made is None:
            single = typer.Typer(**SETTINGS)
            single.command(name=self.name)(self._function)
            self._made = typer.main.get_command(single)
        return self._made

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        return self.resolved().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        return self.resolved().invoke(ctx)

    def get_params(self, ctx: Any) -> Any:
        return self.resolved().get_params(ctx)


class _Commands(TyperGroup):
    """typer's group, with the commands of :data:`_LAZY` made only when they are used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = {name: _LazyCommand(name, callback) for name, callback in _LAZY.items()}

    def list_commands(self, ctx: Any) -> list[str]:
        known = [name for name in _ORDER if name in self.commands or name in self._lazy]
        return known + sorted(set(self.commands) - set(known))  # a command left out of _ORDER is still listed

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        return self.commands.get(cmd_name) or self._lazy.get(cmd_name)


app = typer.Typer(
    name="pvisor-host",
    help="Replay recorded AI-agent trajectories with pvisor inside hardened Docker containers.",
    no_args_is_help=True,
    cls=_Commands,
    **SETTINGS,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pvisor-host {__version__} (pvisor {PVISOR_VERSION})")
        raise typer.Exit


@app.callback()
def _global(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every step.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Log warnings and errors only.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Verbose logs and tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    from . import logs

    logs.configure(verbose=verbose, quiet=quiet, debug=debug)


images.register(app)
host.register(app)
results.register(app)
cluster.register(app)


def command(*path: str) -> Any:
    """The click command at ``path`` (``("images", "prune")``), made if it is made only when used: for the
    generated reference and the tests that hold the CLI to the models."""
    found: Any = typer.main.get_command(app)
    for name in path:
        child = found.get_command(typer.Context(found), name)
        assert child is not None, f"no command {name}"
        found = child.resolved() if isinstance(child, _LazyCommand) else child
    return found
