"""A backend that runs no sandbox: each attempt follows a script, so the scheduler above the seam can be
tested without an engine, in seconds, with exact assertions. A test aid for our own logic only.

A script maps an item's trajectory stem to the outcomes of its attempts, in order (the last one repeats):
``"ok"``, ``"replay_failed"`` (pvisor's ``trajectory_error``), ``"rate_limited"`` (retryable
``model_rate_limit``), ``"infra_error"`` or ``"oom"``; ``seconds`` says how long an attempt runs. An attempt
that outlives ``--timeout`` ends ``timeout``; :meth:`FakeBackend.cancel` stops the running ones, which end
``interrupted``, as the Docker backend's do.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pvisor_host.backend.base import Backend
from pvisor_host.backend.docker.image.cache import ImageCache, Ledger, Priced
from pvisor_host.backend.docker.image.cache.layers import Layer
from pvisor_host.backend.docker.image.registry import ManifestError
from pvisor_host.errors import ImageUnavailable, Interrupted, UsageError
from pvisor_host.models.housekeeping import AgentStatus, CatalogEntry, Check, GcReport, PruneResult
from pvisor_host.models.image import (
    BuildOptions,
    BuildPlan,
    ImageCost,
    ImageHold,
    ImagePlan,
    ImagePreview,
    ImageRef,
    ImageRequest,
    ImageUsage,
    InjectPlan,
    PulledImage,
    PullProgress,
    ResolvedImage,
)
from pvisor_host.models.ownership import Ownership
from pvisor_host.models.record import ContainerInfo, Failure, Inputs, Limits, ReplayRecord, TrajectoryRef, save_record
from pvisor_host.models.replay import Attempt, PreparedReplay, Runtime, SandboxPlan
from pvisor_host.models.spec import ModelUpstream

_FAILURES = {
    "replay_failed": Failure(category="trajectory_error", message="invalid native JSONL at line 1"),
    "rate_limited": Failure(category="model_rate_limit", message="status 429", retryable=True),
    "infra_error": Failure(category="infra_error", message="Docker engine failed to start container x: injected"),
    "oom": Failure(category="oom", message="the sandbox ran out of memory"),
    "disk_full": Failure(category="disk_full", message="the run directory's filesystem is full: os error 28"),
}
_STATUS = {"rate_limited": "replay_failed", "disk_full": "infra_error"}


class FakeGateway:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeRegistry:
    """Task images a :class:`FakeBackend` can pull: ref → (bytes on the engine, seconds a pull takes), or a
    failure (``"image_not_found"``, ``"registry_unauthorized"``) instead of a size."""

    def __init__(self, images: dict[str, tuple[int, float] | str]) -> None:
        self.images = images


class FakeCacheEngine:
    """The fake backend's engine and registry as the image cache asks them: one layer per image, as big as the
    registry says it is unpacked (half of that downloaded)."""

    def __init__(self, backend: FakeBackend) -> None:
        self._backend = backend

    def present(self, ref: str) -> PulledImage | None:
        found = self._backend.present.get(ref)
        return None if found is None else PulledImage(ref=ref, id=f"sha256:{ref}", size=found[0])

    def has(self, image: str) -> bool:
        return any(f"sha256:{ref}" == image for ref in self._backend.present)

    def layers(self, image_id: str) -> list[Layer]:
        ref = image_id.removeprefix("sha256:")
        found = self._backend.present.get(ref)
        return [] if found is None else [Layer(chain=f"sha256:layer-{ref}", size=found[0])]

    def chain_sizes(self) -> dict[str, int]:
        return {f"sha256:layer-{ref}": size for ref, (size, _) in dict(self._backend.present).items()}

    def price(self, ref: str) -> Priced:
        found = self._backend.registry.images.get(ref) if self._backend.registry else None
        if not isinstance(found, tuple):
            raise ManifestError(f"{ref}: not found in the registry", status=404)
        return Priced(id=f"sha256:{ref}", diff_ids=[f"sha256:layer-{ref}"], compressed=[found[0] // 2])

    def pull(
        self, ref: str, *, progress: Callable[[PullProgress], None] | None = None, cancel: threading.Event | None = None
    ) -> PulledImage:
        backend = self._backend
        found = backend.registry.images.get(ref, "image_not_found") if backend.registry else "image_not_found"
        if isinstance(found, str):
            raise ImageUnavailable(found, f"image {ref}: {found.replace('_', ' ')} (fake)")
        size, seconds = found
        with backend._lock:
            backend.events.append(("pulling", ref))
        if cancel is not None and cancel.wait(seconds):
            raise Interrupted(f"interrupted while pulling {ref}")
        with backend._lock:
            backend.pulls.append(ref)
            backend.events.append(("pull", ref))
            backend.present[ref] = (size, True)
            backend.peak = max(backend.peak, sum(size for size, pulled in backend.present.values() if pulled))
        return PulledImage(ref=ref, id=f"sha256:{ref}", size=size, pulled=True, downloaded=size // 2, seconds=seconds)

    def remove(self, ref: str, image_id: str) -> bool:
        backend = self._backend
        with backend._lock:
            if ref in backend.running_images:
                raise AssertionError(f"{ref} was removed while a sandbox used it")
            backend.present.pop(ref, None)
            backend.removals.append(ref)
            backend.events.append(("remove", ref))
        return True


class FakeBackend:
    """See the module docstring. ``unbuildable`` names images whose plan fails, as an unknown image would.

    With a ``registry``, task images named by reference must be pulled before an item can plan them: the
    fake keeps what its engine holds (``present``), every pull and removal in order, and the most bytes the
    pulled images ever took at once (``peak``)."""

    def __init__(
        self,
        script: dict[str, list[str]] | None = None,
        *,
        seconds: float = 0.0,
        unbuildable: frozenset[str] = frozenset(),
        registry: FakeRegistry | None = None,
        present: dict[str, int] | None = None,
    ) -> None:
        self.script = script or {}
        self.seconds = seconds
        self.unbuildable = unbuildable
        self.registry = registry
        self.present: dict[str, tuple[int, bool]] = {ref: (size, False) for ref, size in (present or {}).items()}
        """What the engine holds: ref → (bytes, pulled by a batch)."""
        self.pulls: list[str] = []
        self.removals: list[str] = []
        self.events: list[tuple[str, str]] = []
        """("pull" | "run" | "remove", ref) in the order they happened."""
        self.peak = 0
        self._ownership = Ownership.current()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.running = 0
        self.others = 0
        """Sandboxes another batch runs on the fake's engine."""
        self.most_running = 0
        self.finished = 0
        self.attempts: dict[str, list[str]] = {}
        """Trajectory stem → the outcome of each attempt run, in order."""
        self.cancels = 0
        self.images_made = 0
        self.gateways: list[FakeGateway] = []
        self.running_images: dict[str, int] = {}
        self._cache: ImageCache | None = None

    @property
    def ownership(self) -> Ownership:
        return self._ownership

    def plan_image(self, request: ImageRequest) -> ImagePlan:
        if request.image in self.unbuildable:
            raise UsageError(f"image {request.image} does not exist here and cannot be pulled (fake)")
        if self.registry is not None and request.image is not None and request.image not in self.present:
            raise AssertionError(f"{request.image} was planned before it was pulled")
        assert request.profile is not None
        if request.image is not None and request.inject:
            return InjectPlan(profile=request.profile, ref=request.image, id=f"sha256:{request.image}")
        return BuildPlan(profile=request.profile)

    def ensure_image(self, plan: ImagePlan, build: BuildOptions) -> ResolvedImage:
        with self._lock:
            self.images_made += 1
        agent = image_ref(plan.profile.agent)
        if isinstance(plan, InjectPlan):  # the task image, its runtime from the agent image
            injected = agent.model_copy(update={"ref": plan.ref, "id": plan.id, "agent_image": agent.ref})
            return ResolvedImage(profile=plan.profile, image=injected)
        return ResolvedImage(profile=plan.profile, image=agent)

    def preview_image(self, plan: ImagePlan) -> ImagePreview:
        return ImagePreview(image=image_ref(plan.profile.agent), exists=True)

    def running_sandboxes(self) -> int:
        return self.others

    def capacity(self) -> int | None:
        return None

    def image_cost(self, ref: str) -> ImageCost:
        if ref in self.present:
            return ImageCost(ref=ref, present=True, id=f"sha256:{ref}", size=self.present[ref][0])
        found = self.registry.images.get(ref) if self.registry else None
        if not isinstance(found, tuple):
            return ImageCost(ref=ref, present=False, error="not found (fake)")
        return ImageCost(ref=ref, present=False, id=f"sha256:{ref}", layers={"sha256:l1": found[0] // 2})

    # -- task images: the real image cache, over this fake engine (see FakeCacheEngine) -------------------------

    @property
    def cache(self) -> ImageCache:
        with self._lock:
            if self._cache is None:
                ledger = Ledger(Path(tempfile.mkdtemp(prefix="fake-cache-")) / "cache.json", self._ownership)
                self._cache = ImageCache(FakeCacheEngine(self), ledger, self._ownership)
            return self._cache

    def reserve_image(self, ref: str, *, budget: int | None, cancel: threading.Event | None = None) -> ImageHold:
        return self.cache.reserve(ref, budget=budget, cancel=cancel)

    def fill_image(
        self,
        hold: ImageHold,
        *,
        progress: Callable[[PullProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> PulledImage:
        return self.cache.fill(hold, progress=progress, cancel=cancel)

    def release_image(self, hold: ImageHold) -> None:
        self.cache.release(hold)
        with self._lock:
            self.events.append(("done", hold.ref))

    def finish_images(self, *, keep: bool = False) -> list[str]:
        if keep:
            kept = [("keep", entry.ref) for entry in self.cache.entries()]
            with self._lock:
                self.events += kept
        return self.cache.finish(keep=keep)

    def image_usage(self) -> ImageUsage | None:
        return self.cache.usage().model_copy(update={"peak": self.cache.peak(self._ownership.session)})

    def node_pulls(self) -> int | None:
        return None

    def push_image(self, ref: str, registry: str) -> str:
        raise NotImplementedError("the fake has no registry to push to")

    def image_budget(self, given: int | None = None) -> int | None:
        return given

    def runtime(self, name: str | None) -> Runtime:
        return Runtime(name=name or "runc")

    def describe_sandbox(self, prepared: PreparedReplay) -> SandboxPlan:
        return SandboxPlan(mounts=[], limits=limits(prepared), command=["fake"])

    def open_gateway(self, upstream: ModelUpstream, *, user: str) -> FakeGateway:
        gateway = FakeGateway()
        self.gateways.append(gateway)
        return gateway

    def run_forks(
        self, prepared: PreparedReplay, *, gateway: object | None = None, cancel: threading.Event | None = None
    ) -> list[ReplayRecord]:
        raise NotImplementedError("the fake backend does not fork")

    def run_attempt(
        self,
        prepared: PreparedReplay,
        attempt: Attempt,
        *,
        gateway: object | None = None,
        cancel: threading.Event | None = None,
    ) -> ReplayRecord:
        stem = prepared.spec.trajectory.stem
        task_image = prepared.spec.image
        with self._lock:
            if self.registry is not None and task_image is not None:
                assert task_image in self.present, f"{task_image} ran without being present"
                self.running_images[task_image] = self.running_images.get(task_image, 0) + 1
                self.events.append(("run", task_image))
            done = self.attempts.setdefault(stem, [])
            plan = self.script.get(stem, ["ok"])
            outcome = plan[min(len(done), len(plan) - 1)]
            done.append(outcome)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        started = datetime.now(UTC)
        try:
            limit = min(self.seconds, prepared.spec.timeout)
            stopped = self._stop.wait(limit) or (cancel is not None and cancel.is_set())
            if limit < self.seconds and not stopped:
                outcome = "timeout"
        finally:
            with self._lock:
                self.running -= 1
                self.finished += 1
                if task_image is not None and self.registry is not None:
                    self.events.append(("ran", task_image))
                if task_image is not None and task_image in self.running_images:
                    self.running_images[task_image] -= 1
                    if not self.running_images[task_image]:
                        del self.running_images[task_image]
        status = "interrupted" if stopped else _STATUS.get(outcome, outcome)
        failure = Failure(category=status, message=status) if status in ("interrupted", "timeout") else None
        record = ReplayRecord(
            pvisor_host_version="test",
            run_id=attempt.run_id,
            status=status,
            failure=failure or _FAILURES.get(outcome),
            started_at=started,
            finished_at=datetime.now(UTC),
            timings={"run": round(time.monotonic() % 1, 3), "total": 0.1},
            inputs=Inputs(
                agent=prepared.profile.agent,
                after_step=prepared.spec.after_step,
                mode=prepared.spec.mode,
                max_steps=None,
                boundary_user_prompt=None,
                disable_thinking=False,
                allow_stale_observations=False,
                session_id=None,
                workspace_dir=None,
                workspace_path=prepared.workspace_path,
                collect_workspace=True,
                env_names=[],
                trajectory=TrajectoryRef(
                    path=str(prepared.trajectory.path),
                    size=prepared.trajectory.size,
                    sha256=prepared.trajectory.sha256,
                    mounted_at="/in",
                ),
            ),
            image=prepared.image,
            limits=limits(prepared),
            container=ContainerInfo(name=f"fake-{attempt.run_id}", command=["fake"]),
            attempt=attempt.number,
        )
        attempt.run_dir.mkdir(parents=True, exist_ok=True)
        save_record(record, attempt.run_dir)
        if stopped:
            raise Interrupted("interrupted; record.json says status interrupted")
        return record

    def cancel(self) -> None:
        self.cancels += 1
        self._stop.set()

    def sweep(self, *, dry_run: bool = False, out: Path | None = None) -> GcReport:
        return GcReport(orphans=[], live=0, other_hosts=0)

    def catalog(self) -> list[CatalogEntry]:
        return []

    def prune(
        self, *, keep_bytes: int | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> PruneResult:
        return PruneResult()

    def agent_statuses(self) -> list[AgentStatus]:
        return []

    def diagnose(self) -> list[Check]:
        return []

    def close(self) -> None:
        return


def image_ref(agent: str) -> ImageRef:
    return ImageRef(
        ref=f"fake/{agent}:1",
        id=f"sha256:fake-{agent}",
        agent=agent,
        agent_version="1",
        pvisor_version="0.3.1",
        agent_entrypoint="/usr/bin/agent",
        pvisor_path="/opt/pvisor/bin/pvisor",
        verified_by="build",
    )


def limits(prepared: PreparedReplay) -> Limits:
    spec = prepared.spec
    return Limits(
        user=prepared.user,
        network=spec.network,
        read_only_rootfs=True,
        cap_drop=["ALL"],
        cap_add=[],
        no_new_privileges=True,
        memory=spec.memory,
        cpus=spec.cpus,
        pids=spec.pids,
        tmp_size=spec.tmp_size,
        timeout=spec.timeout,
        collect_limit=spec.collect_limit,
    )


def trajectories(root: Path, names: list[str]) -> list[Path]:
    """Real Claude Code trajectories named ``<name>.jsonl`` (the host checks read them); kept when present."""
    from trajgen import claude_files_session, write_jsonl

    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"{name}.jsonl" for name in names]
    return [path if path.exists() else write_jsonl(path, claude_files_session()) for path in paths]


if TYPE_CHECKING:  # mypy (make lint) checks that the fake fits the seam, as the real backends do

    def _fits(backend: FakeBackend) -> Backend[FakeGateway]:
        return backend
