"""One pre-flight per trajectory file, for all its boundaries: what pvisor accepts, counted and checked once.

A dataset asks for many boundaries of each trajectory. Running pvisor's ``--prepare-only`` once per
(file, boundary) costs a process per item; :func:`survey` asks pvisor about the file as a whole and answers
every boundary from that, cached by the file's sha256 (and the agent, and pvisor's version, which is pinned).

What one call vouches for follows from where pvisor 0.3.1 makes its checks (``crates/pvisor-replay``, read
and confirmed against the binary; docs/batch.md#pre-flight-once-per-trajectory has the table):

- the file-level checks (the format, the pinned agent version inside the file, Pi's and OpenHands' tool
  allow-lists, Codex's call ids, ...) run while the file is parsed: any call vouches for every boundary;
- ``requested after-step K, trajectory has M complete batches`` gives the count M;
- Claude Code and SWE-agent check each batch of the prefix (an unsupported tool, a ``submit`` in the prefix)
  *after* the count: a call at K checks batches 1..K, and a call past the end checks none of them;
- mini-swe-agent checks its prefix (a submission) while parsing, before the count;
- OpenHands refuses a boundary with no user message at or before it: boundaries below some point.

So the first call goes to an upper bound of the count read from the file (its tool calls:
:attr:`~pvisor_host.models.replay.TrajectoryInfo.bounds`, read with the file). When pvisor accepts it, the bound
was the count and that call checked every batch. When pvisor says the count is lower, Claude Code and SWE-agent get
a second call at the count. A refusal of some batches is located by bisection over the boundaries (pvisor's per-
batch checks are monotone: a refused prefix stays refused when it grows), and OpenHands gets one call at boundary 1
(a bisection only if that is refused). A valid file of Codex, OpenCode, Pi, mini-swe-agent, SWE-agent or Claude
Code therefore costs one pvisor run; a valid OpenHands file two.

Not vouched for by any prepare-only call: Claude's stale tools (``--allow-stale-observations``), which pvisor
checks only when it runs tools, and the ``--max-steps`` budget, which pvisor counts in model turns: where
those are not the boundary itself (Codex, OpenCode, Pi, mini-swe-agent), a budget is checked with a call at
that boundary (:func:`prefix_model_turns`).

:func:`survey_plan` answers one boundary from the survey as :func:`~.hostpvisor.prepare_only` answers it with a
pvisor run of its own: refused, or the plan of its prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from .._version import PVISOR_VERSION
from ..errors import PreflightRejected
from ..models.replay import PvisorPlan, TrajectoryInfo
from ..models.result import ResultFailure
from .hostpvisor import Probe, probe

T = TypeVar("T")

#: A boundary past any trajectory's end: pvisor answers with the count.
PAST_THE_END = 999_999_999
#: Agents whose per-batch checks run after the count (a call past the end does not make them).
_CHECKED_AFTER_COUNT = frozenset({"claude-code", "swe-agent"})
#: Agents that refuse boundaries below some point (OpenHands: no user message at or before the boundary).
_REFUSED_BELOW = frozenset({"openhands"})
#: Agents whose prefix counts exactly one model turn per batch (so a ``--max-steps`` budget needs no call).
TURNS_ARE_BATCHES = frozenset({"claude-code", "openhands", "swe-agent"})


class Survey(BaseModel):
    """What pvisor accepts of one trajectory, boundary by boundary (see the module docstring)."""

    agent: str
    sha256: str
    pvisor_version: str = PVISOR_VERSION
    complete: int | None = None
    """pvisor's count of complete tool batches (None: it refused the file before counting)."""
    refused_from: int | None = None
    """Boundaries from this one up are refused with ``failure`` (1: the whole file)."""
    failure: ResultFailure | None = None
    refused_below: int | None = None
    """Boundaries below this one are refused with ``below`` (OpenHands' user message)."""
    below: ResultFailure | None = None
    batches: list[list[str]] | None = None
    """The tool names of each batch pvisor checked (when a call was accepted at the last checked boundary)."""
    prefix_model_turns: dict[int, int] = {}
    """The model turns of the prefix at the boundaries a call was accepted at."""
    pvisor_runs: int = 0
    """How many host pvisor runs the survey took."""

    def verdict(self, after_step: int) -> ResultFailure | None:
        """pvisor's refusal of ``after_step`` (None: accepted)."""
        if self.complete is not None and after_step > self.complete:
            message = f"requested after-step {after_step}, trajectory has {self.complete} complete batches"
            return ResultFailure(category="trajectory_error", message=message)
        if self.refused_from is not None and after_step >= self.refused_from:
            return self.failure
        if self.refused_below is not None and after_step < self.refused_below:
            return self.below
        return None

    @property
    def count(self) -> int | None:
        """The boundaries ``all`` expands to: the count, or, where pvisor refused before it could count, up to the
        first refused boundary (so that refusal shows as an item); None when pvisor refused the file itself."""
        if self.complete is not None:
            return self.complete
        return self.refused_from if self.refused_from is not None and self.refused_from > 1 else None

    @property
    def accepted(self) -> tuple[int, int] | None:
        """The first and last boundary pvisor accepts (None: none)."""
        last = self.complete if self.complete is not None else (self.refused_from or 1) - 1
        if self.refused_from is not None:
            last = min(last, self.refused_from - 1)
        first = max(1, self.refused_below or 1)
        return (first, last) if first <= last else None


class _Runs:
    """The probes of one survey, counted."""

    def __init__(self, agent: str, path: Path) -> None:
        self.agent, self.path, self.count = agent, path, 0

    def __call__(self, after_step: int) -> Probe:
        self.count += 1
        return probe(self.agent, self.path, after_step)


def _survey(agent: str, trajectory: TrajectoryInfo) -> Survey:
    run = _Runs(agent, trajectory.path)
    survey = Survey(agent=agent, sha256=trajectory.sha256)
    bound = trajectory.bounds.get(agent)
    first = run(bound if bound else PAST_THE_END)
    if first.failure is None:  # accepted at an upper bound of the count: it is the count, every batch checked
        survey.complete = first.after_step
        _accepted(survey, first)
    elif first.complete is not None:
        survey.complete = first.complete
        if agent in _CHECKED_AFTER_COUNT and first.complete > 0:
            second = run(first.complete)
            if second.failure is None:
                _accepted(survey, second)
            else:
                _refused_from(survey, run, second)
    else:  # refused before counting: the file itself, or some batch (mini-swe-agent, or at Claude's bound)
        _refused_from(survey, run, first)
        if agent in _CHECKED_AFTER_COUNT and survey.refused_from != 1:  # these count before checking batches
            survey.complete = run(PAST_THE_END).complete
    if agent in _REFUSED_BELOW and survey.complete and survey.verdict(1) is None:
        low = run(1)
        if low.failure is not None:
            _refused_below(survey, run, low)
    survey.pvisor_runs = run.count
    return survey


def _accepted(survey: Survey, found: Probe) -> None:
    survey.batches = found.batches
    if found.prefix_model_turns is not None:
        survey.prefix_model_turns[found.after_step] = found.prefix_model_turns


def _refused_from(survey: Survey, run: Callable[[int], Probe], refused: Probe) -> None:
    """The first refused boundary at or below ``refused.after_step``, by bisection (pvisor's checks of the
    batches of a prefix are monotone: a refused prefix stays refused as it grows)."""
    high, failure = refused.after_step, refused.failure
    low = 0
    if high > 1:
        at_one = run(1)
        if _refusal(at_one):
            survey.refused_from, survey.failure = 1, at_one.failure
            return
        low = 1
    while high - low > 1:
        middle = (low + high) // 2
        found = run(middle)
        if _refusal(found):
            high, failure = middle, found.failure
        else:
            low = middle
    survey.refused_from, survey.failure = high, failure


def _refusal(found: Probe) -> bool:
    """A refusal of the prefix (not pvisor's count of a boundary past the end)."""
    return found.failure is not None and found.complete is None


def _refused_below(survey: Survey, run: Callable[[int], Probe], refused: Probe) -> None:
    """The first accepted boundary above a refused boundary 1 (bisection up to the count)."""
    assert survey.complete is not None
    low, high, failure = 1, survey.complete + 1, refused.failure
    top = run(survey.complete)
    if top.failure is not None:
        survey.refused_below, survey.below = survey.complete + 1, top.failure
        return
    high = survey.complete
    while high - low > 1:
        middle = (low + high) // 2
        found = run(middle)
        if found.failure is not None:
            low, failure = middle, found.failure
        else:
            high = middle
    survey.refused_below, survey.below = high, failure


def _turns(survey: Survey, path: Path, after_step: int) -> int:
    """The model turns of the prefix up to ``after_step``, kept in ``survey`` (pvisor asked the first time)."""
    if after_step not in survey.prefix_model_turns:
        probed = probe(survey.agent, path, after_step)
        survey.prefix_model_turns[after_step] = probed.prefix_model_turns or after_step
    return survey.prefix_model_turns[after_step]


# -- one survey per trajectory ------------------------------------------------------------------------------


class _Cache:
    """Surveys by (agent, sha256), each computed once however many threads ask (pvisor is pinned, so its
    version is no part of the key within one process); the model turns of boundaries asked later are kept in
    their survey."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._found: dict[tuple[str, str], Survey] = {}

    def get(self, agent: str, trajectory: TrajectoryInfo) -> Survey:
        return self._with(agent, trajectory, lambda found: found)

    def turns(self, agent: str, trajectory: TrajectoryInfo, after_step: int) -> int:
        return self._with(agent, trajectory, lambda found: _turns(found, trajectory.path, after_step))

    def _with(self, agent: str, trajectory: TrajectoryInfo, then: Callable[[Survey], T]) -> T:
        key = (agent, trajectory.sha256)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._found:
                self._found[key] = _survey(agent, trajectory)
            return then(self._found[key])

    def files(self) -> list[tuple[str, str]]:
        """The (agent, sha256) surveyed so far."""
        with self._lock:
            return list(self._found)


_CACHE = _Cache()


def checked_files() -> list[tuple[str, str]]:
    """The trajectories (agent, sha256) this process has surveyed."""
    return _CACHE.files()


def survey(agent: str, trajectory: TrajectoryInfo) -> Survey:
    """What pvisor accepts of the trajectory as ``agent``'s, for every boundary (see the module docstring).

    Raises:
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: pvisor hung or could not be run.
    """
    return _CACHE.get(agent, trajectory)


def boundaries(agent: str, trajectory: TrajectoryInfo) -> int | None:
    """The boundaries ``all`` means for the trajectory (:attr:`Survey.count`)."""
    return survey(agent, trajectory).count


def prefix_model_turns(agent: str, trajectory: TrajectoryInfo, after_step: int) -> int:
    """The model turns pvisor counts in the prefix up to ``after_step`` (what ``--max-steps`` budgets): the
    boundary itself for Claude Code, OpenHands and SWE-agent, else pvisor's own count at that boundary."""
    if agent in TURNS_ARE_BATCHES:
        return after_step
    return _CACHE.turns(agent, trajectory, after_step)


def survey_plan(agent: str, trajectory: TrajectoryInfo, after_step: int, *, count_turns: bool) -> PvisorPlan:
    """pvisor's verdict on ``after_step`` from the trajectory's survey: the plan of its prefix, whose model turns are
    pvisor's own count only with ``count_turns`` (a step budget to check against them), else the boundary.

    Raises:
        PreflightRejected: pvisor refuses the boundary (its category and message).
    """
    found = survey(agent, trajectory)
    refusal = found.verdict(after_step)
    if refusal is not None:
        raise PreflightRejected(refusal.category, refusal.message)
    turns = prefix_model_turns(agent, trajectory, after_step) if count_turns else after_step
    calls = sum(len(batch) for batch in (found.batches or [])[:after_step])
    return PvisorPlan(after_step=after_step, prefix_model_turns=turns, tool_calls=calls)
