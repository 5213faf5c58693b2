"""The data behind ``report.html`` (:class:`ReportData`), embedded in the page as JSON.

The page's JSON leaves out every field that holds its default (``exclude_defaults``), to stay small;
:attr:`ReportData.defaults` carries those defaults so that the page fills them back in.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

REPORT_SCHEMA = "pvisor-host.report/v1"
CallOutcome = Literal["exact", "diverged", "errored"]


class CallView(BaseModel):
    """One replayed tool call of an item."""

    index: int
    """Its position among the item's replayed calls (0-based)."""
    call_id: str
    tool: str
    command: str | None = None
    """The shell command, or the path, pattern or URL the call acted on (shortened)."""
    outcome: CallOutcome
    """``exact``: the fresh observation equals the recorded one; ``errored``: it did not, and the fresh call
    failed; ``diverged``: it did not, otherwise."""
    original_is_error: bool = False
    replayed_is_error: bool = False
    diff: str | None = None
    """A compact diff, recorded (``-``) to fresh (``+``), when both observations could be read."""


class ActionTool(BaseModel):
    """A tool call of a next action."""

    name: str
    command: str | None = None
    """What it acted on, as for :attr:`CallView.command`."""


class NextActionView(BaseModel):
    """For a continued run: the agent's first action after the boundary against the recording's."""

    original_tools: list[ActionTool]
    replayed_tools: list[ActionTool]
    tool_names_equal: bool
    tool_arguments_equal: bool
    text_status: str
    text_similarity: float | None = None
    original_text: str = ""
    replayed_text: str = ""


class ItemView(BaseModel):
    """One row of the item table, and its details."""

    id: str
    line: int
    status: str
    category: str | None = None
    message: str | None = None
    agent: str | None = None
    mode: str | None = None
    after_step: int | None = None
    replayed: int | None = None
    """pvisor's ``replayed_tool_calls``."""
    continued: int | None = None
    """pvisor's ``continued_steps``."""
    exact: int = 0
    diverged: int = 0
    errored: int = 0
    duration: float | None = None
    """Seconds, the record's ``total``."""
    attempts: int = 0
    skipped: bool = False
    dir: str | None = None
    """The item's directory, relative to the report (links to its record, logs and artifacts)."""
    calls: list[CallView] = []
    """The replayed calls; the exact ones only while the page's budget allows (see ``exact_listed``)."""
    exact_listed: bool = True
    """False when the exact calls were left out of ``calls`` to keep the page small."""
    next_action: NextActionView | None = None
    tokens: int | None = None
    """A live continuation's model tokens, in and out (every attempt's)."""
    model: str | None = None
    """Its model figures in one line: calls, tokens, retries, errors, waits, latency, cost."""


class PhaseStats(BaseModel):
    """The distribution of one phase's seconds over the items that ran."""

    count: int
    min: float
    p10: float
    p50: float
    p90: float
    max: float


class DivergenceGroup(BaseModel):
    """Replayed calls of one tool (and, when grouped by command, one command) across items."""

    tool: str
    command: str | None = None
    diverged: int
    """Calls in the group whose fresh observation differed (``diverged`` or ``errored``)."""
    calls: int
    items: list[str]
    """Ids of the items with such a call (the first few)."""


class ReportData(BaseModel):
    """Everything ``report.html`` shows."""

    schema_version: str
    title: str
    generated_at: datetime
    counts: dict[str, int]
    categories: dict[str, int]
    phases: dict[str, PhaseStats]
    items: list[ItemView]
    by_tool: list[DivergenceGroup]
    by_command: list[DivergenceGroup]
    diffs_dropped: int
    """Calls that did not reproduce and have no diff because the page had no room for one."""
    exact_hidden: int
    """Items whose exact calls were left out to keep the page small."""
    model: str | None = None
    """The batch's model figures in one line (live continuations only)."""
    defaults: dict[str, dict[str, Any]]
    """The defaults of ``item`` and ``call`` fields, which the page's JSON leaves out."""

    def page_json(self) -> str:
        """The JSON embedded in the page: no field that holds its default."""
        return self.model_dump_json(exclude_defaults=True)


def field_defaults() -> dict[str, dict[str, Any]]:
    """``ReportData.defaults``."""
    return {
        name: {key: field.default for key, field in model.model_fields.items() if not field.is_required()}
        for name, model in (("item", ItemView), ("call", CallView), ("group", DivergenceGroup))
    }
