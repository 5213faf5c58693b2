"""A workspace's changes as one patch: what turns the workspace the replay started from into the one it ended
with, in git's format (``git apply`` takes it, and ``patch -p1`` its text parts).

Written here rather than by running ``git diff``: the host need not have git, a workspace need not be a
repository, and a repository's own history (``.git/``, commits the replay made) is not what changed in the
working tree. The patch compares the two snapshots the run already has (the workspace as staged, the
workspace as the sandbox left it), file by file: text as unified diffs (difflib), anything else as git's
binary literal, with the full blob ids ``git apply`` asks binary patches for. ``.git/`` itself is left out.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import zlib
from pathlib import Path

from .trees import Entry

#: The length character of a binary patch line, for 1..52 bytes.
_LENGTHS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NULL = "0" * 40


def workspace_patch(before: list[Entry], after: list[Entry], original: Path | None, final: Path) -> bytes:
    """The patch from the files of ``before`` (their contents under ``original``; None: the workspace started
    empty) to those of ``after`` (under ``final``). Symlinks and modes are patched as git does; directories
    are implied by their files."""
    old = {e.path: e for e in before if e.kind != "dir" and not _in_git(e.path)}
    new = {e.path: e for e in after if e.kind != "dir" and not _in_git(e.path)}
    chunks: list[bytes] = []
    for path in sorted(old.keys() | new.keys()):
        a, b = old.get(path), new.get(path)
        if a is not None and b is not None and _same(a, b):
            continue
        before_bytes = _content(original, a)
        if a is not None and a.kind == "file" and hashlib.sha256(before_bytes or b"").hexdigest() != a.sha256:
            # git apply reads text before a "diff --git" line as a comment
            chunks.append(
                f"# {path}: changed where the workspace was copied from since the replay began; left out\n".encode()
            )
            continue
        chunks.append(_file_patch(path, a, before_bytes, b, _content(final, b)))
    return b"".join(chunks)


def _in_git(path: str) -> bool:
    return path == ".git" or path.startswith(".git/")


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


def _file_patch(path: str, a: Entry | None, old: bytes | None, b: Entry | None, new: bytes | None) -> bytes:
    head = [f"diff --git a/{path} b/{path}"]
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
    if old_bytes == new_bytes:  # a mode change only
        return ("\n".join(head) + "\n").encode()
    old_text, new_text = _text(old_bytes), _text(new_bytes)
    if old_text is None or new_text is None:
        body = ["GIT binary patch", *_literal(new_bytes), "", *_literal(old_bytes), ""]
        return ("\n".join(head + body) + "\n").encode()
    source = f"a/{path}" if a is not None else "/dev/null"
    target = f"b/{path}" if b is not None else "/dev/null"
    lines = list(difflib.unified_diff(old_text.splitlines(True), new_text.splitlines(True), source, target))
    return ("\n".join(head) + "\n").encode() + "".join(_newline(line) for line in lines).encode()


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
