"""``report.html``: a batch's results as one self-contained page (charts, a filterable item table, the
observation diffs, and the tool calls that diverge most often across items).

The page's module (its template and the gathering) loads when a report is written, not with the batch or the
library that will write one at the end: :mod:`.page`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from ..fanout.compare import Comparison
    from ..models.batch import ItemResult

__all__ = ["write_report"]


def write_report(out: Path, results: list[ItemResult] | None = None, *, comparison: Comparison | None = None) -> Path:
    """See :func:`.page.write_report`."""
    from .page import write_report as write

    return write(out, results, comparison=comparison)
