"""``workspace.patch``: git's format, applied by the real ``git apply`` to a copy of the starting workspace, for
what a replay can leave: text with carriage returns and form feeds, names with tabs, newlines and non-ASCII,
a file turned into a link, a nested repository, a binary, a file too large for a patch."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pvisor_host.files.archive import snapshot_tree
from pvisor_host.files.patch import FILE_LIMIT, write_patch

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patch")


def tree(root: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if ".git" in relative.parts or path.is_dir() and not path.is_symlink():
            continue
        found[str(relative)] = os.readlink(path) if path.is_symlink() else (path.read_bytes(), os.access(path, os.X_OK))
    return found


def patched(before: Path, after: Path, budget: int = 10**9) -> tuple[Path, bytes]:
    patch = before.parent / "w.patch"
    with patch.open("wb") as sink:
        write_patch(snapshot_tree(before), snapshot_tree(after), before, after, sink, budget)
    copy = before.parent / "applied"
    shutil.copytree(before, copy, symlinks=True)
    subprocess.run(["git", "init", "-q", "."], cwd=copy, check=True)
    done = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=copy, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return copy, patch.read_bytes()


def test_what_a_replay_can_leave_applies_exactly(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "sub" / ".git").mkdir(parents=True)
    (a / "cr.txt").write_bytes(b"one\rtwo\nthree\fx\n")
    (b / "cr.txt").write_bytes(b"one\rTWO\nthree\fy\n")
    (a / "tab\tname.txt").write_text("x\n")
    (b / "tab\tname.txt").write_text("y\n")
    (b / "new\nline.txt").write_text("k\n")
    (a / "tolink").write_text("f\n")
    (b / "tolink").symlink_to("cr.txt")
    (a / "sub" / ".git" / "index").write_text("i\n")
    (b / "sub" / ".git" / "index").write_text("j\n")  # a nested repository's own files are not the workspace's
    (a / "ünï.txt").write_text("é\n")
    (b / "ünï.txt").write_text("è\n")
    (b / "bin.dat").write_bytes(bytes(range(256)) * 4)
    (a / "run.sh").write_text("#!/bin/sh\n")
    (b / "run.sh").write_text("#!/bin/sh\n")
    (b / "run.sh").chmod(0o755)
    copy, patch = patched(a, b)
    expected = tree(b)
    assert tree(copy) == expected
    assert b'"b/new\\nline.txt"' in patch and b"sub/.git" not in patch


def test_a_file_too_large_is_left_out_with_a_comment_and_the_budget_holds(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "huge.bin").write_bytes(b"\1" * (FILE_LIMIT + 1))
    (b / "small.txt").write_text("ok\n")
    copy, patch = patched(a, b)
    assert patch.startswith(b"# huge.bin: larger than 1024 KiB; left out of this patch\n")
    assert sorted(tree(copy)) == ["small.txt"]
    sink = tmp_path / "tight.patch"
    with sink.open("wb") as handle:
        written = write_patch(snapshot_tree(a), snapshot_tree(b), a, b, handle, 80)
    assert written == sink.stat().st_size <= 80
