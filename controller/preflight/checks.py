"""Host checks: everything about a replay that can be decided without an engine, cheapest first.

They come in two kinds, and both are functions of values read once:

- :func:`check_options`: what the options alone decide (the environment variables, the workspace directory, the
  user, a cassette's directory, a continuation's model, an agent that cannot be built or injected here). A batch
  asks it of every item before anything else (a reason every item shares is one line, not N rejections);
- the trajectory's: the file (:func:`~.trajectory.read_trajectory`, read once per version of it) is not another
  agent's, pvisor's own pre-flight accepts the boundary (``--prepare-only`` on the host, or the trajectory's
  survey for a batch), the step budget fits the prefix, and the workspace path.

:func:`check_inputs` reads the trajectory and runs them in that order (:func:`check_trajectory_inputs`, for a
trajectory read already): the options that need no agent, the run directory, then, once the agent is known
(from ``--agent`` or the trajectory's format; else later from the image's label), the agent's options and the
trajectory's checks (:func:`with_agent`, the same for both). It returns what they found as one value,
:class:`CheckedInputs` (the agent's profile, looked up once, in it). Any failure is a one-line
:class:`~pvisor_host.errors.UsageError` (or ``PrerequisiteError``), and nothing has been created. The checks
that need the engine (the runtime, the image's user) are :mod:`.prepare`'s.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

from ..errors import UsageError
from ..models.profiles import AgentProfile, UnavailableInstall, all_profiles, get_profile
from ..models.record import PvisorRequest
from ..models.replay import PvisorPlan, TrajectoryInfo
from ..models.spec import ModelUpstream, ReplaySpec, check_workspace_path, default_user, parse_user
from .hostpvisor import prepare_only
from .survey import survey_plan
from .trajectory import read_trajectory

DEFAULT_WORKSPACE = "/workspace"
_GATEWAY_HINT = "pass --model-base-url URL --model NAME --model-api-key-env VAR: a host-side gateway keeps the key"


class AgentChecks(BaseModel):
    """What pre-flight learned once the agent was known."""

    profile: AgentProfile
    workspace_path: str
    """The workspace's path in the sandbox: ``--workspace-path``, the recording's cwd, or ``/workspace``."""
    plan: PvisorPlan | None
    """pvisor's own pre-flight of the prefix; None when it was left to the sandbox."""


class CheckedInputs(BaseModel):
    """The host-only part of pre-flight: everything that needs no engine."""

    spec: ReplaySpec
    trajectory: TrajectoryInfo
    run_id: str
    out_dir: Path
    user: str
    agent: AgentChecks | None = None
    """Present once the agent is known; with ``--image`` alone the agent comes from the image's label."""
    host_pvisor: bool = True
    """Whether the agent checks run pvisor's own pre-flight on the host."""
    per_file: bool = False
    """Whether that pre-flight is the trajectory's survey for all its boundaries (a batch's items)."""
    seconds: float
    """Time the checks took."""

    @property
    def profile(self) -> AgentProfile | None:
        """The agent's profile, when it is known."""
        return self.agent.profile if self.agent is not None else None


def new_run_id() -> str:
    """A sortable, unique run id: ``<UTC timestamp>-<6 hex>``."""
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"


def check_inputs(
    spec: ReplaySpec,
    *,
    host_pvisor: bool = True,
    per_file: bool = False,
    run_id: str | None = None,
    out_dir: Path | None = None,
) -> CheckedInputs:
    """:func:`check_trajectory_inputs` of the spec's trajectory, read first (once per version of the file).

    Raises:
        UsageError: the first problem found, in one line.
        PrerequisiteError: the host's pvisor is missing.
    """
    started = time.monotonic()
    checked = check_trajectory_inputs(
        spec, read_trajectory(spec.trajectory), host_pvisor=host_pvisor, per_file=per_file, run_id=run_id,
        out_dir=out_dir,
    )  # fmt: skip
    return checked.model_copy(update={"seconds": time.monotonic() - started})


def check_trajectory_inputs(
    spec: ReplaySpec,
    trajectory: TrajectoryInfo,
    *,
    host_pvisor: bool = True,
    per_file: bool = False,
    run_id: str | None = None,
    out_dir: Path | None = None,
) -> CheckedInputs:
    """Every check that needs no engine (see the module docstring) of ``spec`` and its ``trajectory`` (read
    already), the agent's included when it is known: from ``--agent``, else from the trajectory's format (with
    ``--image`` alone and a format no profile knows, the image's label names it later: :func:`with_agent`). The
    agent's profile is looked up once, here.

    ``host_pvisor=False`` leaves the trajectory and boundary checks to the pvisor in the sandbox;
    ``per_file=True`` answers them from one survey of the trajectory for all its boundaries (a batch:
    :mod:`.survey`) instead of a pvisor run at this boundary; ``run_id`` and ``out_dir`` override the spec's (a
    batch names them, and has made sure ``out_dir`` is free).

    Raises:
        UsageError: the first problem found, in one line.
        PrerequisiteError: the host's pvisor is missing.
    """
    started = time.monotonic()
    if spec.agent is None:  # with --image (not injected) the image's label may name it
        spec = spec.model_copy(update={"agent": agent_of(trajectory, required=spec.image is None or spec.inject)})
    _plain_options(spec)
    run_id = run_id or spec.run_id or new_run_id()
    out_dir = out_dir.absolute() if out_dir is not None else check_out_dir(spec.out, run_id)
    _tape(spec, out_dir.name)
    checked = CheckedInputs(
        spec=spec,
        trajectory=trajectory,
        run_id=run_id,
        out_dir=out_dir,
        user=spec.user or default_user(),
        host_pvisor=host_pvisor,
        per_file=per_file,
        seconds=0.0,
    )
    agent = with_agent(checked, get_profile(spec.agent)) if spec.agent is not None else None
    return checked.model_copy(update={"agent": agent, "seconds": time.monotonic() - started})


def check_options(spec: ReplaySpec, profile: AgentProfile | None) -> None:
    """What the options alone decide, for every item alike (no file is read but the workspace directory's
    listing): see the module docstring.

    Raises:
        UsageError: the first problem found, in one line.
    """
    _plain_options(spec)
    if profile is not None:
        _agent_options(spec, profile)


def with_agent(checked: CheckedInputs, profile: AgentProfile) -> AgentChecks:
    """The agent's checks (:func:`check_options`' part that needs the agent, then the trajectory's as that
    agent's): for inputs whose agent only the image's label named, or the agent's own when it was known
    already."""
    if checked.agent is not None:
        return checked.agent
    spec = checked.spec
    _agent_options(spec, profile)
    check_agent(checked.trajectory, profile)
    plan = None
    if checked.host_pvisor and checked.per_file:
        budgeted = spec.max_steps is not None and spec.mode != "prepare-only"  # its turns counted for _budget
        plan = survey_plan(profile.agent, checked.trajectory, spec.after_step, count_turns=budgeted)
    elif checked.host_pvisor:
        _, plan = prepare_only(PvisorRequest.of(spec, profile.agent), checked.trajectory.path, checked.run_id)
    if plan is not None:
        _budget(spec, plan)
    return AgentChecks(profile=profile, workspace_path=_workspace_path(spec, checked.trajectory, profile), plan=plan)


def _plain_options(spec: ReplaySpec) -> None:
    """The options' checks that need no agent."""
    _env_values(spec)
    _workspace_dir(spec)
    _user(spec)
    _cassette_dir(spec)


def _agent_options(spec: ReplaySpec, profile: AgentProfile) -> None:
    """The options' checks that need the agent: its continuation, and an image it needs that cannot be made."""
    _continuation(spec, profile)
    refusal = profile.inject_refusal if spec.inject else None
    if refusal is not None:
        raise UsageError(refusal, hint="drop --inject")
    needs_agent_image = spec.inject or (spec.image is None and spec.mode != "prepare-only")
    if needs_agent_image and isinstance(profile.install, UnavailableInstall):
        raise UsageError(
            f"cannot build {profile.agent} {profile.version} here: {profile.install.reason}",
            hint="pvisor-host agents lists what can be built",
        )


# -- which agent's trajectory it is ------------------------------------------------------------------------


def detect_agent(trajectory: TrajectoryInfo) -> str:
    """The agent whose native format the trajectory is, from the profiles' fingerprints.

    Raises:
        UsageError: no profile's fingerprint matches, or more than one does (one line, naming them).
    """
    found = sorted(trajectory.agents)
    if len(found) == 1:
        return found[0]
    if found:
        problem = f"could be a trajectory of {', '.join(found)}; pass agent explicitly"
        raise _not_replayable(trajectory, problem, f"pass --agent {found[0]}")
    raise _not_replayable(
        trajectory,
        f"is no trajectory format pvisor replays (none of {', '.join(sorted(all_profiles()))})",
        "pass agent explicitly if it is one",
    )


def agent_of(trajectory: TrajectoryInfo, *, required: bool) -> str | None:
    """:func:`detect_agent`'s answer; where the agent is not ``required`` (an image's label may name it), None
    when the trajectory cannot tell (no profile's format, or several).

    Raises:
        UsageError: as :func:`detect_agent`, when ``required``.
    """
    try:
        return detect_agent(trajectory)
    except UsageError:
        if required:
            raise
        return None


def check_agent(trajectory: TrajectoryInfo, profile: AgentProfile) -> None:
    """Refuse a trajectory that is recognisably another agent's format."""
    found = sorted(trajectory.agents)
    if found and profile.agent not in found:
        raise _not_replayable(
            trajectory,
            f"looks like a {', '.join(found)} trajectory, not {profile.agent} ({profile.trajectory.description})",
            f"pass --agent {found[0]}" if len(found) == 1 else None,
        )


def _not_replayable(trajectory: TrajectoryInfo, problem: str, hint: str | None) -> UsageError:
    return UsageError(f"trajectory {trajectory.path}: {problem}", hint=hint)


# -- the run directory -------------------------------------------------------------------------------------


def check_out_dir(out: Path | None, run_id: str) -> Path:
    """The run directory: ``--out`` or ``./pvisor-runs/<run-id>``; it must be new or empty, and writable.

    Nothing is created here: :func:`~.prepare.prepare` creates it once the engine's checks have passed too.
    """
    path = (out or Path("pvisor-runs") / run_id).expanduser().absolute()
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UsageError(f"--out {path} exists and is not a directory")
        if any(path.iterdir()):
            raise UsageError(
                f"--out {path} is not empty", hint="pass a new directory; pvisor-host never overwrites a run"
            )
    unwritable = _unwritable(path)
    if unwritable is not None:
        raise UsageError(f"--out {path} is not writable ({unwritable})")
    return path


def _unwritable(path: Path) -> str | None:
    """Why no file could be made at ``path`` (a directory that may not exist yet), None: one could. Its nearest
    existing directory takes an unnamed temporary file (``O_TMPFILE`` where supported): proof that leaves no
    trace."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as exc:
        return f"{existing}: {exc.strerror}"


# -- the individual checks ---------------------------------------------------------------------------------


def _env_values(spec: ReplaySpec) -> None:
    missing = [name for name in spec.env if name not in os.environ]
    if missing:
        raise UsageError(f"--env {missing[0]}: {missing[0]} is not set in this environment")


def _cassette_dir(spec: ReplaySpec) -> None:
    """A cassette served back must be a directory; one to record into must be a directory we can make (nothing is
    made here)."""
    cassette = spec.continuation.cassette if spec.continuation is not None else None
    if cassette is None:
        return
    flag = f"--model-cassette {cassette.mode} {cassette.dir}"
    if cassette.replaying:
        if not cassette.dir.is_dir():
            raise UsageError(f"{flag}: no such directory", hint="record one with --model-cassette record DIR")
        return
    if cassette.dir.exists() and not cassette.dir.is_dir():
        raise UsageError(f"{flag}: not a directory")
    unwritable = _unwritable(cassette.dir)  # made when the tape is written, at the end of the run
    if unwritable is not None:
        raise UsageError(f"{flag}: cannot make the directory ({unwritable})")


def _tape(spec: ReplaySpec, name: str) -> None:
    """A cassette served back must hold this run's tape."""
    cassette = spec.continuation.cassette if spec.continuation is not None else None
    if cassette is not None and cassette.replaying and not cassette.tape(name).is_file():
        raise UsageError(
            f"--model-cassette {cassette.mode} {cassette.dir}: no tape {name}.jsonl there",
            hint="record one with --model-cassette record DIR",
        )


def _continuation(spec: ReplaySpec, profile: AgentProfile) -> None:
    if spec.mode != "continue":
        return
    if spec.upstream is not None:
        _gateway_inputs(spec, spec.upstream, profile)
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


def _gateway_inputs(spec: ReplaySpec, upstream: ModelUpstream, profile: AgentProfile) -> None:
    if upstream.api_key_env is not None and not os.environ.get(upstream.api_key_env):
        raise UsageError(f"--model-api-key-env {upstream.api_key_env}: {upstream.api_key_env} is not set or empty")
    if upstream.gateway and spec.network != "none":
        raise UsageError(
            f"--network {spec.network}: with --model-network {upstream.network} the sandbox reaches only the gateway",
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


def _user(spec: ReplaySpec) -> None:
    user = spec.user or default_user()
    check_own_uid(parse_user(user)[0], f"--user {user}: as a non-root user")


def check_own_uid(uid: int, what: str, hint: str | None = None) -> None:
    """A non-root pvisor-host can only run sandboxes as its own uid."""
    if os.geteuid() != 0 and uid != os.geteuid():
        raise UsageError(f"{what} pvisor-host can only run sandboxes as your own uid {os.geteuid()}", hint=hint)


def _workspace_path(spec: ReplaySpec, trajectory: TrajectoryInfo, profile: AgentProfile) -> str:
    if spec.workspace_path:
        return spec.workspace_path
    recorded = trajectory.cwd.get(profile.agent)
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
