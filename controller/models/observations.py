"""Tool observations read back from native trajectories, and how a replayed call's fresh one matches the recorded.

pvisor's ``observation-comparison.json`` says only whether each replayed call's fresh observation equals the
recorded one (``exact``). A replay whose calls differ only in whitespace or line endings (a trailing newline a
recording lost, ``\r\n``) reproduced what matters, and is told apart from a real divergence here: the recorded
observation is read from the original trajectory and the fresh one from pvisor's
``reconstructed_native_trajectory`` (the same native format, with the fresh observations in place), each call
then classed ``exact``, ``whitespace`` or ``diverged`` (:class:`Observations`, in every record). Both are found by
call id, in whichever shape the agent writes:

* Claude Code: a ``tool_result`` content block (``tool_use_id``, ``content`` as text or text blocks);
* Codex and the Responses-style agents: a ``function_call_output`` item (``call_id``, ``output``, which may
  itself be a JSON object with an ``output`` field);
* any other JSON object with a ``tool_call_id`` and a ``content`` (the chat-completions shape).

A call found in neither shape stays ``diverged`` (nothing tells otherwise); nothing here raises on a malformed
trajectory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

if TYPE_CHECKING:  # a record holds its observations: it imports this module
    from .record import ReplayRecord

#: How a replayed call's fresh observation matches the recorded one.
Match = Literal["exact", "whitespace", "diverged"]


class ObservationCall(BaseModel):
    """One replayed call, as pvisor's observation comparison names it, and how its observation matched."""

    index: int
    """Its position among the replayed calls (0-based)."""
    call_id: str
    tool: str
    match: Match
    """``exact``; ``whitespace``: the two differ only in whitespace or line endings; ``diverged``: otherwise."""


class Observations(BaseModel):
    """How the replayed calls' fresh observations matched the recorded ones (see the module docstring)."""

    calls: list[ObservationCall] = []

    def count(self, match: Match) -> int:
        return sum(call.match == match for call in self.calls)

    @property
    def exact(self) -> int:
        return self.count("exact")

    @property
    def whitespace(self) -> int:
        return self.count("whitespace")

    @property
    def diverged(self) -> int:
        return self.count("diverged")

    def describe(self) -> str:
        """``3 of 3 exact``, ``2 of 3 exact, 1 differs only in whitespace``, ``1 of 3 exact, 2 diverged``."""
        line = f"{self.exact} of {len(self.calls)} exact"
        if self.whitespace:
            line += f", {self.whitespace} {'differs' if self.whitespace == 1 else 'differ'} only in whitespace"
        if self.diverged:
            line += f", {self.diverged} diverged"
        return line


def same_but_whitespace(recorded: str, fresh: str) -> bool:
    """Whether two observations differ in whitespace and line endings only."""
    return recorded.split() == fresh.split()


def match_observations(comparison: Any, recorded: Path, fresh: Path | None) -> Observations | None:
    """Each call of pvisor's observation comparison (its parsed JSON), classed: ``exact`` as pvisor says, and of the
    others those whose recorded (the trajectory at ``recorded``) and fresh (``fresh``, pvisor's reconstructed
    native trajectory) observations differ only in whitespace; None when there is no comparison."""
    if not isinstance(comparison, list):
        return None
    entries = [entry for entry in comparison if isinstance(entry, dict)]
    differing = {str(entry.get("call_id")) for entry in entries if entry.get("exact") is not True}
    fresh_text = read_observations(fresh, differing) if fresh is not None and differing else {}
    recorded_text = read_observations(recorded, set(fresh_text)) if fresh_text else {}
    calls = []
    for index, entry in enumerate(entries):
        call_id = str(entry.get("call_id"))
        match: Match = "exact"
        if entry.get("exact") is not True:
            before, after = recorded_text.get(call_id), fresh_text.get(call_id)
            whitespace = before is not None and after is not None and same_but_whitespace(before, after)
            match = "whitespace" if whitespace else "diverged"
        calls.append(ObservationCall(index=index, call_id=call_id, tool=str(entry.get("tool")), match=match))
    return Observations(calls=calls)


#: A trajectory larger than this is not read for observations (the report stays quick on huge sessions).
MAX_TRAJECTORY_BYTES = 64 * 1024 * 1024


def read_observations(path: Path, wanted: set[str]) -> dict[str, str]:
    """The observation text of each call id in ``wanted`` found in the JSONL file at ``path`` (first wins)."""
    found: dict[str, str] = {}
    needles = [call_id.encode() for call_id in wanted]
    try:
        if not wanted or path.stat().st_size > MAX_TRAJECTORY_BYTES:
            return found
        with path.open("rb") as handle:
            for raw in handle:
                if len(found) == len(wanted):
                    break
                if not any(needle in raw for needle in needles):
                    continue  # most lines answer no wanted call: skip parsing them
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                for call_id, text in _observations(event):
                    if call_id in wanted and call_id not in found:
                        found[call_id] = text
    except OSError:
        pass
    return found


def _observations(value: Any, depth: int = 0) -> Iterator[tuple[str, str]]:
    if depth > 8:
        return
    if isinstance(value, list):
        for item in value:
            yield from _observations(item, depth + 1)
        return
    if not isinstance(value, dict):
        return
    kind = value.get("type")
    if kind == "tool_result" and isinstance(value.get("tool_use_id"), str):
        yield value["tool_use_id"], _text(value.get("content"))
        return
    if kind in ("function_call_output", "custom_tool_call_output") and isinstance(value.get("call_id"), str):
        yield value["call_id"], _output(value.get("output"))
        return
    if isinstance(value.get("tool_call_id"), str) and "content" in value:
        yield value["tool_call_id"], _text(value.get("content"))
        return
    for child in value.values():
        if isinstance(child, dict | list):
            yield from _observations(child, depth + 1)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(block.get("text", "")) if isinstance(block, dict) else _text(block) for block in content)
    if content is None:
        return ""
    return json.dumps(content, sort_keys=True)


def _output(output: Any) -> str:
    if isinstance(output, str):
        try:
            decoded = json.loads(output)
        except ValueError:
            return output
        if isinstance(decoded, dict) and isinstance(decoded.get("output"), str):
            return str(decoded["output"])
        return output
    if isinstance(output, dict) and "output" in output:
        return _text(output["output"])
    return _text(output)


def observations_of(record: ReplayRecord, run_dir: Path, trajectory: Path) -> Observations | None:
    """How ``record``'s replayed calls' fresh observations (its artifacts under ``run_dir``) matched those recorded
    in ``trajectory`` (None: pvisor compared none)."""
    return match_observations(
        record.artifact_json(run_dir, "observation_comparison"),
        trajectory,
        record.artifact_path(run_dir, "reconstructed_native_trajectory"),
    )
