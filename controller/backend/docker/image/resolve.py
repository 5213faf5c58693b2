"""Which image a replay runs in, and what it carries — decided on the host where it can be.

Images built by ``pvisor-host build`` carry labels recording the pvisor and agent versions verified in
them, so their fitness is checked without a container. For an image without our labels, a probe
container looks inside (after every host-side check has passed). ``--agent`` alone means the image
``build`` makes, built when missing. The decision is an :data:`~pvisor_host.models.image.ImagePlan`.
"""

from __future__ import annotations

from typing import Literal

import docker
from docker.models.images import Image

from ...._log import logger
from ...._version import PVISOR_VERSION
from ....errors import UsageError
from ....models.image import (
    BuildOptions,
    BuildPlan,
    ImagePlan,
    ImagePreview,
    ImageRef,
    ImageRequest,
    InjectPlan,
    LabelledPlan,
    ProbePlan,
    ResolvedImage,
)
from ....models.ownership import Ownership
from ....models.profiles import AgentProfile, get_profile
from .. import labels as L
from ..engine import ENGINE_ERRORS, describe, engine_errors
from .base import find_image, pull
from .images import repo_digest
from .inject import Injector, RuntimeVolume, check_task_image_metadata, inject_spec, runtime_volume_name
from .probe import probe_agent_image, version_problem
from .recipe import DEFAULT_PVISOR_PATH, build_agent_image, build_pvisor_image, expected_tag
from .users import ImageUsers

Verification = Literal["build", "labels", "probe", "inject"]


def plan_image(client: docker.DockerClient, request: ImageRequest) -> ImagePlan:
    """Inspect the requested image (no container): which agent, and whether its labels vouch for it.

    Raises:
        UsageError: unknown image, an image of another agent or version, an unlabelled image without
            ``--agent``, or a task image ``--inject`` cannot use (not linux/amd64, an agent without
            an inject profile).
    """
    profile = request.profile
    if request.image is None:
        if profile is None:
            raise UsageError("pass --agent, --image, or both")
        return BuildPlan(profile=profile, pvisor_only=request.pvisor_only)
    image = request.image
    found = _local_or_pulled(client, image)
    labels = dict(found.labels or {})
    digest = repo_digest(image, found.attrs.get("RepoDigests") or [])
    user = str((found.attrs.get("Config") or {}).get("User") or "")
    env = config_env(found)
    if request.inject:
        if profile is None:
            raise UsageError("--inject needs both --image (the task image) and --agent (the runtime to inject)")
        inject_spec(profile)
        check_task_image_metadata(found, image)
        return InjectPlan(profile=profile, ref=image, id=found.id, labels=labels, digest=digest, user=user, env=env)
    labelled_agent = labels.get(L.AGENT) or None
    if labelled_agent is None:
        if profile is None:
            raise UsageError(
                f"image {image} was not built by pvisor-host (no {L.AGENT} label)",
                hint="pass --agent to say which agent it holds",
            )
        return ProbePlan(profile=profile, ref=image, id=found.id, labels=labels, digest=digest, user=user, env=env)
    if profile is not None and profile.agent != labelled_agent:
        raise UsageError(
            f"image {image} holds {labelled_agent} {labels.get(L.AGENT_VERSION, '?')}, not {profile.agent}",
            hint=f"drop --image to use the {profile.agent} image, or drop --agent",
        )
    profile = profile or get_profile(labelled_agent)
    _check_labels(image, labels, profile)
    return LabelledPlan(profile=profile, ref=image, id=found.id, labels=labels, digest=digest, env=env)


def config_env(image: Image) -> dict[str, str]:
    """The environment an image's configuration sets (``Config.Env``: ``NAME=value`` entries)."""
    entries = (image.attrs.get("Config") or {}).get("Env") or []
    return dict(entry.split("=", 1) for entry in entries if isinstance(entry, str) and "=" in entry)


def _local_or_pulled(client: docker.DockerClient, image: str) -> Image:
    found = find_image(client, image)
    if found is not None:
        return found
    try:
        logger.debug("image {} is not present; trying to pull it", image)
        return pull(client, image)
    except ENGINE_ERRORS as exc:
        raise UsageError(
            f"image {image} does not exist here and cannot be pulled ({describe(exc)[:160]})",
            hint="build one with `pvisor-host build --agent AGENT` or pass --agent without --image",
        ) from exc


def _check_labels(image: str, labels: dict[str, str], profile: AgentProfile) -> None:
    version = labels.get(L.AGENT_VERSION)
    if version != profile.version:
        raise UsageError(
            f"image {image} has {profile.agent} {version}; pvisor {PVISOR_VERSION} replays only {profile.version}",
            hint=f"pvisor-host build --agent {profile.agent}",
        )
    pvisor = labels.get(L.PVISOR_VERSION)
    if pvisor != PVISOR_VERSION:
        raise UsageError(
            f"image {image} has pvisor {pvisor}; pvisor-host drives pvisor {PVISOR_VERSION}",
            hint=f"pvisor-host build --agent {profile.agent}",
        )


def materialize(
    client: docker.DockerClient,
    ownership: Ownership,
    injector: Injector,
    users: ImageUsers,
    plan: ImagePlan,
    build: BuildOptions,
) -> ResolvedImage:
    """Make the planned image real: build it, probe it, fill its runtime volume, or take its labels. A task
    image's own user is resolved to numbers (:mod:`.users`).

    Raises:
        UsageError: an unlabelled image lacks pvisor or has another agent version, or a task image names a user
            it does not have.
        ImageBuildError: a build failed or produced the wrong versions.
    """
    profile = plan.profile
    if isinstance(plan, BuildPlan):
        built = (
            build_pvisor_image(client, ownership, profile.suite, build)
            if plan.pvisor_only
            else build_agent_image(client, ownership, profile, build)
        )
        with engine_errors(f"inspect image {built.tag}"):
            env = config_env(client.images.get(built.id))
        image = _ref(built.tag, built.id, profile, "build").model_copy(update={"env": env})
        return ResolvedImage(profile=profile, image=image, built=built)
    if isinstance(plan, InjectPlan):
        injector.check_task_image(plan.id, plan.ref, profile)
        built = build_agent_image(client, ownership, profile, build)
        volume = injector.ensure_runtime_volume(profile, built.id)
        update: dict[str, object] = {"user": users.resolve(plan.id, plan.user), "env": plan.env}
        return ResolvedImage(profile=profile, image=_injected(plan, volume, built.tag).model_copy(update=update),
                             built=built)  # fmt: skip
    if isinstance(plan, LabelledPlan):
        entrypoint = plan.labels.get(L.AGENT_ENTRYPOINT, profile.entrypoint)
        image = _ref(plan.ref, plan.id, profile, "labels", entrypoint, plan.labels.get(L.PVISOR_PATH))
        return ResolvedImage(profile=profile, image=image.model_copy(update={"digest": plan.digest, "env": plan.env}))
    found = probe_agent_image(client, ownership, plan.id, profile)
    problem = version_problem(found, profile)
    if problem is not None:
        raise UsageError(f"image {plan.ref} {problem}", hint=f"pvisor-host build --agent {profile.agent}")
    image = _ref(plan.ref, plan.id, profile, "probe", found.agent_path, found.pvisor_path)
    user = users.resolve(plan.id, plan.user)
    fields: dict[str, object] = {"digest": plan.digest, "user": user, "env": plan.env}
    return ResolvedImage(profile=profile, image=image.model_copy(update=fields))


def preview(client: docker.DockerClient, users: ImageUsers, plan: ImagePlan) -> ImagePreview:
    """What :func:`materialize` would give, found without building, probing or filling anything (a task image's
    user is read from its ``/etc/passwd`` when its configuration names one)."""
    profile = plan.profile
    if isinstance(plan, LabelledPlan):
        entrypoint = plan.labels.get(L.AGENT_ENTRYPOINT, profile.entrypoint)
        image = _ref(plan.ref, plan.id, profile, "labels", entrypoint, plan.labels.get(L.PVISOR_PATH))
        return ImagePreview(image=image, exists=True)
    if isinstance(plan, ProbePlan):
        note = "a probe container confirms the versions before the first run"
        image = _ref(plan.ref, plan.id, profile, "probe").model_copy(update={"user": users.resolve(plan.id, plan.user)})
        return ImagePreview(image=image, exists=True, note=note)
    tag = expected_tag(client, None if isinstance(plan, BuildPlan) and plan.pvisor_only else profile, profile.suite)
    agent_image = find_image(client, tag) if tag is not None else None
    if agent_image is None:
        stand_in = _ref("(to be built)", "(to be built)", profile, "build")
        if isinstance(plan, InjectPlan):  # the task image is here: it runs as a task image does
            stand_in = _ref(plan.ref, plan.id, profile, "inject")
            stand_in = stand_in.model_copy(update={"user": users.resolve(plan.id, plan.user)})
        note = f"to be built first: {tag or f'a {profile.suite} base, then the {profile.agent} image'}"
        return ImagePreview(image=stand_in, exists=False, note=note)
    assert tag is not None
    if isinstance(plan, BuildPlan):
        return ImagePreview(image=_ref(tag, agent_image.id, profile, "build"), exists=True)
    note = "a probe of the task image (libc, architecture) comes before the first run"
    image = injected_image(plan, agent_image.id, tag).model_copy(update={"user": users.resolve(plan.id, plan.user)})
    return ImagePreview(image=image, exists=True, note=note)


def injected_image(plan: InjectPlan, agent_image_id: str, agent_tag: str) -> ImageRef:
    """The task image of ``plan`` with the runtime volume filled from ``agent_image_id`` (its name is the same
    wherever it is filled: a cluster's nodes fill their own)."""
    profile = plan.profile
    volume = RuntimeVolume(
        name=runtime_volume_name(profile, inject_spec(profile), agent_image_id),
        agent=profile.agent,
        agent_version=profile.version,
        pvisor_version=PVISOR_VERSION,
        agent_image=agent_image_id,
    )
    return _injected(plan, volume, agent_tag)


def _injected(plan: InjectPlan, volume: RuntimeVolume, agent_tag: str) -> ImageRef:
    spec = inject_spec(plan.profile)
    entrypoint = f"{volume.runtime_root}/{spec.entrypoint}"
    ref = _ref(plan.ref, plan.id, plan.profile, "inject", entrypoint, volume.pvisor_path)
    update = {"runtime_volume": volume.name, "agent_image": agent_tag, "digest": plan.digest, "user": plan.user}
    return ref.model_copy(update=update)


def _ref(
    ref: str,
    image_id: str,
    profile: AgentProfile,
    verified_by: Verification,
    entrypoint: str | None = None,
    pvisor_path: str | None = None,
) -> ImageRef:
    return ImageRef(
        ref=ref,
        id=image_id,
        agent=profile.agent,
        agent_version=profile.version,
        pvisor_version=PVISOR_VERSION,
        agent_entrypoint=entrypoint or profile.entrypoint,
        pvisor_path=pvisor_path or DEFAULT_PVISOR_PATH,
        verified_by=verified_by,
    )
