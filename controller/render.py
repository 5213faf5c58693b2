"""Human-readable output of the CLI (rich); ``--json`` output bypasses this module."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from .build import BuiltImage
from .catalog import CatalogEntry, PruneResult
from .doctor import Report
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


def agents_table(console: Console, rows: list[dict[str, str]], notes: list[str]) -> None:
    """``pvisor-host agents``: one row per agent, then why the unavailable ones are."""
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("agent", "version", "install source", "image", "inject", "continuation needs"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["agent"], row["version"], row["install_source"], row["image"], row["inject"], row["needs"])
    console.print(table)
    for note in notes:
        console.print(f"\n[bold]{note.split(':')[0]}[/bold]:{note.split(':', 1)[1]}", highlight=False)


def catalog_table(console: Console, entries: list[CatalogEntry]) -> None:
    """``pvisor-host images``."""
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("name", "kind", "agent", "pvisor", "size", "created", "last used", "in use"):
        table.add_column(column, overflow="fold")
    for e in entries:
        table.add_row(
            e.name if e.name != "<none>" else f"<none> {e.id[7:19]}",
            e.role,
            f"{e.agent} {e.agent_version}" if e.agent else "",
            e.pvisor_version or "",
            format_size(e.size),
            e.created.strftime("%Y-%m-%d %H:%M"),
            e.last_used.strftime("%Y-%m-%d %H:%M") if e.last_used else "never",
            "yes" if e.in_use else "",
        )
    console.print(table)
    console.print(
        f"{len(entries)} items, {format_size(sum(e.size for e in entries))} (shared layers counted per image)"
    )


def prune_result(console: Console, result: PruneResult, *, dry_run: bool) -> None:
    """``pvisor-host images prune``."""
    verb = "would remove" if dry_run else "removed"
    for entry in result.removed:
        console.print(f"{verb} {entry.name} ({entry.kind}, {format_size(entry.size)})")
    for name, reason in result.kept.items():
        console.print(f"kept {name}: {reason}")
    console.print(f"{verb} {len(result.removed)} items, {format_size(result.freed)}")


def doctor_report(console: Console, report: Report) -> None:
    """``pvisor-host doctor``: one line per check, with the fix where one is needed."""
    marks = {"ok": "[green]ok[/green]  ", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}
    for check in report.checks:
        line = f"{marks[check.status]} {check.name}: {check.detail}"
        if check.fix and check.status != "ok":
            line += f" [dim]→ {check.fix}[/dim]"
        console.print(line, highlight=False, soft_wrap=True)
