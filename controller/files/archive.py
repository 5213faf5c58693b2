"""Safe extraction of untrusted trees: what a sandbox leaves behind, or what an image holds.

Everything a sandbox produced is untrusted. :func:`extract_tar` unpacks a tar stream (as the engine's
archive API returns it) into one destination directory and never writes outside it; :func:`harvest_tree`
does the same for a directory the sandbox wrote through a bind mount, read on the host after it stopped:
each entry, seen with ``lstat`` and never followed, is judged as the archive member it would be.

* Each member is judged by :func:`tarfile.data_filter`, Python's own policy for data archives, against a
  stand-in destination that does not exist on disk, so the verdict depends on the archive alone: names that
  escape with ``..``, absolute links, links resolving outside the tree, devices, FIFOs and other special
  files are refused, and set-uid, set-gid and sticky bits are dropped. Absolute member names are refused
  too (the filter would quietly make them relative).
* What is already on disk is guarded here: nothing is written through a symlink (every parent must be a
  real directory, files are created with ``O_EXCL | O_NOFOLLOW``), a later member replaces a link instead
  of following it, and a hard link is kept only when it names a regular file this extraction already wrote
  (its content is copied, never linked).
* A byte budget shared by all trees of one run caps the total: a file that no longer fits is skipped (and
  listed), smaller ones after it may still be collected, and the report says ``truncated``. An entry budget
  caps the number of members.

Every skipped member is reported with its reason.
"""

from __future__ import annotations

import functools
import io
import os
import posixpath
import stat
import tarfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from pydantic import BaseModel

from .digest import CHUNK, copy_hashing
from .trees import Entry

#: Most entries one run may collect (a million tiny files is a denial of service, not an artifact).
MAX_ENTRIES = 200_000
#: Most skipped members listed one by one in a report.
MAX_SKIPPED = 1000
# Where data_filter imagines the tree: a path that does not exist, so no link on this host can sway it.
_JUDGED_AT = f"/pvisor-host-archive-{uuid.uuid4().hex}"


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
    return io.BufferedReader(_ChunkReader(chunks), buffer_size=CHUNK)


def strip_first(name: str) -> str | None:
    """Member-name mapper for the engine's archives: drop the top directory (the archived path)."""
    parts = name.split("/", 1)
    return parts[1] if len(parts) == 2 and parts[1] else None


def _refusal(member: tarfile.TarInfo, error: tarfile.FilterError) -> str:
    """Our words for data_filter's verdict on ``member``."""
    if isinstance(error, tarfile.OutsideDestinationError | tarfile.AbsolutePathError):
        return "path escapes the collected tree"
    if member.islnk():
        return "hard link to a file outside the collected tree"
    if isinstance(error, tarfile.AbsoluteLinkError):
        return f"symlink to an absolute path ({member.linkname})"
    if isinstance(error, tarfile.LinkOutsideDestinationError):
        return f"symlink points outside the collected tree ({member.linkname})"
    if member.ischr() or member.isblk():
        return "device file"
    if member.isfifo():
        return "FIFO"
    return f"unsupported member type {member.type!r}"


class _Extractor:
    def __init__(self, dest: Path, budget: Budget, mapper: Callable[[str], str | None]) -> None:
        self.dest = dest
        self.budget = budget
        self.mapper = mapper
        self.report = ExtractReport()
        self.files: dict[str, Path] = {}

    def skip(self, path: str, reason: str) -> None:
        if len(self.report.skipped) < MAX_SKIPPED:
            self.report.skipped.append(Skipped(path=path, reason=reason))
        elif len(self.report.skipped) == MAX_SKIPPED:
            self.report.skipped.append(Skipped(path="...", reason="more members skipped; not listed"))

    def judge(self, member: tarfile.TarInfo) -> tuple[str, tarfile.TarInfo] | None:
        """The member's safe relative path and data_filter's sanitised copy of it; None when skipped."""
        if member.name.startswith("/"):
            self.skip(member.name, "absolute path")
            return None
        mapped = self.mapper(member.name)
        if mapped is None:
            return None
        if mapped.startswith("/"):
            self.skip(member.name, "path escapes the collected tree")
            return None
        try:
            tarfile.data_filter(tarfile.TarInfo(member.name), _JUDGED_AT)  # the name as the archive gave it
            judged = tarfile.data_filter(member.replace(name=mapped, deep=False), _JUDGED_AT)
        except tarfile.FilterError as error:
            escaped = isinstance(error, tarfile.OutsideDestinationError | tarfile.AbsolutePathError)
            self.skip(member.name if escaped else posixpath.normpath(mapped), _refusal(member, error))
            return None
        relative = posixpath.normpath(mapped)
        return (relative, judged) if relative != "." else None

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
        _clear(target)
        executable = bool(mode & 0o100)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o755 if executable else 0o644)
        with os.fdopen(fd, "wb") as sink:
            written, digest = copy_hashing(source, sink)
        self.budget.bytes -= written
        self.report.bytes += written
        self.files[relative] = target
        self.report.entries.append(
            Entry(path=relative, kind="file", size=written, sha256=digest, executable=executable)
        )
        return True

    def symlink(self, relative: str, target: Path, link: str) -> None:
        _clear(target)
        if os.path.isdir(target) and not os.path.islink(target):
            self.skip(relative, "symlink would replace a directory")
            return
        os.symlink(link, target)
        self.report.entries.append(Entry(path=relative, kind="symlink", target=link))

    def hardlink(self, relative: str, target: Path, linkname: str) -> bool:
        mapped = self.mapper(linkname)
        source = self.files.get(posixpath.normpath(mapped)) if mapped else None
        if source is None:
            self.skip(relative, "hard link to a file outside the collected tree")
            return True
        with source.open("rb") as handle:
            return self.regular(relative, target, handle, source.stat().st_size, source.stat().st_mode)

    def member(self, member: tarfile.TarInfo, content: Callable[[], IO[bytes]]) -> bool:
        """Extract one member (``content`` opens a regular file's bytes); False when the entry cap ends it."""
        verdict = self.judge(member)
        if verdict is None:
            return True
        relative, judged = verdict
        if not self.take_entry():
            self.report.truncated = True
            self.skip(relative, "entry cap reached")
            return False
        target = self.parent_ok(relative)
        if target is None:
            self.skip(relative, "a parent directory is a symlink or a file")
        elif judged.isdir():
            self.directory(relative, target)
        elif judged.isreg():
            with content() as source:
                if not self.regular(relative, target, source, member.size, judged.mode):
                    self.report.truncated = True
        elif judged.issym():
            self.symlink(relative, target, judged.linkname)
        elif judged.islnk() and not self.hardlink(relative, target, judged.linkname):
            self.report.truncated = True
        return True


def _clear(target: Path) -> None:
    """Remove whatever an earlier member left at ``target`` (never following a link); keep directories."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        os.unlink(target)


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
    work = _Extractor(dest, budget, mapper)
    try:
        archive = tarfile.open(fileobj=stream, mode="r|")  # noqa: SIM115 (closed by the `with` below)
    except tarfile.ReadError:
        work.report.skipped.append(Skipped(path=".", reason="not a tar archive"))
        return work.report
    with archive:
        for member in archive:
            if not work.member(member, functools.partial(_archived, archive, member)):
                break
    return work.report


def _archived(archive: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    source = archive.extractfile(member)
    assert source is not None
    return source


_KINDS = {
    stat.S_IFDIR: tarfile.DIRTYPE,
    stat.S_IFREG: tarfile.REGTYPE,
    stat.S_IFLNK: tarfile.SYMTYPE,
    stat.S_IFCHR: tarfile.CHRTYPE,
    stat.S_IFBLK: tarfile.BLKTYPE,
    stat.S_IFIFO: tarfile.FIFOTYPE,
}


def harvest_tree(root: Path, dest: Path, budget: Budget, *, keep: Callable[[str], bool] | None = None) -> ExtractReport:
    """Copy the untrusted directory tree ``root`` into ``dest``, judged entry by entry exactly as
    :func:`extract_tar` judges an archive's members (see the module docstring). Nothing is followed: a
    symlink is a member like any other, and only real directories are descended into. ``keep``: only the
    entries whose relative path it accepts (their directories are made as they need them).
    """
    dest.mkdir(parents=True, exist_ok=True)

    def mapper(name: str) -> str | None:
        return name if keep is None or keep(name) else None

    work = _Extractor(dest, budget, mapper=mapper)
    for member, path in _members(root):
        if not work.member(member, functools.partial(_open_regular, path)):
            break
    return work.report


def snapshot_tree(root: Path) -> list[Entry]:
    """The untrusted tree ``root`` as :func:`harvest_tree` would list what it copies, without copying: each
    regular file hashed, links as links (never followed), directories the sandbox locked unlocked (we own them),
    devices, FIFOs and sockets left out."""
    entries: list[Entry] = []
    for member, path in _members(root):
        if member.type == tarfile.DIRTYPE:
            entries.append(Entry(path=member.name, kind="dir"))
        elif member.type == tarfile.SYMTYPE:
            entries.append(Entry(path=member.name, kind="symlink", target=member.linkname))
        elif member.type == tarfile.REGTYPE:
            with _open_regular(path) as handle:
                size, digest = copy_hashing(handle)
            entries.append(
                Entry(path=member.name, kind="file", size=size, sha256=digest, executable=bool(member.mode & 0o100))
            )
    return entries


def _members(root: Path) -> Iterator[tuple[tarfile.TarInfo, Path]]:
    """Every entry below ``root`` as a tar member (depth first, by name), with its path."""
    pending = [""]
    while pending:
        relative = pending.pop()
        directory = root / relative if relative else root
        try:
            listing = os.scandir(directory)
        except PermissionError:  # the sandbox locked a directory it owns; as its owner we may unlock it
            os.chmod(directory, 0o700)
            listing = os.scandir(directory)
        with listing:
            entries = sorted(listing, key=lambda e: e.name, reverse=True)
        for entry in reversed(entries):
            info = entry.stat(follow_symlinks=False)
            member = tarfile.TarInfo(f"{relative}{entry.name}")
            member.type = _KINDS.get(stat.S_IFMT(info.st_mode), b"s")  # b"s": a socket, refused as unsupported
            member.mode = stat.S_IMODE(info.st_mode)
            if member.type == tarfile.REGTYPE:
                member.size = info.st_size
            elif member.type == tarfile.SYMTYPE:
                member.linkname = os.readlink(entry.path)
            yield member, Path(entry.path)
            if member.type == tarfile.DIRTYPE:
                pending.append(f"{member.name}/")


def _open_regular(path: Path) -> IO[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except PermissionError:  # a file the sandbox made unreadable; as its owner we may read it again
        os.chmod(path, 0o600)  # a regular file (lstat said so), not a link
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    return os.fdopen(fd, "rb")
