"""``pvisor-host doctor``: is this host ready to replay, and if not, what to do about it.

Each check says what it found and, when it fails, how to fix it. Required checks decide the exit code;
the others only inform (a missing registry is fine where mmdebstrap can bootstrap a base).
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import Literal

import docker
import requests
from docker.errors import APIError
from pydantic import BaseModel

from . import bootstrap
from ._version import PVISOR_VERSION
from .build import DEFAULT_BASE, expected_tag, find_image, resolve_base_offline
from .engine import connect, engine_address
from .errors import PvisorHostError
from .hostpvisor import pvisor_binary
from .profiles import all_profiles
from .units import format_size

_LOW_DISK = 10 * 1024**3
_TOO_LOW_DISK = 2 * 1024**3
_REGISTRY = "registry-1.docker.io"


class Check(BaseModel):
    """One line of the report."""

    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: str | None = None
    required: bool = True


class Report(BaseModel):
    """All checks; ``ok`` when no required check failed."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" and c.required for c in self.checks)


def diagnose() -> Report:
    """Run every check (the engine's own checks only when it answers)."""
    checks = [_host_pvisor()]
    try:
        client = connect(timeout=10)
    except PvisorHostError as exc:
        checks.insert(0, Check(name="engine", status="fail", detail=exc.message, fix=exc.hint))
        checks.append(_registry(client=None))
        return Report(checks=checks)
    info = client.info()
    version = client.version()
    checks.insert(
        0,
        Check(
            name="engine",
            status="ok",
            detail=f"Docker {version.get('Version')} (API {version.get('ApiVersion')}) at {engine_address()}",
        ),
    )
    checks += [_architecture(info), _disk(info), _registry(client)]
    checks += _images(client)
    return Report(checks=checks)


def _host_pvisor() -> Check:
    try:
        path = pvisor_binary()
    except PvisorHostError as exc:
        return Check(name="pvisor on the host", status="fail", detail=exc.message, fix=exc.hint)
    return Check(name="pvisor on the host", status="ok", detail=f"pvisor {PVISOR_VERSION} at {path}")


def _architecture(info: dict[str, object]) -> Check:
    arch = str(info.get("Architecture"))
    if arch in ("x86_64", "amd64"):
        return Check(name="architecture", status="ok", detail=f"{arch} (pvisor {PVISOR_VERSION} ships x86_64 binaries)")
    return Check(
        name="architecture",
        status="fail",
        detail=f"the engine runs on {arch}; pvisor {PVISOR_VERSION} ships only x86_64 Linux binaries",
        fix="use an x86_64 Docker host",
    )


def _disk(info: dict[str, object]) -> Check:
    root = str(info.get("DockerRootDir") or "/var/lib/docker")
    local = engine_address().startswith("unix://")
    if not local or not os.path.isdir(root):
        return Check(
            name="disk", status="warn", detail=f"cannot measure {root} from here (remote engine)", required=False
        )
    free = shutil.disk_usage(root).free
    detail = f"{format_size(free)} free for the Docker data root {root}"
    if free < _TOO_LOW_DISK:
        return Check(name="disk", status="fail", detail=detail, fix="free disk space (pvisor-host images prune)")
    if free < _LOW_DISK:
        return Check(name="disk", status="warn", detail=detail, fix="pvisor-host images prune", required=False)
    return Check(name="disk", status="ok", detail=detail)


def _registry(client: docker.DockerClient | None) -> Check:
    try:
        socket.getaddrinfo(_REGISTRY, 443)
        requests.get(f"https://{_REGISTRY}/v2/", timeout=5)
    except (OSError, requests.exceptions.RequestException) as exc:
        base_present = client is not None and (
            find_image(client, DEFAULT_BASE) is not None or bootstrap.find_bootstrapped(client) is not None
        )
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


def _images(client: docker.DockerClient) -> list[Check]:
    try:
        base = resolve_base_offline(client)
    except APIError:
        base = None
    if base is None:
        return [
            Check(
                name="base image",
                status="warn",
                detail=f"neither {DEFAULT_BASE} nor a bootstrapped base is present",
                fix="pvisor-host build --agent claude-code (gets or bootstraps one)",
                required=False,
            )
        ]
    checks = [Check(name="base image", status="ok", detail=f"{base.ref} ({base.source})", required=False)]
    for profile in all_profiles().values():
        if not profile.installable:
            checks.append(
                Check(name=f"image {profile.agent}", status="warn", detail="cannot be built here", required=False)
            )
            continue
        tag = expected_tag(client, profile)
        assert tag is not None
        present = find_image(client, tag) is not None
        checks.append(
            Check(
                name=f"image {profile.agent}",
                status="ok" if present else "warn",
                detail=tag if present else f"{tag} not built yet",
                fix=None if present else f"pvisor-host build --agent {profile.agent}",
                required=False,
            )
        )
    return checks
