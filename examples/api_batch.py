"""Six replays through the Python API, two of which are refused on purpose (a boundary past the trajectory's
end: pvisor's pre-flight on the host refuses them, and no sandbox starts for them).

    python examples/api_batch.py OUT_DIR

Each result is printed as it finishes; the exit status is 0 when exactly the two meant to fail did.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pvisor_host

HERE = Path(__file__).resolve().parent
TRAJECTORY = HERE / "claude-code-demo.jsonl"  # four complete tool batches


def items() -> list[dict[str, Any]]:
    """Four boundaries that exist, and two that do not."""
    return [{"id": f"step{n}", "trajectory": TRAJECTORY, "after_step": n} for n in (1, 2, 3, 4, 7, 9)]


def main(out: Path) -> int:
    defaults = {"agent": "claude-code", "mode": "replay-only", "workspace_dir": HERE / "demo-workspace"}
    with pvisor_host.batch(items(), out=out, workers=2, defaults=defaults) as run:
        for result in run:
            print(f"{result.id:6} {result.status:14} {result.category or ''}")
    summary = run.summary
    assert summary is not None
    print(f"{summary.ran} ran: {summary.counts}")
    return 0 if summary.counts == {"ok": 4, "rejected": 2} else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
