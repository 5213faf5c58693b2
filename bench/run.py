#!/usr/bin/env python3
"""``make bench``: pvisor-host side by side with what a user would otherwise write, on this machine, in one run.

Every figure is a ratio (or a rate) against a baseline measured in the same run, interleaved so that load
drifts hit both alike; medians, with the spread of the per-pair ratios. Sections (``--only`` picks some):

* ``single``  one ``replay --mode replay-only`` against a minimal docker-py script (create, start, wait, logs,
  archive, remove) and against ``docker run --rm`` plus copying the output out; the same replay under gVisor
  (``runsc``) against runc; where pvisor-host's time goes, phase by phase.
* ``batch``   100 replay-only items at 2, 4 and 8 workers against ``xargs -P W docker run --rm``, same
  hardening, output kept; and the batch under runsc against runc at 4 workers.
* ``scale``   per-item wall time and the controller's peak RSS for prepare-only batches of 100, 1,000 and
  5,000 items.
* ``plan``    the same for ``batch --plan --json`` over a 10,000-line manifest.
* ``cache``   ``build`` of an image that exists against a docker-py script that only looks the tag up.
* ``startup`` ``pvisor-host --help`` and ``replay --help`` against ``python -c "import typer"``.
* ``dataset`` a dataset of task images in a real registry (20 images, each with 100 MB of its own, 3 replay-only
  items each, the agent injected, W=4): pvisor-host (images pulled just in time, within a budget of four
  images) against a shell loop ``docker pull && docker run && docker rmi`` per item at the same width and
  hardening, and against pvisor-host pulling every image first (``--pull-workers 0``): throughput, the time to
  the first result, and the peak disk the batch's images took against the budget.
* ``swe``     the SWE-shaped dataset: 2 environment images of 200 MB, 12 task images on them with 20 MB of their
  own, every boundary of a 5-batch trajectory per task image, brought as a glob with an image template, no agent
  and ``--after-step all``: against the shell loop and every image first, as ``dataset``; then ``--plan`` of 2,000
  items (400 trajectories x 5 boundaries), its wall time and the host pvisor runs it took.
* ``collect`` the bytes an item writes with ``--collect changes`` and with ``full``: a task image with a 200 MB
  checkout, a replay that changes 3 files.
* ``report``  ``report.html`` of 2,000 and of 100,000 items (copies of a real batch's): the page's size, the
  memory and time to write it, and the time to its first rows in headless Chromium (median of 3).
* ``gateway`` the model gateway's added latency per call, against the stub model server called directly: 1 and
  32 concurrent streamed answers, time to the first byte and to the whole answer, p50 and p99; and the
  gateway process's peak RSS while 32 streams of 10 MB each pass through it. No engine needed.
* ``cluster`` ``batch --cluster`` on a real Ray cluster of node containers (``tests/cluster.py``): the same
  replay-only items against a local batch with as many workers as the cluster has slots, throughput at 3,
  2 and 1 nodes, and a node's memory (idle, and its peak while replaying). Not in the default run (it
  builds the node image once, about 80 s): ``--only cluster``. Then the same for a dataset of task images
  (``--inject``): pulls per image, wall against one engine, the driver's and Ray's CPU per item; that part
  alone: ``--only cluster-tasks``.

Writes ``bench-results.json`` and prints a compact table. ``BENCH_SCALE=0.1`` shrinks every count (a quick
look, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLI = str(BIN / "pvisor-host")
TRAJECTORY = ROOT / "examples" / "claude-code-demo.jsonl"  # four complete tool batches
WORKSPACE = ROOT / "examples" / "demo-workspace"
SCALE = float(os.environ.get("BENCH_SCALE", "1"))


def scaled(count: int, least: int = 2) -> int:
    return max(least, round(count * SCALE))


def timed(command: list[str], **kwargs: Any) -> float:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command[:4])} ... exited {done.returncode}: {done.stderr[-800:]}")
    return time.monotonic() - started


def peak_rss(command: list[str]) -> tuple[float, int]:
    """Wall seconds and the peak RSS (bytes) of the command's process (``/usr/bin/time``'s maximum RSS)."""
    with tempfile.NamedTemporaryFile("r") as report:
        started = time.monotonic()
        done = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", report.name, *command], capture_output=True, text=True
        )
        wall = time.monotonic() - started
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(command[:4])} ... exited {done.returncode}: {done.stderr[-800:]}")
        return wall, int(report.read().strip().splitlines()[-1]) * 1024


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def spread(ratios: list[float]) -> list[float]:
    return [round(min(ratios), 3), round(max(ratios), 3)] if ratios else []


def write_manifest(path: Path, count: int, prefix: str, *, steps: int = 4) -> Path:
    """A manifest of ``count`` items over the demo trajectory, boundaries cycling through 1..``steps``."""
    path.write_text(
        "".join(
            json.dumps({"id": f"{prefix}{n:03d}", "trajectory": str(TRAJECTORY), "after_step": 1 + n % steps}) + "\n"
            for n in range(count)
        )
    )
    return path


# -- the same hardened sandbox, written by hand ------------------------------------------------------------


def image() -> tuple[str, str]:
    """The claude-code image (built when missing) and its agent entrypoint."""
    import docker

    import pvisor_host

    ref = pvisor_host.build("claude-code")
    labels = docker.from_env().images.get(ref.id).labels
    return ref.ref, labels["pvisor-host.agent-entrypoint"]


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


def pvisor_command(entrypoint: str, run_id: str, after_step: int = 4) -> list[str]:
    return [
        "/opt/pvisor/bin/pvisor",
        "replay",
        "--agent",
        "claude-code",
        "--trajectory",
        "/in/t.jsonl",
        "--after-step",
        str(after_step),
        "--replay-only",
        "--workspace",
        "/workspace",
        "--state-dir",
        "/run/state",
        "--output-dir",
        "/run/output",
        "--run-id",
        run_id,
        "--agent-entrypoint",
        entrypoint,
    ]


HARDENING = [
    "--network",
    "none",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--read-only",
    "--tmpfs",
    "/tmp:rw,nosuid,nodev,size=1073741824,mode=1777",
    "--user",
    "65532:65532",
    "--init",
    "--memory",
    "4g",
    "--memory-swap",
    "4g",
    "--cpus",
    "2",
    "--pids-limit",
    "1024",
    "-e",
    "HOME=/tmp",
    "-e",
    "TMPDIR=/tmp",
    "-w",
    "/workspace",
]

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


# -- sections --------------------------------------------------------------------------------------------


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
                    ours.append(_cli_batch(manifest, work / f"batch-{workers}-{n}", workers))
                else:
                    theirs.append(_xargs(loop, work / f"loop-{workers}-{n}", items, workers))
        ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
        rows[f"W={workers}"] = {
            "pvisor-host_per_minute": round(items / median(ours) * 60, 1),
            "shell_loop_per_minute": round(items / median(theirs) * 60, 1),
            "ratio": round(median(ratios), 3),
            "spread": spread(ratios),
        }
    runc = _cli_batch(manifest, work / "batch-runc", 4)
    runsc = _cli_batch(manifest, work / "batch-runsc", 4, "--runtime", "runsc")
    return {
        "items": items,
        "throughput": rows,
        "runsc_vs_runc_at_W=4": round(runsc / runc, 3),
        "target": "at least 1.0x the shell loop at every worker count",
    }


def batch_command(manifest: Path, out: Path, mode: str, *extra: str) -> list[str]:
    """``pvisor-host batch`` over ``manifest`` for claude-code, into ``out``."""
    return [CLI, "batch", str(manifest), "--agent", "claude-code", "--mode", mode, "--out", str(out), *extra]


def _cli_batch(manifest: Path, out: Path, workers: int, *extra: str) -> float:
    return timed(batch_command(manifest, out, "replay-only", "--workers", str(workers), "--quiet", *extra))


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


def scale(work: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for count in (scaled(100), scaled(1000), scaled(5000)):
        manifest = write_manifest(work / f"scale-{count}.jsonl", count, "p", steps=1)
        out = work / f"scale-out-{count}"
        wall, rss = peak_rss(batch_command(manifest, out, "prepare-only", "--workers", "8", "--quiet"))
        rows[f"prepare-only x{count}"] = {
            "per_item_seconds": round(wall / count, 4),
            "peak_rss_mib": round(rss / 2**20, 1),
        }
    first, *_, last = [r["per_item_seconds"] for r in rows.values()]
    return {
        "rows": rows,
        "per_item_growth_100_to_5000": round(last / first, 3),
        "target": "per-item cost flat within 10% from 100 to 5,000 items; peak RSS under 150 MB",
    }


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


def table(results: dict[str, Any]) -> str:
    lines = [f"pvisor-host benchmark — {results['machine']['date']}, {results['machine']['cpus']} CPUs"]
    if "single" in results:
        s = results["single"]
        lines.append(f"single replay ({s['pairs']} interleaved runs each; medians, s): {s['median_seconds']}")
        for name, r in s["ratios"].items():
            lines.append(f"  pvisor-host {name}: {r['median']}x (spread {r['spread']})")
        lines.append(f"  pvisor-host phases: {s['phases_median_seconds']}")
    if "batch" in results:
        b = results["batch"]
        lines.append(f"batch of {b['items']} replay-only items (replays/min):")
        for workers, row in b["throughput"].items():
            lines.append(
                f"  {workers}: pvisor-host {row['pvisor-host_per_minute']}, shell loop "
                f"{row['shell_loop_per_minute']}, ratio {row['ratio']}x (spread {row['spread']})"
            )
        lines.append(f"  runsc/runc wall at W=4: {b['runsc_vs_runc_at_W=4']}x")
    if "scale" in results:
        for name, row in results["scale"]["rows"].items():
            lines.append(f"  {name}: {row['per_item_seconds']} s/item, peak RSS {row['peak_rss_mib']} MiB")
        lines.append(f"  per-item growth 100 → 5000: {results['scale']['per_item_growth_100_to_5000']}x")
    if "plan" in results:
        p = results["plan"]
        lines.append(
            f"batch --plan --json x{p['items']}: {p['per_item_seconds']} s/item, peak RSS {p['peak_rss_mib']} MiB"
        )
    if "cache" in results:
        c = results["cache"]
        lines.append(f"cached build vs a docker-py tag lookup: {c['ratio']['median']}x ({c['median_seconds']})")
    if "startup" in results:
        lines.append(f"start-up (s): {results['startup']['median_seconds']}")
    if "dataset" in results:
        d = results["dataset"]
        lines.append(
            f"dataset of {d['images']} task images x {d['items'] // d['images']} items (replays/min): "
            + ", ".join(f"{k} {v}" for k, v in d["per_minute"].items())
            + f"; {d['ratio_vs_shell_loop']}x the shell loop, {d['ratio_vs_pull_everything_first']}x pulling first"
        )
        lines.append(f"  first result (s): {d['first_result_seconds']}")
        lines.append(f"  peak of the batch's images {d['peak_image_bytes']} B within a budget of {d['budget_bytes']} B")
    if "swe" in results:
        w = results["swe"]
        lines.append(
            f"SWE-shaped dataset, {w['task_images']} task images on {w['environment_images']} environments, "
            f"{w['items']} items (replays/min): "
            + ", ".join(f"{k} {v}" for k, v in w["per_minute"].items())
            + f"; {w['ratio_vs_shell_loop']}x the shell loop, {w['ratio_vs_pull_everything_first']}x pulling first"
        )
        lines.append(f"  first result (s): {w['first_result_seconds']}")
        lines.append(f"  --plan: {w['plan']}")
    if "collect" in results:
        c = results["collect"]
        lines.append(
            f"collect, a {c['checkout_bytes'] // 2**20} MB checkout, 3 files changed: an item writes "
            f"{c['changes']['item_bytes']} B with changes, {c['full']['item_bytes']} B with full"
        )
    if "report" in results:
        for items, row in results["report"]["rows"].items():
            lines.append(f"report of {items} items: {row}")
    if "gateway" in results:
        g = results["gateway"]
        for row, added in g["added_latency"].items():
            lines.append(f"gateway, {row}: added ms {added}")
        lines.append(f"gateway, 32 streams of 10 MB: {g['big_streams']}")
    if "cluster" in results:
        c = results["cluster"]
        if "items" in c:  # not with --only cluster-tasks
            lines.append(
                f"cluster, {c['items']} replay-only items, {c['slots_per_node']} slots per node: wall against a "
                f"local batch at the same width {c['cluster_vs_local_wall']['median']}x; replays/min "
                + ", ".join(f"{k} {v['per_minute']}" for k, v in c["throughput"].items())
                + f"; node memory {c['node_memory_mib']}"
            )
        if "task_images" in c:
            lines.append(f"cluster task images: {c['task_images']}")
    return "\n".join(lines)


def cluster(work: Path, *, tasks_only: bool = False) -> dict[str, Any]:
    """See the module docstring; every batch here is replay-only (``tasks_only``: the task-image batch alone)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import docker

    from cluster import remove_engines

    client = docker.from_env(timeout=600)
    try:
        found = {} if tasks_only else _cluster(work, client)
        found["task_images"] = _cluster_tasks(work, client)
        return found
    finally:
        remove_engines(client)  # the nodes' engine volumes, kept between the clusters of this run


def _cluster_tasks(work: Path, client: Any) -> dict[str, Any]:
    """A dataset of task images on the cluster (``--inject``, ``--image-workspace``): pulls per image, wall
    against the same batch on one engine at the same width, and the driver's and Ray's CPU per item (every
    process of Ray's on this machine, the nodes' included, read from /proc: wall time here measures the one
    machine the nodes share, not the design)."""
    from cluster import Cluster, Registry

    count, per_image, slots = scaled(6, 3), 4, 2
    trajectory = work / "task.jsonl"
    trajectory.write_text(task_session())
    with Registry(client) as registry:
        refs = _task_images(client, registry.name, count, megabytes=scaled(20, 5))
        lines = [{"id": f"t{i:02d}-{n}", "trajectory": str(trajectory), "after_step": 1, "image": ref}
                 for i, ref in enumerate(refs) for n in range(per_image)]  # fmt: skip
        manifest = work / "tasks.jsonl"
        manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
        items = len(lines)
        options = ["--inject", "--image-workspace", "--workspace-path", "/app", "--json"]
        with Cluster(client, nodes=2, slots=slots, fresh=True, registry=registry.for_nodes) as running:
            env = {**os.environ, **running.env}
            warm = write_manifest(work / "tasks-warm.jsonl", 3 * slots, "w")  # the agent image to every node
            timed(batch_command(warm, work / "tasks-warm", "replay-only", "--quiet", "--cluster", running.address,
                                "--registry", registry.name), env=env)  # fmt: skip
            ray_before, driver_before = _ray_cpu(), _children_cpu()
            started = time.monotonic()
            done = subprocess.run(
                batch_command(manifest, work / "tasks-cluster", "replay-only", "--quiet", "--cluster",
                              running.address, "--registry", registry.name, *options),
                capture_output=True, text=True, env=env,
            )  # fmt: skip
            wall = time.monotonic() - started
            ray_cpu, driver_cpu = _ray_cpu() - ray_before, _children_cpu() - driver_before
            if done.returncode != 0:
                raise SystemExit(f"the cluster's task-image batch failed: {done.stderr[-800:]}")
            summary = json.loads(done.stdout)
        _forget(client, refs)
        local_before = _children_cpu()
        local = timed(batch_command(manifest, work / "tasks-local", "replay-only", "--quiet", "--workers",
                                    str(2 * slots), *options))  # fmt: skip
        local_cpu = _children_cpu() - local_before
        _forget(client, refs)
    return {
        "images": count,
        "items": items,
        "node_pulls_per_image": round((summary["images"]["node_pulls"] or 0) / count, 2),
        "cluster_vs_local_wall": round(wall / local, 3),
        "cpu_ms_per_item": {
            "driver": round(driver_cpu / items * 1000, 1),
            "ray": round(ray_cpu / items * 1000, 1),
            "both": round((driver_cpu + ray_cpu) / items * 1000, 1),
            "local_controller": round(local_cpu / items * 1000, 1),
            "beyond_local": round((driver_cpu + ray_cpu - local_cpu) / items * 1000, 1),
        },  # fmt: skip
        "target": "pulls per image <= 1.5; the driver's and Ray's CPU <= 50 ms per item",
    }


def _ray_cpu() -> float:
    """CPU seconds of every Ray process on this machine (the head's and the nodes' own), with their reaped
    children (workers that ended)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"ray" not in command or b"pvisor-host" in command.split(b"\0")[0]:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cluster(work: Path, client: Any) -> dict[str, Any]:
    from cluster import Cluster

    items, slots = scaled(24, 6), 2
    manifest = write_manifest(work / "cluster.jsonl", items, "c")
    rows: dict[str, Any] = {}
    with Cluster(client, nodes=3, slots=slots) as running:
        env = {**os.environ, **running.env}
        idle = {name: _memory(client, name) for name in running.nodes}
        warm = write_manifest(work / "warm.jsonl", 3 * slots, "w")  # ships the image to every node, untimed
        timed(batch_command(warm, work / "warm", "replay-only", "--quiet", "--cluster", running.address), env=env)
        pairs = []
        for n in range(max(1, scaled(3, 1))):
            ours = timed(
                batch_command(manifest, work / f"on-3-{n}", "replay-only", "--quiet", "--cluster", running.address),
                env=env,
            )
            local = _cli_batch(manifest, work / f"local-{n}", 3 * slots)
            pairs.append((ours, local))
        rows["3 nodes"] = {"per_minute": round(items / median([o for o, _ in pairs]) * 60, 1)}
        after = {name: _memory(client, name) for name in running.nodes}
        for nodes in (2, 1):
            running.remove_node(running.nodes[-1])
            time.sleep(8)  # Ray marks the removed node dead (tuned health check)
            wall = timed(
                batch_command(manifest, work / f"on-{nodes}", "replay-only", "--quiet", "--cluster", running.address),
                env=env,
            )
            rows[f"{nodes} nodes"] = {"per_minute": round(items / wall * 60, 1)}
    ratios = [ours / local for ours, local in pairs]
    return {
        "items": items,
        "slots_per_node": slots,
        "cluster_vs_local_wall": {"median": round(median(ratios), 3), "spread": spread(ratios)},
        "throughput": rows,
        "node_memory_mib": {
            "idle_rss": round(median([m[0] for m in idle.values()]), 1),
            "idle_cgroup": round(median([m[1] for m in idle.values()]), 1),
            "rss_after_replaying": round(max(m[0] for m in after.values()), 1),
            "cgroup_peak_incl_page_cache": round(max(m[2] for m in after.values()), 1),
        },
        "note": "every node is a container on this one machine: more nodes add no CPU",
    }


def dataset(work: Path) -> dict[str, Any]:
    """See the module docstring. The registry runs in a container of the test node image (built once)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import docker

    from cluster import Registry

    client = docker.from_env(timeout=600)
    count, per_image, workers = scaled(20, 4), 3, 4
    with Registry(client) as registry:
        refs = _task_images(client, registry.name, count, megabytes=scaled(100, 10))
        size = _pull_size(client, refs[0])
        budget = 4 * size
        manifest = work / "dataset.jsonl"
        trajectory = work / "task.jsonl"
        trajectory.write_text(task_session())
        lines = [{"id": f"d{i:02d}-{n}", "trajectory": str(trajectory), "after_step": 1, "image": ref}
                 for n in range(per_image) for i, ref in enumerate(refs)]  # fmt: skip
        manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
        items = len(lines)
        source = [str(manifest), "--agent", "claude-code", "--workspace-path", "/app"]
        jobs = [(ref, 1) for _ in range(per_image) for ref in refs]
        ways = _three_ways(client, work, source, refs, jobs, trajectory, workers=workers, budget=budget)
    images = ways.pop("summary")["images"]
    return {
        "images": count,
        "items": items,
        "image_bytes": size,
        "budget_bytes": budget,
        **ways,
        "peak_image_bytes": images["peak"],
        "peak_within_budget": images["peak"] <= budget,
        "targets": "at least 1.5x the shell loop; the first result within one pull plus one replay; peak <= budget",
    }


def _three_ways(
    client: Any,
    work: Path,
    source: list[str],
    refs: list[str],
    jobs: list[tuple[str, int]],
    trajectory: Path,
    *,
    workers: int,
    budget: int,
) -> dict[str, Any]:
    """A dataset of task images run by pvisor-host (within ``budget``), by pvisor-host pulling every image first,
    and by the shell loop (``jobs``: an image and a boundary each), every image removed between the runs: the
    throughputs, their ratios, and the time to the first result against one pull plus one replay."""
    # One run first: the injected runtime's volume is filled, and its sandbox's command is the loop's.
    warm = _dataset_batch(source, work / "warm", workers, f"--image-budget={budget}")
    template = _loop_template(work / "warm")
    _forget(client, refs)
    ours = _dataset_batch(source, work / "ours", workers, f"--image-budget={budget}")
    _forget(client, refs)
    first = _dataset_batch(source, work / "first", workers, "--pull-workers=0")
    _forget(client, refs)
    loop = _dataset_loop(work / "loop", template, jobs, workers, trajectory)
    _forget(client, refs)
    items = len(jobs)
    return {
        "per_minute": {
            "pvisor-host": round(items / ours["wall"] * 60, 1),
            "pull everything first": round(items / first["wall"] * 60, 1),
            "shell loop": round(items / loop["wall"] * 60, 1),
        },
        "ratio_vs_shell_loop": round(loop["wall"] / ours["wall"], 3),
        "ratio_vs_pull_everything_first": round(first["wall"] / ours["wall"], 3),
        "first_result_seconds": {
            "pvisor-host": ours["first"],
            "pull everything first": first["first"],
            "shell loop": loop["first"],
            "one pull plus one replay": round(warm["one_pull"] + warm["one_replay"], 1),
        },
        "summary": ours["summary"],
    }


def swe(work: Path) -> dict[str, Any]:
    """The SWE-shaped dataset: 2 environment images of 200 MB each, 12 task images on them with 20 MB of their
    own each (shared layers), every boundary of a 5-batch trajectory per task image; the input is a glob of
    ``<instance_id>.jsonl`` files with an image template, no agent and ``--after-step all``. Against the shell
    loop and pulling every image first, as ``dataset``; then ``--plan`` of 2,000 items (400 trajectories x 5
    boundaries) and the host pvisor runs it took."""
    sys.path.insert(0, str(ROOT / "tests"))
    import docker

    from cluster import Registry

    client = docker.from_env(timeout=600)
    envs, tasks, batches, workers = 2, scaled(12, 4), 5, 4
    trajs = work / "trajs"
    trajs.mkdir()
    session = swe_session(batches)
    with Registry(client) as registry:
        refs = _swe_images(client, registry.name, envs, tasks, env_mb=scaled(200, 20), own_mb=scaled(20, 2))
        instances = [f"bench__task-{n}" for n in range(tasks)]
        for instance in instances:
            (trajs / f"{instance}.jsonl").write_text(session)
        template = f"{registry.name}/swe/sweb.eval.x86_64.{{stem|swebench}}:latest"
        source = ["--trajectories", str(trajs / "*.jsonl"), "--after-step", "all", "--image", template]
        disk = sum(_pull_size(client, ref) for ref in refs[:1]) * 4
        jobs = [(ref, step) for ref in refs for step in range(1, batches + 1)]
        trajectory = trajs / f"{instances[0]}.jsonl"
        ways = _three_ways(client, work, source, refs, jobs, trajectory, workers=workers, budget=disk)
    ways.pop("summary")
    return {
        "environment_images": envs,
        "task_images": tasks,
        "items": tasks * batches,
        **ways,
        "plan": _swe_plan(work / "plan", session, batches),
        "targets": "at least 1.5x the shell loop; the first result within one pull plus one replay; --plan of 2,000"
        " items within 5 s with at most one host pvisor run per trajectory",
    }


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


def report(work: Path) -> dict[str, Any]:
    """The report of 100,000 items copied from a real batch of 6 (the test suite's way): the page's size, the
    memory and time to write it, and the time to its first rows in Chromium, against the 2,000-item page."""
    sys.path.insert(0, str(ROOT / "tests"))
    from browser import Browser, chromium_path
    from trajgen import linked_copy

    source = work / "source"
    manifest = write_manifest(work / "report.jsonl", 6, "r")
    done = subprocess.run(batch_command(manifest, source, "replay-only", "--quiet"), capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"the report's source batch failed: {done.stderr[-800:]}")
    chromium = chromium_path()
    rows: dict[str, Any] = {}
    for items in (2_000, scaled(100_000, 2_000)):
        big = linked_copy(source, work / f"copy-{items}", items)
        started = time.time()
        process = subprocess.Popen([CLI, "report", str(big)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(process.pid, 0)
        written = time.time() - started
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"report of {items} items failed")
        row: dict[str, Any] = {
            "page_bytes": (big / "report.html").stat().st_size,
            "write_seconds": round(written, 2),
            "write_peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        }
        if chromium is not None:
            renders = []
            for _ in range(3):
                with Browser(chromium, timeout=120) as browser:
                    opened = time.time()
                    page = browser.open((big / "report.html").as_uri())
                    page.wait_for("document.querySelectorAll('#items tr.item').length > 0")
                    renders.append(time.time() - opened)
            row["first_render_seconds"] = round(median(renders), 2)
        rows[str(items)] = row
    return {
        "rows": rows,
        "target": "100,000 items: a page of at most 10 MB, written in at most 300 MB, first rows within 3 s",
    }


def swe_session(batches: int) -> str:
    """A Claude Code session recorded as root in a SWE-style image: ``batches`` tool batches in /testbed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from trajgen import Call, Turn, claude_session

    turns = [Turn([Call("Bash", {"command": f"cat README && echo {n} >> progress.txt"}, "task\n")])
             for n in range(1, batches + 1)]  # fmt: skip
    events = claude_session("Fix the issue.", turns, cwd="/testbed")
    return "".join(json.dumps(event) + "\n" for event in events)


def _swe_images(client: Any, registry: str, envs: int, tasks: int, *, env_mb: int, own_mb: int) -> list[str]:
    """``envs`` environment images (``env_mb`` of their own) and ``tasks`` task images spread over them
    (``own_mb`` each, a README in /testbed), pushed to ``registry`` as SWE-bench names them; none left here."""
    import io

    base = client.images.get(image()[0]).labels["pvisor-host.base-image"]
    environments = []
    for n in range(envs):
        dockerfile = f"FROM {base}\nRUN head -c {env_mb * 2**20} /dev/urandom > /opt/env-{n}.bin\n"
        built, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True)
        environments.append(built.id)
    refs = []
    for n in range(tasks):
        dockerfile = (f"FROM {environments[n % envs]}\nRUN mkdir -p /testbed && echo 'task {n}' > /testbed/README "
                      f"&& head -c {own_mb * 2**20} /dev/urandom > /opt/task.bin\nWORKDIR /testbed\n")  # fmt: skip
        built, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True)
        ref = f"{registry}/swe/sweb.eval.x86_64.bench_1776_task-{n}:latest"
        repository, tag = ref.rsplit(":", 1)
        built.tag(repository, tag)
        for line in client.images.push(repository, tag, stream=True, decode=True):
            if "error" in line:
                raise SystemExit(f"push of {ref} failed: {line['error']}")
        refs.append(ref)
    _forget(client, refs)
    for environment in environments:
        with contextlib.suppress(Exception):  # still the parent of an image another section left: it stays
            client.images.remove(environment)
    return refs


def _swe_plan(work: Path, session: str, batches: int) -> dict[str, Any]:
    """``batch --plan`` of 400 trajectories at every boundary (2,000 items), no agent named."""
    files = scaled(400, 20)
    trajs = work / "trajs"
    trajs.mkdir(parents=True)
    for n in range(files):  # each file its own content: nothing is cached across files
        (trajs / f"bench__plan-{n}.jsonl").write_text(session.replace("Fix the issue.", f"Fix issue {n}."))
    command = [CLI, "batch", "--trajectories", str(trajs / "*.jsonl"), "--after-step", "all", "--mode", "replay-only",
               "--plan", "--json", "--out", str(work / "out")]  # fmt: skip
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"--plan failed ({done.returncode}): {done.stderr[-800:]}")
    runs = next((line for line in done.stderr.splitlines() if "host pvisor runs" in line), "")  # see batch --plan
    return {
        "trajectories": files,
        "items": len(json.loads(done.stdout)),
        "seconds": round(wall, 2),
        "preflight": runs.removeprefix("pvisor-host: pre-flight: "),
        "target": f"within 5 s for {files * batches} items, at most one host pvisor run per trajectory",
    }


def task_session() -> str:
    """A Claude Code session in a task image's /app: it reads the task, then stops (one tool batch)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from trajgen import Call, Turn, claude_session

    events = claude_session("Read the task.", [Turn([Call("Bash", {"command": "cat README"}, "task\n")])], cwd="/app")
    return "".join(json.dumps(event) + "\n" for event in events)


def _task_images(client: Any, registry: str, count: int, *, megabytes: int) -> list[str]:
    """``count`` images in ``registry``, each on the agent images' base with ``megabytes`` of its own (random,
    so that nothing is shared but the base), none left on the engine."""
    import io

    base = client.images.get(image()[0]).labels["pvisor-host.base-image"]
    refs = []
    for n in range(count):
        dockerfile = (f"FROM {base}\nRUN mkdir -p /app && echo 'task {n}' > /app/README "
                      f"&& head -c {megabytes * 2**20} /dev/urandom > /opt/task.bin\n")  # fmt: skip
        built, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True)
        ref = f"{registry}/bench/task{n:02d}:v1"
        repository, tag = ref.rsplit(":", 1)
        built.tag(repository, tag)
        for line in client.images.push(repository, tag, stream=True, decode=True):
            if "error" in line:
                raise SystemExit(f"push of {ref} failed: {line['error']}")
        refs.append(ref)
    _forget(client, refs)
    return refs


def _pull_size(client: Any, ref: str) -> int:
    client.images.pull(ref)
    size = int(client.images.get(ref).attrs["Size"])
    client.images.remove(ref)
    return size


def _forget(client: Any, refs: list[str]) -> None:
    import docker

    for ref in refs:
        try:
            client.images.remove(ref)
        except docker.errors.ImageNotFound:
            continue


def _dataset_batch(source: list[str], out: Path, workers: int, *extra: str) -> dict[str, Any]:
    """One replay-only batch of task images with the agent injected; ``source`` is its input and what names
    the agent and workspace, if anything does."""
    command = [CLI, "batch", *source, "--inject", "--image-workspace", "--mode", "replay-only", "--out", str(out),
               "--workers", str(workers), "--quiet", "--json", *extra]  # fmt: skip
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        failed = []
        with contextlib.suppress(ValueError):
            summary = json.loads(done.stdout)
            results = map(json.loads, (out / "results.jsonl").read_text().splitlines())
            failed = [(r["id"], r["status"], r.get("message")) for r in results if r["status"] != "ok"][:5]
            failed.insert(0, summary.get("counts"))
        raise SystemExit(f"the dataset batch failed ({done.returncode}): {failed} {done.stderr[-800:]}")
    records = [json.loads(p.read_text()) for p in out.glob("*/record.json")]
    finished = min(datetime.fromisoformat(r["finished_at"]).timestamp() for r in records)
    replays = sorted(r["timings"]["total"] for r in records)
    summary = json.loads(done.stdout)
    images = summary.get("images") or {}
    return {
        "wall": wall,
        "first": round(finished - started, 1),
        "summary": summary,
        "one_pull": (images.get("pull_seconds") or 0) / max(1, images.get("pulled") or 1),
        "one_replay": replays[len(replays) // 2],
    }


def _loop_template(out: Path) -> dict[str, Any]:
    """The sandbox a pvisor-host record describes: its command, the runtime volume the loop mounts too, and the
    profile it ran under (a task image runs as the image says: its user, a writable root; docs/security.md)."""
    record = json.loads(next(out.glob("*/record.json")).read_text())
    limits = record["limits"]
    return {
        "command": record["container"]["command"],
        "volume": record["image"]["runtime_volume"],
        "workspace": record["inputs"]["workspace_path"],
        "strict": limits.get("profile", "strict") == "strict",
    }


def _loop_flags(template: dict[str, Any]) -> str:
    """``docker run``'s flags for the loop: pvisor-host's limits, and its profile (strict: a non-root uid, a
    read-only root, HOME=/tmp; a task image: its own user, HOME and working directory, a writable root)."""
    flags = [flag for flag in HARDENING if flag not in ("/workspace", "-w")]
    if not template["strict"]:
        drop = {"--read-only", "--user", "65532:65532", "-e", "HOME=/tmp", "TMPDIR=/tmp"}
        flags = [flag for flag in flags if flag not in drop]
    else:
        flags += ["-w", template["workspace"]]
    return " ".join(f"'{flag}'" for flag in flags)


def _dataset_loop(
    out: Path, template: dict[str, Any], jobs: list[tuple[str, int]], workers: int, trajectory: Path
) -> dict[str, Any]:
    """``docker pull IMG && docker run ... && docker rmi IMG`` per item (an image and a boundary), ``xargs -P
    workers``; the same sandbox as pvisor-host's (its hardening and profile, the injected runtime, the image's
    workspace copied out)."""
    out.mkdir()
    workspace = template["workspace"]
    # pvisor itself, without pvisor-host's entry shim (which sends the output to files of pvisor-host's staging):
    # the loop takes it from `docker run`'s own streams, as a user's would
    parts = template["command"][template["command"].index("replay") - 1 :]
    step = parts.index("--after-step") + 1
    command = " ".join('"$step"' if n == step else f"'{part}'" for n, part in enumerate(parts))
    staged = Path(parts[parts.index("--trajectory") + 1]).name
    owner = 'chown -R 65532:65532 "$dir/run" "$dir/workspace" 2>/dev/null' if template["strict"] else ":"
    script = out / "item.sh"
    script.write_text(f"""#!/bin/sh
# one item: $1 = the image, $2 = the boundary, $3 = the item's directory
img=$1; step=$2; dir=$3; mkdir -p "$dir/input" "$dir/run"
cp {trajectory} "$dir/input/{staged}"
for try in 1 2 3; do  # another item of the image may remove it between this pull and this create
    docker pull -q "$img" >/dev/null || exit 1
    cid=$(docker create "$img" 2>/dev/null) && break
done
docker cp "$cid:{workspace}" "$dir/workspace" && docker rm "$cid" >/dev/null
{owner}
docker run --rm {_loop_flags(template)} -v "{template['volume']}:/pvisor-host/runtime:ro" \
    -v "$dir/input:/pvisor-host/input:ro" -v "$dir/workspace:{workspace}" -v "$dir/run:/pvisor-host/run" \
    "$img" {command} > "$dir/stdout.log" 2> "$dir/stderr.log"
code=$?
docker rmi "$img" >/dev/null 2>&1  # another item of the image may still run: then it stays for the last one
date +%s.%N > "$dir/done"
exit $code
""")  # fmt: skip
    script.chmod(0o755)
    lines = [f"{ref} {step} {out}/{ref.rsplit('/', 1)[-1].replace(':', '-')}-{n}"
             for n, (ref, step) in enumerate(jobs)]  # fmt: skip
    started = time.time()
    done = subprocess.run(["xargs", "-P", str(workers), "-L", "1", str(script)], input="\n".join(lines), text=True,
                          capture_output=True)  # fmt: skip
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"the shell loop failed: {done.stderr[-800:]}")
    failed = [p.parent.name for p in out.glob("*/stdout.log") if '"failure":null' not in p.read_text()]
    if failed:
        raise SystemExit(f"the shell loop's pvisor failed for {failed[:3]}")
    first = min(float(p.read_text()) for p in out.glob("*/done"))
    return {"wall": wall, "first": round(first - started, 1)}


GATEWAY = r"""
import json, sys, time
from pathlib import Path
from pvisor_host.backend.docker.gateway import Gateway
from pvisor_host.models.spec import ModelUpstream
base_url, streams, work = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
config = ModelUpstream(base_url=base_url, model="stub-model", api_key_env="X", network="unix")
with Gateway(config, "bench-key") as gateway:
    tokens = [gateway.access(f"bench-{n}", work / f"j{n}.jsonl").api_key for n in range(streams)]
    print(json.dumps({"socket": gateway.address, "tokens": tokens}), flush=True)
    sys.stdin.readline()
status = Path("/proc/self/status").read_text()
print(json.dumps({"peak_rss": int(status.split("VmHWM:")[1].split()[0]) * 1024}), flush=True)
"""


def gateway(work: Path) -> dict[str, Any]:
    """See the module docstring: the gateway in a process of its own, as in a batch, the stub in another."""
    rounds = scaled(200, 20)
    rows: dict[str, Any] = {}
    with _stub(0) as small, _gateway_process(small, 32, work / "small") as (path, tokens):
        for streams in (1, 32):
            direct = _timed_streams(lambda n: _tcp(small), streams, rounds)
            through = _timed_streams(lambda n: _unix(path, tokens[n]), streams, rounds)
            rows[f"{streams} stream{'s' if streams > 1 else ''}"] = {
                f"{what}_{q}_ms_added": round((through[what][q] - direct[what][q]) * 1000, 2)
                for what in ("first_byte", "whole") for q in ("p50", "p99")
            } | {"direct_whole_p50_ms": round(direct["whole"]["p50"] * 1000, 2)}  # fmt: skip
    with _stub(10 * 2**20) as big:
        with _gateway_process(big, 32, work / "big") as (path, tokens):
            started = time.monotonic()
            _timed_streams(lambda n: _unix(path, tokens[n]), 32, 32)
            seconds = time.monotonic() - started
        peak = _gateway_process.peak
    return {
        "calls_per_row": rounds,
        "added_latency": rows,
        "big_streams": {
            "streams": 32,
            "bytes_each": 10 * 2**20,
            "seconds": round(seconds, 2),
            "gateway_peak_rss_mib": round(peak / 2**20, 1),
        },  # fmt: skip
        "targets": "p50 added <= 2 ms, p99 added <= 10 ms; peak RSS < 150 MB with 32 streams of 10 MB",
    }


class _stub:
    """The stub model server in a process of its own, on a free port."""

    def __init__(self, stream_bytes: int) -> None:
        self.stream_bytes = stream_bytes

    def __enter__(self) -> str:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "modelserver.py"), "--port", str(port), "--stream-bytes",
             str(self.stream_bytes)], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "serving on ..."
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait()


class _gateway_process:
    """A gateway in front of ``address`` in a process of its own (as in a batch); its peak RSS when it ends."""

    peak = 0

    def __init__(self, address: str, streams: int, work: Path) -> None:
        self.address, self.streams, self.work = address, streams, work

    def __enter__(self) -> tuple[str, list[str]]:
        self.work.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-c", GATEWAY, f"http://{self.address}/v1", str(self.streams), str(self.work)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        ready = json.loads(self.process.stdout.readline())
        return ready["socket"], ready["tokens"]

    def __exit__(self, *exc: object) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        _gateway_process.peak = json.loads(self.process.stdout.readline())["peak_rss"]
        self.process.wait()


def _tcp(address: str) -> Any:
    import http.client

    host, port = address.split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60), "stub"


def _unix(path: str, token: str) -> Any:
    import http.client
    import socket

    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)

    return Unix("gateway", timeout=60), token


def _timed_streams(connect: Callable[[int], Any], streams: int, calls: int) -> dict[str, dict[str, float]]:
    """``calls`` streamed chat answers over ``streams`` kept-alive connections at once: the seconds to each
    answer's first byte and to its end, p50 and p99."""
    import threading

    body = json.dumps({"model": "stub-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    first: list[float] = []
    whole: list[float] = []
    lock = threading.Lock()

    def worker(n: int, count: int) -> None:
        connection, token = connect(n)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        for _ in range(count):
            started = time.perf_counter()
            connection.request("POST", "/v1/chat/completions", body, headers)
            answer = connection.getresponse()
            answer.read(1)
            at_first = time.perf_counter()
            while answer.read(65536):
                pass
            done = time.perf_counter()
            with lock:
                first.append(at_first - started)
                whole.append(done - started)
        connection.close()

    threads = [threading.Thread(target=worker, args=(n, calls // streams)) for n in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def quantiles(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}

    return {"first_byte": quantiles(first), "whole": quantiles(whole)}


def _memory(client: Any, name: str) -> tuple[float, float, float]:
    """A container's memory (MiB) from the engine's stats: its RSS now, its cgroup usage now, and the cgroup's
    peak (cgroup v1 keeps it; it counts the page cache too, so a ``docker load`` of the image shows there)."""
    stats = client.containers.get(name).stats(stream=False)["memory_stats"]
    rss = stats.get("stats", {}).get("total_rss", stats.get("stats", {}).get("anon", 0))
    return rss / 2**20, stats.get("usage", 0) / 2**20, stats.get("max_usage", stats.get("usage", 0)) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="single,batch,scale,plan,cache,startup,dataset,swe,collect,report,gateway")
    parser.add_argument("--results", default=str(ROOT / "bench-results.json"))
    args = parser.parse_args()
    sections = args.only.split(",")
    results: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as scratch:
        work = Path(scratch)
        engine = {"single", "batch", "scale", "plan", "cache", "dataset", "swe", "cluster", "cluster-tasks"} & set(
            sections
        )
        tag, entrypoint = image() if engine else ("", "")
        if "startup" in sections:
            results["startup"] = startup()
        if "cache" in sections:
            results["cache"] = cache(tag)
        for name in ("single", "batch", "scale", "plan"):
            (work / name).mkdir()
        if "single" in sections:
            results["single"] = single(work / "single", tag, entrypoint)
        if "batch" in sections:
            results["batch"] = batch(work / "batch", tag, entrypoint)
        if "scale" in sections:
            results["scale"] = scale(work / "scale")
        if "plan" in sections:
            results["plan"] = plan(work / "plan")
        Path(args.results).write_text(json.dumps(results, indent=2) + "\n")  # what is measured so far, kept
        if "dataset" in sections:
            (work / "dataset").mkdir()
            results["dataset"] = dataset(work / "dataset")
        if "swe" in sections:
            (work / "swe").mkdir()
            results["swe"] = swe(work / "swe")
        if "collect" in sections:
            (work / "collect").mkdir()
            results["collect"] = collect(work / "collect")
        if "report" in sections:
            (work / "report").mkdir()
            results["report"] = report(work / "report")
        if "gateway" in sections:
            (work / "gateway").mkdir()
            results["gateway"] = gateway(work / "gateway")
        if "cluster" in sections or "cluster-tasks" in sections:
            (work / "cluster").mkdir()
            results["cluster"] = cluster(work / "cluster", tasks_only="cluster" not in sections)
    results["controller_peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    Path(args.results).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"\nwritten: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
