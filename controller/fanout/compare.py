"""``pvisor-host compare OLD NEW``: what changed between two batch runs, read from their run directories.

Items are matched by id and boundary (``after_step``); an item whose boundary changed is gone at the old
one and new at the new one. For each pair it reports, regressions first:

* ``regression`` — it was ``ok`` and is not any more, or its verification (``--verify``) passed and does not now;
* ``fixed`` — it was not ``ok`` and is now, or its verification failed and passes now;
* ``status_changed`` — neither is ``ok``, and the status or the failure category differs;
* ``divergence_moved`` — same status, but the first replayed tool call whose fresh observation differs
  from the recorded one is another call (or there is one now and was none, or the other way round);
* ``image_changed`` — nothing of the above, but it ran in other bytes: its image's registry digest (or, for
  an image without one, its id) differs;
* ``new`` and ``gone``.

With live continuations it also says how the model's figures moved between the two runs, over every item of
each (tokens in and out, errors, retries, cost): :attr:`Comparison.model`.

Any change also says whether the image changed (``image_changed``), so a regression that came with a new
task image shows it.

The divergence comes from pvisor's ``observation-comparison.json`` (``sandbox-playback/comparison-v1``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ..errors import UsageError
from ..files.atomic import write_atomic
from ..models.record import ModelTotals, ReplayRecord, add_totals, load_record
from .summary import STEP_SUMMARY_ITEMS, append_step_summary, cell, more_line

COMPARE_SCHEMA = "pvisor-host.compare/v1"
COMPARISON_ROLE = "observation_comparison"
ChangeKind = Literal["regression", "fixed", "status_changed", "divergence_moved", "image_changed", "new", "gone"]
#: The order changes are listed in: what a CI guard must look at first.
KIND_ORDER: tuple[ChangeKind, ...] = (
    "regression", "status_changed", "divergence_moved", "image_changed", "gone", "new", "fixed",
)  # fmt: skip


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
    diverged_calls: int = 0
    """Of those, the calls whose fresh observation differs from the recorded one."""
    first_divergence: CallRef | None = None
    image: str | None = None
    """The bytes it ran in: the image's registry digest (``repo@sha256:...``), else its id."""
    image_id: str | None = None
    """The engine's id of that image."""
    path: str
    """The item's directory, relative to its run directory."""
    model: ModelTotals | None = None
    """A live continuation's model figures (every attempt's)."""
    verified: bool | None = None
    """With ``--verify``: whether the task's verifier passed."""


class ItemChange(BaseModel):
    """One item that changed between the two runs."""

    id: str
    after_step: int
    kind: ChangeKind
    old: ItemState | None = None
    new: ItemState | None = None
    image_changed: bool = False
    """It ran in another image than before (another digest, or id)."""

    @property
    def describe(self) -> str:
        """One line for people: what it was and what it is."""
        line = f"{_state_line(self.old)} → {_state_line(self.new)}"
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

    @property
    def regressions(self) -> list[ItemChange]:
        """The changes a guard fails on."""
        return [c for c in self.changes if c.kind == "regression"]


def compare_runs(old: Path, new: Path) -> Comparison:
    """Compare two batch run directories (see the module docstring)."""
    before, after = read_run(old), read_run(new)
    changes: list[ItemChange] = []
    matched = 0
    for key in sorted(before.keys() | after.keys()):
        was, now = before.get(key), after.get(key)
        if was is None or now is None:
            kind: ChangeKind = "new" if was is None else "gone"
            changes.append(ItemChange(id=key[0], after_step=key[1], kind=kind, old=was, new=now))
            continue
        matched += 1
        image_changed = _other_bytes(was, now)
        change = _change(was, now) or ("image_changed" if image_changed else None)
        if change is not None:
            changes.append(
                ItemChange(id=key[0], after_step=key[1], kind=change, old=was, new=now, image_changed=image_changed)
            )
    changes.sort(key=lambda c: (KIND_ORDER.index(c.kind), c.id, c.after_step))
    return Comparison(
        old=str(old),
        new=str(new),
        matched=matched,
        unchanged=matched - sum(1 for c in changes if c.kind not in ("new", "gone")),
        counts={kind: n for kind, n in sorted(Counter(c.kind for c in changes).items())},
        changes=changes,
        model=_model_move(before, after),
    )


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
    if was.verified is True and now.verified is False:
        return "regression"
    if was.verified is False and now.verified is True:
        return "fixed"
    if (was.status, was.category) != (now.status, now.category):
        return "status_changed"
    if was.first_divergence != now.first_divergence:
        return "divergence_moved"
    return None


def check_run_dir(run_dir: Path) -> None:
    """Refuse, in one line, a directory that is not a batch's ``--out`` (cheap: reads no record)."""
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; pass a batch's --out directory")
    if not (run_dir / "summary.json").is_file() and next(run_dir.glob("*/record.json"), None) is None:
        raise UsageError(f"{run_dir} holds no batch results (no */record.json); pass a batch's --out directory")


def read_run(run_dir: Path) -> dict[tuple[str, int], ItemState]:
    """Every item of a batch run directory that has a readable record, by (id, after_step)."""
    check_run_dir(run_dir)
    items: dict[tuple[str, int], ItemState] = {}
    for record_path in sorted(run_dir.glob("*/record.json")):
        if record_path.parent.name.startswith("."):
            continue  # .previous/ and staging
        try:
            record = load_record(record_path)
        except (OSError, ValueError):
            continue  # an item whose run was killed before its record was written has no result
        state = item_state(record, record_path.parent, run_dir)
        items[(state.id, state.after_step)] = state
    if not items and not (run_dir / "summary.json").is_file():
        raise UsageError(f"{run_dir} holds no readable batch results (*/record.json); pass a batch's --out directory")
    return items


def item_state(record: ReplayRecord, item_dir: Path, run_dir: Path) -> ItemState:
    """One item's state, from its record and pvisor's observation comparison beside it."""
    calls = _comparison(record, item_dir)
    diverged = [n for n, call in enumerate(calls) if not call.get("exact", False)]
    first = calls[diverged[0]] if diverged else None
    return ItemState(
        id=record.batch.item_id if record.batch is not None else item_dir.name,
        after_step=record.inputs.after_step,
        status=record.status,
        category=record.failure.category if record.failure else None,
        replayed_calls=len(calls),
        diverged_calls=len(diverged),
        first_divergence=(
            CallRef(index=diverged[0], call_id=str(first.get("call_id")), tool=str(first.get("tool")))
            if first is not None
            else None
        ),
        image=record.image.digest or record.image.id,
        image_id=record.image.id,
        path=str(item_dir.relative_to(run_dir)),
        model=record.model.totals if record.model is not None else None,
        verified=record.verification.passed if record.verification is not None else None,
    )


def _comparison(record: ReplayRecord, item_dir: Path) -> list[dict[str, object]]:
    calls = record.artifact_json(item_dir, COMPARISON_ROLE)
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _short(image: str | None) -> str:
    """``repo@sha256:0123456789ab``: enough of a digest or id to tell two apart."""
    if image is None:
        return "?"
    name, _, digest = image.rpartition("@")
    return f"{name}@{digest[:19]}" if name else image[:19]


def _state_line(state: ItemState | None) -> str:
    if state is None:
        return "-"
    line = state.status if state.category in (None, state.status) else f"{state.status} ({state.category})"
    if state.verified is not None:
        line += ", verification passed" if state.verified else ", verification failed"
    if state.first_divergence is not None:
        call = state.first_divergence
        line += f", diverges at call {call.index + 1} ({call.tool} {call.call_id})"
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
    """The step summary's part for ``--baseline``: the counts, and each regressed item with what it was and is
    (where its replay diverges, its verification)."""
    regressions = comparison.regressions
    lines = [
        f"#### Against `{comparison.old}`",
        "",
        f"{len(regressions)} regressed, {len(comparison.changes) - len(regressions)} otherwise changed, "
        f"{comparison.unchanged} unchanged (compare.json).",
    ]
    if regressions:
        lines += ["", "| regressed | boundary | was → is |", "|---|---|---|"]
        lines += [f"| `{cell(c.id)}` | {c.after_step} | {cell(c.describe)} |" for c in regressions[:STEP_SUMMARY_ITEMS]]
        lines += more_line(len(regressions))
    return "\n".join([*lines, ""])


def write_junit(comparison: Comparison, path: Path) -> None:
    """A JUnit file with a test case per changed item in which only the regressions fail."""
    suite = ET.Element(
        "testsuite",
        name="pvisor-host compare",
        tests=str(len(comparison.changes)),
        failures=str(len(comparison.regressions)),
        errors="0",
    )
    for change in comparison.changes:
        case = ET.SubElement(suite, "testcase", classname=f"compare.{change.kind}", name=change.id)
        if change.kind == "regression":
            failure = ET.SubElement(case, "failure", type="regression", message=change.describe)
            failure.text = change.describe
        else:
            ET.SubElement(case, "system-out").text = change.describe
    write_atomic(path, bytes(ET.tostring(suite, encoding="utf-8", xml_declaration=True)))
