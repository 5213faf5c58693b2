"""Tool observations read back from native trajectories, and a compact diff of two of them.

pvisor's ``observation-comparison.json`` says only whether each replayed call's fresh observation equals
the recorded one. To show *how* it differs, the report reads the recorded observation from the original
trajectory and the fresh one from pvisor's ``reconstructed_native_trajectory`` (the same native format,
with the fresh observations in place). Both are found by call id, in whichever shape the agent writes:

* Claude Code: a ``tool_result`` content block (``tool_use_id``, ``content`` as text or text blocks);
* Codex and the Responses-style agents: a ``function_call_output`` item (``call_id``, ``output``, which may
  itself be a JSON object with an ``output`` field);
* any other JSON object with a ``tool_call_id`` and a ``content`` (the chat-completions shape).

A call found in neither shape simply has no diff; nothing here raises on a malformed trajectory.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: A trajectory larger than this is not read for observations (the report stays quick on huge sessions).
MAX_TRAJECTORY_BYTES = 64 * 1024 * 1024
#: Only the first this many lines of two observations are diffed (difflib slows down on long inputs).
MAX_DIFF_LINES = 2000


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


def compact_diff(recorded: str, fresh: str, *, max_lines: int = 14, max_line: int = 160) -> str:
    """A unified diff of two observations without file headers, one line of context, at most ``max_lines``
    lines of at most ``max_line`` characters; a cut is marked with ``…``."""
    if recorded == fresh:
        return ""
    before, after = recorded.splitlines() or [""], fresh.splitlines() or [""]
    cut = len(before) > MAX_DIFF_LINES or len(after) > MAX_DIFF_LINES
    lines = list(difflib.unified_diff(before[:MAX_DIFF_LINES], after[:MAX_DIFF_LINES], lineterm="", n=1))[2:]
    shown = [line if len(line) <= max_line else line[: max_line - 1] + "…" for line in lines[:max_lines]]
    if len(lines) > max_lines:
        shown.append(f"… {len(lines) - max_lines} more diff lines")
    if not shown:  # the same lines: different line endings, or a difference past what was compared
        shown = [f"(the first {MAX_DIFF_LINES} lines are the same)" if cut else "(they differ only in line endings)"]
    elif cut:
        shown.append(f"… (compared the first {MAX_DIFF_LINES} lines)")
    return "\n".join(shown)
