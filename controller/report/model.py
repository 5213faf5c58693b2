"""The data behind ``report.html`` (:class:`ReportData`), embedded in the page as JSON.

The page's JSON leaves out every field that holds its default (``exclude_defaults``), to stay small;
:attr:`ReportData.defaults` carries those defaults so that the page fills them back in.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

REPORT_SCHEMA = "pvisor-host.report/v1"
CallOutcome = Literal["exact", "whitespace", "diverged", "errored"]


class CallView(BaseModel):
    """One replayed tool call of an item."""

    index: int
    """Its position among the item's replayed calls (0-based)."""
    call_id: str
    tool: str
    command: str | None = None
    """The shell command, or the path, pattern or URL the call acted on (shortened)."""
    outcome: CallOutcome
    """``exact``: the fresh observation equals the recorded one; ``whitespace``: it differs in whitespace or line
    endings only (reproduced); ``errored``: it did not, and the fresh call failed; ``diverged``: it did not,
    otherwise."""
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
    """One item: its row of the table, and (within the page's budget) its details."""

    id: str
    line: int
    status: str
    category: str | None = None
    message: str | None = None
    agent: str | None = None
    image: str | None = None
    """The image it ran in, as it was asked for."""
    mode: str | None = None
    after_step: int | None = None
    replayed: int | None = None
    """pvisor's ``replayed_tool_calls``."""
    continued: int | None = None
    """pvisor's ``continued_steps``."""
    exact: int = 0
    whitespace: int = 0
    diverged: int = 0
    errored: int = 0
    duration: float | None = None
    """Seconds, the record's ``total``."""
    pull_wait: float | None = None
    """Seconds it waited for its task image (pulled just in time)."""
    attempts: int = 0
    skipped: bool = False
    dir: str | None = None
    """The item's directory, relative to the report (links to its record, logs and artifacts)."""
    tokens: int | None = None
    """A live continuation's model tokens, in and out (every attempt's)."""
    verified: bool | None = None
    """With ``--verify``: whether the task's verifier passed."""
    reward: float | None = None
    egress: int | None = None
    """With ``--egress``: the connections its tool calls made through the egress proxy."""
    refused: int | None = None
    """With ``--egress``: the connections the proxy refused it."""
    calls: list[CallView] = []
    """The replayed calls; the exact ones only while the page's budget allows (see ``exact_listed``)."""
    exact_listed: bool = True
    """False when the exact calls were left out of ``calls`` to keep the page small."""
    next_action: NextActionView | None = None
    model: str | None = None
    """Its model figures in one line: calls, tokens, retries, errors, waits, latency, cost."""
    detailed: bool = True
    """False when the page had no room for this item's details (its calls, next action): its row only."""


#: The row of every item, as the page's JSON holds it: one array per item, in this order, the columns an item
#: most often leaves at their default last, and those trailing defaults left off (a 100,000-item dataset's rows
#: are about 6 MB). Strings that repeat across items (status, category, agent, image) are indices into
#: :attr:`ReportData.values`; booleans are 0 and 1; ``dir`` is 1 when it is the item's id.
ROW = (
    "id", "line", "dir", "status", "agent", "after_step", "image", "replayed", "duration", "diverged", "errored",
    "continued", "exact", "verified", "reward", "pull_wait", "tokens", "category", "message", "attempts", "skipped",
    "egress", "refused", "whitespace",
)  # fmt: skip
#: What a row's trailing columns default to (left off when they hold it).
ROW_DEFAULTS: dict[str, Any] = {
    "diverged": 0, "errored": 0, "exact": None, "attempts": 1, "skipped": 0, "whitespace": 0,
}  # fmt: skip
#: The row's columns that hold indices into :attr:`ReportData.values` (repeated strings, stored once).
INDEXED = ("status", "agent", "image", "category", "message")
#: What an item's details hold (its :class:`ItemView` fields beyond the row).
DETAIL = ("mode", "calls", "exact_listed", "next_action", "model")


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


class ImageRow(BaseModel):
    """The items of one task image (or agent image)."""

    image: str
    items: int
    ok: int
    verified: int = 0
    passed: int = 0
    pull_wait_p50: float | None = None
    """Median seconds its items waited for it."""


class BoundaryRow(BaseModel):
    """The items at one boundary."""

    after_step: int
    items: int
    ok: int
    diverged: int
    """Items with at least one replayed call that did not reproduce its observation."""


class ReportData(BaseModel):
    """Everything ``report.html`` shows. The items are :attr:`rows` (every item, compact) and :attr:`details`
    (the calls and next action of as many as the page's budget holds, failures and divergences first)."""

    schema_version: str
    title: str
    generated_at: datetime
    counts: dict[str, int]
    categories: dict[str, int]
    phases: dict[str, PhaseStats]
    rows: list[list[Any]]
    """Every item, as arrays of :data:`ROW` (indexed columns point into :attr:`values`)."""
    values: list[str | None]
    """The strings the rows' indexed columns name."""
    details: dict[str, dict[str, Any]] = {}
    """Item id → its details (:data:`DETAIL` fields), for the items the page has room for."""
    by_tool: list[DivergenceGroup]
    by_command: list[DivergenceGroup]
    by_image: list[ImageRow] = []
    by_boundary: list[BoundaryRow] = []
    images: dict[str, Any] | None = None
    """The task images the batch pulled (``summary.json``'s ``images``)."""
    verification: dict[str, Any] | None = None
    """``summary.json``'s ``verification``: the pass rate and mean reward."""
    egress: dict[str, Any] | None = None
    """``summary.json``'s ``egress``: the connections, the hosts reached and those refused."""
    comparison: dict[str, Any] | None = None
    """Against a baseline (``batch --baseline``, ``report --baseline``): what changed, side by side, regressions
    first (:func:`~pvisor_host.report.gather.comparison_view`)."""
    flaky: list[dict[str, Any]] = []
    """``summary.json``'s ``flaky`` (``--repeat``): the items whose repeats ended or left the workspace otherwise."""
    diffs_dropped: int
    """Calls that did not reproduce and have no diff because the page had no room for one."""
    exact_hidden: int
    """Items whose exact calls were left out to keep the page small."""
    undetailed: int = 0
    """Items whose details were left out to keep the page small (their rows are all there)."""
    model: str | None = None
    """The batch's model figures in one line (live continuations only)."""
    defaults: dict[str, dict[str, Any]]
    """The defaults of ``call`` and ``group`` fields, which the page's JSON leaves out."""

    @property
    def items(self) -> list[ItemView]:
        """Every item as a whole :class:`ItemView`: its row and, where the page has them, its details."""
        views = []
        for row in self.rows:
            fields: dict[str, Any] = {name: ROW_DEFAULTS.get(name) for name in ROW}
            fields |= {name: self.values[value] if name in INDEXED and value is not None else value
                       for name, value in zip(ROW, row, strict=False)}  # fmt: skip
            if fields["exact"] is None:
                fields["exact"] = max(0, (fields["replayed"] or 0) - fields["diverged"] - fields["errored"])
            if fields["dir"] == 1:
                fields["dir"] = fields["id"]
            detail = self.details.get(fields["id"])
            fields["detailed"] = detail is not None
            views.append(ItemView(**fields, **(detail or {})))
        return views

    def page_json(self) -> str:
        """The JSON embedded in the page: no field that holds its default."""
        return self.model_dump_json(exclude_defaults=True)


def field_defaults() -> dict[str, dict[str, Any]]:
    """``ReportData.defaults``."""
    return {
        name: {key: field.default for key, field in model.model_fields.items() if not field.is_required()}
        for name, model in (("item", ItemView), ("call", CallView), ("group", DivergenceGroup))
    }
