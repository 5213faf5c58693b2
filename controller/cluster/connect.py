"""Ray, the optional engine that spreads replays over many Docker hosts: importing it, and joining a cluster.

Ray is the ``ray`` extra (``pip install 'pvisor-host[ray]'``); without it every cluster command is one
line naming the extra. Token authentication is always on: the token comes from ``RAY_AUTH_TOKEN`` (or the
file ``PVISOR_HOST_CLUSTER_TOKEN_FILE`` names), never from a command line, and is never logged.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import PrerequisiteError, UsageError

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


def connect(address: str) -> ModuleType:
    """Join the cluster at ``address`` as a driver (token auth on); ``ray`` is returned, initialised.

    Raises:
        PrerequisiteError: Ray is not installed, or this machine runs no node of a cluster.
        UsageError: a bad address, or no token.
        InfrastructureError: the head does not answer, or refuses the token.
    """
    from ..errors import InfrastructureError

    require_ray()
    environment = auth_environment()
    check_address(address)
    if not local_raylet():
        raise PrerequisiteError(
            f"this machine is not a node of the cluster at {address}, and Ray runs a driver only on one",
            hint="run the batch on the head, or on a Docker host that ran `pvisor-host node join`",
        )
    os.environ.update(environment)  # before Ray is imported: it reads them then
    import ray

    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            logging_level=logging.ERROR,
            log_to_driver=False,
            configure_logging=True,
        )
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ... with its own text
        raise InfrastructureError(f"cannot join the cluster at {address}: {_first_line(exc)}") from None
    return ray


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
