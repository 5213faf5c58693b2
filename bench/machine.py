"""The machine the figures were measured on (``bench-results.json``'s ``machine``): date, CPUs, kernel, Python,
the engine's version, the load average and ``BENCH_SCALE``.
"""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from typing import Any

from bench.common import SCALE


def machine() -> dict[str, Any]:
    docker_version = subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "docker": docker_version,
        "load_average": os.getloadavg(),
        "scale": SCALE,
    }
