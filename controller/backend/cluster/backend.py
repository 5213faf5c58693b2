"""The cluster backend: the backend seam's second implementation, over a Ray cluster of Docker hosts.

The driver (this process, on a machine of the cluster) keeps a local
:class:`~pvisor_host.backend.docker.DockerBackend` for what happens before a sandbox: images are planned,
built and verified here, as for a local run, and the housekeeping commands stay local (those methods hand
over to it). :meth:`ClusterBackend.run_attempt` runs the attempt on the cluster instead
(:class:`~.copies.AttemptRun`):

* Ray schedules each copy of the attempt (:func:`.node.tasks.run_copy`) by resources, on a node that
  advertises a free ``docker_engine`` slot (``node join --slots``), never on a node without an engine;
* the copy makes the image present (:mod:`.ship`: by digest from a registry, or chunks through the cluster,
  once per node); a task image (``--image`` with ``--inject``) the node pulls itself from its registry, by
  the digest the driver resolved, within the node's own disk budget (:mod:`.task_images`,
  :mod:`.node.images`), and the items of one task image are sent to one node where Ray can; it then runs
  the same single-host pipeline as a local run against the node's own engine, and
  leaves the run directory on the node; a pinned streaming task (:func:`.node.tasks.fetch_run`) brings it
  back in chunks, through the same safe extractor and byte cap as a local collection;
* a lost or hung node's copy runs again elsewhere (:mod:`.copies`).

The backend owns its Ray connection (:class:`~.connect.RayConnection`): :meth:`close` ends it, and nothing
else in the process is shut down with it.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._log import logger
from ..._version import __version__
from ...errors import InfrastructureError, PrerequisiteError, UsageError
from ...models.image import ImageHold, ImageUsage
from .connect import ENGINE_RESOURCE, connect, engine_nodes, pinned_to, preferring
from .copies import MAX_NODE_LOSSES, AttemptRun, Watch
from .ledger import Ledger
from .limits import MAX_CALLS, limits_actor
from .node import tasks as on_node
from .ship import Shipper
from .task_images import Placement, TaskImages

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...models.housekeeping import AgentStatus, CatalogEntry, Check, GcReport, PruneResult
    from ...models.image import (
        BuildOptions,
        ImageCost,
        ImagePlan,
        ImagePreview,
        ImageRequest,
        PulledImage,
        PullProgress,
        ResolvedImage,
    )
    from ...models.ownership import Ownership
    from ...models.record import ReplayRecord
    from ...models.replay import Attempt, PreparedReplay, Runtime, SandboxPlan
    from ...models.spec import ModelUpstream
    from ..base import Backend
    from ..docker import DockerBackend

#: A node Ray has marked dead for this long while a copy runs (or may be queued) there is given up on, and
#: the attempt runs again elsewhere (seconds; the ``PVISOR_HOST_CLUSTER_GRACE`` variable sets another).
DEFAULT_GRACE = 20.0
GRACE_ENV = "PVISOR_HOST_CLUSTER_GRACE"

#: Why ``--fork`` does not run on a cluster: the checkpoint and its forks are one engine's.
FORK_PROBLEM = "forks run on one engine, not on a cluster (the checkpoint is one engine's; docs/fork.md)"


class ClusterGateway:
    """A continuation's model, for sandboxes on nodes: each copy's node starts its own gateway with the key,
    which travels to it only over the cluster's authenticated channel. The batch's model limits are one
    :class:`~.limits.ClusterLimits` actor on the driver's node, which every node's gateway takes its slots in."""

    def __init__(self, upstream: ModelUpstream, ray: Any = None, node_id: str = "") -> None:
        self.upstream = upstream
        self.key = upstream.api_key()
        self.limits: Any = None
        self._ray = ray
        if ray is not None and any(
            (upstream.concurrency, upstream.requests_per_minute, upstream.tokens_per_minute)
        ):  # fmt: skip
            self.limits = limits_actor(ray, node_id, upstream, pinned_to(node_id))

    def close(self) -> None:
        """Each node's gateway closes with its copy; the batch's limits go with the batch."""
        if self.limits is not None and self._ray is not None:
            with contextlib.suppress(Exception):
                self._ray.kill(self.limits)
            self.limits = None


class ClusterBackend:
    """Sandboxes on the Docker hosts of a Ray cluster (see the module docstring)."""

    def __init__(
        self, address: str, local: DockerBackend, *, grace: float | None = None, registry: str | None = None
    ) -> None:
        self.address = address
        self.local = local
        self.grace = grace if grace is not None else float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE)
        self._connection = connect(address)
        self.ray = self._connection.ray
        self._cancelled = threading.Event()
        self._inputs: dict[Path, Any] = {}
        self._inputs_lock = threading.Lock()
        try:
            self._remotes()
            self._check_nodes()
            here = self.ray.get_runtime_context().get_node_id()  # the ledger lives as long as this driver
            self.ledger = (  # every running copy waits on it (``wait_stop``): as many calls at once as copies
                self.ray.remote(Ledger)
                .options(num_cpus=0, max_concurrency=MAX_CALLS, scheduling_strategy=pinned_to(here))
                .remote()
            )
            self.watch = Watch(self.ray, self.ledger)
            self.shipper = Shipper(local.images, self.ray, registry)
            self.task_images = TaskImages(local.puller)
            self.placement = Placement()
            self.node_budget: int | None = None
            self.node_pulls_by_image: dict[str, int] = {}
            """Task image pulls the nodes made, by image id."""
        except BaseException:
            self._connection.close()
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

    def _on_node(self, name: str, node_id: str) -> Any:
        """The node call ``name`` (``info``, ``fetch``), pinned to one node."""
        return self._calls[name].options(scheduling_strategy=pinned_to(node_id))

    def capacity(self) -> int:
        """See :meth:`pvisor_host.backend.base.Backend.capacity`: the ``docker_engine`` slots of the alive nodes."""
        return int(sum(n["Resources"][ENGINE_RESOURCE] for n in engine_nodes(self.ray)))

    def running_sandboxes(self) -> int:
        """See :meth:`pvisor_host.backend.base.Backend.running_sandboxes`: 0, the slots already count them."""
        return 0

    def _check_nodes(self) -> None:
        engines = engine_nodes(self.ray)
        if not engines:
            raise PrerequisiteError(
                f"no node of the cluster at {self.address} has a Docker engine",
                hint=f"run `pvisor-host node join --address {self.address}` on each Docker host",
            )
        infos = self._get([self._on_node("info", n["NodeID"]).remote() for n in engines], timeout=120)
        for info in infos:
            if info["version"] != __version__:
                raise PrerequisiteError(
                    f"node {info['node']} runs pvisor-host {info['version']}; this is {__version__}",
                    hint="install the same pvisor-host on every node",
                )
        logger.info("cluster {}: {} nodes, {} slots", self.address, len(engines), self.capacity())

    def _get(self, refs: Any, *, timeout: float | None = None) -> Any:
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise InfrastructureError(f"the cluster at {self.address} did not answer within {timeout:.0f}s") from None

    # -- images (made here, on the driver's engine) -----------------------------------------------------------

    def plan_image(self, request: ImageRequest) -> ImagePlan:
        """See :meth:`pvisor_host.backend.base.Backend.plan_image`; a task image to inject into is planned from
        its registry's manifest and configuration, not pulled here (:mod:`.task_images`)."""
        if request.inject and request.image is not None:
            return self.task_images.plan(request.image, request.profile)
        return self.local.plan_image(request)

    def ensure_image(self, plan: ImagePlan, build: BuildOptions) -> ResolvedImage:
        """See :meth:`pvisor_host.backend.base.Backend.ensure_image`: built here, shipped to nodes when used; for
        a task image, only the agent image its runtime comes from (each node fills its own runtime volume)."""
        from ...models.image import BuildPlan, InjectPlan, ResolvedImage
        from ..docker.image.resolve import injected_image

        if not isinstance(plan, InjectPlan):
            return self.local.ensure_image(plan, build)
        agent = self.local.ensure_image(BuildPlan(profile=plan.profile), build)
        assert agent.built is not None
        image = injected_image(plan, agent.built.id, agent.built.tag)
        return ResolvedImage(profile=plan.profile, image=image, built=agent.built)

    def preview_image(self, plan: ImagePlan) -> ImagePreview:
        """See :meth:`pvisor_host.backend.base.Backend.preview_image`."""
        return self.local.preview_image(plan)

    def image_cost(self, ref: str) -> ImageCost:
        """See :meth:`pvisor_host.backend.base.Backend.image_cost` (the driver's engine and registries)."""
        return self.local.image_cost(ref)

    def reserve_image(self, ref: str, *, budget: int | None, cancel: threading.Event | None = None) -> ImageHold:
        """See :meth:`pvisor_host.backend.base.Backend.reserve_image`: the driver holds nothing (each node holds
        its copy for its own items, within its own budget)."""
        return ImageHold(ref=ref, token=uuid.uuid4().hex, budget=budget)

    def fill_image(
        self,
        hold: ImageHold,
        *,
        progress: Callable[[PullProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> PulledImage:
        """See :meth:`pvisor_host.backend.base.Backend.fill_image`: on a cluster the image is resolved to its
        digest in its registry, and the nodes pull it (nothing comes to the driver's engine)."""
        resolved = self.task_images.resolve(hold.ref, cancel=cancel)
        hold.key = resolved.id
        return resolved.model_copy(update={"pulled": True})

    def release_image(self, hold: ImageHold) -> None:
        """See :meth:`pvisor_host.backend.base.Backend.release_image`: the nodes hear it through the ledger and
        let their copies go as their budgets need."""
        if hold.key is None:
            return
        with contextlib.suppress(Exception):  # the ledger lives on this node; if it is gone, so is the batch
            self.ledger.image_done.remote(hold.key)

    def finish_images(self, *, keep: bool = False) -> list[str]:
        """See :meth:`pvisor_host.backend.base.Backend.finish_images`: the nodes keep what they pulled within
        their budgets."""
        return []

    def image_usage(self) -> ImageUsage | None:
        """See :meth:`pvisor_host.backend.base.Backend.image_usage`: each node's own is in ``cluster status``."""
        return None

    def node_pulls(self) -> int | None:
        """See :meth:`pvisor_host.backend.base.Backend.node_pulls`."""
        with self._inputs_lock:
            return sum(self.node_pulls_by_image.values())

    def push_image(self, ref: str, registry: str) -> str:
        """See :meth:`pvisor_host.backend.base.Backend.push_image`."""
        return self.local.push_image(ref, registry)

    def image_budget(self, given: int | None = None) -> int | None:
        """See :meth:`pvisor_host.backend.base.Backend.image_budget`: none on the driver, which pulls nothing;
        ``given`` is each node's budget (a node without one takes half its engine's free space)."""
        self.node_budget = given
        return None

    def runtime(self, name: str | None) -> Runtime:
        """See :meth:`pvisor_host.backend.base.Backend.runtime` (the driver's engine answers for the nodes; forks run
        on one engine only)."""
        return self.local.runtime(name).model_copy(update={"fork_problem": FORK_PROBLEM})

    def describe_sandbox(self, prepared: PreparedReplay) -> SandboxPlan:
        """See :meth:`pvisor_host.backend.base.Backend.describe_sandbox` (a task image is on the nodes, not here: a
        node's staging checks what it holds)."""
        return self.local.describe_sandbox(prepared, here=not prepared.image.task_image)

    # -- sandboxes, on nodes --------------------------------------------------------------------------------

    def open_gateway(self, upstream: ModelUpstream, *, user: str) -> ClusterGateway:
        """See :meth:`pvisor_host.backend.base.Backend.open_gateway`: each node runs its own gateway."""
        if not upstream.gateway:
            raise UsageError("--model-network pass-through does not run on a cluster (the key would enter a sandbox)")
        return ClusterGateway(upstream, self.ray, self.ray.get_runtime_context().get_node_id())

    def run_attempt(
        self,
        prepared: PreparedReplay,
        attempt: Attempt,
        *,
        gateway: ClusterGateway | None = None,
        cancel: threading.Event | None = None,
    ) -> ReplayRecord:
        """See :meth:`pvisor_host.backend.base.Backend.run_attempt`: as Ray tasks (see :mod:`.copies`)."""
        run = AttemptRun(self, prepared, attempt, gateway)
        return run.follow(cancel)

    def run_forks(
        self, prepared: PreparedReplay, *, gateway: ClusterGateway | None = None, cancel: threading.Event | None = None
    ) -> list[ReplayRecord]:
        """See :meth:`pvisor_host.backend.base.Backend.run_forks`: refused (:data:`FORK_PROBLEM`)."""
        raise UsageError(f"--fork: {FORK_PROBLEM}")

    def cancel(self) -> None:
        """Stop every copy of this batch on every node (their attempts end ``interrupted``)."""
        self._cancelled.set()
        with contextlib.suppress(Exception):
            self.ledger.stop_all.remote()

    def cancelled(self, cancel: threading.Event | None) -> bool:
        """Whether the batch, or the attempt's own ``cancel``, was asked to stop."""
        return self._cancelled.is_set() or (cancel is not None and cancel.is_set())

    def submit_copy(
        self,
        copy_id: str,
        request: dict[str, Any],
        trajectory: bytes,
        workspace: Any,
        key: str | None,
        node: str | None = None,
    ) -> Any:
        """Start one copy of an attempt as a Ray task (see :class:`~.copies.Cluster`), preferably on ``node``."""
        run_copy = self._run_copy
        if node is not None and request.get("task") is not None:  # where its task image is (or will be): it waits
            run_copy = run_copy.options(scheduling_strategy=preferring(node))  # there (elsewhere if node is gone)
        elif node is not None:  # spread after a node died (see place): elsewhere too, when node has no slot free
            run_copy = run_copy.options(scheduling_strategy=preferring(node, spill=True))
        return run_copy.remote(copy_id, request, self.ledger, trajectory, workspace, key)

    def fetch_from(self, node_id: str, token: str) -> Any:
        """Stream a copy's run directory back from its node (see :class:`~.copies.Cluster`)."""
        return self._on_node("fetch", node_id).remote(self.session, token)

    def image_manifest(self, prepared: PreparedReplay, *, chunks: bool) -> dict[str, Any]:
        """What a node gets to make the image present (see :class:`~.copies.Cluster`): the sandbox image, or for
        a task image the agent image its runtime volume is filled from (the node pulls the task image)."""
        if prepared.image.runtime_volume is not None and prepared.built is not None:
            return self.shipper.manifest(prepared.built.id, prepared.built.tag, chunks=chunks)
        return self.shipper.manifest(prepared.image.id, prepared.image.ref, chunks=chunks)

    def task_manifest(self, prepared: PreparedReplay) -> dict[str, Any] | None:
        """What a node needs to pull an injected task image itself (see :class:`~.copies.Cluster`), or None."""
        image = prepared.image
        if image.runtime_volume is None:
            return None
        if image.digest is None:
            raise UsageError(f"task image {image.ref}: its registry gave no digest; the nodes pull task images by one")
        size = self.task_images.resolve(image.ref).size
        return {"id": image.id, "ref": image.ref, "pull": image.digest, "size": size, "budget": self.node_budget}

    def place(self, prepared: PreparedReplay) -> str | None:
        """The node Ray is asked to prefer for the attempt's next copy (None: wherever Ray spreads it).

        A task image's items go to the image's node (:class:`~.task_images.Placement`). Other copies are
        spread by Ray, until a node dies during the batch: from then on each prefers the alive engine with the
        fewest copies placed on it (those placed since the death, and task images' items), and spills to a free
        slot elsewhere when that one has none. The driver's Ray keeps one queue of the batch's spread copies,
        with no more lease requests open than copies queued, and a request sent to a node that then hung stays
        open until gRPC's keepalive gives up (7 minutes: 300 s and 120 s); so a copy submitted after the death
        waited behind it while other nodes were idle. A copy that prefers a node is in a queue of that node's
        own (Ray's scheduling key holds the strategy and its node).
        """
        if prepared.image.runtime_volume is not None:
            layers = self.task_images.layers(prepared.image.ref)
            return self.placement.place(prepared.image.id, self.watch.engines(), layers)
        return self.placement.spread(self.watch.engines()) if self.watch.seen_death else None

    def ended(self, node: str | None, pulled: str | None) -> None:
        """A copy placed on ``node`` ended; the node pulled the task image ``pulled`` for it (None: it had it)."""
        if node is not None:
            self.placement.ended(node)
        if pulled is not None:
            with self._inputs_lock:
                self.node_pulls_by_image[pulled] = self.node_pulls_by_image.get(pulled, 0) + 1

    def workspace_ref(self, path: Path) -> Any:
        """The workspace directory as a tar in the object store, once per directory for the whole batch."""
        with self._inputs_lock:
            if path not in self._inputs:
                self._inputs[path] = self.ray.put(_tar_directory(path))
            return self._inputs[path]

    # -- housekeeping (the driver's engine) ------------------------------------------------------------------

    def sweep(self, *, dry_run: bool = False, out: Path | None = None) -> GcReport:
        """See :meth:`pvisor_host.backend.base.Backend.sweep` (this host; each node sweeps when it joins)."""
        return self.local.sweep(dry_run=dry_run, out=out)

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
        self._connection.close()
        self.local.close()


def _tar_directory(path: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(path, arcname=".")
    return buffer.getvalue()


if TYPE_CHECKING:  # mypy checks that the cluster backend fits the seam, with its own gateway

    def _fits(backend: ClusterBackend) -> Backend[ClusterGateway]:
        return backend
