"""What a batch is made of and ends with, for every layer above the scheduler: each item's
:class:`ItemResult` (``results.jsonl``) and the batch's :class:`BatchSummary` (``summary.json``)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from ..units import percentile
from .egress import EgressStats, EgressTotals
from .observations import match_observations
from .record import ModelDrift, ModelTotals, ReplayRecord, VerificationOutcome, describe_verification

__all__ = [
    "FINAL_STATUSES",
    "PHASES",
    "RESULTS_FILE",
    "BatchSummary",
    "ImageStats",
    "ItemKeys",
    "ItemResult",
    "VerificationStats",
    "percentile",
]

SUMMARY_SCHEMA = "pvisor-host.batch-summary/v1"
#: Record statuses that count as finished (``interrupted`` does not: a rerun runs the item again).
FINAL_STATUSES = frozenset({"ok", "replay_failed", "timeout", "oom", "infra_error"})
PHASES = ("pull_wait", "preflight", "image", "stage", "create", "run", "collect", "verify", "total")
"""Seconds per phase of an item: the wait for its task image (pulled just in time), its replay's phases, and its
verifier's (``--verify``)."""
#: One :class:`ItemResult` per line, in manifest order: every item, including those that got no record.
RESULTS_FILE = "results.jsonl"


class ItemKeys(BaseModel):
    """What an item's row says of it before anything ran: who it is, where it came from, what it asked for."""

    id: str
    line: int
    after_step: int
    trajectory: str
    """The trajectory as the dataset gave it (a manifest's path as written, the shorthand's file)."""
    agent: str | None = None
    image: str | None = None
    """The image as planned (a task image's reference, or none for the agent's own image)."""
    repeat_of: str | None = None
    fork_of: str | None = None
    fork_index: int | None = None
    columns: dict[str, str | None] = {}
    """The dataset's own columns it keeps (``--keep``), as text."""


def fork_row_id(item_id: str, index: int | None) -> str:
    """The id of fork ``index``'s row of item ``item_id`` (``<id>.f<k>``); the item's own (None: its prefix's)."""
    return item_id if index is None else f"{item_id}.f{index}"


#: Statuses an item has when it got no record of its own.
NO_RECORD_STATUSES = ("rejected", "not_run", "interrupted", "infra_error")


class ItemResult(BaseModel):
    """One item of a batch, whatever happened to it: a row of ``results.jsonl`` and of ``pvisor-host results``,
    flat and the same in every format (JSON Lines, CSV, Parquet): these columns, in this order, every time,
    whatever options ran, then the dataset's columns a batch was asked to keep (``--keep``). Built once per item,
    from its record (:meth:`from_record`) or, when it has none, from how it ended (:meth:`without_record`); the
    summary, the report, compare, JUnit, the step summary and ``pvisor_host.results()`` all read it. Its JSON
    Schema is ``docs/schemas/results-row.schema.json``."""

    model_config = ConfigDict(extra="allow")

    batch: str | None = None
    """The batch's directory, as ``pvisor-host results`` was given it (several batches read as one table)."""
    id: str
    """Unique in its batch; names its directory ``<batch>/<id>/``."""
    line: int
    """Its manifest line (or position in the shorthand's expansion)."""
    after_step: int | None = None
    """The boundary it replays to."""
    repeat_of: str | None = None
    """With ``--repeat K``: the id its repeats share (theirs are ``<id>.r1`` …)."""
    fork_of: str | None = None
    """With ``fork: K``: the id of the item whose prefix it continues from (its own is ``<that>.f<k>``; the
    prefix's sandbox has its record in ``<that>/prefix/``)."""
    fork_index: int | None = None
    """With ``fork: K``: which fork it is, 1 to K."""
    trajectory: str | None = None
    """The trajectory as the dataset gave it."""
    agent: str | None = None
    """The agent whose trajectory it is (from the dataset, the trajectory's format, or the image's label)."""
    image: str | None = None
    """The image as asked for (a task image's reference, or the agent image's tag once it is known)."""
    image_digest: str | None = None
    """The registry digest the image came from (``repo@sha256:...``), when it came from one."""
    status: str
    """A record status (``ok``, ``replay_failed``, ``timeout``, ``oom``, ``infra_error``, ``interrupted``),
    ``rejected`` (refused before a sandbox started) or ``not_run`` (the batch ended, or was stopped, first)."""
    category: str | None = None
    """Why it is not ok: pvisor's failure category for ``replay_failed``, pvisor-host's otherwise
    (``image_not_found``, ``registry_unreachable``, ``disk_full``, ``usage``, ...)."""
    message: str | None = None
    """The same in words."""
    skipped: bool = False
    """Finished in an earlier run with the same content key, so not run again (its figures are that run's)."""
    attempts: int = 0
    """Attempts its replay took (0: none ran)."""
    path: str | None = None
    """Its directory, relative to the batch's, when it has one."""
    replayed: int | None = None
    """Tool calls pvisor replayed (``replayed_tool_calls``)."""
    exact: int | None = None
    """Of those, the calls whose fresh observation equals the recorded one."""
    whitespace: int | None = None
    """Of those, the calls whose fresh observation differs from the recorded one in whitespace or line endings
    only (a trailing newline the recording lost): reproduced, counted apart from ``diverged``."""
    diverged: int | None = None
    """Of those, the calls whose fresh observation differs from the recorded one otherwise."""
    continued: int | None = None
    """Steps the live agent took after the boundary (``continued_steps``)."""
    verification: VerificationOutcome | None = None
    """With ``--verify``: ``passed``, ``failed``, ``timed_out`` or ``could_not_run`` (no verdict on the task)."""
    verification_passed: bool | None = None
    """With ``--verify``: whether the task's verifier passed (None when it could not run)."""
    verification_exit_code: int | None = None
    """The verifier's exit code, when it ran to its end."""
    verification_reward: float | None = None
    """The reward it wrote (``reward.txt``, ``reward.json``), else 1 or 0."""
    verification_seconds: float | None = None
    """How long the verifier ran."""
    verification_note: str | None = None
    """Why it did not run to its end, when it did not."""
    model_calls: int | None = None
    """A live continuation's model calls, every attempt's (None: no gateway saw its model)."""
    model_input_tokens: int | None = None
    """Input tokens, the cached ones included (as the APIs count them)."""
    model_output_tokens: int | None = None
    """Output tokens."""
    model_cached_tokens: int | None = None
    """Of the input tokens, those the upstream served from its cache."""
    model_retries: int | None = None
    """Upstream refusals the gateway retried before an answer reached the agent."""
    model_errors: int | None = None
    """Calls whose answer to the agent was an error, or a stream that broke off."""
    model_waited_seconds: float | None = None
    """Time its calls waited for a slot in the batch's model limits."""
    model_latency_p50_ms: float | None = None
    """The median of its model calls' latency, to the first byte."""
    model_latency_p90_ms: float | None = None
    """Their 90th percentile."""
    model_cost: float | None = None
    """What the tokens cost at ``--model-price``."""
    model_drift_call: int | None = None
    """With a cassette served back: the first model call whose request differed from the recording."""
    model_drift_field: str | None = None
    """Where that request differed: ``messages``, ``input``, ... (``calls``: more calls than the tape holds)."""
    model_drift_message: int | None = None
    """The first message of that field (0-based) that differs."""
    egress_connections: int | None = None
    """With ``--egress``: connections its tool calls made through the egress proxy."""
    egress_refused: int | None = None
    """Connections the proxy refused (not listed, a non-public address, a cap)."""
    egress_sent: int | None = None
    """Bytes sent through them."""
    egress_received: int | None = None
    """Bytes received."""
    egress_limited: str | None = None
    """Which ``--egress-limit`` cap was reached, if one was."""
    egress_hosts: list[str] | None = None
    """``host:port`` reached (the first 50)."""
    egress_refused_hosts: list[str] | None = None
    """``host:port`` refused (the first 50)."""
    time_pull_wait: float | None = None
    """Seconds it waited for its task image (pulled just in time)."""
    time_preflight: float | None = None
    """Seconds of its host checks."""
    time_image: float | None = None
    """Seconds making its image ready (a build, a probe, an injected runtime)."""
    time_stage: float | None = None
    """Seconds staging its run directory (the trajectory, the workspace)."""
    time_create: float | None = None
    """Seconds for the engine to create and start its sandbox."""
    time_run: float | None = None
    """Seconds pvisor ran in the sandbox."""
    time_collect: float | None = None
    """Seconds collecting its results."""
    time_verify: float | None = None
    """Seconds its verifier ran (``--verify``)."""
    time_total: float | None = None
    """Seconds, the phases above added up (the wait for its image aside)."""

    @model_validator(mode="before")
    @classmethod
    def _nested(cls, value: Any) -> Any:
        """A row of a ``results.jsonl`` written before rows were flat (nested ``timings``, ``verification``,
        ``model`` and ``egress``), read as a flat one."""
        if not isinstance(value, dict) or not any(isinstance(value.get(k), dict) for k in _NESTED):
            return value
        row = dict(value)
        for phase, seconds in (row.pop("timings", None) or {}).items():
            row[f"time_{phase}"] = seconds
        verification = row.pop("verification", None)
        if isinstance(verification, dict):
            passed = verification.get("passed")
            timed_out = verification.get("timed_out")
            row["verification"] = "timed_out" if timed_out else "passed" if passed else "failed"
            row["verification_passed"] = passed
            for key in ("exit_code", "reward", "seconds"):
                row[f"verification_{key}"] = verification.get(key)
        for group in ("model", "egress"):
            nested = row.pop(group, None)
            for key, inner in (nested or {}).items():
                if isinstance(inner, dict):  # the model's drift
                    row.update({f"{group}_{key}_{k}": v for k, v in inner.items() if k != "diff"})
                else:
                    row[f"{group}_{key}"] = inner
        return row

    @classmethod
    def without_record(cls, keys: ItemKeys, status: str, **fields: Any) -> ItemResult:
        """The row of an item that got no record: refused at pre-flight, not run, or stopped before it started."""
        return cls.model_validate({**keys.model_dump(exclude={"columns"}), **keys.columns, "status": status, **fields})

    @classmethod
    def from_record(
        cls, record: ReplayRecord, keys: ItemKeys, *, path: str, skipped: bool = False, run_dir: Path | None = None
    ) -> ItemResult:
        """The row of an item from its record (``path``: its directory, relative to the batch's; ``run_dir``: where
        it is, for a record written before records said how each call's observation matched)."""
        result = record.result
        row: dict[str, Any] = {
            **keys.model_dump(exclude={"columns"}),
            **keys.columns,
            "agent": record.inputs.agent,
            "image": record.image.ref,
            "image_digest": record.image.digest,
            "status": record.status,
            "category": record.failure.category if record.failure else None,
            "message": record.failure.message if record.failure else None,
            "skipped": skipped,
            "attempts": max(1, len(record.attempts)),
            "path": path,
            "replayed": result.replayed_tool_calls if result is not None else None,
            "continued": result.continued_steps if result is not None else None,
            **{f"time_{phase}": seconds for phase, seconds in record.timings.items() if phase in PHASES},
        }
        observations = record.observations
        if observations is None and run_dir is not None:  # whatever pvisor did not call exact, diverged
            observations = match_observations(record.artifact_json(run_dir, "observation_comparison"), Path(), None)
        if observations is not None:
            row.update(exact=observations.exact, whitespace=observations.whitespace, diverged=observations.diverged)
        verified = record.verification
        if verified is not None:
            row.update(
                verification=verified.outcome, verification_passed=verified.passed,
                verification_exit_code=verified.exit_code, verification_reward=verified.reward,
                verification_seconds=verified.seconds, verification_note=verified.note,
            )  # fmt: skip
        totals = record.model.totals if record.model is not None else None
        if totals is not None:
            row.update({f"model_{k}": v for k, v in totals.model_dump(exclude={"drift"}).items()})
            if totals.drift is not None:
                drift = totals.drift
                row.update(
                    model_drift_call=drift.call, model_drift_field=drift.field, model_drift_message=drift.message
                )
        if record.egress is not None:
            row.update({f"egress_{k}": v for k, v in record.egress.totals().model_dump().items()})
        return cls.model_validate(row)

    @property
    def ran(self) -> bool:
        """Ran to a final status in this run."""
        return not self.skipped and self.status in FINAL_STATUSES

    @property
    def not_ok(self) -> bool:
        """It did not end ``ok``, or its verifier did not pass: what the terminal lists and ``--not-ok`` keeps."""
        return self.status != "ok" or (self.verification is not None and self.verification != "passed")

    @property
    def columns(self) -> dict[str, Any]:
        """The dataset's columns it kept (``--keep``)."""
        return dict(self.model_extra or {})

    def timings(self) -> dict[str, float]:
        """Seconds per phase it has (:data:`PHASES`)."""
        found = {phase: getattr(self, f"time_{phase}") for phase in PHASES}
        return {phase: seconds for phase, seconds in found.items() if seconds is not None}

    def describe_verification(self) -> str | None:
        """Its verification in one line (None: it had none)."""
        if self.verification is None:
            return None
        return describe_verification(
            self.verification, self.verification_exit_code, self.verification_reward, self.verification_seconds,
            self.verification_note,
        )  # fmt: skip

    def model_totals(self) -> ModelTotals | None:
        """Its model figures as the record has them (None: it had no model gateway)."""
        if self.model_calls is None:
            return None
        fields = {name: getattr(self, f"model_{name}") for name in ModelTotals.model_fields if name != "drift"}
        drift = None
        if self.model_drift_call is not None:
            drift = ModelDrift(
                call=self.model_drift_call, field=self.model_drift_field or "", message=self.model_drift_message,
                diff="",
            )  # fmt: skip
        return ModelTotals.model_validate({k: v for k, v in fields.items() if v is not None} | {"drift": drift})

    def egress_totals(self) -> EgressTotals | None:
        """Its egress as the record counts it (None: it ran without ``--egress``)."""
        if self.egress_connections is None:
            return None
        fields = {name: getattr(self, f"egress_{name}") for name in EgressTotals.model_fields}
        return EgressTotals.model_validate({k: v for k, v in fields.items() if v is not None})

    def outcome_line(self) -> str:
        """How it ended, in one line: its status and why, and its verification (the terminal's list)."""
        line = self.status
        reason = self.message or (self.category if self.category not in (None, self.status) else None)
        if reason:
            line += f": {reason}"
        verification = self.describe_verification()
        if verification is not None:
            line += f"; verification {verification}"
        return line


#: The groups an older row nested.
_NESTED = ("timings", "verification", "model", "egress")
#: The columns every row has, in order (the dataset's kept columns follow them).
ROW_COLUMNS: tuple[str, ...] = tuple(ItemResult.model_fields)


class ImageStats(BaseModel):
    """The task images a batch pulled (those it named by reference and the engine did not have)."""

    pulled: int = 0
    """Images pulled."""
    downloaded: int = 0
    """Bytes downloaded."""
    pull_seconds: float = 0.0
    """Seconds spent pulling, all pulls added up (they overlap each other and the sandboxes)."""
    removed: int = 0
    """Images the batch removed again (to stay within its budget, or at its end)."""
    failed: int = 0
    """Images that could not be had (their items are refused)."""
    peak: int = 0
    """The most bytes the batch's pulled images took on the engine at once (unpacked, each image whole)."""
    budget: int | None = None
    """The ``--image-budget`` it kept to (None: none given; on a cluster every node keeps it on its own, and a
    node without one takes half its engine's free space)."""
    node_pulls: int | None = None
    """On a cluster: the pulls the nodes made, summed over nodes (an image two nodes pulled counts twice);
    ``pulled`` counts each image once there (it is resolved on the driver, not pulled), ``downloaded``,
    ``removed`` and ``peak`` are 0 (each node's own are in ``cluster status``), and ``budget`` is each node's."""


class VerificationStats(BaseModel):
    """The batch's verifications (``--verify``), over the items that have one."""

    items: int
    """Items with a verification."""
    passed: int
    failed: int = 0
    """Its verifier exited non-zero."""
    timed_out: int = 0
    could_not_run: int = 0
    """Its verifier could not run (not installed, no interpreter, the sandbox gone first): no verdict on the task,
    so not in the pass rate."""
    pass_rate: float
    """``passed`` over the items whose verifier gave a verdict (passed, failed or timed out)."""
    mean_reward: float | None = None

    def describe(self) -> str:
        """``2 of 3 passed (66.7%), 1 failed, 1 could not run``."""
        judged = self.items - self.could_not_run
        parts = [f"{self.passed} of {judged} passed ({self.pass_rate:.1%})"]
        parts += [f"{n} {what}" for n, what in ((self.failed, "failed"), (self.timed_out, "timed out")) if n]
        if self.could_not_run:
            parts.append(f"{self.could_not_run} could not run")
        if self.mean_reward is not None:
            parts.append(f"mean reward {self.mean_reward:g}")
        return ", ".join(parts)


class FlakyItem(BaseModel):
    """An item run ``--repeat K`` times whose outcome or effects differ between its repeats."""

    id: str
    """The id its repeats share (theirs are ``<id>.r1`` … ``<id>.rK``)."""
    after_step: int
    repeats: list[str]
    """The repeats' ids, in order."""
    outcomes: list[str]
    """Each repeat's outcome in one line (status, verification, where it diverges), in the same order."""
    files: list[str] = []
    """The workspace files some repeats left otherwise than the first."""


class BatchSummary(BaseModel):
    """``summary.json``."""

    schema_version: str = SUMMARY_SCHEMA
    started_at: datetime
    finished_at: datetime
    items: int
    """Items in the manifest (an interrupted batch has results for fewer)."""
    ran: int
    """Items that ran to a final status in this run (not skipped, refused, interrupted or left unstarted)."""
    skipped: int
    interrupted: bool = False
    deadline_reached: bool = False
    counts: dict[str, int]
    """Items per status."""
    categories: dict[str, int]
    """Items per failure category (pvisor's for ``replay_failed``; the status otherwise)."""
    timings: dict[str, dict[str, float]]
    """Per phase: p50, p90, p99 and max seconds over the items that have a record."""
    replays_per_minute: float
    failed: list[str]
    """Ids of the items that did not end ``ok``."""
    stopped: str | None = None
    """Why the batch stopped starting items before the end (the run directory's filesystem is full)."""
    images: ImageStats | None = None
    """The task images it pulled, when it named any by reference."""
    model: ModelTotals | None = None
    """Live continuations' model figures over every item of this run that has them (latency: the median of the
    items' medians, and the 90th percentile of their 90th percentiles)."""
    verification: VerificationStats | None = None
    """With ``--verify``: how many items' verifiers passed, and the mean reward."""
    egress: EgressStats | None = None
    """With ``--egress``: the items' connections, refusals and bytes, and the hosts reached and refused."""
    flaky: list[FlakyItem] = []
    """With ``--repeat K``: the items whose repeats ended otherwise, or left the workspace otherwise."""
