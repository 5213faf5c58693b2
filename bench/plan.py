"""``plan``: per-item wall time and the controller's peak RSS for ``batch --plan --json`` over a 10,000-line
manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import batch_command, peak_rss, scaled, write_manifest


def plan(work: Path) -> dict[str, Any]:
    plan_items = scaled(10_000)
    manifest = write_manifest(work / "plan.jsonl", plan_items, "q")
    wall, rss = peak_rss(batch_command(manifest, work / "plan-out", "replay-only", "--plan", "--json"))
    return {
        "items": plan_items,
        "per_item_seconds": round(wall / plan_items, 4),
        "peak_rss_mib": round(rss / 2**20, 1),
        "target": "peak RSS under 150 MB",
    }
