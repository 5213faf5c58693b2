import json

import pytest

from pvisor_host.errors import UsageError
from pvisor_host.models import profiles
from pvisor_host.preflight.checks import check_agent, detect_agent
from pvisor_host.preflight.trajectory import MAX_TRAJECTORY_BYTES, read_trajectory

from trajgen import (
    claude_files_session,
    codex_files_session,
    mini_files_session,
    pi_files_session,
    write_json,
    write_jsonl,
)


def test_a_good_file_is_hashed(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", claude_files_session())
    info = read_trajectory(path)
    import hashlib

    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info.size == path.stat().st_size
    assert info.path.is_absolute()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: p.write_bytes(b'{"a":1}\n\x00\x01\x02'), "is binary (NUL byte at offset 8)"),
        (lambda p: p.write_bytes(b'{"a":"\xff\xfe"}\n'), "is not UTF-8 text (invalid byte near offset 6)"),
    ],
)
def test_bad_files_say_what_is_wrong(tmp_path, setup, message):
    path = tmp_path / "t.jsonl"
    setup(path)
    with pytest.raises(UsageError) as caught:
        read_trajectory(path)
    assert caught.value.one_line().startswith(f"trajectory {path}: {message}")


def test_oversize_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.jsonl"
    with path.open("wb") as handle:  # sparse: costs no disk
        handle.truncate(MAX_TRAJECTORY_BYTES + 1)
    with pytest.raises(UsageError, match="is 256 MiB; pvisor accepts at most 256 MiB"):
        read_trajectory(path)


def test_unreadable_file(tmp_path, monkeypatch):
    """A file the caller may not read (simulated: the suite runs as root, which reads everything)."""
    import pathlib

    path = write_jsonl(tmp_path / "s.jsonl", claude_files_session())
    real_open = pathlib.Path.open

    def denied(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", denied)
    with pytest.raises(UsageError) as caught:
        read_trajectory(path)
    assert caught.value.one_line() == f"trajectory {path}: is not readable (permission denied)"


def test_sniff_recognises_each_format(tmp_path):
    shipped = profiles.all_profiles()
    cases = {
        "claude-code": write_jsonl(tmp_path / "c.jsonl", claude_files_session()),
        "codex": write_jsonl(tmp_path / "x.jsonl", codex_files_session()),
        "pi-agent": write_jsonl(tmp_path / "p.jsonl", pi_files_session()),
        "mini-swe-agent": write_json(tmp_path / "m.json", mini_files_session()),
    }
    opencode = tmp_path / "o.jsonl"
    opencode.write_text(json.dumps({"type": "step_start", "sessionID": "s"}) + "\n")
    cases["opencode"] = opencode
    assert set(cases) == set(shipped) - {"openhands", "swe-agent"}
    for agent, path in cases.items():
        assert read_trajectory(path).agents == {agent}, agent
        assert detect_agent(read_trajectory(path)) == agent
    unrelated = tmp_path / "u.jsonl"
    unrelated.write_text('{"hello": "world"}\n')
    assert read_trajectory(unrelated).agents == set()
    with pytest.raises(UsageError, match="is no trajectory format pvisor replays"):
        detect_agent(read_trajectory(unrelated))


def test_wrong_agent_for_the_trajectory(tmp_path):
    shipped = profiles.all_profiles()
    codex = read_trajectory(write_jsonl(tmp_path / "x.jsonl", codex_files_session()))
    with pytest.raises(UsageError) as caught:
        check_agent(codex, shipped["claude-code"])
    assert "looks like a codex trajectory, not claude-code" in caught.value.one_line()
    assert caught.value.hint == "pass --agent codex"
    check_agent(codex, shipped["codex"])  # the right agent passes


def test_recorded_workspace(tmp_path):
    claude = read_trajectory(write_jsonl(tmp_path / "c.jsonl", claude_files_session("/srv/task")))
    assert claude.cwd["claude-code"] == "/srv/task"
    assert read_trajectory(write_jsonl(tmp_path / "x.jsonl", codex_files_session("/app"))).cwd["codex"] == "/app"
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"type":"user"}\n')
    assert "claude-code" not in read_trajectory(plain).cwd


def test_a_file_is_read_once_per_version(tmp_path, monkeypatch):
    """Every check asks the same value: the file is opened once however many items name it, and again only when
    it changed."""
    import pathlib

    path = write_jsonl(tmp_path / "s.jsonl", claude_files_session())
    opened = []
    real_open = pathlib.Path.open

    def counting(self, mode="r", *args, **kwargs):
        if self == path and "r" in mode:
            opened.append(self)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", counting)
    first = read_trajectory(path)
    assert read_trajectory(path) is first
    assert len(opened) == 1
    write_jsonl(path, claude_files_session("/elsewhere"))
    assert read_trajectory(path).cwd["claude-code"] == "/elsewhere"
    assert len(opened) == 2


def test_a_document_over_several_lines_is_read_as_one(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(mini_files_session(), indent=2))
    found = read_trajectory(path)
    assert found.agents == {"mini-swe-agent"}
    assert found.bounds["mini-swe-agent"] >= 1
