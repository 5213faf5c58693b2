"""``dataset`` and ``swe``: datasets of task images in a real registry.

* ``dataset`` 20 images, each with 100 MB of its own, 3 replay-only items each, the agent injected, W=4:
  pvisor-host (images pulled just in time, within a budget of four images) against a shell loop ``docker pull &&
  docker run && docker rmi`` per item at the same width and hardening, and against pvisor-host pulling every image
  first (``--pull-workers 0``): throughput, the time to the first result, and the peak disk the batch's images took
  against the budget.
* ``swe``     the SWE-shaped dataset: 2 environment images of 200 MB, 12 task images on them with 20 MB of their
  own, every boundary of a 5-batch trajectory per task image, brought as a glob with an image template, no agent
  and ``--after-step all``: against the shell loop and every image first, as ``dataset``; then ``--plan`` of 2,000
  items (400 trajectories x 5 boundaries), its wall time and the host pvisor runs it took.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import (
    CLI,
    HARDENING,
    ROOT,
    DiskSampler,
    build_and_push,
    forget,
    image,
    median,
    scaled,
    spread,
    task_images,
    task_session,
)


def dataset(work: Path) -> dict[str, Any]:
    """See the module docstring. The registry runs in a container of the test node image (built once)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import docker

    from cluster import Registry

    client = docker.from_env(timeout=600)
    count, per_image, workers = scaled(20, 4), 3, 4
    with Registry(client) as registry:
        refs = task_images(client, registry.name, count, megabytes=scaled(100, 10))
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
        ways = _three_ways(client, work, source, refs, jobs, trajectory, workers=workers, budget=budget,
                           replay_flags=("--agent", "claude-code", "--workspace-path", "/app"))  # fmt: skip
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


#: Interleaved pairs for the time to the first result (a few seconds each, so one sample is noise).
PAIRS = 3


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
    replay_flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A dataset of task images run by pvisor-host (within ``budget``), by pvisor-host pulling every image first,
    and by the shell loop (``jobs``: an image and a boundary each), every image removed between the runs: the
    throughputs, their ratios, and the time to the first result against one pull plus one replay."""
    # One run first: the injected runtime's volume is filled, and its sandbox's command is the loop's.
    warm = _dataset_batch(source, work / "warm", workers, f"--image-budget={budget}")
    template = _loop_template(work / "warm")
    forget(client, refs)
    with DiskSampler(client) as disk:
        ours = _dataset_batch(source, work / "ours", workers, f"--image-budget={budget}")
    forget(client, refs)
    first = _dataset_batch(source, work / "first", workers, "--pull-workers=0")
    forget(client, refs)
    loop = _dataset_loop(work / "loop", template, jobs, workers, trajectory)
    forget(client, refs)
    # The first result against one pull plus one replay: PAIRS interleaved pairs (the first batch's is the one
    # above), each image removed before each; the median and the per-pair ratios' spread.
    firsts, ones = [ours["first"]], []
    for n in range(PAIRS):
        ones.append(_one_pull_one_replay(client, work / f"one-{n}", jobs[0], trajectory, replay_flags))
        forget(client, refs)
        if n + 1 < PAIRS:
            firsts.append(_dataset_batch(source, work / f"ours-{n}", workers, f"--image-budget={budget}")["first"])
            forget(client, refs)
    one = median(ones)
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
            "pvisor-host": median(firsts),
            "pull everything first": first["first"],
            "shell loop": loop["first"],
            "one pull plus one replay": one,
            "pvisor-host against one pull plus one replay": {
                "median": round(median(firsts) / one, 3),
                "spread": spread([f / o for f, o in zip(firsts, ones, strict=True)]),
                "pairs": PAIRS,
            },
            "one pull plus one replay, inside the batch's records": round(warm["one_pull"] + warm["one_replay"], 1),
        },
        "disk": {
            "budget": budget,
            "accounted_peak": (ours["summary"].get("images") or {}).get("peak"),
            "real_peak_sampled": disk.peak,
            "accounted_vs_real": round(((ours["summary"].get("images") or {}).get("peak") or 0) / max(1, disk.peak), 3),
            "target": "accounted within 10% of the real peak; the real peak within the budget",
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
        refs.append(build_and_push(client, dockerfile, f"{registry}/swe/sweb.eval.x86_64.bench_1776_task-{n}:latest"))
    forget(client, refs)
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


def _pull_size(client: Any, ref: str) -> int:
    client.images.pull(ref)
    size = int(client.images.get(ref).attrs["Size"])
    client.images.remove(ref)
    return size


def _one_pull_one_replay(
    client: Any, out: Path, job: tuple[str, int], trajectory: Path, flags: tuple[str, ...]
) -> float:
    """Seconds for what a user would do for one item by hand: ``docker pull`` the image, then ``pvisor-host
    replay`` of the item in it (the same options as the batch's)."""
    ref, step = job
    started = time.time()
    client.images.pull(ref)
    command = [CLI, "replay", "--image", ref, "--inject", "--image-workspace", "--mode", "replay-only",
               "--trajectory", str(trajectory), "--after-step", str(step), "--out", str(out), *flags]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the one replay failed ({done.returncode}): {done.stderr[-800:]}")
    return round(time.time() - started, 1)


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
