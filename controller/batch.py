"""Fan-out: many replays across many containers, resumable, with nothing lost and nothing leaked.

:func:`run_batch` streams :class:`~pvisor_host.manifest.BatchItem` s onto a pool of worker threads that
share one engine client (no subprocess per item). A worker does the item's host checks, takes the image
resolved once for every item that shares it (building it if needed), and runs the item's attempts in
fresh sandboxes; others create, run and collect meanwhile. At most ``2 × workers`` items are in flight,
so a long manifest is never all in memory.

Resume: each item has a content key — sha256 over the trajectory's sha256, the image id (and the agent
image an injected runtime comes from), the workspace directory's content and every option that changes
the outcome. An item whose directory holds a complete record with the same key is skipped (unless it
failed and ``rerun_failed``); anything else in its directory is moved to ``.previous/<id>/<time>/``
first, so nothing is lost. Records are written atomically.

Cancellation (Ctrl-C, SIGTERM): no new item starts, every running sandbox of this batch is killed and
removed, the records of finished items stay, and the summary says ``interrupted``.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Generic, TypeVar

import docker
import requests
from docker.errors import APIError
from docker.models.containers import Container
from loguru import logger
from pydantic import BaseModel

from . import labels as L
from .attempts import RetryPolicy, gateway_config, run_attempts, start_gateway
from .build import BuiltImage
from .collect import hash_file
from .errors import InfrastructureError, Interrupted, PvisorHostError, UsageError
from .gateway import Gateway
from .manifest import BatchItem
from .preflight import check_inputs, prepare, resolve_image
from .record import BatchInfo, ImageRef, ReplayRecord, load_record
from .report import FINAL_STATUSES, BatchSummary, ItemResult, summarize, write_reports
from .signals import deferred_interrupts
from .spec import ReplaySpec
from .stage import STAGING_NAME, remove_staging
from .trajectory import check_file

#: Options that do not change an item's outcome, so changing them does not rerun it.
NOT_OUTCOME = {
    "trajectory", "out", "run_id", "workspace_dir", "attempts", "retry_backoff", "model_body_limit", "no_model_bodies"
}  # fmt: skip

V = TypeVar("V")
ResolvedImage = tuple[ImageRef, BuiltImage | None]
ImageKey = tuple[str | None, str | None, bool]


class BatchOptions(BaseModel):
    """How to run a batch (the ``batch`` command's own options)."""

    out: Path
    """The batch directory: ``<out>/<item id>/`` per item, ``summary.json``, ``junit.xml``."""
    workers: int
    """Items (containers) at a time."""
    deadline: float | None = None
    """Seconds for the whole batch: no item starts after it, running ones are cut at it."""
    rerun_failed: bool = False
    """Rerun items that finished with a failure (by default only missing, incomplete or changed ones rerun)."""
    retry_oom: bool = False
    """Retry an attempt killed for memory (infrastructure errors and retryable results always are)."""
    base: str | None = None
    """Base image for agent images that must be built."""
    ca_bundle: Path | None = None
    """CA bundle for agent images that must be built."""


class BatchOutcome(BaseModel):
    """What :func:`run_batch` returns (and wrote as ``summary.json`` and ``junit.xml``)."""

    results: list[ItemResult]
    summary: BatchSummary


def default_workers(memory: int) -> int:
    """Containers at a time: two per CPU, as many as the host's memory holds at ``memory`` each, at most 32."""
    cpus = os.cpu_count() or 1
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * 1024**3
    return max(1, min(2 * cpus, total // max(memory, 1), 32))


def content_key(spec: ReplaySpec, trajectory_sha256: str, image: ImageRef, workspace_sha256: str | None) -> str:
    """The item's identity for resuming (see the module docstring)."""
    material = {
        "options": spec.model_dump(mode="json", exclude=NOT_OUTCOME),
        "trajectory": trajectory_sha256,
        "image": image.id,
        "agent_image": image.agent_image,
        "workspace": workspace_sha256,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def tree_sha256(root: Path) -> str:
    """A digest of a directory's names, kinds, executable bits and contents (symlinks by target)."""
    digest = hashlib.sha256()
    for directory, children, files in os.walk(root):
        children.sort()
        for name in sorted(files) + [c + "/" for c in children]:
            path = Path(directory, name.rstrip("/"))
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                digest.update(f"L {relative} {os.readlink(path)}\n".encode())
            elif name.endswith("/"):
                digest.update(f"D {relative}\n".encode())
            elif path.is_file():
                executable = os.access(path, os.X_OK)
                digest.update(f"F {relative} {executable} {hash_file(path)[1]}\n".encode())
    return digest.hexdigest()


def image_key(spec: ReplaySpec) -> ImageKey:
    """Items with the same key share one resolved image."""
    return spec.image, spec.agent, spec.inject


def item_result(record: ReplayRecord, *, item_id: str, line: int, skipped: bool = False) -> ItemResult:
    """An item's result from its record."""
    return ItemResult(
        id=item_id,
        line=line,
        agent=record.inputs.agent,
        status=record.status,
        category=record.failure.category if record.failure else None,
        message=record.failure.message if record.failure else None,
        timings=record.timings,
        attempts=max(1, len(record.attempts)),
        skipped=skipped,
        path=item_id,
    )


def finished_result(run_dir: Path, key: str, rerun_failed: bool) -> ItemResult | None:
    """The earlier result of an item, if its record is complete, has the same key and need not rerun."""
    try:
        record = load_record(run_dir / "record.json")
    except (OSError, ValueError):
        return None
    if record.batch is None or record.batch.content_key != key or record.status not in FINAL_STATUSES:
        return None
    if rerun_failed and record.status != "ok":
        return None
    return item_result(record, item_id=record.batch.item_id, line=record.batch.line, skipped=True)


class Memo(Generic[V]):
    """Values computed once per key, safely across threads (images, gateways, workspace digests); a
    :class:`PvisorHostError` is remembered too and raised again for every later caller of that key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[Hashable, threading.Lock] = {}
        self._values: dict[Hashable, V | PvisorHostError] = {}

    def get(self, key: Hashable, compute: Callable[[], V]) -> V:
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                try:
                    self._values[key] = compute()
                except PvisorHostError as exc:
                    self._values[key] = exc
            value = self._values[key]
        if isinstance(value, PvisorHostError):
            raise value
        return value

    def values(self) -> list[V]:
        with self._lock:
            return [v for v in self._values.values() if not isinstance(v, PvisorHostError)]


class _Batch:
    """What the workers of one batch share."""

    def __init__(self, client: docker.DockerClient, options: BatchOptions) -> None:
        self.client = client
        self.options = options
        self.cancel = threading.Event()
        self.started = time.monotonic()
        self._images: Memo[ResolvedImage] = Memo()
        self._gateways: Memo[Gateway] = Memo()
        self._workspaces: Memo[str] = Memo()

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        if self.options.deadline is None:
            return None
        return self.options.deadline - (time.monotonic() - self.started)

    def image(self, spec: ReplaySpec) -> ResolvedImage:
        def resolve() -> ResolvedImage:
            return resolve_image(self.client, spec, base=self.options.base, ca_bundle=self.options.ca_bundle)

        return self._images.get(image_key(spec), resolve)

    def gateway(self, spec: ReplaySpec, user: str) -> Gateway | None:
        config = gateway_config(spec)
        if config is None:
            return None
        return self._gateways.get((config, user), lambda: start_gateway(config, self.client, user))

    def workspace_sha256(self, path: Path | None) -> str | None:
        if path is None:
            return None
        return self._workspaces.get(path, lambda: tree_sha256(path))

    def close(self) -> None:
        for gateway in self._gateways.values():
            gateway.close()


def run_batch(
    items: Iterable[BatchItem],
    client: docker.DockerClient,
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
    batch = _Batch(client, options)
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
    _kill_running(batch.client)
    for future in futures.as_completed(started):
        done(future.result())


def _interrupted(item: BatchItem, message: str) -> ItemResult:
    return ItemResult(
        id=item.id, line=item.line, agent=item.spec.agent, status="interrupted", category="interrupted", message=message
    )


def _kill_running(client: docker.DockerClient) -> None:
    """Kill (in parallel) every running replay container of this controller; their workers remove them."""
    filters = {"label": [f"{L.SESSION}={L.session()}", f"{L.ROLE}=replay"]}
    try:
        containers = client.containers.list(filters=filters)
    except (APIError, requests.exceptions.RequestException) as exc:
        logger.warning("could not list this batch's containers ({}); each worker removes its own", exc)
        return
    with futures.ThreadPoolExecutor(max_workers=16) as killers:
        for container in containers:
            killers.submit(_kill_quietly, container)


def _kill_quietly(container: Container) -> None:
    with contextlib.suppress(APIError, requests.exceptions.RequestException):
        container.kill()


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
        key = content_key(spec, trajectory.sha256, image[0], batch.workspace_sha256(spec.workspace_dir))
        earlier = finished_result(run_dir, key, batch.options.rerun_failed)
        if earlier is not None:
            return earlier.model_copy(update={"id": item.id, "line": item.line, "path": item.id})
        _set_aside(batch.options.out, item.id)
        if remaining is not None:
            spec = spec.model_copy(update={"timeout": max(1.0, min(spec.timeout, remaining))})
        checked = check_inputs(
            spec, host_pvisor=False, run_id=item_run_id(item.id), out_dir=run_dir, trajectory=trajectory
        )
        prepared = prepare(checked, batch.client, image=image)
        record = run_attempts(
            prepared,
            batch.client,
            gateway=batch.gateway(spec, prepared.user),
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


def _set_aside(out: Path, item_id: str) -> None:
    """Move whatever an earlier run left in the item's directory to ``.previous/<id>/<time>/``."""
    run_dir = out / item_id
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return
    # A controller killed mid-run leaves its staging behind, env.sh with secret values included: drop it.
    for staging in [run_dir / STAGING_NAME, *run_dir.glob(f"attempts/*/{STAGING_NAME}")]:
        remove_staging(staging)
    target = out / ".previous" / item_id / datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%f")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(target))


def item_run_id(item_id: str) -> str:
    """A run id for the item's first attempt: its id made pvisor-safe, plus a unique suffix."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', item_id)[:80]}-{secrets.token_hex(3)}"
