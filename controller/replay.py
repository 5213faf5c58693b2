"""Run stage: one prepared replay in one hardened container, from staging to ``record.json``.

:func:`execute` stages the run directory, runs ``pvisor replay`` in a container created by
:func:`~pvisor_host.container.sandbox_container` (removed on every path), waits with the timeout,
collects logs, pvisor's output and state trees and the final workspace through the engine's archive
API, classifies the outcome and writes ``result.json`` and ``record.json`` atomically.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import docker
import requests
from docker.errors import APIError, NotFound
from docker.models.containers import Container
from loguru import logger

from . import container as sandbox
from . import labels as L
from . import launch, usage
from ._version import __version__
from .collect import Budget, Entry, ExtractReport, diff_trees, extract_tar, hash_file, tar_stream
from .errors import InfrastructureError, Interrupted, UsageError
from .launch import Attempt
from .preflight import PreparedReplay, staging_root
from .record import (
    Artifact,
    Collection,
    ContainerInfo,
    Failure,
    Inputs,
    ModelInfo,
    ReplayRecord,
    ReplayStatus,
    TrajectoryRef,
    save_record,
    write_atomic,
)
from .result import ReplayResult, parse_result
from .seed import seed_from_image
from .signals import deferred_interrupts
from .stage import RUN_MOUNT, Staging, remove_staging, stage
from .units import format_duration, format_size


def _inputs(prepared: PreparedReplay, staging_path: str) -> Inputs:
    spec = prepared.spec
    return Inputs(
        agent=prepared.profile.agent,
        after_step=spec.after_step,
        mode=spec.mode,
        max_steps=spec.max_steps,
        boundary_user_prompt=spec.boundary_user_prompt,
        disable_thinking=spec.disable_thinking,
        allow_stale_observations=spec.allow_stale_observations,
        session_id=spec.session_id,
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
        ),
    )


def _image_seed(client: docker.DockerClient, prepared: PreparedReplay) -> Callable[[Path], list[Entry]] | None:
    if not prepared.spec.image_workspace:
        return None
    budget = Budget(prepared.spec.collect_limit)
    return lambda dest: seed_from_image(client, prepared.image.id, prepared.workspace_path, dest, budget)


class _Run:
    """Mutable state of one attempt, turned into a :class:`ReplayRecord` at the end."""

    def __init__(self, prepared: PreparedReplay, attempt: Attempt) -> None:
        self.prepared = prepared
        self.attempt = attempt
        self.dir: Path = attempt.run_dir
        self.timings = dict(prepared.timings) if attempt.number == 1 else {}
        self.started_at = datetime.now(UTC)
        self.outcome = sandbox.WaitOutcome(exit_code=None)
        self.result: ReplayResult | None = None
        self.protocol_error: str | None = None
        self.reports: dict[str, ExtractReport] = {}
        self.logs_truncated = False
        self.interrupted = False
        self.infra_error: str | None = None
        self.cancel: threading.Event | None = None

    def phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.timings[name] = round(now - since, 4)
        return now


def run_attempt(
    prepared: PreparedReplay, client: docker.DockerClient, attempt: Attempt, *, cancel: threading.Event | None = None
) -> ReplayRecord:
    """Run one attempt in a fresh sandbox and return its record (also written to its ``record.json``).

    An attempt that ran always yields a record, whatever its status. Ctrl-C removes the container,
    writes a record with status ``interrupted`` and raises :class:`Interrupted`.
    """
    run = _Run(prepared, attempt)
    run.cancel = cancel
    out = attempt.run_dir
    out.mkdir(parents=True, exist_ok=True)
    clock = time.monotonic()
    staging: Staging | None = None
    cspec: sandbox.ContainerSpec | None = None
    info: ContainerInfo | None = None
    try:
        staging = stage(
            staging_root(out),
            trajectory=prepared.trajectory.path,
            trajectory_sha256=prepared.trajectory.sha256,
            workspace_source=prepared.spec.workspace_dir,
            user=prepared.user,
            env=launch.secret_env(prepared, attempt, {name: os.environ[name] for name in prepared.spec.env}),
            workspace_seed=_image_seed(client, prepared),
        )
        clock = run.phase("stage", clock)
        cspec = launch.container_spec(prepared, attempt, staging)
        info = ContainerInfo(name=cspec.name, command=cspec.command)
        _run_container(client, run, cspec, info, staging, clock)
    except KeyboardInterrupt:
        run.interrupted = True
    except InfrastructureError as exc:
        run.infra_error = exc.one_line()
    except UsageError:
        if staging is None:  # the staging itself was refused (e.g. --image-workspace): nothing ran
            remove_staging(staging_root(out))
        raise
    finally:
        if staging is not None:
            with deferred_interrupts():
                remove_staging(staging.root)
    if staging is None or cspec is None or info is None:
        raise Interrupted("interrupted before the sandbox started; nothing ran")
    record = _record(run, staging, cspec, info)
    save_record(record, out)
    if run.interrupted:
        raise Interrupted("interrupted; the container was removed and record.json says status interrupted")
    return record


def _run_container(
    client: docker.DockerClient,
    run: _Run,
    cspec: sandbox.ContainerSpec,
    info: ContainerInfo,
    staging: Staging,
    clock: float,
) -> None:
    spec = run.prepared.spec
    out = run.dir
    with sandbox.sandbox_container(client, cspec) as box:
        info.id = box.id
        built = run.prepared.built
        usage.record_use(run.prepared.image.id, run.prepared.image.runtime_volume, built.id if built else None)
        clock = run.phase("create", clock)
        sandbox.start(box)
        logger.info(
            "running {} {} (after step {}) in container {} [{}]",
            run.prepared.profile.agent,
            spec.mode,
            spec.after_step,
            box.short_id,
            cspec.name,
        )
        if run.cancel is not None and run.cancel.is_set():
            raise KeyboardInterrupt  # the batch was cancelled while this sandbox started
        run.outcome = sandbox.wait(box, spec.timeout)
        clock = run.phase("run", clock)
        if run.cancel is not None and run.cancel.is_set():
            raise KeyboardInterrupt  # the batch killed this sandbox: record it as interrupted, collect nothing
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        run.logs_truncated = sandbox.save_logs(box, stdout=True, dest=logs / "stdout.log")
        run.logs_truncated |= sandbox.save_logs(box, stdout=False, dest=logs / "stderr.log")
        _parse(run, logs / "stdout.log")
        _collect(box, run, staging)
        run.phase("collect", clock)


def _parse(run: _Run, stdout: Path) -> None:
    try:
        raw, run.result = parse_result(stdout.read_bytes())
    except Exception as exc:  # ResultProtocolError, or an unreadable log
        run.protocol_error = str(exc)
        return
    write_atomic(run.dir / "result.json", raw + b"\n")


def _collect(box: Container, run: _Run, staging: Staging) -> None:
    prepared = run.prepared
    budget = Budget(prepared.spec.collect_limit)
    trees = {
        "output": f"{RUN_MOUNT}/output/{run.attempt.run_id}",
        "state": f"{RUN_MOUNT}/state/{run.attempt.run_id}",
    }
    if not prepared.spec.no_workspace:
        trees["workspace"] = prepared.workspace_path
    for name, path in trees.items():
        dest = run.dir / name
        try:
            chunks, _ = box.get_archive(path)
        except NotFound:
            continue  # pvisor failed before creating it
        except (APIError, requests.exceptions.RequestException) as exc:
            run.infra_error = f"could not collect {path} from the sandbox: {exc}"
            continue
        run.reports[name] = extract_tar(tar_stream(chunks), dest, budget)
    if budget.exhausted:
        logger.warning(
            "the collect limit ({}) was reached; record.json lists what was not collected",
            format_size(prepared.spec.collect_limit),
        )


def classify(
    outcome: sandbox.WaitOutcome,
    result: ReplayResult | None,
    *,
    interrupted: bool = False,
    infra_error: str | None = None,
    protocol_error: str | None = None,
    timeout: float,
    memory: int,
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
    if outcome.oom_killed:
        return "oom", Failure(
            category="oom",
            message=f"the sandbox ran out of memory (--memory {format_size(memory)}); the kernel killed a process",
        )
    if infra_error:
        return "infra_error", Failure(category="infra_error", message=infra_error)
    if result is None:
        message = protocol_error or "pvisor printed no result"
        return "infra_error", Failure(category="infra_error", message=f"{message} (exit code {outcome.exit_code})")
    if result.failure is not None:
        return "replay_failed", Failure(
            category=result.failure.category, message=result.failure.message, retryable=result.retryable
        )
    if outcome.exit_code != 0:
        return "infra_error", Failure(
            category="infra_error", message=f"pvisor exited {outcome.exit_code} although its result reports success"
        )
    return "ok", None


def _artifacts(run: _Run) -> list[Artifact]:
    out = run.dir
    roles = _result_roles(run)
    artifacts: list[Artifact] = []
    for name in ("result.json", "logs/stdout.log", "logs/stderr.log", MODEL_JOURNAL):
        path = out / name
        if path.is_file():
            size, digest = hash_file(path)
            artifacts.append(Artifact(path=name, size=size, sha256=digest))
    for tree, report in run.reports.items():
        for entry in report.entries:
            if entry.kind == "file" and entry.sha256 is not None:
                relative = f"{tree}/{entry.path}"
                role, fmt = roles.get(relative, (None, None)) if tree == "output" else (None, None)
                if role is None and tree == "output":
                    role, fmt = _directory_role(roles, relative)
                artifacts.append(Artifact(path=relative, size=entry.size, sha256=entry.sha256, role=role, format=fmt))
    return artifacts


def _result_roles(run: _Run) -> dict[str, tuple[str, str]]:
    if run.result is None or not run.result.output_dir:
        return {}
    prefix = run.result.output_dir.rstrip("/") + "/"
    return {
        "output/" + a.path[len(prefix) :]: (a.role, a.format) for a in run.result.artifacts if a.path.startswith(prefix)
    }


def _directory_role(roles: dict[str, tuple[str, str]], relative: str) -> tuple[str | None, str | None]:
    for path, (role, fmt) in roles.items():
        if relative.startswith(path.rstrip("/") + "/"):
            return role, fmt
    return None, None


def _record(run: _Run, staging: Staging, cspec: sandbox.ContainerSpec, info: ContainerInfo) -> ReplayRecord:
    prepared = run.prepared
    status, failure = classify(
        run.outcome,
        run.result,
        interrupted=run.interrupted,
        infra_error=run.infra_error,
        protocol_error=run.protocol_error,
        timeout=prepared.spec.timeout,
        memory=prepared.spec.memory,
    )
    info.exit_code = run.outcome.exit_code
    info.oom_killed = run.outcome.oom_killed
    info.timed_out = run.outcome.timed_out
    workspace = run.reports.get("workspace")
    changes = None
    if workspace is not None:
        changes = diff_trees(staging.workspace_before, workspace.entries, complete=not workspace.truncated)
    reports = list(run.reports.values())
    finished = datetime.now(UTC)
    run.timings["total"] = round(sum(v for k, v in run.timings.items() if k != "total"), 4)
    return ReplayRecord(
        pvisor_host_version=__version__,
        run_id=run.attempt.run_id,
        status=status,
        failure=failure,
        started_at=run.started_at,
        finished_at=finished,
        timings=run.timings,
        inputs=_inputs(prepared, staging.trajectory_in_sandbox),
        image=prepared.image,
        limits=launch.limits(prepared, cspec),
        container=info,
        result=run.result,
        artifacts=_artifacts(run),
        workspace_changes=changes,
        collection=Collection(
            truncated=any(r.truncated for r in reports),
            bytes=sum(r.bytes for r in reports),
            skipped=[s for r in reports for s in r.skipped],
            logs_truncated=run.logs_truncated,
        ),
        model=_model_info(run),
        attempt=run.attempt.number,
        host={"hostname": socket.gethostname(), "owner": L.owner()},
    )


MODEL_JOURNAL = "model-traffic.jsonl"


def _model_info(run: _Run) -> ModelInfo | None:
    spec = run.prepared.spec
    if not spec.uses_gateway or run.attempt.model is None:
        return None
    assert spec.model_base_url is not None
    assert spec.model is not None
    assert spec.model_api_key_env is not None
    journal = run.dir / MODEL_JOURNAL
    requests_seen = len(journal.read_text(encoding="utf-8").splitlines()) if journal.is_file() else 0
    return ModelInfo(
        upstream=spec.model_base_url,
        model=spec.model,
        network=spec.model_network,
        api_key_env=spec.model_api_key_env,
        journal=MODEL_JOURNAL if spec.model_network != "pass-through" else None,
        requests=requests_seen,
    )
