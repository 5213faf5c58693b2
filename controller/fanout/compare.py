"""``pvisor-host compare OLD NEW``: what changed between two batch runs, read from their run directories.

Items are matched by id and boundary (``after_step``); an item whose boundary changed is gone at the old
one and new at the new one. For each pair it reports, regressions first:

* ``regression`` — it was ``ok`` and is not any more (failed, rejected before a sandbox, not run, or not in the new
  run at all), or its verification (``--verify``) passed and does not now;
* ``new_failure`` — it is new and not ``ok`` (or its verification did not pass): a guard fails on it as on a
  regression;
* ``fixed`` — it was not ``ok`` and is now, or its verification failed and passes now;
* ``status_changed`` — neither is ``ok``, and the status or the failure category differs;
* ``divergence_moved`` — same status, but the replayed tool calls whose fresh observation differs from the
  recorded one are other calls (not only the first: the whole set is compared);
* ``effects_changed`` — same status and the same diverged calls, but the replay left the workspace otherwise:
  a file it added or changed has other content, or one run touched a file the other did not
  (:attr:`ItemChange.files`; from the record's workspace changes and the collected files' sha256);
* ``new_hosts`` — nothing of the above, but its replayed tool calls reached hosts through the egress proxy
  (``--egress``) that they did not reach before (:attr:`ItemChange.new_hosts`; any other change names them too);
* ``image_changed`` — nothing of the above, but it ran in other bytes: its image's registry digest (or, for
  an image without one, its id) differs;
* ``new`` (and ok) and ``gone`` (and was not ok).

Every item of each run counts, whether or not it got a record: the items are its rows (``results.jsonl``, or the
records of a batch killed before writing it: :mod:`.results`), and each row's record, where it has one, adds
what only a record says (the calls that diverged, the workspace's effects, the hosts reached).

Two ``replay --out`` directories (a ``record.json`` each) compare the same way: their one item each is the
pair (named by the earlier one's trajectory file; a warning when the two trajectories' names differ), and a
boundary that moved is ``gone`` and ``new`` as for a batch.

With live continuations it also says how the model's figures moved between the two runs, over every item of
each (tokens in and out, errors, retries, cost): :attr:`Comparison.model`.

Any change also says whether the image changed (``image_changed``), so a regression that came with a new
task image shows it.

The divergence comes from pvisor's ``observation-comparison.json`` (``sandbox-playback/comparison-v1``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, Field

from .._log import logger
from ..errors import UsageError
from ..files.atomic import write_atomic
from ..models.batch import FlakyItem, ItemKeys, ItemResult
from ..models.observations import match_observations
from ..models.record import ModelTotals, ReplayRecord, VerificationOutcome, add_totals, load_record
from ..units import shortlist
from .results import iter_results
from .summary import STEP_SUMMARY_ITEMS, append_step_summary, cell, more_line

COMPARE_SCHEMA = "pvisor-host.compare/v1"
COMPARISON_ROLE = "observation_comparison"
ChangeKind = Literal[
    "regression", "new_failure", "fixed", "status_changed", "divergence_moved", "effects_changed", "new_hosts",
    "image_changed", "new", "gone",
]  # fmt: skip
#: The order changes are listed in: what a CI guard must look at first.
KIND_ORDER: tuple[ChangeKind, ...] = (
    "regression", "new_failure", "status_changed", "divergence_moved", "effects_changed", "new_hosts",
    "image_changed", "gone", "new", "fixed",
)  # fmt: skip
#: The changes a guard fails on: an item that was ok and is not (or is gone), a new item that is not ok.
FAILING: frozenset[ChangeKind] = frozenset({"regression", "new_failure"})
#: In :attr:`ItemState.effects`: a file the replay removed, and one whose content was not collected.
REMOVED, UNCOLLECTED = "removed", "?"


class CallRef(BaseModel):
    """A replayed tool call, as pvisor's observation comparison names it."""

    index: int
    """Its position among the replayed calls (0-based)."""
    call_id: str
    tool: str


class ItemState(BaseModel):
    """How one item ended in one run."""

    id: str
    after_step: int
    status: str
    category: str | None = None
    """The failure category (pvisor's for ``replay_failed``; otherwise the status)."""
    replayed_calls: int = 0
    """Replayed tool calls with an observation comparison."""
    whitespace_calls: int = 0
    """Of those, the calls whose fresh observation differs from the recorded one in whitespace only (reproduced)."""
    diverged_calls: int = 0
    """Of those, the calls whose fresh observation differs from the recorded one otherwise."""
    first_divergence: CallRef | None = None
    diverged: list[int] = []
    """Every replayed call (0-based) whose fresh observation differs from the recorded one (not only in
    whitespace)."""
    effects: dict[str, str] = {}
    """What the replay did to the workspace: each file it added or changed → the sha256 of its final content
    (``?`` when it was not collected: ``--collect none``, or past the limit), each it removed → ``removed``."""
    image: str | None = None
    """The bytes it ran in: the image's registry digest (``repo@sha256:...``), else its id."""
    image_id: str | None = None
    """The engine's id of that image."""
    trajectory: str | None = None
    """The trajectory's file name (what matches a single replay's item with the other side's)."""
    repeat_of: str | None = None
    """With ``batch --repeat K``: the id its repeats share."""
    path: str | None = None
    """The item's directory, relative to its run directory (None: it has none)."""
    model: ModelTotals | None = None
    """A live continuation's model figures (every attempt's)."""
    verified: bool | None = None
    """With ``--verify``: whether the task's verifier passed (None: no verifier, or it could not run)."""
    verification: VerificationOutcome | None = None
    """With ``--verify``: ``passed``, ``failed``, ``timed_out`` or ``could_not_run``."""
    egress: list[str] | None = None
    """With ``--egress``: the ``host:port`` its replayed tool calls reached (None: it ran without)."""
    environment: dict[str, str | None] = Field(default={}, exclude=True)
    """The environment it ran with (its record's; compared across runs, not listed per item)."""


class ItemRef(BaseModel):
    """An item, by its id and boundary."""

    id: str
    after_step: int


class ItemChange(BaseModel):
    """One item that changed between the two runs."""

    id: str
    after_step: int
    kind: ChangeKind
    old: ItemState | None = None
    new: ItemState | None = None
    image_changed: bool = False
    """It ran in another image than before (another digest, or id)."""
    files: list[str] = []
    """The workspace files whose effect differs between the two runs (see :attr:`ItemState.effects`)."""
    new_hosts: list[str] = []
    """``host:port`` reached through the egress proxy in the new run and not in the old (both with ``--egress``)."""

    @property
    def describe(self) -> str:
        """One line for people: what it was and what it is."""
        line = f"{state_line(self.old)} → {state_line(self.new)}"
        if self.files:
            line += f"; files differ: {shortlist(self.files)}"
        if self.new_hosts:
            line += f"; new hosts reached: {shortlist(self.new_hosts)}"
        if self.image_changed and self.old is not None and self.new is not None:
            line += f"; image {_short(self.old.image)} → {_short(self.new.image)}"
        return line


class ModelMove(BaseModel):
    """The model figures of each run, over all its items (see :class:`~pvisor_host.models.record.ModelTotals`)."""

    old: ModelTotals
    new: ModelTotals

    @property
    def describe(self) -> str:
        """``tokens 12.0k → 9.8k (-18%), errors 3 → 0, retries 4 → 1[, cost 1.20 → 0.98]``."""

        def move(name: str, was: float, now: float, digits: int = 0) -> str:
            change = f" ({(now - was) / was:+.0%})" if was else ""
            return f"{name} {was:.{digits}f} → {now:.{digits}f}{change}"

        old, new = self.old, self.new
        parts = [
            move("tokens", old.input_tokens + old.output_tokens, new.input_tokens + new.output_tokens),
            move("errors", old.errors, new.errors),
            move("retries", old.retries, new.retries),
        ]
        if old.cost is not None and new.cost is not None:
            parts.append(move("cost", old.cost, new.cost, 4))
        return ", ".join(parts)


class Comparison(BaseModel):
    """The result of ``compare`` (``--json`` prints it)."""

    schema_version: str = COMPARE_SCHEMA
    old: str
    new: str
    matched: int
    """Items present in both runs at the same boundary."""
    unchanged: int
    counts: dict[str, int]
    """Changes per kind."""
    changes: list[ItemChange]
    """Regressions first (see ``KIND_ORDER``), then by id."""
    model: ModelMove | None = None
    """How the model's figures moved, when either run continued live."""
    flaky: list[FlakyItem] = []
    """With ``--repeat K`` in the new run: its items whose repeats ended or left the workspace otherwise."""

    same: list[ItemRef] = []
    """The items matched that did not change (every matched item is a test case of the JUnit file)."""
    environment: list[str] = []
    """The environment variables the two runs' matched items ran with otherwise: ``NAME: old → new (N items)``
    (a secret's value is never compared: only whether it was there)."""

    @property
    def regressions(self) -> list[ItemChange]:
        """The items that were ok and are not (or are gone)."""
        return [c for c in self.changes if c.kind == "regression"]

    @property
    def failing(self) -> list[ItemChange]:
        """The changes a guard fails on: regressions and new items that are not ok."""
        return [c for c in self.changes if c.kind in FAILING]


def compare_runs(old: Path, new: Path) -> Comparison:
    """Compare two batch run directories, or replay directories (see the module docstring)."""
    before, after = read_run(old), read_run(new)
    if _single(old) != _single(new):
        raise UsageError(
            f"{old if _single(old) else new} is one replay's --out and the other a batch's; compare two of a kind"
        )
    if _single(old):  # one replay each: the two items are the pair, named by the earlier one's trajectory
        before, after = _by_trajectory(before), _by_trajectory(after)
        (first,), (second,) = before.values(), after.values()
        if first.trajectory != second.trajectory:
            logger.warning("comparing replays of two trajectories: {} and {}", first.trajectory, second.trajectory)
        after = {(first.trajectory or first.id, second.after_step): second}
    changes: list[ItemChange] = []
    same: list[ItemRef] = []
    matched = 0
    for key in sorted(before.keys() | after.keys()):
        was, now = before.get(key), after.get(key)
        if was is None or now is None:
            kind: ChangeKind = _new(now) if now is not None else "regression" if _ok(was) else "gone"
            changes.append(ItemChange(id=key[0], after_step=key[1], kind=kind, old=was, new=now))
            continue
        matched += 1
        image_changed = _other_bytes(was, now)
        files = _other_effects(was, now)
        hosts = _new_hosts(was, now)
        change = _change(was, now) or (
            "effects_changed" if files else "new_hosts" if hosts else "image_changed" if image_changed else None
        )
        if change is not None:
            changes.append(
                ItemChange(
                    id=key[0], after_step=key[1], kind=change, old=was, new=now, image_changed=image_changed,
                    files=files, new_hosts=hosts,
                )
            )  # fmt: skip
        else:
            same.append(ItemRef(id=key[0], after_step=key[1]))
    changes.sort(key=lambda c: (KIND_ORDER.index(c.kind), c.id, c.after_step))
    return Comparison(
        old=str(old),
        new=str(new),
        matched=matched,
        unchanged=len(same),
        counts={kind: n for kind, n in sorted(Counter(c.kind for c in changes).items())},
        changes=changes,
        model=_model_move(before, after),
        flaky=flaky_items(after.values()),
        same=same,
        environment=_environment_moves(before, after),
    )


def _environment_moves(before: dict[tuple[str, int], ItemState], after: dict[tuple[str, int], ItemState]) -> list[str]:
    """Each variable whose value differs between the runs' matched items (both with a recorded environment)."""
    moved: Counter[tuple[str, str, str]] = Counter()
    for key in before.keys() & after.keys():
        was, now = before[key].environment, after[key].environment
        if not was or not now:
            continue
        for name in sorted(was.keys() | now.keys()):
            if name in was and name in now and was[name] == now[name]:
                continue
            moved[(name, _shown(was, name), _shown(now, name))] += 1
    return [f"{name}: {old} → {new} ({count} items)" for (name, old, new), count in sorted(moved.items())]


def _shown(environment: dict[str, str | None], name: str) -> str:
    if name not in environment:
        return "unset"
    value = environment[name]
    return "(secret)" if value is None else repr(value)


def _ok(state: ItemState | None) -> bool:
    """Ended ok, with its verifier passing where it had one."""
    return state is not None and state.status == "ok" and state.verification in (None, "passed")


def _new(state: ItemState) -> ChangeKind:
    return "new" if _ok(state) else "new_failure"


def run_flaky(run_dir: Path, rows: Iterable[ItemResult]) -> list[FlakyItem]:
    """The flaky items among a batch's ``rows`` (see :func:`flaky_items`), their records in ``run_dir``."""
    return flaky_items(item_state(row, _record_of(run_dir, row), run_dir) for row in rows if row.repeat_of)


def flaky_items(states: Iterable[ItemState]) -> list[FlakyItem]:
    """The items run ``--repeat K`` times whose repeats differ from the first: in status, failure category,
    verification or diverged calls, or in the workspace files they left (not in the image they ran in)."""
    groups: dict[tuple[str, int], list[ItemState]] = {}
    for state in states:
        if state.repeat_of is not None:
            groups.setdefault((state.repeat_of, state.after_step), []).append(state)
    found = []
    for (item_id, after_step), repeats in sorted(groups.items()):
        repeats.sort(key=lambda r: _repeat_number(r.id))
        first = repeats[0]
        files = sorted({path for other in repeats[1:] for path in _other_effects(first, other)})
        if files or any(_change(first, other) is not None for other in repeats[1:]):
            found.append(
                FlakyItem(
                    id=item_id, after_step=after_step, repeats=[r.id for r in repeats],
                    outcomes=[state_line(r) for r in repeats], files=files,
                )
            )  # fmt: skip
    return found


def _repeat_number(item_id: str) -> int:
    number = item_id.rpartition(".r")[2]
    return int(number) if number.isdigit() else 0


def _model_move(before: dict[tuple[str, int], ItemState], after: dict[tuple[str, int], ItemState]) -> ModelMove | None:
    old = add_totals([s.model for s in before.values() if s.model is not None])
    new = add_totals([s.model for s in after.values() if s.model is not None])
    if old is None and new is None:
        return None
    return ModelMove(old=old or ModelTotals(), new=new or ModelTotals())


def _other_bytes(was: ItemState, now: ItemState) -> bool:
    """Whether two runs of an item ran in other images: other ids, or other registry digests when both have
    one (an image loaded with ``docker load`` has an id and no digest: the same bytes all the same)."""
    if was.image_id is not None and now.image_id is not None and was.image_id != now.image_id:
        return True
    both = was.image is not None and now.image is not None and "@" in was.image and "@" in now.image
    return both and was.image != now.image


def _change(was: ItemState, now: ItemState) -> ChangeKind | None:
    if was.status == "ok" and now.status != "ok":
        return "regression"
    if was.status != "ok" and now.status == "ok":
        return "fixed"
    if was.verification == "passed" and now.verification not in (None, "passed"):
        return "regression"
    if was.verification not in (None, "passed") and now.verification == "passed":
        return "fixed"
    verified_both = was.verification is not None and now.verification is not None
    if (was.status, was.category) != (now.status, now.category) or (
        verified_both and was.verification != now.verification
    ):
        return "status_changed"
    if was.first_divergence != now.first_divergence or was.diverged != now.diverged:
        return "divergence_moved"
    return None


def _new_hosts(was: ItemState, now: ItemState) -> list[str]:
    """The hosts the new run reached through the egress proxy and the old did not (both ran with ``--egress``)."""
    if was.egress is None or now.egress is None:
        return []
    return [host for host in now.egress if host not in was.egress]


def _other_effects(was: ItemState, now: ItemState) -> list[str]:
    """The workspace files one run left otherwise than the other: touched by one only, or with other content
    (a file whose content a run did not collect counts as the same when both touched it)."""

    def differs(a: str | None, b: str | None) -> bool:
        if a is None or b is None:
            return a != b
        return a != b and UNCOLLECTED not in (a, b)

    paths = was.effects.keys() | now.effects.keys()
    return sorted(path for path in paths if differs(was.effects.get(path), now.effects.get(path)))


def _single(run_dir: Path) -> bool:
    """Whether ``run_dir`` is one ``replay --out`` directory rather than a batch's."""
    return (run_dir / "record.json").is_file()


def _by_trajectory(items: dict[tuple[str, int], ItemState]) -> dict[tuple[str, int], ItemState]:
    """The items keyed by their trajectory's file name instead of their id (a single replay has no id)."""
    return {(state.trajectory or state.id, state.after_step): state for state in items.values()}


def check_run_dir(run_dir: Path, *, single: bool = False) -> None:
    """Refuse, in one line, a directory that is not a batch's ``--out`` (with ``single``, nor a replay's)
    (cheap: reads no record)."""
    what = "a batch's or a replay's --out directory" if single else "a batch's --out directory"
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; pass {what}")
    if single and _single(run_dir):
        return
    if not (run_dir / "summary.json").is_file() and next(run_dir.glob("*/record.json"), None) is None:
        raise UsageError(f"{run_dir} holds no results (no record.json, no */record.json); pass {what}")


def read_run(run_dir: Path) -> dict[tuple[str, int], ItemState]:
    """Every item of a batch run directory, whether or not it got a record (its rows: :mod:`.results`), by (id,
    after_step), each with what its record adds where it has one; or the one item of a replay directory."""
    check_run_dir(run_dir, single=True)
    if _single(run_dir):
        try:
            record = load_record(run_dir / "record.json")
        except (OSError, ValueError):
            raise UsageError(f"{run_dir / 'record.json'} is not a readable record; pass a replay's --out") from None
        keys = ItemKeys(
            id=run_dir.name, line=0, after_step=record.inputs.after_step, trajectory=record.inputs.trajectory.path
        )
        state = item_state(ItemResult.from_record(record, keys, path="."), record, run_dir)
        return {(state.id, state.after_step): state}
    items: dict[tuple[str, int], ItemState] = {}
    for row in iter_results(run_dir):
        state = item_state(row, _record_of(run_dir, row), run_dir)
        items[(state.id, state.after_step)] = state
    return items


def _record_of(run_dir: Path, row: ItemResult) -> ReplayRecord | None:
    """The record beside a row, when it has one that reads."""
    if row.path is None:
        return None
    try:
        return load_record(run_dir / row.path / "record.json")
    except (OSError, ValueError):
        return None  # an item whose run was killed before its record was written


def item_state(row: ItemResult, record: ReplayRecord | None, run_dir: Path) -> ItemState:
    """One item's state: how it ended, from its row; which calls diverged, its workspace's effects and its image's
    id, from its record where it has one (and pvisor's observation comparison beside it, for a record written
    before records said how each call matched)."""
    observations = None
    if record is not None:
        item_dir = run_dir / (row.path or ".")
        observations = record.observations or match_observations(
            record.artifact_json(item_dir, COMPARISON_ROLE), Path(), None
        )
    calls = observations.calls if observations is not None else []
    diverged = [call.index for call in calls if call.match == "diverged"]
    first = calls[diverged[0]] if diverged else None
    return ItemState(
        id=row.id,
        after_step=row.after_step or 0,
        status=row.status,
        category=row.category,
        replayed_calls=len(calls),
        whitespace_calls=sum(call.match == "whitespace" for call in calls),
        diverged_calls=len(diverged),
        first_divergence=CallRef(index=first.index, call_id=first.call_id, tool=first.tool) if first else None,
        diverged=diverged,
        effects=_effects(record) if record is not None else {},
        trajectory=PurePosixPath(row.trajectory).name if row.trajectory else None,
        repeat_of=row.repeat_of,
        image=row.image_digest or (record.image.id if record is not None else row.image),
        image_id=record.image.id if record is not None else None,
        path=row.path,
        model=row.model_totals(),
        verified=row.verification_passed,
        verification=row.verification,
        egress=row.egress_hosts,
        environment=record.inputs.tools_environment if record is not None else {},
    )


def _effects(record: ReplayRecord) -> dict[str, str]:
    """:attr:`ItemState.effects` from the record: its workspace changes, and the sha256 of each collected file."""
    changes = record.workspace_changes
    if changes is None:
        return {}
    collected = {
        a.path.removeprefix("workspace/"): a.sha256 for a in record.artifacts if a.path.startswith("workspace/")
    }
    effects = {path: collected.get(path, UNCOLLECTED) for path in (*changes.added, *changes.changed)}
    effects.update((path, REMOVED) for path in changes.removed)
    return {path: digest for path, digest in effects.items() if not path.endswith("/")}  # files, not directories


def _short(image: str | None) -> str:
    """``repo@sha256:0123456789ab``: enough of a digest or id to tell two apart."""
    if image is None:
        return "?"
    name, _, digest = image.rpartition("@")
    return f"{name}@{digest[:19]}" if name else image[:19]


def state_line(state: ItemState | None) -> str:
    """How an item ended, in one line (``-``: not in that run)."""
    if state is None:
        return "-"
    line = state.status if state.category in (None, state.status) else f"{state.status} ({state.category})"
    if state.verification is not None:
        line += f", verification {state.verification.replace('_', ' ')}"
    if state.first_divergence is not None:
        call = state.first_divergence
        line += f", diverges at call {call.index + 1} ({call.tool} {call.call_id})"
    elif state.whitespace_calls:
        line += f", every observation reproduced ({state.whitespace_calls} differ only in whitespace)"
    elif state.replayed_calls:
        line += ", every observation exact"
    return line


def write_reports(comparison: Comparison, out: Path) -> None:
    """``batch --baseline``: ``compare.json`` and ``compare.xml`` beside the batch's own reports, and the
    regressions in the GitHub step summary when it is asked for."""
    write_atomic(out / "compare.json", comparison.model_dump_json(indent=2).encode() + b"\n")
    write_junit(comparison, out / "compare.xml")
    append_step_summary(markdown(comparison))


def markdown(comparison: Comparison) -> str:
    """The step summary's part for ``--baseline``: the counts, and each regressed item and new failure with what it
    was and is (where its replay diverges, its verification)."""
    regressions, failing = comparison.regressions, comparison.failing
    lines = [
        f"#### Against `{comparison.old}`",
        "",
        f"{len(regressions)} regressed, {len(failing) - len(regressions)} new and failing, "
        f"{len(comparison.changes) - len(failing)} otherwise changed, {comparison.unchanged} unchanged (compare.json).",
    ]
    if failing:
        lines += ["", "| regressed or new and failing | boundary | was → is |", "|---|---|---|"]
        lines += [f"| `{cell(c.id)}` | {c.after_step} | {cell(c.describe)} |" for c in failing[:STEP_SUMMARY_ITEMS]]
        lines += more_line(len(failing))
    return "\n".join([*lines, ""])


def write_junit(comparison: Comparison, path: Path) -> None:
    """A JUnit file with a test case per item of either run: the regressions and the new items that are not ok
    fail, the other changes pass and say what changed, the items that did not change pass (so a green run shows
    its tests)."""
    failing = comparison.failing
    suite = ET.Element(
        "testsuite",
        name="pvisor-host compare",
        tests=str(len(comparison.changes) + len(comparison.same)),
        failures=str(len(failing)),
        errors="0",
    )
    for change in comparison.changes:
        case = ET.SubElement(suite, "testcase", classname=f"compare.{change.kind}", name=_case(change))
        if change.kind in FAILING:
            failure = ET.SubElement(case, "failure", type=change.kind, message=change.describe)
            failure.text = change.describe
        else:
            ET.SubElement(case, "system-out").text = change.describe
    for item in comparison.same:
        ET.SubElement(suite, "testcase", classname="compare.unchanged", name=_case(item))
    write_atomic(path, bytes(ET.tostring(suite, encoding="utf-8", xml_declaration=True)))


def _case(item: ItemRef | ItemChange) -> str:
    """A test case's name: the item, and its boundary."""
    return f"{item.id} (after step {item.after_step})"
