"""The local Docker engine behind the backend seam: each method is one stage, wired to its module.

=====================  ====================================================
seam                   stage
=====================  ====================================================
``plan_image``         :func:`.image.resolve.plan_image` (labels, no container)
``ensure_image``       :func:`.image.resolve.materialize` (build, probe, inject)
``describe_sandbox``   :mod:`.sandbox.launch` (the hardened container spec)
``open_gateway``       :class:`.gateway.Gateway`
``run_attempt``        :func:`.sandbox.run.run_attempt` (stage, run, collect, record)
``cancel``             kill this session's running replay containers
``sweep``              :func:`.cleanup.gc.collect_garbage`
``catalog``/``prune``  :mod:`.cleanup.catalog`
``diagnose``           :mod:`.doctor`
=====================  ====================================================

Every method maps engine failures through :func:`.engine.engine_errors`, so nothing above the seam ever
sees a Docker exception.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from docker.errors import NotFound

from ..._log import logger
from ...errors import EngineUnresponsive, ImageUnavailable, PvisorHostError
from ...models.replay import Attempt, Runtime
from ...models.spec import parse_user
from . import labels as L
from . import runtimes
from .container import Leftovers
from .engine import ENGINE_ERRORS, connect, describe, engine_errors, request_within, timed_out
from .image.files import ImageFiles
from .image.images import ImageStore, Reference
from .image.inject import Injector
from .image.users import ImageUsers
from .sandbox.seed import Seeds

#: Seconds ``close`` waits for an engine that went away to answer again, to remove what it could not.
LEFTOVER_PATIENCE = 60.0

if TYPE_CHECKING:  # each stage's module is imported when the stage is used (`pvisor-host gc` loads no build)
    from collections.abc import Callable, Collection
    from pathlib import Path

    import docker
    from docker.models.containers import Container

    from ...gateway.limits import Limits
    from ...models.housekeeping import AgentStatus, CatalogEntry, Check, GcReport, PruneResult
    from ...models.image import (
        BuildOptions,
        ImageCost,
        ImageHold,
        ImagePlan,
        ImagePreview,
        ImageRequest,
        ImageUsage,
        PulledImage,
        PullProgress,
        ResolvedImage,
    )
    from ...models.ownership import Ownership
    from ...models.record import ReplayRecord
    from ...models.replay import PreparedReplay, SandboxPlan
    from ...models.spec import ModelUpstream
    from ..base import Backend
    from .gateway import Gateway
    from .image.cache import ImageCache
    from .image.mirrors import Mirrors
    from .image.pull import Puller
    from .image.registry import Registries
    from .sandbox.run import Way
    from .sandbox.starts import StartSlots


class DockerBackend:
    """Sandboxes as containers of the local Docker engine (see the module docstring)."""

    def __init__(self, client: docker.DockerClient, ownership: Ownership) -> None:
        self.client = client
        self._ownership = ownership
        self._injector = Injector(client, ownership)
        self._files = ImageFiles(client, ownership)
        self._users = ImageUsers(self._files)
        self._runtimes: tuple[str, dict[str, Runtime], dict[str, Any]] | None = None
        self._probed: dict[str, Runtime] = {}
        self._leftovers = Leftovers()
        self.images = ImageStore(client)
        """The engine's images as other parts need them (the cluster ships images through it)."""
        self._pulls: Puller | None = None
        self._cache: ImageCache | None = None
        self._lock = threading.Lock()
        self._seeds = Seeds()
        self._starts: StartSlots | None = None

    @classmethod
    def connect(
        cls, ownership: Ownership, *, pool_size: int = 10, timeout: float = 120, docker_host: str | None = None
    ) -> DockerBackend:
        """The engine at ``docker_host`` (default: ``DOCKER_HOST``, else the default socket), checked with a ping.

        Raises:
            PrerequisiteError: no engine answers.
        """
        return cls(connect(timeout=timeout, pool_size=pool_size, docker_host=docker_host), ownership)

    @property
    def ownership(self) -> Ownership:
        """The owner labels of everything this backend creates."""
        return self._ownership

    def capacity(self) -> int | None:
        """See :meth:`pvisor_host.backend.base.Backend.capacity`: one engine has no fixed number of slots."""
        return None

    def engine_version(self) -> str:
        """The engine's version (``docker version``)."""
        with engine_errors("read the engine's version"):
            return str(self.client.version().get("Version", "?"))

    def running_sandboxes(self) -> int:
        """Replay sandboxes of pvisor-host running on this engine now, whoever started them."""
        with engine_errors("list the running sandboxes"):
            return len(self.client.containers.list(filters={"label": f"{L.ROLE}=replay"}, sparse=True))

    # -- images ---------------------------------------------------------------------------------------------

    def plan_image(self, request: ImageRequest) -> ImagePlan:
        """See :meth:`pvisor_host.backend.base.Backend.plan_image`."""
        from .image import resolve

        with engine_errors("inspect the image"):
            return resolve.plan_image(self.client, request)

    def ensure_image(self, plan: ImagePlan, build: BuildOptions) -> ResolvedImage:
        """See :meth:`pvisor_host.backend.base.Backend.ensure_image`."""
        from .image import resolve

        with engine_errors("make the image ready"):
            return resolve.materialize(self.client, self._ownership, self._injector, self._users, plan, build)

    def keep_seeds_in(self, root: Path) -> None:
        """Keep the copies out of images (``--image-workspace``) in ``root`` rather than beside each run's
        directory (a cluster's node, whose run directories go with their copies)."""
        self._seeds.root = root

    def image_in_use(self, image_id: str) -> bool:
        """Whether a container of this engine (running or not, anyone's) was made from the image."""
        with engine_errors(f"list the containers of image {image_id[:19]}"):
            return bool(self.client.containers.list(all=True, filters={"ancestor": image_id}, sparse=True))

    def inject_into(self, prepared: PreparedReplay, agent_image_id: str) -> None:
        """Make an injected replay's runtime ready on this engine: its runtime volume filled from the agent
        image ``agent_image_id`` (unless a complete one is there), and its task image probed (a cluster's node
        does this for the task images it pulls; a local batch does it when it resolves the image).

        Raises:
            UsageError: the task image cannot take the runtime (musl, missing libraries).
            ImageBuildError: filling the volume failed.
        """
        with engine_errors("make the injected runtime ready"):
            self._injector.ensure_runtime_volume(prepared.profile, agent_image_id)
            self._injector.check_task_image(prepared.image.id, prepared.image.ref, prepared.profile)

    def preview_image(self, plan: ImagePlan) -> ImagePreview:
        """See :meth:`pvisor_host.backend.base.Backend.preview_image`."""
        from .image import resolve

        with engine_errors("look the image up"):
            return resolve.preview(self.client, self._users, plan)

    # -- images named by reference ----------------------------------------------------------------------------

    @property
    def registries(self) -> Registries:
        """This backend's registry client (manifests, configurations, credentials)."""
        return self.puller.registries

    @property
    def puller(self) -> Puller:
        """This backend's pulls and registry questions (:mod:`.pull`): one set of rate-limit gates for all."""
        with self._lock:
            if self._pulls is None:
                from .image.pull import Puller

                self._pulls = Puller(self.client)
            return self._pulls

    def use_mirrors(self, mirrors: Mirrors) -> None:
        """Pull task images, and ask about them, through ``mirrors`` (``--registry-mirror``, ``--image-rewrite``)."""
        self.puller.registries.mirrors = mirrors

    def image_cost(self, ref: str) -> ImageCost:
        """See :meth:`pvisor_host.backend.base.Backend.image_cost`."""
        from ...models.image import ImageCost
        from .image.registry import ManifestError

        found = self.puller.present(ref)
        if found is not None:
            return ImageCost(ref=ref, present=True, id=found.id, size=found.size, digest=found.digest)
        from .image.pull import registry_fault

        try:
            manifest = self.puller.registries.manifest(ref)
        except ManifestError as exc:
            fault = registry_fault(ref, exc)
            unavailable = isinstance(fault, ImageUnavailable)
            error = fault.one_line() if isinstance(fault, PvisorHostError) else str(exc)
            return ImageCost(ref=ref, present=False, error=error, unavailable=unavailable)
        source = self.puller.registries.mirrors.source(ref)
        digest = f"{Reference(source).repository}@{manifest.digest}" if manifest.digest else None
        return ImageCost(ref=ref, present=False, id=manifest.config_digest, digest=digest, layers=manifest.layers)

    @property
    def image_cache(self) -> ImageCache:
        """This engine's image cache (:mod:`.cache`), shared with every process that uses the engine."""
        puller = self.puller
        with self._lock:
            if self._cache is None:
                from .image.cache.engine import open_cache

                self._cache = open_cache(self.client, self._ownership, puller=puller, on_removed=self._seeds.drop)
            return self._cache

    def reserve_image(
        self,
        ref: str,
        *,
        budget: int | None,
        cancel: threading.Event | None = None,
        owned: bool = True,
        done: Callable[[], Collection[str]] | None = None,
    ) -> ImageHold:
        """See :meth:`pvisor_host.backend.base.Backend.reserve_image` (``owned`` and ``done``: see
        :meth:`.cache.ImageCache.reserve`; a cluster node's copies keep what they pull within the budgets)."""
        return self.image_cache.reserve(ref, budget=budget, cancel=cancel, owned=owned, done=done)

    def fill_image(
        self,
        hold: ImageHold,
        *,
        progress: Callable[[PullProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> PulledImage:
        """See :meth:`pvisor_host.backend.base.Backend.fill_image`."""
        return self.image_cache.fill(hold, progress=progress, cancel=cancel)

    def release_image(self, hold: ImageHold) -> None:
        """See :meth:`pvisor_host.backend.base.Backend.release_image`."""
        try:
            self.image_cache.release(hold)
        except OSError as exc:  # the state directory: its hold ends with this process all the same
            logger.warning("could not let go of {}: {}", hold.ref, exc)

    def finish_images(self, *, keep: bool = False) -> list[str]:
        """See :meth:`pvisor_host.backend.base.Backend.finish_images`."""
        return self.image_cache.finish(keep=keep)

    def image_usage(self) -> ImageUsage:
        """See :meth:`pvisor_host.backend.base.Backend.image_usage`."""
        usage = self.image_cache.usage()
        return usage.model_copy(update={"peak": self.image_cache.peak(self._ownership.session)})

    def push_image(self, ref: str, registry: str) -> str:
        """See :meth:`pvisor_host.backend.base.Backend.push_image`."""
        from .image.images import push_target

        with engine_errors(f"inspect image {ref}"):
            image_id = str(self.client.images.get(ref).id)
        return self.images.push(image_id, *push_target(registry, ref, image_id))

    def node_pulls(self) -> int | None:
        """See :meth:`pvisor_host.backend.base.Backend.node_pulls`: one engine has no nodes."""
        return None

    def image_budget(self, given: int | None = None) -> int | None:
        """See :meth:`pvisor_host.backend.base.Backend.image_budget`: by default half of what the engine's data
        root has free plus what the image cache holds (so the default does not shrink as the cache fills), when
        that directory is on this machine; never more than another batch on the engine keeps to (the cache is
        one, and stays within one budget), which is said in one line."""
        budget = given if given is not None else self._default_budget()
        self.image_cache.share_budget(budget)
        return budget

    def _default_budget(self) -> int | None:
        with engine_errors("read the engine's information"):
            root = self.client.info().get("DockerRootDir")
        try:
            stats = os.statvfs(root) if root else None
        except OSError:
            stats = None
        if stats is None:
            return None
        return (stats.f_bavail * stats.f_frsize + self.image_cache.usage().bytes) // 2

    # -- sandboxes ------------------------------------------------------------------------------------------

    def runtime(self, name: str | None) -> Runtime:
        """See :meth:`pvisor_host.backend.base.Backend.runtime`."""
        if self._runtimes is None:
            with engine_errors("read the engine's runtimes"):
                self._runtimes = runtimes.registered(self.client)
        default, known, info = self._runtimes
        chosen = runtimes.choose(name or default, known)
        if chosen.name not in self._probed:  # once per runtime: a batch asks for each item
            self._probed[chosen.name] = runtimes.probed(chosen, info)
        return self._probed[chosen.name]

    def describe_sandbox(self, prepared: PreparedReplay, *, here: bool = True) -> SandboxPlan:
        """See :meth:`pvisor_host.backend.base.Backend.describe_sandbox` (``here``: the image is on this engine, so
        what it holds is checked too)."""
        from .sandbox import launch
        from .sandbox.gate import GATE_PATH
        from .sandbox.stage import planned_staging, staging_root

        if prepared.spec.image_workspace and here:  # what the run's staging refuses, told now
            self._seeds.check(self.client, self._ownership, prepared.image.id, prepared.workspace_path)
        attempt = Attempt(run_id=prepared.run_id, run_dir=prepared.out_dir)
        staging = planned_staging(staging_root(prepared.out_dir), prepared.trajectory.path)
        if prepared.spec.fork is not None:  # the prefix launches its agent through the gate
            staging = staging.model_copy(update={"gate": GATE_PATH})
        cspec = launch.container_spec(prepared, attempt, staging, ownership=self._ownership)
        return launch.describe(prepared, cspec)

    def open_gateway(
        self, upstream: ModelUpstream, *, user: str, api_key: str | None = None, limits: Limits | None = None
    ) -> Gateway:
        """See :meth:`pvisor_host.backend.base.Backend.open_gateway`; ``api_key`` is the real key when it did not
        come from this process's environment, and ``limits`` the batch's when they are not this gateway's own
        (a cluster node gets both from the driver)."""
        from .gateway import Gateway

        uid, _ = parse_user(user)
        key = api_key if api_key is not None else upstream.api_key()
        gateway = Gateway(upstream, key, client=self.client, ownership=self._ownership, sandbox_uid=uid, limits=limits)
        return gateway.start()

    def run_attempt(
        self,
        prepared: PreparedReplay,
        attempt: Attempt,
        *,
        gateway: Gateway | None = None,
        cancel: threading.Event | None = None,
        way: Way | None = None,
    ) -> ReplayRecord:
        """See :meth:`pvisor_host.backend.base.Backend.run_attempt`; ``way``: how a fork's sandbox comes to be
        (:mod:`.sandbox.fork`)."""
        from .sandbox import run

        self._remove_leftovers()
        record = run.run_attempt(
            self.client,
            self._ownership,
            prepared,
            attempt,
            gateway=gateway,
            cancel=cancel,
            leftovers=self._leftovers,
            seeds=self._seeds,
            files=self._files,
            starts=self.start_slots,
            way=way,
        )
        if record.status == "infra_error" and self.hangs():
            raise EngineUnresponsive(
                f"the engine stopped answering (its /_ping got no answer within {PING_TIMEOUT} s after: "
                f"{record.failure.message if record.failure else 'an engine error'})"
            )
        return record

    def run_forks(
        self, prepared: PreparedReplay, *, gateway: Gateway | None = None, cancel: threading.Event | None = None
    ) -> list[ReplayRecord]:
        """See :meth:`pvisor_host.backend.base.Backend.run_forks`."""
        from .sandbox import fork

        return fork.run_forks(
            self.client, self._ownership, prepared, gateway=gateway, cancel=cancel or threading.Event(),
            kill=lambda run_id: self.cancel(run_id=run_id), run=self.run_attempt,
        )  # fmt: skip

    @property
    def start_slots(self) -> StartSlots:
        """How many sandboxes start at once on this engine, shared by every process (:mod:`.sandbox.starts`)."""
        if self._starts is None:  # asked outside the lock: a stuck engine must not hold every worker here
            from .sandbox.starts import StartSlots
            from .state import engine_state

            slots = StartSlots(engine_state(self.client, "starts"))
            with self._lock:
                self._starts = self._starts or slots
        return self._starts

    def hangs(self) -> bool:
        """Whether the engine takes a ping and gives no answer within :data:`PING_TIMEOUT` seconds: it is stuck
        (a runtime that never returns holds it), and waiting on it ends nowhere. An engine that is away (its
        socket gone or refusing: a restart) does not hang: the attempts' retries wait for it to come back."""
        try:
            request_within(self.client.api, "get", "/_ping", PING_TIMEOUT)
        except ENGINE_ERRORS as exc:
            return timed_out(exc)
        return False

    def cancel(self, *, run_id: str | None = None) -> None:
        """Kill (in parallel) every running replay container of this session (only those of ``run_id``, when
        given); their workers remove them."""
        filters = {"label": [f"{L.SESSION}={self._ownership.session}", f"{L.ROLE}=replay"]}
        if run_id is not None:
            filters["label"].append(f"{L.RUN}={run_id}")
        try:
            containers = self.client.containers.list(filters=filters, sparse=True)  # no inspect: it may hang
        except ENGINE_ERRORS as exc:
            logger.warning("could not list this session's containers ({}); each worker removes its own", describe(exc))
            return
        with futures.ThreadPoolExecutor(max_workers=16) as killers:
            for container in containers:
                killers.submit(_kill_quietly, container)

    # -- housekeeping ---------------------------------------------------------------------------------------

    def sweep(self, *, dry_run: bool = False, out: Path | None = None) -> GcReport:
        """See :meth:`pvisor_host.backend.base.Backend.sweep`."""
        from .cleanup import gc

        return gc.collect_garbage(
            self.client, self._ownership, dry_run=dry_run, out=str(out) if out is not None else None
        )

    def catalog(self) -> list[CatalogEntry]:
        """See :meth:`pvisor_host.backend.base.Backend.catalog`."""
        from .cleanup import catalog

        return catalog.list_catalog(self.client)

    def prune(
        self, *, keep_bytes: int | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> PruneResult:
        """See :meth:`pvisor_host.backend.base.Backend.prune`."""
        from .cleanup import catalog

        return catalog.prune(self.client, keep_bytes=keep_bytes, older_than=older_than, dry_run=dry_run)

    def agent_statuses(self) -> list[AgentStatus]:
        """See :meth:`pvisor_host.backend.base.Backend.agent_statuses`."""
        from .cleanup import catalog

        with engine_errors("look the agent images up"):
            return catalog.agent_statuses(self.client)

    def diagnose(self) -> list[Check]:
        """See :meth:`pvisor_host.backend.base.Backend.diagnose`."""
        from . import doctor

        with engine_errors("check the engine"):
            return doctor.diagnose(self.client)

    def close(self) -> None:
        """Remove the containers the engine could not remove earlier (waiting up to a minute for it to answer
        again), then close the connection."""
        self._remove_leftovers(patience=LEFTOVER_PATIENCE, final=True)
        self._seeds.close()
        self.client.close()

    def _remove_leftovers(self, *, patience: float = 0.0, final: bool = False) -> None:
        """Remove the containers the engine could not remove when their attempt ended; retry for ``patience``
        seconds while the engine does not answer. The ``final`` sweep says how to remove what is still there;
        an earlier one keeps it for the next."""
        from .container import LEFTOVER_TIMEOUT, remove_container

        deadline = time.monotonic() + patience
        while True:
            failed: dict[str, str] = {}
            for container_id in self._leftovers.take(stuck=final):
                try:  # by id, not inspected first: the engine may be stuck on it, and inspecting waits as removing
                    remove_container(self.client.containers.prepare_model({"Id": container_id}), LEFTOVER_TIMEOUT)
                    logger.info("removed container {} (left while the engine was away)", container_id[:12])
                except NotFound:
                    continue
                except ENGINE_ERRORS as exc:
                    failed[container_id] = describe(exc)
            if not failed:
                return
            for container_id in failed:
                self._leftovers.add(container_id)
            if time.monotonic() >= deadline or set(failed) <= self._leftovers.stuck:  # nobody waits on a stuck one
                if not final:
                    return
                for container_id, reason in failed.items():
                    logger.error(
                        "could not remove container {} ({}); remove it with `pvisor-host gc`",
                        container_id[:12],
                        reason,
                    )
                return
            time.sleep(1.0)


#: Seconds a ping may take before the engine counts as not answering.
PING_TIMEOUT = 10


def _kill_quietly(container: Container) -> None:
    try:
        container.kill()
    except ENGINE_ERRORS as exc:  # already gone, or the engine is away: its worker removes it
        logger.debug("could not kill {}: {}", container.short_id, describe(exc))


if TYPE_CHECKING:  # mypy checks that the Docker backend fits the seam, with its own gateway

    def _fits(backend: DockerBackend) -> Backend[Gateway]:
        return backend
