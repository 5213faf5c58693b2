"""Every command turns an engine failure into exit 6 and one line naming what it was doing — never an
"internal error" or a traceback. The CLI runs for real, with the real docker SDK, against a stand-in engine
that answers the ping and then fails every call (a 500, or a dropped connection)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from pvisor_host.errors import ExitCode

from conftest import invoke_cli, run_cli
from fakeengine import FakeEngine, dropping, failing
from trajgen import claude_files_session, write_jsonl

BASE = "debian:bookworm-slim"


@pytest.fixture
def trajectory(tmp_path) -> Path:
    return write_jsonl(tmp_path / "t.jsonl", claude_files_session())


def commands(tmp_path: Path, trajectory: Path) -> dict[str, tuple[list[str | Path], str]]:
    """Each command, and how its one line starts (after ``pvisor-host: error: ``), up to the engine's words."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "one", "trajectory": str(trajectory), "after_step": 1}) + "\n")
    inspect_base = f"inspect image {BASE}"
    replay = ["replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1"]
    batch = ["batch", manifest, "--agent", "claude-code", "--mode", "replay-only"]
    failed = "Docker engine failed to "
    return {
        "build": (["build", "--agent", "claude-code"], failed + inspect_base),
        "replay": ([*replay, "--mode", "replay-only", "--out", tmp_path / "run"],
                   failed + "read the engine's runtimes"),
        "batch": ([*batch, "--out", tmp_path / "b"],
                  f"every failed item failed on the infrastructure; first one: {failed}{inspect_base}"),
        "batch --plan": ([*batch, "--plan", "--out", tmp_path / "p"], f"one: {failed}{inspect_base}"),
        "gc": (["gc"], failed + "list pvisor-host's containers, networks and volumes"),
        "images": (["images"], failed + "list images and volumes"),
        "images prune": (["images", "prune", "--dry-run"], failed + "list images and volumes"),
        "doctor": (["doctor"], failed + "read the engine's information"),
        "agents": (["agents"], failed + inspect_base),
    }  # fmt: skip


@pytest.mark.parametrize(("answer", "words"), [(failing, "injected failure"), (dropping, "")], ids=["500", "drop"])
@pytest.mark.parametrize(
    "command", ["build", "replay", "batch", "batch --plan", "gc", "images", "images prune", "doctor", "agents"]
)
def test_an_engine_failure_is_exit_6_and_one_line_naming_the_action(
    tmp_path, trajectory, command, answer, words, monkeypatch
):
    """In this process, the retries' backoff skipped: tenacity sleeps with ``time.sleep``, patched for the whole
    process (the fake engine waits with ``select``; nothing these commands do sleeps towards a deadline)."""
    import tenacity

    monkeypatch.setattr(tenacity.nap.time, "sleep", lambda seconds: None)
    args, start = commands(tmp_path, trajectory)[command]
    with FakeEngine(answer) as engine:
        result = invoke_cli(*args, env=engine.env, cwd=tmp_path)
    assert result.code == ExitCode.INFRASTRUCTURE, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    errors = [line for line in result.error_lines if line.startswith("pvisor-host: error: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"pvisor-host: error: {start}: "), errors[0]
    assert words in errors[0].removeprefix(f"pvisor-host: error: {start}: "), errors[0]
    assert len(engine.requests) > 2  # it got past the ping: the failure came from a real call


def test_a_digest_base_is_pulled_as_docker_parses_it(tmp_path):
    """``--base name@sha256:<digest>``: docker-py's parser sends repository ``debian`` and the digest as the tag
    (a hand-rolled split once sent repository ``debian@sha256``). The unreachable registry is retried, then
    named in one line."""
    digest = "sha256:" + "ab" * 32
    lookup = "Get https://registry-1.docker.io/v2/: dial tcp: lookup registry-1.docker.io: no such host"
    unreachable = {"message": lookup}

    def answer(method: str, path: str) -> tuple[int, dict[str, str]]:
        if method == "POST" and "/images/create" in path:
            return 500, unreachable
        return 404, {"message": "No such image"}

    with FakeEngine(answer) as engine:
        result = run_cli("build", "--agent", "claude-code", "--base", f"debian@{digest}", env=engine.env)
    assert result.code == ExitCode.PREREQUISITE, result.stderr
    assert [line for line in result.error_lines if "error:" in line] == [
        f"pvisor-host: error: base image debian@{digest} is not present and no registry is reachable "
        f"({lookup}) "
        "(docker load it, or omit --base to bootstrap a Debian base)"
    ]
    pulls = [path for method, path in engine.requests if method == "POST" and "/images/create" in path]
    assert len(pulls) == 4  # the one retry policy for idempotent engine calls: 4 attempts
    queries = [parse_qs(urlsplit(path).query) for path in pulls]
    assert all(query == {"fromImage": ["debian"], "tag": [digest]} for query in queries), pulls


def test_an_engine_that_takes_a_ping_and_never_answers_hangs_and_one_that_is_away_does_not(monkeypatch):
    """After an attempt's engine error the batch asks whether the engine hangs (it then ends with what it has)
    or is away (a restart: the retries wait for it)."""
    from pvisor_host.backend.docker import backend as docker_backend
    from pvisor_host.models.ownership import Ownership

    monkeypatch.setattr(docker_backend, "PING_TIMEOUT", 0.3)
    with FakeEngine() as engine:
        backend = docker_backend.DockerBackend.connect(Ownership.current(), docker_host=engine.env["DOCKER_HOST"])
        assert backend.hangs() is False  # it answers
        engine.silent.set()
        assert backend.hangs() is True
    assert backend.hangs() is False  # its socket is gone: away, not stuck
