"""Snapshots of directory trees, copying one without following links, the difference of two, and removing one."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from .digest import copy_hashing

EntryKind = Literal["file", "dir", "symlink"]


class Entry(BaseModel):
    """One file, directory or symlink, relative to its tree's root."""

    path: str
    kind: EntryKind
    size: int = 0
    sha256: str | None = None
    target: str | None = None
    """A symlink's target."""
    executable: bool = False


class WorkspaceChanges(BaseModel):
    """Files the replay added, changed and removed in the workspace (directories end with ``/``)."""

    added: list[str] = []
    changed: list[str] = []
    removed: list[str] = []
    complete: bool = True
    """False when collection was truncated: ``removed`` is then left empty."""


def _fingerprint(entry: Entry) -> tuple[str, str | None, bool]:
    return entry.kind, entry.sha256 if entry.kind == "file" else entry.target, entry.executable


def diff_trees(before: list[Entry], after: list[Entry], *, complete: bool = True) -> WorkspaceChanges:
    """Compare two snapshots by kind, content (or link target) and executable bit."""

    def keyed(entries: list[Entry]) -> dict[str, Entry]:
        return {e.path + ("/" if e.kind == "dir" else ""): e for e in entries}

    old, new = keyed(before), keyed(after)
    return WorkspaceChanges(
        added=sorted(set(new) - set(old)),
        changed=sorted(p for p in set(new) & set(old) if _fingerprint(new[p]) != _fingerprint(old[p])),
        removed=sorted(set(old) - set(new)) if complete else [],
        complete=complete,
    )


def copy_tree(source: Path, dest: Path, *, uid: int | None = None, gid: int | None = None) -> list[Entry]:
    """Copy ``source`` into the new directory ``dest`` without following links; return its snapshot.

    Symlinks are copied as links; devices, FIFOs and sockets are left out. With ``uid``/``gid`` every
    copied entry is given that owner (the sandbox user).
    """
    entries: list[Entry] = []
    dest.mkdir(mode=0o755)
    _own(dest, uid, gid)

    def walk(directory: Path, relative: str) -> None:
        with os.scandir(directory) as listing:
            items = sorted(listing, key=lambda e: e.name)
        for item in items:
            rel = f"{relative}{item.name}"
            target = dest / rel
            info = item.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                link = os.readlink(item.path)
                os.symlink(link, target)
                entries.append(Entry(path=rel, kind="symlink", target=link))
            elif stat.S_ISDIR(info.st_mode):
                target.mkdir(mode=0o755)
                entries.append(Entry(path=rel, kind="dir"))
                walk(Path(item.path), rel + "/")
            elif stat.S_ISREG(info.st_mode):
                entries.append(_copy_file(Path(item.path), target, rel, info.st_mode))
            else:
                continue
            _own(target, uid, gid)

    walk(source, "")
    return entries


def _copy_file(source: Path, target: Path, relative: str, mode: int) -> Entry:
    executable = bool(mode & 0o111)
    with source.open("rb") as reader, target.open("xb") as writer:
        size, digest = copy_hashing(reader, writer)
    target.chmod(0o755 if executable else 0o644)
    return Entry(path=relative, kind="file", size=size, sha256=digest, executable=executable)


def _own(path: Path, uid: int | None, gid: int | None) -> None:
    if uid is not None:
        os.chown(path, uid, gid if gid is not None else uid, follow_symlinks=False)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give ``root`` and everything under it (links themselves, not their targets) to ``uid:gid``."""
    os.chown(root, uid, gid)
    for directory, children, files in os.walk(root):
        for name in (*children, *files):
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


def remove_tree(root: Path) -> None:
    """Delete a directory tree, whatever a sandbox did to the directory permissions inside it."""
    if not root.exists():
        return
    os.chmod(root, 0o700)
    for directory, children, _ in os.walk(root):  # top-down: children are unlocked before the descent
        for child in children:
            path = os.path.join(directory, child)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(root)


def remove_if_empty(path: Path) -> None:
    """Remove the directory ``path`` again if nothing was put in it (a run directory nothing ran in)."""
    with contextlib.suppress(OSError):
        path.rmdir()
