"""A trajectory file, read once: the host checks every replay of it needs, and everything later checks ask of it.

:func:`read_trajectory` reads the file in one pass and returns a :class:`~pvisor_host.models.replay.TrajectoryInfo`:
its size and sha256, that it is UTF-8 text (no NUL byte) of at most 256 MiB, which agents' formats its first
objects match, the working directory and agent version each format records, and an upper bound of its complete
tool batches per agent (what :mod:`.survey` asks pvisor first). A dataset asks for many boundaries of one file:
the value is kept per version of the file (path, size, modification time), so the file is read once however many
items name it. pvisor itself validates the format (:mod:`.hostpvisor`); this module catches what it reports
poorly or late: a missing, empty, binary or oversized file. Which agent's trajectory it is (and whether it is
another agent's than the one asked for) :mod:`.checks` tells from that value.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..files.digest import CHUNK
from ..models.profiles import AgentProfile, all_profiles
from ..models.replay import TrajectoryInfo

#: pvisor 0.3.1 refuses trajectories above this size (``io.rs``).
MAX_TRAJECTORY_BYTES = 256 * 1024 * 1024
#: How many JSON objects sniffing and the workspace and version hints look at.
_SNIFF_OBJECTS = 200
#: File versions whose facts are kept (a few hundred bytes each).
_KEPT = 65536


def _fail(path: Path, problem: str, hint: str | None = None) -> UsageError:
    return UsageError(f"trajectory {path}: {problem}", hint=hint)


def check_stat(path: Path) -> tuple[Path, os.stat_result]:
    """The cheap half of :func:`read_trajectory` (no read): an existing, non-empty regular file of at most 256 MiB.

    Returns the absolute path and its stat. Raises :class:`UsageError` saying what is wrong otherwise.
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
    return path, info


class _Facts:
    """Trajectory facts by file version (path, size, modification time), each read once however many threads ask."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading: dict[tuple[Path, int, int], threading.Lock] = {}
        self._found: OrderedDict[tuple[Path, int, int], TrajectoryInfo] = OrderedDict()

    def get(self, path: Path, info: os.stat_result) -> TrajectoryInfo:
        key = (path, info.st_size, info.st_mtime_ns)
        with self._lock:
            found = self._found.get(key)
            if found is not None:
                return found
            lock = self._reading.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                found = self._found.get(key)
            if found is None:
                found = _read(path, info.st_size)
                with self._lock:
                    self._found[key] = found
                    while len(self._found) > _KEPT:
                        self._found.popitem(last=False)
            with self._lock:
                self._reading.pop(key, None)
            return found


_FACTS = _Facts()


def read_trajectory(path: Path) -> TrajectoryInfo:
    """The trajectory at ``path``, checked and read once (see the module docstring).

    Raises:
        UsageError: it is missing, empty, too large, a directory, unreadable, binary or not UTF-8 (one line).
    """
    path, info = check_stat(path)
    return _FACTS.get(path, info)


def _read(path: Path, size: int) -> TrajectoryInfo:
    """One pass over the file: digest, text checks, and the facts its JSON objects give."""
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    reader = _Objects()
    offset = 0
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                nul = chunk.find(b"\0")
                if nul >= 0:
                    where = f"NUL byte at offset {offset + nul}"
                    raise _fail(path, f"is binary ({where})", "pass a native trajectory (JSON or JSONL text)")
                try:
                    reader.feed(decoder.decode(chunk))
                except UnicodeDecodeError as exc:
                    raise _not_utf8(path, offset + exc.start) from None
                offset += len(chunk)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, offset - len(exc.object) + exc.start) from None
    except PermissionError:
        raise _fail(path, "is not readable (permission denied)") from None
    reader.finish()
    profiles = all_profiles()
    head = reader.head
    return TrajectoryInfo(
        path=path,
        size=size,
        sha256=digest.hexdigest(),
        agents=frozenset(name for name, profile in profiles.items() if _matches(head, profile)),
        cwd={name: found for name, profile in profiles.items() if (found := _workspace(head, profile)) is not None},
        versions={name: found for name, p in profiles.items() if (found := _version(head, p)) is not None},
        bounds={name: count for name, count in reader.bounds().items() if count},
    )


def _not_utf8(path: Path, offset: int) -> UsageError:
    return _fail(path, f"is not UTF-8 text (invalid byte near offset {offset})", "pass a native trajectory")


class _Objects:
    """The JSON objects of a JSONL file, or of one JSON document, as its text arrives: the first ones are kept (for
    sniffing and hints), and every one feeds the upper bounds of the count."""

    def __init__(self) -> None:
        self.head: list[dict[str, Any]] = []
        self._partial = ""
        self._document: list[str] | None = None
        self._first = True
        self._lines = 0
        self._bad = False
        self._only: Any = None
        self._jsonl = _JsonlBounds()

    def feed(self, text: str) -> None:
        if self._document is not None:
            self._document.append(text)
            return
        text = self._partial + text
        lines = text.split("\n")
        self._partial = lines.pop()
        for number, line in enumerate(lines):
            if self._first and line.strip():
                self._first = False
                if line.lstrip()[:1] in "[{" and not _parses(line):  # a JSON document over several lines
                    self._document = ["\n".join(lines[number:]), "\n", self._partial]
                    self._partial = ""
                    return
            self._line(line)

    def finish(self) -> None:
        if self._document is not None:
            try:
                value = json.loads("".join(self._document))
            except ValueError:
                return
            self._only = value
            items = value if isinstance(value, list) else [value]
            self.head = [item for item in items[:_SNIFF_OBJECTS] if isinstance(item, dict)]
            return
        if self._partial:
            self._line(self._partial)
            self._partial = ""

    def _line(self, line: str) -> None:
        if not line.strip():
            return
        try:
            value = json.loads(line)
        except ValueError:
            self._bad = True
            return
        self._lines += 1
        self._only = value if self._lines == 1 else None
        if isinstance(value, dict):
            if len(self.head) < _SNIFF_OBJECTS:
                self.head.append(value)
            self._jsonl.feed(value)

    def bounds(self) -> dict[str, int | None]:
        """Per agent, the upper bound of its complete batches this file allows (None: not to be told)."""
        found: dict[str, int | None] = {} if self._bad or self._document is not None else self._jsonl.counts()
        if self._only is not None:  # one JSON value: a document format's whole trajectory
            for agent, count in _DOCUMENT_BOUNDS.items():
                try:
                    found[agent] = count(self._only)
                except (TypeError, KeyError, AttributeError):
                    found[agent] = None
        return found


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


# -- upper bounds of the count, read from the file ----------------------------------------------------------
#
# Every batch holds at least one tool call, so the file's tool calls bound pvisor's count of complete batches;
# Claude Code's fragments of one response (consecutive on the chain, one message id) count once, SWE-agent's
# count is exact (:mod:`.survey` says how the bound is used).


class _JsonlBounds:
    """The bounds of the JSONL formats, one event at a time."""

    def __init__(self) -> None:
        self.claude = 0
        self._previous: tuple[Any, Any] | None = None
        self.codex = 0
        self.opencode: set[Any] = set()
        self.pi = 0

    def feed(self, event: dict[str, Any]) -> None:
        message = event.get("message") if event.get("type") == "assistant" else None
        content = message.get("content") if isinstance(message, dict) else None
        tools = isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_use" for b in content)
        same_response = (
            self._previous is not None
            and isinstance(message, dict)
            and message.get("id") == self._previous[0]
            and event.get("parentUuid") == self._previous[1]
        )
        if tools and not same_response:
            self.claude += 1
        self._previous = (message.get("id"), event.get("uuid")) if isinstance(message, dict) and tools else None
        payload = event.get("payload")
        if isinstance(payload, dict) and payload.get("type") in ("function_call", "custom_tool_call"):
            self.codex += 1
        part = event.get("part")
        if event.get("type") == "tool_use" and isinstance(part, dict):
            self.opencode.add(part.get("callID"))
        if event.get("type") == "turn_end":
            self.pi += 1

    def counts(self) -> dict[str, int | None]:
        return {"claude-code": self.claude, "codex": self.codex, "opencode": len(self.opencode), "pi-agent": self.pi}


def _mini(document: Any) -> int:
    return sum(1 for message in document["messages"] if isinstance(message, dict))


def _openhands(document: Any) -> int:
    return sum(1 for event in document if isinstance(event, dict) and "action" in event)


def _swe(document: Any) -> int:
    assistant = sum(1 for entry in document["history"] if isinstance(entry, dict) and entry.get("role") == "assistant")
    return min(len(document["trajectory"]), assistant)


_DOCUMENT_BOUNDS: dict[str, Callable[[Any], int]] = {
    "mini-swe-agent": _mini,
    "openhands": _openhands,
    "swe-agent": _swe,
}


# -- what the first objects say -------------------------------------------------------------------------------


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


def _matches(head: Iterable[dict[str, Any]], profile: AgentProfile) -> bool:
    sets = profile.trajectory.fingerprint
    return any(any(all(_rule_holds(obj, rule) for rule in rule_set) for rule_set in sets) for obj in head)


def _first(head: Iterable[dict[str, Any]], keys: list[str]) -> Iterator[str]:
    for obj in head:
        for key in keys:
            found, value = _lookup(obj, key)
            if found and isinstance(value, str) and value:
                yield value


def _workspace(head: list[dict[str, Any]], profile: AgentProfile) -> str | None:
    found = (os.path.normpath(v) for v in _first(head, profile.trajectory.workspace_hint) if v.startswith("/"))
    return next(found, None)


def _version(head: list[dict[str, Any]], profile: AgentProfile) -> str | None:
    return next(_first(head, profile.trajectory.version_hint), None)
