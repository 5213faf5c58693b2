"""What the batch report shows, gathered from a batch's ``--out`` directory into one typed model.

Per item it reads the record, pvisor's ``manifest.json`` (each call's tool and arguments),
``observation-comparison.json`` (which calls reproduced exactly) and, for the calls that did not, the
recorded and fresh observations (see :mod:`.observations`) for a compact diff; for a continued run also
``next-action-comparison.json``. Items that never got a record (refused before a sandbox, left unstarted
at the deadline) come from ``results.jsonl``. Nothing here fails on one unreadable item: it is shown with
what could be read.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import UsageError
from ..models.batch import PHASES, RESULTS_FILE, ItemResult, percentile
from ..models.record import ModelTotals, ReplayRecord, add_totals, load_record
from .budget import PAGE_BUDGET, base_size, fit
from .model import (
    REPORT_SCHEMA,
    ActionTool,
    CallView,
    DivergenceGroup,
    ItemView,
    NextActionView,
    PhaseStats,
    ReportData,
    field_defaults,
)
from .observations import compact_diff, read_observations

#: Arguments that name what a call did, in the order they are looked for (shell tools first).
COMMAND_KEYS = ("command", "cmd", "file_path", "path", "pattern", "url", "query")
#: At most this many calls of one item get a diff (the first ones that did not reproduce).
DIFFS_PER_ITEM = 8
TOP_GROUPS = 15


def gather(out: Path, results: list[ItemResult] | None = None, *, budget: int = PAGE_BUDGET) -> ReportData:
    """Read the batch directory ``out`` (with its items' results when the batch passes them), and fit what
    the page shows into ``budget`` characters of JSON (see :mod:`.budget`)."""
    results = results if results is not None else load_results(out)
    read = [_item(out, result) for result in results]
    items = [view for view, _ in read]
    ran = [result for result in results if not result.skipped]
    data = ReportData(
        schema_version=REPORT_SCHEMA,
        title=f"pvisor-host batch {out.name}",
        generated_at=datetime.now(UTC),
        counts=dict(Counter(item.status for item in items).most_common()),
        categories=dict(Counter(item.category for item in items if item.category).most_common()),
        phases={
            phase: _stats(values)
            for phase in PHASES
            if (values := sorted(r.timings[phase] for r in ran if phase in r.timings))
        },
        items=[],
        by_tool=_groups(items, by_command=False),
        by_command=_groups(items, by_command=True),
        diffs_dropped=0,
        exact_hidden=0,
        model=_model_line(add_totals([r.model for r in ran if r.model is not None])),
        defaults=field_defaults(),
    )
    fixed, base = len(data.page_json()) + 64, base_size(items)
    unread = _add_diffs([(v, source) for v, source in read if source is not None], budget - fixed - base)
    dropped, hidden = fit(items, fixed=fixed, base=base, budget=budget)
    return data.model_copy(update={"items": items, "diffs_dropped": unread + dropped, "exact_hidden": hidden})


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


def load_results(out: Path) -> list[ItemResult]:
    """The items of the batch directory ``out``: from its ``results.jsonl`` when the batch wrote one (every
    item), else from its records (the items that got one)."""
    if not out.is_dir():
        raise UsageError(f"{out} is not a directory; pass a batch's --out directory")
    try:
        lines = (out / RESULTS_FILE).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        lines = None
    except OSError as exc:
        raise UsageError(f"cannot read {out / RESULTS_FILE}: {exc.strerror}") from None
    if lines is not None:
        try:
            return [ItemResult.model_validate_json(line) for line in lines if line.strip()]
        except ValueError:
            problem = f"{out / RESULTS_FILE} is not a batch's results file"
            raise UsageError(f"{problem}; rerun the batch into {out} to rewrite it") from None
    from ..fanout.resume import item_result

    results = []
    for path in sorted(out.glob("*/record.json")):
        try:
            record = load_record(path)
        except (OSError, ValueError):
            continue
        item_id, line = (record.batch.item_id, record.batch.line) if record.batch else (path.parent.name, 0)
        results.append(item_result(record, item_id=item_id, line=line).model_copy(update={"path": path.parent.name}))
    if not results:
        raise UsageError(
            f"{out} holds no batch results (no results.jsonl or */record.json); pass a batch's --out directory"
        )
    return sorted(results, key=lambda r: (r.line, r.id))


class _Observations(NamedTuple):
    """Where an item's recorded and fresh observations are, for its diffs."""

    original: Path
    size: int
    """The original trajectory's size in the record: a file of another size is not the one replayed."""
    fresh: Path


def _item(out: Path, result: ItemResult) -> tuple[ItemView, _Observations | None]:
    view = ItemView(
        id=result.id,
        line=result.line,
        status=result.status,
        category=result.category,
        message=result.message,
        agent=result.agent,
        duration=round(result.timings["total"], 3) if "total" in result.timings else None,
        attempts=result.attempts,
        skipped=result.skipped,
        dir=result.path,
        tokens=result.model.input_tokens + result.model.output_tokens if result.model is not None else None,
        model=_model_line(result.model),
    )
    item_dir = out / result.path if result.path is not None else None
    if item_dir is None or not item_dir.is_dir():
        view.dir = None  # nothing to link to
        return view, None
    try:
        record = load_record(item_dir / "record.json")
    except (OSError, ValueError):
        return view, None
    view.mode, view.after_step = record.inputs.mode, record.inputs.after_step
    if record.result is not None:
        view.replayed, view.continued = record.result.replayed_tool_calls, record.result.continued_steps
    view.calls = _calls(record, item_dir)
    outcomes = Counter(call.outcome for call in view.calls)
    view.exact, view.diverged, view.errored = outcomes["exact"], outcomes["diverged"], outcomes["errored"]
    view.next_action = _next_action(record.artifact_json(item_dir, "next_action_comparison"))
    fresh = record.artifact_path(item_dir, "reconstructed_native_trajectory")
    if fresh is None or not any(call.outcome != "exact" for call in view.calls):
        return view, None
    return view, _Observations(Path(record.inputs.trajectory.path), record.inputs.trajectory.size, fresh)


def _calls(record: ReplayRecord, item_dir: Path) -> list[CallView]:
    compared = record.artifact_json(item_dir, "observation_comparison")
    if not isinstance(compared, list):
        return []
    arguments = _arguments(record.artifact_json(item_dir, "playback_plan"))
    calls = []
    for index, entry in enumerate(c for c in compared if isinstance(c, dict)):
        exact = bool(entry.get("exact"))
        replayed_error = bool(entry.get("replayed_is_error"))
        call_id = str(entry.get("call_id"))
        calls.append(
            CallView(
                index=index,
                call_id=call_id,
                tool=str(entry.get("tool")),
                command=_command(arguments.get(call_id)),
                outcome="exact" if exact else "errored" if replayed_error else "diverged",
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
            differing = [call for call in view.calls if call.outcome != "exact"][:DIFFS_PER_ITEM]
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


def _groups(items: list[ItemView], *, by_command: bool) -> list[DivergenceGroup]:
    calls: Counter[tuple[str, str | None]] = Counter()
    diverged: Counter[tuple[str, str | None]] = Counter()
    where: defaultdict[tuple[str, str | None], list[str]] = defaultdict(list)
    for item in items:
        for call in item.calls:
            key = (call.tool, call.command if by_command else None)
            calls[key] += 1
            if call.outcome != "exact":
                diverged[key] += 1
                if len(where[key]) < 10 and item.id not in where[key]:
                    where[key].append(item.id)
    top = sorted(diverged, key=lambda key: (-diverged[key], key[0], key[1] or ""))[:TOP_GROUPS]
    return [
        DivergenceGroup(
            tool=tool,
            command=command,
            diverged=diverged[(tool, command)],
            calls=calls[(tool, command)],
            items=where[(tool, command)],
        )
        for tool, command in top
    ]


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
