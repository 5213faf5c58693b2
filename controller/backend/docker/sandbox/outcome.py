"""Record stage: what one attempt amounted to — its status, its artifacts, and ``record.json``.

:func:`classify` decides the status from how the container ended and what pvisor printed;
:func:`build_record` turns an attempt's state into a :class:`~pvisor_host.models.record.ReplayRecord`.
"""

from __future__ import annotations

import json
import re
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from ...._version import __version__
from ....files.digest import hash_file
from ....gateway.journal import totals
from ....models.egress import EgressInfo
from ....models.gateway import MODEL_CASSETTE
from ....models.ownership import Ownership
from ....models.record import (
    DISK_FULL,
    START_TIMEOUT,
    Artifact,
    Collection,
    ContainerInfo,
    Failure,
    ForkInfo,
    Inputs,
    ModelDrift,
    ModelInfo,
    PvisorRequest,
    ReplayRecord,
    ReplayStatus,
    TrajectoryRef,
    Verification,
)
from ....models.replay import Attempt, PreparedReplay
from ....models.result import ReplayResult
from ....units import format_duration, format_size
from .. import container as sandbox
from .collect import PATCH_NAME, Collected
from .launch import limits, sandbox_environment
from .stage import RUN_MOUNT, Staging

#: How pvisor (Rust) words a write that found no space.
#: pvisor's failure message when ``<agent> --version`` ran past 5 s (or printed more than 8 KiB).
_PROBE_BUDGET = "version probe exceeded time/output budget"
_NO_SPACE = re.compile(r"No space left on device|\(os error 28\)|Disk quota exceeded|\(os error 122\)")
#: The gateway's journal of a live continuation, relative to the run directory.
MODEL_JOURNAL = "model-traffic.jsonl"


class AttemptState:
    """What one attempt has found out so far; :func:`build_record` makes its record."""

    def __init__(self, prepared: PreparedReplay, attempt: Attempt) -> None:
        self.prepared = prepared
        self.attempt = attempt
        self.timings = dict(prepared.timings) if attempt.number == 1 else {}
        self.started_at = datetime.now(UTC)
        self.outcome = sandbox.WaitOutcome(exit_code=None)
        self.result: ReplayResult | None = None
        self.protocol_error: str | None = None
        self.collected = Collected()
        self.verification: Verification | None = None
        self.logs_truncated = False
        self.interrupted = False
        self.infra_error: str | None = None
        self.used_gateway = False
        self.egress_journal: list[EgressInfo] = []
        """With ``--egress``: the run's journal, once the proxy has let the run go."""
        self.infra_category: str | None = None
        """The category of an ``infra_error`` that has one of its own (``start_timeout``)."""
        self.self_deadline: str | None = None
        """What the sandbox ended itself at its own deadline (entry.sh's ``deadline.json``), when it did."""
        self.secret_names: list[str] = []
        """The variables handed over through env.sh (``--env``, the model's): named in the record, never valued."""
        self.model_token: str | None = None
        """The gateway token its sandbox holds (``--fork``: its forks hold it too)."""
        self.fork: ForkInfo | None = None
        """With ``--fork``: the prefix's, once checkpointed at the boundary; a fork's, from the start."""

    @property
    def at_boundary(self) -> bool:
        """A prefix's sandbox, checkpointed at the boundary (it has no result of its own: its forks have)."""
        return self.fork is not None and self.fork.role == "prefix" and self.fork.checkpoint_seconds is not None

    def phase(self, name: str, since: float) -> float:
        """Note that phase ``name`` took from ``since`` until now; return now."""
        now = time.monotonic()
        self.timings[name] = round(now - since, 4)
        return now


def classify(
    outcome: sandbox.WaitOutcome,
    result: ReplayResult | None,
    *,
    interrupted: bool = False,
    infra_error: str | None = None,
    protocol_error: str | None = None,
    timeout: float,
    memory: int,
    gvisor: bool = False,
    self_deadline: str | None = None,
    infra_category: str | None = None,
    at_boundary: bool = False,
) -> tuple[ReplayStatus, Failure | None]:
    """Decide a record's status: interrupted, timeout, oom, infra_error, replay_failed or ok (first match).

    An OOM kill anywhere in the sandbox counts as ``oom`` even when pvisor survived it: a replayed
    tool that ran out of memory produced a different observation than the recording.
    """
    if interrupted:
        return "interrupted", Failure(category="interrupted", message="interrupted by the user (Ctrl-C or SIGTERM)")
    if outcome.timed_out:
        return "timeout", Failure(
            category="timeout", message=f"the sandbox ran past --timeout {format_duration(timeout)} and was killed"
        )
    if self_deadline is not None:  # the host did not end it in time (it was away): it ended itself
        return "timeout", Failure(category="timeout", message=f"killed at its own deadline: {self_deadline}")
    if outcome.oom_killed:
        return "oom", Failure(
            category="oom",
            message=f"the sandbox ran out of memory (--memory {format_size(memory)}); the kernel killed a process",
        )
    if infra_error and _NO_SPACE.search(infra_error):  # a write of ours found the host's disk full: never retried
        return "infra_error", Failure(category=DISK_FULL, message=f"the run directory's filesystem is full: "
                                      f"{infra_error}")  # fmt: skip
    if infra_error and infra_category == START_TIMEOUT:  # the runtime hung: a fresh sandbox is worth one more try
        return "infra_error", Failure(category=START_TIMEOUT, message=infra_error, retryable=True)
    if infra_error:
        return "infra_error", Failure(category="infra_error", message=infra_error)
    if result is None and at_boundary:  # checkpointed at the boundary: pvisor goes on in each fork
        return "ok", None
    if result is None:
        message = f"{protocol_error or 'pvisor printed no result'} (exit code {outcome.exit_code})"
        if gvisor:
            message += "; a gVisor sandbox stops like this when it reaches --pids (several host threads per process)"
        return "infra_error", Failure(category="infra_error", message=message)
    if result.failure is not None and _NO_SPACE.search(result.failure.message):
        # pvisor could not write into the run directory (the host's filesystem): not the replay's failure
        return "infra_error", Failure(category=DISK_FULL, message=f"the run directory's filesystem is full: "
                                      f"{result.failure.message}")  # fmt: skip
    if result.failure is not None and result.failure.message.endswith(_PROBE_BUDGET):
        # pvisor gives `<agent> --version` 5 s: a busy host, not another version (a fresh sandbox is worth a try)
        return "infra_error", Failure(
            category="infra_error",
            message=f"pvisor's version probe of the agent ran past its 5 s budget (a busy host): "
            f"{result.failure.message}",
            retryable=True,
        )
    if result.failure is not None:
        return "replay_failed", Failure(
            category=result.failure.category, message=result.failure.message, retryable=result.retryable
        )
    if outcome.exit_code != 0:
        return "infra_error", Failure(
            category="infra_error", message=f"pvisor exited {outcome.exit_code} although its result reports success"
        )
    return "ok", None


def build_record(
    state: AttemptState,
    staging: Staging,
    cspec: sandbox.ContainerSpec,
    info: ContainerInfo,
    ownership: Ownership,
) -> ReplayRecord:
    """The attempt's record (see :mod:`pvisor_host.models.record`)."""
    prepared = state.prepared
    status, failure = classify(
        state.outcome,
        state.result,
        interrupted=state.interrupted,
        infra_error=state.infra_error,
        protocol_error=state.protocol_error,
        timeout=prepared.spec.timeout,
        memory=prepared.spec.memory,
        gvisor=prepared.runtime.gvisor,
        self_deadline=state.self_deadline,
        infra_category=state.infra_category,
        at_boundary=state.at_boundary,
    )
    if failure is not None and RUN_MOUNT in failure.message:  # pvisor names its files where the sandbox saw them
        failure = failure.model_copy(
            update={"message": failure.message.replace(RUN_MOUNT, str(state.attempt.run_dir.absolute()))}
        )
    model = _model_info(state)
    drift = model.totals.drift if model is not None and model.totals is not None else None
    upstream = prepared.spec.continuation
    if drift is not None and status == "replay_failed" and upstream is not None and upstream.on_drift == "fail":
        status, failure = "replay_failed", _drift_failure(drift, failure)
    elif failure is not None and failure.category == "continuation_error" and model is not None:
        failure = _model_failure(state.attempt.run_dir / MODEL_JOURNAL, failure)
    info.exit_code = state.outcome.exit_code
    info.oom_killed = state.outcome.oom_killed
    info.timed_out = state.outcome.timed_out
    reports = state.collected.reports
    state.timings["total"] = round(sum(v for k, v in state.timings.items() if k != "total"), 4)
    artifacts = _artifacts(state)
    return ReplayRecord(
        pvisor_host_version=__version__,
        run_id=state.attempt.run_id,
        status=status,
        failure=failure,
        started_at=state.started_at,
        finished_at=datetime.now(UTC),
        timings=state.timings,
        inputs=_inputs(
            prepared, staging.trajectory_in_sandbox, staging.trajectory_filled, staging.staged_sha256
        ).model_copy(update={"environment": sandbox_environment(prepared, cspec, state.secret_names)}),
        image=prepared.image.model_copy(update={"env": {}}),  # its environment is the inputs', secrets masked
        limits=limits(prepared, cspec),
        container=info,
        result=state.result,
        artifacts=artifacts,
        workspace_changes=state.collected.changes,
        collect=prepared.spec.collect_mode,
        verification=state.verification,
        collection=Collection(
            truncated=any(r.truncated for r in reports.values()),
            bytes=sum(r.bytes for r in reports.values()),
            skipped=[s for r in reports.values() for s in r.skipped],
            logs_truncated=state.logs_truncated,
        ),
        model=model,
        egress=_egress(state, artifacts),
        attempt=state.attempt.number,
        host={"hostname": socket.gethostname(), "owner": ownership.owner},
        fork=state.fork,
    )


def _egress(state: AttemptState, artifacts: list[Artifact]) -> EgressInfo | None:
    """The run's egress journal, each connection given the replayed tool call it happened during where pvisor's
    events tell (one call running then, by the clock host and sandbox share)."""
    if not state.egress_journal:
        return None
    info = state.egress_journal[0]
    events = next((a.path for a in artifacts if a.role == "replay_events"), None)
    calls = tool_calls(state.attempt.run_dir / events) if events else []
    for event in info.events:
        during = [c for c in calls if c[0] <= event.at <= c[1]]
        if len(during) == 1:
            event.call, event.tool = during[0][2], during[0][3]
    return info


def tool_calls(path: Path) -> list[tuple[float, float, str, str | None]]:
    """The replayed tool calls in pvisor's ``replay-events.jsonl``: (started, finished, call id, tool), times in
    seconds since the epoch; a call that never finished lasts until the end."""
    started: dict[str, tuple[float, str | None]] = {}
    calls = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            event = json.loads(line).get("event") or {}
            data, at = event.get("data") or {}, float(event["observed_at_unix_ms"]) / 1000
            payload = data.get("payload") or {}
            call = str(payload["call_id"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if data.get("name") == "tool_started":
            started[call] = (at, payload.get("tool"))
        elif data.get("name") == "tool_finished" and call in started:
            begun, tool = started.pop(call)
            calls.append((begun, at, call, tool))
    calls += [(begun, float("inf"), call, tool) for call, (begun, tool) in started.items()]
    return calls


def _inputs(
    prepared: PreparedReplay, staging_path: str, filled: list[str] | None = None, staged_sha256: str | None = None
) -> Inputs:
    spec = prepared.spec
    return Inputs(
        **PvisorRequest.of(spec, prepared.profile.agent).model_dump(),
        workspace_dir=str(spec.workspace_dir.absolute()) if spec.workspace_dir else None,
        workspace_from_image=spec.image_workspace,
        workspace_path=prepared.workspace_path,
        collect_workspace=not spec.no_workspace,
        env_names=list(spec.env),
        trajectory=TrajectoryRef(
            path=str(prepared.trajectory.path),
            size=prepared.trajectory.size,
            sha256=prepared.trajectory.sha256,
            mounted_at=staging_path,
            filled=filled or [],
            staged_sha256=staged_sha256,
        ),
    )


def _artifacts(state: AttemptState) -> list[Artifact]:
    out = state.attempt.run_dir
    roles = _result_roles(state.result)
    artifacts: list[Artifact] = []
    for name in ("result.json", "logs/stdout.log", "logs/stderr.log", "logs/verify.log", PATCH_NAME, MODEL_JOURNAL,
                 MODEL_CASSETTE):  # fmt: skip
        path = out / name
        if path.is_file():
            size, digest = hash_file(path)
            artifacts.append(Artifact(path=name, size=size, sha256=digest))
    for tree, report in state.collected.reports.items():
        for entry in report.entries:
            if entry.kind == "file" and entry.sha256 is not None:
                relative = f"{tree}/{entry.path}"
                role, fmt = roles.get(relative, (None, None)) if tree == "output" else (None, None)
                if role is None and tree == "output":
                    role, fmt = _directory_role(roles, relative)
                artifacts.append(Artifact(path=relative, size=entry.size, sha256=entry.sha256, role=role, format=fmt))
    return artifacts


def _result_roles(result: ReplayResult | None) -> dict[str, tuple[str, str]]:
    if result is None or not result.output_dir:
        return {}
    prefix = result.output_dir.rstrip("/") + "/"
    return {
        "output/" + a.path[len(prefix) :]: (a.role, a.format) for a in result.artifacts if a.path.startswith(prefix)
    }


def _directory_role(roles: dict[str, tuple[str, str]], relative: str) -> tuple[str | None, str | None]:
    for path, (role, fmt) in roles.items():
        if relative.startswith(path.rstrip("/") + "/"):
            return role, fmt
    return None, None


def _model_info(state: AttemptState) -> ModelInfo | None:
    upstream = state.prepared.spec.continuation
    if upstream is None or not state.used_gateway:
        return None
    journal: Path = state.attempt.run_dir / MODEL_JOURNAL
    requests_seen = len(journal.read_text(encoding="utf-8").splitlines()) if journal.is_file() else 0
    replaying = upstream.cassette is not None and upstream.cassette.replaying
    return ModelInfo(
        upstream=None if replaying else upstream.base_url,
        model=upstream.model,
        network=upstream.network,
        api_key_env=upstream.api_key_env,
        journal=MODEL_JOURNAL if upstream.gateway else None,
        requests=requests_seen,
        totals=totals(journal, upstream.price) if upstream.gateway and journal.is_file() else None,
        cassette=upstream.cassette.mode if upstream.cassette is not None else None,
    )


#: What the gateway answered the agent, in pvisor's model categories (all retryable).
_MODEL_CATEGORIES = {429: "model_rate_limit", 529: "model_rate_limit", 502: "model_connection_error",
                     504: "model_connection_error"}  # fmt: skip


def _model_failure(journal: Path, failure: Failure) -> Failure:
    """pvisor names a model failure from the agent's output; an agent that words it otherwise (Codex, on 5xx)
    ends as ``continuation_error``. When the run's last model call was answered with an error the upstream gave
    beyond the gateway's retry budget, that is the failure: a model category, retryable."""
    try:
        last = json.loads(journal.read_text(encoding="utf-8").splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return failure
    status = int(last.get("status", 0))
    if status < 429 or status in (501, 505) or last.get("drift"):
        return failure
    category = _MODEL_CATEGORIES.get(status, "model_internal_error" if status >= 500 else None)
    if category is None:
        return failure
    retries = len(last.get("retries") or [])
    return Failure(
        category=category,
        message=f"{failure.message}; its last model call was answered {status} after {retries} retries "
        "(the gateway's retry budget was spent)",
        retryable=True,
    )


def _drift_failure(drift: ModelDrift, failure: Failure | None) -> Failure:
    """A continuation served from a cassette that failed after its requests drifted from the recording: the
    drift is the failure (the agent got an error, or answers to other questions)."""
    where = drift.field + (f" message {drift.message}" if drift.message is not None else "")
    cause = f" ({failure.category}: {failure.message[:200]})" if failure is not None else ""
    return Failure(
        category="model_drift", message=f"the request of model call {drift.call} differs from the cassette at "
        f"{where}{cause}", retryable=False,
    )  # fmt: skip
