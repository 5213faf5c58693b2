"""The engine's side of ``pvisor-host doctor``: the engine, its architecture and disk, the base and agent images.

Each check says what it found and, when it fails, how to fix it. The host's side (pvisor on the host, the
registry) is :mod:`pvisor_host.preflight.doctor`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import docker

from ..._version import PVISOR_VERSION
from ...models.housekeeping import Check
from ...models.profiles import all_profiles
from ...models.replay import ESCAPE_CVES, RUNC_FIXED, RUNTIME_REMEDY, Runtime
from ...units import format_size
from .engine import engine_address, engine_errors
from .image.base import default_base, find_image, resolve_base_offline
from .image.recipe import expected_tag
from .runtimes import probed, registered, runsc_registration, shown

_LOW_DISK = 10 * 1024**3
_TOO_LOW_DISK = 2 * 1024**3


def diagnose(client: docker.DockerClient) -> list[Check]:
    """The engine checks, in the order ``doctor`` shows them."""
    with engine_errors("read the engine's information"):
        info = client.info()
        version = client.version()
    engine = Check(
        name="engine",
        status="ok",
        detail=f"Docker {version.get('Version')} (API {version.get('ApiVersion')}) at {engine_address()}",
    )
    default, known, _ = registered(client)
    runtime = probed(known.get(default) or Runtime(name=default), info)
    checks = [engine, _architecture(info), _disk(info), _runtimes(info), _escape_fixes(runtime)]
    return [*checks, *_start_hangs(runtime), *_images(client)]


#: runc versions seen to hang a container's start in ``runc init`` (for 20 minutes and more, the engine answering
#: nothing about it meanwhile) when many sandboxes start at once on a host with hybrid cgroups: ours, 2026-12.
HANGS_IN_INIT = ("1.1.5",)


def _start_hangs(runtime: Runtime) -> list[Check]:
    """A runtime known to hang starting containers: named, with what bounds it."""
    if runtime.name != "runc" or runtime.version is None or runtime.version.lstrip("v") not in HANGS_IN_INIT:
        return []
    return [
        Check(
            name="runtime starts",
            status="warn",
            detail=f"runc {runtime.version} has been seen to hang in `runc init` when many sandboxes start at once "
            "(each start is bounded by --start-timeout, and retried once in a fresh sandbox)",
            fix="upgrade runc (1.2.8 / 1.3.3 or later), or run sandboxes under gVisor (--runtime runsc)",
            required=False,
        )
    ]


def _escape_fixes(runtime: Runtime) -> Check:
    """Whether the default runtime has the fixes for the 2025 runc container escapes (docs/security.md)."""
    named = f"{runtime.name} {runtime.version}" if runtime.version else runtime.name
    fixed = runtime.escape_fixed
    if fixed:
        return Check(name="runtime floor", status="ok", detail=f"{named}: {ESCAPE_CVES} do not apply", required=False)
    if fixed is None:
        return Check(
            name="runtime floor",
            status="warn",
            detail=f"{named}: version unknown, so {ESCAPE_CVES} may apply",
            fix=RUNTIME_REMEDY,
            required=False,
        )
    return Check(
        name="runtime floor",
        status="warn",
        detail=f"{named} is older than the fixes for {ESCAPE_CVES} (runc {RUNC_FIXED})",
        fix=RUNTIME_REMEDY,
        required=False,
    )


def _runtimes(info: dict[str, Any]) -> Check:
    default = str(info.get("DefaultRuntime") or "runc")
    names = shown(list(info.get("Runtimes") or {"runc": {}}))
    detail = ", ".join(f"{name} (default)" if name == default else name for name in names)
    if "runsc" in names:
        return Check(name="runtimes", status="ok", detail=f"{detail}; gVisor is available: --runtime runsc")
    if shutil.which("runsc"):
        return Check(
            name="runtimes",
            status="warn",
            detail=f"{detail}; gVisor (runsc) is installed but not registered with the engine",
            fix=f"put {runsc_registration()} in /etc/docker/daemon.json, then kill -HUP $(pgrep -x dockerd)",
            required=False,
        )
    return Check(name="runtimes", status="ok", detail=f"{detail} (apt-get install runsc adds gVisor)", required=False)


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


def _images(client: docker.DockerClient) -> list[Check]:
    base = resolve_base_offline(client)
    if base is None:
        return [
            Check(
                name="base image",
                status="warn",
                detail=f"neither {default_base()} nor a bootstrapped base is present",
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
        if tag is None:  # its Debian release's base is not here yet (OpenHands builds on trixie)
            checks.append(
                Check(
                    name=f"image {profile.agent}",
                    status="warn",
                    detail=f"not built yet (its {profile.suite} base is not present either)",
                    fix=f"pvisor-host build --agent {profile.agent}",
                    required=False,
                )
            )
            continue
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
