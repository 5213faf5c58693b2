"""``batch --plan``: what every item would run, decided on the host. No container starts.

Each item gets the same pre-flight ``replay`` does (including pvisor's own ``--prepare-only`` on the
host), then the image it would use (the backend's preview), the mounts, limits and command of its sandbox
(the backend's description), its content key and whether a rerun would skip it. Images still to be built
are named by the tag ``build`` would give them; their content keys are known only once they exist.

A task image (``image``) the engine does not have is not pulled: its registry's manifest says what a pull
would download, and :class:`ImagesPlanned` adds up every distinct image, present or not, and the bytes
still to pull (each layer counted once across the batch's images). Its labels and platform are checked once
it is pulled, so such an item's sandbox is described without them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ..backend.base import AnyBackend
from ..errors import ExitCode, PvisorHostError
from ..files.digest import Tree, tree_digest
from ..models.batch import BatchSummary
from ..models.image import ImageCost, ImagePlan, ImagePreview, ImageRequest
from ..models.record import Limits
from ..models.spec import ReplaySpec
from ..preflight.prepare import assemble, check_before_image, check_fork, image_request
from ..preflight.trajectory import read_trajectory
from ..units import format_size
from .manifest import BatchItem
from .memo import Memo
from .options import BatchOptions
from .resume import ImageIdentity, check_item, finished_earlier


class ItemPlan(BaseModel):
    """One item of a batch plan."""

    id: str
    line: int
    after_step: int | None = None
    """The boundary it replays to."""
    action: Literal["run", "skip", "reject"]
    """``skip``: a complete record with the same content key exists; ``reject``: pre-flight refused it."""
    reason: str | None = None
    """Why it is skipped or rejected."""
    agent: str | None = None
    image: str | None = None
    image_id: str | None = None
    """None while the image is still to be built."""
    image_note: str | None = None
    """What happens to the image before the first run (a build, a probe)."""
    mounts: list[str] = []
    """``source:target:ro|rw`` (a volume by name)."""
    limits: Limits | None = None
    command: list[str] = []
    """The command in the sandbox (the run id's suffix is drawn anew at run time)."""
    model_gateway: str | None = None
    """How a live continuation reaches the host-side gateway (its socket or network is made per run)."""
    content_key: str | None = None
    earlier: str | None = None
    """For ``skip``: the status it finished with earlier (with ``fork: K``, the first of its forks' not ok)."""
    rows: list[str] | None = None
    """With ``fork: K``: its rows' ids (``<id>.f<k>``), whose statuses count as its own; for ``skip``, each fork's
    earlier status in ``earlier_rows``."""
    earlier_rows: list[str] | None = None
    exit_code: int | None = None
    """For ``reject``: the exit code the refusal maps to (2 for a bad item, 6 for an engine failure)."""
    image_present: bool | None = None
    """For a task image (``image``): whether the engine has it already."""
    pull_bytes: int | None = None
    """For a task image the engine does not have: what pulling it downloads (its registry's manifest)."""
    collect: str | None = None
    """What of the workspace it collects: ``full``, ``changes`` or ``none``."""
    write_bytes: int | None = None
    """About how many bytes its run directory will take: its record, logs and pvisor's output, plus the whole
    workspace with ``full`` (None: the workspace comes from an image, whose size is known once it is pulled)."""


class ImagesPlanned:
    """The distinct task images of a planned batch, as they are met (see the module docstring)."""

    def __init__(self) -> None:
        self.costs: dict[str, ImageCost] = {}

    @property
    def present(self) -> int:
        return sum(cost.present for cost in self.costs.values())

    @property
    def to_pull(self) -> list[ImageCost]:
        return [cost for cost in self.costs.values() if not cost.present]

    @property
    def pull_bytes(self) -> int:
        """Bytes still to download: each layer once, whatever the number of images that share it."""
        layers: dict[str, int] = {}
        for cost in self.to_pull:
            layers.update(cost.layers)
        return sum(layers.values())


class PlanTally:
    """What a plan's verdicts come to, counted as the run counts its results (so the plan exits as the run would
    for what the host can tell): a rejection as ``rejected`` (``infra_error`` for the host's), a skipped item with
    the status it finished with, and an item to run as ``ok`` (no more can be told before it runs)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.first_infra: ItemPlan | None = None
        self.started = datetime.now(UTC)

    def counting(self, plans: Iterable[ItemPlan]) -> Iterator[ItemPlan]:
        """``plans``, counted as they pass."""
        for plan in plans:
            rows = len(plan.rows or [plan.id])  # a forked item's rows count, as the run's do
            if plan.action == "reject" and plan.exit_code == ExitCode.INFRASTRUCTURE:
                self.counts["infra_error"] += rows
                self.first_infra = self.first_infra or plan
            elif plan.action == "reject":
                self.counts["rejected"] += rows
            elif plan.earlier_rows is not None:
                self.counts.update(plan.earlier_rows)
            else:
                self.counts[plan.earlier or "ok"] += rows
            yield plan

    def summary(self) -> BatchSummary:
        """The counts as a batch summary (:func:`~.summary.exit_code` reads it)."""
        return BatchSummary(
            started_at=self.started, finished_at=self.started, items=self.counts.total(), ran=0, skipped=0,
            counts=dict(self.counts), categories={}, timings={}, replays_per_minute=0.0, failed=[],
        )  # fmt: skip


def plan_batch(
    items: Iterable[BatchItem], backend: AnyBackend, options: BatchOptions, images: ImagesPlanned | None = None
) -> Iterator[ItemPlan]:
    """Plan every item, one at a time (see the module docstring); ``images`` collects the task images."""
    planner = _Planner(backend, options, images if images is not None else ImagesPlanned())
    for item in items:
        try:
            yield planner.plan(item)
        except PvisorHostError as exc:
            yield ItemPlan(
                id=item.id, line=item.line, after_step=item.spec.after_step, action="reject", reason=exc.one_line(),
                agent=item.spec.agent, image=item.spec.image, exit_code=exc.exit_code, rows=_rows(item),
            )  # fmt: skip


def _rows(item: BatchItem) -> list[str] | None:
    """A forked item's rows' ids (None: its own is its only row)."""
    return [keys.id for keys in item.rows] if item.spec.fork is not None else None


class _Planner:
    """The plan of one batch: an item's decisions are the run's (:mod:`.item`), in the run's order; what the run
    makes ready (an image built or pulled) is previewed instead."""

    def __init__(self, backend: AnyBackend, options: BatchOptions, images: ImagesPlanned) -> None:
        self.backend = backend
        self.options = options
        self.images = images
        self.previews: Memo[tuple[ImagePlan, ImagePreview]] = Memo()
        self.workspaces: Memo[Tree] = Memo()

    def plan(self, item: BatchItem) -> ItemPlan:
        spec = item.spec
        rows = _rows(item)
        request = image_request(spec)
        trajectory = read_trajectory(spec.trajectory)
        cost = self._cost(spec.image)
        workspace = self._workspace(spec.workspace_dir)
        write_bytes = _write_bytes(spec, workspace)
        identity = self._identity(request, cost)
        key, earlier = finished_earlier(
            item, trajectory, identity, workspace.sha256 if workspace is not None else None, out=self.options.out,
            rerun_failed=self.options.rerun_failed,
        )  # fmt: skip
        if earlier is not None:  # a record per row: a fork's that failed, say, is the item's status
            status = next((r.status for r in earlier if not r.ok), "ok")
            return ItemPlan(
                id=item.id, line=item.line, after_step=spec.after_step, action="skip", agent=earlier[0].inputs.agent,
                image=earlier[0].image.ref, reason=f"finished earlier: {status}", content_key=key, earlier=status,
                rows=rows, earlier_rows=[r.status for r in earlier] if rows else None,
            )  # fmt: skip
        checked = check_item(item, trajectory, self.options.out)
        check_fork(checked, self.backend)
        if cost is not None and not cost.present:
            return _unpulled(item, checked.spec, cost)
        plan, preview = self._preview(request)
        agent, runtime = check_before_image(checked, self.backend, plan.profile)
        sandbox = self.backend.describe_sandbox(assemble(checked, agent, preview.image, runtime))
        upstream = spec.continuation
        result = ItemPlan(
            id=item.id, line=item.line, after_step=spec.after_step, action="run", agent=plan.profile.agent,
            image=preview.image.ref if preview.exists else None, image_id=preview.image.id if preview.exists else None,
            image_note=preview.note, mounts=sandbox.mounts, limits=sandbox.limits, command=sandbox.command,
            model_gateway=upstream.network if upstream is not None else None, content_key=key,
            image_present=True if spec.image is not None else None, pull_bytes=0 if spec.image is not None else None,
        )  # fmt: skip
        result.collect, result.write_bytes, result.rows = spec.collect_mode, write_bytes, rows
        return result

    def _preview(self, request: ImageRequest) -> tuple[ImagePlan, ImagePreview]:
        """What the image of ``request`` is, previewed once per distinct image."""

        def look_up() -> tuple[ImagePlan, ImagePreview]:
            plan = self.backend.plan_image(request)
            return plan, self.backend.preview_image(plan)

        return self.previews.get(request.key, look_up)

    def _cost(self, ref: str | None) -> ImageCost | None:
        """A task image's cost (what pulling it downloads), asked once per image."""
        if ref is None:
            return None
        if ref not in self.images.costs:
            self.images.costs[ref] = self.backend.image_cost(ref)
        return self.images.costs[ref]

    def _workspace(self, source: Path | None) -> Tree | None:
        """The workspace directory's digest and size, read once per directory."""
        return self.workspaces.get(source, lambda: tree_digest(source)) if source is not None else None

    def _identity(self, request: ImageRequest, cost: ImageCost | None) -> ImageIdentity | None:
        """The image as a content key sees it, told without making it (as the run tells it: :mod:`.item`)."""
        if cost is not None and not cost.present:
            if cost.id is None:
                return None
            runtime = request.runtime_image  # the agent image an injected runtime comes from, by its tag
            try:
                return cost.id, self._preview(runtime)[1].image.ref if runtime is not None else None
            except PvisorHostError:  # as the run's (BatchContext.agent_tag): it meets it after its host checks
                return cost.id, None
        try:
            _, preview = self._preview(request)
        except PvisorHostError:  # the item meets it again after its host checks, as the run's does
            return None
        return (preview.image.id, preview.image.agent_image) if preview.exists else None


def _unpulled(item: BatchItem, spec: ReplaySpec, cost: ImageCost) -> ItemPlan:
    """An item whose task image is still in its registry: what pulling it costs, and what it is."""
    if cost.error is not None:  # no such image, refused, unreachable: the input; a registry in trouble: the host
        return ItemPlan(
            id=item.id, line=item.line, after_step=spec.after_step, action="reject", reason=cost.error,
            agent=spec.agent, exit_code=ExitCode.USAGE if cost.unavailable else ExitCode.INFRASTRUCTURE,
            image=cost.ref, image_present=False, rows=_rows(item),
        )  # fmt: skip
    note = f"to be pulled: {format_size(cost.pull_bytes)} from its registry"
    note += f" ({cost.digest})" if cost.digest else ""
    return ItemPlan(
        id=item.id, line=item.line, after_step=spec.after_step, action="run", agent=spec.agent, image=cost.ref,
        image_id=cost.id, image_note=note + "; its labels and platform are checked once it is here",
        image_present=False, pull_bytes=cost.pull_bytes, rows=_rows(item),
    )  # fmt: skip


#: What a replay writes beside its workspace, about: its record, logs, and pvisor's output and state trees.
RUN_BYTES = 256 * 1024


def _write_bytes(spec: ReplaySpec, workspace: Tree | None) -> int | None:
    """About how many bytes an item's run directory takes (see :attr:`ItemPlan.write_bytes`): a changed
    workspace is not known before the replay, so ``changes`` counts as its record's share only; with ``fork: K``,
    the prefix's run directory and each fork's (the checkpoint and the copies are gone once it ends)."""
    runs = 1 + (spec.fork or 0)
    if spec.collect_mode != "full":
        return RUN_BYTES * runs
    if workspace is not None:
        return (RUN_BYTES + workspace.bytes) * runs
    return None if spec.image_workspace else RUN_BYTES * runs
