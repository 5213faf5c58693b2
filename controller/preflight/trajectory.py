"""Host-side checks of a native trajectory file, before pvisor or any container sees it.

pvisor itself validates the format (see :mod:`pvisor_host.preflight.hostpvisor`); this module catches what it
reports poorly or late: a missing, empty, binary or oversized file, and a trajectory of another agent.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..files.digest import copy_hashing
from ..models.profiles import AgentProfile
from ..models.replay import TrajectoryInfo

#: pvisor 0.3.1 refuses trajectories above this size (``io.rs``).
MAX_TRAJECTORY_BYTES = 256 * 1024 * 1024
#: How many JSON objects sniffing and workspace hints look at.
_SNIFF_OBJECTS = 200


def _fail(path: Path, problem: str, hint: str | None = None) -> UsageError:
    return UsageError(f"trajectory {path}: {problem}", hint=hint)


def check_stat(path: Path) -> tuple[Path, int]:
    """The cheap half of :func:`check_file` (no read): an existing, non-empty regular file of at most 256 MiB.

    Returns the absolute path and the size. Raises :class:`UsageError` saying what is wrong otherwise.
    """
    path = path.expanduser().absolute()
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _fail(path, "does not exist") from None
    except OSError as exc:
        raise _fail(path, f"cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise _fail(path, "is a directory", "pass the native trajectory file itself")
    if not stat.S_ISREG(info.st_mode):
        raise _fail(path, "is not a regular file")
    if info.st_size == 0:
        raise _fail(path, "is empty")
    if info.st_size > MAX_TRAJECTORY_BYTES:
        raise _fail(
            path, f"is {info.st_size / 2**20:.0f} MiB; pvisor accepts at most {MAX_TRAJECTORY_BYTES // 2**20} MiB"
        )
    return path, info.st_size


def check_file(path: Path) -> TrajectoryInfo:
    """Check that ``path`` is a readable, non-empty regular UTF-8 text file of at most 256 MiB.

    Returns its size and sha256. Raises :class:`UsageError` saying what is wrong otherwise.
    """
    path, size = check_stat(path)
    text = _TextCheck(path)
    try:
        with path.open("rb") as handle:
            _, sha256 = copy_hashing(handle, text)
    except PermissionError:
        raise _fail(path, "is not readable (permission denied)") from None
    text.finish()
    return TrajectoryInfo(path=path, size=size, sha256=sha256)


class _TextCheck:
    """A sink for :func:`copy_hashing` that refuses the file at the first NUL byte or invalid UTF-8."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.offset = 0

    def write(self, chunk: bytes) -> None:
        self._check(chunk)
        self.offset += len(chunk)

    def finish(self) -> None:
        self._check(b"", final=True)

    def _check(self, chunk: bytes, final: bool = False) -> None:
        nul = chunk.find(b"\0")
        if nul >= 0:
            raise _fail(
                self.path,
                f"is binary (NUL byte at offset {self.offset + nul})",
                "pass a native trajectory (JSON or JSONL text)",
            )
        try:
            self.decoder.decode(chunk, final)
        except UnicodeDecodeError as exc:
            raise _fail(
                self.path,
                f"is not UTF-8 text (invalid byte near offset {self.offset + exc.start})",
                "pass a native trajectory",
            ) from None


def _objects(path: Path, limit: int = _SNIFF_OBJECTS) -> Iterator[dict[str, Any]]:
    """The first JSON objects of a JSONL file, or the elements of a JSON document; bad lines are skipped."""
    with path.open("r", encoding="utf-8") as handle:
        head = handle.read(1)
        handle.seek(0)
        if head in "[{":
            first_line = handle.readline()
            handle.seek(0)
            try:
                json.loads(first_line)
            except ValueError:
                yield from _document_objects(handle.read(), limit)
                return
        for count, line in enumerate(handle):
            if count >= limit:
                return
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                yield value


def _document_objects(text: str, limit: int) -> Iterator[dict[str, Any]]:
    try:
        value = json.loads(text)
    except ValueError:
        return
    items = value if isinstance(value, list) else [value]
    yield from (item for item in items[:limit] if isinstance(item, dict))


def _lookup(obj: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    current: Any = obj
    for key in dotted.split("."):
        if not isinstance(current, dict) or key not in current:
            return False, None
        current = current[key]
    return True, current


def _rule_holds(obj: dict[str, Any], rule: str) -> bool:
    key, sep, expected = rule.partition("=")
    found, value = _lookup(obj, key)
    return found and (not sep or value == expected)


def sniff(path: Path, profiles: dict[str, AgentProfile]) -> set[str]:
    """The agents whose trajectory fingerprint one of the first objects of ``path`` matches (read once per
    version of the file: a dataset asks once per boundary)."""
    info = path.stat()
    key = tuple((name, profile.trajectory.fingerprint_key) for name, profile in sorted(profiles.items()))
    return set(_sniffed(path.absolute(), info.st_size, info.st_mtime_ns, key))


@functools.lru_cache(maxsize=16384)
def _sniffed(path: Path, size: int, mtime_ns: int, fingerprints: tuple[tuple[str, str], ...]) -> frozenset[str]:
    rules = {name: json.loads(key) for name, key in fingerprints}
    matches: set[str] = set()
    for obj in _objects(path):
        for name, sets in rules.items():
            if any(all(_rule_holds(obj, rule) for rule in rule_set) for rule_set in sets):
                matches.add(name)
    return frozenset(matches)


def detect_agent(path: Path, profiles: dict[str, AgentProfile]) -> str:
    """The agent whose native format ``path`` is, from the profiles' fingerprints.

    Raises:
        UsageError: no profile's fingerprint matches, or more than one does (one line, naming them).
    """
    found = sniff(path, profiles)
    if len(found) == 1:
        return found.pop()
    if found:
        names = ", ".join(sorted(found))
        raise _fail(
            path, f"could be a trajectory of {names}; pass agent explicitly", f"pass --agent {sorted(found)[0]}"
        )
    raise _fail(
        path,
        f"is no trajectory format pvisor replays (none of {', '.join(sorted(profiles))})",
        "pass agent explicitly if it is one",
    )


def check_agent(path: Path, profile: AgentProfile, profiles: dict[str, AgentProfile]) -> None:
    """Refuse a trajectory that is recognisably another agent's format."""
    found = sniff(path, profiles)
    if found and profile.agent not in found:
        other = ", ".join(sorted(found))
        raise _fail(
            path,
            f"looks like a {other} trajectory, not {profile.agent} ({profile.trajectory.description})",
            f"pass --agent {sorted(found)[0]}" if len(found) == 1 else None,
        )


def recorded_workspace(path: Path, profile: AgentProfile) -> str | None:
    """The working directory the recording ran in, from the profile's ``workspace_hint`` keys."""
    if not profile.trajectory.workspace_hint:
        return None
    info = path.stat()
    return _workspace(path.absolute(), info.st_size, info.st_mtime_ns, tuple(profile.trajectory.workspace_hint))


@functools.lru_cache(maxsize=16384)
def _workspace(path: Path, size: int, mtime_ns: int, hints: tuple[str, ...]) -> str | None:
    for obj in _objects(path):
        for key in hints:
            found, value = _lookup(obj, key)
            if found and isinstance(value, str) and value.startswith("/"):
                return os.path.normpath(value)
    return None


def recorded_version(path: Path, profile: AgentProfile) -> str | None:
    """The version of the agent that recorded the trajectory, from the profile's ``version_hint`` keys."""
    for obj in _objects(path):
        for key in profile.trajectory.version_hint:
            found, value = _lookup(obj, key)
            if found and isinstance(value, str) and value:
                return value
    return None
