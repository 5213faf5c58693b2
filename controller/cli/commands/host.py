"""``agents``, ``doctor`` and ``gc``: what this host has, needs, and has left behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ...errors import ExitCode
from ..shared import JsonFlag, console, open_engine


def agents(json_output: JsonFlag = False) -> int:
    """List the agents pvisor replays: pinned versions, install sources, images and continuation needs."""
    from ...errors import PrerequisiteError
    from ...models.housekeeping import AgentStatus
    from ...models.profiles import all_profiles
    from .. import render

    try:
        with open_engine(timeout=10) as backend:
            statuses = backend.agent_statuses()
        engine = True
    except PrerequisiteError:  # still list the agents; image status is unknown
        statuses = [AgentStatus.of(profile) for profile in all_profiles().values()]
        engine = False
    if json_output:
        typer.echo(json.dumps([s.model_dump() for s in statuses], indent=2))
    else:
        render.agents_table(console(), statuses, engine=engine)
    return ExitCode.OK


def doctor(json_output: JsonFlag = False) -> int:
    """Check this host: engine, architecture, disk, registry, base and agent images, pvisor."""
    from ...backend import open_backend
    from ...preflight.doctor import diagnose
    from .. import render

    report = diagnose(lambda: open_backend(timeout=10))
    if json_output:
        typer.echo(json.dumps({"ok": report.ok, **report.model_dump()}, indent=2))
    else:
        render.doctor_report(console(), report)
    return ExitCode.OK if report.ok else ExitCode.PREREQUISITE


def gc(
    dry_run: Annotated[bool, typer.Option(help="Only list what would be removed.")] = False,
    json_output: JsonFlag = False,
) -> int:
    """Remove containers, volumes and networks whose pvisor-host process is gone (after a kill -9, say).

    Resources of a live pvisor-host, of another host, and anything without pvisor-host labels are never touched.
    """
    from .. import render

    with open_engine() as backend:
        report = backend.sweep(dry_run=dry_run)
    if json_output:
        typer.echo(report.model_dump_json(indent=2))
    else:
        render.gc_report(console(), report, dry_run=dry_run)
    return ExitCode.OK if not report.failed else ExitCode.INFRASTRUCTURE


def inspect(
    trajectories: Annotated[
        list[Path], typer.Argument(metavar="TRAJECTORY...", help="Trajectory files.", show_default=False)
    ],
    agent: Annotated[
        str | None, typer.Option(help="The agent of every file (default: detected from each file's format).")
    ] = None,
    json_output: JsonFlag = False,
) -> int:
    """What each trajectory is: its agent and version, boundaries, tools per batch, recorded cwd, and which
    boundaries the pinned pvisor accepts. Exit 2 when a file is no trajectory or pvisor refuses some boundary.

    Runs only the host's pinned pvisor (no engine).
    """
    from ...preflight.inspect import inspect_files
    from .. import render

    reports = inspect_files(trajectories, agent)
    if json_output:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in reports], indent=2))
    else:
        render.trajectory_reports(console(), reports)
    return ExitCode.OK if all(r.ok for r in reports) else ExitCode.USAGE


def register(app: typer.Typer) -> None:
    app.command()(agents)
    app.command()(inspect)
    app.command()(doctor)
    app.command()(gc)
