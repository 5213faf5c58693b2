"""The backend seam: the one protocol everything above the engine uses.

A backend makes images ready, runs one attempt of a prepared replay in a fresh sandbox and hands back its
record with the attempt's run directory filled in on this host, gives sandboxes access to a model gateway,
cancels what it is running, sweeps leftovers, answers the housekeeping commands, and closes. What sits
above it (pre-flight, retries, the batch scheduler, the CLI) never sees an engine, a container or a
Docker error: failures arrive as :class:`~pvisor_host.errors.PvisorHostError` s, outcomes as records.

Two kinds of backend fit it without special cases:

* the local Docker engine (:class:`~pvisor_host.backend.docker.DockerBackend`, the default);
* a cluster of Docker hosts, where :meth:`Backend.run_attempt` ships the prepared replay to a node that runs
  the Docker backend's whole single-host pipeline (stage, run, collect, record) against its own engine,
  then streams the run directory back into ``attempt.run_dir`` here.

Who owns what a backend creates is explicit (:class:`~pvisor_host.models.ownership.Ownership`): every
resource carries the invocation's session (which :meth:`Backend.cancel` looks for, on every machine) and
its creating process (which :meth:`Backend.sweep` judges alive or gone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # annotations only: importing the seam costs nothing
    import threading
    from collections.abc import Callable
    from pathlib import Path

    from ..models.housekeeping import AgentStatus, CatalogEntry, Check, GcReport, PruneResult
    from ..models.image import (
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
    from ..models.ownership import Ownership
    from ..models.record import ReplayRecord
    from ..models.replay import Attempt, PreparedReplay, Runtime, SandboxPlan
    from ..models.spec import ModelUpstream


class ModelGateway(Protocol):
    """A started model gateway for the sandboxes of one user. What it is depends on the backend (a listener
    on this host, the key for each node's own gateway), and only the backend that opened it uses it: the
    backend's type says which gateway its :meth:`Backend.run_attempt` takes, so nothing downcasts."""

    def close(self) -> None:
        """Stop it, and remove what it created (a socket directory, a network)."""


GatewayT = TypeVar("GatewayT", bound=ModelGateway)


class Backend(Protocol[GatewayT]):
    """Where sandboxes run. Every method raises only :class:`~pvisor_host.errors.PvisorHostError` s; an
    engine failure is an :class:`~pvisor_host.errors.InfrastructureError` naming what was being done.

    ``GatewayT`` is the backend's own kind of model gateway: what :meth:`open_gateway` gives and
    :meth:`run_attempt` takes back. Code above the seam holds an :data:`AnyBackend` and passes the gateway
    along without looking into it."""

    @property
    def ownership(self) -> Ownership:
        """The owner labels of everything this backend creates."""

    # -- images ---------------------------------------------------------------------------------------------

    def plan_image(self, request: ImageRequest) -> ImagePlan:
        """Decide, without starting a container, how the requested image is had: built, taken on its
        labels, probed, or injected into. The plan carries the agent's profile.

        Raises:
            UsageError: no such image, an image of another agent or version, an unlabelled image without an
                agent, a task image ``--inject`` cannot use.
        """

    def ensure_image(self, plan: ImagePlan, build: BuildOptions) -> ResolvedImage:
        """Make the planned image ready: build (once) and verify it, probe it, or fill its runtime volume.

        Raises:
            UsageError: the image turns out wrong for the request (no pvisor, another agent version).
            ImageBuildError: a build, its verification or a runtime volume failed.
        """

    def preview_image(self, plan: ImagePlan) -> ImagePreview:
        """What :meth:`ensure_image` would give, found without building, probing or filling anything."""

    # -- images named by reference (a dataset's task images) ------------------------------------------------

    def image_cost(self, ref: str) -> ImageCost:
        """What having the image ``ref`` costs, found without pulling: present already, or the layers its
        registry lists (with the registry's digest)."""

    def reserve_image(self, ref: str, *, budget: int | None, cancel: threading.Event | None = None) -> ImageHold:
        """Hold the image ``ref`` from now until :meth:`release_image`: present, at once; else with room made
        for its pull within ``budget`` (images nobody holds removed, least recently used first; a wait while
        only held images could make room) and the pull noted for ``gc`` before it starts.

        Raises:
            UsageError: the pull alone downloads more than ``budget``.
            Interrupted: ``cancel`` was set while it waited for room.
        """

    def fill_image(
        self,
        hold: ImageHold,
        *,
        progress: Callable[[PullProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> PulledImage:
        """Make the held image present: nothing to do when it is, else pull it, reporting ``progress``,
        retrying what a registry means as passing (a rate limit for as long as it asks). A failed pull is
        forgotten.

        Raises:
            ImageUnavailable: no such image, or the registry refuses our credentials (``category`` says which).
            RegistryError: the registry stayed unreachable or failing past the retries.
            UsageError: the image alone takes more than the budget once unpacked.
            Interrupted: ``cancel`` was set.
        """

    def release_image(self, hold: ImageHold) -> None:
        """The holder is done with the image (its last container is gone). On a cluster, its nodes may then
        let their copies go."""

    def finish_images(self, *, keep: bool = False) -> list[str]:
        """The batch has ended: remove the images it pulled that nobody holds (``keep``: leave them for good,
        no longer anyone's to remove). Returns the references removed."""

    def image_usage(self) -> ImageUsage | None:
        """What the engine's image cache holds, and its peak while this batch used it (None: a cluster, whose
        nodes each keep their own; ``cluster status`` shows them)."""

    def node_pulls(self) -> int | None:
        """On a cluster, the pulls of task images its nodes made so far, summed over nodes (None: one engine)."""

    def push_image(self, ref: str, registry: str) -> str:
        """Push the image ``ref`` (built here) to ``registry`` (``HOST[:PORT][/PATH]``) under its own name and
        tag, and return the digest reference it can be pulled by (``registry/name@sha256:...``).

        Raises:
            InfrastructureError: the push failed, or the registry gave no digest.
        """

    def image_budget(self, given: int | None = None) -> int | None:
        """The budget of the engine's image cache (the distinct layers of the task images pulled for batches),
        ``--image-budget`` being ``given``: that, or by default half of the engine storage's free space plus what
        the cache holds, when it can be read (None: no budget here; a cluster's nodes keep ``given`` each, on
        their own disks)."""

    # -- sandboxes ------------------------------------------------------------------------------------------

    def runtime(self, name: str | None) -> Runtime:
        """The container runtime ``name`` (None: the engine's default), as the engine has it registered.

        Raises:
            UsageError: the engine has no runtime of that name (the message lists those it has).
        """

    def describe_sandbox(self, prepared: PreparedReplay) -> SandboxPlan:
        """The mounts, limits and command of the sandbox :meth:`run_attempt` would start (nothing starts).

        Raises:
            UsageError: a sandbox the backend would refuse to start (``--image-workspace`` with an image that has
                nothing at the workspace path): the run and ``batch --plan`` ask alike.
        """

    def capacity(self) -> int | None:
        """Sandboxes it can run at once now (a cluster: its engines' free and busy slots together), or None
        when it has no such number (one engine: the batch's ``--workers`` decides)."""

    def running_sandboxes(self) -> int:
        """Replay sandboxes of pvisor-host running on its engine now, whoever started them (a cluster: 0, its
        :meth:`capacity` counts the free slots)."""

    def open_gateway(self, upstream: ModelUpstream, *, user: str) -> GatewayT:
        """Start a gateway to ``upstream`` for sandboxes running as ``user`` (close it when done). The real key
        is read from ``upstream.api_key_env`` and never enters a sandbox unless ``network`` is pass-through."""

    def run_attempt(
        self,
        prepared: PreparedReplay,
        attempt: Attempt,
        *,
        gateway: GatewayT | None = None,
        cancel: threading.Event | None = None,
    ) -> ReplayRecord:
        """Run one attempt in a fresh sandbox and return its record, also written with every artifact to
        ``attempt.run_dir``. An attempt that ran always yields a record, whatever its status; the sandbox is
        removed on every path.

        ``gateway`` is the continuation's (from :meth:`open_gateway`). When ``cancel`` is set, or on Ctrl-C,
        the sandbox is stopped and the record says ``interrupted``.

        Raises:
            Interrupted: Ctrl-C, or ``cancel``, before or while the sandbox ran (its record is written).
            UsageError: the request is refused on the backend's side (a missing image, a workspace too big).
        """

    def run_forks(
        self,
        prepared: PreparedReplay,
        *,
        gateway: GatewayT | None = None,
        cancel: threading.Event | None = None,
    ) -> list[ReplayRecord]:
        """Run ``prepared`` with ``--fork K``: the prefix's sandbox up to the boundary, checkpointed there, then K
        forks restored from it (docs/fork.md). The records, each also in its run directory (``prefix/``,
        ``fork-<k>/``): the prefix's first, then each fork's in order; the prefix's alone when it ended before the
        boundary. Every sandbox is removed on every path.

        Raises:
            Interrupted: Ctrl-C, or ``cancel``; the records of what finished are written.
        """

    def cancel(self) -> None:
        """Stop every sandbox of this backend's session that is running now (their attempts then end
        ``interrupted``); callable from any thread."""

    # -- housekeeping ---------------------------------------------------------------------------------------

    def sweep(self, *, dry_run: bool = False, out: Path | None = None) -> GcReport:
        """Remove what controllers that are gone left behind (``gc``); never a live owner's or another host's. With
        ``out``, only what dead runs into that batch directory left (a batch does so before it starts)."""

    def catalog(self) -> list[CatalogEntry]:
        """The images and runtime volumes pvisor-host made, least recently used first."""

    def prune(
        self, *, keep_bytes: int | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> PruneResult:
        """Remove pvisor-host images and runtime volumes least recently used first, never one in use."""

    def agent_statuses(self) -> list[AgentStatus]:
        """Every agent profile, and whether its image is present."""

    def diagnose(self) -> list[Check]:
        """The engine's side of ``doctor``: engine, architecture, disk, registry, base and agent images."""

    def close(self) -> None:
        """Release the connection (and anything else held open)."""


AnyBackend = Backend[Any]
"""A backend, whatever its gateway: what everything above the seam holds."""
