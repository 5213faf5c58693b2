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

from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import BaseModel

from ..backend.base import AnyBackend
from ..errors import ExitCode, PvisorHostError
from ..files.digest import tree_sha256
from ..files.space import tree_bytes
from ..models.image import ImageCost, ImagePlan, ImagePreview
from ..models.record import Limits
from ..models.spec import ReplaySpec
from ..preflight.checks import agent_checks, check_inputs, runtime_checks
from ..preflight.prepare import assemble
from ..units import format_size
from .manifest import BatchItem
from .memo import Memo
from .resume import content_key, finished_result, item_run_id
from .scheduler import BatchOptions, image_key, image_request


class ItemPlan(BaseModel):
    """One item of a batch plan."""

    id: str
    line: int
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


def plan_batch(
    items: Iterable[BatchItem], backend: AnyBackend, options: BatchOptions, images: ImagesPlanned | None = None
) -> Iterator[ItemPlan]:
    """Plan every item, one at a time (see the module docstring); ``images`` collects the task images."""
    previews: Memo[tuple[ImagePlan, ImagePreview]] = Memo()
    workspaces: Memo[str] = Memo()
    sizes: Memo[int] = Memo()
    images = images if images is not None else ImagesPlanned()
    for item in items:
        try:
            if item.spec.image is not None:
                if item.spec.image not in images.costs:
                    images.costs[item.spec.image] = backend.image_cost(item.spec.image)
                cost = images.costs[item.spec.image]
                if not cost.present:
                    yield _plan_unpulled(item, cost, options)
                    continue
            yield _plan_item(item, backend, options, previews, workspaces, sizes)
        except PvisorHostError as exc:
            yield ItemPlan(
                id=item.id,
                line=item.line,
                action="reject",
                reason=exc.one_line(),
                agent=item.spec.agent,
                exit_code=exc.exit_code,
            )


def _plan_unpulled(item: BatchItem, cost: ImageCost, options: BatchOptions) -> ItemPlan:
    """An item whose task image is still in its registry: what pulling it costs, and what it is."""
    check_inputs(item.spec, per_file=True, run_id=item_run_id(item.id), out_dir=options.out / item.id)
    if cost.error is not None:  # no such image, refused: the input; a registry that could not be asked: the host
        wrong = "not found" in cost.error or "refused" in cost.error
        return ItemPlan(
            id=item.id, line=item.line, action="reject", reason=f"image {cost.ref}: {cost.error}",
            agent=item.spec.agent, exit_code=ExitCode.USAGE if wrong else ExitCode.INFRASTRUCTURE, image=cost.ref,
            image_present=False,
        )  # fmt: skip
    note = f"to be pulled: {format_size(cost.pull_bytes)} from its registry"
    note += f" ({cost.digest})" if cost.digest else ""
    return ItemPlan(
        id=item.id, line=item.line, action="run", agent=item.spec.agent, image=cost.ref, image_id=cost.id,
        image_note=note + "; its labels and platform are checked once it is here", image_present=False,
        pull_bytes=cost.pull_bytes,
    )  # fmt: skip


def _plan_item(
    item: BatchItem,
    backend: AnyBackend,
    options: BatchOptions,
    previews: Memo[tuple[ImagePlan, ImagePreview]],
    workspaces: Memo[str],
    sizes: Memo[int],
) -> ItemPlan:
    spec = item.spec
    run_dir = options.out / item.id
    checked = check_inputs(spec, per_file=True, run_id=item_run_id(item.id), out_dir=run_dir)

    def look_up() -> tuple[ImagePlan, ImagePreview]:
        plan = backend.plan_image(image_request(spec))
        return plan, backend.preview_image(plan)

    plan, preview = previews.get(image_key(spec), look_up)
    agent = agent_checks(checked, plan.profile)
    key = None
    if preview.exists:
        source = spec.workspace_dir
        workspace = workspaces.get(source, lambda: tree_sha256(source)) if source is not None else None
        key = content_key(spec, checked.trajectory.sha256, preview.image, workspace)
    runtime = backend.runtime(spec.runtime)
    runtime_checks(spec, runtime)
    sandbox = backend.describe_sandbox(assemble(checked, agent, preview.image, runtime))
    upstream = spec.continuation
    result = ItemPlan(
        id=item.id,
        line=item.line,
        action="run",
        agent=plan.profile.agent,
        image=preview.image.ref if preview.exists else None,
        image_id=preview.image.id if preview.exists else None,
        image_note=preview.note,
        mounts=sandbox.mounts,
        limits=sandbox.limits,
        command=sandbox.command,
        model_gateway=upstream.network if upstream is not None else None,
        content_key=key,
        image_present=True if spec.image is not None else None,
        pull_bytes=0 if spec.image is not None else None,
    )
    result.collect, result.write_bytes = spec.collect_mode, _write_bytes(spec, sizes)
    earlier = finished_result(run_dir, key, options.rerun_failed) if key is not None else None
    if earlier is not None:
        result = result.model_copy(update={"action": "skip", "reason": f"finished earlier: {earlier.status}"})
    return result


#: What a replay writes beside its workspace, about: its record, logs, and pvisor's output and state trees.
RUN_BYTES = 256 * 1024


def _write_bytes(spec: ReplaySpec, sizes: Memo[int]) -> int | None:
    """About how many bytes an item's run directory takes (see :attr:`ItemPlan.write_bytes`): a changed
    workspace is not known before the replay, so ``changes`` counts as its record's share only."""
    if spec.collect_mode != "full":
        return RUN_BYTES
    if spec.workspace_dir is not None:
        source = spec.workspace_dir
        return RUN_BYTES + sizes.get(source, lambda: tree_bytes(source))
    return None if spec.image_workspace else RUN_BYTES
