"""Render :class:`~.gather.ReportData` into ``report.html``: one file, no network, data embedded as JSON."""

from __future__ import annotations

import html
import re
from importlib import resources
from pathlib import Path

from .._version import __version__
from ..fanout.compare import Comparison
from ..files.atomic import write_atomic
from ..models.batch import ItemResult
from .gather import gather
from .model import ReportData

REPORT_FILE = "report.html"


def render_page(data: ReportData) -> bytes:
    """The page for ``data``. The JSON is embedded in a ``<script type="application/json">``; every ``<``
    in it is escaped, so no string from a trajectory can close the element."""
    template = resources.files("pvisor_host.report").joinpath("page.html").read_text(encoding="utf-8")
    values = {
        "TITLE": html.escape(data.title),
        "VERSION": __version__,
        "DATA": data.page_json().replace("<", "\\u003c"),
    }
    return re.sub(r"__(TITLE|VERSION|DATA)__", lambda m: values[m.group(1)], template).encode()


def write_report(out: Path, results: list[ItemResult] | None = None, *, comparison: Comparison | None = None) -> Path:
    """Write ``out/report.html`` (atomically) for the batch directory ``out`` and return its path; with a
    ``comparison`` against a baseline, side by side."""
    path = out / REPORT_FILE
    write_atomic(path, render_page(gather(out, results, comparison=comparison)))
    return path
