"""The ``pvisor-host`` commands: parse → validate into a model → one library call → render → exit code.

Every command is thin: options become pydantic models (a :class:`~pvisor_host.models.spec.ReplaySpec`, say),
the library does the work behind the backend seam, and :mod:`.render` shows the result. The commands live in
one module per group (:mod:`.commands`); the replay options come from the models (:mod:`.options`).
Exceptions become exit codes in one place, :func:`pvisor_host.cli.main.main`. Imports inside commands are
lazy, so ``--help`` loads no engine client.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .._version import PVISOR_VERSION, __version__
from .commands import cluster, host, images, results, run
from .shared import out, say

__all__ = ["app", "say"]

app = typer.Typer(
    name="pvisor-host",
    help="Replay recorded AI-agent trajectories with pvisor inside hardened Docker containers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        out.print(f"pvisor-host {__version__} (pvisor {PVISOR_VERSION})")
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


# In the order `--help` lists them: what users do first, first.
images.register(app)
host.register(app)
run.register(app)
results.register(app)
cluster.register(app)
