"""Every ``pvisor-host`` command line the README and the docs show — in console blocks, and in the CI recipes'
YAML — names a command and options the CLI has, with values it accepts. Only runnable blocks are run
(``tests/integration/test_docs.py``); this keeps the rest from drifting."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main
import yaml

from pvisor_host.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```(console|yaml|bash|sh)\n(.*?)```", re.S)


def _lines(language: str, text: str) -> list[str]:
    """Shell command lines of one block, continuation lines joined, comments and prompts dropped."""
    if language == "yaml":
        found: list[str] = []

        def walk(node: object) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if key in ("run", "script") and isinstance(value, str):
                        found.append(" ".join(value.split()))
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    found.append(" ".join(value.split())) if isinstance(value, str) else walk(value)

        walk(yaml.safe_load(text))
        return found
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.removeprefix("$ ").strip() for line in joined.splitlines()]


def command_lines() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for language, text in _BLOCK.findall(page.read_text()):
            for line in _lines(language, text):
                line = re.sub(r"\s#\s.*$", "", line)  # a trailing comment
                if line.startswith("pvisor-host "):
                    found.append((f"{page.name}: {line}", line))
    return found


COMMANDS = command_lines()


def test_the_docs_show_commands_to_check():
    assert len(COMMANDS) > 40
    assert any("recipes.md: pvisor-host batch --trajectories" in name for name, _ in COMMANDS)  # from the YAML


@pytest.mark.parametrize("line", [line for _, line in COMMANDS], ids=[name[:90] for name, _ in COMMANDS])
def test_a_documented_command_line_parses(line):
    line = re.sub(r"\$\([^)]*\)", "", line)  # a shell substitution adds options conditionally: not checked
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|;&<>")
    lexer.whitespace_split = True
    words = []
    for word in list(lexer)[1:]:
        if word in (
            "|",
            "||",
            "&&",
            ";",
            ">",
            ">>",
            "<",
        ):  # the pvisor-host command ends where the shell's next part begins
            break
        if not word.startswith("$"):
            words.append(word)
    command = typer.main.get_command(app)
    path = ["pvisor-host"]
    while hasattr(command, "commands") and words and not words[0].startswith("-"):
        name = words.pop(0)
        found = command.get_command(None, name)
        assert found is not None, f"{' '.join(path)} has no command {name!r}"
        command = found.resolved() if hasattr(found, "resolved") else found  # made when used (cli/app.py)
        path.append(name)
    try:
        command.make_context(" ".join(path), list(words)).close()
    except (typer.TyperException, typer.Exit) as exc:  # click's errors, as typer ships it
        if getattr(exc, "exit_code", 1) != 0:  # not --help
            pytest.fail(f"{line}: {exc.format_message() if hasattr(exc, 'format_message') else exc!r}")
