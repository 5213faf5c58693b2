"""Pre-flight: everything checked on the host before a sandbox container may start.

In order, cheapest first: the agent, the trajectory file, the output directory, the environment
variables, the workspace; then the engine and the image's labels; then pvisor's own ``--prepare-only``
on the host (the trajectory and boundary, exactly as the sandbox will see them) and the step budget;
only then is an image built or probed. Any failure is a one-line :class:`UsageError` (or
:class:`PrerequisiteError`) and no container has been started.
"""

from __future__ import annotations

import os
import secrets
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
    plan: PvisorPlan
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
            raise UsageError(f"--out {path} is not empty", hint="pass a new directory; pvisor-host never overwrites a run")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK) or _read_only_fs(existing):
        raise UsageError(f"--out {path} is not writable ({existing} does not allow it)")
    return path


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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
    try:
        path.rmdir()
    except OSError:
        pass


def _env_values(spec: ReplaySpec) -> None:
    missing = [name for name in spec.env if name not in os.environ]
    if missing:
        raise UsageError(f"--env {missing[0]}: {missing[0]} is not set in this environment")


def _continuation(spec: ReplaySpec, profile: AgentProfile) -> None:
    if spec.mode != "continue":
        return
    if spec.network == "none":
        raise UsageError(
            "--mode continue lets the agent call its model, which --network none cannot reach",
            hint="pass --network bridge and the model endpoint with --env, or use --mode replay-only",
        )
    for group in profile.continuation.env:
        if not any(name in spec.env for name in group):
            raise UsageError(
                f"--mode continue: {profile.agent} needs one of {', '.join(group)} passed with --env",
                hint=f"its bridge speaks the OpenAI {profile.continuation.api} API",
            )


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
        raise UsageError(f"the trajectory recorded its workspace at {recorded}: {exc}", hint="pass --workspace-path") from None


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


class CheckedInputs(BaseModel):
    """The host-only part of pre-flight: what can be checked without the engine."""

    spec: ReplaySpec
    trajectory: TrajectoryInfo
    run_id: str
    out_dir: Path
    user: str
    seconds: float


def check_inputs(spec: ReplaySpec) -> CheckedInputs:
    """The checks that need neither the engine nor pvisor: agent, trajectory, env, workspace, user, out.

    Raises:
        UsageError: the first problem found, in one line.
    """
    started = time.monotonic()
    if spec.agent is not None:
        get_profile(spec.agent)
    trajectory = check_file(spec.trajectory)
    _env_values(spec)
    _workspace_dir(spec)
    user = _user(spec)
    run_id = spec.run_id or new_run_id()
    out_dir = check_out_dir(spec.out, run_id)
    return CheckedInputs(
        spec=spec, trajectory=trajectory, run_id=run_id, out_dir=out_dir, user=user, seconds=time.monotonic() - started
    )


def prepare(
    checked: CheckedInputs,
    client: docker.DockerClient,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
) -> PreparedReplay:
    """Finish pre-flight with the engine and the host's pvisor, then make the image ready.

    Raises:
        UsageError: the request is wrong (one line says what and how to fix it).
        PrerequisiteError: the host's pvisor is missing.
        ImageBuildError: the image had to be built and the build failed.
    """
    started = time.monotonic()
    spec = checked.spec
    plan = plan_image(client, image=spec.image, agent=spec.agent)
    profile = get_profile(plan.agent)
    check_agent(checked.trajectory.path, profile, all_profiles())
    _continuation(spec, profile)
    workspace_path = _workspace_path(spec, checked.trajectory.path, profile)
    _, pvisor_plan = prepare_only(
        agent=profile.agent,
        trajectory=checked.trajectory.path,
        after_step=spec.after_step,
        run_id=checked.run_id,
        session_id=spec.session_id,
        boundary_user_prompt=spec.boundary_user_prompt,
    )
    _budget(spec, pvisor_plan)
    create_out_dir(checked.out_dir)
    checked_at = time.monotonic()
    try:
        image, built = materialize(client, plan, base=base, ca_bundle=ca_bundle)
    except BaseException:
        release_out_dir(checked.out_dir)
        raise
    return PreparedReplay(
        spec=spec,
        profile=profile,
        trajectory=checked.trajectory,
        run_id=checked.run_id,
        out_dir=checked.out_dir,
        workspace_path=workspace_path,
        user=checked.user,
        image=image,
        built=built,
        plan=pvisor_plan,
        timings={"preflight": round(checked.seconds + checked_at - started, 4), "image": round(time.monotonic() - checked_at, 4)},
    )


def staging_root(out_dir: Path) -> Path:
    """Where the run's staging directory lives (inside the run directory, removed after the run)."""
    return out_dir / STAGING_NAME
