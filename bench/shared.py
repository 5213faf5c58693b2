"""``shared``: two batches started side by side on one engine, against one batch of the same items.

12 task images of 100 MB of their own in a real registry, 2 replay-only items each (the agent injected); a budget of
three images. One batch of all 24 items at the default workers, then the same 24 items as two batches of 12 (six
images each) started together in the same second, each with the same ``--image-budget`` and the default workers,
every image removed between the runs; twice, interleaved. Reported: the wall time of the pair against the one
(both ends included); the image cache's accounted peak (its ledger's, each layer once) against the one budget, and
the disk the engine really used (sampled: pulls in flight hold their downloads too) by the pair against the one
batch; whether both finished with every item ok, and what either left (containers, networks and images of ours).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import CLI, ROOT, DiskSampler, forget, median, scaled, spread, task_images, task_session

#: Interleaved rounds (one batch, then the pair).
ROUNDS = 2


def shared(work: Path) -> dict[str, Any]:
    """See the module docstring."""
    sys.path.insert(0, str(ROOT / "tests"))
    import docker

    from cluster import Registry

    client = docker.from_env(timeout=600)
    count, per_image = scaled(12, 4), 2
    with Registry(client) as registry:
        refs = task_images(client, registry.name, count, megabytes=scaled(100, 10))
        client.images.pull(refs[0])
        size = int(client.images.get(refs[0]).attrs["Size"])
        forget(client, refs[:1])
        budget = 3 * size
        trajectory = work / "task.jsonl"
        trajectory.write_text(task_session())
        halves = [refs[: count // 2], refs[count // 2 :]]
        manifests = [_manifest(work / f"half-{n}.jsonl", half, trajectory, per_image) for n, half in enumerate(halves)]
        whole = _manifest(work / "whole.jsonl", refs, trajectory, per_image)
        _batches(work / "warm", [whole], budget)  # the injected runtime's volume filled once, outside the figures
        forget(client, refs)
        ones: list[float] = []
        pairs: list[float] = []
        peaks: dict[str, list[int]] = {"one": [], "pair": []}
        accounted: dict[str, list[int]] = {"one": [], "pair": []}
        summaries: list[dict[str, Any]] = []
        for n in range(ROUNDS):
            with DiskSampler(client) as disk:
                one, alone = _batches(work / f"one-{n}", [whole], budget)
            forget(client, refs)
            peaks["one"].append(disk.peak)
            accounted["one"].append(max((s.get("images") or {}).get("peak") or 0 for s in alone))
            with DiskSampler(client) as disk:
                pair, summaries = _batches(work / f"pair-{n}", manifests, budget)
            forget(client, refs)
            peaks["pair"].append(disk.peak)
            accounted["pair"].append(max((s.get("images") or {}).get("peak") or 0 for s in summaries))
            ones.append(one)
            pairs.append(pair)
    left = _ours_left(client)  # the registry's container gone too
    return {
        "images": count,
        "items": count * per_image,
        "budget_bytes": budget,
        "one_batch_seconds": median(ones),
        "two_side_by_side_seconds": median(pairs),
        "pair_vs_one": {"median": round(median(pairs) / median(ones), 3),
                        "spread": spread([p / o for p, o in zip(pairs, ones, strict=True)]), "rounds": ROUNDS},
        "peak_disk_sampled": {"one batch": max(peaks["one"]), "two side by side": max(peaks["pair"])},
        "peak_accounted": {"one batch": max(accounted["one"]), "two side by side": max(accounted["pair"])},
        "accounted_within_budget": max(accounted["pair"]) <= budget,
        "pair_disk_vs_one": round(max(peaks["pair"]) / max(1, max(peaks["one"])), 3),
        "both_ok": all(s["counts"].get("ok") == s["items"] for s in summaries),
        "left": left,
        "target": "the pair within 1.2x the one batch's wall; the cache's accounted peak within the one budget, the "
        "disk the pair really used within 1.1x the one batch's; nothing left",
    }  # fmt: skip


def _manifest(path: Path, refs: list[str], trajectory: Path, per_image: int) -> Path:
    lines = [{"id": f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-{n}", "trajectory": str(trajectory),
              "after_step": 1, "image": ref} for n in range(per_image) for ref in refs]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _batches(out: Path, manifests: list[Path], budget: int) -> tuple[float, list[dict[str, Any]]]:
    """Start one batch per manifest in the same moment; the seconds until the last ended, and their summaries."""
    started = time.time()
    running = [
        subprocess.Popen(
            [
                CLI,
                "batch",
                str(manifest),
                "--agent",
                "claude-code",
                "--workspace-path",
                "/app",
                "--inject",
                "--image-workspace",
                "--mode",
                "replay-only",
                "--out",
                str(out / manifest.stem),
                f"--image-budget={budget}",
                "--quiet",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for manifest in manifests
    ]
    summaries = []
    for process in running:
        stdout, stderr = process.communicate(timeout=3600)
        if process.returncode != 0:
            raise SystemExit(f"a batch side by side failed ({process.returncode}): {stderr[-800:]}")
        summaries.append(json.loads(stdout))
    return round(time.time() - started, 1), summaries


def _ours_left(client: Any) -> dict[str, int]:
    """What of ours is still on the engine: containers, networks, and task images the batches pulled."""
    label = {"label": "pvisor-host.managed"}
    return {
        "containers": len(client.containers.list(all=True, filters=label)),
        "networks": len(client.networks.list(filters=label)),
        "task_images": sum(1 for i in client.images.list() if any("/bench/task" in t for t in i.tags)),
    }
