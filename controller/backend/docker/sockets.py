"""The host end of a unix socket a sandbox is given: a short-lived directory, bind-mounted read-only into the
sandbox, holding a socket only the sandbox's user may use (the model gateway's, a run's egress proxy's)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def socket_dir(prefix: str) -> Path:
    """A new directory under ``/tmp`` for a socket (short: AF_UNIX paths are limited to 108 bytes), which the
    sandbox's user may enter."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    directory.chmod(0o755)
    return directory


def own_socket(path: Path, uid: int | None) -> None:
    """Make the socket at ``path`` the sandbox user's (``uid``; when this process may give it away) and no one
    else's."""
    if uid is not None and os.geteuid() == 0:
        os.chown(path, uid, uid)
    path.chmod(0o600)
