"""What a batch is made of and ends with, for every layer above the scheduler: each item's
:class:`ItemResult` (``results.jsonl``) and the batch's :class:`BatchSummary` (``summary.json``)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from ..units import percentile
from .egress import EgressStats, EgressTotals
from .record import ModelTotals, VerificationOutcome, describe_verification

__all__ = [
    "FINAL_STATUSES",
    "PHASES",
    "RESULTS_FILE",
    "BatchSummary",
    "ImageStats",
    "ItemResult",
    "VerificationResult",
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


class VerificationResult(BaseModel):
    """An item's verification, as a results row carries it (``record.json`` has the command and its output)."""

    outcome: VerificationOutcome
    """``passed``, ``failed``, ``timed_out`` or ``could_not_run`` (no verdict on the task: counted apart)."""
    passed: bool | None
    reward: float | None = None
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float | None = None
    note: str | None = None
    """Why it did not run to its end, when it did not."""

    def describe(self) -> str:
        """One line: what it came to, its exit code and reward."""
        return describe_verification(self.outcome, self.exit_code, self.reward, self.seconds, self.note)


class ItemResult(BaseModel):
    """How one batch item ended (this run, or in an earlier run it was skipped for): one row of
    ``results.jsonl`` (schema ``docs/schemas/results-row.schema.json``)."""

    id: str
    line: int
    after_step: int | None = None
    """The boundary it replayed to."""
    agent: str | None = None
    image: str | None = None
    """The image as it was asked for (a task image's reference, or the agent image's tag)."""
    image_digest: str | None = None
    """The registry digest the image came from (``repo@sha256:...``), when it came from one."""
    status: str
    """A record status (``ok``, ``replay_failed``, ``timeout``, ``oom``, ``infra_error``, ``interrupted``),
    ``rejected`` (refused before a sandbox started) or ``not_run`` (the deadline passed first)."""
    category: str | None = None
    message: str | None = None
    timings: dict[str, float] = {}
    attempts: int = 0
    skipped: bool = False
    """Finished in an earlier run with the same content key, so not run again."""
    path: str | None = None
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
    verification: VerificationResult | None = None
    """With ``--verify``: whether the task's verifier passed, and its reward."""
    model: ModelTotals | None = None
    """A live continuation's model figures (tokens, cost, ...), every attempt's calls included."""
    egress: EgressTotals | None = None
    """With ``--egress``: the connections its tool calls made and were refused, the bytes, the hosts."""
    repeat_of: str | None = None
    """With ``--repeat K``: the id its repeats share (see :class:`FlakyItem`)."""

    @property
    def ran(self) -> bool:
        """Ran to a final status in this run."""
        return not self.skipped and self.status in FINAL_STATUSES

    @property
    def not_ok(self) -> bool:
        """It did not end ``ok``, or its verifier did not pass: what the terminal lists and ``--not-ok`` keeps."""
        return self.status != "ok" or (self.verification is not None and self.verification.passed is not True)

    def outcome_line(self) -> str:
        """How it ended, in one line: its status and why, and its verification (the terminal's list)."""
        line = self.status
        reason = self.message or (self.category if self.category not in (None, self.status) else None)
        if reason:
            line += f": {reason}"
        if self.verification is not None:
            line += f"; verification {self.verification.describe()}"
        return line


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
