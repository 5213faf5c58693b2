"""Pre-flight: everything checked on the host before a sandbox container may start.

In order, cheapest first: the agent, the trajectory file, the output directory, the environment
variables, the workspace; then the engine and the image's labels; then pvisor's own ``--prepare-only``
on the host (the trajectory and boundary, exactly as the sandbox will see them) and the step budget;
only then is an image built or probed. Any failure is a one-line :class:`UsageError` (or
:class:`PrerequisiteError`) and no container has been started.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import docker
from pydantic import BaseModel, ConfigDict

from .build import BuiltImage
from .errors import UsageError
from .hostpvisor import PvisorPlan, prepare_only
from .profiles import AgentProfile, all_profiles, get_profile
from .record import ImageRef
from .resolve import materialize, plan_image
from .spec import ReplaySpec, check_workspace_path, default_user
from .stage import STAGING_NAME, parse_user
from .trajectory import TrajectoryInfo, check_agent, check_file, recorded_workspace

DEFAULT_WORKSPACE = "/workspace"


class PreparedReplay(BaseModel):
    """A replay that passed pre-flight: every input checked, the image ready."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    spec: ReplaySpec
    profile: AgentProfile
    trajectory: TrajectoryInfo
    run_id: str
    out_dir: Path
    workspace_path: str
    user: str
    image: ImageRef
    built: BuiltImage | None = None
    plan: PvisorPlan | None
    timings: dict[str, float]


def new_run_id() -> str:
    """A sortable, unique run id: ``<UTC timestamp>-<6 hex>``."""
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"


def check_out_dir(out: Path | None, run_id: str) -> Path:
    """The run directory: ``--out`` or ``./pvisor-runs/<run-id>``; it must be new or empty, and writable.

    Nothing is created here (see :func:`create_out_dir`).
    """
    path = (out or Path("pvisor-runs") / run_id).expanduser().absolute()
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UsageError(f"--out {path} exists and is not a directory")
        if any(path.iterdir()):
            raise UsageError(
                f"--out {path} is not empty", hint="pass a new directory; pvisor-host never overwrites a run"
            )
    existing = path
    while not existing.exists():
        existing = existing.parent
    try:
        # An unnamed temporary file (O_TMPFILE where supported): proves writability, leaves no trace.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise UsageError(f"--out {path} is not writable ({existing}: {exc.strerror})") from None
    return path


def create_out_dir(path: Path) -> None:
    """Create the run directory (checked by :func:`check_out_dir`) and prove it takes a file."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".pvisor-host-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        release_out_dir(path)
        raise UsageError(f"--out {path} is not writable ({exc.strerror})") from None


def release_out_dir(path: Path) -> None:
    """Remove the run directory again if it is still empty (pre-flight failed after creating it)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def _env_values(spec: ReplaySpec) -> None:
    missing = [name for name in spec.env if name not in os.environ]
    if missing:
        raise UsageError(f"--env {missing[0]}: {missing[0]} is not set in this environment")


_GATEWAY_HINT = "pass --model-base-url URL --model NAME --model-api-key-env VAR: a host-side gateway keeps the key"


def _continuation(spec: ReplaySpec, profile: AgentProfile) -> None:
    if spec.mode != "continue":
        return
    if spec.uses_gateway:
        _gateway_inputs(spec, profile)
        return
    # Without a gateway the user brings the endpoint: the sandbox needs a network and the variables.
    if spec.network == "none":
        raise UsageError(
            "--mode continue lets the agent call its model, which --network none cannot reach", hint=_GATEWAY_HINT
        )
    for group in profile.continuation.env:
        if not any(name in spec.env for name in group):
            raise UsageError(
                f"--mode continue: {profile.agent} needs one of {', '.join(group)} passed with --env",
                hint=_GATEWAY_HINT,
            )


def _gateway_inputs(spec: ReplaySpec, profile: AgentProfile) -> None:
    assert spec.model_api_key_env is not None
    if not os.environ.get(spec.model_api_key_env):
        raise UsageError(f"--model-api-key-env {spec.model_api_key_env}: {spec.model_api_key_env} is not set or empty")
    if spec.model_network != "pass-through" and spec.network != "none":
        raise UsageError(
            f"--network {spec.network}: with --model-network {spec.model_network} the sandbox reaches only the gateway",
            hint="drop --network",
        )
    clash = sorted(set(spec.env) & set(profile.continuation.gateway_env))
    if clash:
        raise UsageError(f"--env {clash[0]}: the model gateway sets {clash[0]} for {profile.agent}; drop it")


def _workspace_dir(spec: ReplaySpec) -> None:
    source = spec.workspace_dir
    if source is None:
        return
    if not source.exists():
        raise UsageError(f"--workspace-dir {source} does not exist")
    if not source.is_dir():
        raise UsageError(f"--workspace-dir {source} is not a directory")
    if not os.access(source, os.R_OK | os.X_OK):
        raise UsageError(f"--workspace-dir {source} is not readable")


def _user(spec: ReplaySpec) -> str:
    user = spec.user or default_user()
    uid, _ = parse_user(user)
    if os.geteuid() != 0 and uid != os.geteuid():
        raise UsageError(
            f"--user {user}: as a non-root user pvisor-host can only run sandboxes as your own uid {os.geteuid()}"
        )
    return user


def _workspace_path(spec: ReplaySpec, trajectory: Path, profile: AgentProfile) -> str:
    if spec.workspace_path:
        return spec.workspace_path
    recorded = recorded_workspace(trajectory, profile)
    if recorded is None:
        return DEFAULT_WORKSPACE
    try:
        return check_workspace_path(recorded)
    except ValueError as exc:
        raise UsageError(
            f"the trajectory recorded its workspace at {recorded}: {exc}", hint="pass --workspace-path"
        ) from None


def _budget(spec: ReplaySpec, plan: PvisorPlan) -> None:
    if spec.max_steps is None or spec.mode == "prepare-only":
        return
    prefix = plan.prefix_model_turns
    if spec.mode == "replay-only" and spec.max_steps < prefix:
        raise UsageError(f"--max-steps {spec.max_steps} is smaller than the selected replay prefix of {prefix} steps")
    if spec.mode == "continue" and spec.max_steps <= prefix:
        raise UsageError(
            f"--max-steps {spec.max_steps} leaves no live step after the selected replay prefix of {prefix} steps",
            hint=f"use at least {prefix + 1}",
        )


class AgentChecks(BaseModel):
    """What pre-flight learned once the agent was known."""

    profile: AgentProfile
    workspace_path: str
    plan: PvisorPlan | None
    """pvisor's own pre-flight of the prefix; None when it was left to the sandbox (batch runs)."""


class CheckedInputs(BaseModel):
    """The host-only part of pre-flight: everything that needs no engine."""

    spec: ReplaySpec
    trajectory: TrajectoryInfo
    run_id: str
    out_dir: Path
    user: str
    agent: AgentChecks | None = None
    """Present when ``--agent`` was given; with ``--image`` alone the agent comes from the image's labels."""
    host_pvisor: bool = True
    seconds: float


def check_inputs(
    spec: ReplaySpec,
    *,
    host_pvisor: bool = True,
    run_id: str | None = None,
    out_dir: Path | None = None,
    trajectory: TrajectoryInfo | None = None,
) -> CheckedInputs:
    """Every check that needs no engine: trajectory, environment, workspace, user, output directory and,
    when ``--agent`` is given, the agent-specific ones including pvisor's own pre-flight.

    ``host_pvisor=False`` leaves the trajectory and boundary checks to the pvisor in the sandbox (a batch
    avoids a subprocess per item); ``run_id`` and ``out_dir`` override the spec's (a batch names them, and
    has made sure ``out_dir`` is free); ``trajectory`` is the result of an earlier ``check_file`` of it.

    Raises:
        UsageError: the first problem found, in one line.
        PrerequisiteError: the host's pvisor is missing.
    """
    started = time.monotonic()
    profile = get_profile(spec.agent) if spec.agent is not None else None
    trajectory = trajectory or check_file(spec.trajectory)
    _env_values(spec)
    _workspace_dir(spec)
    user = _user(spec)
    run_id = run_id or spec.run_id or new_run_id()
    out_dir = out_dir.absolute() if out_dir is not None else check_out_dir(spec.out, run_id)
    agent = _agent_checks(spec, trajectory, run_id, profile, host_pvisor) if profile is not None else None
    return CheckedInputs(
        spec=spec,
        trajectory=trajectory,
        run_id=run_id,
        out_dir=out_dir,
        user=user,
        agent=agent,
        host_pvisor=host_pvisor,
        seconds=time.monotonic() - started,
    )


def _agent_checks(
    spec: ReplaySpec, trajectory: TrajectoryInfo, run_id: str, profile: AgentProfile, host_pvisor: bool = True
) -> AgentChecks:
    check_agent(trajectory.path, profile, all_profiles())
    plan = None
    if host_pvisor:
        _, plan = prepare_only(
            agent=profile.agent,
            trajectory=trajectory.path,
            after_step=spec.after_step,
            run_id=run_id,
            session_id=spec.session_id,
            boundary_user_prompt=spec.boundary_user_prompt,
        )
        _budget(spec, plan)
    _continuation(spec, profile)
    workspace_path = _workspace_path(spec, trajectory.path, profile)
    return AgentChecks(profile=profile, workspace_path=workspace_path, plan=plan)


def agent_checks(checked: CheckedInputs, agent: str) -> AgentChecks:
    """The agent-specific checks, once the agent is known (from ``--agent`` or the image's labels)."""
    return checked.agent or _agent_checks(
        checked.spec, checked.trajectory, checked.run_id, get_profile(agent), checked.host_pvisor
    )


def resolve_image(
    client: docker.DockerClient, spec: ReplaySpec, *, base: str | None = None, ca_bundle: Path | None = None
) -> tuple[ImageRef, BuiltImage | None]:
    """The image a spec runs in, ready (labels checked, probed, built or injected).

    Raises:
        UsageError: the image is wrong for the request.
        ImageBuildError: the image had to be built and the build failed.
    """
    plan = plan_image(client, image=spec.image, agent=spec.agent, inject=spec.inject)
    return materialize(client, plan, base=base, ca_bundle=ca_bundle)


def prepare(
    checked: CheckedInputs,
    client: docker.DockerClient,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
    image: tuple[ImageRef, BuiltImage | None] | None = None,
) -> PreparedReplay:
    """Finish pre-flight with the engine (the image's labels), then make the image ready.

    ``image`` is an already resolved image (a batch resolves each distinct image once).

    Raises:
        UsageError: the request is wrong (one line says what and how to fix it).
        PrerequisiteError: the host's pvisor is missing.
        ImageBuildError: the image had to be built and the build failed.
    """
    started = time.monotonic()
    spec = checked.spec
    if image is None:
        plan = plan_image(client, image=spec.image, agent=spec.agent, inject=spec.inject)
        agent_name = plan.agent
    else:
        agent_name = image[0].agent
    agent = agent_checks(checked, agent_name)
    create_out_dir(checked.out_dir)
    checked_at = time.monotonic()
    try:
        ref, built = image if image is not None else materialize(client, plan, base=base, ca_bundle=ca_bundle)
    except BaseException:
        release_out_dir(checked.out_dir)
        raise
    return PreparedReplay(
        spec=spec,
        profile=agent.profile,
        trajectory=checked.trajectory,
        run_id=checked.run_id,
        out_dir=checked.out_dir,
        workspace_path=agent.workspace_path,
        user=checked.user,
        image=ref,
        built=built,
        plan=agent.plan,
        timings={
            "preflight": round(checked.seconds + checked_at - started, 4),
            "image": round(time.monotonic() - checked_at, 4),
        },
    )


def staging_root(out_dir: Path) -> Path:
    """Where the run's staging directory lives (inside the run directory, removed after the run)."""
    return out_dir / STAGING_NAME
