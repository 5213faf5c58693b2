"""Human-readable output of the CLI (rich); ``--json`` output bypasses this module."""

from __future__ import annotations

import shlex
import time
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ..models.batch import BatchSummary, FlakyItem, ItemResult
from ..models.housekeeping import AgentStatus, CatalogEntry, GcReport, HealthReport, PruneResult
from ..models.image import BuiltImage, PullProgress
from ..models.record import ReplayRecord
from ..units import format_duration, format_size

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ..backend.cluster.node.status import NodeStatus
    from ..fanout.compare import Comparison
    from ..fanout.manifest import ManifestCheck
    from ..fanout.plan import ImagesPlanned, ItemPlan
    from ..preflight.inspect import TrajectoryReport

_STATUS_STYLE = {"ok": "green", "replay_failed": "red", "timeout": "yellow", "oom": "yellow"}
_CHANGE_STYLE = {
    "regression": "red", "new_failure": "red", "status_changed": "yellow", "divergence_moved": "yellow",
    "effects_changed": "yellow", "new_hosts": "yellow", "image_changed": "yellow", "fixed": "green",
}  # fmt: skip


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
    if built.pushed:
        console.print(f"  pushed as {built.pushed}", highlight=False)


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
        table.add_row(
            "phase", f"{result.phase}, agent {result.agent_status} (pvisor's replay quality: {result.quality})"
        )
        table.add_row(
            "replayed",
            f"{result.replayed_tool_calls} tool calls up to step {result.after_step}"
            f" ({result.prefix_model_turns} model turns), {result.continued_steps} continued steps",
        )
    if record.observations is not None and record.observations.calls:
        style = "green" if not record.observations.diverged else "yellow"
        table.add_row("observations", f"[{style}]{record.observations.describe()}[/{style}]")
    if record.verification is not None:
        verification = record.verification
        style = {"passed": "green", "could_not_run": "yellow"}.get(verification.outcome, "red")
        table.add_row("verification", Text(verification.describe(), style=style))
    changes = record.workspace_changes
    if changes is not None:
        table.add_row(
            "workspace", f"{len(changes.added)} added, {len(changes.changed)} changed, {len(changes.removed)} removed"
        )
    if record.collection.truncated:
        table.add_row("collected", "[yellow]truncated at the collect limit[/yellow]")
    if record.egress is not None:
        table.add_row("egress", Text(record.egress.describe()))
    table.add_row("image", f"{record.image.ref} ({record.image.agent} {record.image.agent_version})")
    table.add_row("time", format_duration(record.timings.get("total", 0.0)))
    table.add_row("artifacts", f"{_relative(out_dir)}/ ({len(record.artifacts)} files, record.json)")
    console.print(table)


def fork_summary(console: Console, records: list[ReplayRecord], out_dir: Path) -> None:
    """``replay --fork K``'s end: the prefix's sandbox, then each fork, one line each, and where they are."""
    table = Table(box=None, padding=(0, 2), show_edge=False)
    for column in ("run", "status", "how", "time", "failure"):
        table.add_column(column, style="dim" if column == "run" else None)
    for record in records:
        fork = record.fork
        style = _STATUS_STYLE.get(record.status, "red")
        if fork is None or fork.role == "prefix":
            name = "prefix"
            how = "ended before the boundary"
            if fork is not None and fork.checkpoint_error is not None:
                how = f"could not be checkpointed: {fork.checkpoint_error}"
            elif fork is not None and fork.checkpoint_seconds is not None:
                size = format_size(fork.checkpoint_bytes or 0)
                how = f"checkpointed at the boundary in {fork.checkpoint_seconds:.2f}s ({size})"
        else:
            name = f"fork {fork.index}"
            ran = "full replay" if "run" in record.timings else "did not start"  # --fork-strict, or stopped
            how = f"{ran}: {fork.fallback}" if not fork.restored else "not restored"
            if fork.restored and fork.restore_seconds is not None:
                how = f"restored in {fork.restore_seconds:.2f}s"
        failure = f"{record.failure.category}: {record.failure.message}" if record.failure else ""
        total = format_duration(record.timings.get("total", 0.0))
        table.add_row(name, f"[{style}]{record.status}[/{style}]", how, total, failure)
    console.print(table)
    console.print(f"[dim]artifacts[/dim]  {_relative(out_dir)}/ (prefix/, fork-1/ ... each with record.json)")


def agents_table(console: Console, statuses: list[AgentStatus], *, engine: bool) -> None:
    """``pvisor-host agents``: one row per agent, then why the unavailable ones are."""
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("agent", "version", "install source", "image", "inject", "continuation needs"):
        table.add_column(column, overflow="fold")
    for s in statuses:
        if not s.installable:
            image = "unavailable (below)"
        elif not engine:
            image = "unknown (no engine)"
        else:
            image = s.image or "not built"
        needs = s.continuation_api + ": " + ", ".join(group[0] for group in s.continuation_env)
        table.add_row(s.agent, s.version, s.install_source, image, "yes" if s.injectable else "no", needs)
    console.print(table)
    for s in statuses:
        if s.unavailable_reason:
            console.print(f"\n[bold]{s.agent}[/bold]: {s.unavailable_reason}", highlight=False)


def trajectory_reports(console: Console, reports: list[TrajectoryReport]) -> None:
    """``pvisor-host inspect``: per file, what it is and which boundaries pvisor accepts."""
    for report in reports:
        console.print(f"[bold]{_relative(report.path)}[/bold]", highlight=False)
        if report.problem is not None:
            console.print(f"  [red]{report.problem}[/red]", highlight=False)
            continue
        recorded = f"recorded with {report.recorded_version}" if report.recorded_version else "version not recorded"
        console.print(f"  agent       {report.agent} ({recorded}; pvisor replays {report.pinned_version})")
        count = "not counted (refused first)" if report.boundaries is None else str(report.boundaries)
        console.print(f"  boundaries  {count}", highlight=False)
        console.print(f"  cwd         {report.cwd or 'not recorded (the sandbox uses /workspace)'}", highlight=False)
        if report.accepted is not None:
            first, last = report.accepted
            console.print(f"  [green]pvisor accepts boundaries {first}-{last}[/green]", highlight=False)
        for first, last, failure in report.refused:
            span = f"{first}" if first == last else f"{first}-{last}"
            console.print(f"  [red]refused {span}[/red]: {failure.category}: {failure.message}", highlight=False)
        for ordinal, tools in enumerate(report.batches, start=1):
            console.print(f"    {ordinal:>4}  {', '.join(tools)}", highlight=False)


def catalog_table(console: Console, entries: list[CatalogEntry], *, show_all: bool = False) -> None:
    """``pvisor-host images``: what a user can act on; the builder's untagged intermediate layers only with
    ``show_all`` (otherwise counted in one line)."""
    shown = [e for e in entries if show_all or e.role != "build-cache"]
    hidden = len(entries) - len(shown)
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("name", "kind", "agent", "pvisor", "size", "created", "last used", "in use"):
        table.add_column(column, overflow="fold")
    for e in shown:
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
    console.print(f"{len(shown)} items, {format_size(sum(e.size for e in shown))} (shared layers counted per image)")
    if hidden:
        console.print(
            f"{hidden} intermediate build layers not shown: `pvisor-host images --all` lists them; "
            "`pvisor-host images prune` removes those no image is built on",
            highlight=False,
        )


def prune_result(console: Console, result: PruneResult, *, dry_run: bool) -> None:
    """``pvisor-host images prune``."""
    verb = "would remove" if dry_run else "removed"
    for entry in result.removed:
        console.print(f"{verb} {entry.name} ({entry.kind}, {format_size(entry.size)})")
    for name, reason in result.kept.items():
        console.print(f"kept {name}: {reason}")
    console.print(f"{verb} {len(result.removed)} items, {format_size(result.freed)}")


def doctor_report(console: Console, report: HealthReport) -> None:
    """``pvisor-host doctor``: one line per check, with the fix where one is needed."""
    marks = {"ok": "[green]ok[/green]  ", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}
    for check in report.checks:
        line = f"{marks[check.status]} {check.name}: {check.detail}"
        if check.fix and check.status != "ok":
            line += f" [dim]→ {check.fix}[/dim]"
        console.print(line, highlight=False, soft_wrap=True)


def _counts(counts: dict[str, int] | Counter[str]) -> str:
    return ", ".join(f"{status} {count}" for status, count in sorted(counts.items())) or "none yet"


class _StderrConsole(Console):
    """A console whose closed pipe is an ``OSError`` to handle, not rich's ``SystemExit(1)``."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


class BatchProgress:
    """Progress of a batch on stderr: a live bar on a terminal; a plain line every ``interval`` seconds and at
    the end otherwise (CI logs); nothing with ``quiet``. Call it with each finished item."""

    def __init__(self, total: int, *, quiet: bool = False, interval: float = 30.0) -> None:
        self.total = total
        self.quiet = quiet
        self.interval = interval
        self.console = _StderrConsole(stderr=True)
        self.counts: Counter[str] = Counter()
        self.done = 0
        self.ran = 0
        self.started = time.monotonic()
        self.last_line = self.started
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._pull_task: TaskID | None = None
        self._pulling: dict[str, PullProgress] = {}

    def __enter__(self) -> BatchProgress:
        if not self.quiet and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]batch[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(_counts(self.counts), total=self.total, rate="")
        return self

    def __call__(self, result: ItemResult) -> None:
        self.counts[result.status] += 1
        self.done += 1
        self.ran += result.ran
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done, description=_counts(self.counts), rate=self._rate())
        elif not self.quiet and time.monotonic() - self.last_line >= self.interval:
            self._line()

    def pull(self, progress: PullProgress) -> None:
        """A task image's pull went on: one line for every pull in flight, however many (counts, bytes, rate,
        and the slowest), as a bar's row on a terminal and at the end of each line in a log."""
        if self.quiet:
            return
        if progress.finished:
            self._pulling.pop(progress.ref, None)
        else:
            self._pulling[progress.ref] = progress
        if self._bar is None:
            return
        line = pulls_line(list(self._pulling.values()))
        if line and self._pull_task is None:
            self._pull_task = self._bar.add_task(line, total=None, rate="")
        elif line and self._pull_task is not None:
            self._bar.update(self._pull_task, description=line)
        elif self._pull_task is not None:
            self._bar.remove_task(self._pull_task)
            self._pull_task = None

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif not self.quiet:
            self._line()

    def _rate(self) -> str:
        minutes = (time.monotonic() - self.started) / 60
        return f"{self.ran / minutes:.1f}/min" if minutes > 0 and self.ran else ""

    def _line(self) -> None:
        self.last_line = time.monotonic()
        minutes = (self.last_line - self.started) / 60
        rate = self.ran / minutes if minutes > 0 else 0.0
        left = self.total - self.done
        eta = f", eta {format_duration(left / rate * 60)}" if rate > 0 and left > 0 else ""
        line = f"batch: {self.done}/{self.total} done ({_counts(self.counts)}), {rate:.1f} replays/min{eta}"
        pulls = pulls_line(list(self._pulling.values()))
        if pulls:
            line += f"; {pulls}"
        try:
            self.console.print(line, highlight=False, soft_wrap=True)
        except OSError:
            self.quiet = True  # stderr is gone (a closed pipe): the batch goes on, its reports are files


def pulls_line(pulls: list[PullProgress]) -> str:
    """The pulls in flight on one short line: ``pulling 3 images: 120.0 MiB/450.0 MiB at 30.0 MiB/s; slowest
    REF 12%`` (empty: none)."""
    if not pulls:
        return ""
    done = sum(p.done for p in pulls)
    totals = [p.total for p in pulls]
    size = f"/{format_size(sum(t for t in totals if t))}" if all(totals) else ""
    rate = format_size(int(sum(p.rate for p in pulls)))
    line = f"pulling {len(pulls)} image{'s' if len(pulls) != 1 else ''}: {format_size(done)}{size} at {rate}/s"
    slowest = min(pulls, key=lambda p: (p.done / p.total if p.total else 0.0, p.rate, p.ref))
    share = f" {100 * slowest.done // slowest.total}%" if slowest.total else f" {format_size(slowest.done)}"
    return f"{line}; slowest {slowest.ref}{share}" if len(pulls) > 1 else f"{line} ({slowest.ref})"


#: Items not ok the end of ``batch`` lists, a line each; the rest are counted, with how to list them.
NOT_OK_LINES = 10


def batch_summary(
    console: Console, summary: BatchSummary, out: Path, results: Sequence[ItemResult] = (), *, quiet: bool = False
) -> None:
    """The end of ``batch``: counts per status and failure category, the items not ok (a line each, the first
    :data:`NOT_OK_LINES`), the verifications, timings, and where the results are."""
    where = f"{_relative(out)}/summary.json, junit.xml, report.html"
    head = f"{summary.items} items: {summary.ran} ran, {summary.skipped} skipped (finished earlier)"
    if summary.interrupted:
        head += ", [yellow]interrupted[/yellow]"
    if summary.deadline_reached:
        head += ", [yellow]deadline reached[/yellow]"
    if summary.flaky:
        head += f", [yellow]{len(summary.flaky)} flaky[/yellow]"
    if quiet:
        console.print(f"{head}; {_counts(summary.counts)}; {where}", highlight=False, soft_wrap=True)
        return
    _flaky(console, summary.flaky)
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    table.add_column("status")
    table.add_column("items", justify="right")
    for status, count in summary.counts.items():
        style = _STATUS_STYLE.get(status, "red")
        table.add_row(f"[{style}]{status}[/{style}]", str(count))
    console.print(head, highlight=False)
    console.print(table)
    if summary.categories:
        console.print("failures: " + _counts(summary.categories), highlight=False, soft_wrap=True)
    if summary.verification is not None:
        console.print(f"verification: {summary.verification.describe()}", highlight=False, soft_wrap=True)
    not_ok_lines(console, results, out)
    images = summary.images
    if images is not None and (images.pulled or images.failed):
        if images.node_pulls is not None:  # a cluster: the nodes pulled, each within its own budget
            line = f"task images: {images.pulled} resolved, {images.node_pulls} pulls by the nodes"
        else:
            budget = f" of a {format_size(images.budget)} budget" if images.budget else ""
            line = (f"task images: {images.pulled} pulled ({format_size(images.downloaded)}), {images.removed} "
                    f"removed, {images.failed} could not be had; peak {format_size(images.peak)}{budget}")  # fmt: skip
        console.print(line, highlight=False, soft_wrap=True)
    if summary.model is not None:
        console.print(f"model: {summary.model.describe()}", highlight=False, soft_wrap=True)
    if summary.egress is not None:
        console.print(f"egress: {summary.egress.describe()}", highlight=False, soft_wrap=True, markup=False)
    total = summary.timings.get("total", {})
    console.print(
        f"per item p50 {format_duration(total.get('p50', 0))}, p90 {format_duration(total.get('p90', 0))}; "
        f"{summary.replays_per_minute} replays/min; {where}",
        highlight=False,
        soft_wrap=True,
    )


def not_ok_lines(console: Console, results: Sequence[ItemResult], out: Path) -> None:
    """The items not ok (or whose verifier did not pass), a line each: id, boundary, status and why; the first
    :data:`NOT_OK_LINES`, then how many more and how to list them."""
    not_ok = [r for r in results if r.not_ok]
    for result in not_ok[:NOT_OK_LINES]:
        step = f"after {result.after_step}" if result.after_step is not None else "-"
        style = _STATUS_STYLE.get(result.status, "red")
        line = Text.assemble(f"  {result.id}  {step}  ", (result.outcome_line(), style))
        console.print(line, highlight=False, soft_wrap=True)
    if len(not_ok) > NOT_OK_LINES:
        more = len(not_ok) - NOT_OK_LINES
        console.print(
            f"  … and {more} more: pvisor-host results {shlex.quote(_relative(out))} --not-ok --format csv",
            highlight=False,
            soft_wrap=True,
        )


def batch_plan(
    console: Console,
    plans: Iterable[ItemPlan],
    *,
    json_output: bool,
    verbose: bool = False,
    images: ImagesPlanned | None = None,
    slice: ManifestCheck | None = None,
) -> None:
    """``batch --plan``: a line per item (id, agent, boundary, image, verdict and why), with ``verbose`` its mounts,
    limits and command too; then the counts (and the task images, when there are any).

    Each item is written as soon as it is planned and then dropped, so memory stays flat however long the
    manifest; ``--json`` writes one JSON array, an item per line, without rich's highlighting.
    """
    if json_output:
        separator = "["
        for plan in plans:
            console.file.write(f"{separator}\n{plan.model_dump_json()}")
            separator = ","
        console.file.write("[]\n" if separator == "[" else "\n]\n")
        return
    actions: Counter[str] = Counter()
    writes, unknown = 0, 0
    for plan in plans:
        actions[plan.action] += 1
        if plan.action == "run" and plan.collect is not None:
            writes += plan.write_bytes or 0
            unknown += plan.write_bytes is None
        style = {"run": "green", "skip": "dim", "reject": "red"}[plan.action]
        step = f"after {plan.after_step}" if plan.after_step is not None else "-"
        line = Text.assemble(
            (plan.id, "bold"), f"  {plan.agent or '-'}  {step}  {plan.image or '-'}  ", (plan.action, style)
        )
        if plan.reason:
            line.append(f": {plan.reason}")
        console.print(line, highlight=False, soft_wrap=True)
        if verbose and plan.action != "reject":
            _plan_details(console, plan)
    if writes or unknown:
        more = f", plus the workspaces of {unknown} items from their images" if unknown else ""
        console.print(f"about {format_size(writes)} to write{more}", highlight=False)
    of = ""
    if slice is not None and slice.slice is not None:
        of = f" ({slice.slice} of {slice.total})"
    console.print(
        f"{actions.total()} items{of}: {actions['run']} to run, {actions['skip']} to skip, "
        f"{actions['reject']} rejected",
        highlight=False,
    )
    if images is not None and images.costs:
        table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for column in ("task image", "here", "to pull", "digest"):
            table.add_column(column, justify="right" if column == "to pull" else "left", overflow="fold")
        for cost in images.costs.values():
            here = "yes" if cost.present else ("[red]no[/red]" if cost.error else "no")
            pull = "-" if cost.present else (cost.error or format_size(cost.pull_bytes))
            table.add_row(cost.ref, here, pull, cost.digest or cost.id or "-")
        console.print(table)
        console.print(
            f"{len(images.costs)} task images: {images.present} here, {len(images.to_pull)} to pull "
            f"({format_size(images.pull_bytes)} to download, each layer once)",
            highlight=False,
        )


def _plan_details(console: Console, plan: ItemPlan) -> None:
    """``batch --plan -v``: the item's image, mounts, limits, command, what it writes and its content key."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column(overflow="fold")
    grid.add_row("  image", f"{plan.image or '-'} {plan.image_id or ''}".strip())
    if plan.image_note:
        grid.add_row("", plan.image_note)
    grid.add_row("  mounts", "\n".join(plan.mounts))
    if plan.limits is not None:
        lim = plan.limits
        grid.add_row(
            "  limits",
            f"memory {format_size(lim.memory)}, cpus {lim.cpus:g}, pids {lim.pids}, "
            f"timeout {format_duration(lim.timeout)}, network {lim.network}, user {lim.user}, "
            f"{'read-only' if lim.read_only_rootfs else 'writable'} rootfs",
        )
    if plan.model_gateway:
        grid.add_row("  model", f"host-side gateway over {plan.model_gateway}")
    if plan.command:
        grid.add_row("  command", shlex.join(plan.command))
    if plan.collect is not None:
        size = format_size(plan.write_bytes) if plan.write_bytes is not None else "its workspace from the image"
        grid.add_row("  writes", f"about {size} (--collect {plan.collect})")
    grid.add_row("  key", plan.content_key or "known once the image is here")
    console.print(grid)


def comparison(console: Console, result: Comparison) -> None:
    """``pvisor-host compare``: one row per changed item, regressions first, then the counts."""
    if result.changes:
        table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for column in ("change", "item", "step", "was → is"):
            table.add_column(column, overflow="fold")
        for change in result.changes:
            style = _CHANGE_STYLE.get(change.kind, "")
            kind = f"[{style}]{change.kind}[/{style}]" if style else change.kind
            table.add_row(kind, change.id, str(change.after_step), change.describe)
        console.print(table)
    counts = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in result.counts.items()) or "no changes"
    console.print(f"{result.matched} items matched, {result.unchanged} unchanged; {counts}", highlight=False)
    if result.model is not None:
        console.print(f"model: {result.model.describe}", highlight=False, soft_wrap=True)
    for line in result.environment:
        console.print(f"environment differs: {line}", highlight=False, soft_wrap=True, markup=False)
    _flaky(console, result.flaky)


def _flaky(console: Console, flaky: list[FlakyItem]) -> None:
    """The items whose repeats (``--repeat``) differ: one line each, what each repeat did."""
    for item in flaky:
        files = f"; files differ: {', '.join(item.files)}" if item.files else ""
        line = f"[yellow]flaky[/yellow] {item.id} (after step {item.after_step}): {' | '.join(item.outcomes)}{files}"
        console.print(line, highlight=False, soft_wrap=True)


def gc_report(console: Console, report: GcReport, *, dry_run: bool) -> None:
    """``pvisor-host gc``."""
    verb = "would remove" if dry_run else "removed"
    for r in report.orphans:
        if r.name in report.failed:
            console.print(f"[red]could not remove[/red] {r.kind} {r.name}: {report.failed[r.name]}", highlight=False)
        else:
            console.print(f"{verb} {r.kind} {r.name} (owner {r.owner} is gone)", highlight=False)
    done = len(report.orphans) - len(report.failed)
    console.print(
        f"{verb} {done} resources; left {report.live} of live pvisor-host processes"
        f" and {report.other_hosts} of other hosts",
        highlight=False,
    )


def cluster_status(console: Console, nodes: list[NodeStatus]) -> None:
    """``cluster status``: a row per node, then the totals."""
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("node", "address", "state", "engine", "slots", "running", "free", "images", "task images"):
        table.add_column(column, justify="right" if column in ("slots", "running", "free") else "left")
    for node in nodes:
        state = "[green]alive[/green]" if node.alive else "[red]dead[/red]"
        images = ", ".join(tag.rsplit("/", 1)[-1] for tag in node.images) or "-"
        counts = (str(node.slots), str(node.running), str(node.free))
        tasks = "-"
        if node.task_images or node.task_image_budget is not None:
            budget = f" of {format_size(node.task_image_budget)}" if node.task_image_budget else ""
            tasks = (f"{node.task_images}: {format_size(node.task_image_bytes)}{budget}, "
                     f"peak {format_size(node.task_image_peak)}")  # fmt: skip
        table.add_row(node.node, node.address, state, node.engine or "-", *counts, images, tasks)
    console.print(table)
    alive = [n for n in nodes if n.alive and n.slots]
    slots, running, free = sum(n.slots for n in alive), sum(n.running for n in alive), sum(n.free for n in alive)
    console.print(f"{len(alive)} nodes with an engine, {slots} slots, {running} running, {free} free", highlight=False)
