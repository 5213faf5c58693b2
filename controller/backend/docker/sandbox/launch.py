"""What a replay sandbox runs and gets: the ``pvisor replay`` command line, the hardened container spec,
its mounts, its environment (secret values only through env.sh) and the limits recorded for it."""

from __future__ import annotations

from urllib.parse import urlsplit

from ....models.ownership import Ownership
from ....models.record import Limits, PvisorRequest, recorded_environment
from ....models.replay import Attempt, PreparedReplay, SandboxPlan
from .. import container as sandbox
from .. import labels as L
from ..egress import EGRESS_MOUNT, EgressAccess
from ..gateway import SOCKET_MOUNT, ModelAccess
from ..image.inject import RUNTIME_MOUNT
from ..image.recipe import RELAY_PATH
from .stage import INPUT_MOUNT, LOGS_MOUNT, RUN_MOUNT, VERIFIER_MOUNT, Staging

GVISOR_PIDS = (
    "pids: under gVisor the limit counts the sandbox's host threads (several per process inside it), "
    "and reaching it stops the whole sandbox instead of failing a fork"
)
#: What a strict sandbox's environment says (a task image keeps its own).
STRICT_ENV = {"HOME": "/tmp", "TMPDIR": "/tmp"}
#: What every sandbox's environment pins unless its image or ``--env`` sets it, so that the repeats of a replay
#: behave alike: a Python tool's set and dict order, the time zone, the locale (docs/security.md).
PINNED_ENV = {"PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8"}
#: Seconds past its host-side deadline (``--timeout``, ``--verify-timeout``) after which a sandbox ends itself, the
#: host there to end it or not (entry.sh's ``bounded``): the host, when it is there, ends it first.
SELF_GRACE = 30
#: Seconds a verifying sandbox waits for the host's go-ahead after pvisor has ended (the host collects first).
GO_AHEAD_WAIT = 300


def pvisor_command(
    prepared: PreparedReplay, attempt: Attempt, trajectory_in_sandbox: str, gate: str | None = None
) -> list[str]:
    """The ``pvisor replay`` command line run inside the sandbox (behind the entry shim); with ``gate`` (``--fork``),
    pvisor launches the agent through it (:mod:`.gate`)."""
    request = PvisorRequest.of(prepared.spec, prepared.profile.agent)
    image = prepared.image
    if gate is not None:
        agent_flags = ["--agent-entrypoint", gate]
    elif image.runtime_root:
        agent_flags = ["--agent-runtime", image.runtime_root]
    else:
        agent_flags = ["--agent-entrypoint", image.agent_entrypoint]
    argv = request.argv(
        trajectory=trajectory_in_sandbox, workspace=prepared.workspace_path, state_dir=f"{RUN_MOUNT}/state",
        output_dir=f"{RUN_MOUNT}/output", run_id=attempt.pvisor_id, agent_flags=agent_flags,
    )  # fmt: skip
    return ["/bin/sh", f"{INPUT_MOUNT}/entry.sh", image.pvisor_path, *argv]


def secret_env(prepared: PreparedReplay, model: ModelAccess | None, host_env: dict[str, str]) -> dict[str, str]:
    """Variables handed over through env.sh (never in the container config): ``--env`` values and the model's."""
    env = dict(host_env)
    if model is not None:
        env |= prepared.profile.continuation.sandbox_model_env(
            base_url=model.base_url, api_key=model.api_key, model=model.model
        )
    return env


def sandbox_environment(
    prepared: PreparedReplay, cspec: sandbox.ContainerSpec, secret_names: list[str]
) -> dict[str, str | None]:
    """The environment a sandbox ran with, for its record: its image's, then its container's, then the names of
    the values handed over through env.sh (``--env``, the model's key); no secret's value
    (:func:`~pvisor_host.models.record.recorded_environment`)."""
    return recorded_environment({**prepared.image.env, **cspec.environment}, secret_names)


def model_hosts(model: ModelAccess | None) -> list[str]:
    """The host of the model gateway a sandbox calls, which its tools reach directly (not through the egress
    proxy): none besides loopback but on an internal model network."""
    if model is None:
        return []
    host = urlsplit(model.base_url).hostname
    return [host] if host else []


def container_spec(
    prepared: PreparedReplay,
    attempt: Attempt,
    staging: Staging,
    *,
    ownership: Ownership,
    model: ModelAccess | None = None,
    egress: EgressAccess | None = None,
) -> sandbox.ContainerSpec:
    """The hardened container for one attempt (every relaxation comes from an explicit flag)."""
    spec = prepared.spec
    task = prepared.sandbox == "task-image"
    # A task image keeps its own HOME, TMPDIR and working directory (docs/security.md); strict gives /tmp.
    environment = {k: v for k, v in PINNED_ENV.items() if k not in spec.env and k not in prepared.image.env}
    environment |= prepared.profile.sandbox_env if task else {**prepared.profile.sandbox_env, **STRICT_ENV}
    if spec.mode == "replay-only":
        environment |= {k: v for k, v in prepared.profile.replay_only_env.items() if k not in spec.env}
    mounts: list[sandbox.BindMount | sandbox.VolumeMount] = [
        sandbox.BindMount(source=staging.input_dir, target=INPUT_MOUNT, read_only=True),
        sandbox.BindMount(source=staging.workspace_dir, target=prepared.workspace_path),
        sandbox.BindMount(source=staging.run_dir, target=RUN_MOUNT),
        sandbox.BindMount(source=staging.logs_dir, target=LOGS_MOUNT),
    ]
    if prepared.image.runtime_volume:
        mounts.append(sandbox.VolumeMount(volume=prepared.image.runtime_volume, target=RUNTIME_MOUNT))
    environment["PVISOR_HOST_DEADLINE"] = str(int(spec.timeout) + SELF_GRACE)
    if staging.verifier_dir is not None:
        mounts.append(sandbox.BindMount(source=staging.verifier_dir, target=VERIFIER_MOUNT))
        environment["PVISOR_HOST_WORKSPACE"] = prepared.workspace_path
        environment["PVISOR_HOST_VERIFY_DEADLINE"] = str(int(spec.verify_timeout) + SELF_GRACE)
        environment["PVISOR_HOST_GO_AHEAD"] = str(GO_AHEAD_WAIT * 10)
    network: str = spec.network
    relay_bin = f"{RUNTIME_MOUNT}/relay" if prepared.image.runtime_volume else RELAY_PATH
    if model is not None:
        network = model.network
        environment |= model.container_env
        if model.container_env:
            environment["PVISOR_HOST_RELAY_BIN"] = relay_bin
        if model.socket_dir is not None:
            mounts.append(sandbox.BindMount(source=model.socket_dir, target=SOCKET_MOUNT, read_only=True))
    if egress is not None:  # the sandbox keeps no network: the relay carries its tools' proxy connections
        environment |= egress.container_env
        environment["PVISOR_HOST_RELAY_BIN"] = relay_bin
        mounts.append(sandbox.BindMount(source=egress.socket_dir, target=EGRESS_MOUNT, read_only=True))
    return sandbox.ContainerSpec(
        image=prepared.image.id,
        command=pvisor_command(prepared, attempt, staging.trajectory_in_sandbox, staging.gate),
        name=f"pvisor-host-{attempt.run_id}",
        labels=L.resource_labels(ownership, "replay", attempt.run_id),
        user=prepared.user,
        working_dir=None if task else prepared.workspace_path,
        environment=environment,
        mounts=mounts,
        network=network,
        read_only_rootfs=not (task or spec.writable_rootfs),
        tmpfs_size=spec.tmp_size,
        cap_add=spec.cap_add,
        no_new_privileges=not spec.allow_privilege_escalation,
        memory=spec.memory,
        cpus=spec.cpus,
        pids=spec.pids,
        runtime=prepared.runtime.name,
        engine_logs=False,
    )


def limits(prepared: PreparedReplay, cspec: sandbox.ContainerSpec) -> Limits:
    """The hardening and limits the container really got, for the record."""
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
        timeout=prepared.spec.timeout,
        collect_limit=prepared.spec.collect_limit,
        runtime=cspec.runtime or "runc",
        runtime_version=prepared.runtime.version,
        egress=str(prepared.spec.egress) if prepared.spec.egress is not None else None,
        profile=prepared.sandbox,
        notes=[GVISOR_PIDS] if prepared.runtime.gvisor else [],
    )


def describe(prepared: PreparedReplay, cspec: sandbox.ContainerSpec) -> SandboxPlan:
    """The sandbox ``cspec`` would be, as ``batch --plan`` shows it."""
    mounts = [
        f"{m.source if isinstance(m, sandbox.BindMount) else m.volume}:{m.target}:{'ro' if m.read_only else 'rw'}"
        for m in cspec.mounts
    ]
    return SandboxPlan(mounts=mounts, limits=limits(prepared, cspec), command=cspec.command)
