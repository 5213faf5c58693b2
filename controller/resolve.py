"""Which image a replay runs in, and what it carries — decided on the host where it can be.

Images built by ``pvisor-host build`` carry labels recording the pvisor and agent versions verified in
them, so their fitness is checked without a container. For an image without our labels, a probe
container looks inside (after every host-side check has passed). ``--agent`` alone means the image
``build`` makes, built when missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import docker
import requests
from docker.errors import APIError
from docker.models.images import Image
from loguru import logger
from pydantic import BaseModel

from . import labels as L
from ._version import PVISOR_VERSION
from .build import DEFAULT_PVISOR_PATH, BuiltImage, build_agent_image, expected_tag, find_image
from .errors import UsageError
from .inject import (
    RuntimeVolume,
    check_task_image,
    check_task_image_metadata,
    ensure_runtime_volume,
    inject_spec,
    runtime_volume_name,
)
from .probe import probe_agent_image, version_problem
from .profiles import AgentProfile, get_profile
from .record import ImageRef


class ImagePlan(BaseModel):
    """The image decision before anything runs: use as labelled, probe it, or build it."""

    action: Literal["labels", "probe", "build", "inject"]
    agent: str
    ref: str | None = None
    id: str | None = None
    labels: dict[str, str] = {}


def plan_image(client: docker.DockerClient, *, image: str | None, agent: str | None, inject: bool = False) -> ImagePlan:
    """Inspect ``image`` (no container): which agent, and whether its labels already vouch for it.

    Raises:
        UsageError: unknown image, an image of another agent or version, an unlabelled image without
            ``--agent``, or a task image ``--inject`` cannot use (not linux/amd64, an agent without
            an inject profile).
    """
    if image is None:
        assert agent is not None
        get_profile(agent)
        return ImagePlan(action="build", agent=agent)
    found = _local_or_pulled(client, image)
    if inject:
        assert agent is not None
        profile = get_profile(agent)
        inject_spec(profile)
        check_task_image_metadata(found, image)
        return ImagePlan(action="inject", agent=agent, ref=image, id=found.id, labels=dict(found.labels or {}))
    labels = dict(found.labels or {})
    labelled_agent = labels.get(L.AGENT) or None
    if labelled_agent is None:
        if agent is None:
            raise UsageError(
                f"image {image} was not built by pvisor-host (no {L.AGENT} label)",
                hint="pass --agent to say which agent it holds",
            )
        get_profile(agent)
        return ImagePlan(action="probe", agent=agent, ref=image, id=found.id, labels=labels)
    if agent is not None and agent != labelled_agent:
        raise UsageError(
            f"image {image} holds {labelled_agent} {labels.get(L.AGENT_VERSION, '?')}, not {agent}",
            hint=f"drop --image to use the {agent} image, or drop --agent",
        )
    profile = get_profile(labelled_agent)
    _check_labels(image, labels, profile)
    return ImagePlan(action="labels", agent=labelled_agent, ref=image, id=found.id, labels=labels)


def _local_or_pulled(client: docker.DockerClient, image: str) -> Image:
    found = find_image(client, image)
    if found is not None:
        return found
    try:
        logger.debug("image {} is not present; trying to pull it", image)
        return client.images.pull(image)
    except (APIError, requests.exceptions.RequestException) as exc:
        detail = str(getattr(exc, "explanation", None) or exc).split("\n")[0][:160]
        raise UsageError(
            f"image {image} does not exist here and cannot be pulled ({detail})",
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
    plan: ImagePlan,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
) -> tuple[ImageRef, BuiltImage | None]:
    """Make the planned image real: build it, probe it, or take its labels.

    Raises:
        UsageError: an unlabelled image lacks pvisor or has another agent version.
        ImageBuildError: a build failed or produced the wrong versions.
    """
    profile = get_profile(plan.agent)
    if plan.action == "build":
        built = build_agent_image(client, profile, base=base, ca_bundle=ca_bundle)
        return _ref(built.tag, built.id, profile, "build"), built
    assert plan.ref is not None
    assert plan.id is not None
    if plan.action == "inject":
        return _inject(client, plan, profile, base=base, ca_bundle=ca_bundle)
    if plan.action == "labels":
        entrypoint = plan.labels.get(L.AGENT_ENTRYPOINT, profile.entrypoint)
        return _ref(plan.ref, plan.id, profile, "labels", entrypoint, plan.labels.get(L.PVISOR_PATH)), None
    found = probe_agent_image(client, plan.id, profile)
    problem = version_problem(found, profile)
    if problem is not None:
        raise UsageError(f"image {plan.ref} {problem}", hint=f"pvisor-host build --agent {profile.agent}")
    return _ref(plan.ref, plan.id, profile, "probe", found.agent_path, found.pvisor_path), None


def preview(client: docker.DockerClient, plan: ImagePlan) -> tuple[ImageRef | None, str | None]:
    """What :func:`materialize` would give, found without building, probing or filling anything.

    Returns the image (None while it is still to be built) and a note on what the first run will do first.
    """
    profile = get_profile(plan.agent)
    if plan.action == "labels":
        return materialize(client, plan)[0], None
    if plan.action == "probe":
        assert plan.ref is not None
        assert plan.id is not None
        return _ref(plan.ref, plan.id, profile, "probe"), "a probe container confirms the versions before the first run"
    tag = expected_tag(client, profile)
    agent_image = find_image(client, tag) if tag is not None else None
    if agent_image is None:
        return None, f"to be built first: {tag or f'a {profile.suite} base, then the {profile.agent} image'}"
    if plan.action == "build":
        assert tag is not None
        return _ref(tag, agent_image.id, profile, "build"), None
    assert plan.ref is not None
    assert plan.id is not None
    spec = inject_spec(profile)
    volume = RuntimeVolume(
        name=runtime_volume_name(profile, spec, agent_image.id),
        agent=profile.agent,
        agent_version=profile.version,
        pvisor_version=PVISOR_VERSION,
        agent_image=agent_image.id,
    )
    ref = _ref(plan.ref, plan.id, profile, "inject", f"{volume.runtime_root}/{spec.entrypoint}", volume.pvisor_path)
    note = "a probe of the task image (libc, architecture) comes before the first run"
    return ref.model_copy(update={"runtime_volume": volume.name, "agent_image": tag}), note


def _inject(
    client: docker.DockerClient, plan: ImagePlan, profile: AgentProfile, *, base: str | None, ca_bundle: Path | None
) -> tuple[ImageRef, BuiltImage | None]:
    assert plan.ref is not None
    assert plan.id is not None
    check_task_image(client, plan.id, plan.ref, profile)
    built = build_agent_image(client, profile, base=base, ca_bundle=ca_bundle)
    volume = ensure_runtime_volume(client, profile, built.id)
    spec = inject_spec(profile)
    ref = _ref(plan.ref, plan.id, profile, "inject", f"{volume.runtime_root}/{spec.entrypoint}", volume.pvisor_path)
    return ref.model_copy(update={"runtime_volume": volume.name, "agent_image": built.tag}), built


def _ref(
    ref: str,
    image_id: str,
    profile: AgentProfile,
    verified_by: Literal["build", "labels", "probe", "inject"],
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
