"""One replay on its way through the stages: the checked trajectory, pvisor's own view of the prefix, the
prepared replay every backend runs, one attempt of it, and what its sandbox would look like."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from .image import BuiltImage, ImageRef
from .profiles import AgentProfile
from .record import Limits
from .spec import ReplaySpec

#: Inside a run directory while an attempt runs: what the sandbox sees (its ``env.sh`` may hold secret
#: values). Removed on every path; a controller killed with ``kill -9`` leaves it, and the next run of the
#: same directory removes it first.
STAGING_NAME = ".pvisor-host-staging"


class TrajectoryInfo(BaseModel):
    """A trajectory file that passed the host checks."""

    model_config = ConfigDict(frozen=True)

    path: Path
    """Absolute path on the host."""
    size: int
    sha256: str


class PvisorPlan(BaseModel):
    """What pvisor's own pre-flight (``--prepare-only`` on the host) learned about the selected prefix."""

    model_config = ConfigDict(frozen=True)

    after_step: int
    prefix_model_turns: int
    """Model turns in the prefix; ``--max-steps`` budgets are checked against this, not ``after_step``."""
    tool_calls: int
    """Tool calls in the selected prefix (from pvisor's ``manifest.json``)."""


class Runtime(BaseModel):
    """The container runtime a sandbox runs under, as the engine has it registered."""

    model_config = ConfigDict(frozen=True)

    name: str
    """``runc``, ``runsc`` (gVisor), ..."""
    path: str = "runc"
    """The runtime's executable."""
    args: list[str] = []
    """The arguments the engine passes it (``runtimeArgs`` in ``daemon.json``)."""

    @property
    def gvisor(self) -> bool:
        """gVisor's runsc (a user-space kernel between the sandbox and the host)."""
        return self.name == "runsc" or self.path.rsplit("/", 1)[-1] == "runsc"

    @property
    def networkless(self) -> bool:
        """Registered with ``--network=none``: its sandboxes have loopback only, whatever else is asked."""
        return "--network=none" in self.args


class PreparedReplay(BaseModel):
    """A replay that passed pre-flight: every input checked and resolved, the image ready. Backends run it."""

    spec: ReplaySpec
    profile: AgentProfile
    trajectory: TrajectoryInfo
    run_id: str
    """The first attempt's run id (later attempts add ``-a<n>``)."""
    out_dir: Path
    """The run directory on the host."""
    name: str = ""
    """The run's name: its run directory's (a batch item's id). A cassette's tapes are named after it."""
    workspace_path: str
    """The workspace's absolute path inside the sandbox."""
    user: str
    """``uid:gid`` the sandbox runs as."""
    image: ImageRef
    built: BuiltImage | None = None
    runtime: Runtime = Runtime(name="runc")
    """The container runtime, checked against what the engine has registered."""
    plan: PvisorPlan | None = None
    """pvisor's host pre-flight; None when it was left to the sandbox (batch items)."""
    timings: dict[str, float] = {}
    """Seconds spent before the first attempt: ``preflight`` and ``image``."""


class Attempt(BaseModel):
    """One attempt of a replay, in a fresh sandbox: its own run id and run directory."""

    model_config = ConfigDict(frozen=True)

    number: int = 1
    run_id: str
    run_dir: Path
    """Where the backend writes the attempt's record and artifacts (``<out>/attempts/<n>/``)."""


class SandboxPlan(BaseModel):
    """The sandbox a backend would start for a prepared replay (``batch --plan``), described, not started."""

    mounts: list[str]
    """``source:target:ro|rw`` (a volume by name)."""
    limits: Limits
    command: list[str]
    """The command in the sandbox."""
