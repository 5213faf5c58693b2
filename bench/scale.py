"""``scale``: per-item wall time and the controller's peak RSS for prepare-only batches of 100, 1,000 and 5,000
items.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import batch_command, peak_rss, scaled, write_manifest


def scale(work: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for count in (scaled(100), scaled(1000), scaled(5000)):
        manifest = write_manifest(work / f"scale-{count}.jsonl", count, "p", steps=1)
        out = work / f"scale-out-{count}"
        wall, rss = peak_rss(batch_command(manifest, out, "prepare-only", "--workers", "8", "--quiet"))
        rows[f"prepare-only x{count}"] = {
            "per_item_seconds": round(wall / count, 4),
            "peak_rss_mib": round(rss / 2**20, 1),
        }
    first, *_, last = [r["per_item_seconds"] for r in rows.values()]
    return {
        "rows": rows,
        "per_item_growth_100_to_5000": round(last / first, 3),
        "target": "per-item cost flat within 10% from 100 to 5,000 items; peak RSS under 150 MB",
    }
