"""The command line: typer commands (:mod:`.app`), exit codes (:mod:`.main`), human output (:mod:`.render`),
log sinks (:mod:`.logs`) and the replay options shared by ``replay`` and ``batch`` (:mod:`.options`)."""

from .main import main

__all__ = ["main"]
