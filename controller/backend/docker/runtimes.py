"""Container runtimes: which ones the engine has registered (runc, gVisor's runsc, ...), and choosing one.

A runtime the engine does not know is refused before anything starts, with the ones it has, and — for gVisor
installed but not registered — the exact ``daemon.json`` lines that register it.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import docker

from ...errors import UsageError
from ...models.replay import Runtime

#: What ``make test`` registers gVisor with: no network of its own (the only mode that starts on these hosts)
#: and connections to host unix sockets opened for the sandbox (the model gateway's).
RUNSC_ARGS = ["--network=none", "--host-uds=open"]


def registered(client: docker.DockerClient) -> tuple[str, dict[str, Runtime]]:
    """The engine's default runtime, and every runtime it has registered (runc's with the version the engine
    reports for it)."""
    info: dict[str, Any] = client.info()
    runc = runc_version(client)
    found = {}
    for name, entry in (info.get("Runtimes") or {"runc": {"path": "runc"}}).items():
        runtime = Runtime(name=name, path=str(entry.get("path") or name), args=list(entry.get("runtimeArgs") or []))
        found[name] = runtime.model_copy(update={"version": runc}) if runtime.runc else runtime
    return str(info.get("DefaultRuntime") or "runc"), found


def runc_version(client: docker.DockerClient) -> str | None:
    """The version of the runc the engine runs containers with, as ``docker version`` lists it."""
    components = client.version().get("Components") or []
    for component in components:
        if str(component.get("Name", "")).lower() == "runc":
            return str(component.get("Version") or "") or None
    return None


def runsc_registration() -> str:
    """The ``daemon.json`` entry that registers gVisor as ``runsc``."""
    path = shutil.which("runsc") or "/usr/bin/runsc"
    return json.dumps({"runtimes": {"runsc": {"path": path, "runtimeArgs": RUNSC_ARGS}}})


def shown(names: list[str] | dict[str, Runtime]) -> list[str]:
    """The runtimes to name to a user: the engine's ``io.containerd.*`` shim aliases of runc (docker.io lists
    them after some restarts, not after others) are accepted but not listed."""
    return sorted(name for name in names if not name.startswith("io.containerd."))


def choose(name: str, known: dict[str, Runtime]) -> Runtime:
    """The runtime ``name``, or a :class:`UsageError` naming those the engine has."""
    if name in known:
        return known[name]
    have = ", ".join(shown(known))
    if name == "runsc" and shutil.which("runsc"):
        hint = f"gVisor is installed but not registered: put {runsc_registration()} in /etc/docker/daemon.json, "
        hint += "then kill -HUP $(pgrep -x dockerd)"
    else:
        hint = "register it in /etc/docker/daemon.json (docs/security.md#gvisor)"
    raise UsageError(f"--runtime {name}: the engine has no runtime {name!r}; it has {have}", hint=hint)
