"""Container lifecycle: create → start → wait (bounded) → remove, the last on every path.

:class:`ContainerSpec` is the only place security settings become docker-py arguments
(:meth:`ContainerSpec.create_kwargs`, for docker-py's low-level ``create_container``: the high-level
``containers.create`` inspects every container it creates, a round trip a batch pays per item for nothing).
:func:`sandbox_container` is the only way pvisor-host holds a container: it removes it when the block ends,
whatever ended it (error, timeout, Ctrl-C), with further interrupts deferred until the removal is done.

A replay sandbox writes its output to files the host reads afterwards (:mod:`.collect`) and the engine keeps
none of it (``engine_logs=False``); the short-lived helpers (probes) leave theirs to the engine's logs.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import requests
from docker.api import APIClient
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import LogConfig, Mount
from pydantic import BaseModel, ConfigDict

from ..._log import logger
from ...errors import InfrastructureError, UsageError
from ...models.ownership import Ownership
from ...models.record import START_TIMEOUT
from ...models.spec import default_user
from ...signals import cleaning, deferred_interrupts
from ...units import format_duration
from . import labels as L
from .engine import ENGINE_ERRORS, describe, engine_errors, request_within, retrying, timed_out


class Leftovers:
    """Containers the engine could not remove (it was away, or stuck on them), to be removed once it can."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self.stuck: set[str] = set()
        """Those whose start hung: the engine may stay stuck on them for long, so nobody waits for them."""

    def add(self, container_id: str, *, stuck: bool = False) -> None:
        with self._lock:
            self._ids.add(container_id)
            if stuck:
                self.stuck.add(container_id)

    def take(self, *, stuck: bool = True) -> set[str]:
        """Every id noted so far (the caller removes them, or adds back those it could not); without ``stuck``,
        not those whose start hung (they stay noted: trying them costs a wait each, for the batch's end)."""
        with self._lock:
            ids = self._ids if stuck else self._ids - self.stuck
            self._ids = self._ids - ids
        return ids


_WAIT_SLICE = 30.0
#: How often ``wait(until=...)`` looks: first at once, then backing off to every 2 s.
_FIRST_POLL = 0.2
_LAST_POLL = 2.0


class BindMount(BaseModel):
    """A host directory bound into the container."""

    model_config = ConfigDict(frozen=True)

    source: Path
    target: str
    read_only: bool = False

    def mount(self) -> Mount:
        """The docker-py mount."""
        return Mount(self.target, str(self.source), type="bind", read_only=self.read_only)


class VolumeMount(BaseModel):
    """A named Docker volume mounted into the container."""

    model_config = ConfigDict(frozen=True)

    volume: str
    target: str
    read_only: bool = True

    def mount(self) -> Mount:
        """The docker-py mount."""
        return Mount(self.target, self.volume, type="volume", read_only=self.read_only)


class ContainerSpec(BaseModel):
    """Everything the engine needs to create one sandbox container, hardened by default."""

    model_config = ConfigDict(frozen=True)

    image: str
    command: list[str]
    name: str
    labels: dict[str, str]
    user: str
    """``uid:gid`` (non-root unless the caller relaxed it)."""
    working_dir: str | None = None
    environment: dict[str, str] = {}
    """Non-secret variables only: this mapping is visible in ``docker inspect``."""
    mounts: list[BindMount | VolumeMount] = []
    network: str = "none"
    read_only_rootfs: bool = True
    tmpfs_size: int = 1024**3
    cap_add: list[str] = []
    no_new_privileges: bool = True
    memory: int = 4 * 1024**3
    cpus: float = 2.0
    pids: int = 1024
    runtime: str | None = None
    """The engine's runtime to run it with (None: the engine's default)."""
    engine_logs: bool = True
    """Whether the engine keeps the container's output (False: it writes its own, see the module docstring)."""

    def create_kwargs(self, api: APIClient) -> dict[str, object]:
        """docker-py's ``create_container`` arguments (the single translation point)."""
        security = ["no-new-privileges"] if self.no_new_privileges else []
        host_config = api.create_host_config(
            mounts=[m.mount() for m in self.mounts],
            network_mode=self.network,
            read_only=self.read_only_rootfs,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={self.tmpfs_size},mode=1777"},
            cap_drop=["ALL"],
            cap_add=self.cap_add or None,
            security_opt=security,
            mem_limit=self.memory,
            memswap_limit=self.memory,
            nano_cpus=int(self.cpus * 1e9),
            pids_limit=self.pids,
            init=True,
            runtime=self.runtime,
            log_config=None if self.engine_logs else LogConfig(type=LogConfig.types.NONE),
        )
        return {
            "image": self.image,
            "command": self.command,
            "name": self.name,
            "labels": self.labels,
            "user": self.user,
            "working_dir": self.working_dir,
            "environment": self.environment,
            "detach": True,
            "stdin_open": False,
            "tty": False,
            "host_config": host_config,
        }


class WaitOutcome(BaseModel):
    """How the container's main process ended (or that it runs on: :func:`wait` with ``until``)."""

    exit_code: int | None
    timed_out: bool = False
    oom_killed: bool = False
    running: bool = False
    """``until`` came true while the container ran on."""


@retrying()
def _create(client: docker.DockerClient, spec: ContainerSpec) -> Container:
    try:
        created = client.api.create_container(**spec.create_kwargs(client.api))
        return client.containers.prepare_model({"Id": created["Id"]})
    except APIError as exc:
        if exc.status_code == 409:
            # A retried create whose first attempt reached the engine: adopt the container it made.
            existing = _find_own(client, spec)
            if existing is not None:
                return existing
            raise UsageError(f"a container named {spec.name} already exists", hint="use another --run-id") from exc
        raise


def _find_own(client: docker.DockerClient, spec: ContainerSpec) -> Container | None:
    try:
        found = client.containers.get(spec.name)
    except NotFound:
        return None
    own = found.labels.get(L.SESSION) == spec.labels.get(L.SESSION) and found.labels.get(L.RUN) == spec.labels.get(
        L.RUN
    )
    return found if own else None


#: Seconds one removal of a sandbox may take: an engine stuck on it (a runtime that hangs) does not hold the
#: batch, or a Ctrl-C, any longer; what it could not remove is removed later (``Leftovers``, ``gc``).
REMOVE_TIMEOUT = 30.0
#: The same for a sandbox whose start hung: the engine is stuck on it; a later try (``Leftovers``) removes it.
HUNG_REMOVE_TIMEOUT = 3.0


@retrying()
def remove_container(container: Container, timeout: float | None = REMOVE_TIMEOUT) -> None:
    """Force-remove ``container`` (and its anonymous volumes) within ``timeout`` seconds a try; a missing container
    is fine.

    Raises:
        EngineTimeout: the engine did not answer in time (not retried: it would not answer the next try either).
    """
    try:
        if timeout is None:
            container.remove(force=True, v=True)
        else:
            request_within(container.client.api, "delete", "/containers/{0}", timeout, container.id, v=True, force=True)
    except NotFound:
        return
    except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as exc:
        if timed_out(exc):
            raise EngineTimeout(f"the engine did not remove it within {format_duration(timeout or 0)}") from exc
        raise


#: Seconds one try at removing a leftover may take (the engine may have been stuck on it before).
LEFTOVER_TIMEOUT = 5.0


class EngineTimeout(DockerException):  # type: ignore[misc]
    """An engine request that ran out of its own time (mapped as any engine error, never retried)."""


@contextlib.contextmanager
def sandbox_container(
    client: docker.DockerClient, spec: ContainerSpec, *, leftovers: Leftovers | None = None
) -> Iterator[Container]:
    """Create the container and yield it; remove it when the block ends, on every path. When the engine
    cannot remove it then, it goes to ``leftovers`` (their owner retries), else a line says how to."""
    with engine_errors(f"create container {spec.name}"):
        try:
            container = _create(client, spec)
        except ImageNotFound as exc:
            raise UsageError(f"image {spec.image} does not exist", hint="build it with pvisor-host build") from exc
    logger.debug("created container {} ({})", container.short_id, spec.name)
    hung = False
    with cleaning(f"container {spec.name}"):  # until it is removed: named should the process give up first
        try:
            yield container
        except StartHung:
            hung = True
            raise
        finally:
            _remove_at_the_end(container, leftovers, hung=hung)


def _remove_at_the_end(container: Container, leftovers: Leftovers | None, *, hung: bool) -> None:
    with deferred_interrupts():
        try:
            remove_container(container, HUNG_REMOVE_TIMEOUT if hung else REMOVE_TIMEOUT)
            logger.debug("removed container {}", container.short_id)
        except ENGINE_ERRORS as exc:
            if leftovers is not None:
                leftovers.add(container.id, stuck=hung)
                logger.warning("could not remove container {} yet ({})", container.short_id, describe(exc))
            else:
                logger.error(
                    "could not remove container {} ({}); remove it with `pvisor-host gc` or docker rm -f",
                    container.short_id,
                    describe(exc),
                )


def start(container: Container, timeout: float | None = None, *, checkpoint: str | None = None) -> None:
    """Start the container (from its ``checkpoint``, ``--fork``, the engine in experimental mode); one the engine has
    not started within ``timeout`` seconds is a :class:`StartHung` naming the step that hangs (see
    :func:`hung_step`): a runtime that never returns from ``create`` holds the engine's answer, and a batch waiting on
    it waits for good."""
    with engine_errors(f"start container {container.short_id}"):
        if timeout is None and checkpoint is None:
            container.start()
            return
        assert timeout is not None, "a start from a checkpoint takes a timeout"
        params = {"checkpoint": checkpoint} if checkpoint is not None else {}
        try:
            api = container.client.api
            request_within(api, "post", "/containers/{0}/start", timeout, container.id, **params)
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as exc:
            if not timed_out(exc):
                raise
            raise StartHung(
                f"the engine did not start the sandbox within {format_duration(timeout)}: {hung_step(container.id)}",
                hint="--start-timeout gives it longer; `pvisor-host doctor` names runtimes known to hang",
            ) from None


class StartHung(InfrastructureError):
    """The engine did not start a sandbox in time (its runtime hangs)."""

    @property
    def category(self) -> str:
        return START_TIMEOUT


def hung_step(container_id: str) -> str:
    """Which step of starting the container hangs, read from this host's processes: the runtime's command that
    names the container (``runc create``), and whether its child is still in ``runc init``; the engine itself when
    no such process runs here (or the engine is not on this host)."""
    found = None
    children: dict[int, list[str]] = {}
    shells = ("sh", "bash", "dash", "python3", "python")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(" ".join(Path(argv[0]).name.split() + argv[1:2]))
        if found is None and container_id in argv and Path(argv[0]).name != "containerd-shim-runc-v2":
            program = Path(argv[1] if Path(argv[0]).name in shells and len(argv) > 1 else argv[0]).name
            verbs = [arg for arg in argv[1:] if arg in ("create", "start", "run", "delete", "kill")]
            found = (int(entry.name), f"{program} {verbs[0] if verbs else ''}".strip())
    if found is None:
        return "the engine itself did not answer (no runtime process for it runs on this host)"
    pid, command = found
    inner = [child for child in children.get(pid, []) if child.endswith(" init")]
    return f"`{command}` hangs" + (f" (its `{inner[0]}` has not returned)" if inner else "")


def wait(container: Container, timeout: float | None, *, until: Callable[[], bool] | None = None) -> WaitOutcome:
    """Wait for the container to exit; past ``timeout`` seconds kill it and report ``timed_out``. With ``until``:
    stop waiting, the container still running, as soon as it is true (asked at least every 2 s)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    poll = _FIRST_POLL
    while True:
        if until is not None and not timed_out and until():
            return WaitOutcome(exit_code=None, running=True)
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            timed_out = True
            kill(container)
            deadline = None
            remaining = None
        slice_ = _WAIT_SLICE if until is None or timed_out else poll
        poll = min(poll * 1.5, _LAST_POLL)
        status = _wait_slice(container, min(slice_, remaining) if remaining else slice_)
        if status is not None:
            break
    state = inspect_state(container)
    return WaitOutcome(exit_code=status.get("StatusCode"), timed_out=timed_out, oom_killed=bool(state.get("OOMKilled")))


def _wait_slice(container: Container, seconds: float) -> dict[str, Any] | None:
    """The container's exit status, or None when it still runs after ``seconds``."""
    with engine_errors(f"wait for container {container.short_id}"):
        try:
            return dict(container.wait(timeout=seconds))
        except requests.exceptions.ConnectionError:
            # docker-py surfaces a wait that ran out of time as a (read-timeout) ConnectionError: make sure the
            # engine is still there, then wait on.
            container.reload()
            return None


def kill(container: Container) -> None:
    """SIGKILL the container's processes; an already stopped container is fine."""
    with engine_errors(f"kill container {container.short_id}"):
        try:
            container.kill()
        except NotFound:
            return
        except APIError as exc:
            if exc.status_code != 409:  # 409: not running any more
                raise


def inspect_state(container: Container) -> dict[str, object]:
    """The container's ``State`` block from ``docker inspect``."""
    with engine_errors(f"inspect container {container.short_id}"):
        container.reload()
    return dict(container.attrs.get("State", {}))


def logs_text(container: Container, *, stdout: bool, limit: int = 1024 * 1024) -> str:
    """One of a helper container's (small) output streams as text, cut at ``limit`` bytes."""
    buffer = io.BytesIO()
    with engine_errors(f"read the logs of container {container.short_id}"):
        for chunk in container.logs(stdout=stdout, stderr=not stdout, stream=True, follow=False):
            buffer.write(chunk[: max(0, limit - buffer.tell())])
    return buffer.getvalue().decode("utf-8", errors="replace")


@contextlib.contextmanager
def stopped_container(
    client: docker.DockerClient,
    ownership: Ownership,
    image: str,
    *,
    role: str,
    mounts: list[BindMount | VolumeMount] | None = None,
) -> Iterator[Container]:
    """A container that is created but never started, to read files out of an image (and its volumes)."""
    spec = ContainerSpec(
        image=image,
        command=["/nonexistent/never-started"],
        name=f"pvisor-host-{role}-{uuid.uuid4().hex[:12]}",
        labels=L.resource_labels(ownership, role),
        user=default_user(),
        mounts=mounts or [],
    )
    with sandbox_container(client, spec) as container:
        yield container
