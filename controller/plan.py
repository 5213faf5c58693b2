"""``batch --plan``: what every item would run, decided on the host. No container starts.

Each item gets the same pre-flight ``replay`` does (including pvisor's own ``--prepare-only`` on the
host), then the image it would use, the mounts, limits and command of its sandbox, its content key and
whether a rerun would skip it. Images still to be built are named by the tag ``build`` would give them;
their content keys are known only once they exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import docker
from pydantic import BaseModel

from ._version import PVISOR_VERSION
from .batch import BatchOptions, Memo, content_key, finished_result, image_key, item_run_id, tree_sha256
from .build import DEFAULT_PVISOR_PATH
from .container import BindMount
from .errors import PvisorHostError
from .launch import Attempt, container_spec, limits
from .manifest import BatchItem
from .preflight import PreparedReplay, agent_checks, check_inputs, staging_root
from .record import ImageRef, Limits
from .resolve import plan_image, preview
from .stage import planned_staging


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


class _Image(BaseModel):
    agent: str
    ref: ImageRef | None
    note: str | None


def plan_batch(items: Iterable[BatchItem], client: docker.DockerClient, options: BatchOptions) -> Iterator[ItemPlan]:
    """Plan every item, one at a time (see the module docstring)."""
    images: Memo[_Image] = Memo()
    workspaces: Memo[str] = Memo()
    for item in items:
        try:
            yield _plan_item(item, client, options, images, workspaces)
        except PvisorHostError as exc:
            yield ItemPlan(id=item.id, line=item.line, action="reject", reason=exc.one_line(), agent=item.spec.agent)


def _image(client: docker.DockerClient, item: BatchItem) -> _Image:
    """The item's image as :func:`~pvisor_host.resolve.preview` finds it."""
    plan = plan_image(client, image=item.spec.image, agent=item.spec.agent, inject=item.spec.inject)
    ref, note = preview(client, plan)
    return _Image(agent=plan.agent, ref=ref, note=note)


def _plan_item(
    item: BatchItem,
    client: docker.DockerClient,
    options: BatchOptions,
    images: Memo[_Image],
    workspaces: Memo[str],
) -> ItemPlan:
    spec = item.spec
    run_dir = options.out / item.id
    checked = check_inputs(spec, run_id=item_run_id(item.id), out_dir=run_dir)
    found = images.get(image_key(spec), lambda: _image(client, item))
    image = found.ref
    checks = agent_checks(checked, found.agent)
    key = None
    if image is not None:
        workspace = None
        source = spec.workspace_dir
        if source is not None:
            workspace = workspaces.get(source, lambda: tree_sha256(source))
        key = content_key(spec, checked.trajectory.sha256, image, workspace)
    plan = ItemPlan(
        id=item.id,
        line=item.line,
        action="run",
        agent=found.agent,
        image=image.ref if image is not None else None,
        image_id=image.id if image is not None else None,
        image_note=found.note,
        model_gateway=spec.model_network if spec.uses_gateway else None,
        content_key=key,
    )
    earlier = finished_result(run_dir, key, options.rerun_failed) if key is not None else None
    if earlier is not None:
        plan = plan.model_copy(update={"action": "skip", "reason": f"finished earlier: {earlier.status}"})
    stand_in = image or ImageRef(
        ref="(to be built)",
        id="(to be built)",
        agent=checks.profile.agent,
        agent_version=checks.profile.version,
        pvisor_version=PVISOR_VERSION,
        agent_entrypoint=checks.profile.entrypoint,
        pvisor_path=DEFAULT_PVISOR_PATH,
        verified_by="build",
    )
    prepared = PreparedReplay(
        spec=spec,
        profile=checks.profile,
        trajectory=checked.trajectory,
        run_id=checked.run_id,
        out_dir=run_dir,
        workspace_path=checks.workspace_path,
        user=checked.user,
        image=stand_in,
        plan=checks.plan,
        timings={},
    )
    attempt = Attempt(run_id=checked.run_id, run_dir=run_dir)
    cspec = container_spec(prepared, attempt, planned_staging(staging_root(run_dir), checked.trajectory.path))
    mounts = [
        f"{m.source if isinstance(m, BindMount) else m.volume}:{m.target}:{'ro' if m.read_only else 'rw'}"
        for m in cspec.mounts
    ]
    return plan.model_copy(update={"mounts": mounts, "limits": limits(prepared, cspec), "command": cspec.command})
