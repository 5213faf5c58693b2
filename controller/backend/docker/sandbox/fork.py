"""``--fork K``: K continuations from one replayed prefix, on this engine (docs/fork.md).

The prefix runs as a replay does, but pvisor launches the agent through the gate (:mod:`.gate`). Once the
sandbox waits there (the prefix's tool calls replayed, the context rebuilt, no model call yet), gVisor
checkpoints it (:mod:`..checkpoint`; the sandbox stops) and the staging's directories are copied as they are at
that moment (``env.sh`` aside: the forks' processes hold its values already). The prefix's record is written
then: its tool calls, egress and timings, once.

Each fork is then a container of the prefix's configuration (the same hardening, limits, mounts and command) with
its own copies of those directories, its own run id, its own egress socket and its own socket on the model
gateway (every fork's pvisor holds the prefix's token, so the gateway tells forks apart by the socket they
arrive on). It starts from the checkpoint and gets its go-ahead; pvisor, still the parent, finishes its
continuation and writes its own result, collected into ``fork-<k>/`` as any replay's is. The forks run at once;
their starts from the checkpoint one at a time (the engine's containerd refuses two uploads of one checkpoint
at once: "content ... already exists"). A fork's ``--timeout`` is what the prefix left of it, as the sandbox's
own deadline, restored with it, says.

A fork the engine cannot start from the checkpoint (or whose copy fails) runs once as a full replay instead, its
record saying so (``fork.restored`` false, ``fork.fallback`` why); when the checkpoint itself fails, every fork
does. With ``--fork-strict`` neither happens: the fork (the prefix) fails. Ctrl-C (or ``cancel``) stops every fork
and removes its sandbox. The checkpoint (the sandbox's memory, secrets included) and the copies are removed on
every path; a controller killed with ``kill -9`` leaves them under ``.pvisor-host-fork/``, which a batch's
rerun removes (:func:`~pvisor_host.fanout.resume.set_aside`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import docker
from docker.models.containers import Container

from ...._log import logger
from ....errors import DiskFull, InfrastructureError, Interrupted
from ....files.space import disk_full, is_full
from ....files.trees import remove_tree
from ....models.ownership import Ownership
from ....models.record import ForkInfo, ReplayRecord, fork_dir_name, fork_run_id, save_record
from ....models.replay import FORK_WORK, STAGING_NAME, Attempt, PreparedReplay
from ....signals import deferred_interrupts
from .. import checkpoint as ck
from .. import container as sandbox
from ..engine import engine_errors
from ..gateway import Gateway
from .gate import release
from .run import Way, run_attempt
from .stage import Staging, copy_staging, planned_staging

Run = Callable[..., ReplayRecord]
""":func:`~.run.run_attempt` with the backend's own arguments bound."""


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The prefix's sandbox, checkpointed at the boundary."""

    image: Path
    """The checkpoint."""
    staging: Staging
    """The prefix's staging, copied at the boundary (its paths are the copies')."""
    token: str | None
    timeout: float
    """What the prefix left of ``--timeout``."""


def run_forks(
    client: docker.DockerClient,
    ownership: Ownership,
    prepared: PreparedReplay,
    *,
    gateway: Gateway | None,
    cancel: threading.Event,
    kill: Callable[[str], None],
    run: Run = run_attempt,
) -> list[ReplayRecord]:
    """Run ``prepared`` (``--fork K``) to its records: the prefix's first, then each fork's, in order (the prefix's
    alone when it ended before the boundary, or could not be checkpointed with ``--fork-strict``: its record says
    why). ``kill`` kills a run's sandbox (by run id).

    Raises:
        Interrupted: Ctrl-C or ``cancel``; every sandbox was removed, the finished forks' records are kept.
    """
    assert prepared.spec.fork is not None
    out = prepared.out_dir
    work = out / FORK_WORK
    found: list[Boundary] = []
    try:
        remove_tree(work)  # what a controller killed mid-fork left
        work.mkdir(mode=0o700)
        with engine_errors("read the engine's root directory"):
            root = Path(str(client.info().get("DockerRootDir") or "/var/lib/docker"))
        info = ForkInfo(role="prefix", of=prepared.run_id, forks=prepared.spec.fork, reached=False)

        def at_boundary(box: Container, staging: Staging, cspec: sandbox.ContainerSpec, token: str | None,
                        elapsed: float) -> ForkInfo:  # fmt: skip
            seconds, size = ck.checkpoint(prepared.runtime, box, work / "checkpoint")
            copied = copy_staging(staging, work / "boundary")
            left = prepared.spec.timeout - elapsed
            found.append(Boundary(work / "checkpoint", copied, token, max(1.0, left)))
            logger.info("checkpointed the prefix at the boundary in {:.2f}s ({} bytes)", seconds, size)
            return info.model_copy(update={"reached": True, "checkpoint_seconds": seconds, "checkpoint_bytes": size})

        attempt = Attempt(run_id=prepared.run_id, run_dir=out / info.dir_name)
        prefix = run(prepared, attempt, gateway=gateway, cancel=cancel, way=Way(boundary=at_boundary, fork=info))
        fork = prefix.fork
        assert fork is not None  # the run gives its record the way's fork information
        if not fork.reached or (prepared.spec.fork_strict and fork.checkpoint_error is not None):
            prefix = prefix.model_copy(update={"fork": fork.model_copy(update={"alone": True})})
            save_record(prefix, attempt.run_dir)
            return [prefix]  # it ended before the boundary, or its checkpoint failed: its record says why
        why = None if found else fork.checkpoint_error or "the checkpoint failed"
        if why is not None:
            logger.warning("no fork can start from the boundary ({}); running each once as a full replay", why)
        forks = _run_all(prepared, found[0] if found else None, root, gateway, cancel, kill, run, why)
        return [prefix, *forks]
    finally:
        with deferred_interrupts():  # the checkpoint holds the sandbox's memory: a second Ctrl-C must not keep it
            remove_tree(work)


def _run_all(
    prepared: PreparedReplay,
    boundary: Boundary | None,
    root: Path,
    gateway: Gateway | None,
    cancel: threading.Event,
    kill: Callable[[str], None],
    run: Run,
    why: str | None,
) -> list[ReplayRecord]:
    """Every fork at once (each a full replay, for ``why``, without a ``boundary``). Ctrl-C, or any fork's
    error, cancels and kills them all, and waits for their workers' cleanup."""
    forks = prepared.spec.fork or 0
    starting = threading.Lock()  # one start from the checkpoint at a time (see the module docstring)
    stop = threading.Event()  # this replay's forks' own: the caller's cancel stops them, a fork's error not the caller
    pool = futures.ThreadPoolExecutor(max_workers=forks, thread_name_prefix="pvisor-host-fork")
    running: list[futures.Future[ReplayRecord]] = []
    try:
        for index in range(1, forks + 1):
            context = contextvars.copy_context()  # the item's logging context, in each fork's thread
            one = _Fork(prepared, boundary, root, index, gateway, stop, run, why, starting)
            running.append(pool.submit(context.run, one.run))
        pending: set[futures.Future[ReplayRecord]] = set(running)
        if cancel.is_set():
            stop.set()
        while pending:
            done, pending = futures.wait(pending, timeout=0.2, return_when=futures.FIRST_EXCEPTION)
            if cancel.is_set():
                stop.set()
            failed = next((e for f in done if (e := f.exception()) is not None), None)
            if failed is not None:
                raise failed
    except BaseException as exc:
        with deferred_interrupts():  # a second Ctrl-C must not cut the cleanup short
            stop.set()
            for index in range(1, forks + 1):
                kill(fork_run_id(prepared.run_id, index))
            pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(exc, KeyboardInterrupt | Interrupted):
            raise Interrupted("interrupted; every fork's sandbox was removed") from None
        raise
    finally:
        pool.shutdown(wait=True)
    return [f.result() for f in running]


@dataclasses.dataclass
class _Fork:
    """Fork ``index``: restored from the checkpoint, or (when that fails, and not ``--fork-strict``) once as a full
    replay."""

    prepared: PreparedReplay
    boundary: Boundary | None
    root: Path
    index: int
    gateway: Gateway | None
    cancel: threading.Event
    run_attempt: Run
    why: str | None
    starting: threading.Lock

    def run(self) -> ReplayRecord:
        info = ForkInfo(role="fork", of=self.prepared.run_id, index=self.index, forks=self.prepared.spec.fork or 0)
        if self.cancel.is_set():
            raise Interrupted("interrupted before it started")
        if self.boundary is None:
            return self._full_replay(info, self.why or "no checkpoint")
        run_dir = self.prepared.out_dir / info.dir_name
        copy_root = run_dir / STAGING_NAME
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            copied = copy_staging(self.boundary.staging, copy_root)
        except DiskFull:
            raise  # the host's disk: every fork would meet it
        except (InfrastructureError, OSError) as exc:
            if is_full(exc):
                raise disk_full(run_dir) from exc
            failed = f"could not copy the sandbox at the boundary: {exc}"
            if self.prepared.spec.fork_strict:
                return self._failed(info, failed)
            return self._full_replay(info, failed)
        boundary = self.boundary

        def start(box: Container) -> float:
            started, timeout = time.monotonic(), self.prepared.spec.start_timeout
            try:
                sandbox.start(box, timeout, checkpoint=ck.NAME)
            except sandbox.StartHung:  # a restore, not a runtime's create that hangs
                raise ck.CheckpointFailed(
                    f"the engine did not start the copy from the checkpoint in {timeout:.0f}s"
                ) from None
            release(copied)
            return round(time.monotonic() - started, 3)

        way = Way(
            staged=lambda _: copied, before_start=lambda box: ck.give(box, boundary.image, self.root), start=start,
            start_lock=self.starting, token=boundary.token, fork=info, timeout=boundary.timeout,
        )  # fmt: skip
        try:
            record = self.run_attempt(self.prepared, self._attempt(restored=True), gateway=self.gateway,
                                      cancel=self.cancel, way=way)  # fmt: skip
        finally:
            remove_tree(copy_root)
        fork = record.fork or info
        if fork.restore_seconds is not None:
            return record
        failed = record.failure.message if record.failure is not None else "the copy did not start"
        if self.prepared.spec.fork_strict or self.cancel.is_set() or record.status != "infra_error":
            record = record.model_copy(update={"fork": _not_restored(fork, failed)})
            save_record(record, run_dir)
            return record
        logger.warning("fork {} could not start from the checkpoint ({}); running it once as a full replay",
                       self.index, failed)  # fmt: skip
        remove_tree(run_dir)
        return self._full_replay(info, failed)

    def _attempt(self, *, restored: bool) -> Attempt:
        """This fork's attempt: restored, pvisor in it knows the prefix's run id; else its own."""
        return Attempt(
            run_id=fork_run_id(self.prepared.run_id, self.index),
            run_dir=self.prepared.out_dir / fork_dir_name(self.index),
            pvisor_run_id=self.prepared.run_id if restored else None,
        )

    def _failed(self, info: ForkInfo, why: str) -> ReplayRecord:
        """This fork's record, failed before its sandbox started (``--fork-strict``): ``why``."""

        def refuse(box: Container) -> None:
            raise ck.CheckpointFailed(why)

        def empty(root: Path) -> Staging:  # nothing copied, nothing secret: the sandbox never starts
            staging = planned_staging(root, self.prepared.trajectory.path)
            for directory in (root, staging.input_dir, staging.workspace_dir, staging.run_dir, staging.logs_dir):
                directory.mkdir(mode=0o700)
            return staging

        way = Way(fork=_not_restored(info, why), staged=empty, before_start=refuse)
        return self.run_attempt(self.prepared, self._attempt(restored=False), gateway=self.gateway,
                                cancel=self.cancel, way=way)  # fmt: skip

    def _full_replay(self, info: ForkInfo, why: str) -> ReplayRecord:
        """This fork as a plain replay of its own (the prefix's tool calls run again in it), saying ``why``."""
        return self.run_attempt(self.prepared, self._attempt(restored=False), gateway=self.gateway,
                                cancel=self.cancel, way=Way(fork=_not_restored(info, why)))  # fmt: skip


def _not_restored(info: ForkInfo, why: str) -> ForkInfo:
    """A fork's information once it did not start from the checkpoint, for ``why``."""
    return info.model_copy(update={"restored": False, "fallback": why})
