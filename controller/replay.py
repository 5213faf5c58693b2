"""Run stage: one prepared replay in one hardened container, from staging to ``record.json``.

:func:`execute` stages the run directory, runs ``pvisor replay`` in a container created by
:func:`~pvisor_host.container.sandbox_container` (removed on every path), waits with the timeout,
collects logs, pvisor's output and state trees and the final workspace through the engine's archive
API, classifies the outcome and writes ``result.json`` and ``record.json`` atomically.
"""

from __future__ import annotations

import os
import socket
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
from . import usage
from ._version import __version__
from .collect import Budget, Entry, ExtractReport, diff_trees, extract_tar, hash_file, tar_stream
from .errors import InfrastructureError, Interrupted, UsageError
from .inject import RUNTIME_MOUNT
from .preflight import PreparedReplay, release_out_dir, staging_root
from .record import (
    Artifact,
    Collection,
    ContainerInfo,
    Failure,
    Inputs,
    Limits,
    ReplayRecord,
    ReplayStatus,
    TrajectoryRef,
    save_record,
    write_atomic,
)
from .result import ReplayResult, parse_result
from .seed import seed_from_image
from .signals import deferred_interrupts
from .stage import INPUT_MOUNT, RUN_MOUNT, Staging, remove_staging, stage
from .units import format_duration, format_size

_MODE_FLAGS = {"continue": [], "replay-only": ["--replay-only"], "prepare-only": ["--prepare-only"]}


def pvisor_command(prepared: PreparedReplay, trajectory_in_sandbox: str) -> list[str]:
    """The ``pvisor replay`` command line run inside the sandbox (behind the entry shim)."""
    spec = prepared.spec
    command = [
        "/bin/sh",
        f"{INPUT_MOUNT}/entry.sh",
        prepared.image.pvisor_path,
        "replay",
        "--agent",
        prepared.profile.agent,
        "--trajectory",
        trajectory_in_sandbox,
        "--after-step",
        str(spec.after_step),
        *_MODE_FLAGS[spec.mode],
        "--workspace",
        prepared.workspace_path,
        "--state-dir",
        f"{RUN_MOUNT}/state",
        "--output-dir",
        f"{RUN_MOUNT}/output",
        "--run-id",
        prepared.run_id,
    ]
    if prepared.image.runtime_root and spec.mode != "prepare-only":
        command += ["--agent-runtime", prepared.image.runtime_root]
    elif spec.mode != "prepare-only":
        command += ["--agent-entrypoint", prepared.image.agent_entrypoint]
    if spec.max_steps is not None:
        command += ["--max-steps", str(spec.max_steps)]
    if spec.session_id:
        command += ["--session-id", spec.session_id]
    if spec.boundary_user_prompt:
        command += ["--boundary-user-prompt", spec.boundary_user_prompt]
    if spec.disable_thinking:
        command.append("--disable-thinking")
    if spec.allow_stale_observations:
        command.append("--allow-stale-observations")
    return command


def container_spec(prepared: PreparedReplay, staging: Staging) -> sandbox.ContainerSpec:
    """The hardened container for ``prepared`` (every relaxation comes from an explicit flag)."""
    spec = prepared.spec
    return sandbox.ContainerSpec(
        image=prepared.image.id,
        command=pvisor_command(prepared, staging.trajectory_in_sandbox),
        name=f"pvisor-host-{prepared.run_id}",
        labels=L.resource_labels("replay", prepared.run_id),
        user=prepared.user,
        working_dir=prepared.workspace_path,
        environment={**prepared.profile.sandbox_env, "HOME": "/tmp", "TMPDIR": "/tmp"},
        mounts=[
            sandbox.BindMount(source=staging.input_dir, target=INPUT_MOUNT, read_only=True),
            sandbox.BindMount(source=staging.workspace_dir, target=prepared.workspace_path),
            sandbox.BindMount(source=staging.run_dir, target=RUN_MOUNT),
            *_runtime_mount(prepared),
        ],
        network=spec.network,
        read_only_rootfs=not spec.writable_rootfs,
        tmpfs_size=spec.tmp_size,
        cap_add=spec.cap_add,
        no_new_privileges=not spec.allow_privilege_escalation,
        memory=spec.memory,
        cpus=spec.cpus,
        pids=spec.pids,
    )


def _runtime_mount(prepared: PreparedReplay) -> list[sandbox.VolumeMount]:
    volume = prepared.image.runtime_volume
    return [sandbox.VolumeMount(volume=volume, target=RUNTIME_MOUNT, read_only=True)] if volume else []


def _limits(prepared: PreparedReplay, cspec: sandbox.ContainerSpec) -> Limits:
    spec = prepared.spec
    return Limits(
        user=cspec.user,
        network=cspec.network,
        read_only_rootfs=cspec.read_only_rootfs,
        cap_drop=["ALL"],
        cap_add=cspec.cap_add,
        no_new_privileges=cspec.no_new_privileges,
        memory=cspec.memory,
        cpus=cspec.cpus,
        pids=cspec.pids,
        tmp_size=cspec.tmpfs_size,
        timeout=spec.timeout,
        collect_limit=spec.collect_limit,
    )


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
    """Mutable state of one execution, turned into a :class:`ReplayRecord` at the end."""

    def __init__(self, prepared: PreparedReplay) -> None:
        self.prepared = prepared
        self.timings = dict(prepared.timings)
        self.started_at = datetime.now(UTC)
        self.outcome = sandbox.WaitOutcome(exit_code=None)
        self.result: ReplayResult | None = None
        self.protocol_error: str | None = None
        self.reports: dict[str, ExtractReport] = {}
        self.logs_truncated = False
        self.interrupted = False
        self.infra_error: str | None = None

    def phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.timings[name] = round(now - since, 4)
        return now


def execute(prepared: PreparedReplay, client: docker.DockerClient) -> ReplayRecord:
    """Run the prepared replay and return its record (also written to ``<out>/record.json``).

    A replay that ran always yields a record, whatever its status. Ctrl-C removes the container,
    writes a record with status ``interrupted`` and raises :class:`Interrupted`.
    """
    run = _Run(prepared)
    out = prepared.out_dir
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
            env={name: os.environ[name] for name in prepared.spec.env},
            workspace_seed=_image_seed(client, prepared),
        )
        clock = run.phase("stage", clock)
        cspec = container_spec(prepared, staging)
        info = ContainerInfo(name=cspec.name, command=cspec.command)
        _run_container(client, run, cspec, info, staging, clock)
    except KeyboardInterrupt:
        run.interrupted = True
    except InfrastructureError as exc:
        run.infra_error = exc.one_line()
    except UsageError:
        if staging is None:  # the staging itself was refused (e.g. --image-workspace): nothing ran
            remove_staging(staging_root(out))
            release_out_dir(out)
        raise
    finally:
        if staging is not None:
            with deferred_interrupts():
                remove_staging(staging.root)
    if staging is None or cspec is None or info is None:
        release_out_dir(out)
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
    out = run.prepared.out_dir
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
        run.outcome = sandbox.wait(box, spec.timeout)
        clock = run.phase("run", clock)
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
    write_atomic(run.prepared.out_dir / "result.json", raw + b"\n")


def _collect(box: Container, run: _Run, staging: Staging) -> None:
    prepared = run.prepared
    budget = Budget(prepared.spec.collect_limit)
    trees = {
        "output": f"{RUN_MOUNT}/output/{prepared.run_id}",
        "state": f"{RUN_MOUNT}/state/{prepared.run_id}",
    }
    if not prepared.spec.no_workspace:
        trees["workspace"] = prepared.workspace_path
    for name, path in trees.items():
        dest = prepared.out_dir / name
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
    out = run.prepared.out_dir
    roles = _result_roles(run)
    artifacts: list[Artifact] = []
    for name in ("result.json", "logs/stdout.log", "logs/stderr.log"):
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
        run_id=prepared.run_id,
        status=status,
        failure=failure,
        started_at=run.started_at,
        finished_at=finished,
        timings=run.timings,
        inputs=_inputs(prepared, staging.trajectory_in_sandbox),
        image=prepared.image,
        limits=_limits(prepared, cspec),
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
        host={"hostname": socket.gethostname(), "owner": L.owner()},
    )
