"""What runs on a node: the bodies of the Ray tasks of a cluster batch, each against the node's own engine.

The driver makes these plain functions Ray tasks (:mod:`.backend`); none of them imports Ray at module level.

* :func:`run_copy` — one copy of an attempt, scheduled by Ray on any node with a free ``docker_engine`` slot
  and retried by Ray when its node dies. It says in the :class:`~.ledger.Ledger` where it started, makes the
  image present (loaded from the driver's chunks or pulled by digest, once per node), runs the single-host
  pipeline of a local run (:meth:`DockerBackend.run_attempt
  <pvisor_host.backend.docker.DockerBackend.run_attempt>`: staging, the hardened sandbox, collection under
  the cap, the record) in this node's scratch directory, and leaves the run directory there.
* :func:`fetch_run` — pinned to that node: streams the run directory back as a tar, one chunk at a time,
  then removes it (a run directory that fits in one chunk comes back with the copy's reply). Neither side
  holds more than a chunk of it in memory.
* :func:`node_info`, :func:`node_status` — small pinned calls (the driver's version check, ``cluster status``).

A failure comes back as ``{"error": {...}}`` naming the exception's class, never as a raised exception, so
Ray retries only what it should: a copy whose node died.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import socket
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...._version import __version__
from ....errors import InfrastructureError, Interrupted, PvisorHostError
from ....files.trees import remove_if_empty
from ....models.replay import Attempt, PreparedReplay
from ...docker.image.images import Reference
from ..limits import RemoteLimits
from .images import prepare_task
from .images import status as task_status

if TYPE_CHECKING:
    from ...docker import DockerBackend
    from ...docker.image.images import ImageStore

#: Bytes per chunk of a run directory or an image on its way between the driver and a node.
CHUNK = 8 * 1024 * 1024
#: Where a node keeps the run directories of its copies until the driver fetched them: one folder per
#: batch session. ``node join`` empties it (nothing runs on a node before it joins).
SCRATCH_ENV = "PVISOR_HOST_NODE_SCRATCH"
#: How long one call of a running copy's watcher waits on the ledger for a reason to stop (seconds); it asks
#: again after, and right away when the driver forgot the copy.
STOP_WAIT = 60.0
#: How long the watcher waits before it asks again after the ledger did not answer (seconds).
STOP_POLL = 1.0
#: The ledger's answer when another copy of the attempt finished first (else ``"cancelled"``, or None).
SUPERSEDED = "superseded"
_backends: dict[str, DockerBackend] = {}
_backends_lock = threading.Lock()


def scratch_root() -> Path:
    """This node's scratch directory (``$PVISOR_HOST_NODE_SCRATCH``, else ``<tmp>/pvisor-host-node``)."""
    return Path(os.environ.get(SCRATCH_ENV) or Path(tempfile.gettempdir()) / "pvisor-host-node")


def node_name() -> str:
    """The name a node goes by in records and ``cluster status``: its host name."""
    return socket.gethostname()


def backend_for(session: str) -> DockerBackend:
    """This worker process's engine connection for the batch ``session`` (its sandboxes carry that session).

    The first one a worker process opens also sweeps what workers that are gone left in the engine (a worker
    Ray killed with its driver cannot remove its sandbox itself).
    """
    with _backends_lock:
        backend = _backends.get(session)
        if backend is None:
            from ....models.ownership import Ownership
            from ...docker import DockerBackend

            backend = DockerBackend.connect(Ownership.current(session=session), pool_size=8)
            # copies out of task images (--image-workspace) outlive a copy's folder: once per image here
            backend.keep_seeds_in(scratch_root() / session / f"seeds-{os.getpid()}")
            if not _backends:
                with contextlib.suppress(PvisorHostError):
                    backend.sweep()
            _backends[session] = backend
        return backend


# -- small pinned calls ---------------------------------------------------------------------------------------


def node_info() -> dict[str, Any]:
    """This node: its name, pvisor-host version and Python version (Ray needs the driver's exact one)."""
    import platform

    return {"node": node_name(), "version": __version__, "python": platform.python_version()}


def node_status(session: str) -> dict[str, Any]:
    """This node for ``cluster status``: engine version, pvisor-host images, sandboxes of ours running now, and
    the task images its copies pulled (bytes now, peak, budget)."""
    backend = backend_for(session)
    try:
        tasks = task_status(backend)
    except (PvisorHostError, OSError) as exc:
        tasks = {"error": str(exc)}
    try:
        engine, images, running = backend.engine_version(), backend.images.ours(), backend.running_sandboxes()
    except PvisorHostError as exc:  # reported, not raised: status shows every node it can
        return {**node_info(), "engine": f"error: {exc.message}", "images": [], "running": 0, "task_images": tasks}
    return {**node_info(), "engine": engine, "images": images, "running": running, "task_images": tasks}


# -- images ---------------------------------------------------------------------------------------------------


def ensure_image(session: str, image: dict[str, Any], fetch_chunk: Callable[[Any], bytes]) -> bool:
    """Make the image ``image["id"]`` present in this node's engine, once per node whatever the number of
    copies asking at once: pulled by digest from ``image["pull"]`` when the driver pushed it to a registry,
    else loaded from the chunks of its ``docker save`` (``fetch_chunk(ref)`` gets one chunk's bytes).
    Never an implicit pull.

    Returns:
        False when the node has not got it and was given no way to get it (the driver then ships it).

    Raises:
        InfrastructureError: the load or pull failed, or gave another image.
    """
    images = backend_for(session).images
    image_id = image["id"]
    if images.has(image_id):
        return True
    if not image.get("pull") and not image.get("chunks"):
        return False
    root = scratch_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"image-{image_id.removeprefix('sha256:')[:32]}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one copy loads it; the others find it present
        if images.has(image_id):
            return True
        try:
            if image.get("pull"):
                images.pull(image["pull"])  # by digest: exactly the image the driver pushed
                if Reference(image["ref"]).tag is not None:  # as the driver knows it: `images`, status, prune
                    images.tag(image_id, image["ref"])
            else:
                _load(images, root, image["chunks"], fetch_chunk)
        except PvisorHostError as exc:  # a message for the driver, naming this node
            raise InfrastructureError(f"{node_name()}: {exc.message}") from None
        if not images.has(image_id):
            raise InfrastructureError(f"{node_name()}: {image['ref']} arrived as another image than {image_id[:19]}")
    return True


def _load(images: ImageStore, root: Path, chunks: list[Any], fetch_chunk: Callable[[Any], bytes]) -> None:
    """``docker load`` the chunks of a ``docker save``, written to a file here first (one chunk in memory)."""
    upload = root / f"upload-{uuid.uuid4().hex}"
    try:
        with upload.open("wb") as handle:
            for ref in chunks:
                handle.write(fetch_chunk(ref))
        with upload.open("rb") as handle:
            images.load(handle)
    finally:
        upload.unlink(missing_ok=True)


# -- copies ---------------------------------------------------------------------------------------------------


def run_copy(
    copy_id: str,
    request: dict[str, Any],
    ledger: Any,
    trajectory: bytes,
    workspace: bytes | None,
    key: str | None,
    *,
    fetch_chunk: Callable[[Any], bytes] | None = None,
) -> dict[str, Any]:
    """Run one copy of an attempt here (see the module docstring).

    ``request`` holds the session, the prepared replay (JSON), the attempt's number and run id, and the image
    (id, ref, and chunks or a digest to pull). ``ledger`` is the batch's :class:`~.ledger.Ledger`, told where
    the copy started and asked whether it should stop (Ctrl-C on the driver, another copy finished first, or the
    attempt ended without it).

    Returns:
        ``{"node", "node_id", "token", "interrupted", "pulled", "starts"}`` (``starts``: how many times Ray
        started this copy, this one included), and ``"tar"``, the run directory, when it fits in one
        chunk; a larger one waits here for :func:`fetch_run`;
        ``{"need_image": True}``: the node has not got the image and was sent no way to get it;
        ``{"superseded": True}``: it was told to stop (another copy finished first, or the attempt ended
        without it) and removed what it made, or the driver had given it up or stopped it before it started
        (it ran nothing); or
        ``{"error": {"type", "message", "exit_code", "category"}}``.
    """
    import ray

    session = request["session"]
    token = uuid.uuid4().hex
    base = scratch_root() / session / token
    node = node_name()
    started = ledger.started.remote(copy_id, _node_id(), node, datetime.now(UTC).isoformat(), token)
    starts = ray.get(started, timeout=60)  # before anything runs: the driver must know where this copy is
    if not starts:  # the driver gave it up (or stopped it) before Ray started it: another copy runs instead
        return {"superseded": True}
    stop = _Stop()
    watcher = threading.Thread(target=_watch, args=(ledger, copy_id, stop, session, request["run_id"]), daemon=True)
    watcher.start()
    gateway = None
    limits = None
    pulled = None
    hold = None
    backend = None
    try:
        if not ensure_image(session, request["image"], fetch_chunk or ray.get):
            return {"need_image": True}
        prepared, attempt = _materialize(base, request, trajectory, workspace)
        backend = backend_for(session)
        if request.get("task") is not None:  # a task image: held here, pulled by digest within the node's budget
            hold, pulled = prepare_task(
                backend, scratch_root(), prepared, request["task"], request["image"]["id"], ledger, stop.event
            )
        if prepared.spec.continuation is not None:
            limits = RemoteLimits(request["model_limits"], _node_id()) if request.get("model_limits") else None
            gateway = backend.open_gateway(prepared.spec.continuation, user=prepared.user, api_key=key, limits=limits)
        backend.run_attempt(prepared, attempt, gateway=gateway, cancel=stop.event)
        interrupted = False
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    except PvisorHostError as exc:
        shutil.rmtree(base, ignore_errors=True)
        return _error(type(exc).__name__, exc.one_line(), exit_code=int(exc.exit_code), category=exc.category)
    except Exception as exc:  # noqa: BLE001 - the driver needs one line, not a traceback from a node
        shutil.rmtree(base, ignore_errors=True)
        return _error("InfrastructureError", f"{node}: {exc!r}")
    finally:
        stop.event.set()  # also ends the watcher
        if gateway is not None:
            gateway.close()
        if limits is not None:
            limits.close()  # whatever its gateway still held of the batch's model limits
        if hold is not None and backend is not None:
            backend.release_image(hold)  # its sandbox is gone: the image may go when the budget needs
    if stop.reason == SUPERSEDED:  # another copy made the record: nobody fetches this one
        _remove(base)
        return {"superseded": True}
    reply: dict[str, Any] = {
        "node": node, "node_id": _node_id(), "token": token, "interrupted": interrupted, "pulled": pulled,
        "starts": starts,
    }  # fmt: skip
    archive = _pack(base)
    if archive is None or archive.stat().st_size <= CHUNK:  # one chunk: it comes back with the reply
        reply["tar"] = archive.read_bytes() if archive is not None else b""
        _remove(base)
    return reply


def _materialize(
    base: Path, request: dict[str, Any], trajectory: bytes, workspace: bytes | None
) -> tuple[PreparedReplay, Attempt]:
    """The prepared replay and the attempt with this node's paths: the trajectory, the workspace and the run
    directory in the copy's scratch folder."""
    prepared = PreparedReplay.model_validate_json(request["prepared"])
    (base / "input").mkdir(parents=True)
    source = base / "input" / prepared.trajectory.path.name
    source.write_bytes(trajectory)
    spec = prepared.spec
    if request.get("tape") is not None and spec.upstream is not None and spec.upstream.cassette is not None:
        cassette = spec.upstream.cassette.model_copy(update={"dir": base / "cassette"})  # the driver's tape, here
        cassette.dir.mkdir()
        cassette.tape(prepared.name).write_bytes(request["tape"])
        spec = spec.model_copy(update={"upstream": spec.upstream.model_copy(update={"cassette": cassette})})
    if workspace is not None:
        with tarfile.open(fileobj=io.BytesIO(workspace), mode="r:") as archive:
            archive.extractall(base / "workspace", filter="data")
        spec = spec.model_copy(update={"workspace_dir": base / "workspace"})
    local = prepared.model_copy(
        update={
            "spec": spec,
            "trajectory": prepared.trajectory.model_copy(update={"path": source}),
            "out_dir": base / "run",
        }
    )
    attempt = Attempt(number=request["attempt"], run_id=request["run_id"], run_dir=base / "run")
    return local, attempt


class _Stop:
    """Whether (and why) a running copy was asked to stop."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason: str | None = None


def _watch(ledger: Any, copy_id: str, stop: _Stop, session: str, run_id: str) -> None:
    """Until the copy ends: wait on the ledger for a reason to stop; if one comes, stop its sandbox (the pipeline
    then records it as interrupted, as a local Ctrl-C would). Each copy stops its own sandbox, after it has said
    so to its pipeline: a sandbox killed by another copy's watcher would look like a crash."""
    import ray

    while not stop.event.is_set():
        try:
            reason = ray.get(ledger.wait_stop.remote(copy_id, STOP_WAIT), timeout=STOP_WAIT + 30)
        except Exception:  # noqa: BLE001 - the driver's node is gone: Ray ends this job's workers soon
            stop.event.wait(STOP_POLL)
            continue
        if reason is not None and not stop.event.is_set():
            stop.reason = reason
            stop.event.set()
            backend_for(session).cancel(run_id=run_id)
            return


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def fetch_run(session: str, token: str) -> Iterator[bytes]:
    """The run directory of copy ``token`` as a tar (top folder ``run``), in chunks; then it is removed.

    Written to a file on this node first, so that only one chunk is in memory at a time.
    """
    base = scratch_root() / session / token
    try:
        archive = _pack(base)
        if archive is not None:
            with archive.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    yield chunk
    finally:
        _remove(base)


def _pack(base: Path) -> Path | None:
    """The copy's run directory as ``run.tar`` beside it (None when the copy made none)."""
    if not (base / "run").is_dir():
        return None
    archive = base / "run.tar"
    if not archive.exists():
        with tarfile.open(archive, "w") as tar:
            tar.add(base / "run", arcname="run")
    return archive


def _remove(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)
    remove_if_empty(base.parent)  # the batch's folder, once its last run directory went


def _error(kind: str, message: str, *, exit_code: int | None = None, category: str | None = None) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, "exit_code": exit_code, "category": category}}
