"""The cluster backend: the backend seam's second implementation, over a Ray cluster of Docker hosts.

The driver (this process) keeps a local :class:`~pvisor_host.backend.docker.DockerBackend` for what
happens before a sandbox: images are planned, built and verified here, as for a local run, and housekeeping
commands stay local. :meth:`ClusterBackend.run_attempt` runs the attempt on a node instead:

1. a node with a free slot is chosen (each node advertises ``docker_engine: N``; at most N at once);
2. the image is shipped to it once — ``docker save`` here, chunks through Ray, ``docker load`` there,
   checked by id — never pulled;
3. the node's :class:`~.agent.NodeAgent` runs the single-host pipeline against its own engine (the same
   pre-flighted replay, hardening, limits, record and gateway confinement);
4. the attempt's run directory streams back in chunks into ``attempt.run_dir``, through the same safe
   extractor and byte cap as a local collection, and the record is rewritten with this host's paths.

A node that dies, hangs or is cut off mid-attempt (Ray marks it dead; a hung node's calls would stay
blocked) is given up on after ``grace`` seconds: the attempt runs again on another node, in a fresh
sandbox, and the record lists the lost one in ``superseded``. The record is that of the copy not given up
on; a late finish of a lost one is ignored (its node removes its sandbox, or ``node join`` sweeps it).
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

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
from .agent import CHUNK, NodeAgent
from .connect import ENGINE_RESOURCE, NAMESPACE, connect

if TYPE_CHECKING:
    from ..backend.docker import DockerBackend
    from ..models.housekeeping import AgentStatus, CatalogEntry, Check, GcReport, PruneResult
    from ..models.image import BuildOptions, ImagePlan, ImagePreview, ImageRequest, ResolvedImage
    from ..models.ownership import Ownership
    from ..models.replay import Attempt, PreparedReplay, Runtime, SandboxPlan
    from ..models.spec import ModelUpstream

#: A node Ray has marked dead for this long while it runs an attempt is given up on (seconds; the
#: ``PVISOR_HOST_CLUSTER_GRACE`` variable sets another).
DEFAULT_GRACE = 20.0
GRACE_ENV = "PVISOR_HOST_CLUSTER_GRACE"
#: Node losses one attempt survives before it fails as an infrastructure error.
MAX_NODE_LOSSES = 3
_ERRORS: dict[str, type[PvisorHostError]] = {
    "UsageError": UsageError,
    "PreflightRejected": UsageError,
    "PrerequisiteError": PrerequisiteError,
    "ImageBuildError": ImageBuildError,
    "Interrupted": Interrupted,
}


class NodeStatus(BaseModel):
    """One node, as ``cluster status`` shows it."""

    node: str
    address: str
    alive: bool
    slots: int
    """Replays it may run at once (its ``docker_engine`` resource; 0: no engine, the head say)."""
    engine: str | None = None
    """Its Docker engine's version (none without an engine)."""
    running: int = 0
    """Sandboxes of pvisor-host running there now."""
    images: list[str] = []
    """pvisor-host images its engine holds."""


class NodeLost(InfrastructureError):
    """The node running an attempt died, hung or was cut off."""


class _Node:
    """One node with an engine, as the driver sees it."""

    def __init__(self, node_id: str, address: str, slots: int, agent: Any) -> None:
        self.id, self.address, self.slots, self.agent = node_id, address, slots, agent
        self.name = address
        self.running = 0
        self.images: set[str] = set()
        self.image_lock = threading.Lock()


class ClusterGateway:
    """A continuation's model, for sandboxes on nodes: each attempt's node starts its own gateway with the key,
    which travels to it only over the cluster's authenticated channel."""

    def __init__(self, upstream: ModelUpstream) -> None:
        self.upstream = upstream
        self.key = os.environ[upstream.api_key_env]

    def close(self) -> None:
        """Nothing runs here; each node's gateway closes with its attempt."""


class ClusterBackend:
    """Sandboxes on the Docker hosts of a Ray cluster (see the module docstring)."""

    def __init__(self, address: str, local: DockerBackend, *, grace: float | None = None) -> None:
        self.address = address
        self.local = local
        self.grace = grace if grace is not None else float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE)
        self._alive_cache: tuple[float, set[str]] = (0.0, set())
        self._alive_lock = threading.Lock()
        self.ray = connect(address)
        self._nodes: list[_Node] = []
        self._free = threading.Condition()
        self._cancelled = threading.Event()
        self._start_agents()

    @property
    def ownership(self) -> Ownership:
        """The owner labels of everything this backend creates (the driver's session)."""
        return self.local.ownership

    @property
    def slots(self) -> int:
        """Replays the cluster runs at once."""
        return sum(node.slots for node in self._nodes)

    def _start_agents(self) -> None:
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        engines = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(ENGINE_RESOURCE, 0) >= 1]
        if not engines:
            raise PrerequisiteError(
                f"no node of the cluster at {self.address} has a Docker engine",
                hint=f"run `pvisor-host node join --address {self.address}` on each Docker host",
            )
        remote = ray.remote(num_cpus=0, max_concurrency=64, max_restarts=0)(NodeAgent)
        for found in engines:
            slots = int(found["Resources"][ENGINE_RESOURCE])
            agent = remote.options(
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(found["NodeID"], soft=False),
            ).remote(self.ownership.session)
            self._nodes.append(_Node(found["NodeID"], found.get("NodeManagerAddress", "?"), slots, agent))
        infos = self._get([node.agent.info.remote() for node in self._nodes], timeout=120)
        for node, info in zip(self._nodes, infos, strict=True):
            node.name = info["node"]
            if info["version"] != __version__:
                raise PrerequisiteError(
                    f"node {node.name} runs pvisor-host {info['version']}; this is {__version__}",
                    hint="install the same pvisor-host on every node",
                )
        logger.info("cluster {}: {} nodes, {} slots", self.address, len(self._nodes), self.slots)

    def status(self) -> list[NodeStatus]:
        """Every node of the cluster: alive or not, its engine's slots, and for nodes with an engine their
        images and the sandboxes of pvisor-host running there now (any driver's)."""
        reports = self._get([node.agent.status.remote() for node in self._nodes], timeout=60)
        by_id: dict[str, dict[str, Any]] = {node.id: report for node, report in zip(self._nodes, reports, strict=True)}
        found = []
        for entry in self.ray.nodes():
            report = by_id.get(entry["NodeID"], {})
            found.append(
                NodeStatus(
                    node=report.get("node") or entry.get("NodeManagerAddress", "?"),
                    address=entry.get("NodeManagerAddress", "?"),
                    alive=bool(entry.get("Alive")),
                    slots=int(entry.get("Resources", {}).get(ENGINE_RESOURCE, 0)),
                    engine=report.get("engine"),
                    running=int(report.get("running", 0)),
                    images=list(report.get("images", [])),
                )
            )
        return sorted(found, key=lambda n: (not n.alive, -n.slots, n.node))

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
        """See :meth:`pvisor_host.backend.base.Backend.run_attempt`: on a node (see the module docstring)."""
        key = gateway.key if isinstance(gateway, ClusterGateway) else None
        trajectory = prepared.trajectory.path.read_bytes()
        workspace = _tar_directory(prepared.spec.workspace_dir) if prepared.spec.workspace_dir else None
        lost: list[SupersededAttempt] = []
        while True:
            node = self._take_slot(cancel)
            started = datetime.now(UTC)
            try:
                self._ship_image(node, prepared)
                return self._run_on(node, prepared, attempt, trajectory, workspace, key, cancel, lost)
            except NodeLost as exc:
                lost.append(SupersededAttempt(node=node.name, reason=exc.one_line(), started_at=started))
                logger.warning("{}; running the attempt again on another node", exc.one_line())
                self._forget(node)
                if len(lost) >= MAX_NODE_LOSSES:
                    raise InfrastructureError(f"{len(lost)} nodes were lost running {attempt.run_id}") from None
            finally:
                self._give_slot(node)

    def _take_slot(self, cancel: threading.Event | None) -> _Node:
        with self._free:
            while True:
                if self._cancelled.is_set() or (cancel is not None and cancel.is_set()):
                    raise Interrupted("cancelled before a node was free")
                nodes = [n for n in self._nodes if n.running < n.slots]
                if not self._nodes:
                    raise InfrastructureError(f"every node of the cluster at {self.address} was lost")
                if nodes:
                    node = min(nodes, key=lambda n: n.running / n.slots)
                    node.running += 1
                    return node
                self._free.wait(0.5)

    def _give_slot(self, node: _Node) -> None:
        with self._free:
            node.running -= 1
            self._free.notify_all()

    def _forget(self, node: _Node) -> None:
        with self._free:
            if node in self._nodes:
                self._nodes.remove(node)
            self._free.notify_all()

    def _ship_image(self, node: _Node, prepared: PreparedReplay) -> None:
        image_id = prepared.image.id
        with node.image_lock:
            if image_id in node.images:
                return
            if not self._call(node, node.agent.has_image.remote(image_id), timeout=60):
                started = time.monotonic()
                token = uuid.uuid4().hex
                sent = 0
                for chunk in self.local.client.images.get(image_id).save(chunk_size=CHUNK, named=True):
                    sent = self._call(node, node.agent.upload.remote(token, chunk), timeout=120)
                done = self._call(node, node.agent.load_image.remote(token, image_id), timeout=600)
                _raise_error(done)
                logger.info(
                    "shipped {} ({:.0f} MiB) to {} in {:.1f}s",
                    prepared.image.ref,
                    sent / 2**20,
                    node.name,
                    time.monotonic() - started,
                )
            node.images.add(image_id)

    def _run_on(
        self,
        node: _Node,
        prepared: PreparedReplay,
        attempt: Attempt,
        trajectory: bytes,
        workspace: bytes | None,
        key: str | None,
        cancel: threading.Event | None,
        lost: list[SupersededAttempt],
    ) -> ReplayRecord:
        ref = node.agent.run.remote(
            prepared.model_dump_json(), attempt.number, attempt.run_id, trajectory, workspace, key
        )
        reply = self._call(node, ref, timeout=None, cancel=cancel)
        _raise_error(reply)
        try:
            self._fetch(node, reply["token"], attempt.run_dir, prepared.spec.collect_limit)
        finally:
            node.agent.drop.remote(reply["token"])
        if reply["interrupted"] and not (attempt.run_dir / "record.json").exists():
            raise Interrupted("interrupted on a node before its sandbox started")
        record = load_record(attempt.run_dir / "record.json")
        record = self._as_local(record, prepared, node, lost)
        save_record(record, attempt.run_dir)
        if reply["interrupted"]:
            raise Interrupted("interrupted while the sandbox ran on a node; its record says so")
        return record

    def _call(self, node: _Node, ref: Any, *, timeout: float | None, cancel: threading.Event | None = None) -> Any:
        """Wait for one agent call, giving the node up once Ray has marked it dead for ``grace`` seconds."""
        ray = self.ray
        deadline = None if timeout is None else time.monotonic() + timeout
        dead_since: float | None = None
        cancelled = False
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                try:
                    return ray.get(ready[0])
                except _lost_errors(ray) as exc:
                    raise NodeLost(f"node {node.name} was lost ({type(exc).__name__})") from None
            if not cancelled and (self._cancelled.is_set() or (cancel is not None and cancel.is_set())):
                cancelled = True  # the node stops the sandbox; its reply says interrupted
                node.agent.cancel.remote()
            if not self._alive(node):
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since >= self.grace:
                    raise NodeLost(f"node {node.name} stopped answering (Ray marked it dead {self.grace:.0f}s ago)")
            else:
                dead_since = None
            if deadline is not None and time.monotonic() > deadline:
                raise NodeLost(f"node {node.name} did not answer within {timeout:.0f}s")

    def _alive(self, node: _Node) -> bool:
        """Whether Ray has the node alive (asked at most once a second, whatever the number of waiting calls)."""
        with self._alive_lock:
            asked, alive = self._alive_cache
            if time.monotonic() - asked > 1.0:
                alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
                self._alive_cache = (time.monotonic(), alive)
        return node.id in alive

    def _fetch(self, node: _Node, token: str, dest: Path, limit: int) -> None:
        def chunks() -> Iterator[bytes]:
            offset = 0
            while True:
                chunk = self._call(node, node.agent.read.remote(token, offset), timeout=120)
                if not chunk:
                    return
                offset += len(chunk)
                yield chunk

        # The run directory holds what pvisor-host collected under the cap; a little room for its own files.
        extract_tar(tar_stream(chunks()), dest, Budget(limit + 64 * 2**20))  # the tar's top directory is "run"

    def _as_local(
        self, record: ReplayRecord, prepared: PreparedReplay, node: _Node, lost: list[SupersededAttempt]
    ) -> ReplayRecord:
        spec = prepared.spec
        inputs = record.inputs.model_copy(
            update={
                "trajectory": record.inputs.trajectory.model_copy(update={"path": str(prepared.trajectory.path)}),
                "workspace_dir": str(spec.workspace_dir.absolute()) if spec.workspace_dir else None,
            }
        )
        host = {**record.host, "node": node.name, "cluster": self.address}
        return record.model_copy(update={"inputs": inputs, "host": host, "superseded": list(lost)})

    def cancel(self) -> None:
        """Stop every sandbox of this batch on every node (their attempts end ``interrupted``)."""
        self._cancelled.set()
        for node in list(self._nodes):
            node.agent.cancel.remote()
        with self._free:
            self._free.notify_all()

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
        """Stop the node agents (each removes its scratch directory) and leave the cluster."""
        closing = [node.agent.close.remote() for node in self._nodes]
        with contextlib.suppress(Exception):
            self.ray.wait(closing, num_returns=len(closing), timeout=30)
        for node in self._nodes:
            with contextlib.suppress(Exception):
                self.ray.kill(node.agent)
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        self.local.close()


def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError")
    return tuple(kind for name in names if (kind := getattr(ray.exceptions, name, None)) is not None)


def _raise_error(reply: Any) -> None:
    error = reply.get("error") if isinstance(reply, dict) else None
    if error is None:
        return
    kind = _ERRORS.get(error["type"], InfrastructureError)
    raise kind(error["message"])


def _tar_directory(path: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(path, arcname=".")
    return buffer.getvalue()
