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

from docker.models.containers import Container

from ...errors import InfrastructureError
from ...files.space import disk_full, is_full, tree_bytes
from ...models.replay import Runtime
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
    return round(time.monotonic() - started, 3), tree_bytes(image)


def give(container: Container, image: Path, docker_root: Path) -> None:
    """Put the checkpoint in ``image`` into the created ``container``'s own checkpoints directory (under the
    engine's ``docker_root``), where the engine starts it from (:func:`~.container.start` with ``checkpoint=NAME``)."""
    own = docker_root / "containers" / container.id / "checkpoints" / NAME
    try:
        shutil.copytree(image, own)
    except OSError as exc:
        if is_full(exc):
            raise disk_full(own) from exc
        raise CheckpointFailed(f"could not give the copy its checkpoint ({own}): {exc.strerror or exc}") from exc
