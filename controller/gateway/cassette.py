"""A cassette: a run's model exchanges kept in order (``record``), then served back with no upstream (``replay``).

A tape is one JSON line per model call: the call's number, method and path, the request body, and the answer
(status, content type, whether it was a stream, the body as sent). It holds no header, so no authorization
and no token: what it holds is the prompts and the answers. A tape is one run's, named after the run
directory (a batch item's id): ``DIR/<item>.jsonl``.

Served back, call *n* of a run gets the tape's answer *n*. Its request is compared with the recorded one,
conversation only (``messages``, or ``input`` and ``instructions``: the rest carries per-run ids and
settings): the first message that differs is drift, named with a compact diff. ``--on-drift fail`` answers
it with an error, so the agent stops and the item fails as ``model_drift``; ``serve`` answers all the same.
"""

from __future__ import annotations

import difflib
import json
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..models.record import ModelDrift

#: Request fields that hold the conversation, compared when a tape is served back.
CONVERSATION = ("system", "instructions", "messages", "input")
#: Lines of a drift's diff kept in the record.
DIFF_LINES = 24


class TapeEntry(BaseModel):
    """One recorded call."""

    call: int
    method: str
    path: str
    request: Any
    status: int
    content_type: str
    stream: bool
    answer: str


class Tape:
    """One run's tape: written as calls are answered (``record``), or read whole and served (``replay``)."""

    def __init__(self, path: Path, *, replaying: bool) -> None:
        self.path = path
        self.replaying = replaying
        self.entries: list[TapeEntry] = []
        self.calls = 0
        self.drift: ModelDrift | None = None
        self._lock = threading.Lock()
        if replaying:
            with path.open(encoding="utf-8") as lines:
                self.entries = [TapeEntry.model_validate_json(line) for line in lines if line.strip()]

    def next_call(self) -> int:
        """The number of the call that just came in (1-based)."""
        with self._lock:
            self.calls += 1
            return self.calls

    def record(self, entry: TapeEntry) -> None:
        """Keep one answered call."""
        with self._lock, self.path.open("a", encoding="utf-8") as handle:
            handle.write(entry.model_dump_json() + "\n")

    def serve(self, call: int, request: Any) -> tuple[TapeEntry | None, ModelDrift | None]:
        """The recorded answer to call ``call`` and, when ``request`` differs from the recorded one, where."""
        if call > len(self.entries):
            drift = ModelDrift(
                call=call, field="calls", diff=f"the tape holds {len(self.entries)} calls; this is call {call}"
            )
            return None, self._first(drift)
        entry = self.entries[call - 1]
        found = compare(entry.request, request)
        return entry, self._first(found.model_copy(update={"call": call})) if found else None

    def _first(self, drift: ModelDrift) -> ModelDrift:
        with self._lock:
            if self.drift is None:
                self.drift = drift
        return drift


def compare(recorded: Any, sent: Any) -> ModelDrift | None:
    """The first difference between two requests' conversations, or None (see the module docstring)."""
    if not isinstance(recorded, dict) or not isinstance(sent, dict):
        return None if recorded == sent else ModelDrift(call=0, field="body", diff=_diff(recorded, sent))
    for field in CONVERSATION:
        old, new = recorded.get(field), sent.get(field)
        if old == new:
            continue
        if isinstance(old, list) and isinstance(new, list):
            index = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
            before = old[index] if index < len(old) else None
            after = new[index] if index < len(new) else None
            return ModelDrift(call=0, field=field, message=index, diff=_diff(before, after))
        return ModelDrift(call=0, field=field, diff=_diff(old, new))
    return None


def _diff(recorded: Any, sent: Any) -> str:
    def lines(value: Any) -> list[str]:
        return [] if value is None else json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False).splitlines()

    found = list(difflib.unified_diff(lines(recorded), lines(sent), "recorded", "sent", n=1, lineterm=""))
    if len(found) > DIFF_LINES:
        found = [*found[:DIFF_LINES], f"... ({len(found) - DIFF_LINES} more lines)"]
    return "\n".join(line[:300] for line in found)


def request_json(body: bytes) -> Any:
    """A request body as the tape keeps it: its JSON, or its text when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")
