"""sha256 of files and directory trees: the one chunked read-hash-(copy) loop of pvisor-host."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO, Protocol

#: Bytes read (and written) at a time.
CHUNK = 1024 * 1024


class Sink(Protocol):
    """Where :func:`copy_hashing` sends each chunk: a file, or a checker that only looks at the bytes."""

    def write(self, data: bytes, /) -> object: ...


def copy_hashing(source: IO[bytes], sink: Sink | None = None) -> tuple[int, str]:
    """Read ``source`` to its end, passing every chunk to ``sink`` (if any); return the size and sha256."""
    digest = hashlib.sha256()
    size = 0
    while chunk := source.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return size, digest.hexdigest()


def hash_file(path: Path) -> tuple[int, str]:
    """Size and sha256 of a file."""
    with path.open("rb") as handle:
        return copy_hashing(handle)


def tree_sha256(root: Path) -> str:
    """A digest of a directory's names, kinds, executable bits and contents (symlinks by target)."""
    digest = hashlib.sha256()
    for directory, children, files in os.walk(root):
        children.sort()
        for name in sorted(files) + [c + "/" for c in children]:
            path = Path(directory, name.rstrip("/"))
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                digest.update(f"L {relative} {os.readlink(path)}\n".encode())
            elif name.endswith("/"):
                digest.update(f"D {relative}\n".encode())
            elif path.is_file():
                executable = os.access(path, os.X_OK)
                digest.update(f"F {relative} {executable} {hash_file(path)[1]}\n".encode())
    return digest.hexdigest()
