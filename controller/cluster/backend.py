"""The cluster backend: the backend seam's second implementation, over a Ray cluster of Docker hosts.

The driver (this process, on a machine of the cluster) keeps a local
:class:`~pvisor_host.backend.docker.DockerBackend` for what happens before a sandbox: images are planned,
built and verified here, as for a local run, and the housekeeping commands stay local.
:meth:`ClusterBackend.run_attempt` runs the attempt as a **Ray task** instead (:func:`.node.run_copy`):

* Ray schedules it by resources on a node that advertises a free ``docker_engine`` slot (``node join
  --slots``), never on a node without an engine;
* the task makes the image present (:mod:`.ship`: by digest from a registry, or chunks through the cluster,
  once per node), runs the same single-host pipeline as a local run against the node's own engine, and
  leaves the run directory on the node; a pinned streaming task (:func:`.node.fetch_run`) brings it back in
  chunks, through the same safe extractor and byte cap as a local collection;
* when a node dies, Ray runs the task again elsewhere (``max_retries``). When a node hangs or is cut off,
  Ray marks it dead but leaves its tasks blocked: the driver's watchdog (:class:`Watch`) sees that in the
  batch's :class:`~.ledger.Ledger` and, after ``grace`` seconds, submits another copy of the attempt. Two
  copies may then run at once, each in its own disposable sandbox; the first to finish is the attempt's
  record, and the record lists every other start in ``superseded``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._log import logger
from .._version import __version__
from ..errors import (
    ImageBuildError,
    InfrastructureError,
    Interrupted,
    PrerequisiteError,
    PvisorHostError,
    UsageError,
)
from ..files.archive import Budget, extract_tar, tar_stream
from ..models.record import ReplayRecord, SupersededAttempt, load_record, save_record
from . import node as on_node
from .connect import ENGINE_RESOURCE, connect, engine_nodes, pinned_to
from .ledger import Ledger
from .ship import Shipper

if TYPE_CHECKING:
    from ..backend.docker import DockerBackend
    from ..models.housekeeping import AgentStatus, CatalogEntry, Check, GcReport, PruneResult
    from ..models.image import BuildOptions, ImagePlan, ImagePreview, ImageRequest, ResolvedImage
    from ..models.ownership import Ownership
    from ..models.replay import Attempt, PreparedReplay, Runtime, SandboxPlan
    from ..models.spec import ModelUpstream

#: A node Ray has marked dead for this long while a copy runs (or may be queued) there is given up on, and
#: the attempt runs again elsewhere (seconds; the ``PVISOR_HOST_CLUSTER_GRACE`` variable sets another).
DEFAULT_GRACE = 20.0
GRACE_ENV = "PVISOR_HOST_CLUSTER_GRACE"
#: Node losses one attempt survives (Ray's retries and the watchdog's together) before it fails.
MAX_NODE_LOSSES = 3
#: How often the watchdog reads the ledger and the nodes' liveness (seconds).
WATCH_PERIOD = 0.5
_ERRORS: dict[str, type[PvisorHostError]] = {
    "UsageError": UsageError,
    "PreflightRejected": UsageError,
    "PrerequisiteError": PrerequisiteError,
    "ImageBuildError": ImageBuildError,
    "Interrupted": Interrupted,
}


class ClusterGateway:
    """A continuation's model, for sandboxes on nodes: each copy's node starts its own gateway with the key,
    which travels to it only over the cluster's authenticated channel."""

    def __init__(self, upstream: ModelUpstream) -> None:
        self.upstream = upstream
        self.key = os.environ[upstream.api_key_env]

    def close(self) -> None:
        """Nothing runs here; each node's gateway closes with its copy."""


class Watch:
    """The driver's view of the cluster, refreshed every :data:`WATCH_PERIOD` by one thread: where every copy
    started (the ledger) and since when each node has been dead."""

    def __init__(self, ray: Any, ledger: Any) -> None:
        self._ray, self._ledger = ray, ledger
        self._lock = threading.Lock()
        self._starts: dict[str, list[dict[str, str]]] = {}
        self._dead_since: dict[str, float] = {}
        self._closed = threading.Event()
        for entry in ray.nodes():  # dead before this batch: no copy of it can be waiting there
            if not entry.get("Alive"):
                self._dead_since[entry["NodeID"]] = float("-inf")
        self._thread = threading.Thread(target=self._run, name="pvisor-host-cluster-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(WATCH_PERIOD):
            with contextlib.suppress(Exception):  # a slow head: keep the last view, try again
                self.refresh()

    def refresh(self) -> None:
        """Read the ledger and the nodes now."""
        starts = self._ray.get(self._ledger.snapshot.remote(), timeout=30)
        nodes = self._ray.nodes()
        now = time.monotonic()
        with self._lock:
            self._starts = starts
            for entry in nodes:
                node_id = entry["NodeID"]
                if entry.get("Alive"):
                    self._dead_since.pop(node_id, None)
                else:
                    self._dead_since.setdefault(node_id, now)

    def starts(self, copy_id: str) -> list[dict[str, str]]:
        """Where copy ``copy_id`` started so far (Ray starts it again when its node dies)."""
        with self._lock:
            return list(self._starts.get(copy_id, []))

    def dead_for(self, node_id: str) -> float:
        """Seconds the node has been dead (0: alive, or not seen dead yet; infinite: dead before the batch)."""
        with self._lock:
            since = self._dead_since.get(node_id)
        return 0.0 if since is None else time.monotonic() - since

    def deaths_since(self, moment: float) -> list[float]:
        """When the nodes that died after ``moment`` (monotonic) were first seen dead."""
        with self._lock:
            return [since for since in self._dead_since.values() if since >= moment]

    def close(self) -> None:
        self._closed.set()


class _Copy:
    """One copy of an attempt: a Ray task, and what the driver decided about it."""

    def __init__(self, ref: Any, copy_id: str) -> None:
        self.ref, self.id = ref, copy_id
        self.submitted = time.monotonic()
        self.given_up = False
        """The driver runs another copy instead (this one may still finish first)."""

    @property
    def hopeful(self) -> bool:
        """Running, or waiting to, and not given up on."""
        return self.ref is not None and not self.given_up


class ClusterBackend:
    """Sandboxes on the Docker hosts of a Ray cluster (see the module docstring)."""

    def __init__(
        self, address: str, local: DockerBackend, *, grace: float | None = None, registry: str | None = None
    ) -> None:
        self.address = address
        self.local = local
        self.grace = grace if grace is not None else float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE)
        self.ray = connect(address)
        self._cancelled = threading.Event()
        self._inputs: dict[Path, Any] = {}
        self._inputs_lock = threading.Lock()
        try:
            self._remotes()
            self._check_nodes()
            here = self.ray.get_runtime_context().get_node_id()  # the ledger lives as long as this driver
            self.ledger = self.ray.remote(Ledger).options(num_cpus=0, scheduling_strategy=pinned_to(here)).remote()
            self.watch = Watch(self.ray, self.ledger)
            self.shipper = Shipper(local.client, self.ray, registry)
        except BaseException:
            with contextlib.suppress(Exception):
                self.ray.shutdown()
            raise

    @property
    def ownership(self) -> Ownership:
        """The owner labels of everything this backend creates (the driver's session)."""
        return self.local.ownership

    @property
    def session(self) -> str:
        return self.local.ownership.session

    def _remotes(self) -> None:
        ray = self.ray
        self._run_copy = ray.remote(
            num_cpus=0,
            resources={ENGINE_RESOURCE: 1},  # Ray places a copy only where an engine slot is free
            max_retries=MAX_NODE_LOSSES,  # ... and runs it again elsewhere when its node dies
            retry_exceptions=False,
            scheduling_strategy="SPREAD",
        )(on_node.run_copy)
        self._calls = {
            "info": ray.remote(num_cpus=0, max_retries=0)(on_node.node_info),
            # the run directory comes back as a stream, at most two chunks ahead of the driver
            "fetch": ray.remote(num_cpus=0, max_retries=0, _generator_backpressure_num_objects=2)(on_node.fetch_run),
        }

    def on_node(self, name: str, node_id: str) -> Any:
        """The node call ``name`` (``info``, ``fetch``), pinned to one node."""
        return self._calls[name].options(scheduling_strategy=pinned_to(node_id))

    @property
    def slots(self) -> int:
        """Replays the cluster runs at once now (the ``docker_engine`` slots of its alive nodes)."""
        return int(sum(n["Resources"][ENGINE_RESOURCE] for n in engine_nodes(self.ray)))

    def _check_nodes(self) -> None:
        engines = engine_nodes(self.ray)
        if not engines:
            raise PrerequisiteError(
                f"no node of the cluster at {self.address} has a Docker engine",
                hint=f"run `pvisor-host node join --address {self.address}` on each Docker host",
            )
        infos = self._get([self.on_node("info", n["NodeID"]).remote() for n in engines], timeout=120)
        for info in infos:
            if info["version"] != __version__:
                raise PrerequisiteError(
                    f"node {info['node']} runs pvisor-host {info['version']}; this is {__version__}",
                    hint="install the same pvisor-host on every node",
                )
        logger.info("cluster {}: {} nodes, {} slots", self.address, len(engines), self.slots)

    def _get(self, refs: Any, *, timeout: float | None = None) -> Any:
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise InfrastructureError(f"the cluster at {self.address} did not answer within {timeout:.0f}s") from None

    # -- images (made here, on the driver's engine) -----------------------------------------------------------

    def plan_image(self, request: ImageRequest) -> ImagePlan:
        """See :meth:`pvisor_host.backend.base.Backend.plan_image` (``--inject`` is refused on a cluster)."""
        if request.inject:
            raise UsageError("--inject does not run on a cluster yet; run it without --cluster")
        return self.local.plan_image(request)

    def ensure_image(self, plan: ImagePlan, build: BuildOptions) -> ResolvedImage:
        """See :meth:`pvisor_host.backend.base.Backend.ensure_image`: built here, shipped to nodes when used."""
        return self.local.ensure_image(plan, build)

    def preview_image(self, plan: ImagePlan) -> ImagePreview:
        """See :meth:`pvisor_host.backend.base.Backend.preview_image`."""
        return self.local.preview_image(plan)

    def runtime(self, name: str | None) -> Runtime:
        """See :meth:`pvisor_host.backend.base.Backend.runtime` (the driver's engine answers for the nodes)."""
        return self.local.runtime(name)

    def describe_sandbox(self, prepared: PreparedReplay) -> SandboxPlan:
        """See :meth:`pvisor_host.backend.base.Backend.describe_sandbox`."""
        return self.local.describe_sandbox(prepared)

    def open_gateway(self, upstream: ModelUpstream, *, user: str) -> ClusterGateway:
        """See :meth:`pvisor_host.backend.base.Backend.open_gateway`: each node runs its own gateway."""
        if not upstream.gateway:
            raise UsageError("--model-network pass-through does not run on a cluster (the key would enter a sandbox)")
        return ClusterGateway(upstream)

    # -- sandboxes, on nodes --------------------------------------------------------------------------------

    def run_attempt(
        self,
        prepared: PreparedReplay,
        attempt: Attempt,
        *,
        gateway: Any = None,
        cancel: threading.Event | None = None,
    ) -> ReplayRecord:
        """See :meth:`pvisor_host.backend.base.Backend.run_attempt`: as Ray tasks (see the module docstring)."""
        run = _AttemptRun(self, prepared, attempt, gateway.key if isinstance(gateway, ClusterGateway) else None)
        return run.follow(cancel)

    def cancel(self) -> None:
        """Stop every copy of this batch on every node (their attempts end ``interrupted``)."""
        self._cancelled.set()
        with contextlib.suppress(Exception):
            self.ledger.stop_all.remote()

    def cancelled(self, cancel: threading.Event | None) -> bool:
        return self._cancelled.is_set() or (cancel is not None and cancel.is_set())

    def workspace_ref(self, path: Path) -> Any:
        """The workspace directory as a tar in the object store, once per directory for the whole batch."""
        with self._inputs_lock:
            if path not in self._inputs:
                self._inputs[path] = self.ray.put(_tar_directory(path))
            return self._inputs[path]

    # -- housekeeping (the driver's engine) ------------------------------------------------------------------

    def sweep(self, *, dry_run: bool = False) -> GcReport:
        """See :meth:`pvisor_host.backend.base.Backend.sweep` (this host; each node sweeps when it joins)."""
        return self.local.sweep(dry_run=dry_run)

    def catalog(self) -> list[CatalogEntry]:
        """See :meth:`pvisor_host.backend.base.Backend.catalog`."""
        return self.local.catalog()

    def prune(
        self, *, keep_bytes: int | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> PruneResult:
        """See :meth:`pvisor_host.backend.base.Backend.prune`."""
        return self.local.prune(keep_bytes=keep_bytes, older_than=older_than, dry_run=dry_run)

    def agent_statuses(self) -> list[AgentStatus]:
        """See :meth:`pvisor_host.backend.base.Backend.agent_statuses`."""
        return self.local.agent_statuses()

    def diagnose(self) -> list[Check]:
        """See :meth:`pvisor_host.backend.base.Backend.diagnose`."""
        return self.local.diagnose()

    def close(self) -> None:
        """Stop watching, let the object store drop what the batch put there, and leave the cluster."""
        self.watch.close()
        self.shipper.close()
        with contextlib.suppress(Exception):
            self.ray.kill(self.ledger)
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        self.local.close()


class _AttemptRun:
    """One attempt on the cluster: its copies, followed until the first finishes (see the module docstring)."""

    def __init__(self, backend: ClusterBackend, prepared: PreparedReplay, attempt: Attempt, key: str | None) -> None:
        self.backend, self.prepared, self.attempt, self.key = backend, prepared, attempt, key
        self.ray = backend.ray
        self.copies: list[_Copy] = []
        self.reasons: dict[str, str] = {}
        """Why each copy that did not make the record was left (by copy id)."""
        self.unshipped: set[str] = set()
        """Copies that found no image on their node and ran nothing (not superseded: nothing ran)."""
        self.losses = 0
        self.chunks = False
        self.trajectory = prepared.trajectory.path.read_bytes()
        workspace = prepared.spec.workspace_dir
        self.workspace = backend.workspace_ref(workspace.absolute()) if workspace is not None else None

    def submit(self) -> _Copy:
        request = {
            "session": self.backend.session,
            "prepared": self.prepared.model_dump_json(),
            "attempt": self.attempt.number,
            "run_id": self.attempt.run_id,
            "image": self.backend.shipper.manifest(self.prepared.image, chunks=self.chunks),
        }
        copy_id = f"{self.attempt.run_id}/{uuid.uuid4().hex[:8]}"
        ref = self.backend._run_copy.remote(
            copy_id, request, self.backend.ledger, self.trajectory, self.workspace, self.key
        )
        copy = _Copy(ref, copy_id)
        self.copies.append(copy)
        return copy

    def live(self) -> list[_Copy]:
        return [c for c in self.copies if c.ref is not None]

    def follow(self, cancel: threading.Event | None) -> ReplayRecord:
        """Wait for the first copy to finish with a record, keeping a copy running while nodes fail."""
        backend, ray = self.backend, self.ray
        self.submit()
        stopped_at: float | None = None
        try:
            while True:
                if stopped_at is None and backend.cancelled(cancel):
                    stopped_at = time.monotonic()
                    backend.cancel()
                    for copy in self.live():
                        if not self.backend.watch.starts(copy.id):
                            ray.cancel(copy.ref)  # not started: it never will
                if not any(copy.hopeful for copy in self.copies):
                    if stopped_at is not None:
                        raise Interrupted("cancelled; no copy of it is running on a node that answers")
                    self._lost_all()
                live = self.live()
                ready, _ = ray.wait([c.ref for c in live], num_returns=1, timeout=WATCH_PERIOD)
                for ref in ready:
                    copy = next(c for c in live if c.ref is ref)
                    record = self._finished(copy, interrupted_wanted=stopped_at is not None)
                    if record is not None:
                        return self._won(copy, record)
                if stopped_at is None:
                    self._watchdog()
                elif time.monotonic() - stopped_at > 60 + backend.grace:
                    raise Interrupted("cancelled; a node did not answer, so its copy may still run there")
        finally:
            for copy in self.copies:
                with contextlib.suppress(Exception):
                    backend.ledger.forget.remote(copy.id)

    def _finished(self, copy: _Copy, *, interrupted_wanted: bool) -> ReplayRecord | None:
        """A copy's task ended: its record (fetched), or None when it gave none (and what to do next is done)."""
        ray = self.ray
        ref, copy.ref = copy.ref, None
        try:
            reply = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return None
        except _lost_errors(ray) as exc:
            self._lose(copy, f"its node was lost and Ray's retries ran out ({type(exc).__name__})")
            return None
        except ray.exceptions.RayTaskError as exc:  # a bug on the node: its last line says what
            raise InfrastructureError(f"a node failed running {self.attempt.run_id}: {_last_line(exc)}") from None
        if reply.get("superseded"):
            return None
        if reply.get("need_image"):
            self.unshipped.add(copy.id)
            self.chunks = True
            self.submit()  # not a loss: the node learns how to get the image
            return None
        error = reply.get("error")
        if error is not None:
            if any(c.hopeful for c in self.copies) and error["type"] not in _ERRORS:
                self.reasons[copy.id] = f"it failed there: {error['message']}"
                return None  # another copy is still running: it may do better
            raise _ERRORS.get(error["type"], InfrastructureError)(error["message"])
        try:
            if "tar" in reply:
                self._extract(iter([reply["tar"]]))
            else:
                self._fetch(reply["node_id"], reply["token"])
        except _NodeLost as exc:
            self._lose(copy, str(exc))
            return None
        path = self.attempt.run_dir / "record.json"
        if not path.exists():
            if reply["interrupted"] or interrupted_wanted:
                raise Interrupted("interrupted on a node before its sandbox started")
            raise InfrastructureError(f"the copy on {reply['node']} sent back no record")
        return self._as_local(load_record(path), reply["node"])

    def _won(self, winner: _Copy, record: ReplayRecord) -> ReplayRecord:
        """``winner`` finished first: stop the others, list every other start, and write the record."""
        for copy in self.live():
            self.reasons.setdefault(copy.id, f"a copy on {record.host.get('node')} finished first")
            self.backend.ledger.stop.remote(copy.id)
            if not self.backend.watch.starts(copy.id):
                self.ray.cancel(copy.ref)
        record = record.model_copy(update={"superseded": self._superseded(winner)})
        save_record(record, self.attempt.run_dir)
        if record.status == "interrupted":
            raise Interrupted("interrupted while the sandbox ran on a node; its record says so")
        return record

    def _superseded(self, winner: _Copy) -> list[SupersededAttempt]:
        with contextlib.suppress(Exception):
            self.backend.watch.refresh()
        found = []
        for copy in self.copies:
            if copy.id in self.unshipped:
                continue
            starts = self.backend.watch.starts(copy.id)
            if copy is winner:
                starts = starts[:-1]
            for n, start in enumerate(starts):
                if copy is winner or n < len(starts) - 1:
                    reason = f"node {start['node']} was lost; Ray ran the copy again"
                else:
                    reason = self.reasons.get(copy.id, "stopped by the driver")
                found.append(
                    SupersededAttempt(node=start["node"], reason=reason, started_at=datetime.fromisoformat(start["at"]))
                )
        return sorted(found, key=lambda s: s.started_at)

    def _lose(self, copy: _Copy, reason: str) -> None:
        self.reasons[copy.id] = reason
        self.losses += 1
        logger.warning("{}: {}; running it on another node", self.attempt.run_id, reason)

    def _lost_all(self) -> None:
        """No copy is left: run another, unless nodes were lost too often."""
        if self.losses > MAX_NODE_LOSSES:
            raise InfrastructureError(f"{self.losses} nodes were lost running {self.attempt.run_id}")
        self.submit()

    def _watchdog(self) -> None:
        """Give up on copies whose node Ray has marked dead for ``grace`` seconds, and on copies that may be
        queued at such a node (the loop then runs another copy; see the module docstring)."""
        watch, grace = self.backend.watch, self.backend.grace
        for copy in self.copies:
            if not copy.hopeful:
                continue
            starts = watch.starts(copy.id)
            if starts:
                dead = watch.dead_for(starts[-1]["node_id"])
                if dead >= grace:
                    copy.given_up = True
                    node = starts[-1]["node"]
                    self._lose(copy, f"node {node} stopped answering (Ray marked it dead {dead:.0f}s ago)")
                    # A crashed node's copy may still wait for a slot to be run again by Ray: ours replaces it.
                    # (A hung node's copy cannot be cancelled; Ray drops its result when the node returns.)
                    self.ray.cancel(copy.ref)
            elif any(time.monotonic() - since >= grace for since in watch.deaths_since(copy.submitted)):
                copy.given_up = True  # its lease may wait at the dead node: let Ray place another copy
                self.reasons[copy.id] = "queued while a node died; replaced"
                self.ray.cancel(copy.ref)

    def _fetch(self, node_id: str, token: str) -> None:
        """Stream the copy's run directory from its node into ``attempt.run_dir`` (under the run's cap)."""
        ray, watch = self.ray, self.backend.watch
        generator = self.backend.on_node("fetch", node_id).remote(self.backend.session, token)

        def chunks() -> Any:
            while True:
                ready, _ = ray.wait([generator], timeout=WATCH_PERIOD)
                if not ready:
                    if watch.dead_for(node_id) >= self.backend.grace:
                        raise _NodeLost("its node stopped answering while its results came back")
                    continue
                try:
                    ref = next(generator)
                    yield ray.get(ref)
                except StopIteration:
                    return
                except _lost_errors(ray) as exc:
                    raise _NodeLost(f"its node was lost while its results came back ({type(exc).__name__})") from None

        self._extract(chunks())

    def _extract(self, chunks: Iterator[bytes]) -> None:
        """Unpack a copy's run directory into ``attempt.run_dir``, through the safe extractor, under the cap."""
        dest = self.attempt.run_dir
        if dest.exists():
            shutil.rmtree(dest)  # what an earlier copy's interrupted fetch left
        # The run directory holds what pvisor-host collected under the cap; a little room for its own files.
        extract_tar(tar_stream(chunks), dest, Budget(self.prepared.spec.collect_limit + 64 * 2**20))

    def _as_local(self, record: ReplayRecord, node: str) -> ReplayRecord:
        spec = self.prepared.spec
        inputs = record.inputs.model_copy(
            update={
                "trajectory": record.inputs.trajectory.model_copy(update={"path": str(self.prepared.trajectory.path)}),
                "workspace_dir": str(spec.workspace_dir.absolute()) if spec.workspace_dir else None,
            }
        )
        host = {**record.host, "node": node, "cluster": self.backend.address}
        return record.model_copy(update={"inputs": inputs, "host": host})


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


class _NodeLost(Exception):
    """A node was lost while a copy's results came back."""


def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    names = ("WorkerCrashedError", "NodeDiedError", "ObjectLostError", "OwnerDiedError", "RaySystemError",
             "ActorDiedError", "ObjectReconstructionFailedError", "ObjectFetchTimedOutError")  # fmt: skip
    return tuple(kind for name in names if (kind := getattr(ray.exceptions, name, None)) is not None)


def _tar_directory(path: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(path, arcname=".")
    return buffer.getvalue()
