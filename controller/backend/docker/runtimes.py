"""Container runtimes: which ones the engine has registered (runc, gVisor's runsc, ...), and choosing one.

A runtime the engine does not know is refused before anything starts, with the ones it has, and — for gVisor
installed but not registered — the exact ``daemon.json`` lines that register it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import docker

from ...errors import UsageError
from ...models.replay import Runtime

#: What ``make test`` registers gVisor with: no network of its own (the only mode that starts on these hosts)
#: and connections to host unix sockets opened for the sandbox (the model gateway's).
RUNSC_ARGS = ["--network=none", "--host-uds=open"]
#: Where Docker 20.10's runc.v2 shim keeps its runtimes' state (runsc's included), for the moby namespace: where
#: ``runsc checkpoint`` finds a sandbox.
RUNTIME_ROOT = "/var/run/docker/runtime-runc/moby"
#: The oldest gVisor that saves a sandbox at the boundary: Debian 12's 20221219 fails there with "endpoint still
#: has waiters upon save" on the loopback listeners pvisor's bridge and the relay hold; Debian 13's 20240729 saves it.
FORK_GVISOR = 20240729


def registered(client: docker.DockerClient) -> tuple[str, dict[str, Runtime], dict[str, Any]]:
    """The engine's default runtime, every runtime it has registered (runc's with the version the engine reports
    for it), and the engine's information (for :func:`probed`)."""
    info: dict[str, Any] = client.info()
    runc = runc_version(client)
    found = {}
    for name, entry in (info.get("Runtimes") or {"runc": {"path": "runc"}}).items():
        runtime = Runtime(name=name, path=str(entry.get("path") or name), args=list(entry.get("runtimeArgs") or []))
        found[name] = runtime.model_copy(update={"version": runc}) if runtime.runc else runtime
    return str(info.get("DefaultRuntime") or "runc"), found, info


def probed(runtime: Runtime, info: dict[str, Any]) -> Runtime:
    """``runtime`` as a sandbox runs under it: gVisor's with its version (``runsc --version``, run only for the
    runtime chosen) and whether it can fork a sandbox on the engine ``info`` describes."""
    if not runtime.gvisor:
        return runtime
    version = gvisor_version(runtime.path)
    return runtime.model_copy(update={"version": version, "fork_problem": fork_problem(version, info)})


def gvisor_version(path: str) -> str | None:
    """gVisor's version, as ``runsc --version`` gives it on this host (``0.0~20240729.0``, ``release-20250106.0``);
    None when it does not run here."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"runsc version (\S+)", done.stdout)
    return found.group(1) if found else None


def gvisor_date(version: str) -> int | None:
    """The date a gVisor version was cut (``0.0~20240729.0`` and ``release-20240729.0`` → 20240729)."""
    found = re.search(r"(20\d{6})", version)
    return int(found.group(1)) if found else None


def fork_problem(version: str | None, info: dict[str, Any]) -> str | None:
    """Why a gVisor runtime of ``version`` cannot fork a sandbox on the engine ``info`` describes (None: it can)."""
    if version is None:
        return "its runsc does not run on this host (the controller must run beside the engine)"
    date = gvisor_date(version)
    if date is None or date < FORK_GVISOR:
        return (f"gVisor {version} cannot save a sandbox at the boundary (its listening sockets): it needs gVisor "
                f"{FORK_GVISOR} or later (docs/fork.md)")  # fmt: skip
    if not info.get("ExperimentalBuild"):
        return 'the engine\'s experimental mode is off: Docker restores a checkpoint only with "experimental": true'
    if not Path(str(info.get("DockerRootDir") or "/var/lib/docker")).is_dir() or not Path(RUNTIME_ROOT).is_dir():
        return "the engine's directories are not on this host (the controller must run beside the engine)"
    if os.geteuid() != 0:
        return "checkpointing a sandbox takes root (gVisor's state and the engine's directories are root's)"
    return None


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
