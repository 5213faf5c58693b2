"""Stop a batch early by leaving the loop, then run it again: the second run does only what is left.

    python examples/api_resume.py OUT_DIR

Leaving the loop stops the batch: its running sandboxes are removed, the finished items keep their
records. The second run skips those and runs the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pvisor_host

HERE = Path(__file__).resolve().parent
SPECS = [
    pvisor_host.ReplaySpec(
        trajectory=HERE / "claude-code-demo.jsonl",
        after_step=1 + n % 4,
        agent="claude-code",
        mode="replay-only",
        timeout=600,
    )
    for n in range(6)
]


def first_three(out: Path) -> list[str]:
    """Run until three items have finished, then leave."""
    finished: list[str] = []
    with pvisor_host.batch(SPECS, out=out, workers=2) as run:
        for result in run:
            if result.status == "ok":
                finished.append(result.id)
            if len(finished) == 3:
                break
    return finished


def main(out: Path) -> int:
    finished = first_three(out)
    print("finished before leaving:", ", ".join(finished))
    again = pvisor_host.batch(SPECS, out=out, workers=2)
    ran = [result.id for result in again if not result.skipped]
    summary = again.summary
    assert summary is not None
    print(f"second run: {summary.skipped} skipped, ran {', '.join(ran)}")
    return 0 if summary.counts == {"ok": 6} and not set(ran) & set(finished) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
