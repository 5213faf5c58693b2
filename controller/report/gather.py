"""What the batch report shows, gathered from a batch's ``--out`` directory into one typed model.

It scales to datasets: every item gets a compact row (from ``results.jsonl``, or the records), and the
aggregates (by status, category, image, boundary, the tool calls that diverge most often, phase times) are
over every item. Reading files per item is kept to what needs it: pvisor's ``observation-comparison.json``
and ``manifest.json`` of the items with a call that did not reproduce (for the groups); and, for as many items
as the page's budget has room for, failures and divergences first, the record, the calls, the recorded and
fresh observations of the calls that did not reproduce (a compact diff, :mod:`.observations`) and, for a
continued run, ``next-action-comparison.json``. Nothing here fails on one unreadable item: it is shown with what
could be read.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from ..fanout.compare import Comparison, state_line
from ..fanout.results import iter_results
from ..models.batch import PHASES, ItemResult, percentile
from ..models.observations import read_observations
from ..models.record import ModelTotals, add_totals, load_record
from .budget import PAGE_BUDGET, fit
from .model import (
    INDEXED,
    REPORT_SCHEMA,
    ROW,
    ROW_DEFAULTS,
    ActionTool,
    BoundaryRow,
    CallView,
    DivergenceGroup,
    ImageRow,
    ItemView,
    NextActionView,
    PhaseStats,
    ReportData,
    field_defaults,
)
from .observations import compact_diff

#: Arguments that name what a call did, in the order they are looked for (shell tools first).
COMMAND_KEYS = ("command", "cmd", "file_path", "path", "pattern", "url", "query")
#: At most this many calls of one item get a diff (the first ones that did not reproduce).
DIFFS_PER_ITEM = 8
TOP_GROUPS = 15
#: Below this much room no item's details fit (an id and an empty list of calls).
_LEAST_DETAIL = 48
#: A row's message is cut to this many characters (the record has the whole).
MESSAGE_CHARS = 300


def gather(
    out: Path,
    results: list[ItemResult] | None = None,
    *,
    budget: int = PAGE_BUDGET,
    comparison: Comparison | None = None,
) -> ReportData:
    """Read the batch directory ``out`` (with its items' results when the batch passes them): every item's row
    and the aggregates, then the details of as many items as ``budget`` characters of JSON hold beside the rows
    (see :mod:`.budget`); and, against a baseline, the ``comparison``."""
    table = _Table()
    groups = _Groups()
    images: dict[str, _ImageTally] = {}
    boundaries: dict[int, list[int]] = {}
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    totals: list[ModelTotals] = []
    candidates: list[tuple[int, int, str, str]] = []
    for result in results if results is not None else iter_results(out):
        view = _row_view(result)
        if view.dir is not None and not (out / view.dir).is_dir():
            view.dir = None  # nothing to link to
        # the calls of an item some of whose calls did not reproduce, or whose row cannot say (an older results file)
        unknown = result.diverged is None and result.status not in ("rejected", "not_run")
        calls = _compared(out, view) if view.dir is not None and (unknown or view.diverged > 0) else None
        if calls is not None:
            outcomes = Counter(call.outcome for call in calls)
            view.exact, view.whitespace = outcomes["exact"], outcomes["whitespace"]
            view.diverged, view.errored = outcomes["diverged"], outcomes["errored"]
            groups.add(view.id, calls)
        elif view.replayed and view.status == "ok":  # every replayed call reproduced (the row says none diverged)
            view.exact = view.replayed - view.whitespace
        index = table.add(view)
        _tally(images, boundaries, view)
        if not result.skipped:
            for phase, seconds in result.timings().items():
                phases[phase].append(seconds)
            model = result.model_totals()
            if model is not None:
                totals.append(model)
        if view.dir is not None:
            candidates.append((_priority(view), index, view.id, view.dir))
    summary = _summary(out)
    data = ReportData(
        schema_version=REPORT_SCHEMA,
        title=f"pvisor-host batch {out.name}",
        generated_at=datetime.now(UTC),
        counts=dict(table.statuses.most_common()),
        categories=dict(table.categories.most_common()),
        phases={phase: _stats(sorted(values)) for phase, values in phases.items() if values},
        rows=table.rows,
        values=table.values,
        by_tool=groups.top(by_command=False),
        by_command=groups.top(by_command=True),
        by_image=_image_rows(images),
        by_boundary=[
            BoundaryRow(after_step=k, items=v[0], ok=v[1], diverged=v[2]) for k, v in sorted(boundaries.items())
        ],
        images=summary.get("images"),
        verification=summary.get("verification"),
        egress=summary.get("egress"),
        flaky=summary.get("flaky") or [],
        comparison=comparison_view(comparison) if comparison is not None else None,
        diffs_dropped=0,
        exact_hidden=0,
        model=_model_line(add_totals(totals)),
        defaults=field_defaults(),
    )
    left = budget - len(data.model_copy(update={"rows": []}).page_json()) - 64  # the rows are not in the budget
    details, undetailed, dropped, hidden = _details(out, candidates, left)
    return data.model_copy(
        update={"details": details, "undetailed": undetailed, "diffs_dropped": dropped, "exact_hidden": hidden}
    )


class _Table:
    """The rows, with the strings that repeat stored once (:attr:`ReportData.values`)."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.values: list[str | None] = []
        self._index: dict[str | None, int] = {}
        self.statuses: Counter[str] = Counter()
        self.categories: Counter[str] = Counter()

    def value(self, text: str | None) -> int | None:
        if text is None:
            return None
        found = self._index.get(text)
        if found is None:
            found = self._index[text] = len(self.values)
            self.values.append(text)
        return found

    def add(self, view: ItemView) -> int:
        self.statuses[view.status] += 1
        if view.category:
            self.categories[view.category] += 1
        fields = view.model_dump(include=set(ROW))
        if fields["exact"] == max(0, (fields["replayed"] or 0) - fields["diverged"] - fields["errored"]):
            fields["exact"] = None  # what the page works out from the others
        if fields["dir"] is not None and fields["dir"] == fields["id"]:
            fields["dir"] = 1
        row = [self.value(fields[name]) if name in INDEXED else _compact(fields[name]) for name in ROW]
        while row and row[-1] == _compact(ROW_DEFAULTS.get(ROW[len(row) - 1])):
            row.pop()
        self.rows.append(row)
        return len(self.rows) - 1


def _compact(value: Any) -> Any:
    """Booleans as 0 and 1, seconds to the hundredth."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return round(value, 2)
    return value


class _ImageTally:
    def __init__(self) -> None:
        self.items = self.ok = self.verified = self.passed = 0
        self.waits: list[float] = []


def _tally(images: dict[str, _ImageTally], boundaries: dict[int, list[int]], view: ItemView) -> None:
    if view.image is not None:
        tally = images.setdefault(view.image, _ImageTally())
        tally.items += 1
        tally.ok += view.status == "ok"
        if view.verified is not None:
            tally.verified += 1
            tally.passed += view.verified
        if view.pull_wait is not None:
            tally.waits.append(view.pull_wait)
    if view.after_step is not None:
        counts = boundaries.setdefault(view.after_step, [0, 0, 0])
        counts[0] += 1
        counts[1] += view.status == "ok"
        counts[2] += view.diverged + view.errored > 0


def _image_rows(images: dict[str, _ImageTally]) -> list[ImageRow]:
    return [
        ImageRow(
            image=image, items=t.items, ok=t.ok, verified=t.verified, passed=t.passed,
            pull_wait_p50=round(percentile(sorted(t.waits), 0.5), 3) if t.waits else None,
        )
        for image, t in sorted(images.items(), key=lambda entry: (-entry[1].items, entry[0]))
    ]  # fmt: skip


#: Most changed items the page lists against a baseline (``compare.json`` has them all).
COMPARED_ROWS = 500


def comparison_view(comparison: Comparison) -> dict[str, Any]:
    """What the page shows of a comparison: the counts, then each change as the baseline had it and as this run
    has it, regressions first (as :class:`Comparison` orders them), at most :data:`COMPARED_ROWS`."""
    return {
        "baseline": comparison.old,
        "matched": comparison.matched,
        "unchanged": comparison.unchanged,
        "counts": comparison.counts,
        "total": len(comparison.changes),
        "changes": [
            {
                "id": c.id,
                "after_step": c.after_step,
                "kind": c.kind,
                "was": state_line(c.old),
                "is": state_line(c.new),
                "files": c.files,
                "new_hosts": c.new_hosts,
                "image_changed": c.image_changed,
            }
            for c in comparison.changes[:COMPARED_ROWS]
        ],
    }


def _summary(out: Path) -> dict[str, Any]:
    try:
        value = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _row_view(result: ItemResult) -> ItemView:
    """An item's row, from its result alone (no file read)."""
    model = result.model_totals()
    return ItemView(
        id=result.id,
        line=result.line,
        status=result.status,
        category=result.category,
        message=_short(result.message, MESSAGE_CHARS) if result.message else None,
        agent=result.agent,
        image=result.image,
        after_step=result.after_step,
        replayed=result.replayed,
        continued=result.continued,
        whitespace=result.whitespace or 0,
        diverged=result.diverged or 0,
        duration=round(result.time_total, 3) if result.time_total is not None else None,
        pull_wait=round(result.time_pull_wait, 3) if result.time_pull_wait is not None else None,
        attempts=result.attempts,
        skipped=result.skipped,
        dir=result.path,
        tokens=model.input_tokens + model.output_tokens if model is not None else None,
        verified=result.verification_passed,
        reward=result.verification_reward,
        egress=result.egress_connections,
        refused=result.egress_refused,
        model=_model_line(model),
    )


def _priority(view: ItemView) -> int:
    """Which items' details the page holds first: failures, then divergences, then the rest."""
    if view.status != "ok":
        return 0
    return 1 if view.diverged + view.errored else 2


def _compared(out: Path, view: ItemView) -> list[CallView] | None:
    """The item's replayed calls from pvisor's output files and how its record says each matched: None when there
    are none."""
    assert view.dir is not None
    output = out / view.dir / "output"
    compared = _read_json(output / "observation-comparison.json")
    if not isinstance(compared, list):
        return None
    record = _read_json(out / view.dir / "record.json")
    observations = record.get("observations") if isinstance(record, dict) else None
    return _calls(compared, _arguments(_read_json(output / "manifest.json")), _matches(observations))


def _matches(observations: Any) -> dict[str, str]:
    """Each call id's match (``exact``, ``whitespace``, ``diverged``) from a record's ``observations``."""
    calls = observations.get("calls") if isinstance(observations, dict) else None
    if not isinstance(calls, list):
        return {}
    return {str(c.get("call_id")): str(c.get("match")) for c in calls if isinstance(c, dict)}


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _details(
    out: Path, candidates: list[tuple[int, int, str, str]], room: int
) -> tuple[dict[str, dict[str, Any]], int, int, int]:
    """The details of the items the page has ``room`` for, failures and divergences first (then in order):
    their calls without diffs first; then diffs, each item's first one before any item's second; then the exact
    calls. Returns the details by id, and how many items went without, diffs dropped, exact listings hidden."""
    chosen: list[tuple[ItemView, _Observations | None]] = []
    undetailed = 0
    for _, _, item_id, directory in sorted(candidates):
        if room < _LEAST_DETAIL:  # full: the rest are counted, not read
            undetailed += 1
            continue
        view, source = _detail_view(out, item_id, directory)
        cost = _size({item_id: _detail_dump(view, with_exact=False)}) - 1  # its entry in "details", and a comma
        if cost > room:
            undetailed += 1
            continue
        room -= cost
        chosen.append((view, source))
    unread = _add_diffs([(view, source) for view, source in chosen if source is not None], room)
    views = [view for view, _ in chosen]
    base = sum(_size(_detail_dump(view, with_exact=False)) for view in views)
    dropped, hidden = fit(views, fixed=0, base=base, budget=room + base)
    details = {view.id: _detail_dump(view, with_exact=True) for view in views}
    return details, undetailed, unread + dropped, hidden


def _size(value: Any) -> int:
    """Characters of ``value`` as the page's JSON has it (compact)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _detail_dump(view: ItemView, *, with_exact: bool) -> dict[str, Any]:
    calls = view.calls if with_exact else [c for c in view.calls if c.outcome != "exact"]
    detail: dict[str, Any] = {"calls": [c.model_dump(exclude_defaults=True) for c in calls]}
    if view.mode is not None:
        detail["mode"] = view.mode
    if not view.exact_listed:
        detail["exact_listed"] = False
    if view.next_action is not None:
        detail["next_action"] = view.next_action.model_dump(exclude_defaults=True)
    if view.model is not None:
        detail["model"] = view.model
    return detail


def _detail_view(out: Path, item_id: str, directory: str) -> tuple[ItemView, _Observations | None]:
    """An item's details from its record and the files beside it."""
    item_dir = out / directory
    view = ItemView(id=item_id, line=0, status="")
    try:
        record = load_record(item_dir / "record.json")
    except (OSError, ValueError):
        return view, None
    view.mode = record.inputs.mode
    view.model = _model_line(record.model.totals if record.model is not None else None)
    compared = record.artifact_json(item_dir, "observation_comparison")
    if isinstance(compared, list):
        matches = {c.call_id: c.match for c in record.observations.calls} if record.observations is not None else {}
        view.calls = _calls(compared, _arguments(record.artifact_json(item_dir, "playback_plan")), matches)
    view.next_action = _next_action(record.artifact_json(item_dir, "next_action_comparison"))
    fresh = record.artifact_path(item_dir, "reconstructed_native_trajectory")
    if fresh is None or not any(call.outcome not in ("exact", "whitespace") for call in view.calls):
        return view, None
    return view, _Observations(Path(record.inputs.trajectory.path), record.inputs.trajectory.size, fresh)


def _model_line(totals: ModelTotals | None) -> str | None:
    return totals.describe() if totals is not None else None


def _stats(values: list[float]) -> PhaseStats:
    return PhaseStats(
        count=len(values),
        min=round(values[0], 3),
        p10=round(percentile(values, 0.1), 3),
        p50=round(percentile(values, 0.5), 3),
        p90=round(percentile(values, 0.9), 3),
        max=round(values[-1], 3),
    )


class _Observations(NamedTuple):
    """Where an item's recorded and fresh observations are, for its diffs."""

    original: Path
    size: int
    """The original trajectory's size in the record: a file of another size is not the one replayed."""
    fresh: Path


def _calls(compared: list[Any], arguments: dict[str, Any], matches: Mapping[str, str]) -> list[CallView]:
    calls = []
    for index, entry in enumerate(c for c in compared if isinstance(c, dict)):
        call_id = str(entry.get("call_id"))
        exact = bool(entry.get("exact"))
        replayed_error = bool(entry.get("replayed_is_error"))
        calls.append(
            CallView(
                index=index,
                call_id=call_id,
                tool=str(entry.get("tool")),
                command=_command(arguments.get(call_id)),
                outcome="exact"
                if exact
                else "errored"
                if replayed_error
                else "whitespace"
                if matches.get(call_id) == "whitespace"
                else "diverged",
                original_is_error=bool(entry.get("original_is_error")),
                replayed_is_error=replayed_error,
            )
        )
    return calls


def _add_diffs(pending: list[tuple[ItemView, _Observations]], room: int) -> int:
    """Diffs for the calls that did not reproduce, while the page has ``room`` for them: first each item's
    first one, then the others (up to ``DIFFS_PER_ITEM``). Reading the trajectories is what a report costs,
    so a batch too large for any diff reads none. Returns how many calls were left without a look."""
    skipped = 0
    for first in (True, False):
        for view, source in pending:
            differing = [call for call in view.calls if call.outcome not in ("exact", "whitespace")][:DIFFS_PER_ITEM]
            calls = differing[:1] if first else differing[1:]
            if room <= 0:
                skipped += len(calls)
            elif calls:
                room -= _diff(calls, source)
    return skipped


def _diff(calls: list[CallView], source: _Observations) -> int:
    """Set each call's diff from its two observations; return the characters added."""
    ids = {call.call_id for call in calls}
    fresh = read_observations(source.fresh, ids)
    recorded = read_observations(source.original, ids) if fresh and _unchanged(source.original, source.size) else {}
    added = 0
    for call in calls:
        if call.call_id in fresh and call.call_id in recorded:
            call.diff = compact_diff(recorded[call.call_id], fresh[call.call_id])
            added += len(call.diff) + 16
    return added


def _unchanged(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _next_action(value: Any) -> NextActionView | None:
    if not isinstance(value, dict) or not isinstance(value.get("metrics"), dict):
        return None
    metrics, original, replayed = value["metrics"], value.get("original") or {}, value.get("replayed") or {}
    return NextActionView(
        original_tools=_tools(original),
        replayed_tools=_tools(replayed),
        tool_names_equal=bool(metrics.get("ordered_tool_names_equal")),
        tool_arguments_equal=bool(metrics.get("tool_arguments_equal")),
        text_status=str(metrics.get("text_comparison_status")),
        text_similarity=metrics.get("text_similarity"),
        original_text=_short(original.get("text"), 400),
        replayed_text=_short(replayed.get("text"), 400),
    )


def _tools(action: Any) -> list[ActionTool]:
    tools = action.get("tools") if isinstance(action, dict) else None
    if not isinstance(tools, list):
        return []
    return [
        ActionTool(name=str(t.get("name")), command=_command(t.get("arguments"))) for t in tools if isinstance(t, dict)
    ]


class _Groups:
    """The replayed calls that did not reproduce, grouped by tool and by (tool, command), over every item."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str | None]] = Counter()
        self.diverged: Counter[tuple[str, str | None]] = Counter()
        self.where: defaultdict[tuple[str, str | None], list[str]] = defaultdict(list)

    def add(self, item_id: str, calls: list[CallView]) -> None:
        for call in calls:
            for key in ((call.tool, None), (call.tool, call.command)):
                self.calls[key] += 1
                if call.outcome not in ("exact", "whitespace"):
                    self.diverged[key] += 1
                    if len(self.where[key]) < 10 and item_id not in self.where[key]:
                        self.where[key].append(item_id)

    def top(self, *, by_command: bool) -> list[DivergenceGroup]:
        keys = [key for key in self.diverged if (key[1] is not None) == by_command]
        top = sorted(keys, key=lambda key: (-self.diverged[key], key[0], key[1] or ""))[:TOP_GROUPS]
        return [
            DivergenceGroup(
                tool=tool, command=command, diverged=self.diverged[(tool, command)], calls=self.calls[(tool, command)],
                items=self.where[(tool, command)],
            )
            for tool, command in top
        ]  # fmt: skip


def _arguments(plan: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    batches = plan.get("batches") if isinstance(plan, dict) else None
    for batch in batches if isinstance(batches, list) else []:
        for call in batch.get("tool_calls", []) if isinstance(batch, dict) else []:
            if isinstance(call, dict) and "call_id" in call:
                found[str(call["call_id"])] = call.get("arguments")
    return found


def _command(arguments: Any) -> str | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return _short(arguments, 120)
    if not isinstance(arguments, dict):
        return None
    for key in COMMAND_KEYS:
        value = arguments.get(key)
        if isinstance(value, list) and all(isinstance(part, str) for part in value):
            value = " ".join(value)
        if isinstance(value, str) and value.strip():
            return _short(value, 120)
    return None


def _short(text: Any, limit: int) -> str:
    if not isinstance(text, str):
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
