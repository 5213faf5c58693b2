"""The public Python API: replays, batches, images and cleanup, typed, for pipelines that embed replays.

Everything here validates and defaults exactly as the CLI does (through the same
:class:`~pvisor_host.models.spec.ReplaySpec`, the same host checks, the same backend), raises only
:class:`~pvisor_host.errors.PvisorHostError` s for requests it refuses, prints nothing and installs no
logging sink. Each call opens its own connection to the engine (``docker_host``, default ``DOCKER_HOST`` or
the local socket), so several batches may run at once in one process, against different engines, from
different threads.

A cluster batch (``cluster=``) is the exception, because Ray is: Ray allows one cluster connection per
process and reads its token from the process environment. While a cluster batch runs, the environment
holds Ray's token settings (put back as they were when it ends), and a second cluster batch in the same
process is refused with a :class:`~pvisor_host.errors.UsageError` in one line, as is one in a process where
the application called ``ray.init()`` itself. Run concurrent cluster batches in separate processes. A
batch never shuts down a Ray connection it did not open.

A batch is an iterator of each item's :class:`~pvisor_host.models.batch.ItemResult`, in completion order;
breaking out of it, calling :meth:`Batch.cancel`, or a ``KeyboardInterrupt`` stops and removes its running
sandboxes, keeps the records of the items that finished, and writes the reports. Running the same batch
into the same ``out`` again resumes it. :func:`abatch` is the same for asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from .attempts import run_replay
from .backend import AnyBackend, check_cluster_options, open_backend
from .backend.docker.mirrors import Mirrors
from .errors import UsageError
from .fanout.manifest import BatchItem, batch_items, by_image, image_specs
from .fanout.results import load_results
from .fanout.scheduler import BatchOptions, BatchRun, default_workers, fit_workers
from .models.batch import BatchSummary, ItemResult
from .models.housekeeping import GcReport
from .models.image import BuildOptions, BuildPlan, ImageRef
from .models.profiles import get_profile
from .models.record import ReplayRecord
from .models.spec import ReplaySpec, build_spec
from .preflight.checks import check_inputs
from .preflight.inspect import TrajectoryReport, inspect_files
from .preflight.prepare import prepare
from .report import write_report
from .units import parse_duration, parse_size

Entry = ReplaySpec | Mapping[str, Any]
"""A batch item: a spec, or a mapping of a manifest line's fields (``id`` included)."""


@contextlib.contextmanager
def _engine(docker_host: str | None, *, pool_size: int = 10, **where: Any) -> Iterator[AnyBackend]:
    """The backend, open for the block (``where``: ``cluster``, ``registry``, ``registry_mirror``,
    ``image_rewrites``, ``out``, as :func:`open_backend` takes them)."""
    backend = open_backend(pool_size=pool_size, docker_host=docker_host, **where)
    try:
        yield backend
    finally:
        backend.close()


def _pooled_engine(
    docker_host: str | None, pool_size: int, *, lent: AnyBackend | None, **where: Any
) -> contextlib.AbstractContextManager[AnyBackend]:
    """The backend a batch runs on: the one lent by the caller (left open), else one opened for it."""
    if lent is not None:
        return contextlib.nullcontext(lent)
    return _engine(docker_host, pool_size=pool_size, **where)


def replay(
    spec: ReplaySpec | None = None,
    /,
    *,
    build: BuildOptions | None = None,
    docker_host: str | None = None,
    **options: Any,
) -> ReplayRecord:
    """Replay one trajectory in a fresh hardened sandbox and return its record (also in its run directory).

    Pass a :class:`ReplaySpec`, or its fields as keywords (``trajectory=``, ``after_step=``, ``agent=``,
    ``mode=``, ..., the ``replay`` command's options with underscores). Every host check runs before the
    engine is asked. A replay that ran returns its record whatever its status (``ok``, ``replay_failed``,
    ``timeout``, ...).

    Raises:
        UsageError: the request is wrong (the message says what, and how to fix it).
        PrerequisiteError: no engine answers, or something else the host needs is missing.
        InfrastructureError: the engine or a build failed.
        Interrupted: Ctrl-C; the sandbox was removed and the record says ``interrupted``.
    """
    if spec is not None and options:
        raise UsageError("pass a ReplaySpec or its fields as keywords, not both")
    spec = spec if spec is not None else build_spec(**options)
    checked = check_inputs(spec)
    with _engine(docker_host) as backend:
        prepared = prepare(checked, backend, build=build)
        return run_replay(prepared, backend)


class Batch:
    """A batch of replays: iterate it to run it (see the module docstring). Use it as a context manager, or
    call :meth:`close`, to end it deterministically when you stop iterating early and still hold it."""

    def __init__(
        self,
        items: list[BatchItem],
        options: BatchOptions,
        *,
        backend: Callable[[int], contextlib.AbstractContextManager[AnyBackend]],
        fit_workers: bool = False,
    ) -> None:
        self._items = items
        self._options = options
        self._backend = backend
        """Opens the backend for a pool of so many threads (and closes it, unless it was lent by the caller)."""
        self._fit_workers = fit_workers
        self._run: BatchRun | None = None
        self._cancelled = False
        self._iterator: Generator[ItemResult, None, None] | None = None

    @property
    def items(self) -> list[BatchItem]:
        """The validated items, with their ids (each item's run directory is ``out/<id>/``)."""
        return list(self._items)

    @property
    def out(self) -> Path:
        """The batch directory."""
        return self._options.out

    @property
    def summary(self) -> BatchSummary | None:
        """``summary.json``, once the batch has ended (also when it was stopped)."""
        return self._run.outcome.summary if self._run is not None and self._run.outcome is not None else None

    def record(self, result: ItemResult) -> ReplayRecord | None:
        """The record of a finished item (None for an item that never ran)."""
        from .models.record import load_record

        path = self.out / (result.path or result.id) / "record.json"
        return load_record(path) if result.path and path.is_file() else None

    def __iter__(self) -> Iterator[ItemResult]:
        if self._iterator is not None:
            raise UsageError("a batch runs once; create a new one to run it again (it resumes)")
        self._iterator = self._results()
        return self._iterator

    def _results(self) -> Generator[ItemResult, None, None]:
        with self._backend(self._options.workers + 8) as backend:
            self._options = fit_workers(self._options, backend, given=not self._fit_workers)
            items, task_images = by_image(self._items)
            run = BatchRun(
                items,
                backend,
                self._options,
                total=len(items),
                images=image_specs(items),
                task_images=task_images,
                reports=(write_report,),
            )
            self._run = run
            if self._cancelled:
                run.cancel()
            yield from run

    def cancel(self) -> None:
        """Stop the batch (from any thread): no new item starts, the running sandboxes are stopped and removed,
        the iteration ends once they are."""
        self._cancelled = True
        if self._run is not None:
            self._run.cancel()

    def close(self) -> None:
        """Stop the batch if it still runs and wait until its sandboxes are removed and its reports written."""
        self.cancel()
        if self._iterator is not None:
            self._iterator.close()

    def __enter__(self) -> Batch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def batch(
    items: Iterable[Entry],
    *,
    out: Path | str,
    workers: int | None = None,
    defaults: Mapping[str, Any] | None = None,
    deadline: float | str | None = None,
    rerun_failed: bool = False,
    retry_oom: bool = False,
    build: BuildOptions | None = None,
    pull_workers: int = 2,
    image_budget: int | str | None = None,
    keep_images: bool = False,
    repeat: int = 1,
    docker_host: str | None = None,
    cluster: str | None = None,
    registry: str | None = None,
    registry_mirror: str | None = None,
    image_rewrites: list[str] | None = None,
    backend: AnyBackend | None = None,
) -> Batch:
    """A batch of replays, validated now and run as you iterate it (see the module docstring).

    Args:
        items: specs, or mappings of manifest-line fields (``id`` included); read once, now.
        out: the batch directory (``<out>/<id>/`` per item, ``summary.json``, ``junit.xml``); running into it
            again resumes: items that finished with the same inputs are not run again.
        workers: sandboxes at a time (default: two per CPU, within memory).
        defaults: fields every item gets unless it sets them (the ``batch`` command's replay options).
        deadline: seconds (or ``"6h"``) for the whole batch: no item starts after it, running ones are cut.
        rerun_failed: also rerun items that finished with a failure.
        retry_oom: retry attempts killed for memory.
        build: how an agent image that must be built is built.
        pull_workers: task images (``image``) pulled at once, ahead of their items (0: all of them first).
        image_budget: bytes (or ``"200g"``) the engine's image cache may take: the distinct layers of the task
            images pulled for batches, shared by every batch on the engine; images nobody uses are removed first
            (default: half of the engine storage's free space plus what the cache holds).
        keep_images: keep the task images the batch pulled when it ends (by default it removes them).
        repeat: run every item this many times, under ids of their own (``<id>.r1`` …); the summary's
            ``flaky`` lists the items whose repeats ended or left the workspace otherwise.
        docker_host: the engine (default ``DOCKER_HOST``, else the local socket); with ``cluster``, the engine
            that makes the images.
        cluster: ``HEAD:PORT`` of a Ray cluster of Docker hosts to run the items on (the ``ray`` extra; the
            token comes from ``RAY_AUTH_TOKEN``, this process must run on a machine of the cluster, and
            ``workers`` defaults to the cluster's engine slots); see docs/cluster.md.
        registry: with ``cluster``, where nodes pull images from by digest (default
            ``$PVISOR_HOST_REGISTRY``, else images travel through the cluster).
        registry_mirror: ``HOST[:PORT]`` of a mirror to pull Docker Hub's task images through (they keep their
            names).
        image_rewrites: ``FROM=TO`` image name prefixes: task images named ``FROM...`` are pulled from ``TO...``
            (the first match wins).
        backend: an open backend to run on instead (``docker_host``, ``cluster``, ``registry`` and the mirrors
            are then not used); it stays open afterwards: its caller closes it.

    Raises:
        UsageError: an item is wrong (the first, by position, and how many more), or an option is.
        PrerequisiteError: (when iterated) no engine answers, or the cluster is missing something it needs.
    """
    checked = batch_items(items, defaults, repeat=repeat)
    check_cluster_options(cluster, registry)  # now rather than when iterated; the backend checks again
    Mirrors.parse(registry_mirror, image_rewrites)
    options = BatchOptions.checked(
        out=Path(out).absolute(),
        workers=workers or default_workers(checked[0].spec.memory),
        deadline=parse_duration(deadline, flag="deadline") if isinstance(deadline, str) else deadline,
        rerun_failed=rerun_failed,
        retry_oom=retry_oom,
        build=build or BuildOptions(),
        pull_workers=pull_workers,
        image_budget=parse_size(image_budget, flag="image_budget") if isinstance(image_budget, str) else image_budget,
        keep_images=keep_images,
    )
    opener = functools.partial(
        _pooled_engine, docker_host, cluster=cluster, registry=registry, registry_mirror=registry_mirror,
        image_rewrites=image_rewrites, lent=backend, out=options.out,
    )  # fmt: skip
    return Batch(checked, options, backend=opener, fit_workers=workers is None)


_END = object()


async def abatch(items: Iterable[Entry], **options: Any) -> AsyncGenerator[ItemResult, None]:
    """:func:`batch` for asyncio: ``async for result in abatch(...)``. The batch runs in a worker thread, so
    the event loop is never blocked; leaving the loop early (use ``contextlib.aclosing`` to leave it
    deterministically), or cancelling the task, stops the batch and removes its sandboxes.

    Takes the same arguments as :func:`batch`.
    """
    run = batch(items, **options)
    results = iter(run)
    step: asyncio.Future[object] | None = None
    try:
        while True:
            step = asyncio.ensure_future(asyncio.to_thread(next, results, _END))
            result = await asyncio.shield(step)  # a cancelled task leaves the thread to finish its step
            step = None
            if result is _END:
                return
            assert isinstance(result, ItemResult)
            yield result
    finally:
        run.cancel()
        if step is not None and not step.done():
            await asyncio.wait([step])  # the batch notices the cancel within a moment, then this step ends
        await asyncio.to_thread(run.close)


def build(
    agent: str,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
    bootstrap: bool = False,
    docker_host: str | None = None,
) -> ImageRef:
    """The verified sandbox image for ``agent`` (pvisor and the pinned agent CLI), built only when missing.

    Raises:
        UsageError: an unknown agent, or one whose pinned runtime cannot be installed (the message says why).
        ImageBuildError: the build, or its verification, failed.
    """
    options = BuildOptions(base=base, ca_bundle=ca_bundle, force_bootstrap=bootstrap)
    with _engine(docker_host) as backend:
        return backend.ensure_image(BuildPlan(profile=get_profile(agent)), options).image


def inspect(*trajectories: Path | str, agent: str | None = None) -> list[TrajectoryReport]:
    """What each trajectory file is, as ``pvisor-host inspect`` shows it: its agent (detected unless given) and
    recorded version, pvisor's count of its boundaries, the tools of each batch, the recorded working
    directory, and the boundaries the pinned pvisor accepts (with its reason for the others). A file that is no
    trajectory is reported (``problem``), not raised. Needs no engine.

    Raises:
        UsageError: ``agent`` is not an agent pvisor replays.
        PrerequisiteError: the host's pvisor is missing.
    """
    return inspect_files([Path(path) for path in trajectories], agent)


def results(out: Path | str | Iterable[Path | str]) -> list[ItemResult]:
    """The rows of a finished (or interrupted) batch directory, one per item whatever happened to it, as
    ``pvisor-host results`` gives them (several directories: one list, each row's ``batch`` saying whose): the
    same flat fields for every batch. For pandas: ``pd.DataFrame([r.model_dump() for r in rows])``.

    Raises:
        UsageError: a directory is not a batch's.
    """
    dirs = [out] if isinstance(out, str | Path) else list(out)
    return load_results(*(Path(d).absolute() for d in dirs))


def gc(*, dry_run: bool = False, docker_host: str | None = None) -> GcReport:
    """Remove what controllers that are gone left in the engine (their containers, networks, volumes); never a
    live controller's, another host's, or anything without pvisor-host's labels."""
    with _engine(docker_host) as backend:
        return backend.sweep(dry_run=dry_run)
