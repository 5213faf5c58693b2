"""Safe extraction of untrusted tar streams, workspace snapshots and their difference.

The malicious archives here are crafted by hand: a real engine never emits ``../`` or absolute member
names, but a compromised one (or a future code path) could, so the extractor must not trust it.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from pvisor_host.files.archive import Budget, extract_tar, strip_first, tar_stream
from pvisor_host.files.trees import Entry, copy_tree, diff_trees


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    return info, data


def _special(name: str, kind: bytes, **fields: object) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in fields.items():
        setattr(info, key, value)
    return info, None


def _dir(name: str) -> tuple[tarfile.TarInfo, None]:
    return _special(name, tarfile.DIRTYPE, mode=0o755)


def _extract(data: bytes, dest: Path, limit: int = 10**9, chunk: int = 7):
    chunks = (data[i : i + chunk] for i in range(0, len(data), chunk))  # odd chunk sizes, like the engine's
    return extract_tar(tar_stream(chunks), dest, Budget(limit))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_ordinary_tree_round_trips(tmp_path):
    data = _tar(
        _dir("ws/"),
        _dir("ws/sub/"),
        _file("ws/a.txt", b"hello\n"),
        _file("ws/sub/run.sh", b"#!/bin/sh\n", 0o755),
        _special("ws/link", tarfile.SYMTYPE, linkname="sub/run.sh"),
    )
    report = _extract(data, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "a.txt").read_bytes() == b"hello\n"
    assert os.access(out / "sub/run.sh", os.X_OK)
    assert os.readlink(out / "link") == "sub/run.sh"
    files = {e.path: e for e in report.entries if e.kind == "file"}
    assert files["a.txt"].sha256 == hashlib.sha256(b"hello\n").hexdigest()
    assert files["sub/run.sh"].executable
    assert report.skipped == [] and not report.truncated and report.bytes == 16


def test_malicious_names_write_nothing_outside(tmp_path):
    dest = tmp_path / "run" / "out"
    data = _tar(
        _dir("ws/"),
        _file("ws/../../escape-dotdot.txt", b"x"),
        _file("/abs-escape.txt", b"x"),
        _file("ws//etc/passwd-like", b"x"),  # absolute once the top directory is stripped
        _file("ws/a/../../../escape2.txt", b"x"),
        _special("ws/out-abs", tarfile.SYMTYPE, linkname="/etc/passwd"),
        _special("ws/out-rel", tarfile.SYMTYPE, linkname="../../../../etc"),
        _special("ws/ok-rel", tarfile.SYMTYPE, linkname="sub/../a.txt"),
        _special("ws/dev-null", tarfile.CHRTYPE, devmajor=1, devminor=3),
        _special("ws/disk", tarfile.BLKTYPE, devmajor=8, devminor=0),
        _special("ws/pipe", tarfile.FIFOTYPE),
        _special("ws/hard-out", tarfile.LNKTYPE, linkname="/etc/shadow"),
        _special("ws/hard-dotdot", tarfile.LNKTYPE, linkname="ws/../../x"),
    )
    report = _extract(data, dest)
    everything_under_tmp = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    assert all(p.startswith("run") for p in everything_under_tmp), everything_under_tmp
    assert not (tmp_path / "escape-dotdot.txt").exists() and not Path("/abs-escape.txt").exists()
    reasons = {s.path: s.reason for s in report.skipped}
    assert reasons["ws/../../escape-dotdot.txt"] == "path escapes the collected tree"
    assert reasons["ws/a/../../../escape2.txt"] == "path escapes the collected tree"
    assert reasons["/abs-escape.txt"] == "absolute path"
    assert reasons["ws//etc/passwd-like"] == "path escapes the collected tree"
    assert reasons["out-abs"] == "symlink to an absolute path (/etc/passwd)"
    assert reasons["out-rel"] == "symlink points outside the collected tree (../../../../etc)"
    assert reasons["dev-null"] == "device file" and reasons["disk"] == "device file"
    assert reasons["pipe"] == "FIFO"
    assert reasons["hard-out"] == "hard link to a file outside the collected tree"
    assert reasons["hard-dotdot"] == "hard link to a file outside the collected tree"
    assert _tree(dest) == {"ok-rel"}
    assert os.readlink(dest / "ok-rel") == "sub/../a.txt"


def test_a_symlinked_directory_cannot_redirect_later_members(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "out"
    data = _tar(
        _special("ws/inner", tarfile.SYMTYPE, linkname="."),  # allowed: points inside
        _dir("ws/d/"),
        _special("ws/d2", tarfile.SYMTYPE, linkname="d"),
        _file("ws/d2/through-link.txt", b"x"),  # must not be written through the link
        _file("ws/inner/again.txt", b"x"),
    )
    report = _extract(data, dest)
    assert not (dest / "d" / "through-link.txt").exists()
    assert {s.path for s in report.skipped} == {"d2/through-link.txt", "inner/again.txt"}
    assert all(s.reason == "a parent directory is a symlink or a file" for s in report.skipped)
    assert list(outside.iterdir()) == []


def test_a_later_member_replaces_a_symlink_instead_of_following_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    dest = tmp_path / "out"
    dest.mkdir()
    os.symlink(victim, dest / "f.txt")  # as if an earlier extraction had left it
    _extract(_tar(_file("ws/f.txt", b"new")), dest)
    assert victim.read_text() == "original"
    assert not (dest / "f.txt").is_symlink() and (dest / "f.txt").read_bytes() == b"new"


def test_setuid_bits_are_dropped(tmp_path):
    _extract(_tar(_file("ws/suid", b"x", 0o4755), _file("ws/sgid", b"y", 0o2644)), tmp_path / "out")
    assert (tmp_path / "out/suid").stat().st_mode & 0o7777 == 0o755
    assert (tmp_path / "out/sgid").stat().st_mode & 0o7777 == 0o644


def test_hard_link_inside_the_tree_is_copied(tmp_path):
    data = _tar(_file("ws/a.txt", b"content"), _special("ws/b.txt", tarfile.LNKTYPE, linkname="ws/a.txt"))
    report = _extract(data, tmp_path / "out")
    assert (tmp_path / "out/b.txt").read_bytes() == b"content"
    assert (tmp_path / "out/a.txt").stat().st_ino != (tmp_path / "out/b.txt").stat().st_ino
    assert [e.path for e in report.entries] == ["a.txt", "b.txt"]


def test_size_cap_truncates_and_says_so(tmp_path):
    data = _tar(
        _file("ws/a.bin", b"a" * 600),
        _file("ws/b.bin", b"b" * 600),
        _file("ws/c.bin", b"c" * 10),
        _file("ws/d.bin", b"d" * 500),
    )
    budget = Budget(1000)
    report = extract_tar(tar_stream([data]), tmp_path / "out", budget)
    assert report.truncated and budget.exhausted
    assert _tree(tmp_path / "out") == {"a.bin", "c.bin"}  # what still fits is collected
    assert [(s.path, s.reason) for s in report.skipped] == [
        ("b.bin", "size cap reached (600 bytes would exceed the collect limit)"),
        ("d.bin", "size cap reached (500 bytes would exceed the collect limit)"),
    ]
    assert report.bytes == 610
    # The budget is shared: the next tree of the same run collects nothing more.
    second = extract_tar(tar_stream([_tar(_file("ws/e.bin", b"e" * 391))]), tmp_path / "out2", budget)
    assert second.truncated and _tree(tmp_path / "out2") == set()


def test_entry_cap(tmp_path):
    data = _tar(*(_file(f"ws/f{i}", b"") for i in range(5)))
    report = extract_tar(tar_stream([data]), tmp_path / "out", Budget(10**6, max_entries=3))
    assert report.truncated and len(report.entries) == 3


def test_not_a_tar(tmp_path):
    report = extract_tar(tar_stream([b"this is not a tar archive" * 40]), tmp_path / "out", Budget(100))
    assert report.entries == [] and report.skipped[0].reason == "not a tar archive"


def test_strip_first():
    assert strip_first("ws/a/b") == "a/b"
    assert strip_first("ws/") is None and strip_first("ws") is None


def test_copy_tree_snapshot_and_ownership(tmp_path):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "x.py").write_text("print(1)\n")
    (source / "run.sh").write_text("#!/bin/sh\n")
    (source / "run.sh").chmod(0o755)
    os.symlink("sub/x.py", source / "link")
    os.mkfifo(source / "fifo")
    entries = copy_tree(source, tmp_path / "dst", uid=os.getuid(), gid=os.getgid())
    kinds = {e.path: e.kind for e in entries}
    assert kinds == {"link": "symlink", "run.sh": "file", "sub": "dir", "sub/x.py": "file"}
    assert os.readlink(tmp_path / "dst/link") == "sub/x.py"
    assert not (tmp_path / "dst/fifo").exists()
    assert (tmp_path / "dst/sub/x.py").read_text() == "print(1)\n"


def test_diff_trees():
    def f(path: str, digest: str, executable: bool = False) -> Entry:
        return Entry(path=path, kind="file", sha256=digest, size=1, executable=executable)

    before = [f("same", "1"), f("edited", "2"), f("gone", "3"), f("chmod", "4"), Entry(path="d", kind="dir")]
    after = [
        f("same", "1"),
        f("edited", "9"),
        f("chmod", "4", True),
        f("new", "5"),
        Entry(path="d", kind="dir"),
        Entry(path="e", kind="dir"),
        Entry(path="l", kind="symlink", target="same"),
    ]
    changes = diff_trees(before, after)
    assert changes.added == ["e/", "l", "new"]
    assert changes.changed == ["chmod", "edited"]
    assert changes.removed == ["gone"]
    assert changes.complete
    partial = diff_trees(before, after, complete=False)
    assert partial.removed == [] and not partial.complete


@pytest.mark.parametrize("chunk", [1, 512, 1 << 20])
def test_chunking_does_not_matter(tmp_path, chunk):
    data = _tar(_file("ws/a.txt", os.urandom(5000)))
    _extract(data, tmp_path / "out", chunk=chunk)
    assert (tmp_path / "out/a.txt").stat().st_size == 5000


def test_a_hostile_directory_is_harvested_with_the_archive_rules(tmp_path):
    """What a sandbox leaves in its bind mount, read on the host after it stopped: the same verdicts as for
    an archive (links out, specials, the byte budget), nothing followed, nothing written outside."""
    import socket

    from pvisor_host.files.archive import harvest_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host file")
    root = tmp_path / "sandbox"
    (root / "data").mkdir(parents=True)
    (root / "data" / "ok.txt").write_text("fine\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o4755)
    os.symlink("/etc/passwd", root / "abs-link")
    os.symlink("../outside", root / "rel-escape")
    os.symlink("data/ok.txt", root / "good-link")
    os.symlink(str(outside), root / "dir-link")  # a symlinked directory is a member, never descended into
    os.mkfifo(root / "pipe")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(root / "sock"))
    (root / "big.bin").write_bytes(b"x" * 5000)
    dest = tmp_path / "run" / "workspace"
    report = harvest_tree(root, dest, Budget(1000))
    listener.close()
    reasons = {s.path: s.reason for s in report.skipped}
    assert reasons == {
        "abs-link": "symlink to an absolute path (/etc/passwd)",
        "rel-escape": "symlink points outside the collected tree (../outside)",
        "dir-link": f"symlink to an absolute path ({outside})",
        "pipe": "FIFO",
        "sock": "unsupported member type b's'",
        "big.bin": "size cap reached (5000 bytes would exceed the collect limit)",
    }
    assert report.truncated
    assert _tree(dest) == {"data", "data/ok.txt", "good-link", "run.sh"}
    assert (dest / "good-link").read_text() == "fine\n" and os.readlink(dest / "good-link") == "data/ok.txt"
    assert (dest / "run.sh").stat().st_mode & 0o7777 == 0o755  # set-uid dropped
    files = {e.path: e for e in report.entries if e.kind == "file"}
    assert files["data/ok.txt"].sha256 == hashlib.sha256(b"fine\n").hexdigest()
    everything = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    assert all(p.startswith(("run", "sandbox", "outside")) for p in everything)
    assert (outside / "secret").read_text() == "host file" and list(outside.iterdir()) == [outside / "secret"]


def test_logs_are_cut_at_the_cap_and_the_end_of_stdout_is_read_all_the_same(tmp_path):
    from pvisor_host.backend.docker.sandbox.collect import collect_logs

    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "stdout.log").write_bytes(b"x" * 5000 + b'\n{"result": 1}\n')
    (staged / "stderr.log").write_bytes(b"warn\n")
    truncated, tail = collect_logs(staged, tmp_path / "logs", limit=1000)
    assert truncated is True
    assert (tmp_path / "logs" / "stdout.log").read_bytes() == b"x" * 1000
    assert (tmp_path / "logs" / "stderr.log").read_bytes() == b"warn\n"
    assert tail.endswith(b'\n{"result": 1}\n') and len(tail) == 5015
    assert collect_logs(staged, tmp_path / "again", limit=6000) == (False, tail)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "missing"])
def test_a_log_that_is_not_a_regular_file_reads_as_empty(tmp_path, kind):
    from pvisor_host.backend.docker.sandbox.collect import collect_logs

    staged = tmp_path / "staged"
    staged.mkdir()
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"not the sandbox's")
    if kind == "symlink":
        (staged / "stdout.log").symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(staged / "stdout.log")  # opened without O_NONBLOCK, this would hang the collection
    (staged / "stderr.log").write_bytes(b"e")
    assert collect_logs(staged, tmp_path / "logs") == (False, b"")
    assert (tmp_path / "logs" / "stdout.log").read_bytes() == b""
    assert (tmp_path / "logs" / "stderr.log").read_bytes() == b"e"
