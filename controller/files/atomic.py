"""Writes that readers see whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import UsageError


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never half."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def check_target(path: Path, flag: str) -> Path:
    """A file the user asked for (``--output FILE``, ``--junit FILE``): refused in one line, before any work, when
    it is a directory or its directory is missing or not writable. Returns it, absolute.

    Raises:
        UsageError: see above.
    """
    path = path.expanduser().absolute()
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; pass a file's path")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: no directory {path.parent}", hint=f"mkdir -p {path.parent} first")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{flag} {path}: {path.parent} is not writable")
    return path
