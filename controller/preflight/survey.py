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

So the first call goes to an upper bound of the count read from the file (every batch needs at least one tool
call, so the file's tool calls bound it; for Claude, tool-bearing fragments of one response count once). When
pvisor accepts it, the bound was the count and that call checked every batch. When pvisor says the count is
lower, Claude Code and SWE-agent get a second call at the count. A refusal of some batches is located by
bisection over the boundaries (pvisor's per-batch checks are monotone: a refused prefix stays refused when it
grows), and OpenHands gets one call at boundary 1 (a bisection only if that is refused). A valid file of
Codex, OpenCode, Pi, mini-swe-agent, SWE-agent or Claude Code therefore costs one pvisor run; a valid OpenHands
file two.

Not vouched for by any prepare-only call: Claude's stale tools (``--allow-stale-observations``), which pvisor
checks only when it runs tools, and the ``--max-steps`` budget, which pvisor counts in model turns: where
those are not the boundary itself (Codex, OpenCode, Pi, mini-swe-agent), a budget is checked with a call at
that boundary (:func:`prefix_model_turns`).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .._version import PVISOR_VERSION
from ..files.digest import hash_file
from ..models.result import ResultFailure
from .hostpvisor import Probe, probe

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


def _survey(agent: str, path: Path, sha256: str) -> Survey:
    run = _Runs(agent, path)
    survey = Survey(agent=agent, sha256=sha256)
    bound = upper_bound(agent, path)
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


# -- upper bounds of the count, read from the file ----------------------------------------------------------


def upper_bound(agent: str, path: Path) -> int | None:
    """A number of complete batches pvisor cannot exceed for this file (None: it cannot be told cheaply).

    Every batch holds at least one tool call, so the file's tool calls bound it; Claude Code's fragments of one
    response (consecutive on the chain, one message id) count once, SWE-agent's count is exact."""
    try:
        count = _BOUNDS[agent](path) if agent in _BOUNDS else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None
    return count if count else None


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                value = json.loads(line)
                if isinstance(value, dict):
                    yield value


def _document(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def _claude(path: Path) -> int:
    count, previous = 0, None
    for event in _jsonl(path):
        message = event.get("message") if event.get("type") == "assistant" else None
        content = message.get("content") if isinstance(message, dict) else None
        tools = isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_use" for b in content)
        same_response = (
            previous is not None
            and isinstance(message, dict)
            and message.get("id") == previous[0]
            and event.get("parentUuid") == previous[1]
        )
        if tools and not same_response:
            count += 1
        previous = (message.get("id"), event.get("uuid")) if isinstance(message, dict) and tools else None
    return count


def _codex(path: Path) -> int:
    return sum(
        1
        for event in _jsonl(path)
        if isinstance(event.get("payload"), dict)
        and event["payload"].get("type") in ("function_call", "custom_tool_call")
    )


def _opencode(path: Path) -> int:
    return len(
        {
            event["part"].get("callID")
            for event in _jsonl(path)
            if event.get("type") == "tool_use" and isinstance(event.get("part"), dict)
        }
    )


def _pi(path: Path) -> int:
    return sum(1 for event in _jsonl(path) if event.get("type") == "turn_end")


def _mini(path: Path) -> int:
    return sum(1 for message in _document(path)["messages"] if isinstance(message, dict))


def _openhands(path: Path) -> int:
    return sum(1 for event in _document(path) if isinstance(event, dict) and "action" in event)


def _swe(path: Path) -> int:
    document = _document(path)
    assistant = sum(1 for entry in document["history"] if isinstance(entry, dict) and entry.get("role") == "assistant")
    return min(len(document["trajectory"]), assistant)


_BOUNDS: dict[str, Callable[[Path], int]] = {
    "claude-code": _claude,
    "codex": _codex,
    "opencode": _opencode,
    "pi-agent": _pi,
    "mini-swe-agent": _mini,
    "openhands": _openhands,
    "swe-agent": _swe,
}


# -- caches -----------------------------------------------------------------------------------------------


class _Cache:
    """Surveys by (agent, sha256), each computed once however many threads ask (pvisor is pinned, so its
    version is no part of the key within one process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._found: dict[tuple[str, str], Survey] = {}

    def get(self, agent: str, path: Path, sha256: str) -> Survey:
        key = (agent, sha256)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._found:
                self._found[key] = _survey(agent, path, sha256)
            return self._found[key]

    def files(self) -> list[tuple[str, str]]:
        """The (agent, sha256) surveyed so far."""
        with self._lock:
            return list(self._found)


_CACHE = _Cache()


def checked_files() -> list[tuple[str, str]]:
    """The trajectories (agent, sha256) this process has surveyed."""
    return _CACHE.files()


def survey(agent: str, path: Path, sha256: str | None = None) -> Survey:
    """What pvisor accepts of ``path`` as ``agent``'s trajectory, for every boundary (see the module docstring).

    Raises:
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: pvisor hung or could not be run.
    """
    path = path.absolute()
    return _CACHE.get(agent, path, sha256 or file_sha256(path))


def boundaries(agent: str, path: Path) -> int | None:
    """The boundaries ``all`` means for ``path`` (:attr:`Survey.count`)."""
    return survey(agent, path).count


def prefix_model_turns(agent: str, path: Path, after_step: int) -> int:
    """The model turns pvisor counts in the prefix up to ``after_step`` (what ``--max-steps`` budgets): the
    boundary itself for Claude Code, OpenHands and SWE-agent, else pvisor's own count at that boundary."""
    if agent in TURNS_ARE_BATCHES:
        return after_step
    known = survey(agent, path).prefix_model_turns.get(after_step)
    if known is not None:
        return known
    return _turns(agent, path.absolute(), file_sha256(path), after_step)


@functools.lru_cache(maxsize=65536)
def _turns(agent: str, path: Path, sha256: str, after_step: int) -> int:
    found = probe(agent, path, after_step)
    return found.prefix_model_turns if found.prefix_model_turns is not None else after_step


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read once per version of it (path, size, modification time)."""
    info = path.stat()
    return _sha256(path.absolute(), info.st_size, info.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    return hash_file(path)[1]
