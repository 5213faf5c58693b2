"""Labels on everything pvisor-host creates in Docker, and the owner identity they carry.

Every container, volume, network and image we create carries ``pvisor-host.*`` labels. The
``pvisor-host.owner`` label names the controller process (``host/pid/start-ticks``) so that a later
``gc`` can tell a live owner from a dead one even when the pid has been reused.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import UTC, datetime
from functools import cache

from ._version import __version__

PREFIX = "pvisor-host."
MANAGED = PREFIX + "managed"
RUN = PREFIX + "run"
SESSION = PREFIX + "session"
OWNER = PREFIX + "owner"
STARTED = PREFIX + "started"
VERSION = PREFIX + "version"
ROLE = PREFIX + "role"

# Image labels written at build time (the record of what was verified inside the image).
AGENT = PREFIX + "agent"
AGENT_VERSION = PREFIX + "agent-version"
AGENT_ENTRYPOINT = PREFIX + "agent-entrypoint"
PVISOR_VERSION = PREFIX + "pvisor-version"
PVISOR_PATH = PREFIX + "pvisor-path"
RECIPE_HASH = PREFIX + "recipe-hash"
BASE_IMAGE = PREFIX + "base-image"


def process_start_ticks(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``); None when no
    such process runs (a zombie — exited, not yet reaped by its parent — does not run)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


@cache
def owner() -> str:
    """This process's owner id: ``<hostname>/<pid>/<start ticks>``."""
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{process_start_ticks(pid) or 0}"


@cache
def session() -> str:
    """One id per controller process; every resource it creates shares it."""
    return uuid.uuid4().hex[:16]


def owner_alive(owner_id: str) -> bool | None:
    """Whether the process named by ``owner_id`` still runs; ``None`` when it is on another host."""
    try:
        host, pid_text, ticks = owner_id.split("/")
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname():
        return None
    return process_start_ticks(pid) == ticks


def resource_labels(role: str, run_id: str | None = None) -> dict[str, str]:
    """Labels for a container, volume or network created by this process."""
    labels = {
        MANAGED: "true",
        ROLE: role,
        SESSION: session(),
        OWNER: owner(),
        STARTED: datetime.now(UTC).isoformat(timespec="seconds"),
        VERSION: __version__,
    }
    if run_id:
        labels[RUN] = run_id
    return labels
