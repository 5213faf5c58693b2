"""The console script's main: the one place exceptions become exit codes.

A :class:`~pvisor_host.errors.PvisorHostError` prints one line and exits with its code, Ctrl-C (and SIGTERM,
SIGHUP) exits 130, typer's usage errors exit 2, and a bug prints one line naming itself; tracebacks appear
only with ``--debug`` (or ``PVISOR_HOST_DEBUG=1``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback

import typer
from typer.exceptions import TyperException

from ..errors import ExitCode, PvisorHostError
from ..signals import give_up_when_insisted, ignore_interrupts, install_sigterm_as_interrupt
from .app import app, say


def _debugging(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("PVISOR_HOST_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI and exit with a documented code."""
    args = sys.argv[1:] if argv is None else argv
    debug = _debugging(args)
    install_sigterm_as_interrupt()
    give_up_when_insisted()
    code: int
    try:
        result = app(args=args, prog_name="pvisor-host", standalone_mode=False)
        code = int(result) if isinstance(result, int) else ExitCode.OK
    except PvisorHostError as exc:
        if debug:
            traceback.print_exc()
        interrupted = exc.exit_code == ExitCode.INTERRUPTED
        say(f"pvisor-host: {exc.one_line()}" if interrupted else f"pvisor-host: error: {exc.one_line()}")
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        say("pvisor-host: interrupted")
        code = ExitCode.INTERRUPTED
    except TyperException as exc:  # usage errors from option parsing: one line in our own words
        if debug:
            traceback.print_exc()
        say(f"pvisor-host: error: {usage_line(exc)}")
        code = exc.exit_code
    except Exception as exc:  # a bug: say so in one line, keep the traceback for --debug
        if debug:
            traceback.print_exc()
        say(f"pvisor-host: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)")
        code = ExitCode.INFRASTRUCTURE
    ignore_interrupts()  # the outcome is decided and everything cleaned up: a late Ctrl-C must not change the code
    if code == ExitCode.INTERRUPTED:
        exit_interrupted()
    sys.exit(code)


def usage_line(exc: TyperException) -> str:
    """Click's usage error as one line of ours: ``--workers: 0 is not ... (see pvisor-host batch --help)``."""
    message = exc.format_message().strip().rstrip(".")
    found = re.match(r"^Invalid value for (.+?): (.*)$", message, flags=re.DOTALL)
    if found is not None:
        flag, problem = found.group(1).strip("'"), found.group(2)
        message = f"{flag}: {problem[:1].lower()}{problem[1:]}"
    else:
        message = message[:1].lower() + message[1:]
    message = " ".join(message.split())
    context = getattr(exc, "ctx", None)
    command = context.command_path if context is not None else "pvisor-host"
    return f"{message} (see {command} --help)"


def exit_interrupted() -> None:
    """Exit 130 now. CPython, when a Ctrl-C landed inside an ``eval()`` of a string (annotations being
    resolved), notes it as unhandled even after it was handled, and at exit would kill the process with
    SIGINT instead of returning 130; everything is already cleaned up, so skip the interpreter's exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(ExitCode.INTERRUPTED)
