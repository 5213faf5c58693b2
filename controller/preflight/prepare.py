"""The end of pre-flight: the image, asked of the backend once the host checks have passed.

``--agent`` alone is known before the engine is asked; with ``--image`` alone the agent comes from the
image's label, and its checks (pvisor's own pre-flight included) run before anything is built or probed.
Only then is the run directory created and the image made ready.
"""

from __future__ import annotations

import time

from ..backend.base import AnyBackend
from ..models.image import BuildOptions, ImagePlan, ImageRef, ImageRequest, ResolvedImage
from ..models.profiles import AgentProfile, get_profile
from ..models.replay import PreparedReplay, Runtime
from ..models.spec import ReplaySpec
from .checks import (
    AgentChecks,
    CheckedInputs,
    create_out_dir,
    release_out_dir,
    runtime_checks,
    sandbox_profile,
    sandbox_user,
    with_agent,
)


def image_request(spec: ReplaySpec) -> ImageRequest:
    """The image a replay asks for (its agent's profile resolved, when it names one): the one place that says it."""
    profile = get_profile(spec.agent) if spec.agent is not None else None
    return ImageRequest(image=spec.image, profile=profile, inject=spec.inject, pvisor_only=spec.mode == "prepare-only")


def prepare_image(backend: AnyBackend, request: ImageRequest, build: BuildOptions) -> ResolvedImage:
    """Plan and make ready the image of ``request`` (a batch does this once per distinct image)."""
    return backend.ensure_image(backend.plan_image(request), build)


def prepare(
    checked: CheckedInputs,
    backend: AnyBackend,
    *,
    build: BuildOptions | None = None,
    image: ResolvedImage | None = None,
) -> PreparedReplay:
    """Finish pre-flight with the backend (see the module docstring) and make the image ready.

    ``image`` is an image already made ready (a batch does that once for every item that shares it).

    Raises:
        UsageError: the request is wrong (one line says what and how to fix it).
        PrerequisiteError: the host's pvisor is missing.
        ImageBuildError: the image had to be built and the build failed.
    """
    started = time.monotonic()
    source: ImagePlan | ResolvedImage = image if image is not None else backend.plan_image(image_request(checked.spec))
    agent, runtime = check_before_image(checked, backend, source.profile)
    create_out_dir(checked.out_dir)
    checked_at = time.monotonic()
    try:
        if isinstance(source, ResolvedImage):
            resolved = source
        else:
            resolved = backend.ensure_image(source, build or BuildOptions())
        timings = {
            "preflight": round(checked.seconds + checked_at - started, 4),
            "image": round(time.monotonic() - checked_at, 4),
        }
        prepared = assemble(checked, agent, resolved.image, runtime, built=resolved, timings=timings)
        backend.describe_sandbox(prepared)  # what the sandbox cannot be (a workspace the image lacks), as the plan
        return prepared
    except BaseException:
        release_out_dir(checked.out_dir)
        raise


def check_before_image(
    checked: CheckedInputs, backend: AnyBackend, profile: AgentProfile
) -> tuple[AgentChecks, Runtime]:
    """The checks that need the image's agent (``profile``: from ``--agent``, the trajectory, or the image's label)
    but not the image itself: the agent's own, and the runtime's; before anything is built or pulled, for the
    run and ``batch --plan`` alike."""
    agent = with_agent(checked, profile)
    runtime = backend.runtime(checked.spec.runtime)
    runtime_checks(checked.spec, runtime)
    return agent, runtime


def assemble(
    checked: CheckedInputs,
    agent: AgentChecks,
    image: ImageRef,
    runtime: Runtime,
    *,
    built: ResolvedImage | None = None,
    timings: dict[str, float] | None = None,
) -> PreparedReplay:
    """The prepared replay of checked inputs in ``image`` (``batch --plan`` assembles one from a preview)."""
    profile = sandbox_profile(checked.spec, image)
    return PreparedReplay(
        spec=checked.spec,
        profile=agent.profile,
        trajectory=checked.trajectory,
        run_id=checked.run_id,
        out_dir=checked.out_dir,
        name=checked.out_dir.name,
        workspace_path=agent.workspace_path,
        user=sandbox_user(checked, image, profile),
        sandbox=profile,
        image=image,
        built=built.built if built is not None else None,
        runtime=runtime,
        plan=agent.plan,
        timings=timings or {},
    )
