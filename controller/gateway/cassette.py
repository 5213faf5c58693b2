"""A cassette: a run's model exchanges kept in order (``record``), then served back with no upstream (``replay``).

A tape is one JSON line per model call, numbered in the order the calls came (written as each answer ends):
the call's number, the recording run's id, method and path, the request body, and the answer
(status, content type, whether it was a stream, the body as sent). It holds no header, so no authorization
and no token: what it holds is the prompts and the answers. A tape is one run's, named after the run
directory (a batch item's id): ``DIR/<item>.jsonl``.

Served back, call *n* of a run gets the tape's answer *n*. Its request is compared with the recorded one,
conversation only (``messages``, or ``input`` and ``instructions``: the rest carries per-run ids and
settings), with what differs from run to run by itself masked: the run's own id (agents put it in paths of
their prompts), ``id`` fields (items the agent names afresh), and what :data:`DEFAULT_MASKS` match (dates and
times, kernel and OS versions, temporary paths, durations, pids), the agent's own ``volatile`` patterns and
the user's (``--cassette-mask``). The first message that still differs is drift, shown as the few words around
its first differing character. ``--on-drift fail`` answers
it with an error, so the agent stops and the item fails as ``model_drift``; ``serve`` answers all the same.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import UsageError
from ..models.record import ModelDrift

#: Request fields that hold the conversation, compared when a tape is served back.
CONVERSATION = ("system", "instructions", "messages", "input")
#: Characters of each side a drift shows before and after the first that differs.
DIFF_BEFORE, DIFF_AFTER = 80, 160


class TapeEntry(BaseModel):
    """One recorded call."""

    call: int
    run_id: str = ""
    """The recording run's id."""
    method: str
    path: str
    request: Any
    status: int
    content_type: str
    stream: bool
    answer: str


class Tape:
    """One run's tape: written as calls are answered (``record``), or read whole and served (``replay``)."""

    def __init__(self, path: Path, *, replaying: bool, volatile: list[str] | None = None) -> None:
        self.path = path
        self.replaying = replaying
        self.volatile = [re.compile(pattern) for pattern in volatile or []]
        """What differs from run to run by itself beyond :data:`DEFAULT_MASKS` (the agent profile's ``volatile``
        patterns, the user's ``--cassette-mask``), masked when comparing."""
        self.entries: list[TapeEntry] = []
        self.calls = 0
        self.drift: ModelDrift | None = None
        self._lock = threading.Lock()
        self._served: set[int] = set()
        if replaying:
            try:
                with path.open(encoding="utf-8") as lines:
                    self.entries = [TapeEntry.model_validate_json(line) for line in lines if line.strip()]
            except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
                problem = str(exc).splitlines()[0][:200]
                raise UsageError(f"--model-cassette replay: {path} is not a readable tape ({problem})") from None
            self.entries.sort(key=lambda entry: entry.call)

    def next_call(self) -> int:
        """The number of the call that just came in (1-based)."""
        with self._lock:
            self.calls += 1
            return self.calls

    def record(self, entry: TapeEntry) -> None:
        """Keep one answered call."""
        with self._lock, self.path.open("a", encoding="utf-8") as handle:
            handle.write(entry.model_dump_json() + "\n")

    def serve(self, call: int, request: Any, run: str = "") -> tuple[TapeEntry | None, ModelDrift | None]:
        """The recorded answer to call ``call`` of the run ``run`` and, when ``request`` differs from the recorded
        one, where. Calls a run makes at once may arrive in another order than they were recorded: a request
        that matches another call not served yet gets that call's answer."""
        with self._lock:
            waiting = [entry for entry in self.entries if entry.call not in self._served]
        own = next((entry for entry in waiting if entry.call == call), None)

        def differs(entry: TapeEntry) -> ModelDrift | None:
            return compare(entry.request, request, recorded_run=entry.run_id, run=run, volatile=self.volatile)

        found = differs(own) if own is not None else None
        if own is None or found is not None:
            matching = next((entry for entry in waiting if differs(entry) is None), None)
            if matching is not None:
                own, found = matching, None
        if own is None:
            held = f"the tape holds {len(self.entries)} calls; this is call {call}"
            return None, self._first(ModelDrift(call=call, field="calls", diff=held))
        with self._lock:
            self._served.add(own.call)
        return own, self._first(found.model_copy(update={"call": call})) if found else None

    def _first(self, drift: ModelDrift) -> ModelDrift:
        with self._lock:
            if self.drift is None:
                self.drift = drift
        return drift


def compare(
    recorded: Any, sent: Any, *, recorded_run: str = "", run: str = "", volatile: list[re.Pattern[str]] | None = None
) -> ModelDrift | None:
    """The first difference between two requests' conversations, or None (see the module docstring).
    ``recorded_run`` and ``run`` are the two runs' ids: where a prompt names its own run, that is no drift;
    nor is what matches one of the agent's ``volatile`` patterns."""
    masks = [*DEFAULT_MASKS, *(volatile or [])]
    old, new = _normal(recorded, recorded_run, masks), _normal(sent, run, masks)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None if old == new else ModelDrift(call=0, field="body", diff=_diff(old, new))
    for field in CONVERSATION:
        was, now = old.get(field), new.get(field)
        if was == now:
            continue
        if isinstance(was, list) and isinstance(now, list):
            index = next((i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b), min(len(was), len(now)))
            before = was[index] if index < len(was) else None
            after = now[index] if index < len(now) else None
            return ModelDrift(call=0, field=field, message=index, diff=_diff(before, after))
        return ModelDrift(call=0, field=field, diff=_diff(was, now))
    return None


#: What differs between two runs on two hosts by itself, masked in both requests before they are compared.
#: Each is anchored where a run of its kind starts (no backtracking across a long run of digits), and each
#: masks only what is fresh by nature, in the shapes the tools that make it print: a temp directory's
#: made-up name as ``mktemp``, Python's ``tempfile`` and pytest make them (a file named by the task, even in
#: ``/tmp``, is not masked), a duration a word says was measured ("took 0.52s", "real 0m0.003s", "(12 ms)";
#: not ``timeout=30s`` or ``sleep 1.5s``), dates and times, kernel and OS builds, pids.
_TEMP_DIR = r"(?:/private)?(?:/tmp|/var/tmp|/var/folders/[\w-]+/[\w-]+/T)"
_MADE_UP = r"(?:tmp\.[A-Za-z0-9]{10}|tmp[a-z0-9_]{8}|pytest-of-[\w-]+/pytest-\d+)(?![\w.])"
_UNIT = r"(?:ns|us|µs|ms|msec|s|sec|secs|seconds?|minutes?|mins?)"
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
DEFAULT_MASKS = [
    # `date`, `ls -l`, `git log`: [weekday] month day, then a time or a year
    re.compile(
        rf"\b(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun),? +)?{_MONTH} +\d{{1,2}} +(?:\d{{1,2}}:\d{{2}}(?::\d{{2}})?|\d{{4}})\b"
    ),
    re.compile(r"(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)"),  # dates, ISO timestamps' too
    re.compile(r"(?<![\d:])\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?(?![\d:])"),  # times of day
    re.compile(r"\b(?:Linux|Darwin|Windows(?: NT)?)[ /-]v?\d+(?:\.\d+)+[\w.+~-]*"),  # kernel and OS versions
    re.compile(r"\bDarwin Kernel Version \d+(?:\.\d+)+"),  # uname -v on macOS
    re.compile(r"#\d+(?:~[\w.]+)?(?:-Ubuntu)? SMP"),  # uname -v's build number (Debian's, Ubuntu's #26~22.04.1-Ubuntu)
    re.compile(r"\b(?:Debian|Ubuntu) \d+(?:\.\d+)+-\S+"),  # the kernel package in uname -v
    re.compile(r"(?<![\w.])\d+(?:\.\d+)+-\d+-(?:amd64|arm64|cloud-amd64|generic|aws|azure|gcp)\b"),  # a kernel release
    re.compile(rf"(?<![\w.]){_TEMP_DIR}/{_MADE_UP}"),  # a temporary directory's made-up name
    re.compile(r"(?<![\w.])\d+m\d+(?:\.\d+)?s\b"),  # durations as `time` prints them (0m0.003s)
    re.compile(rf"(?i)\b(?:in|took|after|elapsed:?|real|user|sys|wall time:?)\s+\d+(?:\.\d+)?\s?{_UNIT}\b"),  # said so
    re.compile(rf"\(\d+(?:\.\d+)?\s?{_UNIT}\)"),  # as test runners print them: (0.00s), (12 ms)
    re.compile(r"(?i)\bpid[ =:]*\d+\b"),  # pids
]


def _normal(request: Any, run: str, masks: list[re.Pattern[str]]) -> Any:
    """A request as compared: its run's id and what ``masks`` match masked in its strings, and no ``id`` (an
    item's own name, made afresh by the agent each run)."""
    value = _without_ids(request)
    text = json.dumps(value, ensure_ascii=False)
    if run:
        text = text.replace(run, "<run>")
    value = json.loads(text)
    return _masked(value, masks)


def _masked(value: Any, masks: list[re.Pattern[str]]) -> Any:
    if isinstance(value, str):
        for mask in masks:
            value = mask.sub("<…>", value)
        return value
    if isinstance(value, dict):
        return {k: _masked(v, masks) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v, masks) for v in value]
    return value


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _diff(recorded: Any, sent: Any) -> str:
    """Where two messages part: a few words of each around the first character that differs."""
    old = "" if recorded is None else json.dumps(recorded, ensure_ascii=False, sort_keys=True)
    new = "" if sent is None else json.dumps(sent, ensure_ascii=False, sort_keys=True)
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    start = max(0, at - DIFF_BEFORE)

    def around(text: str) -> str:
        cut = text[start : at + DIFF_AFTER]
        return ("…" if start else "") + cut + ("…" if len(text) > at + DIFF_AFTER else "")

    return f"- {around(old) if recorded is not None else '(none)'}\n+ {around(new) if sent is not None else '(none)'}"


def request_json(body: bytes) -> Any:
    """A request body as the tape keeps it: its JSON, or its text when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")
