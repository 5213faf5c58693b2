"""``report.html``: a batch's results as one self-contained page (charts, a filterable item table, the
observation diffs, and the tool calls that diverge most often across items)."""

from .page import REPORT_FILE, render_page, write_report

__all__ = ["REPORT_FILE", "render_page", "write_report"]
