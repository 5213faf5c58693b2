"""One batch item, from its pre-flight to its result: the pipeline each worker runs, and what the workers of one
batch share (:class:`BatchContext`).

An item goes through the same decisions in the same order whether it runs or ``batch --plan`` describes it
(:mod:`.plan`), so the plan says what the run does:

1. its trajectory is read (once per version of the file);
2. an item that finished in an earlier run with the same content key is skipped
   (:func:`~.resume.finished_earlier`), when its image can be told without making it;
3. its host checks (:func:`~.resume.check_item`: the options, the trajectory, pvisor's pre-flight), once;
4. its image: made ready (the run) or previewed (the plan), then the checks that need it (the agent from its
   label, the runtime, the workspace in it, its user: :func:`~pvisor_host.preflight.prepare.prepare`).

Only then does the run create the item's directory and run its attempts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from .._log import logger
from ..attempts import RetryPolicy, run_attempts, run_forked
from ..backend.base import AnyBackend, ModelGateway
from ..errors import DiskFull, EngineUnresponsive, InfrastructureError, Interrupted, PvisorHostError
from ..files.digest import tree_digest
from ..files.space import disk_full, full_disk_raises
from ..models.batch import ItemResult
from ..models.image import BuildOptions, ImageRequest, ResolvedImage
from ..models.record import DISK_FULL, BatchInfo, ReplayRecord, fork_outcomes
from ..models.spec import ModelUpstream, ReplaySpec
from ..preflight.checks import CheckedInputs
from ..preflight.prepare import check_fork, image_request, prepare, prepare_image
from ..preflight.trajectory import read_trajectory
from .images import ImageWindow
from .manifest import BatchItem
from .memo import Memo
from .resume import ImageIdentity, check_item, finished_earlier, set_aside


class BatchContext:
    """What the workers of one batch share: the backend, the images made ready once for every item that shares
    them, the model gateways, the cancel event and the deadline."""

    def __init__(
        self,
        backend: AnyBackend,
        *,
        out: Path,
        build: BuildOptions,
        deadline: float | None = None,
        rerun_failed: bool = False,
        retry_oom: bool = False,
        window: ImageWindow | None = None,
    ) -> None:
        self.backend = backend
        self.out = out
        self.build = build
        self.deadline = deadline
        self.rerun_failed = rerun_failed
        self.retry_oom = retry_oom
        self.window = window
        """The task images, pulled just in time (None: the batch names none)."""
        self.cancel = threading.Event()
        self.started = time.monotonic()
        self.stopped: DiskFull | EngineUnresponsive | None = None
        """Set when an item found the run directory's filesystem full, or the engine stopped answering: no further
        item starts."""
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._images: Memo[ResolvedImage] = Memo()
        self._gateways: Memo[ModelGateway] = Memo()
        self._workspaces: Memo[str] = Memo()

    def warn_once(self, warning: str | None) -> None:
        """Log ``warning`` the first time this batch meets it (a runtime's, say: every item would repeat it)."""
        if warning is None:
            return
        with self._lock:
            if warning in self._warned:
                return
            self._warned.add(warning)
        logger.warning(warning)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        if self.deadline is None:
            return None
        return self.deadline - (time.monotonic() - self.started)

    def image(self, spec: ReplaySpec) -> ResolvedImage:
        """The item's image, made ready once for every item that asks for the same one."""
        return self._ready(image_request(spec))

    def prepare_ahead(self, spec: ReplaySpec) -> None:
        """What can be made ready before the first item, in the iterating thread (so that Ctrl-C stops a build
        at once): an agent image, or for a task image the agent image its runtime is injected from. A task
        image itself is pulled just in time (:class:`ImageWindow`)."""
        request = image_request(spec)
        if not self._windowed(spec):
            self._ready(request)
        elif request.runtime_image is not None:
            self._ready(request.runtime_image)

    def _ready(self, request: ImageRequest) -> ResolvedImage:
        return self._images.get(request.key, lambda: prepare_image(self.backend, request, self.build))

    def _windowed(self, spec: ReplaySpec) -> bool:
        return spec.image is not None and self.window is not None and spec.image in self.window

    def known_image(self, spec: ReplaySpec) -> ImageIdentity | None:
        """The image the item will run in, as far as it can be told without pulling or building anything: an
        agent image made ready already, or a task image's id from the engine or its registry (None: not yet)."""
        if not self._windowed(spec):
            try:
                image = self.image(spec).image
            except PvisorHostError:  # the item meets it again when it asks for its image
                return None
            return image.id, image.agent_image
        assert self.window is not None and spec.image is not None
        identity = self.window.identity(spec.image)
        return (identity, self.agent_tag(spec)) if identity is not None else None

    def agent_tag(self, spec: ReplaySpec) -> str | None:
        """The agent image an injected runtime comes from (made ready before the first item), else None."""
        runtime = image_request(spec).runtime_image
        if runtime is None:
            return None
        try:
            made = self._ready(runtime)
        except PvisorHostError:
            return None
        return made.built.tag if made.built is not None else made.image.ref

    def skip_image(self, spec: ReplaySpec) -> None:
        """An item ends without running: its task image is one item less in demand."""
        if self._windowed(spec):
            assert self.window is not None and spec.image is not None
            self.window.skip(spec.image)

    def want_image(self, spec: ReplaySpec) -> None:
        """The item passed its host checks and will ask for its task image: its pull may start now."""
        if self._windowed(spec):
            assert self.window is not None and spec.image is not None
            self.window.want(spec.image)

    def task_image(self, spec: ReplaySpec) -> contextlib.AbstractContextManager[object]:
        """Hold the item's task image while it runs (pulled first when it is not there yet)."""
        if not self._windowed(spec):
            return contextlib.nullcontext()
        assert self.window is not None and spec.image is not None
        return self.window.holding(spec.image, self.cancel)

    def gateway(self, upstream: ModelUpstream | None, user: str) -> ModelGateway | None:
        if upstream is None:
            return None
        return self._gateways.get((upstream, user), lambda: self.backend.open_gateway(upstream, user=user))

    def workspace_sha256(self, path: Path | None) -> str | None:
        if path is None:
            return None
        return self._workspaces.get(path, lambda: tree_digest(path).sha256)

    def close(self) -> None:
        for gateway in self._gateways.values():
            gateway.close()


Rows = list[ItemResult]
"""An item's rows: one, or one per fork (``fork: K``)."""


def skipped_result(item: BatchItem, earlier: list[ReplayRecord], out: Path) -> Rows:
    """The rows of an item that finished earlier (:func:`~.resume.finished_earlier`: a record per row), marked
    skipped."""
    return record_rows(item, earlier, out, skipped=True)


def record_rows(item: BatchItem, outcomes: list[ReplayRecord], out: Path, *, skipped: bool = False) -> Rows:
    """An item's rows from what each came to, a record per row: its own record; with ``fork: K`` each fork's
    (:func:`~pvisor_host.models.record.fork_outcomes`: its own record, or the prefix's)."""
    rows = []
    for keys, record in zip(item.rows, outcomes, strict=True):
        where = f"{item.id}/{record.fork.dir_name}" if record.fork is not None else item.id
        rows.append(ItemResult.from_record(record, keys, path=where, skipped=skipped, run_dir=out / where))
    return rows


def run_item(item: BatchItem, batch: BatchContext) -> Rows:
    """One item, in a worker thread: resume decision, host checks, image, attempts (or forks). Never raises."""
    with logger.contextualize(item=item.id):
        asked = threading.Event()  # whether it asked for its task image (else the window is told it never will)
        try:
            result = _outcome(item, batch, asked)
        finally:
            if not asked.is_set():
                batch.skip_image(item.spec)
    return result


def base_result(item: BatchItem, status: str, *, out: Path | None = None, **fields: Any) -> Rows:
    """The rows of an item that got no record of its own (refused, not started, stopped); ``out``: the batch's
    directory, to name the item's when it has one."""
    path = item.id if out is not None and (out / item.id).is_dir() else None
    return [ItemResult.without_record(keys, status, path=path, **fields) for keys in item.rows]


def interrupted_result(item: BatchItem, message: str, *, out: Path | None = None) -> Rows:
    return base_result(item, "interrupted", out=out, category="interrupted", message=message)


def _outcome(item: BatchItem, batch: BatchContext, asked: threading.Event) -> Rows:
    if batch.cancel.is_set():
        return interrupted_result(item, "not started")
    if batch.stopped is not None:
        return base_result(item, "not_run", message=f"not started: {batch.stopped.message}")
    remaining = batch.remaining()
    if remaining is not None and remaining <= 0:
        return base_result(item, "not_run", message="the batch deadline passed before it started")
    spec = item.spec
    run_dir = batch.out / item.id
    try:
        with full_disk_raises(run_dir):
            trajectory = read_trajectory(spec.trajectory)
            workspace = batch.workspace_sha256(spec.workspace_dir)
            key, earlier = finished_earlier(
                item, trajectory, batch.known_image(spec), workspace, out=batch.out, rerun_failed=batch.rerun_failed
            )
            if earlier is not None:
                return skipped_result(item, earlier, batch.out)
            checked = check_item(item, trajectory, batch.out)
            check_fork(checked, batch.backend)
            batch.want_image(spec)  # its pull may start now
            asked.set()
            waiting = time.monotonic()
            with batch.task_image(spec):
                pull_wait = round(time.monotonic() - waiting, 4)  # the task image is here (pulled, or waited for)
                image = batch.image(spec)
                if key is None:  # told only now that its image is here
                    identity = (image.image.id, image.image.agent_image)
                    key, earlier = finished_earlier(
                        item, trajectory, identity, workspace, out=batch.out, rerun_failed=batch.rerun_failed
                    )
                    if earlier is not None:
                        return skipped_result(item, earlier, batch.out)
                assert key is not None
                remaining = batch.remaining()  # again: the wait for its image may have taken the rest
                if remaining is not None and remaining <= 0:
                    return base_result(item, "not_run", message="the batch deadline passed while it waited")
                set_aside(batch.out, item.id)
                if remaining is not None:  # the replay, then its verifier, within what is left
                    checked = _within(checked, remaining)
                prepared = prepare(checked, batch.backend, image=image)
                if spec.image is not None:  # the time it waited for its task image (pulled just in time)
                    prepared = prepared.model_copy(update={"timings": {"pull_wait": pull_wait, **prepared.timings}})
                batch.warn_once(prepared.runtime_warning)
                info = BatchInfo(item_id=item.id, line=item.line, content_key=key, repeat_of=item.repeat_of)
                gateway = batch.gateway(checked.spec.continuation, prepared.user)
                if checked.spec.fork is not None:
                    records = run_forked(prepared, batch.backend, gateway=gateway, cancel=batch.cancel, batch=info)
                else:
                    records = [run_attempts(
                        prepared, batch.backend, gateway=gateway, cancel=batch.cancel, batch=info,
                        policy=RetryPolicy.for_spec(checked.spec, infra=True, oom=batch.retry_oom),
                    )]  # fmt: skip
    except Interrupted as exc:
        return interrupted_result(item, exc.one_line(), out=batch.out)
    except DiskFull as exc:  # also a write of our own that found no space (full_disk_raises)
        batch.stopped = batch.stopped or exc
        return base_result(item, "infra_error", out=batch.out, category=DISK_FULL, message=exc.one_line())
    except EngineUnresponsive as exc:
        batch.stopped = batch.stopped or exc
        return base_result(item, "infra_error", out=batch.out, category="engine_unresponsive", message=exc.one_line())
    except PvisorHostError as exc:
        status = "infra_error" if isinstance(exc, InfrastructureError) else "rejected"
        return base_result(item, status, out=batch.out, category=exc.category, message=exc.one_line())
    except Exception as exc:  # one item's bug must not stop the batch
        logger.opt(exception=exc).error("item {} failed unexpectedly", item.id)
        return base_result(item, "infra_error", out=batch.out, category="internal", message=repr(exc))
    if any(r.failure is not None and r.failure.disk_full for r in records):
        batch.stopped = batch.stopped or disk_full(run_dir)
    outcomes = fork_outcomes(records, item.spec.fork) if item.spec.fork is not None else records
    return record_rows(item, outcomes, batch.out)


def _within(checked: CheckedInputs, remaining: float) -> CheckedInputs:
    """The checked item with its replay, then its verifier, cut to the time the deadline leaves."""
    spec = checked.spec
    timeout = max(1.0, min(spec.timeout, remaining))
    verify = max(1.0, min(spec.verify_timeout, remaining - timeout))
    return checked.model_copy(update={"spec": spec.model_copy(update={"timeout": timeout, "verify_timeout": verify})})
