"""Human-readable output of the CLI (rich); ``--json`` output bypasses this module."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from .build import BuiltImage
from .record import ReplayRecord
from .units import format_duration, format_size

_STATUS_STYLE = {"ok": "green", "replay_failed": "red", "timeout": "yellow", "oom": "yellow"}


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def built_image(console: Console, built: BuiltImage) -> None:
    """One line per fact about a built (or found) image."""
    how = "found (nothing to build)" if built.cached else f"built and verified in {format_duration(built.seconds)}"
    console.print(f"[bold]{built.tag}[/bold] {how}")
    console.print(
        f"  agent {built.agent} {built.agent_version}, pvisor {built.pvisor_version}, {format_size(built.size)}"
    )
    console.print(f"  base {built.base.ref} ({built.base.source})")


def replay_summary(console: Console, record: ReplayRecord, out_dir: Path) -> None:
    """The end-of-run summary: status, what pvisor did, what changed, where everything is."""
    style = _STATUS_STYLE.get(record.status, "red")
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    table.add_row("status", f"[{style}]{record.status}[/{style}]")
    if record.failure:
        table.add_row("failure", f"{record.failure.category}: {record.failure.message}")
    result = record.result
    if result is not None and result.phase is not None:
        table.add_row("phase", f"{result.phase} ({result.quality}), agent {result.agent_status}")
        table.add_row(
            "replayed",
            f"{result.replayed_tool_calls} tool calls up to step {result.after_step}"
            f" ({result.prefix_model_turns} model turns), {result.continued_steps} continued steps",
        )
    changes = record.workspace_changes
    if changes is not None:
        table.add_row(
            "workspace", f"{len(changes.added)} added, {len(changes.changed)} changed, {len(changes.removed)} removed"
        )
    if record.collection.truncated:
        table.add_row("collected", "[yellow]truncated at the collect limit[/yellow]")
    table.add_row("image", f"{record.image.ref} ({record.image.agent} {record.image.agent_version})")
    table.add_row("time", format_duration(record.timings.get("total", 0.0)))
    table.add_row("artifacts", f"{_relative(out_dir)}/ ({len(record.artifacts)} files, record.json)")
    console.print(table)
