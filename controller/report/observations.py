"""A compact diff of two tool observations (:mod:`pvisor_host.models.observations` reads them)."""

from __future__ import annotations

import difflib

#: Only the first this many lines of two observations are diffed (difflib slows down on long inputs).
MAX_DIFF_LINES = 2000


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
