"""The end of pre-flight: the checks that need the engine, and the image, asked of the backend once the host
checks have passed.

``--agent`` alone is known before the engine is asked; with ``--image`` alone the agent comes from the
image's label, and its checks (pvisor's own pre-flight included) run before anything is built or probed, as do
the runtime's (:func:`check_before_image`). Only then is the image made ready; the sandbox's profile and user
follow from the image (:func:`assemble`), and the run directory is created last.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..backend.base import AnyBackend
from ..errors import UsageError
from ..files.trees import remove_if_empty
from ..models.image import BuildOptions, ImagePlan, ImageRef, ImageRequest, ResolvedImage
from ..models.profiles import AgentProfile, get_profile
from ..models.replay import PreparedReplay, Runtime, SandboxProfile
from ..models.spec import ReplaySpec, known_user, parse_user
from .checks import AgentChecks, CheckedInputs, check_own_uid, with_agent


def image_request(spec: ReplaySpec) -> ImageRequest:
    """The image a replay asks for before its checks (a batch groups its items by it): its agent's profile looked
    up, when it names one."""
    return _request(spec, get_profile(spec.agent) if spec.agent is not None else None)


def _request(spec: ReplaySpec, profile: AgentProfile | None) -> ImageRequest:
    """The image a replay of ``profile``'s agent (None: the image's label names it) asks for: the one place that
    says it."""
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

    ``image`` is an image already made ready (a batch does that once for every item that shares it). The run
    directory is created last, once everything else has passed: a refusal, a failed build or Ctrl-C leaves none.

    Raises:
        UsageError: the request is wrong (one line says what and how to fix it).
        PrerequisiteError: the host's pvisor is missing.
        ImageBuildError: the image had to be built and the build failed.
    """
    started = time.monotonic()
    source: ImagePlan | ResolvedImage
    source = image if image is not None else backend.plan_image(_request(checked.spec, checked.profile))
    agent, runtime = check_before_image(checked, backend, source.profile)
    checked_at = time.monotonic()
    resolved = source if isinstance(source, ResolvedImage) else backend.ensure_image(source, build or BuildOptions())
    timings = {
        "preflight": round(checked.seconds + checked_at - started, 4),
        "image": round(time.monotonic() - checked_at, 4),
    }
    prepared = assemble(checked, agent, resolved.image, runtime, built=resolved, timings=timings)
    backend.describe_sandbox(prepared)  # what the sandbox cannot be (a workspace the image lacks), as the plan
    _create_out_dir(checked.out_dir)
    return prepared


def check_before_image(
    checked: CheckedInputs, backend: AnyBackend, profile: AgentProfile
) -> tuple[AgentChecks, Runtime]:
    """The checks that need the image's agent (``profile``: from ``--agent``, the trajectory, or the image's label)
    but not the image itself: the agent's own, and the runtime's; before anything is built or pulled, for the
    run and ``batch --plan`` alike."""
    agent = with_agent(checked, profile)
    runtime = backend.runtime(checked.spec.runtime)
    runtime_checks(checked.spec, runtime)
    fork_checks(checked.spec, profile, runtime)
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


# -- the checks that need the engine ------------------------------------------------------------------------


def runtime_checks(spec: ReplaySpec, runtime: Runtime) -> None:
    """Refuse options the runtime cannot honour: a runtime registered with ``--network=none`` (gVisor as
    ``make test`` registers it) gives its sandboxes loopback only."""
    if not runtime.networkless:
        return
    if spec.network != "none":
        raise UsageError(
            f"--network {spec.network}: runtime {runtime.name} is registered with --network=none, "
            "so its sandboxes have no network",
            hint="drop --network, or register a runtime without --network=none",
        )
    upstream = spec.continuation
    if upstream is not None and upstream.network != "unix":
        raise UsageError(
            f"--model-network {upstream.network}: runtime {runtime.name} is registered with --network=none; "
            "its sandboxes reach the gateway through its unix socket only",
            hint="drop --model-network",
        )


def check_fork(checked: CheckedInputs, backend: AnyBackend) -> None:
    """``--fork``'s refusals, as soon as an item's host checks pass and before its image is made ready (a task image
    pulled), for the plan and the run alike: the agent when it is known, the runtime."""
    spec = checked.spec
    if spec.fork is not None:
        fork_checks(spec, checked.agent.profile if checked.agent else None, backend.runtime(spec.runtime))


def fork_checks(spec: ReplaySpec, agent: AgentProfile | None, runtime: Runtime) -> None:
    """Refuse ``--fork`` where the sandbox cannot be forked: an agent whose launch the gate cannot stand in front of,
    a runtime that cannot checkpoint it on this engine."""
    if spec.fork is None:
        return
    if agent is not None and agent.fork_unsupported is not None:
        raise UsageError(f"--fork: {agent.agent} cannot be forked at the boundary: {agent.fork_unsupported}")
    if runtime.fork_problem is not None:
        raise UsageError(
            f"--fork: runtime {runtime.name} cannot fork a sandbox: {runtime.fork_problem}",
            hint="name a gVisor runtime of 20240729 or later with --runtime; `make engine-runsc` registers one as "
            "runsc-fork (docs/fork.md)",
        )


def sandbox_profile(spec: ReplaySpec, image: ImageRef) -> SandboxProfile:
    """``task-image`` for a task image (run as the image says), unless ``--strict``; ``strict`` for the
    product's own agent images."""
    return "task-image" if image.task_image and not spec.strict else "strict"


def sandbox_user(checked: CheckedInputs, image: ImageRef, profile: SandboxProfile) -> str:
    """``uid:gid`` the sandbox runs as: ``--user``; else a task image's own user (``task-image``); else the
    strict default (a non-root uid).

    Raises:
        UsageError: a task image whose user pvisor-host cannot run a sandbox as: a name the engine could not
            resolve here (a cluster's driver does not hold the image), or, for a non-root pvisor-host, a uid
            other than its own.
    """
    if checked.spec.user is not None or profile == "strict":
        return checked.user
    user = known_user(image.user or "")
    if user is None:  # a local engine read the image's /etc/passwd already; a cluster's driver has no image
        raise UsageError(
            f"task image {image.ref} runs as user {image.user!r}, which only the image's /etc/passwd can say, "
            "and no node has the image yet",
            hint="pass --user UID[:GID] (or --strict)",
        )
    uid, _ = parse_user(user)
    check_own_uid(
        uid,
        f"task image {image.ref} runs as uid {uid}; as a non-root user",
        hint=f"run pvisor-host as root, or pass --strict (or --user {os.geteuid()})",
    )
    return user


def _create_out_dir(path: Path) -> None:
    """Create the run directory (checked by :func:`~.checks.check_out_dir`, but an image's build or pull may have
    taken minutes since): it must still be new or empty, and take a file; a directory made here is removed again
    when it does not."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        if not path.is_dir():
            raise UsageError(f"--out {path} exists and is not a directory") from None
        if any(path.iterdir()):
            raise UsageError(f"--out {path} is no longer empty (another run?)", hint="pass a new directory") from None
        made = False
    except OSError as exc:
        raise UsageError(f"--out {path} is not writable ({exc.strerror})") from None
    else:
        made = True
    try:
        probe = path / ".pvisor-host-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        if made:
            remove_if_empty(path)
        raise UsageError(f"--out {path} is not writable ({exc.strerror})") from None
