"""What the sections share: the repository's paths, ``BENCH_SCALE``, timing, a manifest over the demo trajectory,
the claude-code image, the hand-written sandbox's pvisor command and hardening, ``pvisor-host batch``, and the task
images in a registry (``dataset`` and ``cluster``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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


def image() -> tuple[str, str]:
    """The claude-code image (built when missing) and its agent entrypoint."""
    import docker

    import pvisor_host

    ref = pvisor_host.build("claude-code")
    labels = docker.from_env().images.get(ref.id).labels
    return ref.ref, labels["pvisor-host.agent-entrypoint"]


def pvisor_command(entrypoint: str, run_id: str, after_step: int = 4) -> list[str]:
    """The plain `docker run` baseline's pvisor line: the sandbox's own (``PvisorRequest.argv``), replay-only."""
    from pvisor_host.models.record import PvisorRequest

    request = PvisorRequest(
        agent="claude-code", after_step=after_step, mode="replay-only", max_steps=None, boundary_user_prompt=None,
        disable_thinking=False, allow_stale_observations=False, session_id=None,
    )  # fmt: skip
    argv = request.argv(
        trajectory="/in/t.jsonl", workspace="/workspace", state_dir="/run/state", output_dir="/run/output",
        run_id=run_id, agent_flags=["--agent-entrypoint", entrypoint],
    )  # fmt: skip
    return ["/opt/pvisor/bin/pvisor", *argv]


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


def batch_command(manifest: Path, out: Path, mode: str, *extra: str) -> list[str]:
    """``pvisor-host batch`` over ``manifest`` for claude-code, into ``out``."""
    return [CLI, "batch", str(manifest), "--agent", "claude-code", "--mode", mode, "--out", str(out), *extra]


def cli_batch(manifest: Path, out: Path, workers: int, *extra: str) -> float:
    return timed(batch_command(manifest, out, "replay-only", "--workers", str(workers), "--quiet", *extra))


def task_session() -> str:
    """A Claude Code session in a task image's /app: it reads the task, then stops (one tool batch)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from trajgen import Call, Turn, claude_session

    events = claude_session("Read the task.", [Turn([Call("Bash", {"command": "cat README"}, "task\n")])], cwd="/app")
    return "".join(json.dumps(event) + "\n" for event in events)


def task_images(client: Any, registry: str, count: int, *, megabytes: int) -> list[str]:
    """``count`` images in ``registry``, each on the agent images' base with ``megabytes`` of its own (random,
    so that nothing is shared but the base), none left on the engine."""
    base = client.images.get(image()[0]).labels["pvisor-host.base-image"]
    refs = []
    for n in range(count):
        dockerfile = (f"FROM {base}\nRUN mkdir -p /app && echo 'task {n}' > /app/README "
                      f"&& head -c {megabytes * 2**20} /dev/urandom > /opt/task.bin\n")  # fmt: skip
        refs.append(build_and_push(client, dockerfile, f"{registry}/bench/task{n:02d}:v1"))
    forget(client, refs)
    return refs


def build_and_push(client: Any, dockerfile: str, ref: str) -> str:
    """Build ``dockerfile``, push it to its registry as ``ref`` (``repository:tag``); ``ref``."""
    import io

    built, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True)
    repository, tag = ref.rsplit(":", 1)
    built.tag(repository, tag)
    for line in client.images.push(repository, tag, stream=True, decode=True):
        if "error" in line:
            raise SystemExit(f"push of {ref} failed: {line['error']}")
    return ref


def forget(client: Any, refs: list[str]) -> None:
    import docker

    for ref in refs:
        try:
            client.images.remove(ref)
        except docker.errors.ImageNotFound:
            continue


class DiskSampler:
    """The most the engine's filesystem grew while the block ran (``statvfs`` of its data root, sampled every
    0.2 s against the start): the disk a batch's images really took, measured beside pvisor-host's own count."""

    def __init__(self, client: Any) -> None:
        self.root = str(client.info()["DockerRootDir"])
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _used(self) -> int:
        stats = os.statvfs(self.root)
        return (stats.f_blocks - stats.f_bfree) * stats.f_frsize

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self._used() - self._start)

    def __enter__(self) -> DiskSampler:
        self._start = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
