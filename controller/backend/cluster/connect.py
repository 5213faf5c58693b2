"""Ray, the optional engine that spreads replays over many Docker hosts: importing it, and joining a cluster.

Ray is the ``ray`` extra (``pip install 'pvisor-host[ray]'``); without it every cluster command is one
line naming the extra. Token authentication is always on: the token comes from ``RAY_AUTH_TOKEN`` (or the
file ``PVISOR_HOST_CLUSTER_TOKEN_FILE`` names), never from a command line, and is never logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from ...errors import PrerequisiteError, UsageError

#: The Ray namespace of everything pvisor-host starts in a cluster.
NAMESPACE = "pvisor-host"
#: The custom resource a node advertises: how many replays it may run at once.
ENGINE_RESOURCE = "docker_engine"
TOKEN_FILE_ENV = "PVISOR_HOST_CLUSTER_TOKEN_FILE"
_ADDRESS = re.compile(r"^[A-Za-z0-9_.-]+:\d{1,5}$")


def require_ray() -> None:
    """Check that Ray is installed, without importing it (it reads its auth settings when imported).

    Raises:
        PrerequisiteError: Ray is not installed (one line naming the extra).
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise PrerequisiteError("a cluster needs Ray, which is not installed", hint="pip install 'pvisor-host[ray]'")


def check_address(address: str) -> str:
    """``HOST:PORT`` of the cluster's head (its GCS port).

    Raises:
        UsageError: not ``HOST:PORT``.
    """
    if not _ADDRESS.match(address):
        raise UsageError(f"--cluster {address!r} is not HOST:PORT (the Ray head's address, e.g. 10.0.0.5:6379)")
    return address


def auth_environment() -> dict[str, str]:
    """The environment that turns Ray's token authentication on, from ``RAY_AUTH_TOKEN`` or the token file.

    Raises:
        UsageError: no token (the cluster would accept anyone who can reach it), or an unreadable file.
    """
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    if not token and path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise UsageError(f"{TOKEN_FILE_ENV}={path}: cannot read the cluster token ({exc.strerror})") from None
    if not token:
        raise UsageError(
            "the cluster's token is not set: export RAY_AUTH_TOKEN (or point PVISOR_HOST_CLUSTER_TOKEN_FILE at "
            "a file holding it); it is never taken from a command line"
        )
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}


class RayConnection:
    """This process's connection to a cluster, owned by whoever opened it (:func:`connect`) and ended by its
    :meth:`close`, never by anyone else's.

    Ray keeps one connection per process, and reads its token settings from the process environment. So
    while a connection is open the environment carries them, :meth:`close` puts the environment back as it
    was, and a second connection in the same process is refused in one line until the first is closed.
    """

    def __init__(self, ray: ModuleType, address: str, saved: dict[str, str | None]) -> None:
        self.ray = ray
        self.address = address
        self._saved = saved
        self._closed = False

    def close(self) -> None:
        """Leave the cluster and restore the environment (idempotent)."""
        global _current
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(Exception):
                self.ray.shutdown()
        finally:
            _restore(self._saved)
            with _lock:
                _current = None


_lock = threading.Lock()
_current: RayConnection | None = None


def connect(address: str) -> RayConnection:
    """Join the cluster at ``address`` as a driver (token auth on).

    Raises:
        PrerequisiteError: Ray is not installed, or this machine runs no node of a cluster.
        UsageError: a bad address, no token, or this process is connected to a cluster already (a cluster
            batch running, or Ray initialised by the application itself).
        InfrastructureError: the head does not answer, or refuses the token.
    """
    global _current
    from ...errors import InfrastructureError

    require_ray()
    environment = auth_environment()
    check_address(address)
    if not local_raylet():
        raise PrerequisiteError(
            f"this machine is not a node of the cluster at {address}, and Ray runs a driver only on one",
            hint="run the batch on the head, or on a Docker host that ran `pvisor-host node join`",
        )
    with _lock:
        if _current is not None:
            raise UsageError(
                f"this process is already running a cluster batch on {_current.address}, and Ray allows one "
                "cluster connection per process: run the next batch after it, or in another process"
            )
        already = sys.modules.get("ray")
        if already is not None and already.is_initialized():
            raise UsageError(
                "Ray is already initialised in this process by something else; pvisor-host needs a cluster "
                "connection of its own: run the batch in a process that has not called ray.init()"
            )
        saved = {name: os.environ.get(name) for name in environment}
        os.environ.update(environment)  # Ray reads them when imported and when it connects
        try:
            import ray

            ray.init(
                address=address,
                namespace=NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,
                configure_logging=True,
            )
        except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ... with its own text
            _restore(saved)
            raise InfrastructureError(f"cannot join the cluster at {address}: {_first_line(exc)}") from None
        except BaseException:
            _restore(saved)
            raise
        _current = RayConnection(ray, address, saved)
        return _current


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def local_raylet() -> bool:
    """Whether a Ray node (a ``raylet``) runs on this machine: a driver joins a cluster through one."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "raylet":
                    return True
            except OSError:
                continue
    return False


def engine_nodes(ray: Any) -> list[dict[str, Any]]:
    """The alive nodes of the connected cluster that advertise a Docker engine."""
    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(ENGINE_RESOURCE, 0) >= 1]


def pinned_to(node_id: str) -> Any:
    """Ray's scheduling strategy for "on this node, nowhere else"."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def preferring(node_id: str, *, spill: bool = False) -> Any:
    """Ray's scheduling strategy for "on this node (waiting for a slot there), or anywhere when it is gone";
    with ``spill``, also wherever a slot is free when this node has none.

    ``_spill_on_unavailable`` is marked private in Ray 2.60, the version pvisor-host pins and every node must
    run; Ray Serve's deployment scheduler uses it for the same.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=True, _spill_on_unavailable=spill)
