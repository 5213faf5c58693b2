#!/usr/bin/env python3
"""Write docs/reference.md from the code itself: every command and option of the typer app, the exit codes
and the Docker labels, so the reference cannot drift. ``--check`` fails when the committed page is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import typer.main
from typer.core import TyperArgument, TyperGroup, TyperOption

from pvisor_host.backend.docker import labels
from pvisor_host.cli.app import app
from pvisor_host.errors import ExitCode

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"

HEAD = """# Reference

Generated from the code by `scripts/gen-cli-docs.py`; do not edit by hand (`make docs-api` rewrites it, and a
test fails when it is stale). The guide to each command, with examples, is [cli.md](cli.md).
"""


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def option_row(param: Any) -> str:
    if isinstance(param, TyperArgument):
        name = f"`{(param.metavar or param.name or '').strip('[]').upper()}`"
        help_text = getattr(param, "help", None) or ""
        default = "required" if param.required else "—"
    else:
        assert isinstance(param, TyperOption)
        flags = [*param.opts, *param.secondary_opts]
        name = ", ".join(f"`{flag}`" for flag in flags)
        if not param.is_flag and param.metavar:
            name += f" `{param.metavar}`"
        help_text = param.help or ""
        shown = param.default not in (None, False, ()) and param.show_default is not False
        default = f"`{param.default}`" if shown else "—"
        if param.multiple:
            help_text += " (may be repeated)"
    return f"| {name} | {default} | {cell(help_text)} |"


def command_section(name: str, command: Any) -> list[str]:
    lines = [f"## `pvisor-host {name}`", ""]
    lines += [cell(line) if line.strip() else "" for line in (command.help or "").strip().splitlines()]
    params = [p for p in command.params if p.name != "help" and not getattr(p, "hidden", False)]
    if params:
        lines += ["", "| argument / option | default | meaning |", "|---|---|---|"]
        lines += [option_row(p) for p in params]
    return [*lines, ""]


def commands(group: TyperGroup, prefix: str = "") -> list[str]:
    lines: list[str] = []
    for name in group.list_commands(None):  # type: ignore[arg-type]
        command = group.get_command(None, name)  # type: ignore[arg-type]
        if command is None or command.hidden:
            continue
        command = command.resolved() if hasattr(command, "resolved") else command  # made when used (cli/app.py)
        full = f"{prefix}{name}"
        lines += command_section(full, command)
        if isinstance(command, TyperGroup):
            lines += commands(command, f"{full} ")
    return lines


def page() -> str:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    lines = [HEAD, "## Global options", "", "| option | default | meaning |", "|---|---|---|"]
    lines += [option_row(p) for p in group.params if p.name != "help"]
    lines += ["", *commands(group)]
    lines += ["## Exit codes", "", "What each means: [exit-codes.md](exit-codes.md).", "", "| code | name |"]
    lines += ["|---|---|", *(f"| {code.value} | `{code.name}` |" for code in ExitCode), ""]
    lines += [
        "## Docker labels",
        "",
        f"Everything pvisor-host creates in Docker carries labels starting with `{labels.PREFIX}`; images it",
        "builds carry the ones that record what was verified inside them.",
        "",
        "| label |",
        "|---|",
    ]
    names = sorted(v for k, v in vars(labels).items() if k.isupper() and k != "PREFIX" and isinstance(v, str))
    lines += [f"| `{name}` |" for name in names]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when docs/reference.md is stale")
    args = parser.parse_args()
    text = page()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            sys.stderr.write("stale: docs/reference.md; run `make docs-api`\n")
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
