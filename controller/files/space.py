"""Full disks: recognising one, and naming the filesystem that is full."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import DiskFull
from ..units import format_size

_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_full(exc: BaseException) -> bool:
    """An ``OSError`` saying the filesystem (or the quota) has no space left."""
    return isinstance(exc, OSError) and exc.errno in _FULL


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem ``path`` is on (``path`` may not exist yet)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    device = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def disk_full(path: Path) -> DiskFull:
    """The error for a write under ``path`` that found no space."""
    mount = mount_point(path)
    stats = os.statvfs(mount)
    free = stats.f_bavail * stats.f_frsize
    return DiskFull(str(mount), free, f"the filesystem at {mount} is full ({format_size(free)} free)")


@contextlib.contextmanager
def full_disk_raises(path: Path) -> Iterator[None]:
    """Within the block, a write that finds no space raises :class:`DiskFull` naming ``path``'s filesystem."""
    try:
        yield
    except OSError as exc:
        if is_full(exc):
            raise disk_full(path) from exc
        raise


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links not followed)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                info = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            total += info.st_size
    return total
