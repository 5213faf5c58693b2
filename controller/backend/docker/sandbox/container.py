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
from docker.errors import APIError, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import LogConfig, Mount
from pydantic import BaseModel, ConfigDict

from ...._log import logger
from ....errors import UsageError
from ....models.ownership import Ownership
from ....models.spec import default_user
from ....signals import deferred_interrupts
from .. import labels as L
from ..engine import ENGINE_ERRORS, describe, engine_errors, retrying


class Leftovers:
    """Containers the engine could not remove (it was away), to be removed once it answers again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    def add(self, container_id: str) -> None:
        with self._lock:
            self._ids.add(container_id)

    def take(self) -> set[str]:
        """Every id noted so far (the caller removes them, or adds back those it could not)."""
        with self._lock:
            ids, self._ids = self._ids, set()
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


@retrying()
def remove_container(container: Container) -> None:
    """Force-remove ``container`` (and its anonymous volumes); a missing container is fine."""
    try:
        container.remove(force=True, v=True)
    except NotFound:
        return


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
    try:
        yield container
    finally:
        with deferred_interrupts():
            try:
                remove_container(container)
                logger.debug("removed container {}", container.short_id)
            except ENGINE_ERRORS as exc:
                if leftovers is not None:
                    leftovers.add(container.id)
                    logger.warning("could not remove container {} yet ({})", container.short_id, describe(exc))
                else:
                    logger.error(
                        "could not remove container {} ({}); remove it with `pvisor-host gc` or docker rm -f",
                        container.short_id,
                        describe(exc),
                    )


def start(container: Container) -> None:
    """Start the container."""
    with engine_errors(f"start container {container.short_id}"):
        container.start()


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
