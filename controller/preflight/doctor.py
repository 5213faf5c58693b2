"""``pvisor-host doctor``: is this host ready to replay, and if not, what to do about it.

Each check says what it found and, when it fails, how to fix it. Required checks decide the exit code; the
others only inform (a missing registry is fine where mmdebstrap can bootstrap a base). The host's checks
are here; the engine's come from the backend (:meth:`~pvisor_host.backend.base.Backend.diagnose`).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Callable

from .._version import PVISOR_VERSION
from ..backend.base import AnyBackend
from ..errors import PrerequisiteError, PvisorHostError
from ..models.housekeeping import Check, HealthReport
from .hostpvisor import pvisor_binary

_REGISTRY = "registry-1.docker.io"


def diagnose(open_backend: Callable[[], AnyBackend]) -> HealthReport:
    """Run every check (the engine's only when it answers)."""
    host = _host_pvisor()
    try:
        backend = open_backend()
    except PrerequisiteError as exc:
        engine = Check(name="engine", status="fail", detail=exc.message, fix=exc.hint)
        return HealthReport(checks=[engine, host, _registry(base_present=False)])
    with contextlib.closing(backend):
        checks = backend.diagnose()
    base_present = any(c.name == "base image" and c.status == "ok" for c in checks)
    images = [c for c in checks if c.name == "base image" or c.name.startswith("image ")]
    machine = [c for c in checks if c not in images]  # the engine itself first, then its architecture and disk
    return HealthReport(checks=[machine[0], host, *machine[1:], _registry(base_present=base_present), *images])


def _host_pvisor() -> Check:
    try:
        path = pvisor_binary()
    except PvisorHostError as exc:
        return Check(name="pvisor on the host", status="fail", detail=exc.message, fix=exc.hint)
    return Check(name="pvisor on the host", status="ok", detail=f"pvisor {PVISOR_VERSION} at {path}")


def _registry(*, base_present: bool) -> Check:
    import requests  # only doctor needs it

    try:
        socket.getaddrinfo(_REGISTRY, 443)
        requests.get(f"https://{_REGISTRY}/v2/", timeout=5)
    except (OSError, requests.exceptions.RequestException) as exc:
        if base_present or shutil.which("mmdebstrap"):
            how = "a local base is present" if base_present else "mmdebstrap can bootstrap a base"
            return Check(
                name="registry",
                status="warn",
                detail=f"{_REGISTRY} is not reachable from this host ({type(exc).__name__}); {how}",
                required=False,
            )
        return Check(
            name="registry",
            status="fail",
            detail=f"{_REGISTRY} is not reachable and mmdebstrap is not installed: no base image can be had",
            fix="apt-get install mmdebstrap, or docker load a debian:bookworm-slim image",
        )
    return Check(name="registry", status="ok", detail=f"{_REGISTRY} is reachable", required=False)
