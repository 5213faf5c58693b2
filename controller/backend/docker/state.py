"""When pvisor-host last used each image and runtime volume (Docker does not keep that).

A small JSON file in the state directory (``$PVISOR_HOST_STATE_DIR``, else ``$XDG_STATE_HOME/pvisor-host``,
else ``~/.local/state/pvisor-host``), updated under an exclusive lock so parallel replays do not lose
each other's updates. ``images`` shows it and ``images prune`` removes the least recently used first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ...files.atomic import write_atomic


def state_dir() -> Path:
    """Where pvisor-host keeps its host-side state."""
    explicit = os.environ.get("PVISOR_HOST_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "pvisor-host"


def engine_state(client: Any, name: str) -> Path:
    """The state file or folder ``name`` of the engine ``client`` speaks to (``name-<engine id>``): an engine's
    image cache ledger, its start slots. Every process on that engine finds the same one."""
    from .engine import engine_errors

    with engine_errors("read the engine's information"):
        engine_id = str(client.info().get("ID") or "engine")
    safe = "".join(c for c in engine_id if c.isalnum())[:24] or "engine"
    return state_dir() / f"{name}-{safe}"


def _path() -> Path:
    return state_dir() / "last-used.json"


@contextlib.contextmanager
def locked_state(name: str) -> Iterator[dict[str, Any]]:
    """The JSON object in the state file ``name``, under an exclusive lock; written back (atomically) when the
    block changed it."""
    path = state_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{path.stem}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        except ValueError:
            data = {}
        before = json.dumps(data, sort_keys=True)
        yield data
        if json.dumps(data, sort_keys=True) != before:
            write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())


def _locked() -> contextlib.AbstractContextManager[dict[str, Any]]:
    return locked_state("last-used.json")


def record_use(*keys: str | None) -> None:
    """Note that the images (by id) and volumes (by name) in ``keys`` were used now. Never fails a run."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        with _locked() as data:
            for key in keys:
                if key:
                    data[key] = now
    except OSError:
        return


def last_used() -> dict[str, datetime]:
    """Key → last use, for every image and volume ever recorded."""
    try:
        data = json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {key: datetime.fromisoformat(value) for key, value in data.items()}


def forget(*keys: str) -> None:
    """Drop removed images or volumes from the record."""
    with contextlib.suppress(OSError), _locked() as data:
        for key in keys:
            data.pop(key, None)
