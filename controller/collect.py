"""Collect stage: bring files out of a sandbox safely, and say what the replay changed.

Everything a sandbox produced is untrusted. :func:`extract_tar` unpacks a tar stream (as the engine's
archive API returns it) into one destination directory and never writes outside it:

* member names that are absolute, contain ``..`` or pass through a symlink are skipped;
* symlinks are kept only when relative and resolving inside the destination; hard links only when
  they name a regular file already extracted (the content is copied);
* devices, FIFOs and sockets are skipped; set-uid/set-gid/sticky bits are dropped;
* a byte budget shared by all trees of one run caps the total: a file that no longer fits is skipped
  (and listed), smaller ones after it may still be collected, and the report says ``truncated``.

Every skipped member is reported with its reason. :func:`diff_trees` compares the workspace before and
after the replay.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel

_COPY_CHUNK = 1024 * 1024
#: Most entries one run may collect (a million tiny files is a denial of service, not an artifact).
MAX_ENTRIES = 200_000
#: Most skipped members listed one by one in a report.
MAX_SKIPPED = 1000

EntryKind = Literal["file", "dir", "symlink"]


class Entry(BaseModel):
    """One collected file, directory or symlink, relative to its tree's root."""

    path: str
    kind: EntryKind
    size: int = 0
    sha256: str | None = None
    target: str | None = None
    """A symlink's target."""
    executable: bool = False


class Skipped(BaseModel):
    """A member that was not collected, and why."""

    path: str
    reason: str


class ExtractReport(BaseModel):
    """What one extraction wrote, skipped and whether the budget cut it short."""

    entries: list[Entry] = []
    skipped: list[Skipped] = []
    truncated: bool = False
    bytes: int = 0


class Budget:
    """Bytes and entries still allowed for one run (shared by its trees)."""

    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES) -> None:
        self.bytes = max_bytes
        self.entries = max_entries
        self.exhausted = False


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (the engine's archive stream)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size


def tar_stream(chunks: Iterable[bytes]) -> IO[bytes]:
    """Wrap an iterator of byte chunks as a buffered binary file for :func:`extract_tar`."""
    return io.BufferedReader(_ChunkReader(chunks), buffer_size=_COPY_CHUNK)


def strip_first(name: str) -> str | None:
    """Member-name mapper for the engine's archives: drop the top directory (the archived path)."""
    parts = name.split("/", 1)
    return parts[1] if len(parts) == 2 and parts[1] else None


def _safe_relative(name: str) -> str | None:
    """A normalised relative path, or None when the name is absolute, escapes or is empty."""
    if not name or name.startswith("/") or "\0" in name:
        return None
    normal = posixpath.normpath(name)
    if normal in (".", "") or normal == ".." or normal.startswith("../"):
        return None
    if any(part == ".." for part in name.split("/")):
        return None
    return normal


class _Extractor:
    def __init__(self, dest: Path, budget: Budget) -> None:
        self.dest = dest
        self.budget = budget
        self.report = ExtractReport()
        self.files: dict[str, Path] = {}

    def skip(self, path: str, reason: str) -> None:
        if len(self.report.skipped) < MAX_SKIPPED:
            self.report.skipped.append(Skipped(path=path, reason=reason))
        elif len(self.report.skipped) == MAX_SKIPPED:
            self.report.skipped.append(Skipped(path="...", reason="more members skipped; not listed"))

    def parent_ok(self, relative: str) -> Path | None:
        """Create the parent directories of ``relative``; None if one of them is not a real directory."""
        current = self.dest
        for part in Path(relative).parent.parts:
            current = current / part
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                os.mkdir(current, 0o755)
                continue
            if not stat.S_ISDIR(mode):
                return None
        return self.dest / relative

    def clear(self, target: Path) -> None:
        """Remove whatever an earlier member left at ``target`` (never following a link)."""
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            return
        os.unlink(target)

    def take_entry(self) -> bool:
        if self.budget.entries <= 0:
            self.budget.exhausted = True
            return False
        self.budget.entries -= 1
        return True

    def directory(self, relative: str, target: Path) -> None:
        if os.path.islink(target) or (os.path.lexists(target) and not os.path.isdir(target)):
            os.unlink(target)
        os.makedirs(target, mode=0o755, exist_ok=True)
        self.report.entries.append(Entry(path=relative, kind="dir"))

    def regular(self, relative: str, target: Path, source: IO[bytes], size: int, mode: int) -> bool:
        if size > self.budget.bytes:
            self.budget.exhausted = True
            self.skip(relative, f"size cap reached ({size} bytes would exceed the collect limit)")
            return False
        self.clear(target)
        digest = hashlib.sha256()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        executable = bool(mode & 0o111)
        fd = os.open(target, flags, 0o755 if executable else 0o644)
        written = 0
        with os.fdopen(fd, "wb") as sink:
            while chunk := source.read(_COPY_CHUNK):
                sink.write(chunk)
                digest.update(chunk)
                written += len(chunk)
        self.budget.bytes -= written
        self.report.bytes += written
        self.files[relative] = target
        self.report.entries.append(
            Entry(path=relative, kind="file", size=written, sha256=digest.hexdigest(), executable=executable)
        )
        return True

    def symlink(self, relative: str, target: Path, link: str) -> None:
        if link.startswith("/"):
            self.skip(relative, f"symlink to an absolute path ({link})")
            return
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(relative), link))
        if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
            self.skip(relative, f"symlink points outside the collected tree ({link})")
            return
        self.clear(target)
        if os.path.isdir(target) and not os.path.islink(target):
            self.skip(relative, "symlink would replace a directory")
            return
        os.symlink(link, target)
        self.report.entries.append(Entry(path=relative, kind="symlink", target=link))

    def hardlink(self, relative: str, target: Path, linked: str | None) -> None:
        source = self.files.get(linked) if linked else None
        if source is None:
            self.skip(relative, "hard link to a file outside the collected tree")
            return
        with source.open("rb") as handle:
            self.regular(relative, target, handle, source.stat().st_size, source.stat().st_mode)


def extract_tar(
    stream: IO[bytes],
    dest: Path,
    budget: Budget,
    *,
    mapper: Callable[[str], str | None] = strip_first,
) -> ExtractReport:
    """Unpack the tar ``stream`` into ``dest`` safely (see the module docstring).

    ``mapper`` turns a member name into a path relative to ``dest`` (None: not part of this tree).
    """
    dest.mkdir(parents=True, exist_ok=True)
    work = _Extractor(dest, budget)
    try:
        archive = tarfile.open(fileobj=stream, mode="r|")  # noqa: SIM115 (closed by the `with` below)
    except tarfile.ReadError:
        work.report.skipped.append(Skipped(path=".", reason="not a tar archive"))
        return work.report
    with archive:
        for member in archive:
            if member.name.startswith("/"):
                work.skip(member.name, "absolute path")
                continue
            mapped = mapper(member.name)
            if mapped is None:
                continue
            relative = _safe_relative(mapped)
            if relative is None or _safe_relative(member.name) is None:
                work.skip(member.name, "path escapes the collected tree")
                continue
            if not work.take_entry():
                work.report.truncated = True
                work.skip(relative, "entry cap reached")
                break
            target = work.parent_ok(relative)
            if target is None:
                work.skip(relative, "a parent directory is a symlink or a file")
                continue
            if member.isdir():
                work.directory(relative, target)
            elif member.isfile():
                source = archive.extractfile(member)
                assert source is not None
                if not work.regular(relative, target, source, member.size, member.mode):
                    work.report.truncated = True
            elif member.issym():
                work.symlink(relative, target, member.linkname)
            elif member.islnk():
                linked = mapper(member.linkname)
                work.hardlink(relative, target, _safe_relative(linked) if linked else None)
            elif member.ischr() or member.isblk():
                work.skip(relative, "device file")
            elif member.isfifo():
                work.skip(relative, "FIFO")
            else:
                work.skip(relative, f"unsupported member type {member.type!r}")
    return work.report


# -- workspace snapshots and their difference ------------------------------------------------------------


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
    """Compare two workspace snapshots by kind, content (or link target) and executable bit."""

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
    digest = hashlib.sha256()
    size = 0
    executable = bool(mode & 0o111)
    with source.open("rb") as reader, target.open("xb") as writer:
        while chunk := reader.read(_COPY_CHUNK):
            writer.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    target.chmod(0o755 if executable else 0o644)
    return Entry(path=relative, kind="file", size=size, sha256=digest.hexdigest(), executable=executable)


def _own(path: Path, uid: int | None, gid: int | None) -> None:
    if uid is not None:
        os.chown(path, uid, gid if gid is not None else uid, follow_symlinks=False)


def hash_file(path: Path) -> tuple[int, str]:
    """Size and sha256 of a file on the host."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_COPY_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
