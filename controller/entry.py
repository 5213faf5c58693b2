"""The console script and ``python -m pvisor_host``: the CLI is imported inside a Ctrl-C guard, so an
interrupt while Python is still loading it exits 130 with one line, like any later interrupt."""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Load the CLI and run it (see :func:`pvisor_host.cli.main`)."""
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("pvisor-host: interrupted\n")
        sys.stderr.flush()
        os._exit(130)  # not sys.exit: see pvisor_host.cli.main.exit_interrupted
    run()
