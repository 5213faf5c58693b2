"""``cluster``: ``batch --cluster`` on a real Ray cluster of node containers (``tests/cluster.py``): the same
replay-only items against a local batch with as many workers as the cluster has slots, throughput at 3, 2 and 1
nodes, and a node's memory (idle, and its peak while replaying). Not in the default run (it builds the node image
once, about 80 s): ``--only cluster``. Then the same for a dataset of task images (``--inject``): pulls per image,
wall against one engine, the driver's and Ray's CPU per item (cold; on warm nodes, at the margin and over a batch
four times as long; Ray's CPU while idle); that part alone: ``--only cluster-tasks``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    batch_command,
    cli_batch,
    forget,
    median,
    scaled,
    spread,
    task_images,
    task_session,
    timed,
    write_manifest,
)


def cluster(work: Path, *, tasks_only: bool = False) -> dict[str, Any]:
    """See the module docstring; every batch here is replay-only (``tasks_only``: the task-image batch alone)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import docker

    client = docker.from_env(timeout=600)
    found = {} if tasks_only else _cluster(work, client)
    found["task_images"] = _cluster_tasks(work, client)
    return found


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
        refs = task_images(client, registry.name, count, megabytes=scaled(20, 5))
        lines = [{"id": f"t{i:02d}-{n}", "trajectory": str(trajectory), "after_step": 1, "image": ref}
                 for i, ref in enumerate(refs) for n in range(per_image)]  # fmt: skip
        manifest = work / "tasks.jsonl"
        manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
        items = len(lines)
        options = ["--inject", "--image-workspace", "--workspace-path", "/app", "--json"]
        with Cluster(client, nodes=2, slots=slots, registry=registry.for_nodes) as running:
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
            # The same on warm nodes (the images stay in their caches), once with every item and once with one:
            # the difference is what an item costs beyond the batch's fixed start (imports, ray.init, pre-flight).
            one = work / "tasks-one.jsonl"
            one.write_text(manifest.read_text().splitlines(keepends=True)[0])
            warm_cpu, warm_wall = {}, {}
            for name, path in (("all", manifest), ("one", one)):
                ray_before, driver_before = _ray_cpu(), _children_cpu()
                warm_wall[name] = timed(
                    batch_command(path, work / f"tasks-warm-{name}", "replay-only", "--quiet", "--cluster",
                                  running.address, "--registry", registry.name, *options), env=env,
                )  # fmt: skip
                warm_cpu[name] = (_children_cpu() - driver_before, _ray_cpu() - ray_before)
            # A batch four times as long on the same warm nodes: what an item costs on average once the batch's
            # fixed start is spread over a dataset's worth of items.
            longer = work / "tasks-long.jsonl"
            longer.write_text("".join(
                json.dumps({**line, "id": f"{line['id']}-{n}"}) + "\n" for n in range(LONGER) for line in lines
            ))  # fmt: skip
            ray_before, driver_before = _ray_cpu(), _children_cpu()
            timed(batch_command(longer, work / "tasks-long", "replay-only", "--quiet", "--cluster", running.address,
                                "--registry", registry.name, *options), env=env)  # fmt: skip
            long_cpu = (_children_cpu() - driver_before, _ray_cpu() - ray_before)
            # Ray's CPU with no batch at all: the cluster's own heartbeat, which every second of a batch pays too.
            ray_before = _ray_cpu()
            time.sleep(IDLE_SAMPLE)
            idle_rate = (_ray_cpu() - ray_before) / IDLE_SAMPLE
        forget(client, refs)
        local_before = _children_cpu()
        local = timed(batch_command(manifest, work / "tasks-local", "replay-only", "--quiet", "--workers",
                                    str(2 * slots), *options))  # fmt: skip
        local_cpu = _children_cpu() - local_before
        forget(client, refs)
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
        "warm_cpu_ms_per_item_beyond_the_first": {
            side: round((warm_cpu["all"][n] - warm_cpu["one"][n]) / (items - 1) * 1000, 1)
            for n, side in enumerate(("driver", "ray"))
        },
        f"warm_cpu_ms_per_item_of_{LONGER * items}_items": {
            "driver": round(long_cpu[0] / (LONGER * items) * 1000, 1),
            "ray": round(long_cpu[1] / (LONGER * items) * 1000, 1),
            "both": round(sum(long_cpu) / (LONGER * items) * 1000, 1),
        },
        "ray_idle_cpu_ms_per_s": round(idle_rate * 1000, 1),
        "warm_ray_idle_share_ms_per_item": round(
            idle_rate * (warm_wall["all"] - warm_wall["one"]) / (items - 1) * 1000, 1
        ),
        "warm_cpu_s_of_one_item_batch": {"driver": round(warm_cpu["one"][0], 2), "ray": round(warm_cpu["one"][1], 2)},
        "target": "pulls per image <= 1.5; the driver's and Ray's CPU <= 50 ms per item",
    }


#: The longer warm batch repeats the dataset's items this many times.
LONGER = 4
IDLE_SAMPLE = 20.0
"""Seconds of an idle cluster sampled for Ray's own CPU."""


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
            local = cli_batch(manifest, work / f"local-{n}", 3 * slots)
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


def _memory(client: Any, name: str) -> tuple[float, float, float]:
    """A container's memory (MiB) from the engine's stats: its RSS now, its cgroup usage now, and the cgroup's
    peak (cgroup v1 keeps it; it counts the page cache too, so a ``docker load`` of the image shows there)."""
    stats = client.containers.get(name).stats(stream=False)["memory_stats"]
    rss = stats.get("stats", {}).get("total_rss", stats.get("stats", {}).get("anon", 0))
    return rss / 2**20, stats.get("usage", 0) / 2**20, stats.get("max_usage", stats.get("usage", 0)) / 2**20
