"""``cache``: ``build`` of an image that exists against a docker-py script that only looks the tag up."""

from __future__ import annotations

import sys
from typing import Any

from bench.common import CLI, median, scaled, spread, timed


def cache(tag: str) -> dict[str, Any]:
    lookup = f"import docker; docker.from_env().images.get({tag!r})"
    ours: list[float] = []
    theirs: list[float] = []
    for n in range(scaled(10, 3)):
        pair = [
            lambda: ours.append(timed([CLI, "build", "--agent", "claude-code"])),
            lambda: theirs.append(timed([sys.executable, "-c", lookup])),
        ]
        for run in pair if n % 2 == 0 else reversed(pair):
            run()
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {
        "median_seconds": {"build": round(median(ours), 3), "docker-py lookup": round(median(theirs), 3)},
        "ratio": {"median": round(median(ratios), 3), "spread": spread(ratios)},
        "target": "within 1.5x",
    }
