"""Checkpoint a gVisor sandbox, and start new containers from the checkpoint (``--fork``, docs/fork.md).

What Docker 20.10 offers and what works here (measured by ``scripts/fork-probe.py``, docs/performance.md):

* The engine's own checkpoint call fails once the image passes a few MB ("failed to Lchown .../checkpoint.img"),
  so the checkpoint is gVisor's own: ``runsc checkpoint --image-path DIR`` with the state root the engine's shim
  gives its runtimes. It stops the sandbox.
* The engine refuses ``--checkpoint-dir`` ("custom checkpointdir is not supported"), so a copy's checkpoint goes
  into that container's own ``checkpoints/NAME`` directory, and the copy is started with ``checkpoint=NAME``
  (which the engine accepts only in experimental mode).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import requests
from docker.models.containers import Container

from ...errors import InfrastructureError
from ...models.replay import Runtime
from .engine import engine_errors, request_within, timed_out
from .runtimes import RUNTIME_ROOT

#: The name of the checkpoint in a copy's own checkpoints directory.
NAME = "pvisor-host-fork"
#: Seconds a checkpoint may take.
CHECKPOINT_TIMEOUT = 300.0


class CheckpointFailed(InfrastructureError):
    """gVisor could not checkpoint the sandbox, or a copy could not start from the checkpoint."""


def checkpoint(runtime: Runtime, container: Container, image: Path) -> tuple[float, int]:
    """Checkpoint the running ``container`` into the directory ``image`` (the sandbox stops): the seconds it took
    and the image's size in bytes."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [runtime.path, "--root", RUNTIME_ROOT, "checkpoint", "--image-path", str(image), container.id],
            capture_output=True, text=True, timeout=CHECKPOINT_TIMEOUT, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise CheckpointFailed(f"gVisor could not checkpoint the sandbox: {exc}") from exc
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise CheckpointFailed(f"gVisor could not checkpoint the sandbox: {said[-600:]}")
    try:
        size = sum(path.stat().st_size for path in image.rglob("*") if path.is_file())
    except OSError as exc:
        raise CheckpointFailed(f"gVisor's checkpoint is unreadable: {exc.strerror or exc}") from exc
    return round(time.monotonic() - started, 3), size


def give(container: Container, image: Path, docker_root: Path) -> None:
    """Put the checkpoint in ``image`` into the created ``container``'s own checkpoints directory (under the
    engine's ``docker_root``), where :func:`start_from` starts it from."""
    own = docker_root / "containers" / container.id / "checkpoints" / NAME
    try:
        shutil.copytree(image, own)
    except OSError as exc:
        raise CheckpointFailed(f"could not give the copy its checkpoint ({own}): {exc.strerror or exc}") from exc


def start_from(container: Container, docker_root: Path, timeout: float) -> float:
    """Start the created ``container`` from the checkpoint :func:`give` gave it: the seconds the start took."""
    started = time.monotonic()
    with engine_errors(f"start container {container.short_id} from the checkpoint"):
        try:
            api = container.client.api
            request_within(api, "post", "/containers/{0}/start", timeout, container.id, checkpoint=NAME)
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as exc:
            if not timed_out(exc):
                raise
            raise CheckpointFailed(
                f"the engine did not start the copy from the checkpoint within {timeout:.0f}s"
            ) from None
    return round(time.monotonic() - started, 3)
