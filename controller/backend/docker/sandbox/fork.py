"""``--fork K``: K continuations from one replayed prefix, on this engine (docs/fork.md).

The prefix runs as a replay does, but pvisor launches the agent through the gate (:mod:`.gate`). Once the
sandbox waits there (the prefix's tool calls replayed, the context rebuilt, no model call yet), gVisor
checkpoints it (:mod:`..checkpoint`; the sandbox stops) and the staging's directories are copied as they are at
that moment. The prefix's record is written then: its tool calls, egress and timings, once.

Each fork is then a container of the prefix's configuration (the same hardening, limits, mounts and command) with
its own copies of those directories, its own run id, its own egress socket and its own model gateway (a socket
of its own: every fork's pvisor holds the prefix's token, so the gateway tells forks apart by the socket they
arrive on). It starts from the checkpoint and gets its go-ahead; pvisor, still the parent, finishes its
continuation and writes its own result, collected into ``fork-<k>/`` as any replay's is. The forks run at once.

A fork the engine cannot start from the checkpoint runs once as a full replay instead (its record says so:
``fork.restored`` false, ``fork.fallback`` why), unless ``--fork-strict``. Ctrl-C (or ``cancel``) stops every
fork and removes its sandbox; the checkpoint and the copies are removed on every path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import docker
from docker.models.containers import Container

from ...._log import logger
from ....errors import InfrastructureError, Interrupted
from ....models.ownership import Ownership
from ....models.record import ForkInfo, ReplayRecord
from ....models.replay import Attempt, PreparedReplay
from .. import checkpoint as ck
from .. import container as sandbox
from ..gateway import Gateway
from .gate import release
from .run import Way, run_attempt
from .stage import Staging

#: Under the replay's directory while it forks: the checkpoint and the staging as it was at the boundary.
WORK = ".pvisor-host-fork"


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The prefix's sandbox, checkpointed at the boundary."""

    image: Path
    """The checkpoint."""
    staging: Staging
    """The prefix's staging, copied at the boundary (its paths are the copies')."""
    command: list[str]
    token: str | None


def run_forks(
    client: docker.DockerClient,
    ownership: Ownership,
    prepared: PreparedReplay,
    *,
    gateway: Gateway | None,
    cancel: threading.Event,
    kill: Callable[[str], None],
    run: Callable[..., ReplayRecord] = run_attempt,
) -> list[ReplayRecord]:
    """Run ``prepared`` (``--fork K``) to its records: the prefix's first, then each fork's, in order (the prefix's
    alone when it ended before the boundary: its record says why). ``kill`` kills a run's sandbox (by run id);
    ``run`` is :func:`~.run.run_attempt` with the backend's own arguments bound.

    Raises:
        Interrupted: Ctrl-C or ``cancel``; every sandbox was removed, the finished forks' records are kept.
    """
    assert prepared.spec.fork is not None
    forks = prepared.spec.fork
    out = prepared.out_dir
    work = out / WORK
    work.mkdir(mode=0o700)
    prefix_id = prepared.run_id
    runtime = prepared.runtime
    root = Path(str(client.info().get("DockerRootDir") or "/var/lib/docker"))
    found: list[Boundary] = []
    reached: list[bool] = []

    def at_boundary(box: Container, staging: Staging, cspec: sandbox.ContainerSpec, token: str | None) -> ForkInfo:
        reached.append(True)
        seconds, size = ck.checkpoint(runtime, box, work / "checkpoint")
        found.append(Boundary(work / "checkpoint", _copy_staging(staging, work / "boundary"), cspec.command, token))
        logger.info("checkpointed the prefix at the boundary in {:.2f}s ({} bytes); starting {} forks", seconds, size,
                    forks)  # fmt: skip
        return ForkInfo(role="prefix", of=prefix_id, forks=forks, checkpoint_seconds=seconds, checkpoint_bytes=size)

    try:
        prefix_info = ForkInfo(role="prefix", of=prefix_id, forks=forks)
        prefix_attempt = Attempt(run_id=prefix_id, run_dir=out / prefix_info.dir_name)
        prefix = run(prepared, prefix_attempt, gateway=gateway, cancel=cancel, way=Way(boundary=at_boundary))
        if reached and not found and not prepared.spec.fork_strict and prefix.status == "infra_error":
            why = prefix.failure.message if prefix.failure is not None else "the checkpoint failed"
            logger.warning("no fork can start from the boundary ({}); running each once as a full replay", why)
            records = _run_all(prepared, None, root, gateway=gateway, cancel=cancel, kill=kill, run=run, why=why)
            return [prefix, *records]
        if not found or prefix.fork is None:
            return [prefix]  # it ended before the boundary (its record says why): there is nothing to fork
        records = _run_all(prepared, found[0], root, gateway=gateway, cancel=cancel, kill=kill, run=run)
        return [prefix, *records]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_all(
    prepared: PreparedReplay,
    boundary: Boundary | None,
    root: Path,
    *,
    gateway: Gateway | None,
    cancel: threading.Event,
    kill: Callable[[str], None],
    run: Callable[..., ReplayRecord],
    why: str | None = None,
) -> list[ReplayRecord]:
    """Every fork at once (each a full replay, for ``why``, without a ``boundary``); Ctrl-C cancels and kills them
    all, and waits for their workers' cleanup."""
    forks = prepared.spec.fork or 0
    ids = [f"{prepared.run_id}-f{index}" for index in range(1, forks + 1)]
    with futures.ThreadPoolExecutor(max_workers=forks, thread_name_prefix="pvisor-host-fork") as pool:
        running = [
            pool.submit(_one, prepared, boundary, root, index, gateway, cancel, run, why)
            for index in range(1, forks + 1)
        ]
        try:
            futures.wait(running)
        except KeyboardInterrupt:
            cancel.set()
            for run_id in ids:
                kill(run_id)
            futures.wait(running)
    records: list[ReplayRecord] = []
    stopped: Interrupted | None = None
    for future in running:
        try:
            records.append(future.result())
        except Interrupted as exc:
            stopped = stopped or exc
    if stopped is not None or cancel.is_set():
        raise stopped or Interrupted("interrupted; every fork's sandbox was removed")
    return records


def _one(
    prepared: PreparedReplay,
    boundary: Boundary | None,
    root: Path,
    index: int,
    gateway: Gateway | None,
    cancel: threading.Event,
    run: Callable[..., ReplayRecord],
    why: str | None,
) -> ReplayRecord:
    """Fork ``index``: restored from the checkpoint, or (when that fails, and not ``--fork-strict``) once as a full
    replay."""
    spec = prepared.spec
    forks = spec.fork or 0
    info = ForkInfo(role="fork", of=prepared.run_id, index=index, forks=forks)
    run_dir = prepared.out_dir / info.dir_name
    if boundary is None:
        return _full_replay(prepared, index, info, why or "no checkpoint", gateway, cancel, run)
    attempt = Attempt(run_id=f"{prepared.run_id}-f{index}", run_dir=run_dir, pvisor_run_id=prepared.run_id)
    holder: list[Staging] = []

    def staged(root_dir: Path) -> Staging:
        holder.append(_copy_staging(boundary.staging, root_dir))
        return holder[0]

    def start(box: Container) -> float:
        seconds = ck.start_from(box, boundary.image, root, spec.start_timeout)
        release(holder[0])
        return seconds

    way = Way(staged=staged, start=start, command=boundary.command, token=boundary.token, fork=info)
    with _own_gateway(gateway) as own:
        record = run(prepared, attempt, gateway=own, cancel=cancel, way=way)
    restored = record.fork is not None and record.fork.restore_seconds is not None
    if restored or record.status != "infra_error" or spec.fork_strict or cancel.is_set():
        return record
    failed = record.failure.message if record.failure is not None else "the copy did not start"
    logger.warning("fork {} could not start from the checkpoint ({}); running it once as a full replay", index, failed)
    shutil.rmtree(run_dir, ignore_errors=True)
    return _full_replay(prepared, index, info, failed, gateway, cancel, run)


def _full_replay(
    prepared: PreparedReplay,
    index: int,
    info: ForkInfo,
    why: str,
    gateway: Gateway | None,
    cancel: threading.Event,
    run: Callable[..., ReplayRecord],
) -> ReplayRecord:
    """Fork ``index`` as a plain replay of its own (the prefix's tool calls run again in it), saying ``why``."""
    plain = Attempt(run_id=f"{prepared.run_id}-f{index}", run_dir=prepared.out_dir / info.dir_name)
    fallback = info.model_copy(update={"restored": False, "fallback": why})
    with _own_gateway(gateway) as own:
        return run(prepared, plain, gateway=own, cancel=cancel, way=Way(fork=fallback))


@contextlib.contextmanager
def _own_gateway(gateway: Gateway | None) -> Iterator[Gateway | None]:
    """A gateway of the fork's own (see the module docstring), closed on every path."""
    if gateway is None:
        yield None
        return
    own = gateway.sibling()
    try:
        yield own
    finally:
        own.close()


def _copy_staging(staging: Staging, root: Path) -> Staging:
    """A copy of ``staging``'s directories under ``root`` (owners, modes and times kept: the restored processes
    find their files as they left them)."""
    root.mkdir(mode=0o700)
    moved: dict[str, Path] = {}
    for field in ("input_dir", "workspace_dir", "run_dir", "logs_dir", "verifier_dir"):
        source: Path | None = getattr(staging, field)
        if source is None:
            continue
        target = root / source.name
        try:
            subprocess.run(["cp", "-a", "--", str(source), str(target)], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            raise InfrastructureError(f"could not copy the sandbox's {source.name} directory at the boundary: "
                                      f"{exc.stderr.strip()[-300:]}") from exc  # fmt: skip
        moved[field] = target
    return staging.model_copy(update={"root": root, **moved})
