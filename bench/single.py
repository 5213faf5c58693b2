"""``single``: one ``replay --mode replay-only`` against a minimal docker-py script (create, start, wait, logs,
archive, remove) and against ``docker run --rm`` plus copying the output out; the same replay under gVisor
(``runsc``) against runc; where pvisor-host's time goes, phase by phase.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import CLI, HARDENING, TRAJECTORY, WORKSPACE, median, pvisor_command, scaled, spread, timed


def hand_staging(root: Path, name: str) -> dict[str, Path]:
    """What pvisor-host stages, done by hand: the trajectory, a fresh workspace copy, a run directory."""
    base = root / name
    (base / "input").mkdir(parents=True)
    shutil.copy(TRAJECTORY, base / "input" / "t.jsonl")
    shutil.copytree(WORKSPACE, base / "workspace")
    (base / "run").mkdir()
    if os.geteuid() == 0:  # as pvisor-host does: the sandbox user owns what it writes to
        for path in (base / "workspace", base / "run"):
            os.chown(path, 65532, 65532)
    return {"input": base / "input", "workspace": base / "workspace", "run": base / "run", "base": base}


DOCKER_PY = r"""
import io, sys, tarfile, docker
image, entrypoint, base, run_id = sys.argv[1:5]
client = docker.from_env()
container = client.containers.create(
    image, sys.argv[5:], user="65532:65532", network_mode="none", read_only=True, cap_drop=["ALL"],
    security_opt=["no-new-privileges"], tmpfs={"/tmp": "rw,nosuid,nodev,size=1073741824,mode=1777"},
    mem_limit=4 * 2**30, memswap_limit=4 * 2**30, nano_cpus=2_000_000_000, pids_limit=1024, init=True,
    environment={"HOME": "/tmp", "TMPDIR": "/tmp"}, working_dir="/workspace",
    volumes={f"{base}/input": {"bind": "/in", "mode": "ro"}, f"{base}/workspace": {"bind": "/workspace", "mode": "rw"},
             f"{base}/run": {"bind": "/run", "mode": "rw"}},
)
try:
    container.start()
    code = container.wait()["StatusCode"]
    open(f"{base}/stdout.log", "wb").write(container.logs(stdout=True, stderr=False))
    open(f"{base}/stderr.log", "wb").write(container.logs(stdout=False, stderr=True))
    chunks, _ = container.get_archive(f"/run/output/{run_id}")
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as archive:
        archive.extractall(f"{base}/collected", filter="data")
finally:
    container.remove(force=True)
sys.exit(0 if code == 0 else 1)
"""


def single(work: Path, tag: str, entrypoint: str) -> dict[str, Any]:
    pairs = scaled(10, 3)
    walls: dict[str, list[float]] = {"pvisor-host": [], "docker-py": [], "docker run": [], "pvisor-host runsc": []}
    phases: list[dict[str, float]] = []
    script = work / "docker_py_baseline.py"
    script.write_text(DOCKER_PY)
    for n in range(pairs):
        runs: list[tuple[str, Callable[[], float]]] = [
            ("pvisor-host", lambda n=n: _cli_replay(work / f"cli-{n}", phases)),
            ("docker-py", lambda n=n: _docker_py(work, script, tag, entrypoint, n)),
            ("docker run", lambda n=n: _docker_run(work, tag, entrypoint, n)),
            ("pvisor-host runsc", lambda n=n: _cli_replay(work / f"runsc-{n}", None, "--runtime", "runsc")),
        ]
        if n % 2:
            runs.reverse()  # interleaved both ways, so drifting load hits every variant alike
        for name, run in runs:
            walls[name].append(run())
    ratios = {
        "vs docker-py": [a / b for a, b in zip(walls["pvisor-host"], walls["docker-py"], strict=True)],
        "vs docker run": [a / b for a, b in zip(walls["pvisor-host"], walls["docker run"], strict=True)],
        "runsc vs runc": [a / b for a, b in zip(walls["pvisor-host runsc"], walls["pvisor-host"], strict=True)],
    }
    return {
        "pairs": pairs,
        "median_seconds": {k: round(median(v), 3) for k, v in walls.items()},
        "ratios": {k: {"median": round(median(v), 3), "spread": spread(v)} for k, v in ratios.items()},
        "phases_median_seconds": {k: round(median([p[k] for p in phases if k in p]), 3) for k in phases[0]},
        "target": "within 1.10x of the docker-py baseline",
    }


def _cli_replay(out: Path, phases: list[dict[str, float]] | None, *extra: str) -> float:
    command = [
        CLI,
        "replay",
        "--agent",
        "claude-code",
        "--trajectory",
        str(TRAJECTORY),
        "--after-step",
        "4",
        "--mode",
        "replay-only",
        "--workspace-dir",
        str(WORKSPACE),
        "--out",
        str(out),
        *extra,
    ]
    wall = timed(command)
    if phases is not None:
        phases.append(json.loads((out / "record.json").read_text())["timings"])
    return wall


def _docker_py(work: Path, script: Path, tag: str, entrypoint: str, n: int) -> float:
    staged = hand_staging(work, f"py-{n}")
    run_id = f"bench-py-{n}"
    return timed(
        [sys.executable, str(script), tag, entrypoint, str(staged["base"]), run_id, *pvisor_command(entrypoint, run_id)]
    )


def _docker_run(work: Path, tag: str, entrypoint: str, n: int) -> float:
    staged = hand_staging(work, f"run-{n}")
    run_id = f"bench-run-{n}"
    mounts = [
        "-v",
        f"{staged['input']}:/in:ro",
        "-v",
        f"{staged['workspace']}:/workspace",
        "-v",
        f"{staged['run']}:/run",
    ]
    started = time.monotonic()
    subprocess.run(
        ["docker", "run", "--rm", *HARDENING, *mounts, tag, *pvisor_command(entrypoint, run_id)],
        capture_output=True,
        check=True,
    )
    shutil.copytree(staged["run"] / "output" / run_id, staged["base"] / "collected")
    return time.monotonic() - started
