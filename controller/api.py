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
from collections.abc import AsyncGenerator, Generator, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from .attempts import run_forked, run_replay
from .backend import AnyBackend, open_backend
from .errors import UsageError
from .fanout.manifest import BatchItem, ManifestCheck
from .fanout.options import BatchRequest
from .fanout.results import load_results
from .fanout.scheduler import BatchRun
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
    spec = _spec(spec, options)
    if spec.fork is not None:
        raise UsageError("fork: K continuations give K records; call pvisor_host.fork() for them")
    checked = check_inputs(spec)
    with _engine(docker_host) as backend:
        prepared = prepare(checked, backend, build=build)
        return run_replay(prepared, backend)


def fork(
    spec: ReplaySpec | None = None,
    /,
    *,
    build: BuildOptions | None = None,
    docker_host: str | None = None,
    **options: Any,
) -> list[ReplayRecord]:
    """Replay one trajectory to its boundary once, then continue it ``fork`` times from there: the prefix's sandbox
    is checkpointed at the boundary and restored once per fork (docs/fork.md). Takes what :func:`replay` takes,
    ``fork`` (K, from 2) included.

    Returns the records: the prefix's sandbox's first (``fork.role`` ``prefix``), then each fork's in order (each
    also in its directory, ``<out>/fork-<k>/``); the prefix's alone when it ended before the boundary (its record
    says why).

    Raises:
        UsageError: the request is wrong, or cannot fork here (the runtime, the agent, a cluster).
        PrerequisiteError: no engine answers.
        InfrastructureError: the engine or a build failed.
        Interrupted: Ctrl-C; every sandbox was removed, the finished forks' records are kept.
    """
    spec = _spec(spec, options)
    if spec.fork is None:
        raise UsageError("fork needs fork=K (K from 2); pvisor_host.replay() continues once")
    checked = check_inputs(spec)
    with _engine(docker_host) as backend:
        prepared = prepare(checked, backend, build=build)
        return run_forked(prepared, backend)


def _spec(spec: ReplaySpec | None, options: dict[str, Any]) -> ReplaySpec:
    if spec is not None and options:
        raise UsageError("pass a ReplaySpec or its fields as keywords, not both")
    return spec if spec is not None else build_spec(**options)


class Batch:
    """A batch of replays: iterate it to run it (see the module docstring). Use it as a context manager, or
    call :meth:`close`, to end it deterministically when you stop iterating early and still hold it."""

    def __init__(self, request: BatchRequest, checked: ManifestCheck, *, backend: AnyBackend | None = None) -> None:
        self._request = request
        self._checked = checked
        self._lent = backend
        """The caller's backend, left open; else the batch opens one when it runs, and closes it."""
        self._run: BatchRun | None = None
        self._cancelled = False
        self._iterator: Generator[ItemResult, None, None] | None = None

    @property
    def items(self) -> list[BatchItem]:
        """The validated items, with their ids (each item's run directory is ``out/<id>/``), in the order they
        run."""
        return list(self._request.input.items())

    @property
    def out(self) -> Path:
        """The batch directory."""
        return self._request.options.out

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
        opened = contextlib.nullcontext(self._lent) if self._lent else contextlib.closing(self._request.open())
        with opened as backend:
            checked = self._checked
            run = BatchRun(
                self._request.input.items(), backend, self._request.options, total=checked.items,
                images=checked.image_specs, task_images=checked.image_counts, reports=(write_report,),
                memory=self._request.memory,
            )  # fmt: skip
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
    defaults: Mapping[str, Any] | None = None,
    backend: AnyBackend | None = None,
    **options: Any,
) -> Batch:
    """A batch of replays, validated now and run as you iterate it (see the module docstring).

    Args:
        items: specs, or mappings of manifest-line fields (``id`` included); read now, and again as they run.
        out: the batch directory (``<out>/<id>/`` per item, ``summary.json``, ``junit.xml``); running into it
            again resumes: items that finished with the same inputs are not run again.
        defaults: fields every item gets unless it sets them (the ``batch`` command's replay options).
        backend: an open backend to run on instead (the placement options are then not used); it stays open
            afterwards: its caller closes it.
        options: the ``batch`` command's options, by field name: :class:`~pvisor_host.fanout.options.BatchOptions`'
            (``workers``, ``deadline`` as seconds or ``"6h"``, ``image_budget`` as bytes or ``"200g"``, ...),
            :class:`~pvisor_host.fanout.manifest.BatchInput`'s (``repeat``, ``limit``, ``sample``, ``select``,
            ...), :class:`~pvisor_host.backend.Placement`'s (``docker_host``, ``cluster``, ``registry``,
            ``registry_mirror``, ``image_rewrites``), and the build's (``base``, ``ca_bundle``); any other is a
            replay option every item starts from, as ``defaults``. With ``cluster``, this process must run on a
            machine of the cluster, the token comes from ``RAY_AUTH_TOKEN`` and ``workers`` defaults to the
            cluster's engine slots (docs/cluster.md).

    Raises:
        UsageError: an item is wrong (the first, by position, and how many more), or an option is, or one
            reason refuses every item.
        PrerequisiteError: (when iterated) no engine answers, or the cluster is missing something it needs.
    """
    entries = [i.model_dump(exclude_unset=True) if isinstance(i, ReplaySpec) else dict(i) for i in items]
    request = BatchRequest.from_options({**options, "out": Path(out).absolute()}, entries=entries, defaults=defaults)
    checked = request.input.check()
    if checked.problems:
        first, more = checked.problems[0], len(checked.problems) - 1
        raise UsageError(f"item {first.line}: {first.message}" + (f" (and {more} more)" if more else ""))
    checked.refuse_if_none_can_run()
    return Batch(request, checked, backend=backend)


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
