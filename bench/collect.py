"""``collect``: the bytes an item writes with ``--collect changes`` and with ``full``: a task image with a 200 MB
checkout, a replay that changes 3 files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import CLI, ROOT, image, scaled


def collect(work: Path) -> dict[str, Any]:
    """Bytes an item writes with ``--collect changes`` and with ``full``: a task image with a 200 MB checkout at
    /testbed, a replay that changes 3 files in it."""
    import io

    import docker

    client = docker.from_env(timeout=600)
    base = client.images.get(image()[0]).labels["pvisor-host.base-image"]
    megabytes = scaled(200, 20)
    blobs = f"for n in $(seq 1 200); do head -c {megabytes * 2**20 // 200} /dev/urandom > blob$n.bin; done"
    files = "printf 'a = 1\\n' > /testbed/app.py && printf 'b = 2\\n' > /testbed/lib.py"
    dockerfile = f"FROM {base}\nRUN mkdir -p /testbed/src && cd /testbed/src && {blobs} && {files}\nWORKDIR /testbed\n"
    built, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True)
    tag = "pvisor-host-bench/checkout:latest"
    built.tag("pvisor-host-bench/checkout", "latest")
    sys.path.insert(0, str(ROOT / "tests"))
    from trajgen import Call, Turn, claude_session

    edits = ["printf 'a = 10\\n' > app.py", "printf 'c = 3\\n' > new.py", "rm lib.py"]
    events = claude_session("Edit.", [Turn([Call("Bash", {"command": c}, "")]) for c in edits], cwd="/testbed")
    trajectory = work / "edits.jsonl"
    trajectory.write_text("".join(json.dumps(event) + "\n" for event in events))
    sizes: dict[str, Any] = {}
    try:
        for mode in ("changes", "full"):
            out = work / mode
            command = [CLI, "replay", "--image", tag, "--inject", "--image-workspace", "--trajectory", str(trajectory),
                       "--after-step", "3", "--mode", "replay-only", "--collect", mode, "--out", str(out)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"replay --collect {mode} failed: {done.stderr[-800:]}")
            record = json.loads((out / "record.json").read_text())
            sizes[mode] = {
                "item_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink()),
                "changes": record["workspace_changes"],
            }
    finally:
        client.images.remove(tag, force=True)
    return {
        "checkout_bytes": megabytes * 2**20,
        "changes": sizes["changes"],
        "full": sizes["full"],
        "ratio_full_to_changes": round(sizes["full"]["item_bytes"] / sizes["changes"]["item_bytes"], 1),
        "target": "an item's directory at most 1 MB under --collect changes, with the 3 changes and their patch",
    }
