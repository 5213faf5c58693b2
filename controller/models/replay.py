"""One replay on its way through the stages: the checked trajectory, pvisor's own view of the prefix, the
prepared replay every backend runs, one attempt of it, and what its sandbox would look like."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .image import BuiltImage, ImageRef
from .profiles import AgentProfile
from .record import Limits
from .spec import ReplaySpec, parse_user

#: Inside a run directory while an attempt runs: what the sandbox sees (its ``env.sh`` may hold secret
#: values). Removed on every path; a controller killed with ``kill -9`` leaves it, and the next run of the
#: same directory removes it first.
STAGING_NAME = ".pvisor-host-staging"
#: Inside a forked replay's directory while it forks (``--fork``): the checkpoint (the sandbox's memory, secrets
#: included) and the staging as it was at the boundary. Removed on every path, and by the next run after
#: ``kill -9``.
FORK_WORK = ".pvisor-host-fork"


SandboxProfile = Literal["task-image", "strict"]


class TrajectoryInfo(BaseModel):
    """A trajectory file that passed the host checks, and what one read of it found (every check of a
    trajectory is a function of this value: nothing reads the file again)."""

    model_config = ConfigDict(frozen=True)

    path: Path
    """Absolute path on the host."""
    size: int
    sha256: str
    agents: frozenset[str] = frozenset()
    """The agents whose format fingerprint one of its first objects matches (empty: none recognised)."""
    cwd: dict[str, str] = {}
    """Per agent: the working directory the recording ran in, where the agent's format records one."""
    versions: dict[str, str] = {}
    """Per agent: the version of the agent that recorded it, where the agent's format says."""
    bounds: dict[str, int] = {}
    """Per agent: a number of complete tool batches pvisor cannot exceed for this file (its tool calls; absent:
    it cannot be told from the file)."""


class PvisorPlan(BaseModel):
    """What pvisor's own pre-flight (``--prepare-only`` on the host) learned about the selected prefix."""

    model_config = ConfigDict(frozen=True)

    after_step: int
    prefix_model_turns: int
    """Model turns in the prefix; ``--max-steps`` budgets are checked against this, not ``after_step``."""
    tool_calls: int
    """Tool calls in the selected prefix (from pvisor's ``manifest.json``)."""


ESCAPE_CVES = "CVE-2025-31133, CVE-2025-52565 and CVE-2025-52881"
RUNC_FIXED = "1.2.8 / 1.3.3"
RUNTIME_REMEDY = "run root sandboxes under gVisor (--runtime runsc), or upgrade runc to 1.2.8 / 1.3.3 or later"


def runc_has_escape_fixes(version: str) -> bool | None:
    """Whether runc ``version`` (``1.1.5``, ``1.4.0-rc.2``, ``v1.3.3``) is at or past the fixes of the 2025
    container escapes: 1.2.8 on 1.2, 1.3.3 on 1.3, 1.4.0-rc.3 on 1.4 (None: a version it cannot read)."""
    found = re.match(r"^v?(\d+)\.(\d+)\.(\d+)(?:-rc\.?(\d+))?", version.strip())
    if found is None:
        return None
    major, minor, patch = (int(found.group(n)) for n in (1, 2, 3))
    rc = int(found.group(4)) if found.group(4) is not None else None
    if (major, minor) < (1, 2):
        return False
    if (major, minor) == (1, 2):
        return patch >= 8
    if (major, minor) == (1, 3):
        return patch >= 3
    if (major, minor, patch) == (1, 4, 0) and rc is not None:
        return rc >= 3
    return True


class Runtime(BaseModel):
    """The container runtime a sandbox runs under, as the engine has it registered."""

    model_config = ConfigDict(frozen=True)

    name: str
    """``runc``, ``runsc`` (gVisor), ..."""
    path: str = "runc"
    """The runtime's executable."""
    args: list[str] = []
    """The arguments the engine passes it (``runtimeArgs`` in ``daemon.json``)."""
    version: str | None = None
    """Its version as the engine reports it (runc's, for the runtime the engine ships); None when unknown."""
    fork_problem: str | None = "only gVisor's runsc checkpoints a sandbox here (docs/fork.md)"
    """Why ``--fork`` cannot checkpoint a sandbox of this runtime on this engine (None: it can)."""

    @property
    def gvisor(self) -> bool:
        """gVisor's runsc (a user-space kernel between the sandbox and the host)."""
        return self.name == "runsc" or self.path.rsplit("/", 1)[-1] == "runsc"

    @property
    def runc(self) -> bool:
        """runc itself (the engine's own runtime, or one registered under another name with runc's binary)."""
        return self.name == "runc" or self.path.rsplit("/", 1)[-1] == "runc"

    @property
    def escape_fixed(self) -> bool | None:
        """Whether the runtime has the fixes for the 2025 container escapes through mount races
        (CVE-2025-31133, CVE-2025-52565, CVE-2025-52881): runc 1.2.8, 1.3.3 and 1.4.0-rc.3 have them; gVisor and
        crun are not affected. None: not known (a runtime of another kind, or runc of no reported version)."""
        if not self.runc:
            return True if self.gvisor or self.path.rsplit("/", 1)[-1] == "crun" or self.name == "crun" else None
        return runc_has_escape_fixes(self.version) if self.version else None

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
    sandbox: SandboxProfile = "strict"
    """How the sandbox runs: ``task-image`` (as the task image says: its user, ``HOME``, working directory and
    environment, a writable root thrown away with the container) or ``strict`` (pvisor-host's hardened
    defaults: a non-root uid, ``HOME=/tmp``, a read-only root). Both keep no network, no capabilities,
    ``no-new-privileges`` and the limits."""
    image: ImageRef
    built: BuiltImage | None = None
    runtime: Runtime = Runtime(name="runc")
    """The container runtime, checked against what the engine has registered."""
    plan: PvisorPlan | None = None
    """pvisor's host pre-flight; None when it was left to the sandbox (batch items)."""
    timings: dict[str, float] = {}
    """Seconds spent before the first attempt: ``preflight`` and ``image``."""

    @property
    def runtime_warning(self) -> str | None:
        """A warning for a root sandbox under a runc without the fixes for the 2025 container escapes (None: no
        root sandbox, or a runtime with the fixes or of unknown version; ``doctor`` reports those)."""
        if parse_user(self.user)[0] != 0 or self.runtime.escape_fixed is not False:
            return None
        return (
            f"the sandbox runs as root under runc {self.runtime.version}, which is older than the fixes for "
            f"{ESCAPE_CVES} (runc {RUNC_FIXED}): a malicious task image or tool call could escape; {RUNTIME_REMEDY}"
        )


class Attempt(BaseModel):
    """One attempt of a replay, in a fresh sandbox: its own run id and run directory."""

    model_config = ConfigDict(frozen=True)

    number: int = 1
    run_id: str
    run_dir: Path
    """Where the backend writes the attempt's record and artifacts (``<out>/attempts/<n>/``)."""
    pvisor_run_id: str | None = None
    """The run id pvisor knows the run by, when it is not ``run_id``: a fork's is its prefix's (pvisor, restored
    from the prefix's checkpoint, writes under the prefix's run id)."""

    @property
    def pvisor_id(self) -> str:
        """The run id pvisor's output and state directories are named after."""
        return self.pvisor_run_id or self.run_id


class SandboxPlan(BaseModel):
    """The sandbox a backend would start for a prepared replay (``batch --plan``), described, not started."""

    mounts: list[str]
    """``source:target:ro|rw`` (a volume by name)."""
    limits: Limits
    command: list[str]
    """The command in the sandbox."""
