"""Fan-out: many replays across many sandboxes, resumable, with nothing lost and nothing leaked.

:func:`run_batch` streams :class:`~pvisor_host.fanout.manifest.BatchItem` s onto a pool of worker threads
that share one backend (no subprocess per item). A worker runs one item's pipeline (:mod:`.item`: its resume
decision, its host checks, the image made ready once for every item that shares it, its attempts in fresh
sandboxes); others create, run and collect meanwhile. At most ``2 × workers`` items are in flight, so a long
manifest is never all in memory. Resume rules: :mod:`.resume`.

Cancellation (Ctrl-C, SIGTERM): no new item starts, the backend stops every running sandbox of this batch,
the records of finished items stay, every item not reached gets a ``not_run`` row, and the summary says
``interrupted``.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import fcntl
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

from .._log import logger
from ..backend.base import AnyBackend
from ..errors import DiskFull, PvisorHostError, UsageError
from ..files.space import disk_full, is_full, tree_bytes
from ..models.batch import BatchSummary, ImageStats, ItemResult
from ..models.image import PullProgress
from ..models.spec import ReplaySpec
from ..signals import deferred_interrupts
from ..units import format_size
from .compare import run_flaky
from .images import ImageWindow
from .item import BatchContext, Rows, base_result, interrupted_result, run_item
from .manifest import BatchItem
from .options import BatchOptions, fit_workers
from .summary import BatchReport, summarize, write_reports


class BatchOutcome(BaseModel):
    """What :func:`run_batch` returns (and wrote as ``summary.json`` and ``junit.xml``)."""

    results: list[ItemResult]
    summary: BatchSummary


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
        memory: int | None = None,
    ) -> None:
        self._workers = options.workers or 1
        """Sandboxes at a time: decided when the batch starts (:meth:`_start`)."""
        self._memory = memory
        """The memory every item gets unless its own line says otherwise (what the default workers are sized
        by; None: the replay's default)."""
        self._task_images = task_images
        self._on_pull = on_pull
        self._items = iter(items)
        self._waiting: BatchItem | None = None
        """An item taken from ``items`` and not yet submitted (it waits for a worker)."""
        self._images = list(images)
        self._reports = reports
        self._total = total
        self._batch = BatchContext(
            backend, out=options.out, build=options.build, deadline=options.deadline,
            rerun_failed=options.rerun_failed, retry_oom=options.retry_oom,
        )  # fmt: skip
        self._options = options
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
        options = self._options
        options.out.mkdir(parents=True, exist_ok=True)
        started_at = datetime.now(UTC)
        interrupt: BaseException | None = None
        with _exclusive(options.out):
            self._sweep_earlier()
            self._start()
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
                if interrupt is not None and not self._every_item_ended:
                    self._not_started()
                self.results.sort(key=lambda r: (r.line, r.after_step or 0, r.id))
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
                stopped = self._batch.stopped
                if isinstance(stopped, DiskFull):
                    summary.stopped = _disk_full_line(stopped, options.out, self.results)
                elif stopped is not None:
                    summary.stopped = f"{stopped.one_line()}; run the same command again once it answers to finish"
                if any(r.repeat_of for r in self.results):
                    summary.flaky = run_flaky(options.out, self.results)
                try:
                    write_reports(options.out, self.results, summary, more=self._reports)
                except OSError as exc:
                    if not is_full(exc):
                        raise
                    logger.error("could not write the batch's reports: {}", disk_full(options.out).message)
                self.outcome = BatchOutcome(results=self.results, summary=summary)
        if isinstance(interrupt, KeyboardInterrupt) and not self._every_item_ended:
            raise interrupt

    def _start(self) -> None:
        """What the batch takes of the engine, decided once it holds its directory and a dead run's leftovers
        are gone: its sandboxes at a time (:func:`~.options.fit_workers`) and, with task images, its share of
        the engine's image cache (its budget is noted for every other batch from now on)."""
        backend = self._batch.backend
        memory = self._memory if self._memory is not None else int(ReplaySpec.model_fields["memory"].default)
        self._options = fit_workers(self._options, backend, memory)
        self._workers = self._options.workers or 1
        if self._task_images:
            options = self._options
            specs = {spec.image: spec for spec in self._images if spec.image is not None}
            self._batch.window = ImageWindow(
                backend, self._task_images, budget=backend.image_budget(options.image_budget),
                workers=options.pull_workers, keep=options.keep_images, progress=self._on_pull,
                open_images=backend.capacity(),  # a cluster: its nodes pull, one per slot
                ready=lambda ref: self._batch.image(specs[ref]) if ref in specs else None,
            )  # fmt: skip

    def _sweep_earlier(self) -> None:
        """Remove what an earlier run into this directory left in the engine when it died (``kill -9``): its
        sandboxes would run on to their own deadline, taking slots and memory. Said in one line."""
        try:
            swept = self._batch.backend.sweep(out=self._options.out)
        except PvisorHostError as exc:
            logger.warning("could not look for what an earlier run into {} left: {}", self._options.out, exc)
            return
        if swept.orphans:
            kinds = Counter(resource.kind for resource in swept.orphans)
            what = ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in sorted(kinds.items()))
            failed = f" ({len(swept.failed)} could not be removed: pvisor-host gc)" if swept.failed else ""
            logger.warning("removed what a dead earlier run into {} left: {}{}", self._options.out, what, failed)

    def _not_started(self) -> None:
        """The items the batch never reached before it was stopped: a row each, ``not_run`` (so every item has
        one, and the counts add up to the batch's items)."""
        waiting = [self._waiting] if self._waiting is not None else []
        for item in itertools.chain(waiting, self._items):
            self.results.extend(base_result(item, "not_run", message="not started: the batch was stopped first"))

    def _done(self, rows: Rows) -> Rows:
        """An item's rows, kept (one, or one per fork)."""
        self.results.extend(rows)
        return rows

    def _fan_out(self) -> Iterator[ItemResult]:
        """Make the images ready, then submit items as workers free up, yielding each result as it comes; on
        any way out before the end, stop everything this batch started."""
        batch = self._batch
        workers = self._workers
        pending: Pending = {}
        with futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pvisor-host-item") as pool:
            try:
                for spec in self._images:
                    with contextlib.suppress(PvisorHostError):  # kept, and reported by each item of that image
                        batch.prepare_ahead(spec)
                if batch.window is not None:
                    batch.window.start()
                for item in self._items:
                    if batch.stopped is not None:
                        batch.skip_image(item.spec)
                        message = f"not started: {batch.stopped.message}"
                        yield from self._done(base_result(item, "not_run", message=message))
                        continue
                    remaining = batch.remaining()
                    if remaining is not None and remaining <= 0:
                        batch.skip_image(item.spec)
                        late = "the batch deadline passed before it started"
                        yield from self._done(base_result(item, "not_run", message=late))
                        continue
                    self._waiting = item
                    while len(pending) >= 2 * workers:
                        yield from self._harvest(pending, timeout=0.2)
                    self._check_stop()
                    pending[pool.submit(run_item, item, batch)] = item
                    self._waiting = None
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
            yield from self._done(future.result())

    def _cancel(self, pending: Pending) -> None:
        """Stop everything this batch started, and wait for the workers to record it."""
        if pending:
            logger.warning("interrupted: stopping {} items and removing their sandboxes", len(pending))
        batch = self._batch
        batch.cancel.set()
        started = []
        for future, item in pending.items():
            if future.cancel():
                self._done(interrupted_result(item, "not started"))
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
    memory: int | None = None,
) -> BatchOutcome:
    """Run every item (see :class:`BatchRun`) to the end and return the outcome; ``progress`` is called with
    each result as it comes, ``on_pull`` as task images arrive. Ctrl-C or SIGTERM cancels the batch; the
    outcome then says ``interrupted``.

    Raises:
        UsageError: another batch is running in ``options.out``.
    """
    run = BatchRun(
        items, backend, options, total=total, images=images, task_images=task_images, reports=reports,
        on_pull=on_pull, memory=memory,
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
Pending = dict[futures.Future[Rows], BatchItem]


def _disk_full_line(full: DiskFull, out: Path, results: list[ItemResult]) -> str:
    """One line: which filesystem is full, and about how much one item needs (what finished items used)."""
    used = sorted(tree_bytes(out / r.id) for r in results if r.status == "ok" and not r.skipped)
    need = f"about {format_size(used[len(used) // 2])}" if used else f"more than {format_size(full.free)}"
    return f"{full.message}; each item here needs {need}; free space and run the same command again to finish"


def _on_nodes(pulls: ImageStats, node_pulls: int | None, budget: int | None) -> None:
    """A cluster's figures: its images were resolved here and pulled by the nodes, each within ``budget`` on its
    own (``cluster status`` shows each node's peak); nothing was downloaded, held or removed here."""
    if node_pulls is None:
        return
    pulls.node_pulls = node_pulls
    pulls.downloaded = pulls.removed = pulls.peak = 0
    pulls.pull_seconds = 0.0
    pulls.budget = budget
