"""Fan-out: many replays across many sandboxes, resumable, with nothing lost and nothing leaked.

:func:`run_batch` streams :class:`~pvisor_host.fanout.manifest.BatchItem` s onto a pool of worker threads
that share one backend (no subprocess per item). A worker does the item's host checks, takes the image made
ready once for every item that shares it, and runs the item's attempts in fresh sandboxes; others create,
run and collect meanwhile. At most ``2 × workers`` items are in flight, so a long manifest is never all in
memory. Resume rules: :mod:`.resume`.

Cancellation (Ctrl-C, SIGTERM): no new item starts, the backend stops every running sandbox of this batch,
the records of finished items stay, and the summary says ``interrupted``.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import fcntl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .._log import logger
from ..attempts import RetryPolicy, run_attempts
from ..backend.base import AnyBackend, ModelGateway
from ..errors import DiskFull, InfrastructureError, Interrupted, PvisorHostError, UsageError
from ..files.digest import tree_sha256
from ..files.space import disk_full, full_disk_raises, is_full, tree_bytes
from ..models.batch import BatchSummary, ImageStats, ItemResult
from ..models.image import BuildOptions, ImageRequest, PullProgress, ResolvedImage
from ..models.profiles import get_profile
from ..models.record import DISK_FULL, BatchInfo, load_record
from ..models.spec import ModelUpstream, ReplaySpec
from ..preflight.checks import check_inputs, runtime_floor_warning
from ..preflight.prepare import prepare, prepare_image
from ..preflight.trajectory import check_file
from ..signals import deferred_interrupts
from ..units import format_size, host_slots
from .compare import run_flaky
from .images import ImageWindow
from .manifest import BatchItem
from .memo import Memo
from .resume import content_key, finished_result, item_result, item_run_id, set_aside
from .summary import BatchReport, summarize, write_reports

ImageKey = tuple[str | None, str | None, bool, bool]


class BatchOptions(BaseModel):
    """How to run a batch (the ``batch`` command's own options)."""

    out: Path
    """The batch directory: ``<out>/<item id>/`` per item, ``summary.json``, ``junit.xml``."""
    workers: int
    """Items (sandboxes) at a time."""
    deadline: float | None = None
    """Seconds for the whole batch: no item starts after it, running ones are cut at it."""
    rerun_failed: bool = False
    """Rerun items that finished with a failure (by default only missing, incomplete or changed ones rerun)."""
    retry_oom: bool = False
    """Retry an attempt killed for memory (infrastructure errors and retryable results always are)."""
    build: BuildOptions = BuildOptions()
    """How agent images that must be built are built (``--base``, ``--ca-bundle``)."""
    pull_workers: int = 2
    """Task images pulled at once, ahead of their items (0: every image first, before any item, which no
    ``image_budget`` can bound: the two are refused together)."""
    image_budget: int | None = None
    """Most bytes the task images this batch pulls may take at once (None: the backend's default, half the
    free space of the engine's storage)."""
    keep_images: bool = False
    """Keep the task images this batch pulled when it ends (by default it removes them)."""

    @classmethod
    def checked(cls, **fields: Any) -> BatchOptions:
        """The options, with what no field can say alone refused in one line (before any engine is asked).

        Raises:
            UsageError: ``pull_workers`` 0 (every image first) with an ``image_budget``, which cannot bound it.
        """
        options = cls(**fields)
        if options.pull_workers == 0 and options.image_budget is not None:
            raise UsageError(
                "--image-budget cannot apply with --pull-workers 0: every image is pulled first, before any item",
                hint="drop --pull-workers 0 to keep the images within the budget, or drop the budget",
            )
        return options


class BatchOutcome(BaseModel):
    """What :func:`run_batch` returns (and wrote as ``summary.json`` and ``junit.xml``)."""

    results: list[ItemResult]
    summary: BatchSummary


def default_workers(memory: int) -> int:
    """Sandboxes at a time: two per CPU, as many as the host's memory holds at ``memory`` each, at most 32."""
    return host_slots(2, memory, most=32)


def image_key(spec: ReplaySpec) -> ImageKey:
    """Items with the same key share one image (prepare-only needs no agent in it)."""
    return spec.image, spec.agent, spec.inject, spec.image is None and spec.mode == "prepare-only"


def image_request(spec: ReplaySpec) -> ImageRequest:
    """The image an item asks for (its agent's profile resolved)."""
    profile = get_profile(spec.agent) if spec.agent is not None else None
    return ImageRequest(image=spec.image, profile=profile, inject=spec.inject, pvisor_only=spec.mode == "prepare-only")


class _Batch:
    """What the workers of one batch share."""

    def __init__(self, backend: AnyBackend, options: BatchOptions, window: ImageWindow | None = None) -> None:
        self.backend = backend
        self.options = options
        self.window = window
        """The task images, pulled just in time (None: the batch names none)."""
        self.cancel = threading.Event()
        self.started = time.monotonic()
        self.full: DiskFull | None = None
        """Set when an item found the run directory's filesystem full: no further item starts."""
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
        if self.options.deadline is None:
            return None
        return self.options.deadline - (time.monotonic() - self.started)

    def image(self, spec: ReplaySpec) -> ResolvedImage:
        def resolve() -> ResolvedImage:
            return prepare_image(self.backend, image_request(spec), self.options.build)

        return self._images.get(image_key(spec), resolve)

    def prepare_ahead(self, spec: ReplaySpec) -> None:
        """What can be made ready before the first item, in the iterating thread (so that Ctrl-C stops a build
        at once): an agent image, or for a task image the agent image its runtime is injected from. A task
        image itself is pulled just in time (:class:`ImageWindow`)."""
        if spec.image is None or self.window is None or spec.image not in self.window:
            self.image(spec)
        elif spec.inject and spec.agent is not None:
            self._agent_image(spec.agent)

    def _agent_image(self, agent: str) -> ResolvedImage:
        request = ImageRequest(profile=get_profile(agent))
        return self._images.get(("agent", agent), lambda: prepare_image(self.backend, request, self.options.build))

    def agent_tag(self, spec: ReplaySpec) -> str | None:
        """The agent image an injected runtime comes from (made ready before the first item), else None."""
        if not spec.inject or spec.agent is None:
            return None
        try:
            made = self._agent_image(spec.agent)
        except PvisorHostError:
            return None
        return made.built.tag if made.built is not None else made.image.ref

    def skip_image(self, spec: ReplaySpec) -> None:
        """An item ends without running: its task image is one item less in demand."""
        if spec.image is not None and self.window is not None and spec.image in self.window:
            self.window.skip(spec.image)

    def want_image(self, spec: ReplaySpec) -> bool:
        """The item will ask for its task image once its inputs are checked: its pull may start now. False: it
        has none the window pulls."""
        if spec.image is None or self.window is None or spec.image not in self.window:
            return False
        self.window.want(spec.image)
        return True

    def task_image(self, spec: ReplaySpec) -> contextlib.AbstractContextManager[object]:
        """Hold the item's task image while it runs (pulled first when it is not there yet)."""
        if spec.image is None or self.window is None or spec.image not in self.window:
            return contextlib.nullcontext()
        return self.window.holding(spec.image, self.cancel)

    def gateway(self, upstream: ModelUpstream | None, user: str) -> ModelGateway | None:
        if upstream is None:
            return None
        return self._gateways.get((upstream, user), lambda: self.backend.open_gateway(upstream, user=user))

    def workspace_sha256(self, path: Path | None) -> str | None:
        if path is None:
            return None
        return self._workspaces.get(path, lambda: tree_sha256(path))

    def close(self) -> None:
        for gateway in self._gateways.values():
            gateway.close()


class _Cancelled(Exception):
    """Raised inside the fan-out when :meth:`BatchRun.cancel` was called."""


class BatchRun:
    """One batch, run by iterating it: each item's :class:`ItemResult` is yielded as it finishes (completion
    order), and ``summary.json`` and ``junit.xml`` are written when the iteration ends, however it ends.

    Stopping early — breaking out of the loop (the iterator is closed), :meth:`cancel` from any thread, or
    Ctrl-C / SIGTERM in the iterating thread — starts no new item, has the backend stop every running sandbox
    of this batch, keeps the records of finished items, and writes a summary that says ``interrupted``
    (unless every item had ended already). A ``KeyboardInterrupt`` is raised again once that is done.

    The images of ``images`` (specs, one per distinct image) are made ready first, in the iterating thread,
    so that Ctrl-C during a build stops it at once; an image that cannot be made fails its items only.
    """

    def __init__(
        self,
        items: Iterable[BatchItem],
        backend: AnyBackend,
        options: BatchOptions,
        *,
        total: int,
        images: Iterable[ReplaySpec] = (),
        task_images: dict[str, int] | None = None,
        reports: Sequence[BatchReport] = (),
        on_pull: Callable[[PullProgress], None] | None = None,
    ) -> None:
        self._items = items
        self._images = list(images)
        self._reports = reports
        self._total = total
        self._batch = _Batch(backend, options)
        if task_images:
            specs = {spec.image: spec for spec in self._images if spec.image is not None}
            self._batch.window = ImageWindow(
                backend, task_images, budget=backend.image_budget(options.image_budget), workers=options.pull_workers,
                keep=options.keep_images, progress=on_pull,
                open_images=backend.capacity(),  # a cluster: its nodes pull, one per slot
                ready=lambda ref: self._batch.image(specs[ref]) if ref in specs else None,
            )  # fmt: skip
        self._stop = threading.Event()
        self._every_item_ended = False
        self._core: Iterator[ItemResult] | None = None
        self.results: list[ItemResult] = []
        """Every result so far (completion order; sorted by manifest line once the batch has ended)."""
        self.outcome: BatchOutcome | None = None
        """The results and summary, once the iteration has ended."""

    def __iter__(self) -> Iterator[ItemResult]:
        if self._core is None:
            self._core = self._run()
        yield from self._core  # closing this iterator (a `break`) closes the batch with it

    def cancel(self) -> None:
        """Stop the batch (from any thread): no new item starts and the running ones are stopped."""
        self._stop.set()

    def close(self) -> None:
        """End the batch now if it is still running (as :meth:`cancel`), and wait until it has cleaned up."""
        self.cancel()
        if self._core is None:
            self._core = self._run()
        for _ in self._core:
            pass

    def _run(self) -> Iterator[ItemResult]:
        options = self._batch.options
        options.out.mkdir(parents=True, exist_ok=True)
        started_at = datetime.now(UTC)
        interrupt: BaseException | None = None
        with _exclusive(options.out):
            try:
                yield from self._fan_out()
            except (KeyboardInterrupt, GeneratorExit, _Cancelled) as exc:
                interrupt = exc
            except BaseException:
                window = self._batch.window
                with deferred_interrupts(hurry=window.hurry if window is not None else None):
                    self._batch.close()
                    if window is not None:
                        window.close()
                raise
            # The batch has stopped: a Ctrl-C now has nothing left to stop and must not cost the reports (it
            # only stops the wait for pulls still closing).
            window = self._batch.window
            with deferred_interrupts(reraise=False, hurry=window.hurry if window is not None else None):
                self._batch.close()
                pulls = self._batch.window.close() if self._batch.window is not None else None
                self.results.sort(key=lambda r: r.line)
                remaining = self._batch.remaining()
                summary = summarize(
                    self.results,
                    total=self._total,
                    started=started_at,
                    finished=datetime.now(UTC),
                    interrupted=interrupt is not None and not self._every_item_ended,
                    deadline=remaining is not None and remaining <= 0,
                )
                if pulls is not None:
                    _on_nodes(pulls, self._batch.backend.node_pulls(), options.image_budget)
                summary.images = pulls
                if self._batch.full is not None:
                    summary.stopped = _disk_full_line(self._batch.full, options.out, self.results)
                if any(r.repeat_of for r in self.results):
                    summary.flaky = run_flaky(options.out)
                try:
                    write_reports(options.out, self.results, summary, more=self._reports)
                except OSError as exc:
                    if not is_full(exc):
                        raise
                    logger.error("could not write the batch's reports: {}", disk_full(options.out).message)
                self.outcome = BatchOutcome(results=self.results, summary=summary)
        if isinstance(interrupt, KeyboardInterrupt) and not self._every_item_ended:
            raise interrupt

    def _done(self, result: ItemResult) -> ItemResult:
        self.results.append(result)
        return result

    def _fan_out(self) -> Iterator[ItemResult]:
        """Make the images ready, then submit items as workers free up, yielding each result as it comes; on
        any way out before the end, stop everything this batch started."""
        batch = self._batch
        workers = batch.options.workers
        pending: Pending = {}
        with futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pvisor-host-item") as pool:
            try:
                for spec in self._images:
                    with contextlib.suppress(PvisorHostError):  # kept, and reported by each item of that image
                        batch.prepare_ahead(spec)
                if batch.window is not None:
                    batch.window.start()
                for item in self._items:
                    if batch.full is not None:
                        batch.skip_image(item.spec)
                        yield self._done(_not_started(item, f"not started: {batch.full.message}"))
                        continue
                    remaining = batch.remaining()
                    if remaining is not None and remaining <= 0:
                        batch.skip_image(item.spec)
                        late = ItemResult(
                            id=item.id,
                            line=item.line,
                            agent=item.spec.agent,
                            status="not_run",
                            repeat_of=item.repeat_of,
                        )
                        yield self._done(late)
                        continue
                    while len(pending) >= 2 * workers:
                        yield from self._harvest(pending, timeout=0.2)
                    self._check_stop()
                    pending[pool.submit(_run_item, item, batch)] = item
                    yield from self._harvest(pending, timeout=0)
                while pending:
                    yield from self._harvest(pending, timeout=0.2)
                self._every_item_ended = True
            except BaseException:
                # Ctrl-C, SIGTERM, cancel(), a closed iterator, or anything else going wrong here: nothing this
                # batch started may outlive it.
                with deferred_interrupts():  # a second Ctrl-C must not cut the cleanup short
                    self._cancel(pending)
                raise

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Cancelled

    def _harvest(self, pending: Pending, *, timeout: float) -> Iterator[ItemResult]:
        self._check_stop()
        finished, _ = futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)
        for future in finished:
            del pending[future]
            yield self._done(future.result())

    def _cancel(self, pending: Pending) -> None:
        """Stop everything this batch started, and wait for the workers to record it."""
        if pending:
            logger.warning("interrupted: stopping {} items and removing their sandboxes", len(pending))
        batch = self._batch
        batch.cancel.set()
        started = []
        for future, item in pending.items():
            if future.cancel():
                self._done(_interrupted(item, "not started"))
            else:
                started.append(future)
        if started:
            batch.backend.cancel()
        for future in futures.as_completed(started):
            self._done(future.result())


def run_batch(
    items: Iterable[BatchItem],
    backend: AnyBackend,
    options: BatchOptions,
    *,
    total: int,
    images: Iterable[ReplaySpec] = (),
    task_images: dict[str, int] | None = None,
    reports: Sequence[BatchReport] = (),
    progress: Callable[[ItemResult], None] | None = None,
    on_pull: Callable[[PullProgress], None] | None = None,
) -> BatchOutcome:
    """Run every item (see :class:`BatchRun`) to the end and return the outcome; ``progress`` is called with
    each result as it comes, ``on_pull`` as task images arrive. Ctrl-C or SIGTERM cancels the batch; the
    outcome then says ``interrupted``.

    Raises:
        UsageError: another batch is running in ``options.out``.
    """
    run = BatchRun(
        items, backend, options, total=total, images=images, task_images=task_images, reports=reports,
        on_pull=on_pull,
    )  # fmt: skip
    try:
        for result in run:
            if progress is not None:
                try:
                    progress(result)
                except Exception as exc:  # a display problem must not stop the batch
                    logger.opt(exception=exc).debug("progress display failed")
    except KeyboardInterrupt:
        if run.outcome is None:  # interrupted while showing progress: end the batch first
            run.close()
    if run.outcome is None:
        run.close()
    assert run.outcome is not None
    return run.outcome


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    with (out / ".pvisor-host-batch.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"--out {out}: another batch is running in this directory") from None
        yield


#: Items submitted and not yet harvested.
Pending = dict[futures.Future[ItemResult], BatchItem]


def _not_started(item: BatchItem, message: str) -> ItemResult:
    return ItemResult(
        id=item.id, line=item.line, agent=item.spec.agent, status="not_run", message=message, repeat_of=item.repeat_of
    )


def _disk_full_line(full: DiskFull, out: Path, results: list[ItemResult]) -> str:
    """One line: which filesystem is full, and about how much one item needs (what finished items used)."""
    used = sorted(tree_bytes(out / r.id) for r in results if r.status == "ok" and not r.skipped)
    need = f"about {format_size(used[len(used) // 2])}" if used else f"more than {format_size(full.free)}"
    return f"{full.message}; each item here needs {need}; free space and run the same command again to finish"


def _interrupted(item: BatchItem, message: str) -> ItemResult:
    return ItemResult(
        id=item.id, line=item.line, agent=item.spec.agent, status="interrupted", category="interrupted",
        message=message, repeat_of=item.repeat_of,
    )  # fmt: skip


def _run_item(item: BatchItem, batch: _Batch) -> ItemResult:
    """One item, in a worker thread: resume decision, host checks, attempts. Never raises."""
    with logger.contextualize(item=item.id):
        result = _item_outcome(item, batch)
    return result.model_copy(update={"repeat_of": item.repeat_of}) if item.repeat_of else result


def _item_outcome(item: BatchItem, batch: _Batch) -> ItemResult:
    asked = threading.Event()  # whether it asked for its task image (else the window is told it never will)
    try:
        return _outcome(item, batch, asked)
    finally:
        if not asked.is_set():
            batch.skip_image(item.spec)


def _outcome(item: BatchItem, batch: _Batch, asked: threading.Event) -> ItemResult:
    base = ItemResult(
        id=item.id, line=item.line, after_step=item.spec.after_step, agent=item.spec.agent, image=item.spec.image,
        status="rejected", path=item.id,
    )  # fmt: skip
    if batch.cancel.is_set():
        return _interrupted(item, "not started")
    if batch.full is not None:
        return _not_started(item, f"not started: {batch.full.message}")
    remaining = batch.remaining()
    if remaining is not None and remaining <= 0:
        return base.model_copy(update={"status": "not_run", "path": None})
    spec = item.spec
    run_dir = batch.options.out / item.id
    try:
        with full_disk_raises(run_dir):
            trajectory = check_file(spec.trajectory)
            earlier = _finished_before_its_image(item, batch, trajectory.sha256)
            if earlier is not None:
                return earlier.model_copy(update={"id": item.id, "line": item.line, "path": item.id})
            if batch.want_image(spec):  # its pull may start while the trajectory's pre-flight runs on the host
                check_inputs(spec, per_file=True, run_id=item_run_id(item.id), out_dir=run_dir, trajectory=trajectory)
            asked.set()  # refused before: the window hears the item never asks (see _item_outcome)
            waiting = time.monotonic()
            with batch.task_image(spec):
                pull_wait = round(time.monotonic() - waiting, 4)  # the task image is here (pulled, or waited for)
                image = batch.image(spec)
                key = content_key(spec, trajectory.sha256, image.image, batch.workspace_sha256(spec.workspace_dir))
                earlier = finished_result(run_dir, key, batch.options.rerun_failed)
                if earlier is not None:
                    return earlier.model_copy(update={"id": item.id, "line": item.line, "path": item.id})
                remaining = batch.remaining()  # again: the wait for its image may have taken the rest
                if remaining is not None and remaining <= 0:
                    return base.model_copy(update={"status": "not_run", "path": None})
                set_aside(batch.options.out, item.id)
                if remaining is not None:  # the replay, then its verifier, within what is left
                    timeout = max(1.0, min(spec.timeout, remaining))
                    verify = max(1.0, min(spec.verify_timeout, remaining - timeout))
                    spec = spec.model_copy(update={"timeout": timeout, "verify_timeout": verify})
                checked = check_inputs(
                    spec, per_file=True, run_id=item_run_id(item.id), out_dir=run_dir, trajectory=trajectory
                )
                prepared = prepare(checked, batch.backend, image=image)
                if spec.image is not None:  # the time it waited for its task image (pulled just in time)
                    prepared = prepared.model_copy(update={"timings": {"pull_wait": pull_wait, **prepared.timings}})
                batch.warn_once(runtime_floor_warning(prepared))
                record = run_attempts(
                    prepared,
                    batch.backend,
                    gateway=batch.gateway(spec.continuation, prepared.user),
                    policy=RetryPolicy.for_spec(spec, infra=True, oom=batch.options.retry_oom),
                    cancel=batch.cancel,
                    batch=BatchInfo(item_id=item.id, line=item.line, content_key=key, repeat_of=item.repeat_of),
                )
    except Interrupted as exc:
        return _interrupted(item, exc.one_line()).model_copy(update={"path": item.id})
    except DiskFull as exc:  # also a write of our own that found no space (full_disk_raises)
        batch.full = batch.full or exc
        return base.model_copy(update={"status": "infra_error", "category": DISK_FULL, "message": exc.one_line()})
    except PvisorHostError as exc:
        status = "infra_error" if isinstance(exc, InfrastructureError) else "rejected"
        return base.model_copy(update={"status": status, "category": exc.category, "message": exc.one_line()})
    except Exception as exc:  # one item's bug must not stop the batch
        logger.opt(exception=exc).error("item {} failed unexpectedly", item.id)
        return base.model_copy(update={"status": "infra_error", "category": "internal", "message": repr(exc)})
    if record.failure is not None and record.failure.disk_full:
        batch.full = batch.full or disk_full(run_dir)
    return item_result(record, item_id=item.id, line=item.line, run_dir=run_dir)


def _finished_before_its_image(item: BatchItem, batch: _Batch, trajectory_sha256: str) -> ItemResult | None:
    """An item of a task image that finished in an earlier run with the same content key, told without pulling
    the image: its key needs only the image's id, which the engine or the registry's manifest gives, and the
    agent image its runtime came from, which the batch made ready already. None: it is to run (or to tell,
    once its image is here)."""
    spec = item.spec
    if batch.window is None or spec.image is None or spec.image not in batch.window:
        return None
    run_dir = batch.options.out / item.id
    try:
        earlier = load_record(run_dir / "record.json")
    except (OSError, ValueError):
        return None
    identity = batch.window.identity(spec.image)
    if identity is None:
        return None
    image = earlier.image.model_copy(update={"id": identity, "agent_image": batch.agent_tag(spec)})
    key = content_key(spec, trajectory_sha256, image, batch.workspace_sha256(spec.workspace_dir))
    return finished_result(run_dir, key, batch.options.rerun_failed)


def _on_nodes(pulls: ImageStats, node_pulls: int | None, budget: int | None) -> None:
    """A cluster's figures: its images were resolved here and pulled by the nodes, each within ``budget`` on its
    own (``cluster status`` shows each node's peak); nothing was downloaded, held or removed here."""
    if node_pulls is None:
        return
    pulls.node_pulls = node_pulls
    pulls.downloaded = pulls.removed = pulls.peak = 0
    pulls.pull_seconds = 0.0
    pulls.budget = budget
