"""``report``: ``report.html`` of 2,000 and of 100,000 items (copies of a real batch's): the page's size, the
memory and time to write it, and the time to its first rows in headless Chromium (median of 3). Then ``results`` of
the 100,000 items to Parquet against reading the same ``results.jsonl`` with pandas, interleaved (3 pairs): time
and peak RSS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import CLI, ROOT, batch_command, median, peak_rss, scaled, write_manifest


def report(work: Path) -> dict[str, Any]:
    """The report of 100,000 items copied from a real batch of 6 (the test suite's way): the page's size, the
    memory and time to write it, and the time to its first rows in Chromium, against the 2,000-item page."""
    sys.path.insert(0, str(ROOT / "tests"))
    from browser import Browser, chromium_path
    from trajgen import linked_copy

    source = work / "source"
    manifest = write_manifest(work / "report.jsonl", 6, "r")
    done = subprocess.run(batch_command(manifest, source, "replay-only", "--quiet"), capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"the report's source batch failed: {done.stderr[-800:]}")
    chromium = chromium_path()
    rows: dict[str, Any] = {}
    for items in (2_000, scaled(100_000, 2_000)):
        big = linked_copy(source, work / f"copy-{items}", items)
        started = time.time()
        process = subprocess.Popen([CLI, "report", str(big)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(process.pid, 0)
        written = time.time() - started
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"report of {items} items failed")
        row: dict[str, Any] = {
            "page_bytes": (big / "report.html").stat().st_size,
            "write_seconds": round(written, 2),
            "write_peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        }
        if chromium is not None:
            renders = []
            for _ in range(3):
                with Browser(chromium, timeout=120) as browser:
                    opened = time.time()
                    page = browser.open((big / "report.html").as_uri())
                    page.wait_for("document.querySelectorAll('#items tr.item').length > 0")
                    renders.append(time.time() - opened)
            row["first_render_seconds"] = round(median(renders), 2)
        rows[str(items)] = row
    return {
        "rows": rows,
        "target": "100,000 items: a page of at most 10 MB, written in at most 300 MB, first rows within 3 s",
        "results": _results(big, work),
    }


def _results(batch: Path, work: Path) -> dict[str, Any]:
    """``pvisor-host results DIR --format parquet`` against ``pd.read_json(results.jsonl, lines=True)``, pairs
    interleaved: each one's wall time and peak RSS, and the medians' ratios."""
    ours = [CLI, "results", str(batch), "--format", "parquet", "--output", str(work / "rows.parquet")]
    pandas = [sys.executable, "-c", f"import pandas as pd; pd.read_json({str(batch / 'results.jsonl')!r}, lines=True)"]
    times: dict[str, list[float]] = {"results": [], "pandas": []}
    peaks: dict[str, list[int]] = {"results": [], "pandas": []}
    for _ in range(3):
        for name, command in (("results", ours), ("pandas", pandas)):
            wall, peak = peak_rss(command)
            times[name].append(wall)
            peaks[name].append(peak)
    mine, theirs = median(times["results"]), median(times["pandas"])
    return {
        "items": sum(1 for _ in (batch / "results.jsonl").open()),
        "results_seconds": round(mine, 2),
        "pandas_seconds": round(theirs, 2),
        "time_ratio": round(mine / theirs, 2),
        "results_peak_rss_mib": round(max(peaks["results"]) / 2**20, 1),
        "pandas_peak_rss_mib": round(max(peaks["pandas"]) / 2**20, 1),
        "target": "at most 1.5x the time of reading results.jsonl with pandas, at most 500 MB",
    }
