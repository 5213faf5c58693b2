"""A workspace's changes as one patch: what turns the workspace the replay started from into the one it ended
with, in git's format (``git apply`` takes it, and ``patch -p1`` its text parts).

Written here rather than by running ``git diff``: the host need not have git, a workspace need not be a
repository, and a repository's own history (``.git/``, commits the replay made) is not what changed in the
working tree. The patch compares the two snapshots the run already has (the workspace as staged, the
workspace as the sandbox left it), file by file: text as unified diffs (difflib, lines split at ``\\n`` only, as
git splits them), anything else as git's binary literal, with the full blob ids ``git apply`` asks binary patches
for. A path is C-quoted as git quotes it when it holds a control character, a quote, a backslash or anything
beyond ASCII, so no name can forge a header line. Every ``.git`` directory (nested ones too) is left out, and
a file larger than :data:`FILE_LIMIT`, or one past the byte budget, is left out with a comment line
(``git apply`` reads text before a ``diff --git`` line as a comment); the file itself is still collected.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import re
import zlib
from pathlib import Path
from typing import IO

from .trees import Entry

#: The most bytes of one file (before or after) the patch takes in.
FILE_LIMIT = 1024 * 1024
#: The length character of a binary patch line, for 1..52 bytes.
_LENGTHS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NULL = "0" * 40
_LINES = re.compile(r"[^\n]*\n|[^\n]+\Z")
_ESCAPES = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r",
            '"': '\\"', "\\": "\\\\"}  # fmt: skip


def write_patch(
    before: list[Entry], after: list[Entry], original: Path | None, final: Path, sink: IO[bytes], budget: int
) -> int:
    """Write to ``sink`` the patch from the files of ``before`` (their contents under ``original``; None: the
    workspace started empty) to those of ``after`` (under ``final``), within ``budget`` bytes. Returns the bytes
    written."""
    old = {e.path: e for e in before if e.kind != "dir" and not _in_git(e.path)}
    new = {e.path: e for e in after if e.kind != "dir" and not _in_git(e.path)}
    written = 0
    for path in sorted(old.keys() | new.keys()):
        a, b = old.get(path), new.get(path)
        if a is not None and b is not None and _same(a, b):
            continue
        chunk = _changed(path, a, b, original, final)
        if written + len(chunk) > budget:
            chunk = _note(path, "past the collect limit")
            if written + len(chunk) > budget:
                break
        sink.write(chunk)
        written += len(chunk)
    return written


def _changed(path: str, a: Entry | None, b: Entry | None, original: Path | None, final: Path) -> bytes:
    if (a is not None and a.size > FILE_LIMIT) or (b is not None and b.size > FILE_LIMIT):
        return _note(path, f"larger than {FILE_LIMIT // 1024} KiB")
    before = _content(original, a)
    if a is not None and a.kind == "file" and hashlib.sha256(before or b"").hexdigest() != a.sha256:
        return _note(path, "changed where the workspace was copied from since the replay began")
    after = _content(final, b)
    if a is not None and b is not None and a.kind != b.kind:  # a file became a link, or the other way round
        return _file_patch(path, a, before, None, None) + _file_patch(path, None, None, b, after)
    return _file_patch(path, a, before, b, after)


def _note(path: str, why: str) -> bytes:
    return f"# {_quoted(path)}: {why}; left out of this patch\n".encode()


def _in_git(path: str) -> bool:
    return ".git" in path.split("/")


def _same(a: Entry, b: Entry) -> bool:
    return (a.kind, a.sha256, a.target, a.executable) == (b.kind, b.sha256, b.target, b.executable)


def _content(root: Path | None, entry: Entry | None) -> bytes | None:
    if entry is None:
        return None
    if entry.kind == "symlink":
        return (entry.target or "").encode()
    if root is None:
        return b""
    return (root / entry.path).read_bytes()


def _mode(entry: Entry) -> str:
    if entry.kind == "symlink":
        return "120000"
    return "100755" if entry.executable else "100644"


def _blob(data: bytes) -> str:
    """git's object id of a blob."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _quoted(name: str) -> str:
    """``name`` as git writes it in a patch: as it is, or C-quoted when it needs to be."""
    if all(32 <= ord(c) < 127 and c not in '"\\' for c in name):
        return name
    out = []
    for c in name:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif 32 <= ord(c) < 127:
            out.append(c)
        else:
            out.extend(f"\\{byte:03o}" for byte in c.encode("utf-8", errors="surrogateescape"))
    return '"' + "".join(out) + '"'


def _side(prefix: str, path: str) -> str:
    return _quoted(f"{prefix}/{path}")


def _file_patch(path: str, a: Entry | None, old: bytes | None, b: Entry | None, new: bytes | None) -> bytes:
    head = [f"diff --git {_side('a', path)} {_side('b', path)}"]
    if a is None and b is not None:
        head.append(f"new file mode {_mode(b)}")
    elif b is None and a is not None:
        head.append(f"deleted file mode {_mode(a)}")
    elif a is not None and b is not None and _mode(a) != _mode(b):
        head += [f"old mode {_mode(a)}", f"new mode {_mode(b)}"]
    old_bytes, new_bytes = old or b"", new or b""
    old_id = _blob(old_bytes) if a is not None else _NULL
    new_id = _blob(new_bytes) if b is not None else _NULL
    mode = f" {_mode(a)}" if a is not None and b is not None and _mode(a) == _mode(b) else ""
    head.append(f"index {old_id}..{new_id}{mode}")
    if old_bytes == new_bytes:  # a mode change only, or an empty file
        return ("\n".join(head) + "\n").encode()
    old_text, new_text = _text(old_bytes), _text(new_bytes)
    if old_text is None or new_text is None:
        body = ["GIT binary patch", *_literal(new_bytes), "", *_literal(old_bytes), ""]
        return ("\n".join(head + body) + "\n").encode()
    source = _side("a", path) if a is not None else "/dev/null"
    target = _side("b", path) if b is not None else "/dev/null"
    diff = difflib.unified_diff(_LINES.findall(old_text), _LINES.findall(new_text), source, target)
    return ("\n".join(head) + "\n").encode() + "".join(_newline(line) for line in diff).encode()


def _text(data: bytes) -> str | None:
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _newline(line: str) -> str:
    """A diff line ending as diff's do: a last line without a newline says so."""
    return line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def _literal(data: bytes) -> list[str]:
    """git's ``literal`` hunk: the zlib-compressed bytes in base85 lines of up to 52 bytes each."""
    packed = zlib.compress(data, 9)
    lines = [f"literal {len(data)}"]
    for start in range(0, len(packed), 52):
        piece = packed[start : start + 52]
        lines.append(_LENGTHS[len(piece) - 1] + base64.b85encode(piece, pad=True).decode())
    return lines
