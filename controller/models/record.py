"""pvisor-host's own record of one replay (``record.json``), versioned and written atomically.

The record says what went in (inputs, the trajectory's sha256, the image and its versions, the limits
applied), what happened (container, exit code, per-phase timings, status) and what came out (pvisor's
parsed v3 result, every collected artifact with size and sha256, the workspace changes). It never holds
secret values: environment variables appear by name only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel

from ..files.archive import Skipped
from ..files.atomic import write_atomic
from ..files.trees import WorkspaceChanges
from ..units import percentile
from .egress import EgressInfo
from .image import ImageRef
from .observations import Observations
from .result import ReplayResult

if TYPE_CHECKING:
    from .spec import ReplaySpec

RECORD_SCHEMA: Final = "pvisor-host.record/v1"

ReplayStatus = Literal["ok", "replay_failed", "timeout", "oom", "infra_error", "interrupted"]


#: The prefix of the variables pvisor-host sets for the sandbox's entry script (deadlines, the relay's path).
CONTROL_PREFIX = "PVISOR_HOST_"
#: Names whose values a record never holds, whoever set them (an image's ``ENV HF_TOKEN=...`` too).
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE|AUTH|COOKIE", re.IGNORECASE)


def recorded_environment(environment: Mapping[str, str], secret_names: Iterable[str] = ()) -> dict[str, str | None]:
    """``environment`` as a record holds it: the values of ``secret_names`` (handed over secretly: ``--env``, the
    model's key) and of every name that looks like a secret's (:data:`SECRET_NAME`) as null, the name kept."""
    secret = set(secret_names)
    recorded: dict[str, str | None] = {
        name: None if SECRET_NAME.search(name) else value for name, value in environment.items()
    }
    return {**recorded, **dict.fromkeys(secret)}


class TrajectoryRef(BaseModel):
    """The trajectory as it entered the sandbox."""

    path: str
    size: int
    sha256: str
    mounted_at: str
    filled: list[str] = []
    """Keys of its saved config the sandbox's copy has filled with the agent's own defaults (a mini-swe-agent
    trajectory without its agent templates); empty: the copy is the file, byte for byte."""
    staged_sha256: str | None = None
    """The sha256 of that copy (what pvisor's ``manifest.json`` names), when something was filled."""


#: ``pvisor replay``'s flag for each mode (``continue`` is its default).
_MODE_FLAGS = {"continue": [], "replay-only": ["--replay-only"], "prepare-only": ["--prepare-only"]}


class PvisorRequest(BaseModel):
    """What pvisor is asked to replay: the ``pvisor replay`` flags a sandbox runs with (beside its paths), as the
    record lists them."""

    agent: str
    after_step: int
    mode: str
    max_steps: int | None
    boundary_user_prompt: str | None
    disable_thinking: bool
    allow_stale_observations: bool
    session_id: str | None

    @classmethod
    def of(cls, spec: ReplaySpec, agent: str) -> PvisorRequest:
        """The request of ``spec`` for ``agent`` (the agent its profile names)."""
        return cls(agent=agent, **spec.model_dump(include=set(cls.model_fields) - {"agent"}))

    def argv(
        self,
        *,
        trajectory: str,
        workspace: str,
        state_dir: str,
        output_dir: str,
        run_id: str,
        agent_flags: Sequence[str] = (),
        prepare_only: bool = False,
    ) -> list[str]:
        """``pvisor replay``'s arguments (after the binary) for this request at these paths: the sandbox's command
        (``agent_flags``: where the agent's runtime is, for a mode that starts it) and the host's pre-flight of it
        (``prepare_only``: pvisor parses and selects the prefix and runs nothing) are this one list."""
        mode = "prepare-only" if prepare_only else self.mode
        return [
            "replay", "--agent", self.agent, "--trajectory", trajectory, "--after-step", str(self.after_step),
            *_MODE_FLAGS[mode], "--workspace", workspace, "--state-dir", state_dir, "--output-dir", output_dir,
            "--run-id", run_id, *(agent_flags if mode != "prepare-only" else ()), *self.options(),
        ]  # fmt: skip

    def options(self) -> list[str]:
        """The flags that only a value set adds (``--max-steps``, ``--session-id``, ...), in pvisor's order."""
        flags: list[str] = []
        if self.max_steps is not None:
            flags += ["--max-steps", str(self.max_steps)]
        if self.session_id:
            flags += ["--session-id", self.session_id]
        if self.boundary_user_prompt:
            flags += ["--boundary-user-prompt", self.boundary_user_prompt]
        if self.disable_thinking:
            flags.append("--disable-thinking")
        if self.allow_stale_observations:
            flags.append("--allow-stale-observations")
        return flags


class Inputs(PvisorRequest):
    """The replay request, as run."""

    workspace_dir: str | None
    workspace_from_image: bool = False
    workspace_path: str
    collect_workspace: bool
    env_names: list[str]
    environment: dict[str, str | None] = {}
    """The environment the replay ran with: its image's, pvisor-host's (``PYTHONHASHSEED``, ``TZ`` and ``LANG``
    pinned unless the image or ``--env`` sets them), and the names of the values handed over secretly (``--env``,
    the model's key), whose values are null here."""
    trajectory: TrajectoryRef

    @property
    def tools_environment(self) -> dict[str, str | None]:
        """:attr:`environment` without pvisor-host's own instructions to the sandbox's entry script
        (``PVISOR_HOST_DEADLINE`` and the like, which follow from options recorded elsewhere): what two runs'
        tools are compared by."""
        return {name: value for name, value in self.environment.items() if not name.startswith(CONTROL_PREFIX)}


class Limits(BaseModel):
    """The hardening and limits the container really got."""

    user: str
    network: str
    egress: str | None = None
    """With ``--egress``: the hosts the sandbox's tools could reach through the host's egress proxy."""
    read_only_rootfs: bool
    cap_drop: list[str]
    cap_add: list[str]
    no_new_privileges: bool
    memory: int
    cpus: float
    pids: int
    tmp_size: int
    timeout: float
    collect_limit: int
    init: bool = True
    runtime: str = "runc"
    """The container runtime the sandbox ran under (``runsc``: gVisor)."""
    runtime_version: str | None = None
    """Its version, where the engine reports one (runc's)."""
    profile: str = "strict"
    """``task-image`` (the task image's own user, ``HOME``, working directory and environment, a writable root)
    or ``strict`` (pvisor-host's hardened defaults); see docs/security.md."""
    notes: list[str] = []
    """Where a limit means something else under this runtime (gVisor: ``pids``)."""


class ContainerInfo(BaseModel):
    """The container that ran pvisor."""

    id: str | None = None
    name: str
    command: list[str]
    exit_code: int | None = None
    oom_killed: bool = False
    timed_out: bool = False


class Artifact(BaseModel):
    """One collected file under the run directory."""

    path: str
    """Relative to the run directory (``output/manifest.json``, ``workspace/f.txt``, ...)."""
    size: int
    sha256: str
    role: str | None = None
    """pvisor's artifact role when pvisor listed the file in its result."""
    format: str | None = None


class Collection(BaseModel):
    """How collection went."""

    truncated: bool = False
    """True when the collect limit cut the collection short."""
    bytes: int = 0
    skipped: list[Skipped] = []
    logs_truncated: bool = False


#: The failure category of an attempt that found the run directory's filesystem full (the host's fault).
DISK_FULL: Final = "disk_full"
#: The failure category of an attempt whose sandbox the engine did not start in time (its runtime hung).
START_TIMEOUT: Final = "start_timeout"


class Failure(BaseModel):
    """Why the replay did not end ``ok``."""

    category: str
    """pvisor's ``failure.category`` for ``replay_failed``; otherwise the status itself."""
    message: str
    retryable: bool = False

    @property
    def disk_full(self) -> bool:
        """The host's filesystem was full: never retried, never finished (a rerun redoes it)."""
        return self.category == DISK_FULL


class ModelDrift(BaseModel):
    """Where a continuation's requests stopped matching the cassette it was served from."""

    call: int
    """The model call (1-based) whose request differed."""
    field: str
    """``messages``, ``input``, ... or ``calls`` when the run made more calls than the tape holds."""
    message: int | None = None
    """The first message of ``field`` (0-based) that differs."""
    diff: str
    """Where that message parts from the recording: the words around its first differing character, as
    recorded (``- ``) and as sent (``+ ``)."""


class ModelTotals(BaseModel):
    """A run's model calls, added up from its journal."""

    calls: int = 0
    input_tokens: int = 0
    """Input tokens, the cached ones included (as the APIs count them)."""
    output_tokens: int = 0
    cached_tokens: int = 0
    retries: int = 0
    """Upstream refusals the gateway retried before an answer reached the agent."""
    errors: int = 0
    """Calls whose answer to the agent was an error, or a stream that broke off."""
    waited_seconds: float = 0.0
    """Time calls waited for a slot in the batch's limits (--model-concurrency, --model-rpm, --model-tpm)."""
    latency_p50_ms: float | None = None
    latency_p90_ms: float | None = None
    cost: float | None = None
    """What the tokens cost at --model-price (None without prices)."""
    drift: ModelDrift | None = None
    """With a cassette served back: the first request that differed from the recording."""

    def describe(self) -> str:
        """One line for people: ``12 calls, 48.2k tokens in (40.0k cached), 1.3k out, 2 retries, ...``."""
        parts = [
            f"{self.calls} calls",
            f"{_count(self.input_tokens)} tokens in"
            + (f" ({_count(self.cached_tokens)} cached)" if self.cached_tokens else ""),
            f"{_count(self.output_tokens)} out",
            f"{self.retries} retries",
            f"{self.errors} errors",
        ]
        if self.waited_seconds:
            parts.append(f"waited {self.waited_seconds:.1f}s for a slot")
        if self.latency_p50_ms is not None:
            parts.append(f"latency p50 {self.latency_p50_ms:.0f} ms, p90 {self.latency_p90_ms or 0:.0f} ms")
        if self.cost is not None:
            parts.append(f"cost {self.cost:.4f}")
        if self.drift is not None:
            parts.append(f"drift at call {self.drift.call}")
        return ", ".join(parts)


def _count(tokens: int) -> str:
    return f"{tokens / 1000:.1f}k" if tokens >= 10_000 else str(tokens)


def add_totals(parts: list[ModelTotals]) -> ModelTotals | None:
    """Several runs' model figures as one: counts, tokens, waits and costs added up; latency as the median of
    their medians and the 90th percentile of their 90th percentiles; the first drift (None: no parts)."""
    if not parts:
        return None
    medians = [p.latency_p50_ms for p in parts if p.latency_p50_ms is not None]
    nineties = [p.latency_p90_ms for p in parts if p.latency_p90_ms is not None]
    costs = [p.cost for p in parts if p.cost is not None]
    return ModelTotals(
        calls=sum(p.calls for p in parts),
        input_tokens=sum(p.input_tokens for p in parts),
        output_tokens=sum(p.output_tokens for p in parts),
        cached_tokens=sum(p.cached_tokens for p in parts),
        retries=sum(p.retries for p in parts),
        errors=sum(p.errors for p in parts),
        waited_seconds=round(sum(p.waited_seconds for p in parts), 3),
        latency_p50_ms=percentile(medians, 0.5) if medians else None,
        latency_p90_ms=percentile(nineties, 0.9) if nineties else None,
        cost=round(sum(costs), 6) if costs else None,
        drift=next((p.drift for p in parts if p.drift is not None), None),
    )


class ModelInfo(BaseModel):
    """The live continuation's model, as the gateway saw it (never the key)."""

    upstream: str | None
    """The endpoint the gateway forwarded to (None: a cassette served every answer)."""
    model: str
    network: str
    """``unix``, ``internal`` or ``pass-through``."""
    api_key_env: str | None
    """The name of the host variable the key came from."""
    journal: str | None = None
    """``model-traffic.jsonl`` (relative to the run directory); none with ``pass-through``."""
    requests: int = 0
    totals: ModelTotals | None = None
    """Calls, tokens, retries, errors, waits, latency and cost, from the journal (none with ``pass-through``);
    in the record of a replay that took several attempts, every attempt's calls."""
    cassette: str | None = None
    """``record`` or ``replay``, with a cassette."""


class AttemptSummary(BaseModel):
    """One attempt of a replay that was retried (each in a fresh sandbox with a new run id)."""

    attempt: int
    run_id: str
    status: ReplayStatus
    failure: Failure | None = None
    started_at: datetime
    finished_at: datetime
    container_id: str | None = None
    path: str
    """Where the attempt's files are, relative to the run directory (``.`` for the final attempt)."""


class SupersededAttempt(BaseModel):
    """On a cluster: another start of this attempt that did not make the record. Ray ran it again after its
    node died, the driver gave up on a node that hung or was cut off, or another copy finished first; every
    copy ran in a fresh sandbox of its own."""

    node: str
    """The node it started on."""
    reason: str
    """Why it was left, in words (``its copy on node n1 was lost; Ray ran it again``, ...)."""
    started_at: datetime


#: How a verifier ended: it passed, it failed (exit code not 0), it ran past ``--verify-timeout``, or it could not
#: run at all (not installed, no interpreter, the sandbox gone first): not the task's failure, counted apart.
VerificationOutcome = Literal["passed", "failed", "timed_out", "could_not_run"]
#: Exit codes of a shell that could not run the verifier's command (126: not executable, 127: not found).
COULD_NOT_RUN_CODES = frozenset({126, 127})


class Verification(BaseModel):
    """What ``--verify`` found: the task's verifier, run in the sandbox after pvisor ended."""

    command: str
    exit_code: int | None = None
    """None: the verifier did not run to its end (see ``note``)."""
    passed: bool | None
    """It exited 0 within ``--verify-timeout``; None: it could not run (``note`` says why), which is no verdict on
    the task."""
    timed_out: bool = False
    """Killed at ``--verify-timeout``."""
    oom_killed: bool = False
    """Killed because the sandbox ran out of memory while it ran."""
    seconds: float | None = None
    output_tail: str = ""
    """The last 4 KiB of its output (the whole, cut at 16 MiB, is ``logs/verify.log``)."""
    reward: float | None = None
    """The reward it wrote (``/logs/verifier/reward.txt`` or ``reward.json``), else 1 or 0 from ``passed`` (None
    when it could not run)."""
    reward_source: Literal["reward.txt", "reward.json", "exit_code"] | None = None
    note: str | None = None
    """Why it did not run to its end, when it did not."""

    @property
    def outcome(self) -> VerificationOutcome:
        if self.passed is None:
            return "could_not_run"
        if self.timed_out:
            return "timed_out"
        return "passed" if self.passed else "failed"

    def describe(self) -> str:
        """One line for people: ``passed (exit 0, reward 1.0, 2.1s)``, ``timed out after 30.0s``, ``could not run:
        ...``."""
        return describe_verification(self.outcome, self.exit_code, self.reward, self.seconds, self.note)


def describe_verification(
    outcome: str | None, exit_code: int | None, reward: float | None, seconds: float | None, note: str | None = None
) -> str:
    """A verification in one line (a record's, or a results row's): what it came to, its exit code and reward."""
    took = f", {seconds:.1f}s" if seconds is not None else ""
    if outcome == "could_not_run":
        return f"could not run ({note or f'exit {exit_code}'})"
    if outcome == "timed_out":
        return f"timed out after {seconds:.1f}s" if seconds is not None else "timed out"
    score = f", reward {reward:g}" if reward is not None else ""
    return f"{outcome or 'unknown'} (exit {exit_code}{score}{took})"


class BatchInfo(BaseModel):
    """Where a batch item came from, and the key that decides whether a rerun may skip it."""

    item_id: str
    line: int
    content_key: str
    """sha256 over the trajectory's sha256, the image id and every option that changes the outcome."""
    repeat_of: str | None = None
    """With ``batch --repeat K``: the id this item's repeats share (its own id is ``<that>.r<n>``)."""


class ForkInfo(BaseModel):
    """With ``--fork K``: this record's place among a prefix's sandbox and the K continuations restored from it
    (docs/fork.md)."""

    role: Literal["prefix", "fork"]
    of: str
    """The run id of the prefix's sandbox, which replayed the prefix's tool calls once."""
    index: int | None = None
    """A fork's number, 1 to ``forks``."""
    forks: int
    reached: bool | None = None
    """The prefix's: whether it reached the boundary (False: it ended before, and its record says why)."""
    checkpoint_seconds: float | None = None
    """The prefix's: how long the checkpoint took (None: none was taken)."""
    checkpoint_bytes: int | None = None
    """The prefix's: the size of its checkpoint (the sandbox's memory at the boundary)."""
    checkpoint_error: str | None = None
    """The prefix's: why the checkpoint failed."""
    alone: bool = False
    """The prefix's: it has no forks: it ended before the boundary, or (``--fork-strict``) it could not be
    checkpointed there (else each fork ran as a full replay). Each fork's row is then its record."""
    restored: bool | None = None
    """A fork's: whether it started from the checkpoint (False: it could not, and ran as a full replay or, with
    ``--fork-strict``, failed)."""
    fallback: str | None = None
    """A fork's: why it did not start from the checkpoint."""
    restore_seconds: float | None = None
    """A fork's: how long its start from the checkpoint took."""

    @property
    def dir_name(self) -> str:
        """Its run directory, under the replay's: ``prefix``, ``fork-1``, ..."""
        return fork_dir_name(self.index if self.role == "fork" else None)


def fork_dir_name(index: int | None) -> str:
    """Under a forked replay's directory: the prefix's run directory (``index`` None), or fork ``index``'s."""
    return "prefix" if index is None else f"fork-{index}"


def fork_run_id(prefix_run_id: str, index: int) -> str:
    """Fork ``index``'s run id (its sandbox's, its records'); pvisor in it still knows the prefix's."""
    return f"{prefix_run_id}-f{index}"


def first_not_ok(records: list[ReplayRecord], forks: int | None) -> ReplayRecord | None:
    """The first record that is not ok, of a replay's records (with ``forks``: of its forks' outcomes,
    :func:`fork_outcomes`); None: all are."""
    outcomes = fork_outcomes(records, forks) if forks else records
    return next((r for r in outcomes if not r.ok), None)


def fork_outcomes(records: list[ReplayRecord], forks: int) -> list[ReplayRecord]:
    """What each of ``forks`` forks came to, in order, from a forked replay's records (the prefix's first): its own
    record, or the prefix's when it has none (the prefix ended before the boundary, or could not be forked):
    one per row of a batch, and what ``replay --fork``'s exit code is made of."""
    prefix = records[0]
    own = {r.fork.index: r for r in records[1:] if r.fork is not None and r.fork.index is not None}
    return [own.get(index, prefix) for index in range(1, forks + 1)]


class ReplayRecord(BaseModel):
    """Everything about one replay; ``record.json`` in the run directory."""

    schema_version: Literal["pvisor-host.record/v1"] = RECORD_SCHEMA
    pvisor_host_version: str
    run_id: str
    status: ReplayStatus
    failure: Failure | None = None
    started_at: datetime
    finished_at: datetime
    timings: dict[str, float]
    """Seconds per phase: preflight, image, stage, create, run, collect, total."""
    inputs: Inputs
    image: ImageRef
    limits: Limits
    container: ContainerInfo
    result: ReplayResult | None = None
    """pvisor's parsed ``sandbox-playback.result/v3``, when it printed one."""
    artifacts: list[Artifact] = []
    observations: Observations | None = None
    """How each replayed call's fresh observation matched the recorded one: exact, differing only in whitespace
    or line endings, or diverged (pvisor's comparison, refined; in the top-level record)."""
    workspace_changes: WorkspaceChanges | None = None
    """What the replay added, changed and removed in the workspace (whatever ``--collect`` kept of it)."""
    collect: str = "full"
    """What of the workspace was collected: ``full``, ``changes`` (with ``workspace.patch``) or ``none``."""
    verification: Verification | None = None
    """With ``--verify``: the task's verifier's outcome and reward."""
    collection: Collection = Collection()
    model: ModelInfo | None = None
    egress: EgressInfo | None = None
    """With ``--egress``: the hosts the sandbox reached and was refused, connection by connection."""
    attempt: int = 1
    """Which attempt this record is (pvisor's retryable failures are retried in fresh sandboxes)."""
    attempts: list[AttemptSummary] = []
    """Every attempt of the replay, this one last (in the top-level record only)."""
    batch: BatchInfo | None = None
    """For batch items: the item and its content key."""
    superseded: list[SupersededAttempt] = []
    """On a cluster: every other start of this attempt (this record is the first copy to finish)."""
    host: dict[str, str] = {}
    fork: ForkInfo | None = None
    """With ``--fork K``: the prefix's sandbox, or which of its forks this is."""

    @property
    def ok(self) -> bool:
        """The replay ended with status ``ok``."""
        return self.status == "ok"

    def artifact_json(self, run_dir: Path, role: str) -> Any:
        """The parsed JSON of the collected artifact pvisor gave ``role`` (``observation_comparison``, ...), or
        ``None`` when there is none or it does not parse."""
        path = self.artifact_path(run_dir, role)
        if path is None:
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def artifact_path(self, run_dir: Path, role: str) -> Path | None:
        """Where the collected artifact pvisor gave ``role`` is, under the record's ``run_dir``."""
        return next((run_dir / a.path for a in self.artifacts if a.role == role), None)


def save_record(record: ReplayRecord, run_dir: Path) -> Path:
    """Write ``record.json`` atomically into ``run_dir``."""
    path = run_dir / "record.json"
    write_atomic(path, record.model_dump_json(indent=2).encode() + b"\n")
    return path


def load_record(path: Path) -> ReplayRecord:
    """Read a ``record.json`` back."""
    return ReplayRecord.model_validate(json.loads(path.read_text(encoding="utf-8")))
