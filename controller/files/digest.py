"""sha256 of files and directory trees: the one chunked read-hash-(copy) loop of pvisor-host."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO, NamedTuple, Protocol

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


class Tree(NamedTuple):
    """A directory tree as a replay's inputs see it."""

    sha256: str
    """A digest of its names, kinds, executable bits and contents (symlinks by target)."""
    bytes: int
    """The bytes of its regular files (symlinks not followed)."""


def tree_digest(root: Path) -> Tree:
    """The digest and size of a directory tree, in one pass over it."""
    digest = hashlib.sha256()
    total = 0
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
                size, sha256 = hash_file(path)
                total += size
                digest.update(f"F {relative} {executable} {sha256}\n".encode())
    return Tree(digest.hexdigest(), total)
