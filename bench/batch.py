"""``batch``: 100 replay-only items at 2, 4 and 8 workers against ``xargs -P W docker run --rm``, same hardening,
output kept; and the batch under runsc against runc at 4 workers.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import (
    HARDENING,
    TRAJECTORY,
    WORKSPACE,
    cli_batch,
    median,
    pvisor_command,
    scaled,
    spread,
    write_manifest,
)


def batch(work: Path, tag: str, entrypoint: str) -> dict[str, Any]:
    items = scaled(100, 8)
    rows: dict[str, Any] = {}
    manifest = write_manifest(work / "batch.jsonl", items, "i")
    loop = work / "loop.sh"
    loop.write_text(_shell_loop(tag, entrypoint))
    loop.chmod(0o755)
    pairs = scaled(3, 1)
    for workers in (2, 4, 8):
        ours: list[float] = []
        theirs: list[float] = []
        for n in range(pairs):  # interleaved, each pair in the other order than the last
            for first in (True, False) if n % 2 == 0 else (False, True):
                if first:
                    ours.append(cli_batch(manifest, work / f"batch-{workers}-{n}", workers))
                else:
                    theirs.append(_xargs(loop, work / f"loop-{workers}-{n}", items, workers))
        ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
        rows[f"W={workers}"] = {
            "pvisor-host_per_minute": round(items / median(ours) * 60, 1),
            "shell_loop_per_minute": round(items / median(theirs) * 60, 1),
            "ratio": round(median(ratios), 3),
            "spread": spread(ratios),
        }
    runc = cli_batch(manifest, work / "batch-runc", 4)
    runsc = cli_batch(manifest, work / "batch-runsc", 4, "--runtime", "runsc")
    return {
        "items": items,
        "throughput": rows,
        "runsc_vs_runc_at_W=4": round(runsc / runc, 3),
        "target": "at least 1.0x the shell loop at every worker count",
    }


def _shell_loop(tag: str, entrypoint: str) -> str:
    hardening = " ".join(f"'{flag}'" for flag in HARDENING)
    command = " ".join(f"'{part}'" for part in pvisor_command(entrypoint, "RUNID", after_step=0))
    command = command.replace("'--after-step' '0'", "'--after-step' \"$step\"").replace("'RUNID'", '"$id"')
    return f"""#!/bin/sh
# one item: $1 = n, $2 = the loop's directory (output kept under it)
n=$1; dir=$2; id=item$n; step=$(( n % 4 + 1 )); base=$dir/$id
mkdir -p "$base/in" "$base/run" && cp {TRAJECTORY} "$base/in/t.jsonl" && cp -r {WORKSPACE} "$base/workspace"
chown 65532:65532 "$base/run" "$base/workspace" 2>/dev/null
exec docker run --rm {hardening} -v "$base/in:/in:ro" -v "$base/workspace:/workspace" -v "$base/run:/run" \\
    '{tag}' {command} > "$base/stdout.log" 2> "$base/stderr.log"
"""


def _xargs(loop: Path, out: Path, items: int, workers: int) -> float:
    out.mkdir()
    numbers = "\n".join(str(n) for n in range(items))
    started = time.monotonic()
    subprocess.run(
        ["xargs", "-P", str(workers), "-I{}", str(loop), "{}", str(out)],
        input=numbers,
        text=True,
        capture_output=True,
        check=True,
    )
    return time.monotonic() - started
