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
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from loguru import logger
from pydantic import BaseModel

from ..backend.base import Backend, ModelGateway
from ..errors import InfrastructureError, Interrupted, PvisorHostError, UsageError
from ..files.digest import tree_sha256
from ..models.image import BuildOptions, ImageRequest, ResolvedImage
from ..models.profiles import get_profile
from ..models.record import BatchInfo
from ..models.spec import ModelUpstream, ReplaySpec
from ..preflight.checks import check_inputs
from ..preflight.prepare import prepare, prepare_image
from ..preflight.trajectory import check_file
from ..replay.attempts import RetryPolicy, run_attempts
from ..signals import deferred_interrupts
from .manifest import BatchItem
from .memo import Memo
from .report import BatchSummary, ItemResult, summarize, write_reports
from .resume import content_key, finished_result, item_result, item_run_id, set_aside

ImageKey = tuple[str | None, str | None, bool]


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


class BatchOutcome(BaseModel):
    """What :func:`run_batch` returns (and wrote as ``summary.json`` and ``junit.xml``)."""

    results: list[ItemResult]
    summary: BatchSummary


def default_workers(memory: int) -> int:
    """Sandboxes at a time: two per CPU, as many as the host's memory holds at ``memory`` each, at most 32."""
    cpus = os.cpu_count() or 1
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * 1024**3
    return max(1, min(2 * cpus, total // max(memory, 1), 32))


def image_key(spec: ReplaySpec) -> ImageKey:
    """Items with the same key share one image."""
    return spec.image, spec.agent, spec.inject


def image_request(spec: ReplaySpec) -> ImageRequest:
    """The image an item asks for (its agent's profile resolved)."""
    profile = get_profile(spec.agent) if spec.agent is not None else None
    return ImageRequest(image=spec.image, profile=profile, inject=spec.inject)


class _Batch:
    """What the workers of one batch share."""

    def __init__(self, backend: Backend, options: BatchOptions) -> None:
        self.backend = backend
        self.options = options
        self.cancel = threading.Event()
        self.started = time.monotonic()
        self._images: Memo[ResolvedImage] = Memo()
        self._gateways: Memo[ModelGateway] = Memo()
        self._workspaces: Memo[str] = Memo()

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        if self.options.deadline is None:
            return None
        return self.options.deadline - (time.monotonic() - self.started)

    def image(self, spec: ReplaySpec) -> ResolvedImage:
        def resolve() -> ResolvedImage:
            return prepare_image(self.backend, image_request(spec), self.options.build)

        return self._images.get(image_key(spec), resolve)

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


def run_batch(
    items: Iterable[BatchItem],
    backend: Backend,
    options: BatchOptions,
    *,
    total: int,
    images: Iterable[ReplaySpec] = (),
    progress: Callable[[ItemResult], None] | None = None,
) -> BatchOutcome:
    """Run every item (see the module docstring) and write ``summary.json`` and ``junit.xml``.

    The images of ``images`` (specs, one per distinct image) are made ready first, in the calling thread,
    so that Ctrl-C during a build stops it at once; an image that cannot be made fails its items only.
    ``progress`` is called from the calling thread as each item finishes. Ctrl-C or SIGTERM cancels the
    batch as described above; the outcome then says ``interrupted``.

    Raises:
        UsageError: another batch is running in ``options.out``.
    """
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(UTC)
    batch = _Batch(backend, options)
    results: list[ItemResult] = []
    with _exclusive(out):
        try:
            interrupted = _fan_out(items, images, batch, results, progress)
        except BaseException:
            with deferred_interrupts():
                batch.close()
            raise
        # Every item has ended: a Ctrl-C now has nothing left to stop and must not cost the reports.
        with deferred_interrupts(reraise=False):
            batch.close()
            results.sort(key=lambda r: r.line)
            remaining = batch.remaining()
            summary = summarize(
                results,
                total=total,
                started=started_at,
                finished=datetime.now(UTC),
                interrupted=interrupted,
                deadline=remaining is not None and remaining <= 0,
            )
            write_reports(out, results, summary)
    return BatchOutcome(results=results, summary=summary)


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


def _fan_out(
    items: Iterable[BatchItem],
    images: Iterable[ReplaySpec],
    batch: _Batch,
    results: list[ItemResult],
    progress: Callable[[ItemResult], None] | None,
) -> bool:
    """Make the images ready, then submit items as workers free up; on Ctrl-C/SIGTERM cancel everything.
    Returns True when interrupted."""
    workers = batch.options.workers
    pending: Pending = {}

    def done(result: ItemResult) -> None:
        results.append(result)
        if progress is not None:
            try:
                progress(result)
            except Exception as exc:  # a display problem must not stop the batch
                logger.opt(exception=exc).debug("progress display failed")

    with futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pvisor-host-item") as pool:
        try:
            for spec in images:
                with contextlib.suppress(PvisorHostError):  # kept, and reported by each item of that image
                    batch.image(spec)
            for item in items:
                remaining = batch.remaining()
                if remaining is not None and remaining <= 0:
                    done(ItemResult(id=item.id, line=item.line, agent=item.spec.agent, status="not_run"))
                    continue
                while len(pending) >= 2 * workers:
                    _harvest(pending, done, timeout=1.0)
                pending[pool.submit(_run_item, item, batch)] = item
                _harvest(pending, done, timeout=0)
            while pending:
                _harvest(pending, done, timeout=1.0)
        except BaseException as exc:
            # Ctrl-C, SIGTERM, or anything else going wrong here: nothing this batch started may outlive it.
            with deferred_interrupts():  # a second Ctrl-C must not cut the cleanup short
                _cancel(batch, pending, done)
            if isinstance(exc, KeyboardInterrupt):
                return True
            raise
    return False


def _harvest(pending: Pending, done: Callable[[ItemResult], None], *, timeout: float) -> None:
    finished, _ = futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)
    for future in finished:
        del pending[future]
        done(future.result())


def _cancel(batch: _Batch, pending: Pending, done: Callable[[ItemResult], None]) -> None:
    """Stop everything this batch started, and wait for the workers to record it."""
    logger.warning("interrupted: stopping {} items and removing their sandboxes", len(pending))
    batch.cancel.set()
    started = []
    for future, item in pending.items():
        if future.cancel():
            done(_interrupted(item, "not started"))
        else:
            started.append(future)
    batch.backend.cancel()
    for future in futures.as_completed(started):
        done(future.result())


def _interrupted(item: BatchItem, message: str) -> ItemResult:
    return ItemResult(
        id=item.id, line=item.line, agent=item.spec.agent, status="interrupted", category="interrupted", message=message
    )


def _run_item(item: BatchItem, batch: _Batch) -> ItemResult:
    """One item, in a worker thread: resume decision, host checks, attempts. Never raises."""
    with logger.contextualize(item=item.id):
        return _item_outcome(item, batch)


def _item_outcome(item: BatchItem, batch: _Batch) -> ItemResult:
    base = ItemResult(id=item.id, line=item.line, agent=item.spec.agent, status="rejected", path=item.id)
    if batch.cancel.is_set():
        return _interrupted(item, "not started")
    remaining = batch.remaining()
    if remaining is not None and remaining <= 0:
        return base.model_copy(update={"status": "not_run", "path": None})
    spec = item.spec
    run_dir = batch.options.out / item.id
    try:
        trajectory = check_file(spec.trajectory)
        image = batch.image(spec)
        key = content_key(spec, trajectory.sha256, image.image, batch.workspace_sha256(spec.workspace_dir))
        earlier = finished_result(run_dir, key, batch.options.rerun_failed)
        if earlier is not None:
            return earlier.model_copy(update={"id": item.id, "line": item.line, "path": item.id})
        set_aside(batch.options.out, item.id)
        if remaining is not None:
            spec = spec.model_copy(update={"timeout": max(1.0, min(spec.timeout, remaining))})
        checked = check_inputs(
            spec, host_pvisor=False, run_id=item_run_id(item.id), out_dir=run_dir, trajectory=trajectory
        )
        prepared = prepare(checked, batch.backend, image=image)
        record = run_attempts(
            prepared,
            batch.backend,
            gateway=batch.gateway(spec.continuation, prepared.user),
            policy=RetryPolicy.for_spec(spec, infra=True, oom=batch.options.retry_oom),
            cancel=batch.cancel,
            batch=BatchInfo(item_id=item.id, line=item.line, content_key=key),
        )
    except Interrupted as exc:
        return _interrupted(item, exc.one_line()).model_copy(update={"path": item.id})
    except PvisorHostError as exc:
        status = "infra_error" if isinstance(exc, InfrastructureError) else "rejected"
        category = exc.exit_code.name.lower()
        return base.model_copy(update={"status": status, "category": category, "message": exc.one_line()})
    except Exception as exc:  # one item's bug must not stop the batch
        logger.opt(exception=exc).error("item {} failed unexpectedly", item.id)
        return base.model_copy(update={"status": "infra_error", "category": "internal", "message": repr(exc)})
    return item_result(record, item_id=item.id, line=item.line)
