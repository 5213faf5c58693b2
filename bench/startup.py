"""``startup``: ``pvisor-host --help`` and ``replay --help`` against ``python -c "import typer"``."""

from __future__ import annotations

import sys
from typing import Any

from bench.common import CLI, median, scaled, timed


def startup() -> dict[str, Any]:
    commands = {
        "--help": [CLI, "--help"],
        "replay --help": [CLI, "replay", "--help"],
        "import typer": [sys.executable, "-c", "import typer"],
    }
    walls: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(scaled(10, 3)):
        for name, command in commands.items():
            walls[name].append(timed(command))
    base = median(walls["import typer"])
    return {
        "median_seconds": {k: round(median(v), 3) for k, v in walls.items()},
        "ratio_vs_import_typer": {k: round(median(v) / base, 2) for k, v in walls.items() if k != "import typer"},
    }
