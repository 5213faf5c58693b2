"""Who owns what a backend creates: the session cancel looks for, and the process gc judges alive or gone.

A backend is handed an :class:`Ownership` explicitly, so resources a process creates on another machine (a
cluster node) carry the session of the controller that asked for them, and the owner that created them.
The owner id is ``host/pid/start-ticks``: a pid may be reused, its start time will not be.
"""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import BaseModel, ConfigDict


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


class Ownership(BaseModel):
    """The owner labels of everything one controller invocation creates."""

    model_config = ConfigDict(frozen=True)

    session: str
    """One id per invocation (a replay, a batch): cancelling finds its sandboxes by it, on every machine."""
    owner: str
    """``<host>/<pid>/<start ticks>`` of the process creating the resources: ``gc`` removes them once it is gone."""
    host: str
    """The host ``gc`` runs on; resources owned on another host are never judged from here."""
    out: str | None = None
    """The directory the invocation writes into (a batch's ``--out``), when it has one: a later run into it finds
    what this one left, should it die without cleaning up."""

    @classmethod
    def current(cls, session: str | None = None, *, out: str | None = None) -> Ownership:
        """This process as the owner, with ``session`` (default: a new one), writing into ``out``."""
        pid = os.getpid()
        host = socket.gethostname()
        return cls(
            session=session or uuid.uuid4().hex[:16],
            owner=f"{host}/{pid}/{process_start_ticks(pid) or 0}",
            host=host,
            out=out,
        )

    def owner_alive(self, owner_id: str) -> bool | None:
        """Whether the process named by ``owner_id`` still runs; None when it is on another host."""
        try:
            host, pid_text, ticks = owner_id.split("/")
            pid = int(pid_text)
        except ValueError:
            return False
        if host != self.host:
            return None
        return process_start_ticks(pid) == ticks
