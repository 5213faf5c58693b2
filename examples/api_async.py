"""The same as ``api_resume.py`` with asyncio: ``async for`` over a batch never blocks the event loop.

python examples/api_async.py OUT_DIR
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

import pvisor_host

HERE = Path(__file__).resolve().parent
ITEMS = [
    {"id": f"item{n}", "trajectory": HERE / "claude-code-demo.jsonl", "after_step": 1 + n % 4, "timeout": 600}
    for n in range(6)
]
DEFAULTS = {"agent": "claude-code", "mode": "replay-only"}


async def first_three(out: Path) -> list[str]:
    """Run until three items have finished, then leave (``aclosing`` stops the batch right there)."""
    finished: list[str] = []
    async with contextlib.aclosing(pvisor_host.abatch(ITEMS, out=out, workers=2, defaults=DEFAULTS)) as results:
        async for result in results:
            if result.status == "ok":
                finished.append(result.id)
            if len(finished) == 3:
                break
    return finished


async def the_rest(out: Path) -> list[pvisor_host.ItemResult]:
    """Run the batch again: what finished before is skipped, the rest runs."""
    return [result async for result in pvisor_host.abatch(ITEMS, out=out, workers=2, defaults=DEFAULTS)]


async def main(out: Path) -> int:
    ticks = 0

    async def tick() -> None:  # keeps running while the batches do: the loop is never blocked
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = time.monotonic()
    finished = await first_three(out)
    results = await the_rest(out)
    free = (time.monotonic() - started) / 0.05  # the ticks a loop nobody blocks would have made meanwhile
    ticker.cancel()
    ran = [r.id for r in results if not r.skipped]
    print(f"finished before leaving: {', '.join(finished)}; then ran {', '.join(ran)}; {ticks} ticks meanwhile "
          f"(of {free:.0f} a free loop makes)")  # fmt: skip
    all_ok = len(results) == 6 and all(r.status == "ok" for r in results)
    return 0 if all_ok and not set(ran) & set(finished) and ticks >= free / 4 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]))))
